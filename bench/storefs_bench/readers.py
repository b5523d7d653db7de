"""How bytes and names are read through a mount, with nothing waiting forever.

bench/README.md, "Stalls and failures": a `dd` whose position has not moved for 20 s is a
STALL (readers killed, then the daemon, which aborts the FUSE connection); pread and stat
loops run in a child process (workers.py) with a timeout; shell commands (find, ls -lR, …) get
a timeout too. Every failure is a BenchError naming where it stuck.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

from . import MIB
from .host import BenchError, daemon_diag
from .stats import percentile

STALL_S = 20.0  # no byte of progress for this long = the daemon is stuck
WORKERS_PY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers.py")
_DD_RE = re.compile(r"^(\d+) bytes .* copied, ([0-9.e+-]+) s", re.M)


# --------------------------------------------------------------------------- dd
def fd0_pos(pid: int) -> int | None:
    """File position of fd 0 (dd reads its if= through fd 0)."""
    try:
        with open(f"/proc/{pid}/fdinfo/0") as f:
            return int(f.readline().split()[1])
    except (OSError, IndexError, ValueError):
        return None


def run_dds(argvs: list, daemon_pid: int | None, stall_s: float = STALL_S) -> tuple:
    """Run dd processes at once; returns (list of (bytes, dd seconds), wall seconds).

    A watchdog thread kills them (and then the daemon, which aborts the FUSE connection so the
    readers are released) when no reader has advanced for stall_s; the main thread blocks in
    wait() so the wall time is exact."""
    env = dict(os.environ, LC_ALL="C")
    t0 = time.monotonic()
    procs = [subprocess.Popen(a, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
             for a in argvs]
    done = threading.Event()
    stalled: list = []

    def watch():
        last, since = None, time.monotonic()
        while not done.wait(0.5):
            pos = tuple(fd0_pos(p.pid) for p in procs)
            now = time.monotonic()
            if pos != last:
                last, since = pos, now
            elif now - since >= stall_s:
                stalled.append((pos, daemon_diag(daemon_pid)))
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                if not done.wait(5.0) and daemon_pid:
                    try:
                        os.kill(daemon_pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                return

    w = threading.Thread(target=watch, daemon=True)
    w.start()
    try:
        for p in procs:
            p.wait()
        wall = time.monotonic() - t0
    finally:
        done.set()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        w.join()
    if stalled:
        pos, diag = stalled[0]
        where = ", ".join("-" if x is None else f"{x / MIB:.0f} MiB" for x in pos)
        raise BenchError(f"STALL: no progress for {stall_s:.0f} s, reader position(s) {where}; {diag}")
    results = []
    for p in procs:
        err = p.stderr.read()
        m = _DD_RE.search(err)
        if p.returncode != 0 or not m:
            raise BenchError(f"dd rc {p.returncode}: {err.strip()[-300:]}")
        results.append((int(m.group(1)), float(m.group(2))))
    return results, wall


def seq_read_mibs(path: str, size: int, daemon_pid: int | None) -> float:
    """One `dd bs=1M` of the whole file; MiB/s from dd's own bytes/seconds."""
    [(got, secs)], _ = run_dds([["dd", f"if={path}", "of=/dev/null", "bs=1M"]], daemon_pid)
    if got != size:
        raise BenchError(f"dd read {got} bytes of {size}")
    return got / MIB / secs


def slice_dd_argvs(path: str, size: int, n: int) -> tuple:
    """(argvs, slice MiB): n dd processes, each reading its own 1/n of the file."""
    slice_mib = size // MIB // n
    return ([["dd", f"if={path}", "of=/dev/null", "bs=1M", f"skip={i * slice_mib}", f"count={slice_mib}"]
             for i in range(n)], slice_mib)


