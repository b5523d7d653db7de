"""The workload rows' loops, run in a child Python process so a hung mount cannot hang the
benchmark (workloads.py starts them through readers.run_worker with a timeout).

    python3 workload_workers.py files    < {"dir", "threads", "expect"}  -> {"seconds", "list_seconds", ...}
    python3 workload_workers.py http     < {"host", "port", "ca", "bucket", "prefix", "threads", "expect"}
    python3 workload_workers.py mmap     < {"path", "ranges", "expect", "budget_s"} -> {"seconds", "bytes", ...}
    python3 workload_workers.py odirect  < {"path", "size", "block", "count", "warmup", "seed"} -> {"lat_ns"}

`expect` maps a file name to [size, crc32] (files, http) or lists one crc32 per range (mmap):
a wrong byte is reported, never timed. Standard library only: this file runs as a script.
Threads are Python threads: os.read, http.client's socket reads and zlib.crc32 of more than
5 KiB release the interpreter lock, so the threads' reads and page faults overlap in the kernel.
"""

from __future__ import annotations

import http.client
import json
import mmap
import os
import random
import ssl
import sys
import threading
import time
import urllib.parse
import zlib

CHUNK = 1 << 20  # read() size, and the span one crc32 call covers in the mapping


def _run_threads(n: int, target) -> None:
    """n threads running target(i), started together; returns when all have ended. An
    exception in a thread is re-raised here."""
    errors: list = []

    def wrap(i):
        try:
            target(i)
        except BaseException as exc:  # noqa: BLE001 - reported by the parent
            errors.append(f"thread {i}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=wrap, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError("; ".join(errors[:3]))


class _Queue:
    """The names left to read, handed out one at a time to whichever thread asks."""

    def __init__(self, names):
        self._it = iter(names)
        self._lock = threading.Lock()  # guards _it

    def next(self):
        with self._lock:
            return next(self._it, None)


def files_worker(spec: dict) -> dict:
    """List the directory, then read every file whole (os.read of 1 MiB until EOF) by
    `threads` threads, each taking the next name. `seconds` is the listing and the reads."""
    d, expect = spec["dir"], spec["expect"]
    pc = time.perf_counter
    t0 = pc()
    names = os.listdir(d)
    t_list = pc()
    if sorted(names) != sorted(expect):
        missing = sorted(set(expect) - set(names))[:3]
        extra = sorted(set(names) - set(expect))[:3]
        return {"error": f"listing of {d}: {len(names)} names, want {len(expect)}; missing {missing}, extra {extra}"}
    queue = _Queue(sorted(names))
    bad: list = []
    total = [0] * spec["threads"]

    def reader(i):
        while (name := queue.next()) is not None:
            fd = os.open(os.path.join(d, name), os.O_RDONLY)
            crc = n = 0
            try:
                while b := os.read(fd, CHUNK):
                    crc = zlib.crc32(b, crc)
                    n += len(b)
            finally:
                os.close(fd)
            total[i] += n
            if [n, crc] != expect[name]:
                bad.append(f"{name}: {n} bytes crc {crc:08x}, want {expect[name][0]} crc {expect[name][1]:08x}")

    _run_threads(spec["threads"], reader)
    t_end = pc()
    return {"seconds": t_end - t0, "list_seconds": t_list - t0, "files": len(names), "bytes": sum(total),
            "bad": len(bad), "first_bad": bad[:3]}


def _connection(spec: dict) -> http.client.HTTPConnection:
    if spec.get("ca"):
        ctx = ssl.create_default_context(cafile=spec["ca"])
        ctx.set_alpn_protocols(["http/1.1"])
        return http.client.HTTPSConnection(spec["host"], spec["port"], timeout=60, context=ctx)
    return http.client.HTTPConnection(spec["host"], spec["port"], timeout=60)


def http_worker(spec: dict) -> dict:
    """The ceiling of the files row: one listing (on a connection of its own, every page),
    then `threads` keep-alive connections, one GET of each file whole."""
    bucket, prefix, expect = spec["bucket"], spec["prefix"], spec["expect"]
    pc = time.perf_counter
    t0 = pc()
    conn = _connection(spec)
    names, token, pages = [], None, 0
    while True:
        q = {"prefix": prefix, "delimiter": "/"}
        if token:
            q["pageToken"] = token
        conn.request("GET", f"/storage/v1/b/{bucket}/o?" + urllib.parse.urlencode(q))
        r = conn.getresponse()
        body = r.read()
        if r.status != 200:
            return {"error": f"listing: HTTP {r.status}: {body[:200]!r}"}
        page = json.loads(body)
        pages += 1
        names += [it["name"][len(prefix):] for it in page.get("items", [])]
        token = page.get("nextPageToken")
        if not token:
            break
    conn.close()
    t_list = pc()
    if sorted(names) != sorted(expect):
        return {"error": f"listing of {prefix}: {len(names)} names, want {len(expect)}"}
    queue = _Queue(sorted(names))
    bad: list = []
    total = [0] * spec["threads"]

    def getter(i):
        c = _connection(spec)
        try:
            while (name := queue.next()) is not None:
                c.request("GET", f"/download/storage/v1/b/{bucket}/o/"
                          + urllib.parse.quote(prefix + name, safe="") + "?alt=media")
                r = c.getresponse()
                body = r.read()
                total[i] += len(body)
                if r.status != 200 or [len(body), zlib.crc32(body)] != expect[name]:
                    bad.append(f"{name}: HTTP {r.status}, {len(body)} bytes")
        finally:
            c.close()

    _run_threads(spec["threads"], getter)
    t_end = pc()
    return {"seconds": t_end - t0, "list_seconds": t_list - t0, "files": len(names), "bytes": sum(total),
            "pages": pages, "connections": 1 + spec["threads"], "bad": len(bad), "first_bad": bad[:3]}


def mmap_worker(spec: dict) -> dict:
    """Map the file (MAP_SHARED, read-only) and touch every page of each range in order, one
    thread per range, all started together: zlib.crc32 over the range 1 MiB at a time (every
    byte read, so every page faulted in, and the bytes checked). A thread stops at the budget
    (`partial`); MiB/s is then over what was read."""
    ranges, budget = spec["ranges"], spec["budget_s"]
    fd = os.open(spec["path"], os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    mv = memoryview(m)
    done = [0] * len(ranges)
    crcs = [0] * len(ranges)
    t0 = [0.0]
    # The clock starts when the last thread is ready: all ranges are touched at once.
    start = threading.Barrier(len(ranges), action=lambda: t0.__setitem__(0, time.perf_counter()))

    def toucher(i):
        a, b = ranges[i]
        start.wait()
        deadline = t0[0] + budget
        crc, off = 0, a
        while off < b:
            end = min(b, off + CHUNK)
            crc = zlib.crc32(mv[off:end], crc)
            off = end
            if time.perf_counter() > deadline:
                break
        done[i], crcs[i] = off - a, crc

    try:
        _run_threads(len(ranges), toucher)
        secs = time.perf_counter() - t0[0]
    finally:
        mv.release()
        m.close()
    complete = [done[i] == b - a for i, (a, b) in enumerate(ranges)]
    bad = [i for i in range(len(ranges)) if complete[i] and crcs[i] != spec["expect"][i]]
    return {"seconds": secs, "bytes": sum(done), "partial": not all(complete), "bad_ranges": bad}


def odirect_worker(spec: dict) -> dict:
    """`count` O_DIRECT preads of `block` bytes at random block-aligned offsets of a local file
    (the disk itself, no page cache), each timed, after `warmup` untimed ones."""
    block, size = spec["block"], spec["size"]
    rng = random.Random(spec["seed"])
    buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT needs
    fd = os.open(spec["path"], os.O_RDONLY | os.O_DIRECT)
    lat = []
    try:
        for i in range(spec["warmup"] + spec["count"]):
            off = rng.randrange(0, size // block) * block
            t0 = time.perf_counter_ns()
            n = os.preadv(fd, [buf], off)
            t1 = time.perf_counter_ns()
            if n != block:
                return {"error": f"O_DIRECT read at {off}: {n} bytes, want {block}"}
            if i >= spec["warmup"]:
                lat.append(t1 - t0)
    finally:
        os.close(fd)
        buf.close()
    return {"lat_ns": lat}


def cachefiles_worker(spec: dict) -> dict:
    """The least a cache that keeps each object in a file of its own pays on a filesystem: for
    each of `sizes`, a file made under a temporary name in one of 256 sub-directories of `dir`,
    a 4 KiB header page and the object's bytes written with one buffered write, then renamed
    into place; then `sync` unless `spec["sync"]` is false. Returns the wall time of the loop,
    this process's CPU seconds, and the whole host's CPU seconds from the start until the sync
    returned (the kernel's writeback included)."""
    def host_cpu() -> float:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")
    top = spec["dir"]
    page = b"\0" * 4096
    data = os.urandom(max(spec["sizes"]))
    h0, c0, t0 = host_cpu(), sum(os.times()[:2]), time.perf_counter()
    for i, size in enumerate(spec["sizes"]):
        sub = os.path.join(top, f"{i % 256:02x}")
        if i < 256:
            os.mkdir(sub, 0o700)   # made when first needed, as storefs makes its shards
        temp, final = os.path.join(sub, f"{i}.blk.tmp"), os.path.join(sub, f"{i}.blk")
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, page + data[:size])
        finally:
            os.close(fd)
        os.rename(temp, final)
    t1, c1 = time.perf_counter(), sum(os.times()[:2])
    if spec.get("sync", True):
        os.sync()
    return {"seconds": t1 - t0, "cpu_s": c1 - c0, "host_cpu_s": host_cpu() - h0, "files": len(spec["sizes"])}


WORKERS = {"files": files_worker, "http": http_worker, "mmap": mmap_worker, "odirect": odirect_worker,
           "cachefiles": cachefiles_worker}

if __name__ == "__main__":
    json.dump(WORKERS[sys.argv[1]](json.load(sys.stdin)), sys.stdout)
