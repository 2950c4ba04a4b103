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
cargo clippy --all-targets -- -D warnings
mkdir -p target
# Integration tests start their own weed servers; keep parallelism modest on small machines.
RUST_TEST_THREADS=${RUST_TEST_THREADS:-2} cargo test --all-targets --no-fail-fast 2>&1 | tee target/test.log
# POSIX conformance of our mount (pjdfstest 0.2.2 with the Linux features enabled).
tests/pjdfstest.sh
# fsx (mmap on) and fsstress from xfstests on our mount; skipped without ../shared/thirdparty.
scripts/xfstests.sh --quick
