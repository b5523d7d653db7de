"""The --scale setting: walking a bucket of millions of objects (bench/README.md, "--scale").

The bucket is Tests/integration/scale_server.py's synthetic one (ScaleServer serves it from
a child process of its own): D directories × F files (`dNNN/fNNNNN.bin`) plus `wide/` with W
entries. Its floor is `walk()`: the direct listing walk (delimited, sequential, one keep-alive
connection, JSON decoded) — what listing the bucket costs before any filesystem is involved.

Per system and run, each phase gets a fresh mount and a fresh cache dir, then runs **cold**
(right after drop_caches) and **warm** (same mount, at once again); after each pass the
daemon's VmRSS and the server's request counts by kind, at the end of the mount its VmHWM:

    find      find MNT | wc -l              (count checked: objects + directories + 1)
    lsR       ls -lR MNT > /dev/null
    du        du -s MNT
    ls_wide   ls MNT/wide | wc -l          (count checked)
    lsl_wide  ls -l MNT/wide > /dev/null
    stat      os.stat of 10,000 known paths chosen with a fixed seed, one Python process
              (sizes checked against the server's)

plus `find` three times on one mount (drop_caches before each) with VmRSS after each: the
daemon's memory must not grow walk after walk. With --api v0, `storefs-v0` (storefs with
protocol=firebase, the Firebase v0 list API) runs the find phase against walk(api="v0").

With --manifest, `storefs-manifest` (storefs with `manifest=`, docs/manifest.md) runs every
phase too, from a manifest of the whole bucket written here (CSV, in the server's order) and
an index built once into a cache dir kept for all its mounts (`prepare_manifest`: the build
and a second mount reusing it are timed, and the index's size is noted); then, for it and
`storefs`, the time to the first byte of a file on a fresh mount after drop_caches.
"""

from __future__ import annotations

import os
import random
import re
import shlex
import shutil
import subprocess
import time
from dataclasses import dataclass

from .data import SEED
from .host import (BenchError, MountError, busy_share, cpu_jiffies, drop_caches, log, proc_hwm_mib,
                   proc_rss_mib)
from .readers import stat_loop, timed_shell
from .systems import Mount, RunContext

SCALE_SYSTEMS = ["storefs", "rclone"]
V0_SYSTEM = "storefs-v0"
MANIFEST_SYSTEM = "storefs-manifest"
MANIFEST_BUILD_TIMEOUT_S = 3600
STAT_PATHS = 10_000
STAT_SEED = SEED + 500          # the same paths in every run and for every system
FIND_REPEATS = 3
PHASE_TIMEOUT_S = 3600          # rclone's ls -lR of a million objects takes minutes
FILES_PER_DIR = 10_000
WIDE_MAX = 100_000
FIND_TARGET = 1.5               # find ≤ 1.5 × walk (the targets)
LSR_TARGET = 2.5                # ls -lR ≤ 2.5 × walk
RSS_TARGET_MIB = 256            # daemon VmRSS after find and after ls -lR
NAMES_PER_LIST_TARGET = 900     # "about one list request per 1,000 names" (a full page is 1,000)
RSS_GROWTH_SLACK = (1.10, 8.0)  # repeated finds: RSS may grow 10% + 8 MiB, not more


# --------------------------------------------------------------------------- the bucket's shape
@dataclass
class Shape:
    """The synthetic bucket: dirs × files objects plus wide/ with `wide` entries."""

    objects: int   # what --objects asked for (the dirs × files part)
    dirs: int
    files: int
    wide: int

    @property
    def label(self) -> str:
        wide = f" + wide/ {self.wide:,}" if self.wide else ""
        return f"{self.dirs:,} dirs × {self.files:,} files{wide}"


