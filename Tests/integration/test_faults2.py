"""Outages and interrupts seen from outside (issue 49): a server that comes back is asked
again at once, an interrupt is never taken for an outage, cached bytes answer whatever the
bucket does, and a handled signal ends any read promptly (docs/security.md, "Time bounds").

Objects live in `faults2-bucket`; every mount goes through the `fault_proxy` fixture.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from storefs_testlib import default_signals, read_whole, wait_for

F2 = "faults2-bucket"
KiB, MiB = 1 << 10, 1 << 20

CACHED = "obj/c.bin"
STALLED = "intr/direct.bin"
BACK = "back/uncached.bin"
DOWN = "back/first.bin"
PROBE = "back/probe.bin"
REFUSED = "back/refused.bin"
OUTAGE = ["response_timeout=2", "request_timeout=3"]
# Enough readers to fill every place a read can wait on the server: 16 FUSE threads (near the
# server), 64 read workers at most, and some over (docs/architecture.md, "Threads and locks").
QUEUE = [f"queue/f{i:02d}.bin" for i in range(88)]
QUEUED = "queue/interrupted.bin"
META_DIRS = [f"meta/d{i:02d}" for i in range(72)]
META_FREE = "meta/free"          # a directory no stalled lookup is in (the kernel serialises one's)

# A reader that handles SIGINT and calls pread(2) itself (no retry on EINTR, as Python's
# os.pread would), with O_DIRECT: prints {"rc", "errno", "elapsed", "after_signal"}.
DIRECT_READER = textwrap.dedent("""
    import ctypes, json, mmap, os, signal, sys, time
    libc = ctypes.CDLL(None, use_errno=True)
    libc.pread.restype = ctypes.c_ssize_t
    libc.pread.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_long]
    got = []
    signal.signal(signal.SIGINT, lambda s, f: got.append(time.monotonic()))
    path, n = sys.argv[1], int(sys.argv[2])
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buf = mmap.mmap(-1, n)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    t0 = time.monotonic()
    if os.environ.get("STOREFS_TEST_OS_PREAD"):   # CPython's own pread: retried on EINTR (PEP 475)
        try:
            rc, err = os.preadv(fd, [buf], 0), 0
        except OSError as exc:
            rc, err = -1, exc.errno
    else:
        rc = libc.pread(fd, addr, n, 0)
        err = ctypes.get_errno()
    t1 = time.monotonic()
    print(json.dumps({"rc": rc, "errno": err if rc < 0 else 0, "elapsed": t1 - t0,
                      "after_signal": (t1 - got[0]) if got else None}), flush=True)
