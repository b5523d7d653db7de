"""The workloads users run (issue 48; bench/README.md "Workloads"), measured on every mount
beside the read rows of phases.py, and the baselines each is judged against:

- `files`: a directory of 1,000 image-sized files (32–256 KiB, ~140 MiB), listed, then read
  whole by 16 threads, on a fresh mount with an empty cache. Files/s, wall time, the media
  requests they cost and the new connections. Ceiling: 16 keep-alive connections doing one
  listing request, then one GET per file, through the same link (http.client threads).
- `mmap`: one object (512 MiB; 128 with --quick) read through a shared read-only mapping:
  every page in order by one thread, then (on another fresh mount) by 4 threads each touching
  its quarter at once. MiB/s and the daemon's peak RSS. Ceiling: curl-N of the same object.
- `cached`: a 256 MiB object read once whole (its blocks now in the mount's cache), then 500
  random 4 KiB preads after POSIX_FADV_DONTNEED on the mounted file with the cache files'
  pages dropped too (what memory pressure does: every read is a block-cache hit from the
  disk), then 500 more with the cache files' pages in memory. Baseline: one 16 KiB O_DIRECT
  read of a file on the cache dir's filesystem (the disk itself), p50, timed before each of
  the 500 "pages dropped" reads on the same mount (the row's target is judged against that:
  this host's virtual disk swings from ~45 to ~115 µs between minutes), and once per run
  among the baselines.

Requests are counted by the link proxy with --link (it sees each request's range, so the
one-byte GETs that open connections ahead of need are told apart) and by fake-gcs-server's
own request log on loopback, where nothing else sees them; connections only by the link proxy.

Every byte read is checked (crc32 against the local copy): a wrong byte is an error, not a
number. Objects live in the loopback bucket (data.py's BUCKET) beside big.bin and tree/,
generated once per data dir (WORKLOADS.json is their marker).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
import urllib.parse
import zlib
from dataclasses import dataclass, field

from . import MIB
from .baselines import curl_parallel
from .data import BUCKET, SEED
from .host import BenchError, at_cleanup, dir_size_mib, drop_caches, log
from .phases import RAND_READS, SystemRun, random_offsets
from .readers import run_worker, pread_latency, seq_read_mibs
from .stats import percentile
from .tls import curl_tls_args

KIB = 1 << 10
FILES_DIR = "files1k"
FILES_N = 1000
FILES_MIN, FILES_MAX = 32 * KIB, 256 * KIB
FILES_THREADS = 16
MMAP_NAME = "mmap.bin"
MMAP_MIB, MMAP_QUICK_MIB = 512, 128
MMAP_THREADS = 4
# A pass that has not touched every page by then stops, and its MiB/s is over what it read
# (rclone-off with 4 threads reads ~2 MiB/s through `wan`: 512 MiB would take minutes).
MMAP_BUDGET_S = 60.0
CACHED_NAME = "cached.bin"
CACHED_MIB = 256
DISK_BLOCK = 16 * KIB
DISK_READS = 500
DISK_WARMUP = 20
# After a workload's last read, before its requests are counted: a request is logged when its
# answer ends, and read-ahead the reads started lands meanwhile.
SETTLE_S = 1.0
WL_SEED = SEED + 48
WORKERS_PY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workload_workers.py")

# Which mounts each workload runs on: the floor has no cache, rclone-off neither.
NO_CACHE = ("floor", "rclone-off")


# --------------------------------------------------------------------------- data
@dataclass
class Plan:
    """The workloads' objects in the data dir and what reading them must give."""
    root: str
    mmap_mib: int
    files: dict = field(default_factory=dict)      # name in FILES_DIR -> [size, crc32]
    mmap_quarter_crcs: list = field(default_factory=list)
    mmap_crc: int = 0

    def local(self, name: str) -> str:
        return os.path.join(self.root, BUCKET, name)

    @property
    def mmap_size(self) -> int:
        return self.mmap_mib * MIB

    @property
    def cached_size(self) -> int:
        return CACHED_MIB * MIB

    @property
    def files_mib(self) -> float:
        return sum(s for s, _ in self.files.values()) / MIB


def file_sizes() -> list:
    """FILES_N sizes spread evenly over [FILES_MIN, FILES_MAX], seeded (~140 MiB in all)."""
    rng = random.Random(WL_SEED)
    return [rng.randint(FILES_MIN, FILES_MAX) for _ in range(FILES_N)]


