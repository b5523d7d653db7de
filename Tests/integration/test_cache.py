"""The block cache and the prefetcher, through real mounts (docs/architecture.md, README "Block cache").

Objects of their own live in a second bucket, `cache-bucket`, so that the corpus bucket's
listing stays what the other modules expect; the 24 MiB corpus object is reused read-only.
Every test reads through a mount and compares with the bytes that were uploaded. Media
requests and bytes are counted by the proxy (`proxy.counts['media']`, `proxy.media_bytes`).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import math
import os
import random
import re
import signal
import stat
import subprocess
import threading
import time
import uuid

import pytest

from storefs_testlib import BUCKET, default_signals, is_mounted, run_storefs, vm_kib
from storefs_testlib import read_whole as read_file

CB = "cache-bucket"
KiB, MiB = 1 << 10, 1 << 20

SEQ = "seq/random-20MiB.bin"                 # 20 MiB + a tail that is not block aligned
SEQ_SIZE = 20 * MiB + 12345
CAP = ["cap/a-8MiB.bin", "cap/b-8MiB.bin", "cap/c-8MiB.bin"]
SMALL = "small/hello.txt"
RACE = [f"race/r{i}.bin" for i in range(10)]  # 1 MiB each, first opened in test_concurrent_...
OTHER = "seq/other-6MiB.bin"
# Names whose fragments must never show up in the cache directory (paths or contents).
SECRET_NAMES = ["names/zebra-QWERTY-unguessable.txt", "names/with space ünïcødé.bin",
                "names/deeper/banana-XYZZY-42.dat"]


@pytest.fixture(scope="module")
def cdata(emulator) -> dict[str, bytes]:
    """Uploads this module's objects to CB once; returns name -> bytes."""
    emulator.create_bucket(CB, exist_ok=True)
    rng = random.Random(424242)
    data = {SEQ: rng.randbytes(SEQ_SIZE), OTHER: rng.randbytes(6 * MiB + 7),
            SMALL: b"tiny payload\n"}
    for name in CAP:
        data[name] = rng.randbytes(8 * MiB)
    for name in RACE:
        data[name] = rng.randbytes(1 * MiB)
    for i, name in enumerate(SECRET_NAMES):
        data[name] = b"payload %d " % i + rng.randbytes(300 * KiB + i)
    for name, body in data.items():
        res = emulator.upload(CB, name, body)
        assert int(res["size"]) == len(body), name
    return data


# ---------------------------------------------------------------------- helpers
def pread_ranges(path: str, ranges, *, random_access: bool = True) -> list[bytes]:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if random_access:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        return [os.pread(fd, n, off) for off, n in ranges]
    finally:
        os.close(fd)


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def cache_files(cache_dir: str) -> list[str]:
    out = []
    for root, _dirs, files in os.walk(cache_dir):
        out += [os.path.join(root, f) for f in files]
    return out


def cache_allocated(cache_dir: str) -> int:
    """Bytes the cache really occupies on disk (allocated blocks, not apparent sizes)."""
    total = 0
    for p in cache_files(cache_dir):
        try:
            total += os.lstat(p).st_blocks * 512
        except FileNotFoundError:   # evicted while we walked
            pass
    return total


def settle(proxy, quiet: float = 0.6, timeout: float = 15.0) -> None:
    """Waits until no media request is in flight and none arrived for `quiet` seconds."""
    deadline = time.monotonic() + timeout
    last = (-1, -1)
    since = time.monotonic()
    while time.monotonic() < deadline:
        now = (proxy.started["media"], proxy.counts["media"])
        if now != last:
            last, since = now, time.monotonic()
        elif now[0] == now[1] and time.monotonic() - since >= quiet:
            return
        time.sleep(0.05)
    pytest.fail(f"media requests did not settle within {timeout:.0f} s "
                f"(started {proxy.started['media']}, answered {proxy.counts['media']})")


def media_for(proxy, name: str) -> list:
    return [r for r in proxy.requests("media") if r.name == name]


