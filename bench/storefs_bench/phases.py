"""The rows measured on each mount in the loopback and --link settings (bench/README.md,
"What happens" 4). Each phase starts from a fresh mount with a fresh, empty cache dir and
dropped caches, unless it says otherwise:

- `sequential`: cold `dd` of big.bin (cold_seq), the daemon's VmHWM after it (rss), its and the
  server's CPU per GiB (with --tls the daemon's is a row too: cpu_gib) and the bytes the server sent; then the warm re-read on a remount with
  the same cache dir (warm_seq), and once more without drop_caches (an extra line).
- `random`: 500 cold 4 KiB preads (rand_cold_*), then the same offsets from the daemon's
  cache (rand_cached_*), then again after drop_caches (an extra line).
- `parallel readers`: N dd on disjoint slices (par8; with --link also 4 readers: par4).
- `first byte` (--link only): `head -c 1` of big.bin on a fresh mount (first_byte); of
  tree/d07/f0712.txt on another (first_byte_tree), then of tree/d07/f0745.txt
  (first_byte_sibling).
- `short read`: `head -c 100000` of big.bin on a fresh mount, and the MiB the server sent for
  it within a second after (head_100k): read-ahead should grow with evidence, not fetch
  megabytes for a short read.
- `find` / `ls -lR` of the 10,000-file tree (find, lsR).

Values go to res[row][system] (a list, one per run); extras to extra[key][system]; a failed
phase becomes a line under the table and the other phases go on.
"""

from __future__ import annotations

import os
import random
import shlex
import shutil
import subprocess
import time

from . import MIB
from .data import BIG, SEED, TREE_ENTRIES
from .host import (BenchError, MountError, busy_share, cpu_jiffies, dir_size_mib, drop_caches, log,
                   proc_cpu_seconds)
from .readers import parallel_readers_mibs, pread_latency, seq_read_mibs, timed_shell
from .systems import Mount, RunContext

RAND_READS = 500
READERS = 8
LINK_READERS = 4  # --link: 4 readers of disjoint slices, beside the 8