def prepare_workload_data(root: str, mmap_mib: int, fresh: bool) -> Plan:
    """BUCKET/files1k/fNNNN.jpg, BUCKET/mmap.bin and BUCKET/cached.bin in the data dir
    (generated once, seeded), and what each must read as."""
    marker = os.path.join(root, "WORKLOADS.json")
    want = {"seed": WL_SEED, "files": FILES_N, "min": FILES_MIN, "max": FILES_MAX, "mmap_mib": mmap_mib,
            "cached_mib": CACHED_MIB}
    plan = Plan(root, mmap_mib)
    have = None
    if not fresh and os.path.exists(marker):
        try:
            with open(marker) as f:
                have = json.load(f)
        except (OSError, ValueError):
            pass
    if have != want:
        t0 = time.monotonic()
        bdir = os.path.join(root, BUCKET)
        shutil.rmtree(os.path.join(bdir, FILES_DIR), ignore_errors=True)
        os.makedirs(os.path.join(bdir, FILES_DIR))
        rng = random.Random(WL_SEED + 1)
        for i, size in enumerate(file_sizes()):
            with open(os.path.join(bdir, FILES_DIR, f"f{i:04d}.jpg"), "wb") as f:
                f.write(rng.randbytes(size))
        for name, mib, seed in ((MMAP_NAME, mmap_mib, WL_SEED + 2), (CACHED_NAME, CACHED_MIB, WL_SEED + 3)):
            r = random.Random(seed)
            with open(os.path.join(bdir, name), "wb") as f:
                for _ in range(mib // 16):
                    f.write(r.randbytes(16 * MIB))
        with open(marker, "w") as f:
            json.dump(want, f)
        log(f"generated the workloads' data ({FILES_N} files, {MMAP_NAME} {mmap_mib} MiB, {CACHED_NAME} "
            f"{CACHED_MIB} MiB) in {root} ({time.monotonic() - t0:.1f} s)")
    fdir = plan.local(FILES_DIR)
    for name in sorted(os.listdir(fdir)):
        with open(os.path.join(fdir, name), "rb") as f:
            data = f.read()
        plan.files[name] = [len(data), zlib.crc32(data)]
    q = plan.mmap_size // MMAP_THREADS
    with open(plan.local(MMAP_NAME), "rb") as f:
        for _ in range(MMAP_THREADS):
            crc, left = 0, q
            while left:
                b = f.read(min(left, 16 * MIB))
                crc, left = zlib.crc32(b, crc), left - len(b)
                plan.mmap_crc = zlib.crc32(b, plan.mmap_crc)
            plan.mmap_quarter_crcs.append(crc)
    return plan


def media_path(name: str) -> str:
    return f"/download/storage/v1/b/{BUCKET}/o/{urllib.parse.quote(name, safe='')}?alt=media"


def write_floor_manifest(plan: Plan, endpoint: str, path: str) -> str:
    """floorfs's MANIFEST (bench/floor/floorfs.c): the files and the mmap object, each with the
    URL its reads GET."""
    with open(path, "w") as f:
        for name, (size, _crc) in sorted(plan.files.items()):
            f.write(f"{size} {endpoint}{media_path(f'{FILES_DIR}/{name}')} {FILES_DIR}/{name}\n")
        f.write(f"{plan.mmap_size} {endpoint}{media_path(MMAP_NAME)} {MMAP_NAME}\n")
    return path


# --------------------------------------------------------------------------- requests
def classify(path: str) -> tuple:
    """(kind, object name or list prefix) of a request path: media, metadata, list, other."""
    base, _, query = path.partition("?")
    p = urllib.parse.unquote(base)
    q = urllib.parse.parse_qs(query, keep_blank_values=True)
    if "/o/" in p:
        return ("media" if q.get("alt") == ["media"] else "metadata"), p.split("/o/", 1)[1]
    if p.endswith("/o") or p.endswith("/o/"):
        return "list", (q.get("prefix") or [""])[0]
    return "other", ""


class RequestCount:
    """What one workload cost on the wire: requests by kind, the one-byte connection openers
    (link only), new connections (link only), MiB the server sent. Started where the workload
    starts; `finish` reads the link proxy's log, or the server's request log on loopback."""

    def __init__(self, server, link):
        self.server, self.link = server, link
        if link is not None:
            link.reset_stats()
        self.mark = server.log_mark() if server.log_requests and link is None else None
        self.sent0 = server.sent_bytes()

    def finish(self, names: tuple) -> dict:
        """Counts of the requests for objects (or listings of prefixes) starting with any of
        `names`; the rest are `other`."""
        time.sleep(SETTLE_S)
        out = {"media": 0, "openers": 0, "list": 0, "metadata": 0, "other": 0, "connections": None}
        if self.link is not None:
            stats = self.link.stats()
            reqs = [(r["path"], r.get("range")) for r in stats["per_request"]]
            out["connections"] = stats["connections"]
        elif self.mark is not None:
            reqs = [(path, None) for _m, path, _s in self.server.request_paths(self.mark)]
        else:
            reqs = None
        if reqs is None:
            for k in ("media", "openers", "list", "metadata", "other"):
                out[k] = None
        else:
            for path, rng in reqs:
                kind, name = classify(path)
                if kind == "other" or not name.startswith(names):
                    out["other"] += 1
                elif kind == "media" and rng == "bytes=0-0":
                    out["openers"] += 1
                else:
                    out[kind] += 1
        sent1 = self.server.sent_bytes()
        out["mib"] = None if self.sent0 is None or sent1 is None else (sent1 - self.sent0) / MIB
        return out


# --------------------------------------------------------------------------- the runs
def files_spec(plan: Plan, directory: str) -> dict:
    return {"dir": directory, "threads": FILES_THREADS, "expect": plan.files}


def check_files_result(r: dict, what: str) -> None:
    if "error" in r:
        raise BenchError(f"{what}: {r['error']}")
    if r["bad"]:
        raise BenchError(f"{what}: {r['bad']} of {r['files']} files read wrong bytes, e.g. {'; '.join(r['first_bad'])}")


class Workloads:
    """The workload rows of one bench run: its plan, the baselines per run, the rows per mount."""

    def __init__(self, ctx, plan: Plan, streams: int):
        self.ctx, self.plan, self.streams = ctx, plan, streams
        self.probe = os.path.join(ctx.workdir, "disk-probe.bin")

    def url(self, name: str) -> str:
        return self.ctx.endpoint + media_path(name)

    def description(self) -> dict:
        p = self.plan
        return {"files": FILES_N, "files_dir": FILES_DIR, "files_mib": round(p.files_mib, 1),
                "file_sizes": f"{FILES_MIN // KIB}-{FILES_MAX // KIB} KiB", "files_threads": FILES_THREADS,
                "mmap_object_mib": p.mmap_mib, "mmap_threads": MMAP_THREADS, "mmap_budget_s": MMAP_BUDGET_S,
                "cached_object_mib": CACHED_MIB, "cached_reads": RAND_READS,
                "disk_read": f"{DISK_BLOCK // KIB} KiB O_DIRECT, p50 of {DISK_READS}",
                "requests_counted_by": "the link proxy" if self.ctx.args.link else "fake-gcs-server's request log"}

    # ------------------------------------------------------------------ baselines
    def measure_baselines(self, base: dict, extra: dict, run_i: int, link, errors: list) -> None:
        """The ceilings of one run: the files over 16 keep-alive connections, curl-N of the mmap
        object, the disk's O_DIRECT 16 KiB read, and what writing the files into a file each
        costs on the cache dirs' filesystem."""
        for name, fn in (("files ceiling", lambda: self._files_ceiling(base, extra, link)),
                         ("mmap curl", lambda: self._mmap_curl(base)),
                         ("disk O_DIRECT read", lambda: self._disk(base, run_i)),
                         ("cache files written", lambda: self._cache_files(base))):
            try:
                fn()
            except (BenchError, OSError, ValueError) as exc:
                log(f"ERROR run {run_i + 1} workload baseline {name}: {exc}")
                errors.append(f"run {run_i + 1} workload baseline {name}: {exc}")

    def _files_ceiling(self, base: dict, extra: dict, link) -> None:
        ctx = self.ctx
        origin = urllib.parse.urlsplit(ctx.endpoint)
        spec = {"host": origin.hostname, "port": origin.port, "ca": ctx.pki.ca if ctx.pki else None,
                "bucket": BUCKET, "prefix": FILES_DIR + "/", "threads": FILES_THREADS, "expect": self.plan.files}
        count = RequestCount(ctx.server, link)
        r = run_worker("http", spec, 120 * ctx.timeout_factor, f"{FILES_N} GETs", None, script=WORKERS_PY)
        check_files_result(r, "the files' ceiling")
        c = count.finish((FILES_DIR + "/",))
        c.update(wall=r["seconds"], list_s=r["list_seconds"])
        _put(base, "wl_files_rate", r["files"] / r["seconds"])
        _put(base, "wl_files_wall", r["seconds"])
        _put(base, "wl_files_media", c["media"])
        _put(base, "wl_files_conns", c["connections"])
        extra.setdefault("wl_files_detail", {}).setdefault("ceiling", []).append(c)
        log(f"  ceiling: {FILES_N} files over {FILES_THREADS} keep-alive connections in {r['seconds']:.2f} s "
            f"({r['files'] / r['seconds']:.0f} files/s), {_count_text(c)}")

    def _mmap_curl(self, base: dict) -> None:
        ctx = self.ctx
        extra = curl_tls_args(ctx.pki, "1.1") if ctx.pki else []
        v = curl_parallel(self.url(MMAP_NAME), self.plan.mmap_size, self.streams, extra)
        _put(base, "wl_mmap_curl", v)
        log(f"  curl-{self.streams} of {MMAP_NAME} ({self.plan.mmap_mib} MiB): {v:.0f} MiB/s")

    def _disk(self, base: dict, run_i: int) -> None:
        if not os.path.exists(self.probe):
            make_probe(self.probe, self.plan.cached_size)
        spec = {"path": self.probe, "size": self.plan.cached_size, "block": DISK_BLOCK, "count": DISK_READS,
                "warmup": DISK_WARMUP, "seed": WL_SEED + 10 + run_i}
        r = run_worker("odirect", spec, 120, f"{DISK_READS} O_DIRECT reads", None, script=WORKERS_PY)
        if "error" in r:
            raise BenchError(r["error"])
        lat = [ns / 1000.0 for ns in r["lat_ns"]]
        _put(base, "wl_disk_p50", percentile(lat, 50))
        _put(base, "wl_disk_p99", percentile(lat, 99))
        log(f"  disk: {DISK_BLOCK // KIB} KiB O_DIRECT read p50/p99 {percentile(lat, 50):.0f}/{percentile(lat, 99):.0f} µs")

    def _cache_files(self, base: dict) -> None:
        """The files row's objects written into a file each on the cache dirs' filesystem, the
        cheapest way (`cachefiles_worker`): what a cache that keeps each object in a file of its
        own adds to the files row at the least, beside the floor that keeps none."""
        d = self.ctx.new_cache_dir("cachefiles")
        try:
            spec = {"dir": d, "sizes": [size for size, _crc in self.plan.files.values()]}
            r = run_worker("cachefiles", spec, 120 * self.ctx.timeout_factor, f"{FILES_N} cache files written", None,
                           script=WORKERS_PY)
        finally:
            leave_until_exit(d)
        if "error" in r:
            raise BenchError(r["error"])
        _put(base, "wl_cachefiles_s", r["seconds"])
        _put(base, "wl_cachefiles_cpu_s", r["cpu_s"])
        _put(base, "wl_cachefiles_host_cpu_s", r["host_cpu_s"])
        log(f"  disk: {r['files']} files written into a file each in {r['seconds']:.2f} s, "
            f"{r['cpu_s']:.2f} CPU-s in the writer, {r['host_cpu_s']:.2f} CPU-s on the host up to a sync")

    # ------------------------------------------------------------------ per mount
    def measure_system(self, ctx, system: str, run_i: int, res: dict, extra: dict, errors: list,
                       link=None) -> None:
        """The workload rows on one system, one run; each on a fresh mount with an empty cache."""
        sr = SystemRun(ctx, system, run_i, res, extra, errors, link)
        sr.step("1,000 files", lambda: self.files_phase(sr), link_label="workload: 1,000 files")
        sr.step("mmap, 1 thread", lambda: self.mmap_phase(sr, 1), link_label="workload: mmap, 1 thread")
        sr.step(f"mmap, {MMAP_THREADS} threads", lambda: self.mmap_phase(sr, MMAP_THREADS),
                link_label=f"workload: mmap, {MMAP_THREADS} threads")
        if system not in NO_CACHE:
            sr.step("cached random 4K", lambda: self.cached_phase(sr),
                    link_label="workload: cached random (the whole object read once)")

    def files_phase(self, sr: SystemRun) -> None:
        self._files_pass(sr)
        if sr.system == "floor" and sr.link is None:
            sr.step("1,000 files with cache writes", lambda: self._files_pass(sr, cache_writes=True))

    def _files_pass(self, sr: SystemRun, cache_writes: bool = False) -> None:
        """One pass of the files row. `cache_writes` (the floor, on loopback): the floor writes
        what it reads the way the least cache of a file per object would (floorfs's
        FLOORFS_CACHE_DIR: a file made at open, each read's bytes written into it after the
        reply, renamed at release; no header, index or checksum), on its own FUSE threads: what
        such a cache costs the floor, measured on the same cores as the reads."""
        ctx = sr.ctx
        cache = sr.fresh_cache()
        try:
            m = sr.mount(cache)
            m.floor_cache_writes = cache_writes
            with m:
                drop_caches()
                count = None if cache_writes else RequestCount(ctx.server, sr.link)
                r = run_worker("files", files_spec(self.plan, os.path.join(ctx.mnt, FILES_DIR)),
                               120 * ctx.timeout_factor, f"{FILES_N} files read", m.pid, script=WORKERS_PY)
                if not cache_writes:
                    self._files_counted(sr, r, count)
            if cache_writes:
                # Counted once unmounted: the kernel sends a release after its close returns.
                check_files_result(r, f"{sr.system} files writing a file per file")
                made = sum(1 for n in os.listdir(cache) if not n.endswith(".tmp"))
                if made != FILES_N:
                    raise BenchError(f"the floor writing a file per file made {made} files, not {FILES_N}")
                sr.put("files_rate_cache_writes", r["files"] / r["seconds"])
                log(f"  {sr.system} {FILES_N} files by {FILES_THREADS} threads, writing a file per file: "
                    f"{r['seconds']:.2f} s ({r['files'] / r['seconds']:.0f} files/s)")
        finally:
            leave_until_exit(cache)

    def _files_counted(self, sr: SystemRun, r: dict, count) -> None:
        """The files row's numbers of one pass, with what it cost on the wire."""
        check_files_result(r, f"{sr.system} files")
        c = count.finish((FILES_DIR + "/",))
        c.update(wall=r["seconds"], list_s=r["list_seconds"])
        sr.put("files_rate", r["files"] / r["seconds"])
        sr.put("files_wall", r["seconds"])
        sr.put("files_media", c["media"])
        sr.put("files_conns", c["connections"])
        sr.put_extra("wl_files_detail", c)
        log(f"  {sr.system} {FILES_N} files by {FILES_THREADS} threads in {r['seconds']:.2f} s "
            f"({r['files'] / r['seconds']:.0f} files/s), {_count_text(c)}")

    def mmap_phase(self, sr: SystemRun, threads: int) -> None:
        ctx, plan = sr.ctx, self.plan
        if threads not in (1, MMAP_THREADS):
            raise ValueError(f"mmap with {threads} threads: the expected bytes are known for 1 and {MMAP_THREADS}")
        q = plan.mmap_size // threads
        ranges = [[i * q, (i + 1) * q] for i in range(threads)]
        expect = plan.mmap_quarter_crcs if threads == MMAP_THREADS else [plan.mmap_crc]
        key = f"mmap_{threads}"
        cache = sr.fresh_cache()
        try:
            with sr.mount(cache) as m:
                drop_caches()
                count = RequestCount(ctx.server, sr.link)
                spec = {"path": os.path.join(ctx.mnt, MMAP_NAME), "ranges": ranges, "expect": expect,
                        "budget_s": MMAP_BUDGET_S}
                r = run_worker("mmap", spec, MMAP_BUDGET_S + 120, f"mmap of {MMAP_NAME}", m.pid, script=WORKERS_PY)
                if "error" in r:
                    raise BenchError(r["error"])
                if r["bad_ranges"]:
                    raise BenchError(f"mmap of {MMAP_NAME}: wrong bytes in range(s) {r['bad_ranges']} of {ranges}")
                v = r["bytes"] / MIB / r["seconds"]
                sr.put(key, v)
                sr.put(f"mmap_rss_{threads}", m.hwm_mib())
                c = count.finish((MMAP_NAME,))
                c.update(partial=r["partial"], mib_touched=r["bytes"] / MIB, seconds=r["seconds"])
                sr.put_extra(f"wl_{key}_detail", c)
                log(f"  {sr.system} mmap of {MMAP_NAME}, {threads} thread(s): {v:.0f} MiB/s"
                    + (f" (stopped at the {MMAP_BUDGET_S:.0f} s budget after {r['bytes'] / MIB:.0f} MiB)"
                       if r["partial"] else "")
                    + f", VmHWM {sr.last(f'mmap_rss_{threads}'):.0f} MiB, {_count_text(c)}")
        finally:
            shutil.rmtree(cache, ignore_errors=True)

    def cached_phase(self, sr: SystemRun) -> None:
        ctx, plan = sr.ctx, self.plan
        path, local, size = os.path.join(ctx.mnt, CACHED_NAME), plan.local(CACHED_NAME), plan.cached_size
        cache = sr.fresh_cache()
        offs_dropped = random_offsets(size, WL_SEED + 200 + sr.run_i)
        offs_memory = random_offsets(size, WL_SEED + 300 + sr.run_i)

        def preads(offs, disk=None):
            return pread_latency(path, local, offs, evict_first=True, daemon_pid=m.pid,
                                 timeout=120 * ctx.timeout_factor, disk=disk)

        if not os.path.exists(self.probe):
            make_probe(self.probe, plan.cached_size)
        disk = {"path": self.probe, "size": plan.cached_size, "block": DISK_BLOCK, "seed": WL_SEED + 400 + sr.run_i}

        try:
            with sr.mount(cache) as m:
                drop_caches()
                seq_read_mibs(path, size, m.pid)  # read once whole: every block is in the cache now
                settle_dir(cache)
                drop_dir_pages(cache)
                p50d, p99d, disk50 = preads(offs_dropped, disk)
                load_dir_pages(cache)
                p50m, p99m = preads(offs_memory)
                sr.put("cached_dropped_p50", p50d)
                sr.put("cached_dropped_disk_p50", disk50)
                sr.put("cached_memory_p50", p50m)
                sr.put_extra("wl_cached_dropped_p99_us", p99d)
                sr.put_extra("wl_cached_memory_p99_us", p99m)
                log(f"  {sr.system} cached random 4K p50/p99: pages dropped {p50d:.0f}/{p99d:.0f} µs "
                    f"(the disk's {DISK_BLOCK // KIB} KiB O_DIRECT read between them: p50 {disk50:.0f} µs), "
                    f"cache files in memory {p50m:.0f}/{p99m:.0f} µs")
        finally:
            shutil.rmtree(cache, ignore_errors=True)


# --------------------------------------------------------------------------- helpers
def leave_until_exit(d: str) -> None:
    """A dir of 1,000 files is removed with the work dir when the bench ends, not now. On a
    filesystem without a journal (this host's root ext4) ext4 passes over every inode freed in
    the last minute when it allocates one, reading its inode table block: a files pass made
    right after 1,000 files were deleted paid for that in each of its own creates, 7% of the
    daemon's samples (docs/experiments.md, "2026-12-07, night"). A user's first read does not
    follow a thousand deletions."""
    at_cleanup(lambda: shutil.rmtree(d, ignore_errors=True))


def _put(d: dict, key: str, v) -> None:
    d.setdefault(key, []).append(v)


def _count_text(c: dict) -> str:
    def n(v):
        return "-" if v is None else f"{v}"
    mib = "-" if c.get("mib") is None else f"{c['mib']:.1f}"
    return (f"requests: media {n(c['media'])}, openers {n(c['openers'])}, list {n(c['list'])}, "
            f"metadata {n(c['metadata'])}, other {n(c['other'])}; new connections {n(c['connections'])}; "
            f"{mib} MiB sent")


def make_probe(path: str, size: int) -> None:
    """A file of `size` random bytes on the work dir's filesystem (the cache dirs' own), on
    the disk and out of the page cache: what one O_DIRECT read of that disk costs is measured on it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for _ in range(size // (16 * MIB)):
            os.write(fd, os.urandom(16 * MIB))
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _files_under(d: str) -> list:
    return [os.path.join(dp, f) for dp, _dn, fns in os.walk(d) for f in fns
            if os.path.isfile(os.path.join(dp, f)) and not os.path.islink(os.path.join(dp, f))]


def settle_dir(d: str, quiet_s: float = 0.5, limit_s: float = 30.0) -> None:
    """Wait until the cache dir stops growing (the daemon's last cache writes after the read)."""
    deadline = time.monotonic() + limit_s
    last = dir_size_mib(d)
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        now = dir_size_mib(d)
        if now == last:
            return
        last = now


def drop_dir_pages(d: str) -> None:
    """Every cache file's pages out of memory (written back, then POSIX_FADV_DONTNEED)."""
    for p in _files_under(d):
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue  # gone meanwhile (a temporary file)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def load_dir_pages(d: str) -> None:
    """Every cache file read once, buffered: its pages are in memory."""
    for p in _files_under(d):
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            while os.read(fd, 4 * MIB):
                pass
        finally:
            os.close(fd)
