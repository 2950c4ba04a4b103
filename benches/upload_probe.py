#!/usr/bin/env python3
"""What a volume server alone takes for a chunk: raw uploads of 1 MiB, and of its two
halves in parallel, with and without `Content-MD5` (computed before the clock starts).

    python3 benches/upload_probe.py --master 127.0.0.1:9333 [--rounds 80]

Against a running `weed server` (e.g. the one `benches/bench.py` or `deploy/demo.sh`
starts). Prints p50 latencies; see docs/BENCHMARKS.md, session 29.
"""
import argparse
import base64
import hashlib
import http.client
import json
import os
import queue
import statistics
import threading
import time


def md5_b64(data):
    return base64.b64encode(hashlib.md5(data).digest()).decode()


class Uploader(threading.Thread):
    """One persistent connection to the volume server, fed through a queue."""

    def __init__(self, url):
        super().__init__(daemon=True)
        host, port = url.rsplit(":", 1)
        self.conn = http.client.HTTPConnection(host, int(port))
        self.todo = queue.Queue()
        self.done = queue.Queue()
        self.start()

    def run(self):
        while True:
            fid, data, md5 = self.todo.get()
            headers = {"Content-Type": "application/octet-stream"}
            if md5:
                headers["Content-MD5"] = md5
            self.conn.request("POST", "/" + fid, body=data, headers=headers)
            resp = self.conn.getresponse()
            body = resp.read()
            self.done.put(resp.status if resp.status in (200, 201, 204) else body)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--master", required=True, help="host:port of the master")
    ap.add_argument("--rounds", type=int, default=80)
    a = ap.parse_args()
    host, port = a.master.rsplit(":", 1)
    master = http.client.HTTPConnection(host, int(port))

    def assign():
        master.request("GET", "/dir/assign")
        r = json.loads(master.getresponse().read())
        return r["fid"], r["url"]

    data = os.urandom(1 << 20)
    halves = [data[: 1 << 19], data[1 << 19 :]]
    _, url = assign()
    one, two = Uploader(url), Uploader(url)

    def wait(u):
        r = u.done.get()
        if not isinstance(r, int):
            raise SystemExit(f"upload failed: {r[:200]!r}")

    for with_md5 in (True, False):
        sums = [md5_b64(d) if with_md5 else None for d in (data, *halves)]
        whole, split = [], []
        for _ in range(a.rounds):
            f1, f2, f3 = assign()[0], assign()[0], assign()[0]
            t = time.perf_counter()
            one.todo.put((f1, data, sums[0]))
            wait(one)
            whole.append(time.perf_counter() - t)
            t = time.perf_counter()
            one.todo.put((f2, halves[0], sums[1]))
            two.todo.put((f3, halves[1], sums[2]))
            wait(one)
            wait(two)
            split.append(time.perf_counter() - t)
        print(
            f"Content-MD5 {'yes' if with_md5 else 'no '}: 1 MiB p50 "
            f"{statistics.median(whole) * 1000:.2f} ms; two 512 KiB halves in parallel p50 "
            f"{statistics.median(split) * 1000:.2f} ms"
        )


if __name__ == "__main__":
    main()