""")


@pytest.fixture(scope="module")
def f2data(emulator) -> dict[str, bytes]:
    emulator.create_bucket(F2, exist_ok=True)
    rng = random.Random(49)
    data = {CACHED: rng.randbytes(256 * KiB), STALLED: rng.randbytes(4 * MiB),
            BACK: rng.randbytes(300 * KiB), DOWN: rng.randbytes(64 * KiB),
            PROBE: rng.randbytes(64 * KiB), REFUSED: rng.randbytes(64 * KiB)}
    for name in QUEUE + [QUEUED]:
        data[name] = rng.randbytes(64 * KiB)
    for d in META_DIRS + [META_FREE]:
        data[d + "/f.txt"] = b"f\n"
    for name, body in data.items():
        assert int(emulator.upload(F2, name, body)["size"]) == len(body), name
    return data


@pytest.mark.parametrize("fault", [{"fault": "blackhole"},
                                   {"fault": "stall_mid_body", "seconds": 60, "fraction": 0.25}],
                         ids=["blackhole", "stall_mid_body"])
def test_sigint_ends_an_o_direct_read_of_2mib_with_eintr_and_a_cached_file_still_reads(
        mount, fault_proxy, f2data, fault):
    m = mount(F2, endpoint=fault_proxy.endpoint, options=["response_timeout=10", "request_timeout=60"])
    assert read_whole(m.p(CACHED)) == f2data[CACHED]
    os.stat(m.p(STALLED))
    fault_proxy.add_rule(kind="media", name_prefix=STALLED, **fault)
    proc = subprocess.Popen([sys.executable, "-c", DIRECT_READER, m.p(STALLED), str(2 * MiB)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=default_signals)
    try:
        assert wait_for(lambda: fault_proxy.requests("media", fault=fault["fault"]), 10), \
            "the read's media request never reached the server"
        time.sleep(1.0)
        assert proc.poll() is None, f"the reader ended before the signal: {proc.communicate()}"
        proc.send_signal(signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            out, err = None, None
    finally:
        if proc.poll() is None:
            fault_proxy.release()
            fault_proxy.clear_rules()
            try:
                proc.communicate(timeout=80)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate(timeout=10)
    assert out is not None, "the O_DIRECT pread was still blocked 5 s after a handled SIGINT"
    result = json.loads(out.strip().splitlines()[-1])
    assert result["rc"] == -1 and result["errno"] == errno.EINTR, \
        f"pread after SIGINT: {result} (want EINTR); stderr {err}"
    assert result["after_signal"] is not None and result["after_signal"] < 3, result
    # The server still holds every media request: a cached file reads without it.
    t0 = time.monotonic()
    assert read_whole(m.p(CACHED)) == f2data[CACHED], "a cached file did not read after the interrupt"
    assert time.monotonic() - t0 < 2


def direct_pread(path: str, n: int) -> bytes:
    """One O_DIRECT pread at 0: a request of the reading thread, not a background one (the
    kernel holds at most 12 of those in flight), so 40 of them reach storefs at once."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        buf = mmap.mmap(-1, n)
        return bytes(buf[:os.preadv(fd, [buf], 0)])
    finally:
        os.close(fd)


def timed_read(path: str, direct: bool = False):
    """(seconds, bytes or the OSError); `direct`: one O_DIRECT pread of 64 KiB, one request
    (no kernel readahead beside it, no second try of a failed page)."""
    t0 = time.monotonic()
    try:
        got = direct_pread(path, 64 * KiB) if direct else read_whole(path)
    except OSError as exc:
        got = exc
    return time.monotonic() - t0, got


def _start_outage(m, fault_proxy, f2data) -> None:
    """Every name known and one file cached; then every media request is held, and a read of
    an uncached file fails for good (EIO within request_timeout): an outage is assumed."""
    assert read_whole(m.p(CACHED)) == f2data[CACHED]
    for name in (BACK, DOWN, PROBE, REFUSED):
        assert os.stat(m.p(name)).st_size == len(f2data[name])
    # Lookups leave requests running (first pages, probe halves): an answer to one of those
    # during the failing read would make it one unlucky request, not an outage.
    assert fault_proxy.wait_idle(5), f"{fault_proxy.inflight()} requests still running"
    time.sleep(0.2)
    fault_proxy.add_rule(kind="media", fault="blackhole")
    took, got = timed_read(m.p(DOWN), direct=True)
    assert isinstance(got, OSError) and got.errno == errno.EIO, f"{got!r} after {took:.1f} s"
    assert took < 10, f"the failing read took {took:.1f} s"
    assert wait_for(lambda: "the bucket does not answer" in m.stderr(), 2), \
        "no outage was assumed: the test would not test the outage"


def _release(fault_proxy) -> None:
    fault_proxy.clear_rules()
    fault_proxy.release()


def _interrupt(proc):
    """SIGINT to the child; its (stdout, stderr) if it ended within 5 s, else (None, None)."""
    proc.send_signal(signal.SIGINT)
    try:
        return proc.communicate(timeout=5)
    except subprocess.TimeoutExpired:
        return None, None


def _release_and_reap(fault_proxy, proc, threads) -> None:
    """Lets the stalled requests go, then waits for the interrupted child (killed if it does not
    end) and the threads that held the workers."""
    _release(fault_proxy)
    if proc is not None and proc.poll() is None:
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate(timeout=10)
    for t in threads:
        t.join(60)


