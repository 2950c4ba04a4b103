//! Compiles our own wire-compatible protos with protox, so no `protoc` install is needed.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = ["proto/filer.proto", "proto/csi.proto"];
    for p in protos {
        println!("cargo:rerun-if-changed={p}");
    }
    let fds = protox::compile(protos, ["proto"])?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(fds)?;
    Ok(())
}
