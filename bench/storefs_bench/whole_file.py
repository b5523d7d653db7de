"""`bench/whole-file`: the measurement behind `whole_file=`'s default (bench/README.md,
"bench/whole-file"; docs/experiments.md has its entries). A file whose size is known and at most
`whole_file=` is fetched whole by its first read, one GET, without read-ahead; a larger one in
ranged parts with read-ahead. Which is faster depends on the file's size and on how many
readers share the link, so for files of 512 KiB to 8 MiB, through bench/link's `wan` model:

- 16 readers: FILES files of one size in their own directory, listed, then read whole by 16
  threads (workload_workers.files_worker, as the workload rows' data loader), on a fresh
  mount with an empty cache; files/s and MiB/s of the reads (the listing's time left out),
  media GETs (the link proxy's count), the daemon's VmHWM. Ceiling: 16 keep-alive
  connections, one GET per file (workload_workers.http_worker, as the files ceiling).
- 1 reader: one file of that size, alone in its directory, listed, then read whole by one
  thread on a fresh mount: the time from open to EOF. Ceiling: one GET on a new connection.

storefs is mounted with whole_file=0 (parts), 1M (the default when this was written) and the
files' size (whole); the order of the systems turns with each run. Every byte is checked.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import tempfile
import types
import urllib.parse
import zlib

from . import MIB
from .data import BUCKET
from .host import BenchError, OtherLoad, at_cleanup, drop_caches, free_port, log, other_load_line
from .readers import run_worker
from .servers import FakeGCS, link_module, start_link_proxy
from .systems import Mount, RunContext, prepare_storefs
from .workloads import WORKERS_PY, RequestCount

SIZES = {"512K": 512 << 10, "1M": 1 << 20, "2M": 2 << 20, "4M": 4 << 20, "8M": 8 << 20}
FILES = 48
THREADS = 16
PROBE_SIZE = 4096  # big.bin, which FakeGCS.start waits for; nothing reads it
SEED = 20261207


def parts_dir(label: str) -> str:
    return f"wf-{label.lower()}"


def one_dir(label: str) -> str:
    return f"wf-{label.lower()}-one"


def prepare(root: str) -> dict:
    """The bucket in `root` (made once, seeded): per size FILES files and one file alone.
    Returns {directory: {name: [size, crc32]}}."""
    marker = os.path.join(root, "WHOLE_FILE.json")
    want = {"seed": SEED, "files": FILES, "sizes": SIZES}
    bdir = os.path.join(root, BUCKET)
    if not (os.path.exists(marker) and json.load(open(marker)) == want):
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(bdir)
        with open(os.path.join(bdir, "big.bin"), "wb") as f:
            f.write(b"\0" * PROBE_SIZE)
        rng = random.Random(SEED)
        for label, size in SIZES.items():
            for d, n in ((parts_dir(label), FILES), (one_dir(label), 1)):
                os.makedirs(os.path.join(bdir, d))
                for i in range(n):
                    with open(os.path.join(bdir, d, f"f{i:02d}.bin"), "wb") as f:
                        f.write(rng.randbytes(size))
        with open(marker, "w") as f:
            json.dump(want, f)
    expect = {}
    for d in sorted(os.listdir(bdir)):
        if os.path.isdir(os.path.join(bdir, d)):
            expect[d] = {}
            for name in sorted(os.listdir(os.path.join(bdir, d))):
                data = open(os.path.join(bdir, d, name), "rb").read()
                expect[d][name] = [len(data), zlib.crc32(data)]
    return expect


def measure(ctx: RunContext, link, system: str, directory: str, expect: dict, threads: int, run_i: int) -> dict:
    """Read every file of `directory` whole by `threads` threads: through a fresh storefs mount
    with `whole_file=` from `system` ("wf=SIZE"), or straight over HTTP ("ceiling")."""
    files = expect[directory]
    if system == "ceiling":
        origin = urllib.parse.urlsplit(ctx.endpoint)
        spec = {"host": origin.hostname, "port": origin.port, "ca": None, "bucket": BUCKET,
                "prefix": directory + "/", "threads": threads, "expect": files}
        count = RequestCount(ctx.server, link)
        r = run_worker("http", spec, 300, f"GETs of {directory}", None, script=WORKERS_PY)
        hwm = None
    else:
        ctx.storefs_opts = f"whole_file={system.split('=', 1)[1]}"
        cache = ctx.new_cache_dir(f"r{run_i}")
        try:
            with Mount("storefs", ctx, ctx.mnt, cache) as m:
                drop_caches()
                count = RequestCount(ctx.server, link)
                spec = {"dir": os.path.join(ctx.mnt, directory), "threads": threads, "expect": files}
                r = run_worker("files", spec, 300, f"{directory} read", m.pid, script=WORKERS_PY)
                hwm = m.hwm_mib()
        finally:
            shutil.rmtree(cache, ignore_errors=True)
    if "error" in r or r["bad"]:
        raise BenchError(f"{system} {directory}: {r.get('error') or r['first_bad']}")
    c = count.finish((directory + "/",))
    reads = r["seconds"] - r["list_seconds"]
    return {"reads_s": reads, "files_s": r["files"] / reads, "mibs": r["bytes"] / MIB / reads,
            "media": c["media"], "openers": c["openers"], "connections": c["connections"], "hwm_mib": hwm}


def systems_for(label: str) -> list:
    return ["ceiling", "wf=0", "wf=1M"] + ([f"wf={label}"] if label not in ("512K", "1M") else [])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bench/whole-file", description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="runs of the 16-reader passes (median; default 3)")
    ap.add_argument("--singles", type=int, default=5, help="cold single-file reads per size and system (default 5)")
    ap.add_argument("--sizes", default=",".join(SIZES), help=f"a subset of {','.join(SIZES)}")
    ap.add_argument("--json", help="write every value to this file")
    ap.add_argument("--data-dir", default=os.path.join(tempfile.gettempdir(), "storefs-bench-data-whole-file"))
    args = ap.parse_args(argv)
    labels = [s for s in args.sizes.split(",") if s]
    if not set(labels) <= set(SIZES):
        ap.error(f"--sizes: choose from {','.join(SIZES)}")
    load = OtherLoad()
    workdir = tempfile.mkdtemp(prefix="storefs-whole-file-")
    at_cleanup(lambda: shutil.rmtree(workdir, ignore_errors=True), first=True)
    ctx = RunContext(types.SimpleNamespace(link="wan"), workdir, PROBE_SIZE, BUCKET)
    expect = prepare(args.data_dir)
    why = prepare_storefs(ctx)
    if why:
        raise BenchError(why)
    upstream = free_port()
    link = start_link_proxy("wan", upstream, workdir)
    ctx.server = FakeGCS(args.data_dir, workdir, PROBE_SIZE, port=upstream, external_url=link.url).start()
    ctx.endpoint = link.url
    vals: dict = {}  # (threads, label, system) -> [result per run]
    for run_i in range(max(args.runs, args.singles)):
        for label in labels:
            systems = systems_for(label)
            k = run_i % len(systems)
            systems = systems[k:] + systems[:k]
            for threads, directory, n in ((THREADS, parts_dir(label), args.runs), (1, one_dir(label), args.singles)):
                if run_i >= n:
                    continue
                for s in systems:
                    if threads == 1 and s == "wf=1M" and label not in ("512K", "1M"):
                        continue  # the same as wf=0 for a file above 1M: one reader needs no third column
                    r = measure(ctx, link, s, directory, expect, threads, run_i)
                    vals.setdefault(f"{threads} {label} {s}", []).append(r)
                    log(f"run {run_i + 1} {threads:2d} reader(s) {label:>4} {s:>8}: {r['reads_s'] * 1000:7.1f} ms, "
                        f"{r['files_s']:6.1f} files/s, {r['mibs']:6.1f} MiB/s, media {r['media']}, "
                        f"openers {r['openers']}, conns {r['connections']}, VmHWM {r['hwm_mib']}")
    noise = load.finish()
    print_table(vals, labels, args, ctx, noise)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"storefs_sha256": ctx.storefs_sha, "noise": noise, "values": vals}, f, indent=1)
    return 0


def _med(rs: list, key: str):
    v = [r[key] for r in rs if r[key] is not None]
    return statistics.median(v) if v else None


def print_table(vals: dict, labels: list, args, ctx, noise: dict) -> None:
    print(f"\nstorefs {ctx.storefs_version}, sha256 {ctx.storefs_sha[:12]}; link 'wan'; {FILES} files per size, "
          f"{THREADS} readers: median of {args.runs}; 1 reader: median of {args.singles}")
    print("| size | system | 16 readers: files/s | MiB/s | media GETs | peak RSS, MiB | 1 reader: ms |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    wan = link_module().PROFILES["wan"]
    link_ms = {label: wan["ttfb_ms"] + SIZES[label] / MIB / wan["conn_mibps"] * 1000 for label in labels}
    for label in labels:
        for s in systems_for(label):
            many, one = vals.get(f"{THREADS} {label} {s}", []), vals.get(f"1 {label} {s}", [])
            cells = [f"{_med(many, 'files_s'):.0f}" if many else "-", f"{_med(many, 'mibs'):.0f}" if many else "-",
                     f"{_med(many, 'media'):.0f}" if many else "-",
                     f"{_med(many, 'hwm_mib'):.0f}" if many and _med(many, "hwm_mib") else "-",
                     f"{_med(one, 'reads_s') * 1000:.0f}" if one else "(= wf=0)"]
            print(f"| {label} | {s} | " + " | ".join(cells) + " |")
    print("1 reader, the link's least: " + ", ".join(f"{k} {v:.0f} ms" for k, v in link_ms.items())
          + f" (first byte {wan['ttfb_ms']} ms + size at {wan['conn_mibps']} MiB/s); the ceiling's 1-reader time"
          f" includes opening its connection ({wan['setup_ms']} ms)")
    print(other_load_line(noise))
