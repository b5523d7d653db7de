"""The machine the benchmark runs on: logging, cleanups, processes, /proc readers, load.

Everything here is independent of what is being measured. Two promises of bench/README.md
("Stalls and failures") live here: every process is stopped by its pid, and every cleanup
registered with `at_cleanup` runs at exit, on Ctrl-C and on SIGTERM.
"""

from __future__ import annotations

import atexit
import os
import resource
import signal
import socket
import subprocess
import sys
import time

from . import MIB


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class BenchError(RuntimeError):
    """A measurement failed: its cell shows `-` and the reason is listed under the table."""


class MountError(BenchError):
    """The daemon did not mount at all: no point trying its other rows."""


# --------------------------------------------------------------------------- cleanups
_cleanups: list = []  # callables run at exit / on signal, newest first


def at_cleanup(fn, first: bool = False) -> None:
    """Run fn at exit or on a signal; `first=True` registers it to run after all others."""
    if first:
        _cleanups.insert(0, fn)
    else:
        _cleanups.append(fn)


def forget_cleanup(fn) -> None:
    """fn has done its work by itself (e.g. a mount was unmounted normally)."""
    try:
        _cleanups.remove(fn)
    except ValueError:
        pass


def run_cleanups() -> None:
    while _cleanups:
        fn = _cleanups.pop()
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - cleanup must go on
            log(f"cleanup error: {exc}")


atexit.register(run_cleanups)


def _on_signal(signum, _frame):
    raise KeyboardInterrupt(f"signal {signum}")


def install_signal_handlers() -> None:
    """SIGTERM and SIGHUP become KeyboardInterrupt, so the same path unmounts and stops
    everything. SIGINT too, explicitly: a shell starts background jobs with SIGINT ignored,
    and Python then leaves it ignored."""
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, _on_signal)


