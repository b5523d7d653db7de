"""storefs against a misbehaving server: every fault of fault_proxy.FaultProxy, through real mounts.

The contract (README "Errors", docs/integrity.md, docs/security.md): a read returns exactly the stored bytes or fails
with EIO, never wrong bytes; nothing waits longer than `request_timeout`; a server that stops
answering leaves cached data, listings and attributes usable; interrupted and unmounted
operations end promptly; bad listings are EIO, not a shorter list or an endless loop.

The objects live in a bucket of their own, `faults-bucket` (the corpus bucket's root and whole
tree are listed exactly by other modules), written from seeded `random.Random` data. The
256 MiB soak object is a seeded 1 MiB block XORed with a per-MiB key, streamed to the emulator
and checked piecewise, so it never sits in this process's memory.

Every mount goes through the `fault_proxy` fixture (stopped, releasing every held socket,
before the mount fixture unmounts). Operations that may hang run in daemon threads with a
deadline (`Call`); a test that fails releases the proxy first, so the stuck system calls
end and the unmount is clean.
"""

from __future__ import annotations

import concurrent.futures
import errno
import functools
import http.client
import json
import os
import random
import signal
import subprocess
import threading
import time
import uuid
from collections import Counter

import pytest

from fault_proxy import FaultProxy
from gcs_emulator import quote_name
from storefs_testlib import default_signals, is_mounted, pid_alive, wait_for, wait_pid_gone
from storefs_testlib import read_whole as read_all

FB = "faults-bucket"
KiB, MiB = 1 << 10, 1 << 20

TIMEOUTS = ["response_timeout=2", "request_timeout=30"]

# the soak
BIG = "soak/big-256MiB.bin"
BIG_SIZE = 256 * MiB
BIG_SEED = 0x5EED_256
SMALL_SOAK = {"soak/s-5KiB.bin": 5 * KiB + 3, "soak/s-300KiB.bin": 300 * KiB + 1,
              "soak/s-1MiB.bin": MiB + 17, "soak/s-3MiB.bin": 3 * MiB + 5}
# corruption
CRC_OBJECTS = {"bitflip": "crc/bitflip-6MiB.bin", "shifted_body": "crc/shifted-6MiB.bin"}
# the dead server
HOLE_CACHED, HOLE_KNOWN, HOLE_UNCACHED = "hole/cached.txt", "hole/known.txt", "hole/uncached.bin"
HOLE_DIR = ["hole/dir/a.txt", "hole/dir/b.txt", "hole/dir/c.txt"]
# listings
PAGES = [f"pages/p{i:03d}.txt" for i in range(25)]        # 3 pages of 10 via list_page_size
LOOP = [f"loop/l{i:04d}.txt" for i in range(500)]
HUGE = ["huge/one.txt", "huge/two.txt"]
ENDLESS = "endless/x.bin"
TRICKLE = "trickle/slow.bin"
RETRY = "retry/after.bin"
UNLUCKY = "unlucky/one-block.bin"      # 10 KiB: one block, one media request at a time
INTR_READ = "intr/read.bin"
PAR = [f"par/n{i}.txt" for i in range(4)]
PAR2_CACHED = "par2/cached.txt"
PAR2_DIRS = [f"par2/d{i:02d}" for i in range(40)]
SHUT = [f"shut/{c}.bin" for c in "abc"]


