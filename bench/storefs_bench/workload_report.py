"""The workload rows' table (workloads.py; bench/README.md "Workloads"): medians per column,
each row against its own baseline (the `baseline` column), the floor and the best rclone mode,
the issue's target and its verdict; the lines under it; their place in the JSON document.

Rows go into the same document as the read rows (`rows`, each marked `"table": "workloads"`),
so --chart draws them and --json keeps every run's value.
"""

from __future__ import annotations

from .report import fmt, fmt_extra, print_columns, verdict, versus
from .stats import median_or_none
from .systems import MOUNT_SYSTEMS, TLS_MOUNT_SYSTEMS
from .workloads import (CACHED_MIB, DISK_BLOCK, FILES_DIR, FILES_MAX, FILES_MIN, FILES_N, FILES_THREADS,
                        KIB, MMAP_BUDGET_S, MMAP_THREADS, NO_CACHE)

FILES_LABEL = f"{FILES_N:,} files of {FILES_MIN // KIB}–{FILES_MAX // KIB} KiB by {FILES_THREADS} threads"
FILES_TARGET = 0.9      # × the baseline through a link, × the floor on loopback
MMAP_TARGET = 0.8       # × curl-N of the same object
DISK_SLACK_US = 60      # a block-cache hit from the disk: ≤ the disk's own read + this
MEMORY_HIT_US = 50      # a block-cache hit whose cache file pages are in memory

# key, label, unit, higher is better, the baseline's key in `base` (or None), compared with rclone
ROWS = [
    ("files_rate", FILES_LABEL, "files/s", True, "wl_files_rate", True),
    ("files_rate_cache_writes", "  1,000 files: the floor writing a file per file", "files/s", True, None, False),
    ("files_wall", "  1,000 files: wall time (listing + reads)", "s", False, "wl_files_wall", True),
    ("files_media", "  1,000 files: media requests", "requests", False, "wl_files_media", True),
    ("files_conns", "  1,000 files: new connections (link only)", "connections", False, "wl_files_conns", False),
    ("mmap_1", "mmap, 1 thread (every page in order)", "MiB/s", True, "wl_mmap_curl", True),
    ("mmap_4", f"mmap, {MMAP_THREADS} threads (a quarter each, at once)", "MiB/s", True, "wl_mmap_curl", True),
    ("mmap_rss_1", "  daemon peak RSS, mmap 1 thread", "MiB", False, None, True),
    ("mmap_rss_4", f"  daemon peak RSS, mmap {MMAP_THREADS} threads", "MiB", False, None, True),
    ("cached_dropped_p50", "cached random 4K p50, pages dropped", "µs", False, "wl_disk_p50", True),
    ("cached_dropped_disk_p50", "  disk: 16 KiB O_DIRECT read between those reads, p50", "µs", False, None, False),
    ("cached_memory_p50", "cached random 4K p50, cache files in memory", "µs", False, None, True),
]
COUNT_UNITS = ("requests", "connections")


def _target(key: str, vals: dict, base: float | None, st_rows: dict, ml_mib: float, link: bool) -> tuple:
    """(target text, storefs passes?) of one row; (None, None) when it has none."""
    st = vals["storefs"]

    def judge(ok):
        return None if st is None else ok

    if key == "files_rate":
        if link and base:
            goal = FILES_TARGET * base
            return f"≥{FILES_TARGET}×baseline ({goal:.0f})", judge(st is not None and st >= goal)
        if not link and vals.get("floor"):
            goal = FILES_TARGET * vals["floor"]
            return f"≥{FILES_TARGET}×floor ({goal:.0f})", judge(st is not None and st >= goal)
    if key == "files_media":
        return f"={FILES_N} (one GET a file)", judge(st == FILES_N)
    if key in ("mmap_1", "mmap_4") and base:
        goal = MMAP_TARGET * base
        text, ok = f"≥{MMAP_TARGET}×curl ({goal:.0f})", st is not None and st >= goal
        if key == "mmap_4":
            one = st_rows.get("mmap_1")
            text += " and ≥1 thread"
            ok = ok and one is not None and st >= one
        return text, judge(ok)
    if key in ("mmap_rss_1", "mmap_rss_4"):
        goal = 64 + ml_mib
        return f"≤64+{ml_mib:.0f} ({goal:.0f})", judge(st is not None and st <= goal)
    if key == "cached_dropped_p50" and (base or st_rows.get("cached_dropped_disk_p50")):
        # Judged against the disk reads timed between storefs's own reads, when the run has them.
        disk = st_rows.get("cached_dropped_disk_p50") or base
        goal = disk + DISK_SLACK_US
        return f"≤disk+{DISK_SLACK_US} ({goal:.0f})", judge(st is not None and st <= goal)
    if key == "cached_memory_p50":
        return f"≤{MEMORY_HIT_US}", judge(st is not None and st <= MEMORY_HIT_US)
    return None, None


