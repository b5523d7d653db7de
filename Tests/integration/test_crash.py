"""Crash consistency of the block cache: kill -9 at random moments under parallel readers.

Each round (env STOREFS_CRASH_ROUNDS, default 3; scripts/stress runs 30) mounts the corpus
bucket on one cache_dir shared by every round, starts 4-8 reader threads doing random and
sequential reads over a few objects (the 24 MiB one among them), and SIGKILLs storefs at a
seeded random moment 0.05-1.0 s later, while downloads and cache writes are in flight. The
dead mount is taken down (fusermount3 -u, else umount -l) and the same cache_dir mounted again.
Then:

1. the cache on disk is audited: every block whose index entry is present and whose bytes pass
   their CRC32C must hold the object's bytes (a torn block fails its CRC and is refetched: fine;
   a block that passes its CRC with wrong bytes would be served: a failure);
2. those audited blocks are read through the new mount with no media request (the cache
   survived the crash: the byte checks below really exercise cached data);
3. every object is read whole and at random and compared byte for byte with the upload.

The cache is capped (cache_size=12M) below the working set, so every round misses, downloads,
writes and evicts (punches holes) while it is killed. Every round reaches the emulator through
one module-wide ForbiddingProxy (cache keys include the endpoint, so a per-test proxy on a new
port would start each round on an unusable cache); its counters show what was downloaded.
Seeds: env STOREFS_CRASH_SEED.
test_cache.py's test_kill_9_mid_read_then_remount_reads_every_byte is the single, fixed-time
version of this.
"""

from __future__ import annotations

import errno
import hashlib
import os
import random
import shutil
import signal
import struct
import subprocess
import tempfile
import threading
import time

import pytest

from storefs_testlib import BUCKET, Corpus, ForbiddingProxy, crc32c, is_mounted, read_whole, wait_pid_gone

KiB, MiB = 1 << 10, 1 << 20
ROUNDS = int(os.environ.get("STOREFS_CRASH_ROUNDS", "3"))
SEED = int(os.environ.get("STOREFS_CRASH_SEED", "20261130"))
OBJECTS = [Corpus.BIG, "files/lines.txt", Corpus.GZIP, "files/hello.txt"]
WEIGHTS = [6, 2, 2, 1]
OPTIONS = ["cache_size=12M"]
JOIN_S = 20.0            # a reader still inside the dead mount after this is a hang




