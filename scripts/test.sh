#!/usr/bin/env bash
# The project's test command: formatting, lints, unit and integration tests (real weed, real
# FUSE mounts; needs root and /dev/fuse).
set -euo pipefail
cd "$(dirname "$0")/.."
# The Python tools .ci/run installed (weed, kubernetes-validate, helm-python-sdk) are in this
# virtual environment: its python3 and weed come first on PATH for the tests.
. scripts/venv.sh
venv_activate
cargo fmt --check
# Lints for the shipped build and for the test-support build (the test seams: memfs,
# --fakeStager, in the seaweedfs-csi-test-support binary).
cargo clippy --all-targets -- -D warnings
cargo clippy --all-targets --features test-support -- -D warnings
# Dependency policy (deny.toml): licenses, crates.io only, banned crates, duplicate versions
# (warnings), and RustSec advisories where the advisory database (a GitHub repository) can be
# fetched. Without network access to it, advisories are NOT checked.
if command -v cargo-deny >/dev/null 2>&1; then
  if timeout 120 cargo deny fetch db >/dev/null 2>&1; then
    cargo deny check
  else
    echo "test.sh: the RustSec advisory database cannot be fetched here: cargo deny checks bans, licenses and sources only; advisories are checked only where the database is reachable" >&2
    cargo deny check bans licenses sources
  fi
else
  echo "test.sh: cargo-deny is not installed (.ci/run installs it): dependency policy not checked" >&2
fi
mkdir -p target
# Integration tests start their own weed servers; keep parallelism modest on small machines.
# --all-targets also builds the criterion benches (benches/*.rs) and runs each once, so they
# do not rot; `cargo bench` measures. test-support builds the test seams the takeover and
# fake-stager tests need; the shipped binary's own tests (tests/product_cli.rs) check that it
# has none of them.
RUST_TEST_THREADS=${RUST_TEST_THREADS:-2} cargo test --all-targets --features test-support --no-fail-fast 2>&1 | tee target/test.log
# The shipped binary (product commands only) that cargo test just built, for the scripts below.
export SEAWEEDFS_CSI_BIN="${SEAWEEDFS_CSI_BIN:-$(realpath "${CARGO_TARGET_DIR:-target}")/debug/seaweedfs-csi-driver}"
# POSIX conformance of our mount (pjdfstest 0.2.2 with the Linux features enabled).
tests/pjdfstest.sh
# fsx (mmap on) and fsstress from xfstests on our mount; skipped without ../shared/thirdparty.
scripts/xfstests.sh --quick
