"""Many mounts, one cache (issue 45; docs/cache.md): several storefs processes over one
cache_dir, through real FUSE mounts of one https fake-gcs-server (the `proxy` fixture counts
the media requests that reach it).

- what one mount read is served to the others without a request: two mounts (another mount
  point and another prefix of the bucket), and four;
- one cap for the directory, held on disk while several mounts read at once, the smallest
  cache_size of the live mounts winning;
- eviction races: a small cache, several readers in several mounts over the same objects;
- kill -9 rounds: one mount killed at a random moment while all read, the others reading on
  byte for byte, the killed one mounted again; the cache on disk audited each round;
- `storefs cache status|clear` with several mounts; another block size, and another user's
  process, refused with one line.

Objects live in `shared-bucket`. Seeds: env STOREFS_SHARED_SEED; rounds:
STOREFS_SHARED_CRASH_ROUNDS (default 3).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from types import SimpleNamespace

import pytest

from storefs_testlib import ForbiddingProxy, read_whole, run_storefs, wait_for, wait_pid_gone
from test_cache import cache_allocated, force_unmount_dead, run_random_readers, settle
from test_crash import audit_cache

SB = "shared-bucket"
KiB, MiB = 1 << 10, 1 << 20
SEED = int(os.environ.get("STOREFS_SHARED_SEED", "20261207"))
ROUNDS = int(os.environ.get("STOREFS_SHARED_CRASH_ROUNDS", "3"))
_rng = random.Random(SEED)
DIR_X = "dir/x.bin"
OBJS = [f"objs/o{i}.bin" for i in range(4)]
BIG = [f"big/b{i}.bin" for i in range(3)]
DATA = {DIR_X: _rng.randbytes(6 * MiB + 1234)}
DATA.update({name: _rng.randbytes(3 * MiB + 777 * i) for i, name in enumerate(OBJS)})
DATA.update({name: _rng.randbytes(8 * MiB + 4321 * i) for i, name in enumerate(BIG)})


RESOURCES: dict[str, dict] = {}


@pytest.fixture(scope="module")
def sbucket(emulator):
    emulator.create_bucket(SB, exist_ok=True)
    for name, data in DATA.items():
        RESOURCES[name] = emulator.upload(SB, name, data)
        assert int(RESOURCES[name]["size"]) == len(data), name
    return emulator


def block_bytes(cache_dir: str) -> int:
    """Disk the block files take (what the cap covers: not the stored namespaces nor the
    mounts' small shared files)."""
    return cache_allocated(os.path.join(cache_dir, "v1"))


def stats(m) -> dict:
    return json.loads(os.getxattr(m.path, "user.storefs.stats"))


def storefs(storefs_bin, *args, timeout=120):
    return run_storefs([storefs_bin, *args], timeout=timeout)


# ---------------------------------------------------------------- served without a request

def test_a_file_one_mount_read_is_served_to_another_mount_of_another_prefix_without_a_request(mount, sbucket, proxy):
    a = mount(SB, endpoint=proxy.endpoint)
    b = mount(f"gs://{SB}/dir", endpoint=proxy.endpoint, cache_dir=a.cache_dir)
    assert read_whole(a.p(DIR_X)) == DATA[DIR_X]
    settle(proxy)   # read-ahead still landing is the first mount's
    before = proxy.counts["media"]
    assert before > 0
    # The other mount: its own mount point, the bucket's `dir/` prefix as its root.
    assert read_whole(b.p("x.bin")) == DATA[DIR_X]
    ranges = [(0, 1), (5 * MiB - 3, 70_000), (6 * MiB, 1234), (123_456, 2 * MiB)]
    fd = os.open(b.p("x.bin"), os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        assert [os.pread(fd, n, o) for o, n in ranges] == [DATA[DIR_X][o:o + n] for o, n in ranges]
    finally:
        os.close(fd)
    settle(proxy)
    extra = [r.path for r in proxy.requests("media")][before:]
    assert proxy.counts["media"] == before, f"the second mount made {len(extra)} media request(s): {extra[:4]}"
    assert int(os.getxattr(b.p("x.bin"), "user.storefs.cached")) == len(DATA[DIR_X])
    # One copy on disk, counted once by both.
    assert block_bytes(a.cache_dir) < len(DATA[DIR_X]) + 2 * MiB, f"{block_bytes(a.cache_dir)} bytes on disk"
    assert stats(a)["cache"]["used_bytes"] == stats(b)["cache"]["used_bytes"]


def test_four_mounts_each_read_one_file_then_every_mount_reads_every_file_without_a_request(mount, sbucket, proxy):
    first = mount(SB, endpoint=proxy.endpoint)
    mounts = [first] + [mount(SB, endpoint=proxy.endpoint, cache_dir=first.cache_dir) for _ in range(3)]
    pids = {m.pid for m in mounts}
    assert len(pids) == 4
    # At once, each mount its own file.
    errors: list[str] = []

    def read_one(m, name):
        if read_whole(m.p(name)) != DATA[name]:
            errors.append(f"{name} through {m.path}")

    ts = [threading.Thread(target=read_one, args=(m, name)) for m, name in zip(mounts, OBJS)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=120)
    assert errors == []
    settle(proxy)
    before = proxy.counts["media"]
    for m in mounts:
        for name in OBJS:
            assert read_whole(m.p(name)) == DATA[name], f"{name} through {m.path}"
    settle(proxy)
    assert proxy.counts["media"] == before, \
        f"{proxy.counts['media'] - before} media request(s) for files another mount had read"
    total = sum(len(DATA[n]) for n in OBJS)
    assert block_bytes(first.cache_dir) < total + 2 * MiB, \
        f"{block_bytes(first.cache_dir)} bytes on disk for {total} bytes of objects: more than one copy"


# ---------------------------------------------------------------- one cap

def test_one_cap_held_on_disk_while_three_mounts_read_at_once_and_the_smallest_cache_size_wins(mount, sbucket):
    cap, slack = 8 * MiB, 1 * MiB
    a = mount(SB, options=["cache_size=32M"])
    b = mount(SB, options=["cache_size=8M"], cache_dir=a.cache_dir)
    c = mount(SB, options=["cache_size=16M"], cache_dir=a.cache_dir)
    assert {stats(m)["cache"]["capacity_bytes"] for m in (a, b, c)} == {cap}
    stop = threading.Event()
    peak = [0]

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], block_bytes(a.cache_dir))
            time.sleep(0.005)

    errors: list[str] = []

    def read_all(m, names):
        for name in names:
            if read_whole(m.p(name)) != DATA[name]:
                errors.append(f"{name} through {m.path}")

    sampler = threading.Thread(target=sample)
    sampler.start()
    plan = [(a, [BIG[0], BIG[1], OBJS[0]]), (b, [BIG[1], BIG[2], OBJS[1]]), (c, [BIG[2], BIG[0], OBJS[2]])]
    ts = [threading.Thread(target=read_all, args=p) for p in plan]
    try:
        for t in ts:
            t.start()
        for t in ts:
            t.join(timeout=300)
    finally:
        stop.set()
        sampler.join()
    assert errors == []
    assert peak[0] <= cap + slack, f"the cache reached {peak[0]} bytes on disk (cap {cap} + {slack})"
    assert peak[0] >= cap // 2, f"the cache peaked at only {peak[0]} bytes: is it caching at all?"
    # The readers have their bytes; cache copies of the last parts may still be landing: the
    # count (which reserves before a write) and the disk agree once they have.
    def agreed() -> bool:
        used = stats(a)["cache"]["used_bytes"]
        return used <= cap and abs(used - block_bytes(a.cache_dir)) <= slack
    assert wait_for(agreed, 15), \
        f"counted {stats(a)['cache']['used_bytes']}, on disk {block_bytes(a.cache_dir)}"
    # The mount with the smallest cache_size gone, the others' larger cap comes back.
    assert mount.unmount(b) == []
    deadline = time.monotonic() + 30
    while stats(a)["cache"]["capacity_bytes"] != 16 * MiB and time.monotonic() < deadline:
        time.sleep(0.5)
    assert stats(a)["cache"]["capacity_bytes"] == 16 * MiB