def _ratio(a, b):
    return a / b if (a is not None and b) else None


def build_rows(res: dict, base: dict, ml_mib: float, systems: list, link: bool, tls: bool,
               rclone_reason: str | None) -> list:
    """One dict per workload row, shaped like report.build_report's (values per column, runs,
    ratios, target, verdicts), the baseline in the column `baseline`."""
    cols = TLS_MOUNT_SYSTEMS if tls else MOUNT_SYSTEMS
    st_rows = {key: median_or_none(res.get(key, {}).get("storefs", [])) for key, *_ in ROWS}
    rows = []
    for key, label, unit, higher, base_key, vs_rclone in ROWS:
        runs = {s: res.get(key, {}).get(s, []) for s in cols}
        vals = {s: median_or_none(v) for s, v in runs.items()}
        b = median_or_none(base.get(base_key, [])) if base_key else None
        vals = {"baseline": b, **vals}
        runs = {"baseline": base.get(base_key, []) if base_key else [], **runs}
        st = vals["storefs"]
        row = {"key": key, "label": label.strip(), "unit": unit, "better": "higher" if higher else "lower",
               "table": "workloads", "values": vals, "runs": runs,
               "storefs_over_baseline": _ratio(st, b), "storefs_over_floor": _ratio(st, vals.get("floor"))}
        row["target"], row["target_pass"] = _target(key, vals, b, st_rows, ml_mib, link)
        rvals = {s: vals[s] for s in ("rclone-off", "rclone-full") if vals.get(s) is not None} if vs_rclone else {}
        vs = versus(st, rvals, higher, unit, short=lambda s: s.replace("rclone-", "rc-"))
        if unit in COUNT_UNITS:
            vs["text"] = vs["text"].replace("faster", "fewer").replace("slower", "more")
        if not rvals and vs_rclone and any(s.startswith("rclone") for s in systems):
            vs["text"] = "no rclone" if rclone_reason else "-"
        row["vs_rclone"] = vs
        if tls:
            row["storefs_h2_over_baseline"] = _ratio(vals.get("storefs-h2"), b)
        row["indent"] = label.startswith("  ")
        rows.append(row)
    return rows


def print_table(rows: list, streams: int, link: bool, tls: bool) -> None:
    """The workloads table, then what its baseline column holds."""
    cols = ["baseline"] + (TLS_MOUNT_SYSTEMS if tls else MOUNT_SYSTEMS)
    extra = ["h2/base"] if tls else []
    hdr = (["workload", "unit"] + cols + ["st/base"] + extra
           + ["st/floor", "storefs vs best rclone", "rc?", "target (storefs)", "tgt?"])
    table = [hdr]
    for r in rows:
        u = r["unit"]
        have = r["values"]["storefs"] is not None
        more = [_rtext(r.get("storefs_h2_over_baseline"))] if tls else []
        table.append([("  " if r["indent"] else "") + r["label"], u + (" ↑" if r["better"] == "higher" else " ↓")]
                     + [_cell(r["values"].get(c), u) for c in cols]
                     + [_rtext(r["storefs_over_baseline"])] + more
                     + [_rtext(r["storefs_over_floor"]), r["vs_rclone"]["text"],
                        verdict(r["vs_rclone"]["pass"], have) if r["vs_rclone"]["text"] != "-" else "-",
                        r["target"] or "-", verdict(r["target_pass"], have) if r["target"] else "-"])
    print()
    print(f"workloads (issue 48): each on a fresh mount with an empty cache, {'through the link' if link else 'on loopback'}")
    print_columns(table, set(range(2, 2 + len(cols) + 1 + len(extra) + 1)))
    print(f"baseline = {FILES_THREADS} keep-alive HTTP connections doing one listing request, then one GET per file "
          f"(python http.client threads, through the same {'link' if link else 'server'}) | curl-{streams} "
          f"(ranged GETs) of the mmap object | one {DISK_BLOCK // KIB} KiB O_DIRECT read of a file on the cache "
          "dir's filesystem, p50")
    by_key = {r["key"]: r["values"] for r in rows}
    alongside, floor = by_key["files_rate_cache_writes"].get("floor"), by_key["files_rate"].get("floor")
    if alongside and floor:
        st = by_key["files_rate"].get("storefs")
        print(f"the floor writing what it reads into a file per file, on its own threads (made at open, each read "
              f"written after its reply, renamed at release; no header, index or checksum: the least a cache of a "
              f"file per object does): {alongside:.0f} files/s, {alongside / floor:.2f}× the floor"
              + (f"; storefs is {st / alongside:.2f}× that" if st else ""))