# ====================================================================== data
class Pattern:
    """size bytes: chunk i (1 MiB) = a seeded 1 MiB block XOR an 8-byte key of i, repeated."""

    def __init__(self, seed: int, size: int) -> None:
        self.size = size
        self._block = int.from_bytes(random.Random(seed).randbytes(MiB), "little")

    def make_chunk(self, i: int) -> bytes:
        key = ((i + 1) * 0x9E3779B97F4A7C15 & (2**64 - 1)).to_bytes(8, "little") * (MiB // 8)
        full = (self._block ^ int.from_bytes(key, "little")).to_bytes(MiB, "little")
        return full[:min(MiB, self.size - i * MiB)]

    @functools.lru_cache(maxsize=40)
    def chunk(self, i: int) -> bytes:
        return self.make_chunk(i)

    def bytes(self, off: int, n: int) -> bytes:
        end = min(off + n, self.size)
        out = []
        while off < end:
            i, o = divmod(off, MiB)
            take = min(MiB - o, end - off)
            out.append(self.chunk(i)[o:o + take])
            off += take
        return b"".join(out)


def upload_stream(emulator, bucket: str, name: str, pattern: Pattern) -> dict:
    """Multipart upload whose media part is sent chunk by chunk (no 256 MiB buffer here)."""
    boundary = "storefs-" + uuid.uuid4().hex
    head = b"".join([f"--{boundary}\r\n".encode(),
                     b"Content-Type: application/json; charset=UTF-8\r\n\r\n",
                     json.dumps({"name": name, "contentType": "application/octet-stream"}).encode(),
                     b"\r\n", f"--{boundary}\r\n".encode(),
                     b"Content-Type: application/octet-stream\r\n\r\n"])
    tail = f"\r\n--{boundary}--\r\n".encode()
    path = f"/upload/storage/v1/b/{quote_name(bucket)}/o?uploadType=multipart&name={quote_name(name)}"
    conn = http.client.HTTPConnection("127.0.0.1", emulator.http_port, timeout=300)  # plain: the test's back door
    try:
        conn.putrequest("POST", path)
        conn.putheader("Content-Type", f"multipart/related; boundary={boundary}")
        conn.putheader("Content-Length", str(len(head) + pattern.size + len(tail)))
        conn.endheaders()
        conn.send(head)
        for i in range((pattern.size + MiB - 1) // MiB):
            conn.send(pattern.make_chunk(i))
        conn.send(tail)
        resp = conn.getresponse()
        body = resp.read()
    finally:
        conn.close()
        emulator.note_change()
    assert resp.status == 200, (resp.status, body[:300])
    res = json.loads(body)
    assert int(res["size"]) == pattern.size
    return res


@pytest.fixture(scope="module")
def fdata(emulator) -> dict[str, bytes]:
    """Uploads this module's small objects to FB once; returns name -> bytes."""
    emulator.create_bucket(FB, exist_ok=True)
    rng = random.Random(20261130)
    data: dict[str, bytes] = {}
    for name, size in SMALL_SOAK.items():
        data[name] = rng.randbytes(size)
    for name in CRC_OBJECTS.values():
        data[name] = rng.randbytes(6 * MiB)
    data[HOLE_CACHED] = rng.randbytes(100 * KiB)
    data[HOLE_KNOWN] = b"known file\n" * 7
    data[HOLE_UNCACHED] = rng.randbytes(2 * MiB)
    for n in HOLE_DIR + PAGES + LOOP + HUGE + PAR + [d + "/f.txt" for d in PAR2_DIRS]:
        data[n] = f"{n}\n".encode()
    data[ENDLESS] = rng.randbytes(64 * KiB)
    data[TRICKLE] = rng.randbytes(4 * KiB)
    data[RETRY] = rng.randbytes(100 * KiB)
    data[UNLUCKY] = rng.randbytes(10 * KiB)
    data[INTR_READ] = rng.randbytes(4 * MiB)
    for sig in ("SIGINT", "SIGKILL"):
        data[f"intr/stat-{sig}.txt"] = b"stat me\n"
    data[PAR2_CACHED] = rng.randbytes(32 * KiB)
    for n in SHUT:
        data[n] = rng.randbytes(16 * MiB)

    def one(item):
        name, body = item
        res = emulator.upload(FB, name, body)
        assert int(res["size"]) == len(body), name
        return name, res

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        resources = dict(pool.map(one, data.items()))
    fdata_resources.update(resources)
    return data


fdata_resources: dict[str, dict] = {}   # name -> the emulator's resource, filled by fdata


@pytest.fixture(scope="module")
def big(emulator, fdata) -> Pattern:
    pat = Pattern(BIG_SEED, BIG_SIZE)
    upload_stream(emulator, FB, BIG, pat)
    return pat


# ====================================================================== helpers
class Call:
    """fn(*args) in a daemon thread; `wait(t)` -> finished within t. `.value`, `.error`,
    `.elapsed` (seconds from start to return)."""

    def __init__(self, fn, *args, name: str = "") -> None:
        self.name = name or getattr(fn, "__name__", "call")
        self.value = None
        self.error: BaseException | None = None
        self.elapsed: float | None = None
        self.t0 = time.monotonic()
        self.thread = threading.Thread(target=self._run, args=(fn, args), daemon=True)
        self.thread.start()

    def _run(self, fn, args) -> None:
        try:
            self.value = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc
        self.elapsed = time.monotonic() - self.t0

    def wait(self, timeout: float) -> bool:
        self.thread.join(max(0.0, timeout))
        return not self.thread.is_alive()

    @property
    def done(self) -> bool:
        return not self.thread.is_alive()

    def describe(self) -> str:
        if not self.done:
            return f"{self.name}: still blocked after {time.monotonic() - self.t0:.1f} s"
        if self.error is not None:
            e = self.error
            what = f"errno {errno.errorcode.get(e.errno, e.errno)}" if isinstance(e, OSError) else repr(e)
            return f"{self.name}: {what} after {self.elapsed:.1f} s"
        return f"{self.name}: returned after {self.elapsed:.1f} s"


def release_all(proxy: FaultProxy, calls=(), procs=()) -> None:
    """Stops the proxy (held sockets close, storefs sees errors) and waits for stuck calls."""
    proxy.stop()
    deadline = time.monotonic() + 40
    for c in calls:
        c.wait(deadline - time.monotonic())
    for p in procs:
        if p.poll() is None:
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)


def call_within(proxy: FaultProxy, timeout: float, fn, *args, name: str) -> Call:
    """fn(*args) as a `Call` waited for up to `timeout`; if it is still blocked then, the proxy
    is stopped (releasing it) before the test goes on to fail."""
    call = Call(fn, *args, name=name)
    if not call.wait(timeout):
        release_all(proxy, [call])
    return call


def is_eio(call: Call) -> bool:
    return call.done and isinstance(call.error, OSError) and call.error.errno == errno.EIO


def vm_rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except FileNotFoundError:
        pass
    return 0.0


def names_match(names):
    """match= for a rule: metadata/list requests about any of `names` (or below them)."""
    def match(req):
        subject = (req.prefix or "") if req.kind == "list" else (req.name or "")
        return any(subject.startswith(n) for n in names)
    return match


def timeline(proxy: FaultProxy, t0: float, kind: str | None = "media", limit: int = 12) -> str:
    """The proxy's requests as 'fault@arrival-done' seconds after t0, for failure messages."""
    out = []
    for r in proxy.requests(kind)[:limit]:
        done = f"{r.t_done - t0:.1f}s" if r.t_done else "still open"
        out.append(f"{r.fault or 'honest'}@{r.t_arrival - t0:.1f}s-{done}")
    return ", ".join(out) or "no requests"


def cat_within(path: str, timeout: float):
    """`cat path` given `timeout` seconds: (seconds it took, or inf; its output, or None; the
    process, which `release_all` ends if it is still blocked)."""
    t0 = time.monotonic()
    proc = subprocess.Popen(["cat", path], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return time.monotonic() - t0, out, proc
    except subprocess.TimeoutExpired:
        return float("inf"), None, proc


def assert_alive(m) -> None:
    assert m.proc.poll() is None and pid_alive(m.pid), \
        f"storefs exited (status {m.proc.poll()}); stderr tail:\n{m.stderr()[-3000:]}"
    assert is_mounted(m.path), f"{m.path} is no longer mounted"


# ====================================================================== a. soak
DETECTABLE = [
    {"fault": "status", "status": 500},
    {"fault": "status", "status": 503},
    {"fault": "status", "status": 429},
    {"fault": "status", "status": 429, "retry_after": 1},
    {"fault": "reset_before_headers"},
    {"fault": "reset_mid_body"},
    {"fault": "stall_mid_body", "seconds": 2.5},
    {"fault": "truncate"},
    {"fault": "whole_for_range", "weight": 0.5},   # the big object: up to 256 MiB an answer
    {"fault": "wrong_content_range", "shift": 4096},
    {"fault": "wrong_content_range", "shift": 1, "weight": 0.5},
]
SOAK_THREADS = 6
SOAK_READS = 4800            # in all (at least 2,000 must finish within the budget)
SOAK_BUDGET_S = 75.0         # the mount fixture's watchdog kills storefs at 90 s


def test_soak_random_preads_under_10pct_detectable_media_faults_return_exact_bytes(
        mount, fault_proxy, fdata, big):
    # a cache smaller than the object keeps media requests coming all the way through
    m = mount(FB, endpoint=fault_proxy.endpoint, options=TIMEOUTS + ["cache_size=64M"])
    fault_proxy.random_faults(kinds=("media",), rate=0.10, seed=4242, faults=DETECTABLE)
    files = [(BIG, BIG_SIZE)] + list(SMALL_SOAK.items())
    lock = threading.Lock()
    stats = {"reads": 0, "bytes": 0, "max_s": 0.0, "slowest": None}
    wrong: list[str] = []
    short: list[str] = []
    errors: list[str] = []
    deadline = time.monotonic() + SOAK_BUDGET_S

    def expected(name: str, off: int, n: int) -> bytes:
        return big.bytes(off, n) if name == BIG else fdata[name][off:off + n]

    def worker(t: int) -> None:
        rng = random.Random(777_000 + t)
        fds = {name: os.open(m.p(name), os.O_RDONLY) for name, _ in files}
        try:
            for _ in range(SOAK_READS // SOAK_THREADS):
                if time.monotonic() > deadline:
                    return
                name, size = files[0] if rng.random() < 0.7 else rng.choice(files[1:])
                n = min(size, max(1, int(2 ** rng.uniform(0, 21.6))))   # 1 B .. ~3 MiB
                off = rng.randrange(0, size - n + 1)
                t0 = time.monotonic()
                try:
                    # past the kernel's page cache: every read reaches storefs
                    os.posix_fadvise(fds[name], off, n, os.POSIX_FADV_DONTNEED)
                    got = os.pread(fds[name], n, off)
                except OSError as exc:
                    with lock:
                        errors.append(f"{name}@{off}+{n}: {errno.errorcode.get(exc.errno)} "
                                      f"after {time.monotonic() - t0:.1f} s")
                    continue
                took = time.monotonic() - t0
                want = expected(name, off, n)
                with lock:
                    stats["reads"] += 1
                    stats["bytes"] += len(got)
                    if took > stats["max_s"]:
                        stats["max_s"], stats["slowest"] = took, f"{name}@{off}+{n}"
                    if len(got) != n:
                        short.append(f"{name}@{off}+{n}: {len(got)} bytes")
                    if got != want[:len(got)]:
                        first = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
                        wrong.append(f"{name}@{off}+{n}: first wrong byte at +{first}")
        finally:
            for fd in fds.values():
                os.close(fd)

    t_start = time.monotonic()
    calls = [Call(worker, t, name=f"reader{t}") for t in range(SOAK_THREADS)]
    try:
        for c in calls:
            c.wait(deadline + 35 - time.monotonic())   # a read may take request_timeout
        hung = [c.describe() for c in calls if not c.done]
        crashed = [c.describe() for c in calls if c.done and c.error is not None]
    finally:
        if any(not c.done for c in calls):
            release_all(fault_proxy, calls)
    wall = time.monotonic() - t_start
    faults = dict(fault_proxy.fault_counts)
    media = len(fault_proxy.requests("media"))
    statuses = dict(Counter(f"{r.status}" + (f"+RA{r.params['retry_after']}" if "retry_after" in r.params else "")
                            for r in fault_proxy.requests("media", fault="status")))
    print(f"\nsoak: {stats['reads']} reads, {stats['bytes'] / MiB:.1f} MiB in {wall:.1f} s; "
          f"slowest read {stats['max_s']:.2f} s ({stats['slowest']}); {media} media requests, "
          f"{sum(faults.values())} faulted: {faults}; statuses {statuses}; "
          f"errors {len(errors)}, short {len(short)}, "
          f"wrong {len(wrong)}")
    assert not hung, f"readers blocked: {hung}"
    assert not crashed, crashed
    assert not wrong, f"{len(wrong)} reads returned wrong bytes, e.g. {wrong[:5]}"
    # the daemon's own account of a failed read says which path failed it
    said = [line for line in m.stderr().splitlines() if "warn" in line or "error" in line][-20:]
    assert not errors, f"{len(errors)} reads failed, e.g. {errors[:5]}; storefs said:\n" + "\n".join(said)
    assert not short, (f"{len(short)} reads returned fewer bytes than asked, e.g. {short[:5]}; "
                       "storefs said:\n" + "\n".join(said))
    assert stats["reads"] >= 2000, \
        f"only {stats['reads']} reads in the {SOAK_BUDGET_S:.0f} s budget"
    assert stats["max_s"] < 30, f"a read took {stats['max_s']:.1f} s (> request_timeout)"
    assert sum(faults.values()) >= 0.05 * media, f"too few faults injected: {faults} of {media}"
    missing = {d["fault"] for d in DETECTABLE} - set(faults)
    assert not missing, f"these faults never fired: {missing}"
    assert_alive(m)


# ====================================================================== b. Retry-After
def test_429_retry_after_1s_is_honoured_before_the_retry(mount, fault_proxy, fdata):
    m = mount(FB, endpoint=fault_proxy.endpoint)
    os.stat(m.p(RETRY))
    fault_proxy.add_rule(kind="media", name_prefix=RETRY, fault="status", status=429,
                         retry_after=1, count=1)
    call = call_within(fault_proxy, 30, read_all, m.p(RETRY), name="read")
    assert call.done and call.error is None, call.describe()
    assert call.value == fdata[RETRY]
    reqs = fault_proxy.requests("media", name_prefix=RETRY)
    assert reqs and reqs[0].fault == "status" and reqs[0].status == 429, \
        [(r.fault, r.status) for r in reqs]

    def start(r):
        return (r.range or "bytes=0-").partition("=")[2].split("-")[0]

    retries = [r for r in reqs[1:] if start(r) == start(reqs[0])]
    assert retries, f"no retry of {reqs[0].range} after the 429: {[r.range for r in reqs]}"
    gap = retries[0].t_arrival - reqs[0].t_answer
    assert gap >= 0.9, f"retried {gap:.2f} s after a 429 with Retry-After: 1"


def test_a_read_failing_six_times_while_other_reads_succeed_returns_its_bytes_and_fails_no_other(
        mount, fault_proxy, fdata):
    """A flaky server, not a dead one: one request unlucky 6 times in a row (5 tries would give
    up) while other reads keep succeeding. It keeps trying, and nothing else fails meanwhile:
    no outage is assumed from it (docs/security.md, "Time bounds")."""
    m = mount(FB, endpoint=fault_proxy.endpoint, options=TIMEOUTS)
    os.listdir(m.p("unlucky"))        # its lookup answered by the listing: the read is its one GET
    os.listdir(m.p("loop"))
    fault_proxy.add_rule(kind="media", name_prefix=UNLUCKY, fault="status", status=503, count=6)
    stop = threading.Event()
    others: dict[str, list] = {"read": [], "failed": []}

    def other_reader() -> None:       # uncached reads of other objects: the bucket answers them
        for name in LOOP:
            if stop.is_set():
                return
            try:
                got = read_all(m.p(name))
                others["read"].append(name)
                assert got == fdata[name], name
            except OSError as exc:
                others["failed"].append(f"{name}: {errno.errorcode.get(exc.errno)}")

    background = Call(other_reader, name="other reader")
    call = Call(read_all, m.p(UNLUCKY), name="unlucky read")
    try:
        ok = call.wait(30)
    finally:
        stop.set()
        background.wait(30)
        if not ok:
            release_all(fault_proxy, [call, background])
    tries = fault_proxy.requests("media", name_prefix=UNLUCKY)
    assert call.done and call.error is None, \
        f"{call.describe()} after {len(tries)} requests: {[r.fault or r.status for r in tries]}"
    assert call.value == fdata[UNLUCKY]
    assert [r.fault for r in tries] == ["status"] * 6 + [None], [r.fault for r in tries]
    assert background.done and background.error is None, background.describe()
    assert len(others["read"]) >= 5, f"the other reader read only {others['read']}"
    assert not others["failed"], f"reads of other objects failed meanwhile: {others['failed'][:5]}"
    assert_alive(m)


def test_a_lone_read_the_server_keeps_failing_is_eio_after_5_tries(mount, fault_proxy, fdata):
    """Nothing else answers: the bucket may be down, and a read gives up after its 5 tries
    (~1.5 s of waits), not 10."""
    m = mount(FB, endpoint=fault_proxy.endpoint, options=TIMEOUTS)
    os.listdir(m.p("unlucky"))
    fault_proxy.add_rule(kind="media", name_prefix=UNLUCKY, fault="status", status=503)
    call = call_within(fault_proxy, 30, read_all, m.p(UNLUCKY), name="read")
    tries = fault_proxy.requests("media", name_prefix=UNLUCKY)
    assert is_eio(call), call.describe()
    assert len(tries) == 5, f"{len(tries)} tries: {[r.fault for r in tries]}"
    assert call.elapsed < 5, call.describe()
    assert_alive(m)


# ====================================================================== c. corruption
@pytest.mark.parametrize("fault,seed", [("bitflip", 1), ("bitflip", 2), ("shifted_body", 3)])
def test_corrupt_media_never_yields_wrong_bytes_nor_poisons_the_cache(
        mount, fault_proxy, proxy, fdata, fault, seed):
    name = CRC_OBJECTS[fault]
    assert fdata_resources[name].get("crc32c"), "the emulator gave no crc32c"
    k = random.Random(seed).randint(1, 7)
    params = {"flips": 1} if fault == "bitflip" else {"shift": 1}
    m = mount(FB, endpoint=fault_proxy.endpoint, options=["log_level=debug"])
    os.stat(m.p(name))
    fault_proxy.add_rule(kind="media", name_prefix=name, fault=fault, count=k, seed=seed, **params)
    call = Call(read_all, m.p(name), name="read")
    try:
        finished = call.wait(60)
    finally:
        if not finished:
            release_all(fault_proxy, [call])
    assert finished, call.describe()
    faulted = fault_proxy.requests("media", fault=fault)
    assert faulted, "no media answer was corrupted: the test did not test anything"
    if call.error is None:
        exact = call.value == fdata[name]
        assert exact, f"the read succeeded with WRONG bytes after {len(faulted)} {fault} answers"
    else:
        assert isinstance(call.error, OSError) and call.error.errno == errno.EIO, call.describe()
    log = m.stderr().lower()
    assert "checksum" in log or "crc32c" in log, \
        f"no checksum/crc32c mismatch in the storefs log after {len(faulted)} {fault} answers"
    problems = mount.unmount(m)
    assert not problems, problems

    again = mount(FB, endpoint=proxy.endpoint, cache_dir=m.cache_dir)
    exact = read_all(again.p(name)) == fdata[name]
    assert exact, f"wrong bytes after remount: the cache kept {fault} data " \
                  f"({proxy.counts['media']} media requests on the remount)"


# ====================================================================== d. a dead server
def test_blackholed_server_cached_data_listing_and_stat_keep_working_uncached_read_eio(
        mount, fault_proxy, fdata):
    m = mount(FB, endpoint=fault_proxy.endpoint,
              options=["stat_ttl=1", "list_ttl=1", "response_timeout=2", "request_timeout=6"])
    assert read_all(m.p(HOLE_CACHED)) == fdata[HOLE_CACHED]
    listed = sorted(os.listdir(m.p("hole/dir")))
    assert listed == ["a.txt", "b.txt", "c.txt"]
    assert os.stat(m.p(HOLE_KNOWN)).st_size == len(fdata[HOLE_KNOWN])
    fd = os.open(m.p(HOLE_UNCACHED), os.O_RDONLY)
    calls = []
    try:
        fault_proxy.add_rule(kind=None, fault="blackhole")
        time.sleep(1.5)   # every attribute and listing has expired
        calls = [Call(read_all, m.p(HOLE_CACHED), name="cached read"),
                 Call(lambda: sorted(os.listdir(m.p("hole/dir"))), name="ls"),
                 Call(os.stat, m.p(HOLE_KNOWN), name="stat"),
                 Call(os.pread, fd, 64 * KiB, 0, name="uncached read")]
        deadline = time.monotonic() + 18
        for c in calls:
            c.wait(deadline - time.monotonic())
        cached, ls, st, uncached = calls
        report = "; ".join(c.describe() for c in calls)
        assert cached.done and cached.error is None and cached.value == fdata[HOLE_CACHED], report
        assert ls.done and ls.error is None and ls.value == listed, report
        assert st.done and st.error is None and st.value.st_size == len(fdata[HOLE_KNOWN]), report
        assert is_eio(uncached), report
        # Its attribute refresh asks before any outage is known (request_timeout), then its
        # read is the outage's one probe and asks too, in case the server is back
        # (docs/security.md, "Time bounds"): at most two request_timeouts in a row.
        assert uncached.elapsed <= 2 * 6 + 4, report
        assert fault_proxy.requests(fault="blackhole"), "nothing was blackholed"
    finally:
        release_all(fault_proxy, calls)
        os.close(fd)
    assert_alive(m)


# ====================================================================== e. listings
def _listdir_fault(mount, fault_proxy, dirname: str, fault: str, match=None, page_size=None,
                   limit: float = 30.0, sample_rss: bool = False, **params):
    m = mount(FB, endpoint=fault_proxy.endpoint)
    os.stat(m.p(dirname))                # the directory itself is looked up honestly
    fault_proxy.list_page_size = page_size
    fault_proxy.add_rule(kind="list", name_prefix=dirname + "/", fault=fault, match=match, **params)
    call = Call(os.listdir, m.p(dirname), name=f"ls {dirname}")
    rss = [vm_rss_mb(m.pid)]
    try:
        deadline = time.monotonic() + limit
        while not call.done and time.monotonic() < deadline:
            call.wait(0.25)
            if sample_rss:
                rss.append(vm_rss_mb(m.pid))
    finally:
        if not call.done:
            release_all(fault_proxy, [call])
    return m, call, max(rss)


def test_items_not_a_list_on_page_two_of_three_is_eio_not_a_shorter_list(mount, fault_proxy, fdata):
    m, call, _ = _listdir_fault(mount, fault_proxy, "pages", "items_not_list", page_size=10,
                                match=lambda r: "pageToken" in r.query)
    assert fault_proxy.requests("list", fault="items_not_list"), "the fault never fired"
    if call.done and call.error is None:
        pytest.fail(f"listdir returned {len(call.value)} of {len(PAGES)} names instead of EIO")
    assert is_eio(call), call.describe()
    assert_alive(m)


def test_looping_page_token_is_eio_within_30s_and_memory_stays_bounded(mount, fault_proxy, fdata):
    m, call, rss = _listdir_fault(mount, fault_proxy, "loop", "looping_token", limit=30,
                                  sample_rss=True)
    pages = len(fault_proxy.requests("list", fault="looping_token"))
    assert is_eio(call), f"{call.describe()} ({pages} looping pages served, RSS up to {rss:.0f} MB)"
    assert rss < 300, f"storefs RSS reached {rss:.0f} MB over {pages} looping pages"
    assert_alive(m)


def test_huge_listing_page_over_40MB_is_eio(mount, fault_proxy, fdata):
    m, call, _ = _listdir_fault(mount, fault_proxy, "huge", "huge_page", limit=30)
    assert fault_proxy.requests("list", fault="huge_page"), "the fault never fired"
    assert is_eio(call), call.describe()
    assert_alive(m)


def test_endless_error_body_on_media_is_eio_within_request_timeout(mount, fault_proxy, fdata):
    m = mount(FB, endpoint=fault_proxy.endpoint, options=["response_timeout=2", "request_timeout=6"])
    os.stat(m.p(ENDLESS))
    fault_proxy.add_rule(kind="media", name_prefix=ENDLESS, fault="endless_error_body")
    call = Call(read_all, m.p(ENDLESS), name="read")
    try:
        call.wait(10)
        seen = timeline(fault_proxy, call.t0)
    finally:
        if not call.done:
            release_all(fault_proxy, [call])
    assert fault_proxy.requests("media", fault="endless_error_body"), "the fault never fired"
    assert is_eio(call) and call.elapsed <= 10, f"{call.describe()}; media requests: {seen}"
    assert_alive(m)


# ====================================================================== f. trickle
def test_media_trickling_at_2_bytes_per_s_is_eio_within_request_timeout(mount, fault_proxy, fdata):
    m = mount(FB, endpoint=fault_proxy.endpoint, options=["response_timeout=2", "request_timeout=6"])
    os.stat(m.p(TRICKLE))
    fault_proxy.add_rule(kind="media", name_prefix=TRICKLE, fault="trickle", bytes_per_s=2)
    call = Call(read_all, m.p(TRICKLE), name="read")
    try:
        call.wait(10)
        assert fault_proxy.requests("media", fault="trickle"), "the fault never fired"
        assert is_eio(call) and call.elapsed <= 10, \
            f"{call.describe()}; media requests: {timeline(fault_proxy, call.t0)}"
        # storefs gave up on the transfer: it must have closed the connection too
        assert fault_proxy.wait_idle(3), \
            f"{fault_proxy.inflight()} trickling answers still being read 3 s after the EIO"
    finally:
        if not call.done:
            release_all(fault_proxy, [call])
    assert_alive(m)


# ====================================================================== g. interrupts
def _signal_stalled(proc: subprocess.Popen, proxy: FaultProxy, fault: str, sig: int,
                    started: float) -> float:
    """Waits for `fault` to hold a request and the process to be 1 s old, then signals it;
    returns how long it took to go away (inf: not within 3 s)."""
    assert wait_for(lambda: any(r.t_answer for r in proxy.requests(fault=fault)), 10), \
        f"no {fault} request arrived: the stall does not hold the process"
    time.sleep(max(0.0, started + 1.0 - time.monotonic()))
    assert proc.poll() is None, \
        f"the process ended ({proc.returncode}) before the signal: the stall did not hold it"
    t0 = time.monotonic()
    proc.send_signal(sig)
    try:
        proc.wait(timeout=3)
    except subprocess.TimeoutExpired:
        return float("inf")
    return time.monotonic() - t0


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["SIGINT", "SIGKILL"])
def test_signal_ends_a_stat_whose_lookup_is_stalled_within_3s(mount, fault_proxy, fdata, sig):
    name = f"intr/stat-{sig.name}.txt"
    m = mount(FB, endpoint=fault_proxy.endpoint)
    os.stat(m.p("intr"))
    # The name's probe and its directory's first listing page (which would answer it as well:
    # docs/architecture.md, "Lookups in one round trip") both stall.
    fault_proxy.add_rule(kind=("metadata", "list"), fault="blackhole", match=names_match(["intr/"]))
    started = time.monotonic()
    proc = subprocess.Popen(["stat", m.p(name)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            preexec_fn=default_signals)
    try:
        took = _signal_stalled(proc, fault_proxy, "blackhole", sig, started)
    finally:
        release_all(fault_proxy, procs=[proc])
    assert took <= 3, f"stat still there 3 s after {sig.name}: storefs did not answer the INTERRUPT"
    assert_alive(m)


def test_sigkill_ends_a_cat_whose_media_answer_stalls_mid_body_within_3s(mount, fault_proxy, fdata):
    m = mount(FB, endpoint=fault_proxy.endpoint)
    os.stat(m.p(INTR_READ))
    fault_proxy.add_rule(kind="media", name_prefix=INTR_READ, fault="stall_mid_body", seconds=30,
                         fraction=0.25)
    started = time.monotonic()
    proc = subprocess.Popen(["cat", m.p(INTR_READ)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        took = _signal_stalled(proc, fault_proxy, "stall_mid_body", signal.SIGKILL, started)
    finally:
        release_all(fault_proxy, procs=[proc])
    assert took <= 3, "cat still there 3 s after SIGKILL: storefs did not answer the INTERRUPT"
    assert_alive(m)


# ====================================================================== h. parallel lookups
def test_four_lookups_delayed_3s_in_one_directory_cost_one_round_trip_each(mount, fault_proxy, fdata):
    """storefs asks for FUSE_CAP_PARALLEL_DIROPS and never serialises lookups itself, but this
    kernel (6.18) still sends LOOKUPs of one directory one at a time: a plain libfuse C
    filesystem with the capability granted shows the same (docs/architecture.md). What storefs
    controls: a lookup costs one round trip (its list and metadata requests go out together),
    not two, and it fetches its directory's first listing page beside them, which answers the
    other three names (docs/architecture.md, "Lookups in one round trip"); across directories
    lookups run in parallel (next test)."""
    m = mount(FB, endpoint=fault_proxy.endpoint)
    os.stat(m.p("par"))
    # The lookup of par answers with its first answer; its other requests (par's first page)
    # may still be on their way, and a page in flight would answer the lookups below undelayed.
    for _ in range(2):
        time.sleep(0.3)
        assert fault_proxy.wait_idle(10), "requests of the lookup of par still unanswered"
    fault_proxy.add_rule(kind=("metadata", "list"), fault="delay", seconds=3, match=names_match(PAR))
    t0 = time.monotonic()
    calls = [Call(os.stat, m.p(n), name=f"stat {n}") for n in PAR]
    try:
        for c in calls:
            c.wait(t0 + 30 - time.monotonic())
        wall = time.monotonic() - t0
    finally:
        release_all(fault_proxy, calls)
    report = "; ".join(c.describe() for c in calls)
    assert all(c.done and c.error is None for c in calls), report
    # Two requests per lookup asked one after the other would take 6 s each: 24 s for four;
    # one round trip each, 12 s; the first lookup's, and the page for the rest, 3 s.
    assert wall < 3 + 3, f"4 lookups delayed 3 s each took {wall:.1f} s together: {report}"
    delayed = sorted(fault_proxy.requests(fault="delay"), key=lambda r: r.t_arrival)
    assert len(delayed) == 2, ("the first lookup asks 'a directory?' and 'an object?'; the "
                               f"others are answered by the page: {[(r.kind, r.name or r.prefix) for r in delayed]}")
    assert delayed[1].t_arrival - delayed[0].t_arrival < 1.0, "a lookup's two requests went out apart"
    assert [c.value.st_size for c in calls] == [len(fdata[n]) for n in PAR]


def test_forty_stalled_lookups_do_not_delay_a_cached_read(mount, fault_proxy, fdata):
    """The 40 stalled names sit in 40 directories looked up before, so the kernel sends all
    40 LOOKUPs at once whether or not it serialises lookups within one directory."""
    m = mount(FB, endpoint=fault_proxy.endpoint)
    assert read_all(m.p(PAR2_CACHED)) == fdata[PAR2_CACHED]
    for d in PAR2_DIRS:
        os.stat(m.p(d))
    stalled = [d + "/stall" for d in PAR2_DIRS]
    fault_proxy.add_rule(kind=("metadata", "list"), fault="blackhole", match=names_match(stalled))
    calls = [Call(os.stat, m.p(n), name=f"stat {n}") for n in stalled]
    proc = None

    def held_names():
        return {(r.name or r.prefix or "").rstrip("/") for r in fault_proxy.requests(fault="blackhole")}

    try:
        wait_for(lambda: len(held_names()) >= 40, 5)
        time.sleep(0.3)
        held = len(held_names())
        took, out, proc = cat_within(m.p(PAR2_CACHED), 2)
    finally:
        release_all(fault_proxy, calls, [proc] if proc else [])
    assert held >= 1, "no lookup was stalled"
    print(f"\n{held} names had a lookup request held by the server")
    assert took <= 2, f"cat of a cached file took over 2 s behind {held} stalled lookups"
    assert out == fdata[PAR2_CACHED]
    assert_alive(m)


def test_forty_reads_stalled_near_the_server_do_not_delay_a_cached_read(mount, fault_proxy, fdata):
    """Near the server a read that misses the cache is served on the FUSE thread that received
    it, at most 16 at once, half of FUSE's 32 (docs/architecture.md, "Threads"): 40 reads of
    40 files whose media answers never come hold 16 FUSE threads and the 16 read workers, and
    FUSE's other threads still answer a cached read. Had every miss stayed on its FUSE thread,
    32 would hold them all and the cached read would wait behind them."""
    m = mount(FB, endpoint=fault_proxy.endpoint)
    assert read_all(m.p(PAR2_CACHED)) == fdata[PAR2_CACHED]   # a download: the server is near
    files = [d + "/f.txt" for d in PAR2_DIRS]
    for n in files:
        os.stat(m.p(n))
    fault_proxy.add_rule(kind="media", name_prefix="par2/d", fault="blackhole")
    calls = [Call(read_all, m.p(n), name=f"read {n}") for n in files]
    proc = None
    try:
        assert wait_for(lambda: len(fault_proxy.requests("media", fault="blackhole")) >= 32, 10), \
            f"only {len(fault_proxy.requests('media', fault='blackhole'))} media requests held"
        time.sleep(0.3)
        held = len(fault_proxy.requests("media", fault="blackhole"))
        took, out, proc = cat_within(m.p(PAR2_CACHED), 2)
    finally:
        release_all(fault_proxy, calls, [proc] if proc else [])
    print(f"\n{held} media requests held by the server; the cached read took {took:.3f} s")
    assert took <= 2, f"cat of a cached file took over 2 s behind {held} stalled reads"
    assert out == fdata[PAR2_CACHED]
    assert_alive(m)


# ====================================================================== i. clean shutdown
def test_sigterm_ends_storefs_within_3s_while_reads_stall_near_the_server(mount, fault_proxy, fdata):
    """Reads near the server are served on FUSE threads, and libfuse's loop returns only once
    every request a FUSE thread serves is answered: a read that waits for a server that never
    answers must see the session ending (SIGTERM) as an interrupt, as a worker's read sees
    `stopping` (docs/architecture.md, "Shutdown"), or storefs would wait for its time bounds."""
    m = mount(FB, endpoint=fault_proxy.endpoint)
    assert read_all(m.p(PAR2_CACHED)) == fdata[PAR2_CACHED]   # a download: the server is near
    files = [d + "/f.txt" for d in PAR2_DIRS[:4]]
    for n in files:
        os.stat(m.p(n))
    fault_proxy.add_rule(kind="media", name_prefix="par2/d", fault="blackhole")
    calls = [Call(read_all, m.p(n), name=f"read {n}") for n in files]
    try:
        assert wait_for(lambda: len(fault_proxy.requests("media", fault="blackhole")) >= 4, 10), \
            "the reads' media requests did not reach the server"
        t0 = time.monotonic()
        os.kill(m.pid, signal.SIGTERM)
        gone = wait_pid_gone(m.pid, 3)
        took = time.monotonic() - t0
    finally:
        release_all(fault_proxy, calls)
    assert gone, "storefs still running 3 s after SIGTERM while 4 reads waited for the server"
    print(f"\nstorefs exited {took:.2f} s after SIGTERM")
    assert not is_mounted(m.path)
    report = "; ".join(c.describe() for c in calls)
    assert all(c.done and c.error is not None for c in calls), report


def test_unmount_while_downloads_retry_503_forever_exits_within_8s(mount, fault_proxy, fdata):
    """Three readers read the first 64 KiB of a 16 MiB file and close it; every media request
    that does not start at offset 0 (read-ahead, storefs's or the kernel's) gets 503 forever,
    and request_timeout=60 keeps those downloads retrying. `fusermount3 -u` must then end
    storefs within 8 s. (Readers still blocked in read(2) would keep the mount busy: umount
    is EBUSY for any filesystem while a file is open, so the stuck work here has no reader.)"""
    m = mount(FB, endpoint=fault_proxy.endpoint, options=["response_timeout=2", "request_timeout=60"])
    for n in SHUT:
        os.stat(m.p(n))
    fault_proxy.add_rule(kind="media", name_prefix="shut/", fault="status", status=503,
                         match=lambda r: not (r.range or "").startswith("bytes=0-"))

    def head(name):
        with open(m.p(name), "rb") as f:
            return f.read(64 * KiB)

    def retrying():
        return fault_proxy.requests("media", fault="status")

    calls = [Call(head, n, name=f"head {n}") for n in SHUT]
    gone, took = False, None
    try:
        for c in calls:
            c.wait(20)
        report = "; ".join(c.describe() for c in calls)
        assert all(c.done and c.error is None for c in calls), report
        assert [c.value for c in calls] == [fdata[n][:64 * KiB] for n in SHUT]
        assert wait_for(lambda: len(retrying()) >= 3, 10), \
            f"only {len(retrying())} 503s: no download went on after the readers closed"
        time.sleep(1.0)   # well inside request_timeout: the downloads are still retrying
        first = min(r.t_arrival for r in retrying())
        last = max(r.t_arrival for r in retrying())
        t0 = time.monotonic()
        r = subprocess.run(["fusermount3", "-u", m.path], capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, f"fusermount3 -u: {r.stderr.strip()}"
        gone = wait_pid_gone(m.pid, 8)
        took = time.monotonic() - t0
    finally:
        release_all(fault_proxy, calls)
    assert gone, f"storefs still running 8 s after fusermount3 -u ({len(retrying())} 503s served)"
    assert not is_mounted(m.path)
    print(f"\nstorefs exited {took:.1f} s after fusermount3 -u; {len(retrying())} 503s served, "
          f"the first {t0 - first:.1f} s and the last {t0 - last:.1f} s before the unmount")


# ====================================================================== v0 through the proxy
def test_v0_media_and_metadata_faults_are_retried_bytes_stay_exact(mount, firebase, fdata):
    p = FaultProxy(firebase.plain_endpoint).start()   # FaultProxy is plain http both ways
    try:
        m = mount(FB, endpoint=p.endpoint, options=["protocol=firebase"])
        name = "soak/s-3MiB.bin"
        p.add_rule(kind="metadata", name_prefix=name, fault="status", status=503, count=1)
        assert os.stat(m.p(name)).st_size == len(fdata[name])
        p.add_rule(kind="media", name_prefix=name, fault="reset_mid_body", count=1)
        p.add_rule(kind="media", name_prefix=name, fault="status", status=500, count=1)
        p.add_rule(kind="media", name_prefix=name, fault="truncate", count=1)
        call = Call(read_all, m.p(name), name="read")
        if not call.wait(60):
            p.stop()
            call.wait(40)
        assert call.error is None and call.value == fdata[name], call.describe()
        kinds = {(r.kind, r.fault) for r in p.requests()}
        assert ("metadata", "status") in kinds and ("media", "reset_mid_body") in kinds, kinds
    finally:
        p.stop()
