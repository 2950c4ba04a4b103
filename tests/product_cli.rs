//! The shipped binary has product commands only: the test seams (`memfs`, `--fakeStager`) exist
//! only in `seaweedfs-csi-test-support` (`--features test-support`). Also checked on the static
//! release binary in tests/packaging_image.rs.

use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_seaweedfs-csi-driver");

fn run(args: &[&str]) -> (bool, String) {
    let out = Command::new(BIN).args(args).output().unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

#[test]
fn help_lists_no_test_seams() {
    let (ok, help) = run(&["--help"]);
    assert!(ok, "{help}");
    assert!(help.contains("mount") && help.contains("keeper"), "{help}");
    for seam in ["memfs", "fakeStager", "fake"] {
        assert!(
            !help.to_lowercase().contains(&seam.to_lowercase()),
            "{seam} in:\n{help}"
        );
    }
}

#[test]
fn test_seams_are_rejected() {
    let (ok, out) = run(&["memfs", "--dir=/nonexistent"]);
    assert!(!ok, "memfs ran: {out}");
    // a driver flag the shipped binary does not know is an error, not silently ignored
    let (ok, out) = run(&["--fakeStager=/tmp/x", "--components=controller"]);
    assert!(!ok, "--fakeStager accepted: {out}");
    assert!(out.contains("fakeStager"), "{out}");
}