# ====================================================================== helpers
@pytest.fixture(scope="module")
def shared_cache():
    """One cache_dir for every round of this module (0700, under /tmp)."""
    d = tempfile.mkdtemp(prefix="storefs-crash-cache-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def crash_proxy(emulator):
    """One proxy for every round: cache keys include the endpoint, so the rounds share cached
    blocks only if they reach the bucket by the same URL."""
    p = ForbiddingProxy(emulator.endpoint)
    p.start()
    yield p
    p.stop()


def key_hash(endpoint: str, bucket: str, name: str, generation: int) -> str:
    """The cache file name's hash (BlockCache.keyHash)."""
    key = b"storefs-cache-key-v1"
    for part in (endpoint, bucket, name, str(generation)):
        key += b"\0" + part.encode()
    return hashlib.sha256(key).hexdigest()


def first_difference(got: bytes, want: bytes) -> int:
    return next((k for k in range(min(len(got), len(want))) if got[k] != want[k]),
                min(len(got), len(want)))


def take_down_dead_mount(path: str) -> None:
    subprocess.run(["fusermount3", "-u", path], capture_output=True, timeout=30)
    if is_mounted(path):
        subprocess.run(["umount", "-l", path], capture_output=True, timeout=30)
    assert not is_mounted(path), f"{path} still mounted after fusermount3 -u and umount -l"


def audit_cache(cache_dir: str, corpus: Corpus, endpoint: str, bucket: str = BUCKET, objects=OBJECTS
                ) -> tuple[list[tuple[str, int, int, int]], int, list[str], int]:
    """Checks every cache file on disk against the corpus.

    Returns (servable blocks as (object, block, offset, length), torn blocks, problems, bytes
    the cache holds as storefs counts them: header pages plus present blocks rounded to 4 KiB).
    A block is servable when its index entry is present and its bytes pass the CRC; such a
    block holding anything but the object's bytes is a problem (storefs would serve it)."""
    by_key = {key_hash(endpoint, bucket, n, int(corpus.resources[n]["generation"])): n
              for n in objects}
    servable, torn, problems, used = [], 0, [], 0
    for root, _dirs, files in os.walk(os.path.join(cache_dir, "v1")):
        for fname in files:
            if not fname.endswith(".blk"):
                continue
            p = os.path.join(root, fname)
            with open(p, "rb") as f:
                head = f.read(128)
                if len(head) < 128 or head[:8] != b"STFSBLK\0":
                    continue      # not a valid file: storefs discards it at load
                if struct.unpack_from("<I", head, 68)[0] != crc32c(head[:68]):
                    continue
                block_size, size, gen = struct.unpack_from("<Iqq", head, 12)
                count = struct.unpack_from("<I", head, 64)[0]
                name = by_key.get(fname[:-4])
                if name is None:
                    problems.append(f"{p}: a cache file for no object of this test "
                                    f"(size {size}, generation {gen})")
                    continue
                if head[32:64].hex() != fname[:-4] or size != len(corpus.data[name]):
                    problems.append(f"{p}: a valid header that does not match its name")
                    continue
                data = corpus.data[name]
                raw = f.read(8 * count)
                data_offset = (128 + 8 * count + 4095) // 4096 * 4096
                used += data_offset
                for i in range(count):
                    crc, n = struct.unpack_from("<II", raw, 8 * i)
                    off = i * block_size
                    if n == 0 or n != min(block_size, size - off):
                        continue
                    used += (n + 4095) // 4096 * 4096
                    f.seek(data_offset + i * block_size)
                    stored = f.read(n)
                    if stored == data[off:off + n]:
                        if crc == crc32c(stored):
                            servable.append((name, i, off, n))
                        else:
                            torn += 1      # right bytes, stale CRC: refetched, harmless
                    elif crc32c(stored) == crc:
                        problems.append(f"{name} block {i} (offset {off}) passes its CRC with "
                                        f"wrong bytes (first difference at "
                                        f"+{first_difference(stored, data[off:off + n])})")
                    else:
                        torn += 1
    return servable, torn, problems, used


# ====================================================================== the rounds
@pytest.mark.parametrize("rnd", range(ROUNDS), ids=[f"round{r + 1}" for r in range(ROUNDS)])
def test_kill_9_at_a_random_moment_under_parallel_readers(mount, crash_proxy, corpus, shared_cache,
                                                          rnd):
    proxy = crash_proxy
    rng = random.Random(SEED * 1000 + rnd)
    n_threads = rng.randint(4, 8)
    kill_after = rng.uniform(0.05, 1.0)
    proxy.media_delay = rng.choice([0.0, 0.0, 0.02, 0.1])
    where = (f"seed {SEED}, round {rnd + 1}: {n_threads} readers, kill after {kill_after:.3f} s, "
             f"media delay {proxy.media_delay} s")

    m = mount(BUCKET, endpoint=proxy.endpoint, options=OPTIONS, cache_dir=shared_cache)
    assert m.pid is not None
    for name in OBJECTS:     # looked up before the clock starts: the readers go straight to data
        assert os.stat(m.p(name)).st_size == len(corpus.data[name])

    start = threading.Barrier(n_threads + 1)
    killed = threading.Event()
    wrong: list[str] = []
    early_errors: list[str] = []
    late_errors: list[str] = []
    verified = [0] * n_threads

    def check(i: int, name: str, off: int, got: bytes) -> bool:
        want = corpus.data[name][off:off + len(got)]
        if got != want or (len(got) == 0 and off < len(corpus.data[name])):
            wrong.append(f"reader {i}: {name} at {off}: {len(got)} bytes, first difference at "
                         f"+{first_difference(got, want)} ({'after' if killed.is_set() else 'before'} "
                         "the kill)")
            return False
        verified[i] += len(got)
        return True

    def reader(i: int) -> None:
        r = random.Random(SEED * 1000 + rnd * 100 + i)
        try:
            start.wait(timeout=30)
            for _op in range(10_000):                 # bounded; the kill ends it long before
                if killed.is_set():
                    return
                name = r.choices(OBJECTS, WEIGHTS)[0]
                size = len(corpus.data[name])
                fd = os.open(m.p(name), os.O_RDONLY)
                try:
                    if r.random() < 0.3:
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    if r.random() < 0.5:             # sequential run from a random place
                        off = r.randrange(size) if size else 0
                        for _ in range(r.randint(1, 48)):
                            got = os.pread(fd, 256 * KiB, off)
                            if not check(i, name, off, got) or not got:
                                break
                            off += len(got)
                    else:                             # random preads, 1 B .. 1 MiB
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
                        for _ in range(r.randint(1, 16)):
                            off = r.randrange(size + 1)
                            n = max(1, int(2 ** r.uniform(0, 20)))
                            if not check(i, name, off, os.pread(fd, n, off)):
                                break
                finally:
                    try:
                        os.close(fd)
                    except OSError:                   # ENOTCONN from a dead mount's flush
                        pass
        except OSError as exc:
            text = f"reader {i}: {errno.errorcode.get(exc.errno, exc.errno)}"
            (late_errors if killed.is_set() else early_errors).append(text)
        except threading.BrokenBarrierError:
            early_errors.append(f"reader {i}: the start barrier broke")

    threads = [threading.Thread(target=reader, args=(i,), daemon=True) for i in range(n_threads)]
    for t in threads:
        t.start()
    start.wait(timeout=30)
    time.sleep(kill_after)
    in_flight = proxy.started["media"] - proxy.counts["media"]
    killed.set()
    os.kill(m.pid, signal.SIGKILL)
    assert wait_pid_gone(m.pid, 10), "storefs still alive 10 s after SIGKILL"
    deadline = time.monotonic() + JOIN_S
    for t in threads:
        t.join(timeout=max(0.1, deadline - time.monotonic()))
    hung = sum(t.is_alive() for t in threads)
    take_down_dead_mount(m.path)
    assert hung == 0, f"{hung} reader(s) still inside the dead mount after {JOIN_S:.0f} s ({where})"
    assert wrong == [], f"wrong bytes before/at the kill ({where}):\n" + "\n".join(wrong[:10])
    assert early_errors == [], f"read errors before the kill ({where}): {early_errors}"

    # -------------------------------------------------------------- the cache on disk
    servable, torn, problems, used = audit_cache(shared_cache, corpus, proxy.endpoint)
    assert problems == [], f"the cache after the crash ({where}):\n" + "\n".join(problems[:10])

    # -------------------------------------------------------------- the same cache, remounted
    proxy.media_delay = 0.0
    again = mount(BUCKET, endpoint=proxy.endpoint, options=OPTIONS + ["read_ahead=0", "log_level=debug"],
                  cache_dir=shared_cache)
    before = proxy.counts["media"]
    sample = servable if len(servable) <= 400 else random.Random(rnd).sample(servable, 400)
    for name in OBJECTS:
        mine = [(off, n) for nm, _i, off, n in sample if nm == name]
        if not mine:
            continue
        fd = os.open(again.p(name), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            for off, n in mine:
                got = os.pread(fd, min(n, 4 * KiB), off)
                assert got == corpus.data[name][off:off + len(got)], \
                    f"{name}: a block valid on disk reads wrong at {off} ({where})"
        finally:
            os.close(fd)
    refetched = [f"{r.name} {r.range}" for r in proxy.requests("media")][before:]
    assert proxy.counts["media"] == before, (
        f"{len(refetched)} media request(s) for {len(sample)} blocks the cache held after the "
        f"crash ({used} bytes on disk, {len(servable)} valid blocks, {torn} torn): was the cache "
        f"thrown away? ({where}) {refetched[:8]}\nsampled: {sorted(sample)[:8]}\n"
        f"storefs log:\n{again.stderr()[-3000:]}")

    for name in OBJECTS:
        data = corpus.data[name]
        got = read_whole(again.p(name))
        assert len(got) == len(data) and got == data, (
            f"{name}: {len(got)} bytes after the remount, first difference at "
            f"+{first_difference(got, data)} ({where})")
    big = corpus.data[Corpus.BIG]
    r = random.Random(SEED + rnd)
    ranges = [(r.randrange(len(big)), r.choice([1, 4096, 16 * KiB + 1, 300 * KiB]))
              for _ in range(60)]
    fd = os.open(again.p(Corpus.BIG), os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        bad = [(o, n) for o, n in ranges if os.pread(fd, n, o) != big[o:o + n]]
    finally:
        os.close(fd)
    assert bad == [], f"random reads after the remount differ at {bad[:5]} ({where})"
    assert again.proc.poll() is None, "storefs exited"
    assert mount.unmount(again) == []
    print(f"\n{where}: {sum(verified)} bytes verified before the kill, {in_flight} media "
          f"request(s) in flight, late errors {sorted(set(e.split(': ')[1] for e in late_errors))}, "
          f"{len(servable)} valid and {torn} torn block(s) on disk after the crash")
