"""Open-file limits (issue 43, item 3): other users of an `allow_other` mount choose how many
files are open, and each open file holds a cache descriptor. storefs raises its soft limit
to the hard one, and running out of descriptors never pauses the block cache for everyone.
"""

from __future__ import annotations

import os
import resource
import time

from storefs_testlib import BUCKET, Corpus, read_whole


def limits_of(pid: int) -> tuple[int, int]:
    with open(f"/proc/{pid}/limits") as f:
        for line in f:
            if line.startswith("Max open files"):
                soft, hard = line.split()[3:5]
                return int(soft), int(hard)
    raise AssertionError("no open-file limit in /proc/PID/limits")


def test_the_open_file_limit_is_raised_to_the_hard_one(mount):
    m = mount(BUCKET, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, 4096)))
    assert limits_of(m.pid) == (4096, 4096)


def test_running_out_of_descriptors_does_not_pause_the_cache(mount, corpus):
    # A hard limit storefs cannot raise: 1,500 files held open exhaust it.
    m = mount(BUCKET, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (160, 160)))
    held = []
    try:
        for name in Corpus.DIR1500[:400]:
            try:
                f = open(m.p(name), "rb")
            except OSError:
                continue          # the daemon had no descriptor left for this one: expected
            held.append(f)
            try:
                f.read(1)
            except OSError:
                pass              # nor a socket to fetch it with
    finally:
        for f in held:
            f.close()
    assert len(held) > 0
    # Every descriptor is back: the next file is read and cached at once, not streamed past a
    # cache paused for everyone.
    name = Corpus.DIR1500[-1]
    assert read_whole(m.p(name)) == corpus.data[name]
    assert _cached_soon(m.p(name), len(corpus.data[name])), "the file was not cached: the cache was paused"
    assert "block cache paused" not in m.stderr(), m.stderr()


def _cached_soon(path: str, size: int, timeout: float = 5.0) -> bool:
    """The cache copy of a read is written after its reply: give it a moment."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if int(os.getxattr(path, "user.storefs.cached")) >= size:
            return True
        time.sleep(0.02)
    return False