def test_a_read_issued_after_the_server_is_back_succeeds_within_the_outage_hold(mount, fault_proxy, f2data):
    m = mount(F2, endpoint=fault_proxy.endpoint, options=OUTAGE)
    try:
        _start_outage(m, fault_proxy, f2data)
        # Kept: during the outage cached bytes and known attributes answer without asking.
        asked = len(fault_proxy.requests())
        took, got = timed_read(m.p(CACHED))
        assert got == f2data[CACHED] and took < 1, f"cached read during the outage: {took:.2f} s"
        assert os.stat(m.p(BACK)).st_size == len(f2data[BACK])
        assert len(fault_proxy.requests()) == asked, \
            [(r.kind, r.name or r.prefix) for r in fault_proxy.requests()[asked:]]
    finally:
        _release(fault_proxy)
    # The server is back, well inside BucketHealth's 5 s hold: the next read asks it.
    took, got = timed_read(m.p(BACK))
    assert got == f2data[BACK], \
        f"a read issued after the server came back failed: {got!r} after {took:.2f} s"
    assert fault_proxy.requests("media", name_prefix=BACK), "the read did not ask the server"


def test_during_an_outage_one_read_asks_and_another_fails_at_once(mount, fault_proxy, f2data):
    m = mount(F2, endpoint=fault_proxy.endpoint, options=OUTAGE)
    result: dict = {}
    try:
        _start_outage(m, fault_proxy, f2data)
        import threading
        probe = threading.Thread(target=lambda: result.update(probe=timed_read(m.p(PROBE), direct=True)), daemon=True)
        probe.start()
        asked = wait_for(lambda: fault_proxy.requests("media", name_prefix=PROBE), 5)
        took, got = timed_read(m.p(REFUSED), direct=True)
        probe.join(15)
    finally:
        _release(fault_proxy)
    assert asked, f"no read asked the server during the outage (the probe): {result}"
    assert isinstance(got, OSError) and got.errno == errno.EIO and took < 1.5, \
        f"a second read while the probe asks: {got!r} after {took:.2f} s (want EIO at once)"
    assert not fault_proxy.requests("media", name_prefix=REFUSED), "two reads asked at once"
    assert not probe.is_alive(), "the probe's read never ended"


