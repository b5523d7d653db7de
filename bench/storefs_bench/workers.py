"""Loops that run in a child Python process, so a hung mount cannot hang the benchmark.

    python3 workers.py pread   < {"path", "local", "offsets", "evict"[, "disk"]} -> {"lat_ns", "mismatches"[, "disk_lat_ns"]}
    python3 workers.py stat    < {"paths"}                               -> {"seconds", "lat_ns", "errors", "sizes"}

readers.py starts them with a timeout. Standard library only: this file runs as a script.
"""

from __future__ import annotations

import json
import mmap
import os
import random
import sys
import time


def pread_worker(spec: dict) -> dict:
    """4 KiB preads at the given offsets, each timed, then compared with the local copy.

    With `disk` ({"path", "size", "block", "seed"}), each pread follows one timed O_DIRECT read
    of `block` bytes at a random block-aligned offset of that local file: the disk's own latency
    in the same moments as the reads it is compared with (a virtual disk's latency swings by 2×
    from one minute to the next here)."""
    fd = os.open(spec["path"], os.O_RDONLY)
    if spec["evict"]:
        # Drop only this file's kernel page cache, so reads reach the daemon while the daemon's
        # own cache files stay as warm as it left them.
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        # Freeing a GiB of page cache goes on in the kernel for tens of ms after the call
        # returns and slowed the first ~40 ms of reads (p50 ~75 µs vs ~25 µs once settled), for
        # every system alike: let it finish so the number is the daemon's, not the kernel's.
        time.sleep(1.0)
    disk = spec.get("disk")
    if disk:
        dfd = os.open(disk["path"], os.O_RDONLY | os.O_DIRECT)
        dbuf = mmap.mmap(-1, disk["block"])  # page-aligned, as O_DIRECT needs
        rng, blocks = random.Random(disk["seed"]), disk["size"] // disk["block"]
    lat, got, disk_lat = [], [], []
    pc = time.perf_counter_ns
    for off in spec["offsets"]:
        if disk:
            t0 = pc()
            n = os.preadv(dfd, [dbuf], rng.randrange(0, blocks) * disk["block"])
            t1 = pc()
            if n != disk["block"]:
                return {"error": f"O_DIRECT read of {disk['path']}: {n} bytes, want {disk['block']}"}
            disk_lat.append(t1 - t0)
        t0 = pc()
        b = os.pread(fd, 4096, off)
        t1 = pc()
        lat.append(t1 - t0)
        got.append(b)
    os.close(fd)
    if disk:
        os.close(dfd)
        dbuf.close()
    bad = 0
    lfd = os.open(spec["local"], os.O_RDONLY)
    for off, b in zip(spec["offsets"], got):
        if os.pread(lfd, 4096, off) != b:
            bad += 1
    os.close(lfd)
    return {"lat_ns": lat, "mismatches": bad, **({"disk_lat_ns": disk_lat} if disk else {})}


def stat_worker(spec: dict) -> dict:
    """os.stat of each path in order, one process, one thread: the --scale stat row.

    `seconds` is the loop alone (no interpreter start-up); a path that fails is counted in
    `errors` with its first few messages, so a wrong answer is reported, not timed."""
    lat, errors, first, sizes = [], 0, [], []
    pc = time.perf_counter_ns
    t0 = pc()
    for p in spec["paths"]:
        a = pc()
        try:
            st = os.stat(p)
            sizes.append(st.st_size)
        except OSError as exc:
            errors += 1
            sizes.append(None)
            if len(first) < 3:
                first.append(f"{p}: {exc.strerror}")
        lat.append(pc() - a)
    return {"seconds": (pc() - t0) / 1e9, "lat_ns": lat, "errors": errors, "first_errors": first,
            "sizes": sizes}


WORKERS = {"pread": pread_worker, "stat": stat_worker}

if __name__ == "__main__":
    json.dump(WORKERS[sys.argv[1]](json.load(sys.stdin)), sys.stdout)
