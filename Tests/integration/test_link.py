"""Read-ahead through a modelled WAN link (docs/architecture.md, "Adaptive transfers").

The link is bench/link's linkproxy (the benchmark's `--link wan`: 30 ms to every first byte,
50 MiB/s per connection, 60 ms to open a connection) in front of the emulator. Its request
log says when each ranged GET started and ended, so the tests count the parts that were in
flight at once: on a far link one stream is slow and only parallel parts fill it, which storefs
must find with default options, inside memory_limit. Objects live in `link-bucket`.

Plain http on purpose: linkproxy models the link at the HTTP level (it reads each request to
log it), so it sits in front of the emulator's and the v0 server's plain ports and storefs
speaks plain http to it; what TLS changes is tested in test_tls.py.
"""

from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys
import time

import pytest

from storefs_testlib import link_in_front_of, link_media_requests as media_requests, link_module, most_at_once, vm_kib, wait_for

LB = "link-bucket"
MiB = 1 << 20
BIG = "big.bin"
BIG_BYTES = random.Random(9).randbytes(96 * MiB)


TREE = {f"tree/d{d}/f{f}.txt": f"{d}/{f}\n".encode() for d in range(3) for f in range(20)}


@pytest.fixture(scope="module")
def lbucket(emulator):
    emulator.create_bucket(LB, exist_ok=True)
    emulator.upload(LB, BIG, BIG_BYTES)
    for name, data in TREE.items():
        emulator.upload(LB, name, data)
    return emulator


@pytest.fixture
def wan(lbucket, tmp_path):
    """The `wan` profile in front of the emulator."""
    with link_in_front_of(lbucket.http_port, tmp_path, "wan") as proxy:
        yield proxy


def read_through(path: str) -> bytes:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while True:
            b = f.read(1 * MiB)
            if not b:
                break
            h.update(b)
    return h.digest()


def test_sequential_read_on_defaults_fills_a_far_link_within_memory_limit(mount, wan):
    """More than 4 parts (the old fixed default) in flight once the link rewards it, found
    without `parallel=`; the daemon's peak RSS stays within memory_limit plus its base; little
    downloaded twice."""
    limit = 64 * MiB
    m = mount(LB, endpoint=wan.url, options=["memory_limit=64M"])
    assert m.pid is not None
    os.stat(m.p(BIG))
    base = vm_kib(m.pid, "VmRSS") * 1024
    wan.reset_stats()
    assert read_through(m.p(BIG)) == hashlib.sha256(BIG_BYTES).digest(), "bytes differ"
    media = media_requests(wan)
    most = most_at_once(media)
    assert most > 4, (
        f"at most {most} ranged GETs in flight at once through a 30 ms / 50 MiB/s-per-connection "
        f"link ({len(media)} GETs): read-ahead did not grow past 4 parts")
    growth = vm_kib(m.pid, "VmHWM") * 1024 - base
    slack = 24 * MiB
    assert growth <= limit + slack, (
        f"peak RSS grew by {growth / MiB:.1f} MiB during the read: more than memory_limit "
        f"({limit // MiB} MiB) + {slack // MiB} MiB of fixed buffers")
    # Nothing fetched twice: short of memory, read-ahead lets go of finished parts only once
    # their cache copy is made (FlightTable.dropStored), so a part whose copy is still being
    # written stays findable. The 5% is slack for a reader's own gap-filling GET.
    body = sum(r["body"] for r in media)
    assert body <= len(BIG_BYTES) * 1.05, (
        f"{body / MiB:.1f} MiB of media for a {len(BIG_BYTES) // MiB} MiB object: ranges fetched twice: "
        + ", ".join(f"{r['range']} at {r['t_req']:.3f}-{r['t_last']:.3f}" for r in sorted(media, key=lambda r: r["t_req"])))