def test_eviction_races_small_cache_many_readers_in_two_mounts_exact_bytes(mount, sbucket):
    a = mount(SB, options=["cache_size=4M", "block_size=64K"])
    b = mount(SB, options=["cache_size=4M", "block_size=64K"], cache_dir=a.cache_dir)
    errors: list[str] = []

    def readers(m, name, seed):
        errors.extend(run_random_readers(m.p(name), DATA[name], seed, threads=3, handles=2, ops_per_thread=40))

    ts = [threading.Thread(target=readers, args=(m, name, SEED + i))
          for i, (m, name) in enumerate([(a, OBJS[0]), (b, OBJS[0]), (a, OBJS[1]), (b, OBJS[1]), (b, DIR_X)])]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=300)
    assert errors == [], errors[:5]
    assert block_bytes(a.cache_dir) <= 4 * MiB + MiB
    assert stats(a)["cache"]["evicted_blocks"] + stats(b)["cache"]["evicted_blocks"] > 0, "nothing was evicted"


# ---------------------------------------------------------------- kill -9 rounds

@pytest.mark.parametrize("rnd", range(ROUNDS), ids=[f"round{r + 1}" for r in range(ROUNDS)])
def test_kill_9_of_one_mount_while_all_read_the_others_read_on_byte_for_byte(mount, sbucket, rnd, shared_dir,
                                                                           round_proxy):
    proxy = round_proxy
    rng = random.Random(SEED * 100 + rnd)
    options = ["cache_size=12M"]
    mounts = [mount(SB, endpoint=proxy.endpoint, options=options, cache_dir=shared_dir) for _ in range(3)]
    victim = rng.randrange(3)
    names = [OBJS[0], OBJS[1], DIR_X, BIG[0]]
    killed = threading.Event()
    stop = threading.Event()
    wrong: list[str] = []
    survivor_errors: list[str] = []
    survivor_bytes = [0]

    def reader(i: int, m, survivor: bool) -> None:
        r = random.Random(SEED * 1000 + rnd * 10 + i)
        while not stop.is_set():
            name = r.choice(names)
            data = DATA[name]
            try:
                fd = os.open(m.p(name), os.O_RDONLY)
            except OSError as exc:
                if survivor:
                    survivor_errors.append(f"open {name} through survivor {i}: {exc!r}")
                return
            try:
                if r.random() < 0.3:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                off = r.randrange(len(data))
                for _ in range(r.randint(1, 24)):
                    got = os.pread(fd, r.choice([4 * KiB, 100_000, 256 * KiB]), off)
                    if got != data[off:off + len(got)] or (not got and off < len(data)):
                        wrong.append(f"{name} at {off} through mount {i} ({'after' if killed.is_set() else 'before'} the kill)")
                        return
                    if survivor and killed.is_set():
                        survivor_bytes[0] += len(got)
                    off += len(got)
                    if not got:
                        break
            except OSError as exc:
                if survivor:
                    survivor_errors.append(f"{name} through survivor {i}: {exc!r}")
                return
            finally:
                try:
                    os.close(fd)
                except OSError:
                    pass

    threads = [threading.Thread(target=reader, args=(i * 2 + k, m, i != victim), daemon=True)
               for i, m in enumerate(mounts) for k in range(2)]
    for t in threads:
        t.start()
    time.sleep(rng.uniform(0.1, 1.0))
    killed.set()
    os.kill(mounts[victim].pid, signal.SIGKILL)
    assert wait_pid_gone(mounts[victim].pid, 10)
    time.sleep(1.5)          # the survivors read on
    stop.set()
    for t in threads:
        t.join(timeout=30)
    force_unmount_dead(mounts[victim].path)
    where = f"seed {SEED}, round {rnd + 1}, mount {victim} killed"
    assert wrong == [], f"wrong bytes ({where}): {wrong[:5]}"
    assert survivor_errors == [], f"a survivor failed ({where}): {survivor_errors[:5]}"
    assert survivor_bytes[0] > 0, f"the survivors read nothing after the kill ({where})"
    # The cache on disk: no block passes its check with wrong bytes.
    corpus = SimpleNamespace(data=DATA, resources=RESOURCES)
    _servable, _torn, problems, _used = audit_cache(shared_dir, corpus, proxy.endpoint, bucket=SB, objects=names)
    assert problems == [], f"the cache after the kill ({where}): {problems[:5]}"
    # The killed one mounted again: every byte right.
    again = mount(SB, endpoint=proxy.endpoint, options=options, cache_dir=shared_dir)
    for name in names:
        assert read_whole(again.p(name)) == DATA[name], f"{name} after the restart ({where})"
    for m in [again] + [m for i, m in enumerate(mounts) if i != victim]:
        assert m.proc.poll() is None
        assert mount.unmount(m) == []