def random_ops(seed: int, size: int, n: int, block: int) -> list[tuple[int, int]]:
    """(offset, length): lengths log-uniform in 1 B..3 MiB; offsets near block boundaries,
    anywhere, or at/after EOF."""
    rng = random.Random(seed)
    ops = []
    for _ in range(n):
        r = rng.random()
        if r < 0.4:
            off = rng.randrange(size // block + 2) * block + rng.randint(-5, 5)
        elif r < 0.9:
            off = rng.randrange(size)
        else:
            off = size + rng.randint(-100, 2 * MiB)
        length = int(2 ** rng.uniform(0, math.log2(3 * MiB)))
        ops.append((max(0, off), max(1, min(length, 3 * MiB))))
    return ops


def run_random_readers(path: str, data: bytes, seed: int, threads: int = 6, handles: int = 4,
                       ops_per_thread: int = 60) -> list[str]:
    """Several threads pread from several shared descriptors at once; returns mismatches.

    Now and then a thread drops the kernel's page cache of the file, so that later reads
    reach storefs again (its block cache, or downloads other threads started) rather than
    being served by the kernel alone."""
    fds = [os.open(path, os.O_RDONLY) for _ in range(handles)]
    errors: list[str] = []
    start = threading.Barrier(threads)

    def worker(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        try:
            start.wait(timeout=30)
            for off, n in random_ops(seed * 1000 + i, len(data), ops_per_thread, 64 * KiB):
                fd = fds[rng.randrange(handles)]
                if rng.random() < 0.15:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                got = os.pread(fd, n, off)
                want = data[off:off + n]
                if got != want:
                    first = next((k for k in range(min(len(got), len(want)))
                                  if got[k] != want[k]), min(len(got), len(want)))
                    errors.append(f"thread {i}: pread(off={off}, n={n}) returned {len(got)} "
                                  f"bytes, expected {len(want)}; first difference at +{first}")
        except Exception as exc:  # reported by the caller
            errors.append(f"thread {i}: {exc!r}")

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    try:
        for t in ts:
            t.start()
        for t in ts:
            t.join(timeout=60)
        if any(t.is_alive() for t in ts):
            errors.append("a reader thread hung for 60 s")
    finally:
        for fd in fds:
            os.close(fd)
    return errors


def bdi_of(path: str) -> str:
    """maj:min (field 3 of /proc/self/mountinfo) of the mount at `path`."""
    found = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split(" ")
            if fields[4] == path:
                found = fields[2]
    assert found, f"{path} not in /proc/self/mountinfo"
    return found


def force_unmount_dead(path: str) -> None:
    """A mount whose daemon died: fusermount3 -u, else umount -l."""
    subprocess.run(["fusermount3", "-u", path], capture_output=True, timeout=30)
    if is_mounted(path):
        subprocess.run(["umount", "-l", path], capture_output=True, timeout=30)
    assert not is_mounted(path), f"{path} still mounted after fusermount3 -u and umount -l"


# ---------------------------------------------------------------------- 1. random reads
def test_random_concurrent_reads_cold_then_warm(mount, cdata):
    """Seeded random preads (1 B..3 MiB, across 64 KiB block boundaries and past EOF) from
    6 threads over 4 descriptors match the source, on a cold cache and again on a remount
    that finds the blocks of the first pass on disk."""
    data = cdata[SEQ]
    m = mount(CB, options=["block_size=64K"])
    assert os.stat(m.p(SEQ)).st_size == len(data)
    errors = run_random_readers(m.p(SEQ), data, seed=1)
    assert errors == [], "cold pass:\n" + "\n".join(errors[:20])
    assert cache_allocated(m.cache_dir) > 0, "the first pass cached nothing"
    assert mount.unmount(m) == []

    warm = mount(CB, options=["block_size=64K"], cache_dir=m.cache_dir)
    errors = run_random_readers(warm.p(SEQ), data, seed=1)
    assert errors == [], "warm pass (same sequence):\n" + "\n".join(errors[:20])
    errors = run_random_readers(warm.p(SEQ), data, seed=2, ops_per_thread=30)
    assert errors == [], "warm cache, new sequence:\n" + "\n".join(errors[:20])


# ---------------------------------------------------------------------- 2. remount
def test_remount_serves_cached_ranges_without_media_requests(mount, proxy, cdata):
    ranges = [(5 * MiB + 123, 5000), (13 * MiB - 17, 70000), (1 * MiB + 1, 300000)]
    m = mount(CB, endpoint=proxy.endpoint)
    assert read_file(m.p(SEQ)) == cdata[SEQ]
    got = pread_ranges(m.p(OTHER), ranges)
    assert got == [cdata[OTHER][o:o + n] for o, n in ranges]
    settle(proxy)   # read-ahead still landing belongs to the first mount
    media_before = proxy.counts["media"]
    assert media_before > 0
    assert mount.unmount(m) == []

    again = mount(CB, endpoint=proxy.endpoint, cache_dir=m.cache_dir)
    assert read_file(again.p(SEQ)) == cdata[SEQ]
    got = pread_ranges(again.p(OTHER), ranges)
    assert got == [cdata[OTHER][o:o + n] for o, n in ranges]
    settle(proxy)
    extra = [r.path for r in proxy.requests("media")][media_before:]
    assert proxy.counts["media"] == media_before, \
        f"the remount made {len(extra)} media request(s) for cached bytes: {extra[:5]}"


# ---------------------------------------------------------------------- 3. overwrite
def test_overwritten_object_reads_new_bytes_only(mount, emulator, cdata):
    name = f"over/x-{uuid.uuid4().hex[:8]}.bin"
    rng = random.Random(33)
    old = rng.randbytes(1 * MiB + 500 * KiB + 3)
    new = rng.randbytes(700 * KiB + 11)           # shorter: a mix would show old tail bytes
    newer = rng.randbytes(2 * MiB + 99)           # longer: a mix would show old head bytes
    emulator.upload(CB, name, old)
    m = mount(CB, options=["stat_ttl=1", "list_ttl=1", "negative_ttl=1"])
    assert read_file(m.p(name)) == old
    for body in (new, newer):
        emulator.upload(CB, name, body)
        time.sleep(2.2)
        for attempt in range(3):
            got = read_file(m.p(name), drop_page_cache=attempt == 0)
            assert len(got) == len(body), \
                f"open #{attempt} after the overwrite read {len(got)} bytes, want {len(body)}"
            assert got == body, (f"open #{attempt} after the overwrite: bytes differ from the "
                                 f"new object (old bytes served: {got[:4096] == old[:4096]})")
        assert os.stat(m.p(name)).st_size == len(body)
        # Partial reads straddling the old object's length.
        ranges = [(0, 4096), (len(body) - 10, 100), (600 * KiB, 200 * KiB)]
        got = pread_ranges(m.p(name), ranges)
        assert got == [body[o:o + n] for o, n in ranges]
        old = body


# ---------------------------------------------------------------------- 4. cap
def test_cache_size_is_a_hard_cap(mount, cdata):
    cap, slack = 8 * MiB, 1 * MiB
    m = mount(CB, options=["cache_size=8M", "block_size=64K"])
    peak = 0
    for name in CAP + [CAP[0]]:           # 3x the cap of distinct data, then the first again
        fd = os.open(m.p(name), os.O_RDONLY)
        h = hashlib.sha256()
        try:
            while True:
                b = os.read(fd, 1 * MiB)
                if not b:
                    break
                h.update(b)
                peak = max(peak, cache_allocated(m.cache_dir))
        finally:
            os.close(fd)
        assert h.hexdigest() == sha(cdata[name]), f"{name}: bytes differ"
        used = cache_allocated(m.cache_dir)
        peak = max(peak, used)
        assert used <= cap + slack, f"after reading {name}: cache holds {used} bytes on disk"
    assert peak <= cap + slack, f"cache reached {peak} bytes on disk (cap {cap} + {slack})"
    assert peak >= cap // 2, f"cache peaked at only {peak} bytes: is it caching at all?"


# ---------------------------------------------------------------------- 5. kill -9
def test_kill_9_mid_read_then_remount_reads_every_byte(mount, proxy, corpus):
    """SIGKILL while 4 readers stream the 24 MiB object (downloads in flight, blocks being
    written), then a remount on the same cache_dir must give back every byte exactly."""
    data = corpus.data[corpus.BIG]
    proxy.media_delay = 0.2
    m = mount(BUCKET, endpoint=proxy.endpoint)
    path = m.p(corpus.BIG)
    quarter = len(data) // 4
    outcomes: list[str] = []
    progress = [0] * 4
    # One open first, so that the cache file exists before the readers race to open
    # (concurrent first opens are test_concurrent_first_opens_keep_the_cache_file's business).
    holder = os.open(path, os.O_RDONLY)

    def reader(i: int) -> None:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            outcomes.append(f"reader {i}: open {errno.errorcode.get(exc.errno)}")
            return
        try:
            off = i * quarter
            while off < (i + 1) * quarter:
                got = os.pread(fd, 256 * KiB, off)
                if not got or got != data[off:off + len(got)]:
                    outcomes.append(f"reader {i}: wrong bytes at {off} before the kill")
                    return
                off += len(got)
                progress[i] += len(got)
                time.sleep(0.01)
            outcomes.append(f"reader {i}: finished before the kill")
        except OSError as exc:
            outcomes.append(f"reader {i}: {errno.errorcode.get(exc.errno, exc.errno)}")
        finally:
            try:
                os.close(fd)
            except OSError:   # ENOTCONN from the flush of a dead mount
                pass

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while sum(progress) < len(data) // 3 and time.monotonic() < deadline:
        time.sleep(0.005)
    in_flight = proxy.started["media"] - proxy.counts["media"]
    os.kill(m.pid, signal.SIGKILL)
    for t in threads:
        t.join(timeout=20)
    try:
        os.close(holder)
    except OSError:
        pass
    assert not any(t.is_alive() for t in threads), "a reader hung after the daemon died"
    assert not any("wrong bytes" in o for o in outcomes), outcomes
    assert sum("finished" not in o for o in outcomes) >= 1, \
        f"the kill came after the reads ({outcomes}): nothing was interrupted"
    force_unmount_dead(m.path)
    assert cache_allocated(m.cache_dir) > 0, \
        f"nothing cached before the kill: files {cache_files(m.cache_dir)}, readers {outcomes}, " \
        f"media {proxy.counts['media']} ({proxy.media_bytes} bytes)\n{m.stderr()[-2000:]}"

    proxy.media_delay = 0
    again = mount(BUCKET, endpoint=proxy.endpoint, cache_dir=m.cache_dir)
    got = read_file(again.p(corpus.BIG))
    assert len(got) == len(data)
    assert sha(got) == corpus.sha256(corpus.BIG), \
        f"bytes differ after kill -9 and remount ({in_flight} media requests were in flight)"
    # Random ranges too, after dropping the page cache: from the blocks on disk now.
    rng = random.Random(5)
    ranges = [(rng.randrange(len(data)), rng.choice([1, 4096, 300 * KiB])) for _ in range(40)]
    assert pread_ranges(again.p(corpus.BIG), ranges) == [data[o:o + n] for o, n in ranges]


def test_concurrent_first_opens_keep_the_cache_file(mount, proxy, cdata):
    """Threads that open one not-yet-looked-up object at once are woken together by the
    kernel when its lookup completes, so their opens reach storefs together and race to
    create the object's cache file. Afterwards each object must have exactly one file on
    disk, holding the blocks that were read, and a remount must serve those blocks without
    downloading them again."""
    m = mount(CB, endpoint=proxy.endpoint, options=["block_size=64K"])
    names = RACE
    n = 6
    errors: list[str] = []

    def opener(name: str, i: int) -> None:
        try:
            fd = os.open(m.p(name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
                off = i * 128 * KiB
                if os.pread(fd, 64 * KiB, off) != cdata[name][off:off + 64 * KiB]:
                    errors.append(f"{name} opener {i}: bytes differ")
            finally:
                os.close(fd)
        except Exception as exc:
            errors.append(f"{name} opener {i}: {exc!r}")

    for name in names:          # no stat first: the lookup is what lines the opens up
        ts = [threading.Thread(target=opener, args=(name, i)) for i in range(n)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(timeout=30)
        assert not any(t.is_alive() for t in ts), f"{name}: an opener hung"
    assert errors == []
    settle(proxy)
    assert mount.unmount(m) == []
    files = {f: os.lstat(f).st_blocks * 512 for f in cache_files(m.cache_dir)
             if f.endswith(".blk")}

    before = proxy.counts["media"]
    again = mount(CB, endpoint=proxy.endpoint, options=["block_size=64K"], cache_dir=m.cache_dir)
    for name in names:
        ranges = [(i * 128 * KiB, 64 * KiB) for i in range(n)]
        assert pread_ranges(again.p(name), ranges) == [cdata[name][o:o + k] for o, k in ranges]
    settle(proxy)
    refetched = sorted({r.name for r in proxy.requests("media")[before:]})
    assert len(files) == len(names) and refetched == [], (
        f"{len(files)} cache files on disk for {len(names)} objects each opened by {n} threads "
        f"at once; after a remount {len(refetched)} of them were downloaded again: {refetched}")
    small = {f: b for f, b in files.items() if b < n * 64 * KiB}
    assert small == {}, f"cache files holding less than the {n} blocks read: {small}"


# ---------------------------------------------------------------------- 6. server gone
def test_server_gone_cached_file_readable_uncached_read_is_eio(mount, proxy, cdata):
    a, b = OTHER, CAP[1]
    m = mount(CB, endpoint=proxy.endpoint)
    assert read_file(m.p(a)) == cdata[a]
    assert os.stat(m.p(b)).st_size == len(cdata[b])       # looked up, nothing read
    settle(proxy)
    proxy.cut()

    t0 = time.monotonic()
    try:
        got = read_file(m.p(a))                            # fresh open, page cache dropped
    except OSError as exc:
        pytest.fail(f"reading the cached file once the server is gone: {exc!r} after "
                    f"{time.monotonic() - t0:.1f} s\nstorefs log:\n{m.stderr()[-3000:]}")
    assert got == cdata[a], "cached file differs once the server is gone"
    assert time.monotonic() - t0 < 10, "the cached file took long: did it wait on the network?"

    t0 = time.monotonic()
    with pytest.raises(OSError) as info:
        fd = os.open(m.p(b), os.O_RDONLY)
        try:
            os.pread(fd, 4096, 0)
        finally:
            os.close(fd)
    took = time.monotonic() - t0
    assert info.value.errno == errno.EIO, f"got {errno.errorcode.get(info.value.errno)}"
    assert took < 15, f"EIO took {took:.1f} s"
    assert m.proc.poll() is None, "storefs exited"


# ---------------------------------------------------------------------- 7. single flight
def test_concurrent_readers_of_one_block_share_one_get(mount, proxy, cdata):
    proxy.media_delay = 0.3
    m = mount(CB, endpoint=proxy.endpoint, options=["read_ahead=0", "block_size=256K"])
    path = m.p(SEQ)
    data = cdata[SEQ]
    base = 3 * 256 * KiB + 64 * KiB       # inside one 256 KiB block
    # Two readers of the very same 4 KiB (the kernel may merge those on its page), and two of
    # other pages of the same block (those reach storefs as separate reads).
    offsets = [base, base, base + 8 * KiB, base + 100 * KiB]
    barrier = threading.Barrier(len(offsets))
    results: dict[int, bytes | str] = {}

    def reader(i: int, off: int) -> None:
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
                barrier.wait(timeout=10)
                results[i] = os.pread(fd, 4096, off)
            finally:
                os.close(fd)
        except Exception as exc:
            results[i] = repr(exc)

    ts = [threading.Thread(target=reader, args=(i, o)) for i, o in enumerate(offsets)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=30)
    assert all(results.get(i) == data[o:o + 4096] for i, o in enumerate(offsets)), \
        {i: (r if isinstance(r, str) else len(r)) for i, r in results.items()}
    settle(proxy)
    reqs = media_for(proxy, SEQ)
    assert len(reqs) == 1, f"{len(reqs)} media requests for one block: {[r.path for r in reqs]}"


# ---------------------------------------------------------------------- 8. random = no read-ahead
def test_random_reads_get_no_read_ahead(mount, proxy, cdata):
    data = cdata[SEQ]
    m = mount(CB, endpoint=proxy.endpoint, options=["block_size=64K"])
    rng = random.Random(8)
    offsets = [rng.randrange(len(data) - 4096) for _ in range(50)]
    fd = os.open(m.p(SEQ), os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        for off in offsets:
            assert os.pread(fd, 4096, off) == data[off:off + 4096], off
    finally:
        os.close(fd)
    settle(proxy, quiet=1.0)
    limit = 50 * 64 * KiB * 2
    reqs = media_for(proxy, SEQ)
    assert reqs and proxy.media_bytes >= 4096, "no media counted: is the proxy in the path?"
    assert proxy.media_bytes <= limit, (
        f"50 random 4 KiB reads fetched {proxy.media_bytes} bytes in {len(reqs)} media requests "
        f"(limit {limit}); Range headers: {[r.range for r in reqs]}")


# ---------------------------------------------------------------------- 9. interrupt
def test_sigint_ends_a_stalled_cat_and_the_mount_carries_on(mount, proxy, corpus):
    proxy.media_delay = 3.0
    m = mount(BUCKET, endpoint=proxy.endpoint)
    cat = subprocess.Popen(["cat", m.p(corpus.BIG)], stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, preexec_fn=default_signals)
    try:
        time.sleep(0.5)
        assert cat.poll() is None, "cat finished before the signal: the delay did not hold it"
        t0 = time.monotonic()
        cat.send_signal(signal.SIGINT)
        try:
            cat.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pytest.fail("cat still running 5 s after SIGINT")
        took = time.monotonic() - t0
    finally:
        if cat.poll() is None:
            cat.kill()
            cat.wait(timeout=30)
    assert took <= 2.0, f"cat took {took:.1f} s to exit after SIGINT"
    assert cat.returncode != 0
    proxy.media_delay = 0
    r = subprocess.run(["cat", m.p("files/hello.txt")], capture_output=True, timeout=20)
    assert r.returncode == 0 and r.stdout == corpus.data["files/hello.txt"], r
    assert m.proc.poll() is None, "storefs exited after the interrupt"
    rng = random.Random(9)
    data = corpus.data[corpus.BIG]
    ranges = [(rng.randrange(len(data)), 100 * KiB) for _ in range(10)]
    assert pread_ranges(m.p(corpus.BIG), ranges) == [data[o:o + n] for o, n in ranges]


# ---------------------------------------------------------------------- 10. full disk
@contextlib.contextmanager
def small_disk(mount, name: str, make):
    """A small filesystem mounted at a new directory, for a cache_dir that fills. `make(dir)`
    gives the commands that create and mount it (an image, if any, named dir + ".img"). On the
    way out, even when the test failed, every storefs mount whose cache is on it is unmounted,
    then the filesystem (lazily if that fails) and the image removed; when the test passed, both
    unmounts must have gone cleanly."""
    disk = mount.new_dir(name)
    u = None
    try:
        for argv in make(disk):
            r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
            assert r.returncode == 0, f"{' '.join(argv)}: {r.stderr}"
        yield disk
    finally:
        problems = [p for mm in list(mount.mounts)
                    if mm.cache_dir and (mm.cache_dir == disk or mm.cache_dir.startswith(disk + os.sep))
                    for p in mount.unmount(mm)]
        if os.path.ismount(disk):
            u = subprocess.run(["umount", disk], capture_output=True, text=True, timeout=30)
            if u.returncode != 0:
                subprocess.run(["umount", "-l", disk], capture_output=True, timeout=30)
        if os.path.exists(disk + ".img"):
            os.unlink(disk + ".img")
    assert problems == []
    assert u is not None and u.returncode == 0, f"umount of {disk}: {u and u.stderr}"


def test_full_cache_disk_degrades_to_streaming(mount, corpus):
    tmpfs = lambda d: [["mount", "-t", "tmpfs", "-o", "size=2M,mode=0700", "tmpfs", d]]
    with small_disk(mount, "tinyfs", tmpfs) as small:
        m = mount(BUCKET, cache_dir=small)
        got = read_file(m.p(corpus.BIG))
        assert len(got) == corpus.BIG_SIZE
        assert sha(got) == corpus.sha256(corpus.BIG), "bytes differ with a full cache disk"
        rng = random.Random(10)
        data = corpus.data[corpus.BIG]
        ranges = [(rng.randrange(len(data)), 300 * KiB) for _ in range(20)]
        assert pread_ranges(m.p(corpus.BIG), ranges) == [data[o:o + n] for o, n in ranges]
        assert m.proc.poll() is None
        # The disk did fill: a cache write failed and the cache paused. (What the failed
        # writes left on it is let go when the files are closed, so the disk's use at the end
        # says nothing: test_allocation_that_runs_out_of_disk_is_let_go_at_close.)
        assert "block cache paused" in m.stderr(), "no cache write failed on the 2 MiB disk: never full?"


def refused_in_one_line(mount, cache_dir: str, options=()) -> str:
    """Runs a daemonizing mount that must be refused before it daemonizes: a positive exit
    (a negative one is a signal: a crash), exactly one `storefs: ` line, nothing mounted.
    Returns the line."""
    mnt = mount.new_dir("mnt")
    argv, _ = mount.argv(BUCKET, mnt, endpoint=None, foreground=False, cache_dir=cache_dir, options=options)
    mount.adopt(mnt, cache_dir)   # teardown cleans up if storefs mounts anyway
    r = run_storefs(argv, timeout=120)
    lines = r.stderr.splitlines()
    assert r.returncode > 0, f"exit {r.returncode} (a negative one is a signal): {r.stderr[-2000:]!r}"
    assert len(lines) == 1 and lines[0].startswith("storefs: "), f"want one 'storefs: ' line, got {r.stderr[-2000:]!r}"
    assert not is_mounted(mnt)
    return lines[0]


def test_cache_disk_full_at_mount_refuses_with_one_line_instead_of_crashing(mount, corpus):
    """The state the mounts of a cache share (`mounts-v1/shared`) is a mapped file: a store
    into a page of it that has no disk block, on a full filesystem, is a SIGBUS that killed the
    daemon (at mount here; mid-read, at an index write, when the blocks had filled the disk).
    A mount allocates those pages first: on a cache disk with no room it is refused with one
    line naming the file and the fix, before daemonizing, and nothing is left mounted."""
    tmpfs = lambda d: [["mount", "-t", "tmpfs", "-o", "size=1M,mode=0700", "tmpfs", d]]
    with small_disk(mount, "fullfs", tmpfs) as full:
        with open(os.path.join(full, "filler"), "wb") as f:
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * (64 * KiB))
                    f.flush()
        assert os.statvfs(full).f_bavail == 0, "the disk is not full: nothing tested"
        line = refused_in_one_line(mount, full)
        assert "mounts-v1/shared" in line and "No space left" in line and "cache_dir=" in line, line


def test_manifest_index_on_a_cache_disk_that_fills_fails_the_mount_in_one_line(mount, tmp_path):
    """A manifest's index is built in cache_dir, its tables written through a `MAP_SHARED`
    mapping of the file: on a cache disk with room for the names and the build's scratch file
    but not for the tables, a store into the map was a SIGBUS. The pages are allocated first,
    so the mount is refused with one line that names the index and the disk's error."""
    n = 20_000   # names ~120 KiB, scratch records 44 bytes each, tables 40 bytes each
    manifest = tmp_path / "m.csv"
    with open(manifest, "w") as f:
        f.write("name,size,generation\n")
        for i in range(n):
            f.write(f"d/f{i:05d},1,1\n")
    tmpfs = lambda d: [["mount", "-t", "tmpfs", "-o", "size=1280K,mode=0700", "tmpfs", d]]
    with small_disk(mount, "mffs", tmpfs) as small:
        line = refused_in_one_line(mount, small, options=[f"manifest={manifest}"])
        assert "manifest index" in line and "No space left" in line and "cache_dir=" in line, line


FILL = "fill/random-64MiB.bin"


def test_allocation_that_runs_out_of_disk_is_let_go_at_close(mount, emulator):
    """A cache on a small ext4 (a loop image, 47 MiB free) under cache_size=8G: read-ahead
    allocates 16 MiB chunks, and runs of them ahead (docs/architecture.md, "Cache writes"),
    until a `fallocate` runs out of space, which on ext4 keeps what it had allocated. The
    bytes read stay exact, and once the file is closed the cache holds no disk beyond its
    blocks and index: what the failed run allocated is punched with the rest, not left for
    the next mount (the cap does not count it, and the disk is full)."""
    emulator.create_bucket(CB, exist_ok=True)
    body = random.Random(515).randbytes(64 * MiB)
    assert int(emulator.upload(CB, FILL, body)["size"]) == len(body)
    ext4 = lambda d: [["truncate", "-s", "56M", d + ".img"], ["mkfs.ext4", "-q", "-F", "-m", "0", d + ".img"],
                      ["mount", "-o", "loop", d + ".img", d]]
    with small_disk(mount, "ext4", ext4) as disk:
        cache_dir = os.path.join(disk, "cache")
        os.mkdir(cache_dir, 0o700)
        m = mount(CB, cache_dir=cache_dir, options=["cache_size=8G"])
        assert read_file(m.p(FILL)) == body, "bytes differ on a cache disk that fills"
        st = os.statvfs(disk)
        assert st.f_bavail * st.f_frsize < 8 * MiB, "the cache disk never filled: nothing tested"
        assert mount.unmount(m) == []     # every cache file closed
        held = cache_allocated(cache_dir)
        again = mount(CB, cache_dir=cache_dir, options=["cache_size=8G"])
        cached = int(os.getxattr(again.p(FILL), "user.storefs.cached"))
        assert mount.unmount(again) == []
        assert cached > 0, "nothing was cached"
        # Blocks (4 KiB-rounded 16 KiB blocks: their bytes), the header and the index.
        index = 64 * MiB // (16 * KiB) * 8
        assert held <= cached + index + 256 * KiB, \
            f"after close the cache held {held} bytes of disk for {cached} bytes of blocks"


def test_cache_writes_keep_up_reads_every_byte_and_caches_behind_the_reader(mount, proxy, cdata):
    """cache_writes=keep_up: read-ahead's cache copies are written by their own thread. The
    bytes read are exact, and once the writer has caught up (the local disk here keeps up
    with 20 MiB) a remount serves the file with no media request."""
    m = mount(CB, endpoint=proxy.endpoint, options=["cache_writes=keep_up"])
    assert read_file(m.p(SEQ)) == cdata[SEQ]
    settle(proxy)
    before = proxy.counts["media"]
    assert mount.unmount(m) == []        # unmount waits for queued cache writes

    again = mount(CB, endpoint=proxy.endpoint, cache_dir=m.cache_dir, options=["cache_writes=keep_up"])
    assert read_file(again.p(SEQ)) == cdata[SEQ]
    settle(proxy)
    assert proxy.counts["media"] == before, "the remount fetched bytes the first mount had read"


# ---------------------------------------------------------------------- 11. modes, names
def test_cache_layout_modes_and_no_names(mount, cdata):
    m = mount(CB, options=["block_size=64K"])
    for name in SECRET_NAMES + [SMALL]:
        assert read_file(m.p(name)) == cdata[name]
    assert pread_ranges(m.p(SEQ), [(7 * MiB, 100 * KiB)]) == [cdata[SEQ][7 * MiB:7 * MiB + 100 * KiB]]
    assert mount.unmount(m) == []      # nothing half-written while we look

    layout = re.compile(r"v1(/[0-9a-f]{2}(/[0-9a-f]{64}\.blk)?)?|ns-v1(/[0-9a-f]{16}\.log)?|mounts-v1")
    mounts = re.compile(r"mounts-v1/([0-9]{3}|shared)")
    fragments = set()
    for name in SECRET_NAMES + [SMALL, SEQ]:
        for part in re.split(r"[/. ]", name):
            if len(part) >= 4:
                fragments.add(part)
    bad_modes, bad_names, leaks = [], [], []
    files = 0
    for root, dirs, names in os.walk(m.cache_dir):
        rel_root = os.path.relpath(root, m.cache_dir)
        st = os.lstat(root)
        # cache_dir itself keeps the mode it was given (storefs never chmods what it did not
        # create; one others may write is refused); everything storefs made in it is 0700.
        private = stat.S_IMODE(st.st_mode) & 0o022 == 0 if rel_root == "." else stat.S_IMODE(st.st_mode) == 0o700
        if not stat.S_ISDIR(st.st_mode) or not private:
            bad_modes.append(f"{rel_root}: {oct(st.st_mode)}")
        for n in names:
            p = os.path.join(root, n)
            rel = os.path.relpath(p, m.cache_dir)
            st = os.lstat(p)
            files += 1
            if not stat.S_ISREG(st.st_mode) or stat.S_IMODE(st.st_mode) != 0o600:
                bad_modes.append(f"{rel}: {oct(st.st_mode)}")
            if rel == os.path.join("v1", ".lock"):
                files -= 1  # the lock file older versions take alone, named by design
                continue
            if mounts.fullmatch(rel):
                files -= 1  # the mounts sharing the cache: their slots and shared counters
            elif rel.startswith("ns-v1" + os.sep):
                # The stored namespace holds names by design (README, "Offline use"): private
                # (0600, checked above) under private directories, like the blocks.
                if not layout.fullmatch(rel):
                    bad_names.append(rel)
                continue
            elif not layout.fullmatch(rel) or n[:2] != os.path.basename(root):
                bad_names.append(rel)
            with open(p, "rb") as f:
                body = f.read()
            leaks += [f"{rel} contains {frag!r}" for frag in fragments if frag.encode() in body]
        for d in dirs:
            rel = os.path.relpath(os.path.join(root, d), m.cache_dir)
            if not layout.fullmatch(rel):
                bad_names.append(rel + "/")
        for part in [*dirs, *names]:
            bad_names += [f"{part} has {frag!r}" for frag in fragments if frag in part]
    assert files >= len(SECRET_NAMES) + 2, f"only {files} cache files"
    assert bad_modes == [], bad_modes
    assert bad_names == [], bad_names
    assert leaks == [], leaks


# ---------------------------------------------------------------------- 12. bdi readahead
def test_mount_raises_bdi_read_ahead_kb_to_1024(mount, corpus):
    m = mount(BUCKET)
    dev = bdi_of(m.path)
    with open(f"/sys/class/bdi/{dev}/read_ahead_kb") as f:
        value = f.read().strip()
    assert value == "1024", f"/sys/class/bdi/{dev}/read_ahead_kb is {value}"
    with open(m.p("files/hello.txt"), "rb") as f:
        assert f.read() == corpus.data["files/hello.txt"]


# ---------------------------------------------------------------------- 13. memory bound
def test_sequential_read_memory_stays_within_memory_limit(mount, emulator, cdata):
    """memory_limit= bounds what downloads hold: a long sequential read with a read-ahead window
    four times the budget grows the daemon's peak RSS by no more than the budget plus fixed
    buffers (FUSE replies, curl, pooled regions; ~6-12 MiB measured). Read-ahead memory is let
    go once cached, a demand download never holds a part-sized region, and a queued part takes
    no buffer before its download starts (without these the growth was 35-40 MiB)."""
    name, size = "mem/stream-48MiB.bin", 48 * MiB + 4321
    body = random.Random(77).randbytes(size)
    assert int(emulator.upload(CB, name, body)["size"]) == size
    limit = 16 * MiB
    m = mount(CB, options=["memory_limit=16M", "read_ahead=64M", "parallel=4"])
    assert m.pid is not None
    os.stat(m.p(name))
    base = vm_kib(m.pid, "VmRSS") * KiB
    h = hashlib.sha256()
    with open(m.p(name), "rb", buffering=0) as f:
        while True:
            b = f.read(1 * MiB)
            if not b:
                break
            h.update(b)
    assert h.hexdigest() == hashlib.sha256(body).hexdigest(), "bytes differ"
    growth = vm_kib(m.pid, "VmHWM") * KiB - base
    slack = 20 * MiB
    assert growth <= limit + slack, (
        f"peak RSS grew by {growth / MiB:.1f} MiB during the read: more than memory_limit "
        f"({limit / MiB:.0f} MiB) + {slack / MiB:.0f} MiB of fixed buffers")


# ---------------------------------------------------------------------- 14. cached runs ahead
def resident_bytes(path: str) -> int:
    """Bytes of `path` in the page cache now (util-linux fincore)."""
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", path],
                         capture_output=True, text=True, check=True).stdout
    return int(out.split()[0])


def test_a_reader_of_cached_bytes_has_them_read_from_disk_only_a_short_way_ahead(mount, cdata):
    """A sequential reader of a cached file has the kernel read the cache file ahead of it,
    4 MiB ahead (docs/architecture.md, "Cached runs ahead"), not across its whole download
    window: a reader that stops (`head`, readers of slices of one file) left up to the window
    (here the whole 20 MiB file, on a 1 GiB file 200 MiB) read from disk for nothing."""
    m = mount(CB)
    assert read_file(m.p(SEQ)) == cdata[SEQ]
    assert mount.unmount(m) == []
    data = max(cache_files(m.cache_dir), key=os.path.getsize)
    assert os.path.getsize(data) >= SEQ_SIZE, f"no cache file holds {SEQ}: {cache_files(m.cache_dir)}"
    fd = os.open(data, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    assert resident_bytes(data) < 1 * MiB

    again = mount(CB, cache_dir=m.cache_dir)
    # Four 1 MiB reads and no more: the kernel's own readahead is off for this descriptor.
    got = pread_ranges(again.p(SEQ), [(i * MiB, MiB) for i in range(4)], random_access=True)
    assert b"".join(got) == cdata[SEQ][:4 * MiB]
    # The asks run on prefetch threads: let them land, then count what the disk was asked for.
    deadline = time.monotonic() + 2
    seen = resident_bytes(data)
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = resident_bytes(data)
        if now == seen and now >= 4 * MiB:
            break
        seen = now
    assert 4 * MiB <= seen <= 9 * MiB, (
        f"{seen / MiB:.1f} MiB of the cache file read into memory for a reader that read 4 MiB "
        "(want the 4 MiB read and at most 4 MiB ahead, plus the file's index)")