def random_offsets(size: int, seed: int) -> list:
    """RAND_READS seeded-random 4 KiB-aligned offsets in the object."""
    rng = random.Random(seed)
    return [rng.randrange(0, size // 4096) * 4096 for _ in range(RAND_READS)]


class SystemRun:
    """One system's phases in one run: where values go, and how a failed phase is recorded."""

    def __init__(self, ctx: RunContext, system: str, run_i: int, res: dict, extra: dict, errors: list,
                 link=None):
        self.ctx, self.system, self.run_i = ctx, system, run_i
        self.res, self.extra, self.errors = res, extra, errors
        self.link = link  # the LinkProxy with --link, whose stats give requests/connections per phase
        self.big = os.path.join(ctx.mnt, BIG)
        # The floor has no cache (a warm or cached pass would time the same GETs again) and
        # shows one file (no tree to walk).
        self.cacheless = system == "floor"

    def put(self, key, val):
        self.res.setdefault(key, {}).setdefault(self.system, []).append(val)

    def put_extra(self, key, val):
        self.extra.setdefault(key, {}).setdefault(self.system, []).append(val)

    def last(self, key):
        return self.res[key][self.system][-1]

    def step(self, name: str, fn, link_label: str | None = None) -> None:
        """Run one phase; a failure is logged and listed, a mount failure ends this system's run.
        With --link, what it cost on the wire is recorded under `link_label` (else `name`)."""
        if self.system in self.ctx.dead:
            return
        try:
            self._link_reset()
            fn()
            self._link_record(link_label or name)
        except MountError as exc:
            msg = f"run {self.run_i + 1} {self.system} {name}: {exc} -- {self.system} skipped from here on"
            log("ERROR " + msg)
            self.errors.append(msg)
            self.ctx.dead[self.system] = str(exc)
        except (BenchError, subprocess.TimeoutExpired, OSError, ValueError) as exc:
            msg = f"run {self.run_i + 1} {self.system} {name}: {exc}"
            log("ERROR " + msg)
            self.errors.append(msg)

    def _link_reset(self) -> None:
        if self.link is not None:
            self.link.reset_stats()

    def _link_record(self, phase: str) -> None:
        """With --link: what the phase cost on the wire (the proxy's request/connection counts).
        A part that sent no request at all (the floor has no cached pass) is not recorded."""
        if self.link is not None:
            stats = self.link.stats()
            if stats.get("requests", 0) or stats.get("bytes", 0):
                self.put_extra(f"link_stats:{phase}", {k: v for k, v in stats.items() if k != "per_request"})

    def link_checkpoint(self, label: str) -> None:
        """With --link: records what the phase cost on the wire so far under `label`, and counts
        afresh from here (a phase whose parts are worth reading apart)."""
        self._link_record(label)
        self._link_reset()

    def fresh_cache(self) -> str:
        return self.ctx.new_cache_dir(self.system)

    def mount(self, cache: str) -> Mount:
        return Mount(self.system, self.ctx, self.ctx.mnt, cache)


# --------------------------------------------------------------------------- phases
def sequential_phase(sr: SystemRun) -> None:
    """Cold sequential read, peak RSS and CPU; then the warm re-reads on the same cache dir."""
    size, server_pid = sr.ctx.size, sr.ctx.server.pid
    cache = sr.fresh_cache()
    try:
        with sr.mount(cache) as m:
            drop_caches()
            cpu0, srv0, w0 = m.cpu_seconds(), proc_cpu_seconds(server_pid), sr.ctx.server.sent_bytes()
            j0, t0 = cpu_jiffies(), time.monotonic()
            v = seq_read_mibs(sr.big, size, m.pid)
            sr.put_extra("machine_busy_pct_cold_seq", busy_share(j0, cpu_jiffies(), time.monotonic() - t0))
            cpu1, srv1, w1 = m.cpu_seconds(), proc_cpu_seconds(server_pid), sr.ctx.server.sent_bytes()
            if w0 is not None and w1 is not None:
                sr.put_extra("server_mib_sent_cold_seq", (w1 - w0) / MIB)
            sr.put("cold_seq", v)
            sr.put("rss", m.hwm_mib())
            if cpu0 is not None and cpu1 is not None:
                sr.put_extra("daemon_cpu_s_per_gib_cold_seq", (cpu1 - cpu0) / (size / (1 << 30)))
                if sr.ctx.pki is not None:  # --tls: a row of the table (decryption is in it)
                    sr.put("cpu_gib", (cpu1 - cpu0) / (size / (1 << 30)))
            if srv0 is not None and srv1 is not None:
                sr.put_extra("server_cpu_s_per_gib_cold_seq", (srv1 - srv0) / (size / (1 << 30)))
            log(f"  {sr.system} cold sequential {v:.0f} MiB/s, VmHWM {sr.last('rss'):.1f} MiB")
        if sr.cacheless:
            return
        sr.put_extra("cache_dir_mib_after_cold_seq", dir_size_mib(cache))
        with sr.mount(cache) as m:
            drop_caches()
            v = seq_read_mibs(sr.big, size, m.pid)
            sr.put("warm_seq", v)
            log(f"  {sr.system} warm re-read {v:.0f} MiB/s")
        # The same once more without drop_caches: the cache files now sit in the page cache,
        # so this is the daemon's own ceiling rather than the disk's (reference, not a row).
        with sr.mount(cache) as m:
            v = seq_read_mibs(sr.big, size, m.pid)
            sr.put_extra("warm_seq_page_cache_mibs", v)
            log(f"  {sr.system} warm re-read, cache files in page cache {v:.0f} MiB/s")
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def random_phase(sr: SystemRun) -> None:
    """Random 4 KiB preads: cold, then from the daemon's cache, then after drop_caches."""
    ctx = sr.ctx
    cache = sr.fresh_cache()
    offs = random_offsets(ctx.size, SEED + 100 + sr.run_i)

    def preads(m: Mount, evict_first: bool) -> tuple:
        return pread_latency(sr.big, ctx.local_big, offs, evict_first=evict_first, daemon_pid=m.pid,
                             timeout=120 * ctx.timeout_factor)

    try:
        with sr.mount(cache) as m:
            drop_caches()
            w0 = sr.ctx.server.sent_bytes()
            p50, p99 = preads(m, evict_first=False)
            w1 = sr.ctx.server.sent_bytes()
            if w0 is not None and w1 is not None:
                sr.put_extra("server_mib_sent_cold_random", (w1 - w0) / MIB)
            sr.put("rand_cold_p50", p50)
            sr.put("rand_cold_p99", p99)
            # The cold reads' own cost on the wire, apart from the whole-file read below.
            sr.link_checkpoint("random, cold reads")
            if sr.cacheless:
                log(f"  {sr.system} random 4K cold p50/p99 {p50:.0f}/{p99:.0f} µs")
                return
            seq_read_mibs(sr.big, ctx.size, m.pid)  # the file read fully: the daemon's cache is now filled
            p50c, p99c = preads(m, evict_first=True)
            sr.put("rand_cached_p50", p50c)
            sr.put("rand_cached_p99", p99c)
            drop_caches()
            p50d, p99d = preads(m, evict_first=False)
            sr.put_extra("rand_cached_after_drop_caches_p50_us", p50d)
            sr.put_extra("rand_cached_after_drop_caches_p99_us", p99d)
            log(f"  {sr.system} random 4K cold p50/p99 {p50:.0f}/{p99:.0f} µs, cached {p50c:.1f}/{p99c:.1f} µs, "
                f"cached after drop_caches {p50d:.1f}/{p99d:.1f} µs")
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def parallel_phase(sr: SystemRun, n: int, key: str, busy_key: str | None) -> None:
    """n cold readers at once, each on its own 1/n slice of big.bin."""
    cache = sr.fresh_cache()
    try:
        with sr.mount(cache) as m:
            drop_caches()
            j0, t0 = cpu_jiffies(), time.monotonic()
            v, spread = parallel_readers_mibs(sr.big, sr.ctx.size, m.pid, n)
            if busy_key:
                sr.put_extra(busy_key, busy_share(j0, cpu_jiffies(), time.monotonic() - t0))
            sr.put(key, v)
            sr.put_extra(f"spread_{key}", spread)
            log(f"  {sr.system} {n} parallel readers {v:.0f} MiB/s, slowest reader {spread:.2f}× the fastest's time")
    finally:
        shutil.rmtree(cache, ignore_errors=True)


TREE_FIRST = "tree/d07/f0712.txt"
TREE_SIBLING = "tree/d07/f0745.txt"


def timed_head(sr: SystemRun, m: Mount, path: str, n: int) -> float:
    """Seconds of `head -c n path` through the mount; a short or long count is a BenchError."""
    secs, out = timed_shell(f"head -c {n} {shlex.quote(path)} | wc -c", m.pid, timeout=60 * sr.ctx.timeout_factor)
    if out.strip() != str(n):
        raise BenchError(f"head -c {n} of {os.path.relpath(path, sr.ctx.mnt)} gave {out.strip()} bytes")
    return secs


def first_byte_phase(sr: SystemRun) -> None:
    """`head -c 1` of big.bin on a fresh mount: lookup + open + the first read, ms; then of
    TREE_FIRST on another fresh mount, and of TREE_SIBLING (same directory) right after."""
    cache = sr.fresh_cache()
    try:
        with sr.mount(cache) as m:
            drop_caches()
            secs = timed_head(sr, m, sr.big, 1)
            sr.put("first_byte", secs * 1000)
            log(f"  {sr.system} head -c 1 on a fresh mount {secs * 1000:.0f} ms")
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    if sr.cacheless:
        return  # the floor shows one file (no tree)
    # A small file two directories down (one round trip per component, then the GET), then a
    # second file of the same directory (what the first lookup learnt about it should answer).
    cache = sr.fresh_cache()
    try:
        with sr.mount(cache) as m:
            drop_caches()
            for key, rel in (("first_byte_tree", TREE_FIRST), ("first_byte_sibling", TREE_SIBLING)):
                secs = timed_head(sr, m, os.path.join(sr.ctx.mnt, rel), 1)
                sr.put(key, secs * 1000)
                log(f"  {sr.system} head -c 1 of {rel} {secs * 1000:.0f} ms")
    finally:
        shutil.rmtree(cache, ignore_errors=True)


HEAD_BYTES = 100_000


def short_read_phase(sr: SystemRun) -> None:
    """`head -c 100000` of big.bin on a fresh mount: the MiB the server sent for it, counted a
    second after head ended (read-ahead it started has landed by then)."""
    cache = sr.fresh_cache()
    try:
        with sr.mount(cache) as m:
            drop_caches()
            w0 = sr.ctx.server.sent_bytes()
            timed_head(sr, m, sr.big, HEAD_BYTES)
            time.sleep(1)
            w1 = sr.ctx.server.sent_bytes()
            if w0 is None or w1 is None:
                raise BenchError("the server's bytes sent are not readable (/proc/PID/io)")
            sr.put("head_100k", (w1 - w0) / MIB)
            log(f"  {sr.system} head -c {HEAD_BYTES}: the server sent {(w1 - w0) / MIB:.2f} MiB")
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def walk_phase(sr: SystemRun, key: str, cmd: str, check_count: bool) -> None:
    """A metadata walk of the tree (find or ls -lR) on its own fresh mount, seconds."""
    cache = sr.fresh_cache()
    try:
        with sr.mount(cache) as m:
            drop_caches()
            secs, out = timed_shell(cmd, m.pid, timeout=180 * sr.ctx.timeout_factor)
            if check_count and int(out.strip()) != TREE_ENTRIES:
                raise BenchError(f"find listed {out.strip()} entries, want {TREE_ENTRIES}")
            sr.put(key, secs)
            log(f"  {sr.system} {key} {secs:.3f} s")
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def measure_system(ctx: RunContext, system: str, run_i: int, res: dict, extra: dict, errors: list,
                   link=None) -> None:
    """All mount rows for one system, one run. Stores into res[row_key][system] (list per run)."""
    sr = SystemRun(ctx, system, run_i, res, extra, errors, link)
    tree = shlex.quote(os.path.join(ctx.mnt, "tree"))
    sr.step("sequential", lambda: sequential_phase(sr))
    sr.step("random", lambda: random_phase(sr), link_label="random, the whole file read, then cached reads")
    sr.step("parallel readers", lambda: parallel_phase(sr, READERS, "par8", "machine_busy_pct_par8"))
    if link is not None:
        sr.step(f"{LINK_READERS} readers", lambda: parallel_phase(sr, LINK_READERS, "par4", None))
        sr.step("first byte", lambda: first_byte_phase(sr))
    sr.step("short read", lambda: short_read_phase(sr))
    from . import shared_cache  # the shared-cache row (its own module)
    sr.step("second mount", lambda: shared_cache.second_mount_phase(sr))
    if not sr.cacheless:
        sr.step("find", lambda: walk_phase(sr, "find", f"find {tree} | wc -l", True))
        sr.step("ls -lR", lambda: walk_phase(sr, "lsR", f"ls -lR {tree} > /dev/null", False))