def shape_for(text: str) -> Shape:
    """--objects 1M → 100 × 10,000 + wide/ 100,000; 10M → 1,000 × 10,000 + wide/ 100,000;
    100k → 10 × 10,000 + wide/ 10,000 (wide/ is a tenth of the objects, at most 100,000)."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kKmM]?)\s*", text)
    if not m:
        raise ValueError(f"--objects {text!r}: want a count like 100k, 1M or 10M")
    n = int(float(m.group(1)) * {"": 1, "k": 1000, "m": 1_000_000}[m.group(2).lower()])
    if n < 10:
        raise ValueError("--objects: at least 10")
    files = min(FILES_PER_DIR, n)
    return Shape(objects=n, dirs=max(1, n // files), files=files, wide=min(n // 10, WIDE_MAX))


# --------------------------------------------------------------------------- phases
@dataclass
class Phase:
    """One --scale phase: its key in the results, its label, and which walk is its floor."""

    key: str
    label: str
    walk: str   # which walk is its floor: "full" (the whole bucket) or "wide" (wide/ alone)


PHASES = [
    Phase("find", "find MNT | wc -l", "full"),
    Phase("lsR", "ls -lR MNT > /dev/null", "full"),
    Phase("du", "du -s MNT", "full"),
    Phase("ls_wide", "ls MNT/wide | wc -l", "wide"),
    Phase("lsl_wide", "ls -l MNT/wide > /dev/null", "wide"),
    Phase("stat", f"stat {STAT_PATHS:,} random paths", "full"),
]
V0_PHASES = [PHASES[0]]


def directories_and_sample(server, n: int, seed: int) -> tuple:
    """(number of directories, n known object names chosen with a fixed seed in random
    order), from the server's own list of names: what find must see and what stat asks for."""
    total = server.count()
    picks = set(random.Random(seed).sample(range(total), min(n, total)))
    dirs, chosen = set(), []
    for i, name in enumerate(server.names()):
        d = name.rpartition("/")[0]
        while d and d not in dirs:
            dirs.add(d)
            d = d.rpartition("/")[0]
        if i in picks:
            chosen.append(name)
    random.Random(seed + 1).shuffle(chosen)
    return len(dirs), chosen