def connections_idle_at(requests: list[dict], t: float, margin: float = 0.02) -> list[int]:
    """The connections (the link proxy's log) idle at `t`: their last answer's last byte sent
    at least `margin` before it (time for the daemon to take it back), their next request later."""
    by_conn: dict[int, list[dict]] = {}
    for r in sorted(requests, key=lambda r: r["t_req"]):
        by_conn.setdefault(r["conn"], []).append(r)
    idle = []
    for conn, rs in by_conn.items():
        for i, r in enumerate(rs):
            following = rs[i + 1]["t_req"] if i + 1 < len(rs) else float("inf")
            if r["t_last"] is not None and r["t_last"] + margin <= t < following:
                idle.append(conn)
                break
    return idle


def test_a_far_link_has_connections_open_before_read_ahead_needs_them(mount, wan):
    """A new connection costs 60 ms on `wan` before its first byte: once a reader reads on,
    connections are opened (a one-byte GET each) up to the count's next step, and a read-ahead
    part takes one of them as soon as one is open: no part sets up a connection of its own
    while one opened ahead sits idle. Parts that start while the openers are still on their
    way (the first window, or more when reads arrive in a burst on a busy host) open their
    own: waiting for an opener that started less than one time-to-first-byte (30 ms) before
    would not be quicker. (This test asked for at most 4 parts on new connections: on a busy
    host the window's steps come in a burst before the openers land, and 15 did.)"""
    m = mount(LB, endpoint=wan.url)
    os.stat(m.p(BIG))
    wan.reset_stats()
    assert read_through(m.p(BIG)) == hashlib.sha256(BIG_BYTES).digest(), "bytes differ"
    log = wan.stats()["per_request"]
    parts = [r for r in media_requests(wan) if r["body"] >= 2 * MiB]
    assert most_at_once(parts) > 4, "read-ahead did not grow: nothing here is about connections"
    openers = [r for r in log if r["range"] == "bytes=0-0"]
    assert len(openers) >= 16, f"{len(openers)} connections opened ahead for a far reader, want the count's next step"
    assert all(r["seq"] == 1 for r in openers), "a connection opener reused a connection"
    opened = {r["conn"] for r in openers}
    setup_s = link_module().PROFILES["wan"]["setup_ms"] / 1000
    # A part on a connection of its own began setting it up `setup` before its request came in.
    wasteful = [(r, idle) for r in parts if r["seq"] == 1
                for idle in [[c for c in connections_idle_at(log, r["t_req"] - setup_s) if c in opened]] if idle]
    assert not wasteful, (
        f"{len(wasteful)} of {len(parts)} read-ahead parts set up a connection of their own while one "
        f"opened ahead was idle: " + ", ".join(f"{r['range']} on new connection {r['conn']} (idle: {idle[:5]})"
                                               for r, idle in wasteful[:8]))
    assert any(r["seq"] > 1 for r in parts if r["conn"] in opened), "no part used a connection opened ahead"
    # The count's ceiling (48), the reader's own download and the lookup's.
    assert wan.stats()["connections"] <= 50, f"{wan.stats()['connections']} connections for one reader"


def test_a_far_readers_own_download_takes_the_warm_connection_before_its_read_ahead(mount, wan):
    """The lookup leaves a warm connection. The first read misses: the reader waits for its own
    download, and the read-ahead that read lets go is queued before it. A new connection costs
    60 ms on `wan` before the first byte, so the reader's download must go out on the warm one
    and the read-ahead wait for the new one, not the other way round."""
    m = mount(LB, endpoint=wan.url)
    os.stat(m.p(BIG))
    wan.reset_stats()
    with open(m.p(BIG), "rb", buffering=0) as f:
        assert f.read(1 * MiB) == BIG_BYTES[:MiB], "bytes differ"
    media = sorted(media_requests(wan), key=lambda r: r["t_req"])
    own = [r for r in media if r["range"].startswith("bytes=0-")]
    assert own, f"no download from offset 0: {[r['range'] for r in media]}"
    assert own[0]["seq"] > 1, (
        f"the reader's download ({own[0]['range']}) waited for a new connection (request 1 of "
        f"connection {own[0]['conn']}) while read-ahead took the warm one: "
        + ", ".join(f"{r['range']} on {r['conn']}#{r['seq']}" for r in media))


