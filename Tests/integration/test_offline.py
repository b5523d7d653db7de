"""A namespace that outlives the kernel's memory and the server (docs/architecture.md,
"Offline namespace"): read a tree once, unmount, and with the server gone mount the same
cache again — every cached byte of a known path is readable after drop_caches, a listed
directory lists from what was stored (stale, and the log says so), an uncached read fails
with EIO in bounded time. `offline=never` keeps the fail-fast mount; without a stored
namespace an unreachable endpoint stays a one-line error.

The server is the `proxy` fixture in front of the emulator; `cut()` makes it go away
(refused connections). Objects live in `offline-bucket`.
"""

from __future__ import annotations

import errno
import os
import subprocess
import time

import pytest

from storefs_testlib import read_whole

OB = "offline-bucket"
FILES = {
    "trip/a.bin": os.urandom(300_000),
    "trip/b.txt": b"boarding pass\n" * 100,
    "trip/maps/city.bin": os.urandom(70_000),
}
UNREAD = "trip/unread.bin"


@pytest.fixture(scope="module")
def obucket(emulator):
    emulator.create_bucket(OB, exist_ok=True)
    for name, data in FILES.items():
        emulator.upload(OB, name, data)
    emulator.upload(OB, UNREAD, os.urandom(50_000))
    return emulator


def _drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def _first_mount(mount, proxy):
    m = mount(OB, endpoint=proxy.endpoint)
    for name, data in FILES.items():
        assert read_whole(m.p(name)) == data
    assert sorted(os.listdir(m.p("trip"))) == ["a.bin", "b.txt", "maps", "unread.bin"]
    return m


def test_offline_remount_reads_every_cached_byte(mount, obucket, proxy):
    first = _first_mount(mount, proxy)
    assert mount.unmount(first) == []
    proxy.cut()
    t0 = time.monotonic()
    m = mount(OB, endpoint=proxy.endpoint, cache_dir=first.cache_dir, options=["connect_timeout=2"])
    assert time.monotonic() - t0 < 30
    assert "mounting offline" in m.stderr(), m.stderr()
    _drop_caches()
    for name, data in FILES.items():
        assert read_whole(m.p(name)) == data, f"{name}: cached bytes not served offline"
        assert os.stat(m.p(name)).st_size == len(data)
    # The listing stored at the first mount answers, and the log says it is stale.
    assert sorted(os.listdir(m.p("trip"))) == ["a.bin", "b.txt", "maps", "unread.bin"]
    assert "stale listing" in m.stderr(), m.stderr()
    # A known name whose bytes were never cached: EIO, in bounded time.
    t0 = time.monotonic()
    with pytest.raises(OSError) as e:
        read_whole(m.p(UNREAD))
    assert e.value.errno == errno.EIO, repr(e.value)
    assert time.monotonic() - t0 < 20


def test_offline_never_fails_fast(mount, obucket, proxy, storefs_bin):
    first = _first_mount(mount, proxy)
    assert mount.unmount(first) == []
    proxy.cut()
    mnt = mount.new_dir("mnt")
    argv, _ = mount.argv(OB, mnt, endpoint=proxy.endpoint, cache_dir=first.cache_dir,
                         options=["offline=never", "connect_timeout=2"])
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1, r.stderr
    assert not os.path.ismount(mnt)


def test_unreachable_without_a_stored_namespace_is_one_line(mount, proxy):
    proxy.cut()
    mnt = mount.new_dir("mnt")
    argv, _ = mount.argv(OB, mnt, endpoint=proxy.endpoint, options=["connect_timeout=2"])
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and "endpoint" in lines[0], r.stderr
    assert not os.path.ismount(mnt)


def test_fresh_answers_replace_stored_ones(mount, obucket, proxy, emulator):
    first = _first_mount(mount, proxy)
    assert mount.unmount(first) == []
    emulator.upload(OB, "trip/b.txt", b"rebooked\n")
    try:
        m = mount(OB, endpoint=proxy.endpoint, cache_dir=first.cache_dir)
        assert read_whole(m.p("trip/b.txt")) == b"rebooked\n"
    finally:
        emulator.upload(OB, "trip/b.txt", FILES["trip/b.txt"])
