#!/usr/bin/env bash
# Runs the pjdfstest POSIX suite (crates.io pjdfstest 0.2.2) against our FUSE mount of a
# throwaway `weed` cluster on loopback. Fails if any pjdfstest case fails on our mount.
#
#   tests/pjdfstest.sh            # our mount only
#   tests/pjdfstest.sh --compare  # also tmpfs and `weed mount`, for docs/SEMANTICS.md
#
# Needs root, /dev/fuse, `weed` on PATH (or WEED_BIN), cargo. Installs pjdfstest into
# target/pjdfstest and creates the unprivileged user `tests` if it is missing (pjdfstest switches
# to `nobody` and `tests`). Everything started here is stopped by pid and unmounted on exit.
set -euo pipefail

here="$(cd "$(dirname "$0")/.." && pwd)"
cd "$here"
compare=0
[[ "${1:-}" == "--compare" ]] && compare=1

weed="${WEED_BIN:-weed}"
pjd_root="$here/target/pjdfstest"
pjd="$pjd_root/bin/pjdfstest"
conf="$here/tests/pjdfstest.toml"

if [[ $(id -u) -ne 0 ]]; then
  echo "pjdfstest.sh: must run as root (mounts, user switching)" >&2
  exit 2
fi

# ---- tools and users ----
if [[ ! -x "$pjd" ]] || ! "$pjd" --version 2>/dev/null | grep -q "0.2.2"; then
  echo "== installing pjdfstest 0.2.2 into $pjd_root"
  cargo install pjdfstest --version 0.2.2 --locked --root "$pjd_root"
fi
if ! getent passwd nobody >/dev/null; then
  echo "pjdfstest.sh: user nobody is missing" >&2
  exit 2
fi
if ! getent passwd tests >/dev/null; then
  echo "== creating user tests"
  useradd --system --user-group --no-create-home --home-dir / --shell /usr/sbin/nologin tests
fi
# SEAWEEDFS_CSI_BIN: a driver binary already built (scripts/test.sh passes the one its cargo
# test built, so that a build without its features does not recompile the crate).
bin="${SEAWEEDFS_CSI_BIN:-$here/target/debug/seaweedfs-csi-driver}"
[ -n "${SEAWEEDFS_CSI_BIN:-}" ] || cargo build --quiet --bin seaweedfs-csi-driver

# ---- scratch space; cleanup of everything we start ----
work="$(mktemp -d /tmp/pjdfstest.XXXXXX)"
chmod 0755 "$work"
pids=()
mounts=()
cleanup() {
  set +e
  # newest first: mounts before the filer they flush to, the filer before the servers
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
    p=${pids[$i]}
    kill -TERM "$p" 2>/dev/null || continue
    for _ in $(seq 1 100); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$p" 2>/dev/null
    wait "$p" 2>/dev/null
  done
  # a dead FUSE mount fails `mountpoint`, so look in the mount table
  for m in "${mounts[@]}"; do
    grep -q " $m " /proc/self/mounts && umount -l "$m"
  done
  rm -rf "$work"
}
trap cleanup EXIT

# a free port whose +10000 neighbour is free too (SeaweedFS's gRPC convention)
free_port() {
  python3 - <<'EOF'
import socket
for _ in range(200):
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]
    if p < 55000:
        t = socket.socket()
        try:
            t.bind(("127.0.0.1", p + 10000)); print(p); break
        except OSError:
            pass
        finally:
            t.close()
    s.close()
EOF
}

wait_for() { # timeout-seconds command...
  local t=$1; shift
  for _ in $(seq 1 $((t * 10))); do "$@" >/dev/null 2>&1 && return 0; sleep 0.1; done
  return 1
}

mport=$(free_port); vport=$(free_port); fport=$(free_port)
mkdir -p "$work/data" "$work/filer"
echo "== weed server on 127.0.0.1 (master $mport, volume $vport, filer $fport)"
(cd "$work" && exec "$weed" server -dir="$work/data" -ip=127.0.0.1 -ip.bind=127.0.0.1 \
  -master.port="$mport" -volume.port="$vport" -metricsPort="$(free_port)" \
  -master.volumeSizeLimitMB=256 -volume.max=100 -master.peers=none >"$work/server.log" 2>&1) &
pids+=($!)
wait_for 60 curl -sf "http://127.0.0.1:$mport/dir/assign" || { cat "$work/server.log"; exit 1; }
(cd "$work" && exec "$weed" filer -master="127.0.0.1:$mport" -ip=127.0.0.1 -ip.bind=127.0.0.1 \
  -port="$fport" -defaultStoreDir="$work/filer" >"$work/filer.log" 2>&1) &
pids+=($!)
wait_for 60 curl -sf "http://127.0.0.1:$fport/" || { cat "$work/filer.log"; exit 1; }
wait_for 20 bash -c "exec 3<>/dev/tcp/127.0.0.1/$((fport + 10000))"

# secondary file system for the EXDEV cases
mkdir -p "$work/second"
mount -t tmpfs -o size=64m tmpfs "$work/second"
mounts+=("$work/second")

run_suite() { # label dir -> prints the summary line, returns pjdfstest's status
  local label=$1 dir=$2
  echo "== pjdfstest on $label ($dir)"
  local st=0
  (cd "$dir" && "$pjd" -c "$conf" -p "$dir" -s "$work/second") >"$work/$label.out" 2>&1 || st=$?
  grep -E "FAILED$" "$work/$label.out" | sed "s/^/   $label: /" || true
  local summary
  summary=$(grep -E "^Summary:" "$work/$label.out" || echo "Summary: (no summary; see output)")
  echo "$label: $summary"
  if [[ "$summary" == *"no summary"* ]]; then tail -30 "$work/$label.out"; fi
  return $st
}

mount_ours() { # dir filer-path
  mkdir -p "$1"
  RUST_LOG=warn "$bin" mount --filer="127.0.0.1:$fport" --filer.path="$2" --dir="$1" \
    >"$work/ours.log" 2>&1 &
  pids+=($!)
  mounts+=("$1")
  wait_for 30 mountpoint -q "$1" || { cat "$work/ours.log"; exit 1; }
}

status=0
mount_ours "$work/ours" /pjdfstest-ours
run_suite ours "$work/ours" || status=$?

if [[ $compare -eq 1 ]]; then
  mkdir -p "$work/tmpfs"
  mount -t tmpfs tmpfs "$work/tmpfs"
  mounts+=("$work/tmpfs")
  chmod 0755 "$work/tmpfs"
  run_suite tmpfs "$work/tmpfs" || true

  mkdir -p "$work/weed" "$work/weedcache"
  (cd "$work" && exec "$weed" mount -filer="127.0.0.1:$fport" -filer.path=/pjdfstest-weed \
    -dir="$work/weed" -cacheDir="$work/weedcache" -localSocket="$work/weed-mount.sock" \
    >"$work/weedmount.log" 2>&1) &
  pids+=($!)
  mounts+=("$work/weed")
  wait_for 30 mountpoint -q "$work/weed" || { cat "$work/weedmount.log"; exit 1; }
  run_suite weed-mount "$work/weed" || true
fi

if [[ $status -ne 0 ]]; then
  echo "pjdfstest: FAILURES on our mount (full output was in $work/ours.out):"
  grep -B2 -A6 "FAILED$" "$work/ours.out" | head -200
fi
exit $status