def test_sigint_ends_an_o_direct_read_queued_behind_stalled_read_workers_with_eintr(mount, fault_proxy, f2data):
    """88 reads wait on a server that holds every answer: up to 16 on FUSE threads, 64 on the
    read workers (their most), the rest queued for a worker (docs/architecture.md, "Threads").
    A reader that handles SIGINT, queued behind them, gets EINTR at once: its INTERRUPT answers
    it, it does not wait for a worker to come free (request_timeout)."""
    import threading
    m = mount(F2, endpoint=fault_proxy.endpoint, options=["response_timeout=30", "request_timeout=30"])
    assert read_whole(m.p(CACHED)) == f2data[CACHED]      # a download: the server is near
    for name in QUEUE + [QUEUED]:
        os.stat(m.p(name))
    fault_proxy.add_rule(kind="media", name_prefix="queue/", fault="blackhole")
    results: dict = {}

    def stalled(name):
        try:
            results[name] = direct_pread(m.p(name), 64 * KiB)
        except OSError as exc:
            results[name] = exc

    threads = [threading.Thread(target=stalled, args=(n,), daemon=True) for n in QUEUE]
    proc = None
    out = err = None
    try:
        for t in threads:
            t.start()
        held = wait_for(lambda: len(fault_proxy.requests("media", fault="blackhole")) >= 64, 30)
        assert held, f"only {len(fault_proxy.requests('media', fault='blackhole'))} reads reached the server"
        time.sleep(0.5)
        proc = subprocess.Popen([sys.executable, "-c", DIRECT_READER, m.p(QUEUED), str(64 * KiB)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                preexec_fn=default_signals)
        time.sleep(1.0)
        assert proc.poll() is None, f"the reader ended before the signal: {proc.communicate()}"
        queued = not fault_proxy.requests("media", name_prefix=QUEUED)
        out, err = _interrupt(proc)
    finally:
        _release_and_reap(fault_proxy, proc, threads)
    assert queued, "the interrupted read reached the server: it was not queued behind the workers"
    assert out is not None, "a queued O_DIRECT pread was still blocked 5 s after a handled SIGINT"
    result = json.loads(out.strip().splitlines()[-1])
    assert result["rc"] == -1 and result["errno"] == errno.EINTR, f"pread after SIGINT: {result}; stderr {err}"
    assert result["after_signal"] is not None and result["after_signal"] < 3, result
    assert not any(t.is_alive() for t in threads), "stalled reads still blocked after the server let go"


def test_a_python_reader_whose_sigint_handler_returns_reads_again_and_a_cached_file_still_reads(
        mount, fault_proxy, f2data):
    """Issue 49's reproduction, explained (docs/fuse-notes.md, item 5): the INTERRUPT is
    answered EINTR at once, but CPython's os.pread retries on EINTR when the handler returns
    normally (PEP 475); the retried read is not interrupted and fails with EIO after
    request_timeout, as any read of a server that never answers. Cached bytes read at once
    after it, outage or not."""
    m = mount(F2, endpoint=fault_proxy.endpoint,
              options=["response_timeout=4", "request_timeout=4", "log_level=debug"])
    assert read_whole(m.p(CACHED)) == f2data[CACHED]
    os.stat(m.p(STALLED))
    fault_proxy.add_rule(kind="media", name_prefix=STALLED, fault="blackhole")
    proc = subprocess.Popen([sys.executable, "-c", DIRECT_READER, m.p(STALLED), str(2 * MiB)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, STOREFS_TEST_OS_PREAD="1"), preexec_fn=default_signals)
    try:
        assert wait_for(lambda: fault_proxy.requests("media", fault="blackhole"), 10), \
            "the read's media request never reached the server"
        time.sleep(1.0)
        assert proc.poll() is None, f"the reader ended before the signal: {proc.communicate()}"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
    result = json.loads(out.strip().splitlines()[-1])
    log = m.stderr()
    assert "result=EINTR" in log, "storefs did not answer the INTERRUPT with EINTR"
    assert result["rc"] == -1 and result["errno"] == errno.EIO and 3 < result["after_signal"] < 10, \
        f"want EIO about request_timeout after the signal (the retried read): {result}"
    t0 = time.monotonic()
    try:
        assert read_whole(m.p(CACHED)) == f2data[CACHED], "a cached file did not read after the interrupt"
        assert time.monotonic() - t0 < 2
    finally:
        _release(fault_proxy)


# A process that handles SIGINT and calls stat(2) itself (no retry on EINTR).
STATTER = textwrap.dedent("""
    import ctypes, json, signal, sys, time
    libc = ctypes.CDLL(None, use_errno=True)
    got = []
    signal.signal(signal.SIGINT, lambda s, f: got.append(time.monotonic()))
    buf = ctypes.create_string_buffer(512)
    t0 = time.monotonic()
    rc = libc.stat(sys.argv[1].encode(), buf)
    err = ctypes.get_errno()
    t1 = time.monotonic()
    print(json.dumps({"rc": rc, "errno": err if rc < 0 else 0, "elapsed": t1 - t0,
                      "after_signal": (t1 - got[0]) if got else None}), flush=True)
""")


def test_sigint_ends_a_stat_queued_behind_64_stalled_lookups_with_eintr(mount, fault_proxy, f2data):
    """72 lookups of names in 72 directories wait on a server that holds every answer: 64 hold
    the metadata workers, 8 are queued. A stat of another name, from a process that handles
    SIGINT, waits behind them for a worker; its INTERRUPT answers it EINTR at once."""
    import threading
    m = mount(F2, endpoint=fault_proxy.endpoint, options=["response_timeout=30", "request_timeout=30"])
    for d in META_DIRS + [META_FREE]:
        os.stat(m.p(d))
    stalled = [d + "/stall" for d in META_DIRS]
    fault_proxy.add_rule(kind=("metadata", "list"), fault="blackhole",
                         match=lambda r: (r.name or r.prefix or "").startswith("meta/d"))
    threads = [threading.Thread(target=lambda n=n: os.path.exists(m.p(n)), daemon=True) for n in stalled]
    proc = None
    out = err = None
    try:
        for t in threads:
            t.start()

        def held():
            return {(r.name or r.prefix or "").split("/")[1] for r in fault_proxy.requests(fault="blackhole")}

        # Their requests wait on 16 probe threads (docs/architecture.md, "Threads"), so only some
        # reach the server; every lookup holds a metadata worker meanwhile.
        assert wait_for(lambda: len(held()) >= 4, 15), f"only {len(held())} lookups reached the server"
        time.sleep(2.0)
        assert all(t.is_alive() for t in threads), "a stalled lookup ended: the server let it go"
        proc = subprocess.Popen([sys.executable, "-c", STATTER, m.p(META_FREE, "another")],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                preexec_fn=default_signals)
        time.sleep(1.0)
        assert proc.poll() is None, f"the stat ended before the signal: {proc.communicate()}"
        out, err = _interrupt(proc)
    finally:
        _release_and_reap(fault_proxy, proc, threads)
    assert out is not None, "a stat queued behind stalled lookups was still blocked 5 s after a handled SIGINT"
    result = json.loads(out.strip().splitlines()[-1])
    assert result["rc"] == -1 and result["errno"] == errno.EINTR, f"stat after SIGINT: {result}; stderr {err}"
    assert result["after_signal"] is not None and result["after_signal"] < 3, result


def test_readers_of_60_files_behind_a_server_stall_each_wait_about_the_stall(mount, fault_proxy, f2data):
    """Issue 49, item 11: a download that waits on a stalled server holds its read worker, and
    readers of other files must not queue behind it: more workers start (up to 64) while reads
    wait. 60 readers of different files behind a server that delays every answer by STALL s
    each get exact bytes after about STALL s, not after two or three stalls in turn (with 16
    workers and 16 FUSE threads, the median was about two stalls)."""
    import statistics
    import threading
    stall = 4.0
    readers = QUEUE[:60]
    m = mount(F2, endpoint=fault_proxy.endpoint, options=["response_timeout=30", "request_timeout=60"])
    assert read_whole(m.p(CACHED)) == f2data[CACHED]
    for name in readers:
        os.stat(m.p(name))
    fault_proxy.add_rule(kind="media", name_prefix="queue/", fault="delay", seconds=stall)
    results: dict = {}

    def timed(name):
        t0 = time.monotonic()
        try:
            got = direct_pread(m.p(name), 64 * KiB)
        except OSError as exc:
            got = exc
        results[name] = (time.monotonic() - t0, got)

    threads = [threading.Thread(target=timed, args=(n,), daemon=True) for n in readers]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        _release(fault_proxy)
    assert len(results) == len(readers), f"{len(readers) - len(results)} readers never returned"
    wrong = [n for n, (_, got) in results.items() if got != f2data[n]]
    assert not wrong, f"{len(wrong)} readers got wrong bytes or errors, e.g. {wrong[0]}: {results[wrong[0]][1]!r}"
    times = sorted(t for t, _ in results.values())
    median = statistics.median(times)
    assert median < 1.6 * stall, f"median {median:.1f} s behind a {stall} s stall (slowest {times[-1]:.1f} s)"
    assert times[-1] < 2.6 * stall, f"slowest {times[-1]:.1f} s behind a {stall} s stall (median {median:.1f} s)"
