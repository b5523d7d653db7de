"""What the fault toolkit still found (issue 49, items 3, 4 and 10), seen from outside: lookups
stalled together each wait one stall, threads end once a load is over, and memory comes back
after every round of a heavy read load (docs/architecture.md, "Threads"; docs/security.md,
"Time bounds").

Item 3 mounts through the `fault_proxy` fixture (plain http both ways, its docstring says why);
item 4 walks the synthetic bucket (scale_server.py, plain http like test_scale.py: the thread
count does not depend on TLS); item 10 reads from the session's fake-gcs-server over https.
"""

from __future__ import annotations

import os
import random
import subprocess
import threading
import time

import pytest

from fault_proxy import FaultProxy
from scale_server import ScaleServer
from storefs_testlib import vm_kib

F3 = "faults3-bucket"
STALL = 3.0
LOOKUPS = 16
DIRS = [f"look/d{i:02d}" for i in range(LOOKUPS)]


# ====================================================================== helpers
def thread_count(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    raise AssertionError(f"no Threads: in /proc/{pid}/status")


# ====================================================================== item 3: lookups
@pytest.fixture(scope="module")
def f3data(emulator) -> None:
    emulator.create_bucket(F3, exist_ok=True)
    for d in DIRS:
        assert int(emulator.upload(F3, d + "/f.txt", b"f\n")["size"]) == 2


@pytest.fixture(params=["gcs", "firebase"])
def stalled(request, fault_proxy, f3data):
    """(the proxy, mount options) for each protocol: a FaultProxy in front of fake-gcs-server's
    JSON API, or of the v0 fixture."""
    if request.param == "gcs":
        yield fault_proxy, []
        return
    firebase = request.getfixturevalue("firebase")
    p = FaultProxy(firebase.plain_endpoint).start()   # plain both ways, as fault_proxy
    try:
        yield p, ["protocol=firebase"]
    finally:
        p.stop()


def test_16_lookups_of_missing_names_stalled_together_each_take_one_stall_not_three(mount, stalled):
    """Each lookup of a name not yet known asks up to three things at once (the directory's
    first page or, over v0, the file's first bytes; the metadata GET; "is it a directory?"),
    on threads of a pool. With 16 of those threads, 16 lookups stalled together queued their
    requests behind each other's: the issue's lookups of missing names took three stalls."""
    proxy, options = stalled
    m = mount(F3, endpoint=proxy.endpoint, options=["list_ahead=0", *options])
    for d in DIRS:
        assert os.path.isdir(m.p(d))
    assert proxy.wait_idle(10), f"{proxy.inflight()} requests still running before the stall"
    proxy.reset()
    proxy.add_rule(fault="delay", seconds=STALL)
    took: dict[int, float | str] = {}

    def look(i: int) -> None:
        t0 = time.monotonic()
        try:
            os.stat(m.p(DIRS[i], "missing.txt"))
            took[i] = "found"
        except FileNotFoundError:
            took[i] = time.monotonic() - t0
        except OSError as exc:
            took[i] = repr(exc)

    threads = [threading.Thread(target=look, args=(i,)) for i in range(LOOKUPS)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    arrivals = sorted(r.t_arrival - t0 for r in proxy.requests())
    proxy.release()
    times = [took.get(i, "still waiting") for i in range(LOOKUPS)]
    assert all(isinstance(t, float) for t in times), f"lookups: {times}"
    print(f"\n{LOOKUPS} lookups stalled {STALL:.0f} s each: {sorted(round(t, 1) for t in times)}; "
          f"{len(arrivals)} requests, the last reached the server {arrivals[-1]:.1f} s in")
    assert max(times) < 1.7 * STALL, f"lookups of missing names took {sorted(round(t, 1) for t in times)} s"
    assert arrivals[-1] < STALL, f"a lookup's request waited for another's stall: arrivals {arrivals}"


# ====================================================================== item 4: threads
WALK_DIRS, WALK_FILES = 20, 1000          # the 20,000 files
WALKS = 4
# docs/architecture.md, "Threads": once a load is over, what stays is the daemon's few fixed
# threads, at most 16 idle FUSE threads and the floors of the pools the walk used (4 metadata,
# 2 probe, 1 list, 1 namespace); threads above a floor end after 5 s without work.
SETTLED_BOUND = 32


@pytest.fixture(scope="module")
def walk_tree():
    with ScaleServer(bucket="walk-bucket", dirs=WALK_DIRS, files=WALK_FILES) as server:
        yield server


def settled_threads(pid: int, timeout: float = 15.0) -> int:
    """The thread count once it has stopped falling (idle pool threads end after 5 s)."""
    deadline = time.monotonic() + timeout
    last, since = thread_count(pid), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.25)
        now = thread_count(pid)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= 6.0:
            break
    return last


def test_threads_after_repeated_find_walks_stay_under_32_and_do_not_creep(mount, walk_tree):
    m = mount("walk-bucket", endpoint=walk_tree.endpoint)
    peak = [thread_count(m.pid)]
    sampling = threading.Event()
    sampling.set()

    def sampler() -> None:
        while sampling.is_set():
            try:
                peak.append(thread_count(m.pid))
            except (OSError, AssertionError):
                return
            time.sleep(0.05)

    threading.Thread(target=sampler, daemon=True).start()
    settled = []
    try:
        for _ in range(WALKS):
            out = subprocess.run(["find", m.path], capture_output=True, timeout=300, check=True).stdout
            assert out.count(b"\n") == 1 + WALK_DIRS * (WALK_FILES + 1), "find did not see the whole tree"
            settled.append(settled_threads(m.pid))
    finally:
        sampling.clear()
    print(f"threads after each of {WALKS} walks of {WALK_DIRS * WALK_FILES} files: {settled}; "
          f"most during the walks {max(peak)}")
    assert max(settled) <= SETTLED_BOUND, \
        f"threads after the walks: {settled} (bound {SETTLED_BOUND}; peak {max(peak)})"
    # Which FUSE threads a walk's last requests landed on decides whether one more stays.
    assert settled[-1] <= settled[0] + 2, f"threads creep walk after walk: {settled}"


# ====================================================================== item 10: memory
MiB = 1 << 20
MEM_OBJECTS = [f"mem/o{i}.bin" for i in range(2)]
MEM_SIZE = 48 * MiB
ROUNDS = 4
READERS = 16
ROUND_BYTES = 160 * MiB
BACK_WITHIN = 3.0          # seconds after the load ends
OVER_BASELINE = 32         # MiB


@pytest.fixture(scope="module")
def memdata(emulator) -> dict[str, bytes]:
    emulator.create_bucket(F3, exist_ok=True)
    data = {}
    for i, name in enumerate(MEM_OBJECTS):
        data[name] = random.Random(f"mem{i}").randbytes(MEM_SIZE)
        assert int(emulator.upload(F3, name, data[name])["size"]) == MEM_SIZE
    return data


def read_load(m, data: dict[str, bytes], seed: int) -> list[str]:
    """16 readers, half sequential (runs of 8-32 MiB), half random (4 KiB-1 MiB), ROUND_BYTES
    in all, the page cache dropped as they go so reads reach storefs; every byte checked."""
    names = list(data)
    errors: list[str] = []

    def reader(i: int) -> None:
        rng = random.Random(f"{seed}-{i}")
        done, budget = 0, ROUND_BYTES // READERS
        while done < budget and not errors:
            name = rng.choice(names)
            body = data[name]
            fd = os.open(m.p(name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                if i % 2 == 0:
                    off = rng.randrange(0, MEM_SIZE, MiB)
                    end = min(MEM_SIZE, off + rng.randint(8, 32) * MiB)
                    while off < end and done < budget:
                        got = os.pread(fd, MiB, off)
                        if not got or got != body[off:off + len(got)]:
                            errors.append(f"reader {i}: {name} at {off}: wrong bytes")
                            return
                        off += len(got)
                        done += len(got)
                else:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
                    for _ in range(32):
                        n = int(2 ** rng.uniform(12, 20))
                        off = rng.randrange(MEM_SIZE - n)
                        if os.pread(fd, n, off) != body[off:off + n]:
                            errors.append(f"reader {i}: {name} at {off}+{n}: wrong bytes")
                            return
                        done += n
            except OSError as exc:
                errors.append(f"reader {i}: {exc!r}")
            finally:
                os.close(fd)

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(READERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return errors


def test_memory_comes_back_within_32_mib_of_the_baseline_3_s_after_each_of_4_rounds(memdata, mount):
    """Issue 49, item 10: 5 s after a heavy read load RSS was back to 40 MiB in one run and at
    204 MiB in another (baseline 31): the pools let their buffers go 2-4 s after their last use,
    depending on the phase of the 2 s tick, and that use comes up to a second after the readers
    stop (the kernel's read-ahead of the last sequential reads is still being answered)."""
    m = mount(F3, options=["cache_size=32M"])
    for name in MEM_OBJECTS:
        assert os.stat(m.p(name)).st_size == MEM_SIZE
    time.sleep(1.0)
    baseline = vm_kib(m.pid, "VmRSS") // 1024
    bound = baseline + OVER_BASELINE
    back_after, peaks, loads = [], [], []
    for r in range(ROUNDS):
        t0 = time.monotonic()
        errors = read_load(m, memdata, r)
        loads.append(round(time.monotonic() - t0, 1))
        assert not errors, errors[:5]
        ended = time.monotonic()
        peaks.append(vm_kib(m.pid, "VmHWM") // 1024)
        while vm_kib(m.pid, "VmRSS") // 1024 > bound and time.monotonic() - ended < 10:
            time.sleep(0.05)
        back_after.append(round(time.monotonic() - ended, 2))
        time.sleep(max(0.0, BACK_WITHIN + 0.5 - (time.monotonic() - ended)))
    print(f"\nbaseline {baseline} MiB, peak {max(peaks)} MiB; RSS back under {bound} MiB after "
          f"{back_after} s in {ROUNDS} rounds of {ROUND_BYTES // MiB} MiB (each read in {loads} s)")
    assert max(peaks) > bound + 32, f"the load never raised RSS far above the bound (peak {max(peaks)} MiB)"
    assert max(back_after) <= BACK_WITHIN, \
        f"RSS came back within {OVER_BASELINE} MiB of the baseline ({baseline}) only after {back_after} s"