@pytest.fixture(scope="module")
def round_proxy(emulator):
    """One proxy for every kill round: cache keys include the endpoint, so the rounds share
    cached blocks only if they reach the bucket by the same URL."""
    p = ForbiddingProxy(emulator.http_endpoint, aliases=[emulator.endpoint])
    p.start()
    yield p
    p.stop()


@pytest.fixture(scope="module")
def shared_dir():
    """One cache_dir for every kill round (0700, under /tmp): each round starts on what the
    killed mounts of the rounds before left."""
    d = tempfile.mkdtemp(prefix="storefs-shared-cache-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


# ---------------------------------------------------------------- tools, refusals

def test_cache_status_lists_every_mount_and_clear_goes_through_each(mount, sbucket, storefs_bin):
    a = mount(SB, options=["cache_size=64M"])
    b = mount(SB, options=["cache_size=32M"], cache_dir=a.cache_dir)
    assert read_whole(a.p(OBJS[2])) == DATA[OBJS[2]]
    r = storefs(storefs_bin, "cache", "status", a.cache_dir)
    assert r.returncode == 0, r.stderr
    assert f"pid {a.pid} mounted at {a.path}" in r.stdout and f"pid {b.pid} mounted at {b.path}" in r.stdout, r.stdout
    assert "by 2 mounts" in r.stdout and "32.0 MiB" in r.stdout, r.stdout
    r = storefs(storefs_bin, "cache", "clear", a.cache_dir)
    assert r.returncode == 1 and f"pid {a.pid}" in r.stderr and f"pid {b.pid}" in r.stderr and "--force" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = storefs(storefs_bin, "cache", "clear", "--force", a.cache_dir)
    assert r.returncode == 0 and r.stdout.count("through the mount") == 2, (r.stdout, r.stderr)
    assert int(os.getxattr(b.p(OBJS[2]), "user.storefs.cached")) == 0
    assert read_whole(b.p(OBJS[2])) == DATA[OBJS[2]]   # from the bucket again


def test_a_mount_of_another_block_size_is_refused_with_one_line(mount, sbucket):
    a = mount(SB)
    mnt = mount.new_dir("mnt")
    argv, _ = mount.argv(SB, mnt, endpoint=None, options=["block_size=64K"], cache_dir=a.cache_dir)
    r = run_storefs(argv)
    assert r.returncode != 0 and not os.path.ismount(mnt)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "block_size=16384" in lines[0] and f"pid {a.pid}" in lines[0], r.stderr
    assert read_whole(a.p(OBJS[3])) == DATA[OBJS[3]]


def test_a_cache_two_mounts_share_refuses_another_users_process_with_one_line(mount, sbucket, storefs_bin):
    a = mount(SB)
    b = mount(SB, cache_dir=a.cache_dir)
    name = "sfs" + os.urandom(4).hex()
    r = subprocess.run(["useradd", "-M", "-s", "/usr/sbin/nologin", name], capture_output=True, text=True)
    assert r.returncode == 0, f"useradd failed: {r.stderr} (this test needs root)"
    try:
        import pwd
        pw = pwd.getpwnam(name)
        mnt = tempfile.mkdtemp(prefix="storefs-other-")
        os.chown(mnt, pw.pw_uid, pw.pw_gid)
        # The https emulator's CA where the other user can read it.
        ca_dir = tempfile.mkdtemp(prefix="storefs-ca-")
        os.chmod(ca_dir, 0o755)
        ca = os.path.join(ca_dir, "ca.pem")
        shutil.copy(mount.ca_file, ca)
        os.chmod(ca, 0o644)
        argv, _ = mount.argv(SB, mnt, endpoint=None, cache_dir=a.cache_dir, ca_file=ca)
        os.chmod(os.path.dirname(a.cache_dir), 0o755)   # it may reach the directory, not into it
        p = subprocess.run(argv, user=pw.pw_uid, group=pw.pw_gid, extra_groups=[], capture_output=True,
                           text=True, timeout=60, start_new_session=True)
        assert p.returncode != 0 and not os.path.ismount(mnt), p.stderr
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and "not by the mounting user" in lines[0], p.stderr
        assert read_whole(a.p(OBJS[3])) == DATA[OBJS[3]]
        assert read_whole(b.p(OBJS[3])) == DATA[OBJS[3]]
        assert {m.pid for m in (a, b)} == {m.pid for m in (a, b) if m.proc.poll() is None}
        shutil.rmtree(ca_dir)
        os.rmdir(mnt)
    finally:
        subprocess.run(["userdel", name], capture_output=True)
