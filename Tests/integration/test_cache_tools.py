"""Warming and managing the block cache (docs/operations.md, "Warm-up" and "Cache tools"):
`storefs prefetch` through a mount, `storefs cache status|clear`, and a cache directory
deleted under a live mount. Objects live in `tools-bucket`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time

import pytest

from fault_proxy import FaultProxy
from storefs_testlib import read_whole, run_storefs

TB = "tools-bucket"
MiB = 1 << 20
TREE = {
    "warm/a.bin": os.urandom(3 * MiB + 1),
    "warm/b.txt": b"line\n" * 20_000,
    "warm/sub/c.bin": os.urandom(700_000),
    "warm/sub/deeper/d.bin": os.urandom(5 * MiB),
    "warm/empty.txt": b"",
}
SLOW = {f"slow/s{i}.bin": os.urandom(2 * MiB) for i in range(6)}
OTHER = {"other/x.bin": os.urandom(1 * MiB), "other/y.bin": os.urandom(2 * MiB)}


@pytest.fixture(scope="module")
def tbucket(emulator):
    emulator.create_bucket(TB, exist_ok=True)
    for name, data in {**TREE, **SLOW, **OTHER}.items():
        emulator.upload(TB, name, data)
    return emulator


def cached(path: str, want: int | None = None, timeout: float = 5.0) -> int:
    """user.storefs.cached; with `want`, once it reaches it (or its value after `timeout`):
    the attribute answers from the cache as it is, and a download's cache copy is written
    after the read it answered."""
    deadline = time.monotonic() + timeout
    while True:
        value = int(os.getxattr(path, "user.storefs.cached"))
        if want is None or value >= want or time.monotonic() > deadline:
            return value
        time.sleep(0.02)


def storefs(storefs_bin, *args, timeout=120, **kw):
    return run_storefs([storefs_bin, *args], timeout=timeout, **kw)


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


# ---------------------------------------------------------------- prefetch

def test_prefetch_warms_a_tree_that_then_reads_offline(mount, tbucket, proxy, storefs_bin):
    m = mount(TB, endpoint=proxy.endpoint)
    assert all(cached(m.p(n)) == 0 for n in TREE if TREE[n])
    r = storefs(storefs_bin, "prefetch", "-j", "3", m.p("warm"))
    assert r.returncode == 0, r.stderr
    # Not a terminal: plain lines, the last one a summary.
    assert "prefetch: " in r.stderr and "\r" not in r.stderr, r.stderr
    # The empty file needs nothing: it counts as cached.
    assert "4 of 4 files fetched" in r.stderr and "1 already cached" in r.stderr, r.stderr
    for name, data in TREE.items():
        assert cached(m.p(name), len(data)) == len(data), name
    media = proxy.counts.get("media", 0)
    again = storefs(storefs_bin, "prefetch", m.p("warm"))
    assert again.returncode == 0 and "5 already cached" in again.stderr, again.stderr
    assert proxy.counts.get("media", 0) == media, "prefetch read again what was cached"
    # Remount the same cache with the server gone: every prefetched byte is there.
    assert mount.unmount(m) == []
    proxy.cut()
    off = mount(TB, endpoint=proxy.endpoint, cache_dir=m.cache_dir, options=["connect_timeout=2"])
    drop_caches()
    for name, data in TREE.items():
        assert read_whole(off.p(name)) == data, f"{name} was not prefetched"


def test_prefetch_names_every_path_it_could_not_fetch(mount, tbucket, proxy, storefs_bin, tmp_path):
    m = mount(TB, endpoint=proxy.endpoint, options=["negative_ttl=0"])
    outside = tmp_path / "plain.txt"
    outside.write_bytes(b"not in a mount")
    missing = m.p("warm/nope.bin")
    r = storefs(storefs_bin, "prefetch", m.p("other/x.bin"), str(outside), missing, m.p("private"))
    assert r.returncode == 1, r.stderr
    failed = [l for l in r.stderr.splitlines() if "could not fetch" in l]
    assert any(str(outside) in l and "not a file or directory inside a storefs mount" in l for l in failed), r.stderr
    assert any(missing in l for l in failed), r.stderr
    assert any(m.p("private") in l for l in failed), r.stderr
    assert len(failed) == 3, r.stderr
    assert cached(m.p("other/x.bin"), len(OTHER["other/x.bin"])) == len(OTHER["other/x.bin"])
    bad = storefs(storefs_bin, "prefetch", "-j", "0", m.p("other"))
    assert bad.returncode == 2 and "-j 0" in bad.stderr


def test_ctrl_c_stops_prefetch_and_keeps_what_was_fetched(mount, tbucket, emulator, storefs_bin):
    slow = FaultProxy(emulator.http_endpoint, aliases=[emulator.endpoint]).start()  # plain both ways
    try:
        m = mount(TB, endpoint=slow.endpoint)
        # Every media request of s2..s5 waits 20 s: prefetch is still busy when Ctrl-C comes.
        slow.add_rule(kind="media", name_prefix="slow/s", fault="delay", seconds=20,
                      match=lambda req: not req.name.endswith(("s0.bin", "s1.bin")))
        p = subprocess.Popen([storefs_bin, "prefetch", "-j", "1", m.p("slow")], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
        deadline = time.monotonic() + 30
        while cached(m.p("slow/s1.bin")) < 2 * MiB and time.monotonic() < deadline:
            time.sleep(0.05)
        assert cached(m.p("slow/s1.bin"), 2 * MiB) == 2 * MiB
        time.sleep(0.5)
        t0 = time.monotonic()
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=15)
        assert time.monotonic() - t0 < 10, "Ctrl-C did not stop prefetch promptly"
        assert p.returncode == 130, err
        assert "interrupted" in err and "2 of 6 files fetched" in err, err
        assert cached(m.p("slow/s0.bin"), 2 * MiB) == 2 * MiB
    finally:
        slow.stop()


# ---------------------------------------------------------------- cache status / clear

def test_cache_status_and_clear_while_mounted_and_after(mount, tbucket, storefs_bin):
    m = mount(TB, options=["cache_size=512M"])
    for name, data in OTHER.items():
        assert read_whole(m.p(name)) == data
    r = storefs(storefs_bin, "cache", "status", m.cache_dir)
    assert r.returncode == 0, r.stderr
    assert "2 cached object generations" in r.stdout, r.stdout
    assert f"pid {m.pid} mounted at {m.path}" in r.stdout and "512.0 MiB" in r.stdout, r.stdout
    # Clearing under a live mount is refused unless --force.
    r = storefs(storefs_bin, "cache", "clear", m.cache_dir)
    assert r.returncode == 1 and "in use" in r.stderr and "--force" in r.stderr, r.stderr
    assert cached(m.p("other/x.bin"), len(OTHER["other/x.bin"])) == len(OTHER["other/x.bin"])
    r = storefs(storefs_bin, "cache", "clear", "--force", m.cache_dir)
    assert r.returncode == 0 and "through the mount" in r.stdout, (r.stdout, r.stderr)
    assert cached(m.p("other/x.bin")) == 0 and cached(m.p("other/y.bin")) == 0
    assert json.loads(os.getxattr(m.path, "user.storefs.stats"))["cache"]["used_bytes"] < MiB
    assert read_whole(m.p("other/y.bin")) == OTHER["other/y.bin"]   # still reads, from the bucket
    assert mount.unmount(m) == []
    r = storefs(storefs_bin, "cache", "status", m.cache_dir)
    assert "in use:    no" in r.stdout and "1 cached object generations" in r.stdout, r.stdout
    r = storefs(storefs_bin, "cache", "clear", m.cache_dir)
    assert r.returncode == 0 and "1 cached objects" in r.stdout, (r.stdout, r.stderr)
    r = storefs(storefs_bin, "cache", "status", m.cache_dir)
    assert "0 cached object generations" in r.stdout, r.stdout
    again = mount(TB, cache_dir=m.cache_dir)
    assert read_whole(again.p("other/x.bin")) == OTHER["other/x.bin"]


def test_cache_tools_refuse_bad_input(mount, storefs_bin, tmp_path):
    r = storefs(storefs_bin, "cache", "frobnicate")
    assert r.returncode == 2 and "unknown cache command" in r.stderr
    link = tmp_path / "link"
    os.symlink(tmp_path, link)
    r = storefs(storefs_bin, "cache", "clear", str(link))
    assert r.returncode == 1 and "not a directory" in r.stderr, r.stderr
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    os.chown(foreign, 65534, 65534)
    r = storefs(storefs_bin, "cache", "clear", str(foreign))
    assert r.returncode == 1 and "belongs to uid 65534" in r.stderr, r.stderr


# ---------------------------------------------------------------- rm -rf under a live mount

def test_deleting_the_cache_under_a_live_mount_is_recovered(mount, tbucket, storefs_bin):
    m = mount(TB)
    assert read_whole(m.p("other/x.bin")) == OTHER["other/x.bin"]
    version = os.path.join(m.cache_dir, "v1")
    shutil.rmtree(version)
    # A new object: the daemon makes the directory again and caches into it.
    assert read_whole(m.p("other/y.bin")) == OTHER["other/y.bin"]
    assert os.path.isdir(version) and (os.stat(version).st_mode & 0o777) == 0o700
    assert cached(m.p("other/y.bin"), len(OTHER["other/y.bin"])) == len(OTHER["other/y.bin"])
    blk = [f for _, _, fs in os.walk(version) for f in fs if f.endswith(".blk")]
    assert len(blk) == 1, blk
    # The mount kept the cache: a second mount of the same cache_dir joins it and finds what
    # the first one cached into the directory made again.
    second = mount(TB, cache_dir=m.cache_dir)
    assert cached(second.p("other/y.bin")) == len(OTHER["other/y.bin"])
    assert read_whole(second.p("other/y.bin")) == OTHER["other/y.bin"]
    # The file read before the deletion is read (and cached) again.
    assert read_whole(m.p("other/x.bin")) == OTHER["other/x.bin"]
    assert cached(m.p("other/x.bin"), len(OTHER["other/x.bin"])) == len(OTHER["other/x.bin"])
    r = storefs(storefs_bin, "cache", "status", m.cache_dir)
    assert f"pid {m.pid}" in r.stdout and f"pid {second.pid}" in r.stdout, r.stdout