class ScaleBench:
    """One --scale run's state: the server, the expectations, and every value by run."""

    def __init__(self, ctx: RunContext, server, shape: Shape, systems: list, api: str):
        self.ctx, self.server, self.shape, self.api = ctx, server, shape, api
        self.systems = systems
        self.res: dict = {}        # "phase:cold|warm" -> system -> [seconds per run]
        self.rss: dict = {}        # "phase:cold|warm" -> system -> [VmRSS MiB per run]
        self.rss_max: dict = {}    # phase -> system -> [max(VmRSS cold, warm) per run]
        self.hwm: dict = {}        # phase -> system -> [VmHWM MiB at the end of its mount]
        self.peak: dict = {}       # system -> {run: highest VmHWM over that run's mounts}
        self.requests: dict = {}   # "phase:cold|warm" -> system -> [Counter dict per run]
        self.busy: dict = {}       # "phase:cold|warm" -> system -> [% of all CPUs per run]
        self.repeat_rss: dict = {}  # system -> [[RSS after find 1..3] per run]
        self.walks: dict = {}      # "full" | "wide" | "v0" -> [walk() dict per run]
        self.manifest: dict = {}   # --manifest: what prepare_manifest and first_bytes measured
        self.manifest_cache = ""   # storefs-manifest's cache dir, kept across its mounts (its index)
        self.errors: list = []
        t0 = time.monotonic()
        self.count = server.count()
        self.dir_count, names = directories_and_sample(server, STAT_PATHS, STAT_SEED)
        self.stat_paths = [os.path.join(ctx.mnt, n) for n in names]
        self.stat_sizes = [server.size_of(n) for n in names]
        self.find_entries = self.count + self.dir_count + 1
        log(f"expected: {self.count:,} objects in {self.dir_count:,} directories; {len(names):,} stat paths "
            f"(seed {STAT_SEED}); {time.monotonic() - t0:.1f} s")

    # ----------------------------------------------------------------- recording
    def put(self, table: dict, key: str, system: str, value) -> None:
        table.setdefault(key, {}).setdefault(system, []).append(value)

    def fail(self, run_i: int, system: str, what: str, exc: Exception) -> None:
        msg = f"run {run_i + 1} {system} {what}: {exc}"
        log("ERROR " + msg)
        self.errors.append(msg)
        if isinstance(exc, MountError):
            self.ctx.dead[system] = str(exc)

    # ----------------------------------------------------------------- the floor
    def measure_walks(self, walk) -> None:
        """The direct listing walks, each checked against the server's own count."""
        ep, bucket = self.server.endpoint, self.server.bucket
        todo = [("full", "", "gcs", self.count)]
        if self.shape.wide:
            todo.append(("wide", "wide/", "gcs", self.shape.wide))
        if self.api == "v0":
            todo.append(("v0", "", "v0", self.count))
        for key, prefix, api, want in todo:
            w = walk(ep, bucket, prefix=prefix, delimited=True, api=api)
            if w["objects"] != want:
                msg = f"LOUD ERROR: walk({prefix!r}, api={api}) saw {w['objects']:,} objects, the server has {want:,}"
                log(msg)
                self.errors.append(msg)
            self.walks.setdefault(key, []).append(w)
            log(f"  walk {key}: {w['objects']:,} objects, {w['prefixes']:,} prefixes, {w['pages']:,} pages, "
                f"{w['seconds']:.2f} s")

    # ----------------------------------------------------------------- one phase's command
    def run_phase(self, key: str, m: Mount) -> float:
        """Seconds for one pass of phase `key` on mount m; a wrong count is an error, not a number."""
        mnt = shlex.quote(self.ctx.mnt)
        wide = shlex.quote(os.path.join(self.ctx.mnt, "wide"))
        if key == "find":
            secs, out = timed_shell(f"find {mnt} | wc -l", m.pid, PHASE_TIMEOUT_S)
            if int(out) != self.find_entries:
                raise BenchError(f"LOUD ERROR: find saw {int(out):,} entries, want {self.find_entries:,} "
                                 f"({self.count:,} objects + {self.dir_count:,} directories + 1)")
            return secs
        if key == "lsR":
            return timed_shell(f"ls -lR {mnt} > /dev/null", m.pid, PHASE_TIMEOUT_S)[0]
        if key == "du":
            secs, out = timed_shell(f"du -s {mnt}", m.pid, PHASE_TIMEOUT_S)
            if not out.split() or int(out.split()[0]) <= 0:
                raise BenchError(f"du -s printed {out.strip()!r}")
            return secs
        if key == "ls_wide":
            secs, out = timed_shell(f"ls {wide} | wc -l", m.pid, PHASE_TIMEOUT_S)
            if int(out) != self.shape.wide:
                raise BenchError(f"LOUD ERROR: ls wide/ listed {int(out):,} names, want {self.shape.wide:,}")
            return secs
        if key == "lsl_wide":
            return timed_shell(f"ls -l {wide} > /dev/null", m.pid, PHASE_TIMEOUT_S)[0]
        if key == "stat":
            got = stat_loop(self.stat_paths, m.pid, PHASE_TIMEOUT_S)
            bad = sum(1 for a, b in zip(got["sizes"], self.stat_sizes) if a != b)
            if bad:
                raise BenchError(f"{bad} of {len(self.stat_paths)} stats gave the wrong size")
            return got["seconds"]
        raise BenchError(f"unknown phase {key}")

    # ----------------------------------------------------------------- --manifest
    def prepare_manifest(self) -> None:
        """Writes the bucket's manifest, mounts storefs-manifest to build its index (timed,
        with the index's size), once more to time a mount that reuses it, and measures the
        first byte of a file on a fresh mount of each storefs system."""
        path = os.path.join(self.ctx.workdir, "manifest.csv")
        t0 = time.monotonic()
        with open(path, "w") as f:
            f.write("name,size,generation,updated,crc32c\n")
            s = self.server
            for n in s.names():
                f.write(f"{n},{s.size_of(n)},{s.generation_of(n)},2024-05-06T07:08:09.123Z,{s.crc32c_of(n)}\n")
        self.ctx.manifest_path = path
        self.manifest_cache = self.ctx.new_cache_dir(MANIFEST_SYSTEM)
        at_written = time.monotonic()
        log(f"manifest: {self.count:,} rows, {os.path.getsize(path) / 1e6:,.0f} MB written in {at_written - t0:.1f} s")
        for key, wait in (("build_s", MANIFEST_BUILD_TIMEOUT_S), ("remount_s", 60)):
            drop_caches()
            m = Mount(MANIFEST_SYSTEM, self.ctx, self.ctx.mnt, self.manifest_cache)
            t0 = time.monotonic()
            m.start(wait=wait)
            self.manifest[key] = time.monotonic() - t0
            self.manifest[key.replace("_s", "_rss")] = proc_rss_mib(m.pid)
            m.stop()
        index_dir = os.path.join(self.manifest_cache, "mf-v1")
        self.manifest["index_bytes"] = sum(os.path.getsize(os.path.join(index_dir, f))
                                           for f in os.listdir(index_dir) if f.endswith(".idx"))
        self.manifest["objects"] = self.count
        log(f"manifest: index of {self.manifest['index_bytes'] / 1e6:,.0f} MB built by the first mount in "
            f"{self.manifest['build_s']:.1f} s; a mount reusing it {self.manifest['remount_s']:.2f} s")
        sample = self.stat_paths[0]
        for system in [s for s in ("storefs", MANIFEST_SYSTEM) if s in self.systems]:
            m, cache = self.mount(system)
            try:
                drop_caches()
                t0 = time.monotonic()
                with m:
                    mounted = time.monotonic() - t0
                    secs, _ = timed_shell(f"head -c 1 {shlex.quote(sample)} > /dev/null", m.pid, 120)
                self.manifest.setdefault("first_byte", {})[system] = {"mount_s": mounted, "first_byte_s": secs}
                log(f"  {system}: mounted in {mounted:.2f} s, first byte of {os.path.relpath(sample, self.ctx.mnt)} "
                    f"{secs * 1000:.0f} ms later")
            except (BenchError, subprocess.TimeoutExpired, OSError) as exc:
                self.fail(0, system, "first byte", exc)
            finally:
                if cache:
                    shutil.rmtree(cache, ignore_errors=True)

    # ----------------------------------------------------------------- per system
    def mount(self, system: str) -> tuple:
        """A mount of `system` and its cache dir to remove afterwards (None: keep it)."""
        if system == MANIFEST_SYSTEM:
            return Mount(system, self.ctx, self.ctx.mnt, self.manifest_cache), None
        cache = self.ctx.new_cache_dir(system)
        return Mount(system, self.ctx, self.ctx.mnt, cache), cache

    def cold_and_warm(self, system: str, phase: Phase, run_i: int) -> None:
        """Fresh mount: the phase after drop_caches (cold), then at once again (warm)."""
        m, cache = self.mount(system)
        try:
            with m:
                for temp in ("cold", "warm"):
                    if temp == "cold":
                        drop_caches()
                    self.server.reset_counts()
                    j0, t0 = cpu_jiffies(), time.monotonic()
                    secs = self.run_phase(phase.key, m)
                    k = f"{phase.key}:{temp}"
                    self.put(self.busy, k, system, busy_share(j0, cpu_jiffies(), time.monotonic() - t0))
                    self.put(self.requests, k, system, dict(self.server.counts))
                    self.put(self.res, k, system, secs)
                    self.put(self.rss, k, system, proc_rss_mib(m.pid))
                    log(f"  {system} {phase.key} {temp} {secs:.2f} s, VmRSS {_mib(self.rss[k][system][-1])}, "
                        f"requests {self.requests[k][system][-1]}")
                self.put(self.rss_max, phase.key, system,
                         max(self.rss[f"{phase.key}:{t}"][system][-1] or 0.0 for t in ("cold", "warm")))
                hwm = proc_hwm_mib(m.pid)
                self.put(self.hwm, phase.key, system, hwm)
                runs = self.peak.setdefault(system, {})
                runs[run_i] = max(runs.get(run_i, 0.0), hwm or 0.0)
        finally:
            if cache:
                shutil.rmtree(cache, ignore_errors=True)

    def repeated_finds(self, system: str) -> None:
        """find FIND_REPEATS times on one mount, drop_caches before each: VmRSS after each."""
        m, cache = self.mount(system)
        rss = []
        try:
            with m:
                for _ in range(FIND_REPEATS):
                    drop_caches()
                    self.run_phase("find", m)
                    rss.append(proc_rss_mib(m.pid))
            self.repeat_rss.setdefault(system, []).append(rss)
            log(f"  {system} VmRSS after {FIND_REPEATS} finds on one mount: " + ", ".join(_mib(x) for x in rss))
        finally:
            if cache:
                shutil.rmtree(cache, ignore_errors=True)

    def measure_system(self, system: str, run_i: int) -> None:
        """Every phase of one system in one run (storefs-v0: find only), then the repeated
        finds; a failed phase is listed under the table and the next one runs."""
        phases = V0_PHASES if system == V0_SYSTEM else [p for p in PHASES if self.shape.wide or p.walk != "wide"]
        for phase in phases:
            if system in self.ctx.dead:
                return
            try:
                self.cold_and_warm(system, phase, run_i)
            except (BenchError, subprocess.TimeoutExpired, OSError, ValueError) as exc:
                self.fail(run_i, system, phase.key, exc)
        if system != V0_SYSTEM and system not in self.ctx.dead:
            try:
                self.repeated_finds(system)
            except (BenchError, subprocess.TimeoutExpired, OSError, ValueError) as exc:
                self.fail(run_i, system, "repeated finds", exc)


def _mib(value) -> str:
    """A VmRSS for the log; None when the daemon is gone (which the phase then reports)."""
    return "-" if value is None else f"{value:.1f} MiB"
