//! deploy/: the kustomize base, the examples and the Helm chart render and validate offline
//! against the Kubernetes JSON schemas, and agree with the binary about its flags.
//!
//! The work is done by tests/deploy/check_manifests.py (the validators are Python packages);
//! this test hands it the flags the real binary accepts, read from its `--help`.
//! Needs: kubectl (for `kubectl kustomize`), and kubernetes-validate + helm-python-sdk, which
//! .ci/run installs into the virtual environment of scripts/venv.sh (used when it exists,
//! else `python3` on PATH).

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_seaweedfs-csi-driver");

/// `--flag` names in a clap help text.
fn flags_in_help(args: &[&str]) -> BTreeSet<String> {
    let out = Command::new(BIN)
        .args(args)
        .arg("--help")
        .output()
        .expect("run the binary");
    assert!(
        out.status.success(),
        "{args:?} --help failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let mut flags = BTreeSet::new();
    for word in text.split(|c: char| c.is_whitespace() || c == ',' || c == '=' || c == '[') {
        if let Some(rest) = word.strip_prefix("--") {
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '.' || *c == '-')
                .collect();
            if !name.is_empty() {
                flags.insert(format!("--{name}"));
            }
        }
    }
    flags
}

#[test]
fn flags_in_help_parses_clap_output() {
    let f = flags_in_help(&["mount"]);
    for want in [
        "--filer",
        "--filer.path",
        "--dir",
        "--cacheCapacityMB",
        "--map.uid",
    ] {
        assert!(f.contains(want), "{want} missing from {f:?}");
    }
}

/// The venv's python3 (scripts/venv.sh: $SEAWEEDFS_CSI_VENV or /opt/seaweedfs-csi-venv) if
/// it exists, else `python3` from PATH.
fn python3() -> std::path::PathBuf {
    let venv = std::env::var_os("SEAWEEDFS_CSI_VENV")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| "/opt/seaweedfs-csi-venv".into());
    let p = venv.join("bin/python3");
    if p.exists() {
        p
    } else {
        "python3".into()
    }
}

fn run_checker(flags_json: Option<&Path>) -> String {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/deploy/check_manifests.py");
    let mut cmd = Command::new(python3());
    cmd.arg(&script);
    if let Some(f) = flags_json {
        cmd.arg("--flags-json").arg(f);
    }
    let out = cmd.output().expect("python3");
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}");
    assert!(
        out.status.success(),
        "manifest check failed (needs kubectl, and kubernetes-validate and helm-python-sdk \
         as .ci/run installs them):\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains("0 problems"), "{stdout}");
    // It really rendered the chart and the base (not an empty run).
    assert!(stdout.contains("helm full values: 16 objects"), "{stdout}");
    assert!(stdout.contains("kustomize base: 15 objects"), "{stdout}");
    assert!(
        stdout.contains("helm values schema: 10 misspelled/invalid value sets rejected"),
        "{stdout}"
    );
    assert!(
        stdout.contains(
            "helm monitoring: PodMonitor/swfs, Service/swfs-controller-metrics, \
             Service/swfs-node-metrics, ServiceMonitor/swfs"
        ),
        "{stdout}"
    );
    // The upgrade-from-the-Go-chart check ran (tests/deploy/go_chart_immutable.json), for Go
    // charts that leave fsGroupPolicy unset (<= 0.2.35) and that set File (PR #313).
    assert!(
        stdout.contains("upgrade from Go chart: 4 cases"),
        "{stdout}"
    );
    assert!(
        stdout.contains(
            "upgrade from Go chart: live CSIDriver fsGroupPolicy File, ReadWriteOnceWithFSType"
        ),
        "{stdout}"
    );
    stdout
}

/// Schemas (Kubernetes 1.26 and the newest bundled), references, handover layout, Helm values,
/// and `helm upgrade` from a release of the Go driver's chart: immutable fields (selectors,
/// StorageClass, roleRefs) equal to the Go chart's, and the CSIDriver check stopping early.
#[test]
fn manifests_render_and_validate() {
    run_checker(None);
}

/// Every flag the manifests pass to our image is one the binary accepts (and the keeper
/// subcommand exists): catches drift between deploy/ and src/cli.rs.
#[test]
fn manifest_flags_are_accepted_by_the_binary() {
    let driver = flags_in_help(&[]);
    let keeper = flags_in_help(&["keeper"]);
    for f in [
        "--endpoint",
        "--filer",
        "--nodeid",
        "--driverName",
        "--components",
    ] {
        assert!(driver.contains(f), "driver mode lacks {f}: {driver:?}");
    }
    assert!(
        keeper.contains("--socket"),
        "keeper lacks --socket: {keeper:?}"
    );
    let dir = tempfile::tempdir().unwrap();
    let flags_json = dir.path().join("flags.json");
    let json = serde_json::json!({ "driver": driver, "keeper": keeper });
    std::fs::write(&flags_json, json.to_string()).unwrap();
    run_checker(Some(&flags_json));
}

/// The image the packaging test imitates is the image the Dockerfile builds: the final stage
/// is `FROM scratch` with the binary from scripts/build-static.sh and an empty /tmp, nothing
/// else, and the entrypoint is that binary.
#[test]
fn dockerfile_final_stage_is_one_static_binary() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(root.join("Dockerfile")).unwrap();
    let lines: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect();
    let last_from = lines
        .iter()
        .rposition(|l| l.starts_with("FROM "))
        .expect("a FROM line");
    assert_eq!(lines[last_from], "FROM scratch");
    let final_stage = &lines[last_from + 1..];
    let copies: Vec<&&str> = final_stage
        .iter()
        .filter(|l| l.starts_with("COPY"))
        .collect();
    assert_eq!(
        copies,
        [
            &"COPY --from=build /out/tmp /tmp",
            &"COPY --from=build /out/seaweedfs-csi-driver /seaweedfs-csi-driver"
        ]
    );
    for l in final_stage {
        assert!(
            l.starts_with("COPY") || l.starts_with("ENTRYPOINT"),
            "unexpected instruction in the final stage: {l}"
        );
    }
    assert!(final_stage.contains(&r#"ENTRYPOINT ["/seaweedfs-csi-driver"]"#));
    assert!(
        text.contains(
            r#"scripts/build-static.sh --arch "${TARGETARCH:-$(uname -m)}" --out /out/seaweedfs-csi-driver"#
        ),
        "the image must be built by the script the packaging test runs, for the platform asked"
    );
    // Multi-platform: the build stage runs natively and cross-compiles (as the aarch64 test in
    // tests/packaging_image.rs does), rather than under an emulated compiler.
    assert!(
        text.contains("FROM --platform=$BUILDPLATFORM rust:"),
        "{text}"
    );
    assert!(text.contains("ARG TARGETARCH"), "{text}");
    assert!(
        text.contains("rustup target add aarch64-unknown-linux-gnu"),
        "{text}"
    );
    let ignore = std::fs::read_to_string(root.join(".dockerignore")).unwrap();
    for needed in [
        "src",
        "proto",
        "build.rs",
        "Cargo.toml",
        "Cargo.lock",
        "scripts/build-static.sh",
    ] {
        assert!(
            !ignore
                .lines()
                .any(|l| l.trim() == needed || l.trim() == format!("{needed}/")),
            ".dockerignore excludes {needed}"
        );
    }
    assert!(ignore.lines().any(|l| l.trim() == "target/"));
}