def test_head_of_a_large_file_fetches_a_few_mib_and_opens_no_connections_ahead(mount, wan):
    """`head -c 100000` reads 100,000 bytes; the kernel's readahead turns it into three
    growing reads (32, 128 and 256 KiB). That is not yet a stream: read-ahead opens its first
    window (2 MiB) and neither widens it nor opens connections for parts to come."""
    m = mount(LB, endpoint=wan.url)
    os.stat(m.p(BIG))
    wan.reset_stats()
    # The file stays open a second after head's last read: read-ahead a close would cancel
    # before it went out has its time to go out.
    with open(m.p(BIG), "rb") as f:
        out = subprocess.run(["head", "-c", "100000"], stdin=f, capture_output=True, timeout=30)
        assert out.returncode == 0 and out.stdout == BIG_BYTES[:100000], out.stderr
        time.sleep(1)
        deadline = time.monotonic() + 10
        while wan.stats()["incomplete"] and time.monotonic() < deadline:  # read-ahead landing
            time.sleep(0.1)
    media = media_requests(wan)
    body = sum(r["body"] for r in media)
    assert body <= 4 * MiB, (
        f"{body / MiB:.2f} MiB fetched for head -c 100000: " + ", ".join(r["range"] for r in media))
    openers = [r for r in wan.stats()["per_request"] if r["range"] == "bytes=0-0"]
    assert not openers, f"{len(openers)} connections opened ahead for a short read"


def test_parallel_option_fixes_the_parts_in_flight(mount, wan):
    """`parallel=N` is an override: read-ahead never runs more than N parts at once, however
    much the link would reward more (a reader's own miss may add one GET beside them)."""
    m = mount(LB, endpoint=wan.url, options=["parallel=2"])
    os.stat(m.p(BIG))
    wan.reset_stats()
    assert read_through(m.p(BIG)) == hashlib.sha256(BIG_BYTES).digest(), "bytes differ"
    most = most_at_once(media_requests(wan))
    assert most <= 3, f"{most} ranged GETs in flight at once with parallel=2"


def test_a_second_file_of_a_directory_costs_only_its_get(mount, wan):
    """The first lookup in a directory fetches the directory's first listing page beside its
    probe; the next name there is answered from it: `head -c 1` of a second file makes one
    request, the media GET (where a probe would add a list and a metadata GET)."""
    m = mount(LB, endpoint=wan.url)
    with open(m.p("tree/d1/f3.txt"), "rb") as f:
        assert f.read(1) == b"1"
    # The page was asked for beside the probe, before the GET: it is in by now, or very soon.
    deadline = time.monotonic() + 5
    while not any("prefix=tree%2Fd1%2F" in r["path"] and "maxResults=1000" in r["path"]
                  for r in wan.stats()["per_request"]):
        assert time.monotonic() < deadline, "no first-page listing of tree/d1/ went out"
        time.sleep(0.05)
    # The first lookup's probe (a metadata GET, a list of `f3.txt/`), which the page may have
    # beaten, ends on its own (the proxy logs a request once answered).
    def probed(paths):
        return (any(p.endswith("/o/tree%2Fd1%2Ff3.txt") for p in paths)
                and any("prefix=tree%2Fd1%2Ff3.txt%2F" in p for p in paths))
    while not probed([r["path"] for r in wan.stats()["per_request"]]):
        assert time.monotonic() < deadline, wan.stats()["per_request"]
        time.sleep(0.05)
    wan.reset_stats()
    with open(m.p("tree/d1/f17.txt"), "rb") as f:
        assert f.read(1) == b"1"
    # The proxy logs a request once its answer has gone through: wait for the GET's line,
    # then a little for any other request the read might have made.
    deadline = time.monotonic() + 5
    while not wan.stats()["per_request"] and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    paths = [r["path"] for r in wan.stats()["per_request"]]
    assert len(paths) == 1 and "alt=media" in paths[0], paths
    # Names the page covers and does not hold are absent without asking.
    wan.reset_stats()
    assert not os.path.exists(m.p("tree/d1/f1x.txt"))
    assert wan.stats()["requests"] == 0, wan.stats()["per_request"]