def _cell(v, unit: str) -> str:
    if v is not None and unit in COUNT_UNITS:
        return f"{v:.0f}"
    return fmt(v, unit)


def _rtext(v) -> str:
    return "-" if v is None else f"{v:.2f}×"


def print_extras(base: dict, extra: dict, mmap_mib: int) -> None:
    """Under the table: what each files pass and mmap pass cost on the wire, the p99s."""
    det = extra.get("wl_files_detail", {})
    if det:
        print(f"{FILES_N} files ({FILES_DIR}/), per system (median over runs): wall / listing s; requests: media, "
              "one-byte connection openers, list, metadata, other; new connections; MiB sent")
        for system, snaps in det.items():
            print(f"  {system}: {_detail(snaps)}")
    for threads in (1, MMAP_THREADS):
        det = extra.get(f"wl_mmap_{threads}_detail", {})
        if det:
            cells = []
            for system, snaps in det.items():
                sent = median_or_none([s.get("mib") for s in snaps])
                touched = median_or_none([s["mib_touched"] for s in snaps])
                partial = sum(1 for s in snaps if s["partial"])
                cells.append(f"{system} {fmt(sent, 'MiB')} MiB sent for {fmt(touched, 'MiB')} MiB read"
                             + (f" ({partial} run(s) stopped at the {MMAP_BUDGET_S:.0f} s budget)" if partial else ""))
            print(f"mmap of {mmap_mib} MiB, {threads} thread(s): " + "; ".join(cells))
    cf = [median_or_none(base.get(k, [])) for k in ("wl_cachefiles_s", "wl_cachefiles_cpu_s", "wl_cachefiles_host_cpu_s")]
    if None not in cf:
        print(f"disk: the {FILES_N} files written into a file each on the cache dirs' filesystem (made under a "
              f"temporary name, one buffered write, renamed; then sync): {cf[0]:.2f} s, {cf[1]:.2f} CPU-s in the "
              f"writer, {cf[2]:.2f} CPU-s on the host: the least a cache of a file per object adds to the files row")
    d99 = median_or_none(base.get("wl_disk_p99", []))
    if d99 is not None:
        print(f"disk: {DISK_BLOCK // KIB} KiB O_DIRECT read p99 {d99:.0f} µs")
    for key, label in (("wl_cached_dropped_p99_us", f"cached random 4K p99 ({CACHED_MIB} MiB object), pages dropped"),
                       ("wl_cached_memory_p99_us", "cached random 4K p99, cache files in memory")):
        if key in extra:
            print(f"{label}: " + ", ".join(f"{s} {fmt_extra(median_or_none(v), 'µs')}" for s, v in extra[key].items()))
    print(f"the cached rows run on the systems with a cache (not {', '.join(NO_CACHE)})")


def _detail(snaps: list) -> str:
    def med(k):
        return median_or_none([s.get(k) for s in snaps if s.get(k) is not None])

    def n(v):
        return "-" if v is None else f"{v:.0f}"
    return (f"{fmt(med('wall'), 's')} / {fmt(med('list_s'), 's')} s; {n(med('media'))}, {n(med('openers'))}, "
            f"{n(med('list'))}, {n(med('metadata'))}, {n(med('other'))}; {n(med('connections'))}; "
            f"{fmt(med('mib'), 'MiB')}")


def add_to_json(doc: dict, rows: list, description: dict) -> None:
    """The workload rows after the read rows, and what was measured in meta."""
    doc["rows"] = doc.get("rows", []) + rows
    doc["meta"]["workloads"] = description