# --------------------------------------------------------------------------- processes
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_process(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGTERM by pid, wait, then SIGKILL by pid."""
    if proc.poll() is not None:
        return
    try:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=timeout)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=timeout)


class ServerProcess:
    """A server the bench started (`self.proc`): its pid, and `stop` by pid, once, also run
    at exit when the run is cut short (`at_cleanup(self.stop)` when it starts)."""

    proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
            self.proc = None
        forget_cleanup(self.stop)


def mounted_fstype(mnt: str) -> str | None:
    """fstype of the mount at exactly `mnt` in /proc/self/mountinfo, or None."""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields = left.split()
            if len(fields) >= 5 and fields[4].replace("\\040", " ") == mnt:
                return right.split()[0]
    return None


# --------------------------------------------------------------------------- page cache
_drop_warned = False


def drop_caches() -> None:
    """Empty the page cache, dentries and inodes: the 'cold' of every cold row."""
    global _drop_warned
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError as exc:
        if not _drop_warned:
            log(f"WARNING: cannot drop caches ({exc}); 'cold' numbers may be warm")
            _drop_warned = True


def dir_size_mib(path: str) -> float:
    total = 0
    for dp, _dn, fns in os.walk(path):
        for fn in fns:
            try:
                total += os.lstat(os.path.join(dp, fn)).st_blocks * 512
            except OSError:
                pass
    return total / MIB


# --------------------------------------------------------------------------- /proc of one process
def proc_cpu_seconds(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def proc_wchar(pid: int) -> int | None:
    """Bytes the process wrote via write/send syscalls: for the memory-backend server, bytes served."""
    try:
        with open(f"/proc/{pid}/io") as f:
            for line in f:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _proc_status_mib(pid: int, field: str) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


def proc_hwm_mib(pid: int) -> float | None:
    """Peak resident memory (VmHWM) of a process so far."""
    return _proc_status_mib(pid, "VmHWM:")


def proc_rss_mib(pid: int) -> float | None:
    """Resident memory (VmRSS) of a process now."""
    return _proc_status_mib(pid, "VmRSS:")


def process_tree(pid: int) -> list:
    """pid and all its descendants (e.g. a server and the workers it forked)."""
    children: dict = {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(p))
            except (OSError, IndexError, ValueError):
                pass
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def tree_usage(pid: int) -> dict:
    """VmRSS, VmHWM (MiB) and CPU seconds summed over pid and its descendants."""
    tree = process_tree(pid)
    return {"rss": sum(proc_rss_mib(p) or 0.0 for p in tree), "hwm": sum(proc_hwm_mib(p) or 0.0 for p in tree),
            "cpu_s": sum(proc_cpu_seconds(p) or 0.0 for p in tree), "processes": len(tree)}


def daemon_diag(pid: int | None) -> str:
    """What the daemon's threads are blocked in, for a stall report."""
    if not pid:
        return ""
    waits: dict = {}
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/wchan") as f:
                    w = f.read().strip() or "running"
            except OSError:
                w = "?"
            waits[w] = waits.get(w, 0) + 1
    except OSError:
        return "daemon gone"
    rss = proc_hwm_mib(pid)
    return (f"daemon VmHWM {rss:.0f} MiB, threads by wait channel: "
            + ", ".join(f"{k}×{v}" for k, v in sorted(waits.items(), key=lambda kv: -kv[1])))


# --------------------------------------------------------------------------- machine load
def loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


def busy_processes(min_pct: float = 20.0) -> list:
    """Other processes using >= min_pct of a CPU over a 1 s sample (noise warning)."""
    def snap():
        out = {}
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                try:
                    with open(f"/proc/{pid}/stat") as f:
                        head, _, rest = f.read().rpartition(")")
                    fields = rest.split()
                    out[int(pid)] = (head.split("(", 1)[1], int(fields[11]) + int(fields[12]))
                except (OSError, IndexError, ValueError):
                    pass
        return out
    a = snap()
    time.sleep(1.0)
    b = snap()
    hz = os.sysconf("SC_CLK_TCK")
    busy = []
    for pid, (name, t) in b.items():
        if pid in a and pid != os.getpid():
            pct = (t - a[pid][1]) * 100.0 / hz
            if pct >= min_pct:
                busy.append(f"{name}[{pid}] {pct:.0f}%")
    return busy


def cpu_jiffies() -> tuple:
    """(busy, steal) jiffies of the whole machine from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal ...
    return v[0] + v[1] + v[2] + v[5] + v[6], v[7] if len(v) > 7 else 0


def busy_share(before: tuple, after: tuple, secs: float) -> float:
    """Percent of all CPUs the machine was busy between two cpu_jiffies() samples."""
    hz = os.sysconf("SC_CLK_TCK")
    return 100.0 * (after[0] - before[0]) / hz / (secs * (os.cpu_count() or 1))


def own_cpu_seconds() -> float:
    """CPU of this process plus every child it has reaped (dd, curl, daemons, server)."""
    a = resource.getrusage(resource.RUSAGE_SELF)
    b = resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime


class OtherLoad:
    """How much CPU processes that are not ours used during the run ("other load").

    The machine's busy jiffies minus our own CPU and that of every child we reaped: numbers
    taken while something else builds or benchmarks are not comparable (bench/README.md).
    Servers running inside this Python process (e.g. the scale bucket's threads) count as ours.
    """

    def __init__(self):
        self.t0 = time.monotonic()
        self.duration = 0.0
        self.noise = {"loadavg_start": loadavg(), "busy_start": busy_processes()}
        self._jif0, self._steal0 = cpu_jiffies()
        self._own0 = own_cpu_seconds()
        if self.noise["busy_start"]:
            log(f"WARNING: other processes are busy ({', '.join(self.noise['busy_start'])}); "
                f"load {self.noise['loadavg_start']}: numbers will be noisy on {os.cpu_count()} CPUs")

    def finish(self) -> dict:
        """Close the accounting; `duration` is then the run's wall time in seconds."""
        self.duration = duration = time.monotonic() - self.t0
        noise = self.noise
        noise["loadavg_end"] = loadavg()
        jif1, steal1 = cpu_jiffies()
        hz = os.sysconf("SC_CLK_TCK")
        # Whatever the machine was busy with that was not us (nor our reaped children).
        noise["foreign_cpu_s"] = round(max(0.0, (jif1 - self._jif0) / hz - (own_cpu_seconds() - self._own0)), 1)
        noise["steal_s"] = round((steal1 - self._steal0) / hz, 1)
        noise["cpu_s_available"] = round(duration * (os.cpu_count() or 1), 1)
        noise["busy_end"] = busy_processes()
        return noise


def other_load_line(noise: dict) -> str:
    """The report's "other load during the run" line."""
    return (f"other load during the run: {noise['foreign_cpu_s']:.1f} CPU-s not ours of {noise['cpu_s_available']:.0f} "
            f"available (steal {noise['steal_s']:.1f} s); load average at start {noise['loadavg_start']}, "
            f"at end {noise['loadavg_end']}"
            + (f"; busy at start: {', '.join(noise['busy_start'])}" if noise["busy_start"] else "")
            + (f"; busy at end: {', '.join(noise['busy_end'])}" if noise["busy_end"] else ""))