def parallel_readers_mibs(path: str, size: int, daemon_pid: int | None, n: int) -> tuple:
    """n dd readers at once on disjoint slices; (MiB/s = total bytes / wall time, the slowest
    reader's dd time over the fastest's: 1 when they shared the link evenly)."""
    argvs, slice_mib = slice_dd_argvs(path, size, n)
    results, wall = run_dds(argvs, daemon_pid)
    total = sum(b for b, _ in results)
    if total != slice_mib * MIB * n:
        raise BenchError(f"parallel readers got {total} bytes, want {slice_mib * MIB * n}")
    times = [t for _, t in results]
    return total / MIB / wall, max(times) / max(min(times), 1e-6)


# --------------------------------------------------------------------------- child-process loops
def run_worker(kind: str, spec: dict, timeout: float, what: str, daemon_pid: int | None,
               script: str = WORKERS_PY) -> dict:
    """`python3 script kind` with spec as JSON on stdin, its JSON answer; a timeout is a STALL
    (with what the daemon's threads wait in), a failure a BenchError with the worker's stderr."""
    try:
        out = subprocess.run([sys.executable, script, kind], input=json.dumps(spec),
                             capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise BenchError(f"STALL: {what} not done after {timeout:.0f} s; {daemon_diag(daemon_pid)}") from None
    if out.returncode != 0:
        raise BenchError(f"{kind} worker failed: {out.stderr.strip()[-400:]}")
    return json.loads(out.stdout)


def pread_latency(path: str, local: str, offsets: list, evict_first: bool, daemon_pid: int | None,
                  timeout: float = 120, disk: dict | None = None):
    """Runs the pread loop in a child (so a hung mount cannot hang the bench); returns (p50, p99)
    µs, and with `disk` (workers.pread_worker) the p50 of the disk reads interleaved with them
    as a third value."""
    spec = {"path": path, "local": local, "offsets": offsets, "evict": evict_first, **({"disk": disk} if disk else {})}
    res = run_worker("pread", spec, timeout, f"{len(offsets)} preads", daemon_pid)
    if "error" in res:
        raise BenchError(res["error"])
    if res["mismatches"]:
        raise BenchError(f"{res['mismatches']} of {len(offsets)} 4 KiB reads returned wrong bytes")
    lat = [ns / 1000.0 for ns in res["lat_ns"]]
    if disk:
        return percentile(lat, 50), percentile(lat, 99), percentile([ns / 1000.0 for ns in res["disk_lat_ns"]], 50)
    return percentile(lat, 50), percentile(lat, 99)


def stat_loop(paths: list, daemon_pid: int | None, timeout: float = 600) -> dict:
    """os.stat of every path in one child process; {"seconds", "p50_us", "p99_us", "sizes"}.

    A path that does not stat is an error, not a number."""
    res = run_worker("stat", {"paths": paths}, timeout, f"{len(paths)} stats", daemon_pid)
    if res["errors"]:
        raise BenchError(f"{res['errors']} of {len(paths)} stats failed, e.g. {'; '.join(res['first_errors'])}")
    lat = [ns / 1000.0 for ns in res["lat_ns"]]
    return {"seconds": res["seconds"], "p50_us": percentile(lat, 50), "p99_us": percentile(lat, 99),
            "sizes": res["sizes"]}


# --------------------------------------------------------------------------- shell commands
def timed_shell(cmd: str, daemon_pid: int | None, timeout: float = 180):
    """(seconds, stdout) of `bash -o pipefail -c cmd`; a failure or timeout is a BenchError."""
    t0 = time.monotonic()
    # Its own process group, so a timeout or Ctrl-C stops the whole pipeline (find, ls, wc),
    # not just bash: a reader left behind would keep the mount busy and delay its unmount.
    proc = subprocess.Popen(["bash", "-o", "pipefail", "-c", cmd], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        diag = daemon_diag(daemon_pid)
        _kill_group(proc)
        raise BenchError(f"STALL: `{cmd}` not done after {timeout:.0f} s; {diag}") from None
    except BaseException:
        _kill_group(proc)
        raise
    secs = time.monotonic() - t0
    if proc.returncode != 0:
        raise BenchError(f"`{cmd}` failed rc {proc.returncode}: {stderr.strip()[-300:]}")
    return secs, stdout


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group led by proc (our own child's pid), then reap proc."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.communicate()
