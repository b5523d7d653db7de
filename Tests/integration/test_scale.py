"""Many objects, through real mounts of the synthetic bucket server (scale_server.py): listings
complete and exact, and the daemon's memory bounded (docs/architecture.md, "Metadata memory").

The servers compute 200,000 objects (20 directories x 10,000 files), and a 100,000-entry
`wide/` directory, from their names; nothing is uploaded. bench/run --scale measures the same
walks at 1,000,000 objects against rclone and the direct listing walk.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time

import pytest

from scale_server import ScaleServer

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "bench", "link"))
import link  # noqa: E402  (bench/link/link.py: the link model, here only to slow pages down)

DIRS, FILES, WIDE = 20, 10_000, 100_000


@pytest.fixture(scope="module")
def scale():
    with ScaleServer(bucket="scale-bucket", dirs=DIRS, files=FILES) as server:
        yield server


@pytest.fixture(scope="module")
def wide():
    with ScaleServer(bucket="wide-bucket", dirs=1, files=10, wide=WIDE) as server:
        yield server


def settled_rss_mib(pid: int) -> float:
    """RSS once the daemon has been idle long enough to return freed memory (it trims after
    2 s idle: docs/architecture.md, "Threads")."""
    time.sleep(3)
    return rss_mib(pid)


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def _expected(scale) -> tuple[set[str], dict[str, int]]:
    names, sizes = set(), {}
    for n in scale.names():
        names.add(n)
        sizes[n] = scale.size_of(n)
    return names, sizes


def test_find_and_ls_l_list_200k_objects_exactly(mount, scale):
    m = mount("scale-bucket", endpoint=scale.endpoint)
    names, sizes = _expected(scale)
    dirs = {n.rsplit("/", 1)[0] for n in names}
    out = subprocess.run(["find", ".", "-mindepth", "1"], cwd=m.path, capture_output=True, timeout=300,
                         check=True).stdout.decode("utf-8", "surrogateescape").splitlines()
    seen = [p[2:] for p in out]
    assert len(seen) == len(set(seen)), "find saw a name twice"
    assert set(seen) == names | dirs, (f"{len(set(seen) - names - dirs)} extra, "
                                       f"{len((names | dirs) - set(seen))} missing")
    # ls -l: every size, through readdirplus (or lookups), exactly as the server has it.
    got = {}
    for d in sorted(dirs):
        listing = subprocess.run(["ls", "-l", "--time-style=+%s", d], cwd=m.path, capture_output=True,
                                 timeout=300, check=True).stdout.decode().splitlines()
        for line in listing[1:]:
            fields = line.split(None, 6)
            got[f"{d}/{fields[6]}"] = int(fields[4])
    assert got == sizes
    # The kernel now holds an inode for every name: each must be cheap (~100 bytes here).
    held = settled_rss_mib(m.pid)
    print(f"RSS with {len(names)} inodes held by the kernel: {held:.0f} MiB")
    assert held <= 256, f"RSS with {len(names)} inodes held: {held:.0f} MiB"


def test_memory_is_bounded_and_does_not_grow_with_repeated_walks(mount, scale):
    m = mount("scale-bucket", endpoint=scale.endpoint, options=["metadata_cache_size=32768"])
    after = []
    for _ in range(4):
        subprocess.run(["find", m.path], stdout=subprocess.DEVNULL, timeout=300, check=True)
        after.append(settled_rss_mib(m.pid))
    print(f"RSS after 4 finds over {DIRS * FILES} objects: {after}")
    # The listings (200,000 entries) do not fit metadata_cache_size: every walk lists again,
    # and what is kept must not follow the walks. glibc's per-thread arenas keep some freed
    # memory for reuse, so the first walks raise RSS to a plateau (docs/architecture.md,
    # "Metadata memory"); past it, walks add nothing.
    assert max(after) <= 256, f"RSS after walks: {after}"
    assert after[3] <= after[2] * 1.10 + 8, f"RSS still grows with repeated walks: {after}"


def test_many_opens_of_a_wide_directory_share_one_listing(mount, wide):
    m = mount("wide-bucket", endpoint=wide.endpoint)
    wide = m.p("wide")
    assert len(os.listdir(wide)) == WIDE
    base = rss_mib(m.pid)
    fds = [os.open(wide, os.O_RDONLY | os.O_DIRECTORY) for _ in range(40)]
    try:
        # Each handle reads a little of the directory (an opendir the kernel passes on).
        for fd in fds:
            with os.scandir(fd) as it:
                next(it)
        grown = rss_mib(m.pid) - base
    finally:
        for fd in fds:
            os.close(fd)
    assert grown < 40, f"40 opens of a {WIDE}-entry directory cost {grown:.0f} MiB"


def test_a_flood_of_missing_names_stays_bounded(mount, scale):
    m = mount("scale-bucket", endpoint=scale.endpoint, options=["metadata_cache_size=4096", "negative_ttl=600"])
    os.stat(m.p("d000"))
    base = rss_mib(m.pid)
    rng = random.Random(7)

    def flood(seed: int) -> None:
        r = random.Random(seed)
        for _ in range(5000):
            try:
                os.stat(m.p("d000", f"missing-{r.getrandbits(64):016x}"))
            except FileNotFoundError:
                pass

    threads = [threading.Thread(target=flood, args=(rng.random(),)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert rss_mib(m.pid) - base < 30


def test_the_first_entries_of_a_wide_directory_come_before_its_last_page(mount, wide, tmp_path):
    """readdir hands out a listing's settled entries as its pages arrive (docs/architecture.md,
    "Listings as they arrive"): through a link where every page costs 20 ms, the first entry of
    a 100,000-entry directory (100 pages) must reach the reader while most pages are still to
    come, and the whole must still be exact, in byte order, each name once."""
    proxy = link.LinkProxy(wide.port, ttfb_ms=20, workdir=str(tmp_path), log_path=str(tmp_path / "link.log"))
    try:
        proxy.start()
    except RuntimeError as exc:
        pytest.fail(f"the link proxy did not start: {exc}", pytrace=False)
    try:
        m = mount("wide-bucket", endpoint=proxy.url)
        os.stat(m.p("wide"))
        wide.reset_counts()
        t0 = time.monotonic()
        with os.scandir(m.p("wide")) as it:
            first = next(it).name
            t_first = time.monotonic() - t0
            pages_then = wide.counts["list"]
            names = [first] + [e.name for e in it]
        t_all = time.monotonic() - t0
        pages = wide.counts["list"]
    finally:
        proxy.stop()
    print(f"first entry after {t_first * 1000:.0f} ms ({pages_then} of {pages} pages), all {len(names)} after "
          f"{t_all * 1000:.0f} ms")
    assert pages >= 100, f"the listing took {pages} pages"
    assert pages_then <= pages // 4, f"the first entry came after {pages_then} of {pages} pages"
    assert t_first < t_all / 4, (t_first, t_all)
    assert len(names) == WIDE and len(set(names)) == WIDE
    assert names == sorted(names, key=lambda n: n.encode()), "not in byte order"