def test_a_lookup_takes_its_directory_page_when_it_lands_first(mount, lbucket, tmp_path):
    """A lookup that asks the bucket sends its probe (two requests) and its directory's first
    listing page at once, and takes whichever answers first (docs/architecture.md, "Lookups in
    one round trip"). On a link where opening a connection takes 1.5 s, the probe's requests
    wait for new connections while the page leaves on the one the previous request freed: a
    file two directories down is read after one round trip per component and the GET, well
    under one connection set-up (waiting for the probes took more than 1.5 s per level)."""
    with link_in_front_of(lbucket.http_port, tmp_path, ttfb_ms=20, setup_ms=1500) as proxy:
        m = mount(LB, endpoint=proxy.url)
        started = time.monotonic()
        with open(m.p("tree/d2/f5.txt"), "rb") as f:
            assert f.read() == b"2/5\n"
        took = time.monotonic() - started
        assert took < 0.75, f"head of tree/d2/f5.txt took {took:.2f} s on a fresh mount"
        # The file's probe still ran, to its end (the proxy logs a request once it is over):
        # it was left to finish, not cut off mid-answer, which would close its connection.
        deadline = time.monotonic() + 10
        while not any(r["path"].endswith("/o/tree%2Fd2%2Ff5.txt") for r in proxy.stats()["per_request"]):
            assert time.monotonic() < deadline, proxy.stats()["per_request"]
            time.sleep(0.1)
        assert proxy.stats()["incomplete"] == 0, proxy.stats()["per_request"]


def _settled(proxy, quiet: float = 0.5) -> bool:
    """No request through `proxy` is unfinished, and none arrived for `quiet` seconds."""
    before = proxy.stats()
    time.sleep(quiet)
    after = proxy.stats()
    return after["incomplete"] == 0 and after["requests"] == before["requests"]


def test_the_mount_check_answers_the_first_lookups(mount, wan):
    """The access check at mount is the root's first listing page (docs/architecture.md,
    "Lookups in one round trip"): a name in the root, and the first directory of a path, are
    answered from it, so `head -c 1` of a root file on a fresh mount makes one request, its GET."""
    m = mount(LB, endpoint=wan.url)
    wan.reset_stats()
    with open(m.p(BIG), "rb") as f:
        assert f.read(1) == BIG_BYTES[:1]
    paths = [r["path"] for r in wan.stats()["per_request"]]
    assert paths and all("alt=media" in p for p in paths), paths
    # The read's own requests (the connections it opens ahead of read-ahead, each a one-byte
    # GET from a thread started for it) may still be on their way: counted before the lookup.
    assert wait_for(lambda: _settled(wan), 10), f"the read's requests never settled: {wan.stats()}"
    wan.reset_stats()
    assert not os.path.exists(m.p("no-such-name"))
    assert wan.stats()["requests"] == 0, wan.stats()["per_request"]


def test_a_firebase_v0_read_right_after_its_lookup_waits_one_round_trip(bare_mount, firebase, lbucket, tmp_path):
    """v0 listings carry no sizes, so a lookup asks the object's metadata (one round trip)
    and `head -c 1` would then wait a second one for its media GET. The first bytes are asked
    beside the metadata, and the read takes them: one media GET, sent before the metadata's
    answer came back, and none after it."""
    with link_in_front_of(firebase.plain_port, tmp_path, "wan") as proxy:
        m = bare_mount(LB, endpoint=proxy.url, options=["protocol=firebase", "anonymous"])
        for name in ("tree/d1/f3.txt", "tree/d1/f7.txt"):
            proxy.reset_stats()
            started = time.monotonic()
            with open(m.p(name), "rb") as f:
                assert f.read(1) == TREE[name][:1]
            took = time.monotonic() - started
            print(f"head -c 1 of {name} through wan on v0: {took * 1000:.0f} ms")
            quoted = name.replace("/", "%2F")
            reqs = [r for r in proxy.stats()["per_request"] if quoted in r["path"]]
            media = [r for r in reqs if "alt=media" in r["path"]]
            meta = [r for r in reqs if r["path"].endswith("/o/" + quoted)]
            assert len(meta) == 1 and len(media) == 1, (
                f"{name}: expected one metadata GET and one media GET, got "
                + ", ".join(f"{r['path']} {r['range']}" for r in reqs))
            assert media[0]["t_req"] <= meta[0]["t_first"], (
                f"{name}: the media GET went out {1000 * (media[0]['t_req'] - meta[0]['t_first']):.0f} ms after "
                f"the metadata's answer ({took * 1000:.0f} ms in all): a second round trip")


