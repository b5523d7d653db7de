"""The workloads users run (issue 48): a directory of small files read whole, one file mapped
into memory, several readers of one file at once. The benchmark's workload rows
(bench/storefs_bench/workloads.py) measure how fast; these pin what must hold whatever the
speed: how many requests a small file costs, and that every byte arrives right through mmap
and through parallel readers. No timing is asserted here.

Objects live in `workload-bucket`. storefs reaches the emulator over TLS (the `proxy` fixture
counts requests as a ForbiddingProxy serving https), and through bench/link's `wan` model
(plain http: linkproxy models the link at the HTTP level, as in test_link.py) where a far
link is what makes readers interfere.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
import threading
import time

import pytest

from storefs_testlib import link_in_front_of, link_media_requests, most_at_once, read_whole, wait_for

WB = "workload-bucket"
KiB, MiB = 1 << 10, 1 << 20

# A file whose size is known and at most this is fetched whole by its first read: one GET.
# storefs's default (BlockReader.defaultWholeObjectLimit, chosen by measurement: docs/experiments.md,
# "2026-12-07: whole_file's default, files fetched whole up to 4 MiB").
SMALL_FILE_LIMIT = 4 * MiB
# The kernel's first FUSE read of a file asks for at most its initial read-ahead window (128
# KiB), and with many readers at once often for one page (4 KiB): the reads after it, however
# many, must not become more GETs.
KERNEL_FIRST_READ = 128 * KiB

SMALL_DIR = "small/"
SMALL_FILES = 96
READERS = 16  # the data loader: 16 threads, each reading the next file whole


def small_sizes() -> list[int]:
    """Sizes around the kernel's first read and up to the limit, both edges included."""
    fixed = [1, 4 * KiB, 64 * KiB, KERNEL_FIRST_READ, KERNEL_FIRST_READ + 1, 200 * KiB, 256 * KiB + 7,
             SMALL_FILE_LIMIT // 2, SMALL_FILE_LIMIT - 1, SMALL_FILE_LIMIT]
    rng = random.Random(48)
    # The rest image-sized, as the data loader reads (the edges above reach the limit).
    return fixed + [rng.randint(32 * KiB, 1 * MiB) for _ in range(SMALL_FILES - len(fixed))]


SMALL = {f"{SMALL_DIR}f{i:02d}.bin": random.Random(4800 + i).randbytes(size)
         for i, size in enumerate(small_sizes())}
# Not a whole number of pages, so the last page of a mapping is a partial one.
MAPPED = "model/weights.bin"
MAPPED_BYTES = random.Random(4801).randbytes(20 * MiB + 12345)
QUARTERS = 4


@pytest.fixture(scope="module")
def wbucket(emulator):
    emulator.create_bucket(WB, exist_ok=True)
    for name, data in SMALL.items():
        emulator.upload(WB, name, data)
    emulator.upload(WB, MAPPED, MAPPED_BYTES)
    return emulator


@pytest.fixture(params=["tls", "wan"])
def far_or_near(request, wbucket, mount, tmp_path):
    """(a fresh storefs mount of WB, the link proxy or None): straight to the emulator over
    TLS, or through bench/link's `wan` model (30 ms to every first byte, 50 MiB/s per
    connection, 60 ms to open one; plain http, as the model needs)."""
    if request.param == "tls":
        yield mount(WB), None
        return
    with link_in_front_of(wbucket.http_port, tmp_path, "wan") as proxy:
        yield mount(WB, endpoint=proxy.url), proxy


def fetched_once(proxy, size: int) -> None:
    """Through the link: the media GETs since its last reset brought the object's bytes once
    (5% slack for a reader's own gap-filling GET), not the same ranges again and again."""
    body = sum(r["body"] for r in link_media_requests(proxy))
    assert body <= size * 1.05, (
        f"{body / MiB:.1f} MiB fetched for a {size / MiB:.1f} MiB object: ranges fetched more than once: "
        + ", ".join(r["range"] for r in sorted(link_media_requests(proxy), key=lambda r: r["t_req"])))


def settled(proxy) -> None:
    """Every request that reached the counting proxy has been answered, and none came for a
    moment (read-ahead a read started has landed)."""
    def quiet():
        return sum(proxy.started.values()) == sum(n for k, n in proxy.counts.items() if k != "denied")
    for _ in range(3):
        assert wait_for(quiet, 10), f"requests still unanswered: {proxy.started} vs {proxy.counts}"
        time.sleep(0.3)
    assert quiet()


# ---------------------------------------------------------------------------- small files
def read_all_at_once(paths: list[str], threads: int) -> dict[str, bytes]:
    """Every path read whole (read_whole), `threads` threads each taking the next path."""
    todo = list(reversed(paths))
    got: dict[str, bytes] = {}
    errors: list[str] = []
    lock = threading.Lock()  # guards todo, got and errors

    def reader():
        while True:
            with lock:
                if not todo:
                    return
                path = todo.pop()
            try:
                data = read_whole(path)
            except OSError as exc:
                with lock:
                    errors.append(f"{path}: {exc!r}")
                continue
            with lock:
                got[path] = data

    ts = [threading.Thread(target=reader) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in ts), "a reader hung"
    assert errors == []
    return got


def test_small_files_listed_then_read_whole_by_16_threads_cost_one_get_each(mount, wbucket, proxy):
    """Issue 48: a file whose size the listing gave, at most SMALL_FILE_LIMIT, is fetched whole
    by its first read: one media GET, however little of it the kernel's first read asks for
    (with 16 readers at once it often asks for the first pages only). A second reading of
    every file (its pages dropped from the kernel's cache) is served from those downloads:
    no GET at all."""
    m = mount(WB, endpoint=proxy.endpoint)
    listed = {e.name: e.stat().st_size for e in os.scandir(m.p(SMALL_DIR))}
    want = {name[len(SMALL_DIR):]: len(data) for name, data in SMALL.items()}
    assert listed == want, "the listing shows other names or sizes than the bucket holds"
    settled(proxy)
    proxy.reset()
    got = read_all_at_once([m.p(name) for name in SMALL], READERS)
    wrong = [name for name, data in SMALL.items() if got[m.p(name)] != data]
    assert not wrong, f"bytes differ: {wrong}"
    settled(proxy)
    gets: dict[str, list[str]] = {name: [] for name in SMALL}
    for r in proxy.requests("media"):
        assert r.name in gets, f"a GET of {r.name!r}, which was not read"
        gets[r.name].append(r.range or "whole")
    extra = {n: g for n, g in gets.items() if len(g) != 1}
    assert not extra, (
        f"{sum(len(g) for g in gets.values())} media GETs for {len(SMALL)} files of at most "
        f"{SMALL_FILE_LIMIT // KiB} KiB (SMALL_FILE_LIMIT) read whole by {READERS} threads, whose sizes the "
        f"listing gave; want one GET each. {len(extra)} file(s) took other than one: "
        + "; ".join(f"{n} ({len(SMALL[n])} bytes): {', '.join(g) or 'none'}" for n, g in sorted(extra.items())))
    proxy.reset()
    got = read_all_at_once([m.p(name) for name in SMALL], READERS)
    assert all(got[m.p(name)] == data for name, data in SMALL.items()), "bytes differ when read again"
    settled(proxy)
    again = [f"{r.name} {r.range}" for r in proxy.requests("media")]
    assert not again, f"reading the files again went to the bucket: {again}"


def test_whole_file_sets_the_size_up_to_which_a_file_costs_one_get(mount, wbucket, proxy):
    """`whole_file=SIZE` moves the threshold both ways: with 8M, a 6 MiB file (above the
    default, SMALL_FILE_LIMIT) read in 16 KiB pieces is one GET; with 0, a 200 KiB file is
    fetched in parts as any large file is (the kernel's first read, then read-ahead), more
    than one GET."""
    name = "sizes/six-mib.bin"
    data = random.Random(4802).randbytes(6 * MiB)
    assert len(data) > SMALL_FILE_LIMIT
    wbucket.upload(WB, name, data)
    small = f"{SMALL_DIR}f05.bin"
    assert len(SMALL[small]) == 200 * KiB
    for option, path, want_one in (("whole_file=8M", name, True), ("whole_file=0", small, False)):
        m = mount(WB, endpoint=proxy.endpoint, options=[option])
        os.stat(m.p(path))
        settled(proxy)
        proxy.reset()
        with open(m.p(path), "rb", buffering=0) as f:
            got = b"".join(iter(lambda: f.read(16 * KiB), b""))
        assert got == (data if path == name else SMALL[small]), f"{option}: bytes differ"
        settled(proxy)
        gets = [r.range or "whole" for r in proxy.requests("media") if r.name == path]
        if want_one:
            assert len(gets) == 1, f"{option}: {len(gets)} GETs for a 6 MiB file: {gets}"
        else:
            assert len(gets) > 1, f"{option}: one GET for a 200 KiB file, as if fetched whole: {gets}"
        mount.unmount(m)


# ---------------------------------------------------------------------------- mmap
# The mapping is read in a child process: a fault storefs answers with an error is a SIGBUS,
# which must end the child, not the test session.
MAP_CHILD = r"""
import hashlib, json, mmap, os, random, sys, threading
spec = json.loads(sys.argv[1])
fd = os.open(spec["path"], os.O_RDONLY)
size = os.fstat(fd).st_size
if spec["mode"] == "private":
    # Copy-on-write: the pages are the file's until written, then the writer's own.
    m = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
else:
    m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
os.close(fd)
out = {"size": size}
if spec["mode"] == "private":
    out["whole"] = hashlib.sha256(m).hexdigest()
    m[0:4] = b"\0\0\0\0"   # a private write: never reaches the file
    out["after_write"] = hashlib.sha256(m[:4]).hexdigest()
elif spec["mode"] == "pages":
    # Every page once, in a random order (a loader jumping between tensors), then compared.
    pages = list(range((size + 4095) // 4096))
    random.Random(7).shuffle(pages)
    got = bytearray(size)
    for p in pages:
        got[p * 4096:(p + 1) * 4096] = m[p * 4096:(p + 1) * 4096]
    out["whole"] = hashlib.sha256(got).hexdigest()
else:
    # `threads` threads, each hashing its own part at once (hashlib lets go of the interpreter
    # lock on large buffers, so their page faults overlap).
    n = spec["threads"]
    q = size // n
    parts = [None] * n
    mv = memoryview(m)
    start = threading.Barrier(n)
    def part(i):
        start.wait()
        end = size if i == n - 1 else (i + 1) * q
        h = hashlib.sha256()
        for off in range(i * q, end, 1 << 20):
            h.update(mv[off:min(end, off + (1 << 20))])
        parts[i] = h.hexdigest()
    ts = [threading.Thread(target=part, args=(i,)) for i in range(n)]
    for t in ts: t.start()
    for t in ts: t.join()
    mv.release()
    out["parts"] = parts
m.close()
print(json.dumps(out))
"""


def mapped_read(path: str, mode: str, threads: int = 1) -> dict:
    """Run MAP_CHILD on `path`; its JSON answer, or a failure saying how the child ended."""
    spec = json.dumps({"path": path, "mode": mode, "threads": threads})
    try:
        r = subprocess.run([sys.executable, "-c", MAP_CHILD, spec], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail(f"reading {path} through mmap ({mode}) did not end within 120 s", pytrace=False)
    if r.returncode != 0:
        how = f"signal {-r.returncode}" if r.returncode < 0 else f"exit {r.returncode}"
        pytest.fail(f"reading {path} through mmap ({mode}) ended with {how} (SIGBUS = a page storefs could "
                    f"not fill): {r.stderr.strip()[-600:]}", pytrace=False)
    return json.loads(r.stdout)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_a_cold_file_read_through_a_shared_mapping_page_by_page_is_byte_exact(mount, wbucket):
    """MAP_SHARED, every page faulted in once in a random order, on a fresh mount (nothing of
    the file in the kernel's or storefs's cache); the last page is a partial one."""
    m = mount(WB)
    got = mapped_read(m.p(MAPPED), "pages")
    assert got["size"] == len(MAPPED_BYTES)
    assert got["whole"] == sha(MAPPED_BYTES), "the mapping's bytes differ from the object's"


def test_a_cold_file_read_through_a_private_mapping_is_byte_exact_and_its_writes_stay_private(mount, wbucket):
    """MAP_PRIVATE (copy-on-write) of a cold file on the read-only mount: the same bytes, and a
    write into the mapping changes the writer's copy only, never what the file reads as."""
    m = mount(WB)
    got = mapped_read(m.p(MAPPED), "private")
    assert got["whole"] == sha(MAPPED_BYTES), "the private mapping's bytes differ from the object's"
    assert got["after_write"] == sha(b"\0\0\0\0"), "a write into the private mapping did not take"
    assert read_whole(m.p(MAPPED)) == MAPPED_BYTES, "a private mapping's write reached the file"


def test_a_mapped_file_touched_in_order_through_a_far_link_reads_ahead_in_parallel_parts(wbucket, mount, tmp_path):
    """Issue 48, "mmap is first-class": page faults read ahead as read() does. Through `wan`
    one GET at a time cannot fill the link; the faults of one thread touching a cold mapping
    in order must be met by several parts in flight at once (as test_link's sequential read
    is), each range fetched once."""
    with link_in_front_of(wbucket.http_port, tmp_path, "wan") as wan:
        m = mount(WB, endpoint=wan.url)
        os.stat(m.p(MAPPED))
        wan.reset_stats()
        got = mapped_read(m.p(MAPPED), "threads", threads=1)
        assert got["parts"] == [sha(MAPPED_BYTES)], "the mapping's bytes differ from the object's"
        media = link_media_requests(wan)
        most = most_at_once(media)
        assert most > 4, (
            f"at most {most} ranged GETs in flight at once for page faults in order through a 30 ms link "
            f"({len(media)} GETs): the mapping did not read ahead as read() does")
        fetched_once(wan, len(MAPPED_BYTES))


def test_four_threads_touching_quarters_of_one_mapping_at_once_get_exact_bytes(far_or_near):
    """Parallel tensor loads: one shared mapping of a cold file, 4 threads each reading its
    quarter at the same time, near (TLS) and through a far link, where their page faults'
    read-ahead streams run side by side in one file: every byte right, and through the link
    each range fetched once."""
    m, link = far_or_near
    if link is not None:
        os.stat(m.p(MAPPED))
        link.reset_stats()
    got = mapped_read(m.p(MAPPED), "threads", threads=QUARTERS)
    q = len(MAPPED_BYTES) // QUARTERS
    want = [sha(MAPPED_BYTES[i * q:len(MAPPED_BYTES) if i == QUARTERS - 1 else (i + 1) * q])
            for i in range(QUARTERS)]
    bad = [i for i in range(QUARTERS) if got["parts"][i] != want[i]]
    assert not bad, f"quarter(s) {bad} of the mapping read other bytes than the object holds"
    if link is not None:
        fetched_once(link, len(MAPPED_BYTES))


# ---------------------------------------------------------------------------- parallel readers
def test_four_threads_pread_looping_quarters_of_one_descriptor_get_exact_bytes(far_or_near):
    """Several streams in one open file: 4 threads, one descriptor, each pread()ing its own
    quarter front to back in 128 KiB steps, all at once on a cold file; near (TLS) and
    through a far link. Every byte is compared with the object's; through the link each range
    is fetched once."""
    m, link = far_or_near
    data = MAPPED_BYTES
    q = len(data) // QUARTERS
    step = 128 * KiB
    errors: list[str] = []
    fd = os.open(m.p(MAPPED), os.O_RDONLY)
    if link is not None:
        link.reset_stats()
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        start = threading.Barrier(QUARTERS)

        def reader(i):
            a, b = i * q, len(data) if i == QUARTERS - 1 else (i + 1) * q
            try:
                start.wait()
                for off in range(a, b, step):
                    n = min(step, b - off)
                    got = os.pread(fd, n, off)
                    if got != data[off:off + n]:
                        errors.append(f"reader {i}: {len(got)} bytes at {off} differ from the object's")
                        return
            except Exception as exc:  # reported below
                errors.append(f"reader {i}: {exc!r}")

        threads = [threading.Thread(target=reader, args=(i,)) for i in range(QUARTERS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads), "a reader hung"
    finally:
        os.close(fd)
    assert errors == []
    if link is not None:
        fetched_once(link, len(data))