# One reader of a file, in a process of its own: waits for the common start time, opens the
# file, reads its slice; prints how long open(2) and the read took, and the slice's SHA-256.
_OPEN_AND_READ = """
import hashlib, os, sys, time
path, offset, length, start_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
time.sleep(max(0.0, start_at - time.time()))
t0 = time.monotonic()
fd = os.open(path, os.O_RDONLY)
t1 = time.monotonic()
got = os.pread(fd, length, offset)
t2 = time.monotonic()
os.close(fd)
print(t1 - t0, t2 - t1, hashlib.sha256(got).hexdigest())
"""


def test_readers_opening_a_file_at_once_never_wait_in_open_for_each_others_reads(mount, lbucket, tmp_path):
    """An open that does not let the kernel keep the file's page cache makes the kernel drop
    it, and wait for every page other readers are reading in: through a far link, a whole read.
    The first open of a file has no pages to drop, so it keeps them: 8 processes that open a
    file at once and read a slice each never wait in open(2) behind each other's reads (through
    `harsh`, one of 8 `dd`s opening one file at once waited 0.4-0.85 s in open(2), most runs).
    Every round is a file opened for the first time; the link gives each response 400 ms before
    its first byte, so a wait behind a read is at least that."""
    files = {f"opens/f{i}.bin": random.Random(100 + i).randbytes(4 * MiB) for i in range(6)}
    for name, data in files.items():
        lbucket.upload(LB, name, data)
    with link_in_front_of(lbucket.http_port, tmp_path, ttfb_ms=400, conn_mibps=50, total_mibps=1024) as proxy:
        m = mount(LB, endpoint=proxy.url)
        readers, piece = 8, 512 * 1024
        waits = []
        for name, data in files.items():
            os.stat(m.p(name))  # looked up, never opened
            start_at = time.time() + 1.0
            procs = [subprocess.Popen([sys.executable, "-c", _OPEN_AND_READ, m.p(name), str(i * piece), str(piece),
                                       str(start_at)], stdout=subprocess.PIPE, text=True)
                     for i in range(readers)]
            try:
                for i, p in enumerate(procs):
                    out, _ = p.communicate(timeout=60)
                    assert p.returncode == 0, f"reader {i} of {name} failed"
                    opened, read, digest = out.split()
                    want = hashlib.sha256(data[i * piece:(i + 1) * piece]).hexdigest()
                    assert digest == want, f"reader {i} of {name} read other bytes"
                    waits.append((float(opened), name, i, float(read)))
            finally:
                for p in procs:  # a reader left behind would keep the mount busy
                    if p.poll() is None:
                        p.kill()
                        p.wait()
        slowest = max(waits)
        print(f"open(2) of {len(waits)} first opens: slowest {slowest[0] * 1000:.0f} ms "
              f"({slowest[1]}, reader {slowest[2]}; its read took {slowest[3] * 1000:.0f} ms)")
        late = [w for w in waits if w[0] >= 0.3]
        assert not late, (
            f"{len(late)} of {len(waits)} opens waited behind other readers' reads: "
            + ", ".join(f"{n} reader {i} {o * 1000:.0f} ms" for o, n, i, _ in late))
