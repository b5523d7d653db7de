"""From per-run values to what is printed: medians, ratios, verdicts, tables, the JSON file.

The loopback/--link table (bench/README.md, "What happens" 5): one row per measurement, the
median over the runs in each column, `st/curl-N` and `st/floor` ratios, storefs against the
best rclone mode, and the design target with its verdict. The --scale table is built in
scale.py with the helpers here (`fmt`, `print_columns`, `verdict`).
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import time

from . import MIB, REPO
from .baselines import LAT_GETS
from .data import BIG, TREE_DIRS, TREE_FILES_PER_DIR
from .host import other_load_line
from .phases import LINK_READERS, RAND_READS, READERS
from .shared_cache import EXTRAS as SHARED_EXTRAS, ROW as SHARED_ROW
from .stats import median_or_none
from .systems import MOUNT_SYSTEMS, TLS_MOUNT_SYSTEMS

ROWS = [
    # key, label, unit, higher_is_better
    ("cold_seq", "cold sequential read (dd bs=1M)", "MiB/s", True),
    ("warm_seq", "warm re-read (remount, same cache)", "MiB/s", True),
    SHARED_ROW,
    ("rand_cold_p50", "random 4K pread p50, cold", "µs", False),
    ("rand_cold_p99", "random 4K pread p99, cold", "µs", False),
    ("rand_cached_p50", "random 4K pread p50, cached", "µs", False),
    ("rand_cached_p99", "random 4K pread p99, cached", "µs", False),
    ("par8", f"{READERS} parallel readers, cold", "MiB/s", True),
    ("head_100k", "head -c 100000 of big: MiB sent (fresh)", "MiB", False),
    ("find", "find tree | wc -l (fresh mount)", "s", False),
    ("lsR", "ls -lR tree (fresh mount)", "s", False),
    ("rss", "daemon peak RSS (VmHWM, cold seq)", "MiB", False),
]
# find and ls -lR of the tree against the direct listing walk of it (the target).
WALK_TARGET = 1.2
# --link adds these after the parallel readers.
LINK_ROWS = [
    ("par4", f"{LINK_READERS} readers of disjoint slices, cold", "MiB/s", True),
    ("first_byte", f"head -c 1 of {BIG} (fresh mount)", "ms", False),
    ("first_byte_tree", "head -c 1 of tree/d07/f0712 (fresh)", "ms", False),
    ("first_byte_sibling", "then of tree/d07/f0745 (same dir)", "ms", False),
]


# --tls adds this last: what the bytes cost the daemon (decrypting them included).
TLS_ROWS = [
    ("cpu_gib", "daemon CPU-s per GiB, cold sequential", "s", False),
]


def rows_for(link: bool, tls: bool = False) -> list:
    """The table's rows: the loopback ones, plus LINK_ROWS after the 8 readers with --link,
    plus TLS_ROWS at the end with --tls."""
    rows = ROWS
    if link:
        i = [r[0] for r in ROWS].index("par8") + 1
        rows = ROWS[:i] + LINK_ROWS + ROWS[i:]
    return rows + TLS_ROWS if tls else rows


def memory_limit_mib(opts: str) -> float:
    """storefs's memory_limit= in STOREFS_BENCH_OPTS (default 256M): the RSS target's budget."""
    m = re.search(r"(?:^|,)memory_limit=([0-9.]+)\s*([KMGT]?)(i?B?)(?:,|$)", opts, re.I)
    if not m:
        return 256.0
    mult = {"": 1 / MIB, "K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}[m.group(2).upper()]
    return float(m.group(1)) * mult


# --------------------------------------------------------------------------- formatting
def fmt(v, unit: str) -> str:
    if v is None:
        return "-"
    if unit == "s":
        return f"{v:.3f}"
    if unit in ("µs", "ms"):
        return f"{v:.1f}" if v < 100 else f"{v:.0f}"
    if unit == "MiB":
        return f"{v:.1f}"
    return f"{v:.0f}"


def fmt_extra(v, unit: str) -> str:
    if v is None:
        return "-"
    if unit == "%":
        return f"{v:.0f}%"
    if unit == "×":
        return f"{v:.2f}×"
    return f"{v:.2f} {unit}" if unit == "s" else f"{fmt(v, unit)} {unit}"


def verdict(p, have: bool = True) -> str:
    """PASS/MISS, `-` when there is nothing to judge, `n/a` when storefs has no value."""
    return ("-" if have else "n/a") if p is None else ("PASS" if p else "MISS")


def print_columns(table: list, numeric: set) -> None:
    """Print rows of cells aligned; table[0] is the header, `numeric` the right-aligned columns."""
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for n, row in enumerate(table):
        cells = [c.rjust(widths[i]) if i in numeric else c.ljust(widths[i]) for i, c in enumerate(row)]
        print("  ".join(cells).rstrip())
        if n == 0:
            print("  ".join("-" * w for w in widths))


def versus(st, others: dict, higher: bool, unit: str, short=lambda s: s) -> dict:
    """storefs against the best of `others` on one row, worded so the direction is plain."""
    if not others or st is None:
        return {"best": None, "factor": None, "text": "-", "pass": None}
    best_s = max(others, key=others.get) if higher else min(others, key=others.get)
    best = others[best_s]
    if higher:
        ahead = st > best
        f = st / best if ahead else best / st
        word = "faster" if ahead else "slower"
    else:
        ahead = st < best
        f = best / st if ahead else st / best
        if unit == "MiB":
            word = "smaller" if ahead else "larger"
        else:  # latency and elapsed time: lower means faster
            word = "faster" if ahead else "slower"
    return {"best": best_s, "factor": f, "pass": ahead, "text": f"{f:.2f}× {word} than {short(best_s)}"}


# --------------------------------------------------------------------------- the loopback / --link table
def columns(streams: int, tls: bool = False) -> list:
    """The value columns: curl-1, curl-N (8 on loopback, 16 through a link), then the mounts.
    With --tls: curl over TLS with HTTP/1.1, curl-N-h2 the same N streams with HTTP/2, and
    storefs-h2 (http_version=2) beside storefs (http_version=1.1)."""
    if tls:
        return ["curl-1", f"curl-{streams}", f"curl-{streams}-h2"] + TLS_MOUNT_SYSTEMS
    return ["curl-1", f"curl-{streams}"] + MOUNT_SYSTEMS


def _baseline_cells(key: str, base: dict, streams: int, vals: dict, runs: dict) -> None:
    """The curl columns of the rows that have a curl counterpart."""
    cn, bn = f"curl-{streams}", f"curl{streams}"
    h2 = f"{bn}_h2" in base  # --tls: curl-N over HTTP/2 too
    if key == "cold_seq":
        vals["curl-1"] = median_or_none(base["curl1"])
        vals[cn] = median_or_none(base[bn])
        runs["curl-1"], runs[cn] = base["curl1"], base[bn]
    if key in ("cold_seq", "par8") and h2:
        vals[f"{cn}-h2"] = median_or_none(base[f"{bn}_h2"])
        runs[f"{cn}-h2"] = base[f"{bn}_h2"]
    if key == "par8":
        vals[cn] = median_or_none(base[bn])
        runs[cn] = base[bn]
    elif key in ("rand_cold_p50", "rand_cold_p99"):
        src = "get_p50" if key.endswith("p50") else "get_p99"
        vals["curl-1"] = median_or_none(base[src])
        runs["curl-1"] = base[src]


def _target(key: str, vals: dict, streams: int, ml_mib: float, walk: float | None) -> tuple:
    """(target text, storefs passes?, floor passes?) of one row; (None, None, None) if none.
    `walk` is the direct listing walk's seconds (median), the floor of find and ls -lR."""
    st, fl, cn = vals["storefs"], vals["floor"], f"curl-{streams}"
    if key == "cold_seq" and vals[cn]:
        goal = 0.9 * vals[cn]
        return (f"≥0.9×{cn} ({goal:.0f})", None if st is None else st >= goal,
                None if fl is None else fl >= goal)
    if key == "warm_seq":
        return "≥2048 (2 GiB/s)", None if st is None else st >= 2048, None
    if key == "rand_cold_p50" and vals["curl-1"]:
        goal = 1.5 * vals["curl-1"]
        return (f"≤1.5×GET p50 ({goal:.0f})", None if st is None else st <= goal,
                None if fl is None else fl <= goal)
    if key == "rand_cached_p50":
        return "≤50", None if st is None else st <= 50, None
    if key == "head_100k":
        return "≤4 (a few MiB)", None if st is None else st <= 4, None if fl is None else fl <= 4
    if key in ("find", "lsR") and walk:
        goal = WALK_TARGET * walk
        return f"≤{WALK_TARGET}×walk ({goal:.2f})", None if st is None else st <= goal, None
    if key == "rss":
        goal = 64 + ml_mib
        return f"≤64+{ml_mib:.0f} ({goal:.0f})", None if st is None else st <= goal, None
    return None, None, None


def build_report(res: dict, base: dict, ml_mib: float, rclone_reason: str | None, systems: list,
                 streams: int = READERS, link: bool = False, tls: bool = False) -> list:
    """One dict per row: medians per column, ratios, target and verdicts, per-run values.
    With --tls also storefs-h2 against curl-N (HTTP/1.1, the ceiling) and against storefs."""
    cn = f"curl-{streams}"
    rows = []
    for key, label, unit, higher in rows_for(link, tls):
        runs = {s: res.get(key, {}).get(s, []) for s in (TLS_MOUNT_SYSTEMS if tls else MOUNT_SYSTEMS)}
        vals = {s: median_or_none(v) for s, v in runs.items()}
        vals["curl-1"] = vals[cn] = None
        if tls:
            vals[f"{cn}-h2"] = None
        _baseline_cells(key, base, streams, vals, runs)
        st = vals["storefs"]
        row = {"key": key, "label": label, "unit": unit,
               "better": "higher" if higher else "lower", "values": vals, "runs": runs}
        # storefs / curl-N for throughput rows (the key is named for the loopback's curl-8)
        row["storefs_over_curl8"] = (st / vals[cn]) if (higher and st and vals[cn]) else None
        # storefs / floor: how much storefs's own work costs over FUSE + HTTP alone
        fl = vals["floor"]
        row["storefs_over_floor"] = (st / fl) if (st and fl) else None
        row["target"], row["target_pass"], row["floor_target_pass"] = _target(key, vals, streams, ml_mib,
                                                                              median_or_none(base["walk"]))
        rvals = {s: vals[s] for s in ("rclone-off", "rclone-full") if vals[s] is not None}
        vs = versus(st, rvals, higher, unit, short=lambda s: s.replace("rclone-", "rc-"))
        if not rvals and ("rclone-off" in systems or "rclone-full" in systems):
            vs["text"] = "no rclone" if rclone_reason else "-"
        row["vs_rclone"] = vs
        if tls:
            h2 = vals["storefs-h2"]
            row["storefs_h2_over_curl8"] = (h2 / vals[cn]) if (higher and h2 and vals[cn]) else None
            row["h2_vs_h1"] = versus(h2, {"storefs": st} if st is not None else {}, higher, unit,
                                     short=lambda s: "h1.1")
        rows.append(row)
    return rows


def print_floor(rows: list, streams: int = READERS) -> None:
    """What the floor says about each target: one the floor misses no FUSE filesystem meets here."""
    by = {r["key"]: r for r in rows}
    cn = f"curl-{streams}"
    lines = []
    for key, base, word in [("cold_seq", cn, cn), ("par8", cn, cn), ("rand_cold_p50", "curl-1", "GET p50")]:
        r = by.get(key)
        if not r or r["values"]["floor"] is None:
            continue
        fl, b = r["values"]["floor"], r["values"][base]
        text = f"  {r['label']}: floor {fmt(fl, r['unit'])} {r['unit']}"
        if b:
            text += f" = {fl / b:.2f}×{word}"
        if r["floor_target_pass"] is not None:
            text += f"; storefs target {r['target']}: the floor {'meets' if r['floor_target_pass'] else 'MISSES'} it"
        if r["storefs_over_floor"] is not None:
            text += f"; storefs = {r['storefs_over_floor']:.2f}×floor"
        lines.append(text)
    if lines:
        print("floor = bench/floor/floorfs.c: C on libfuse3 + libcurl, the same mount settings, one ranged GET "
              "per FUSE read on the FUSE thread, no cache, no read-ahead of its own (the kernel's only): "
              "what FUSE + HTTP cost on this machine when the filesystem does no work.")
        for line in lines:
            print(line)


def _ratio(v) -> str:
    return "-" if v is None else f"{v:.2f}×"


def print_table(rows: list, streams: int = READERS, tls: bool = False) -> None:
    """The loopback/--link table: values, ratios, storefs vs best rclone, target and verdicts.
    With --tls: `h2/curl-N` (storefs-h2 over curl-N with HTTP/1.1) and `h2 vs h1.1` (storefs-h2
    against storefs) after `st/curl-N`."""
    cols = columns(streams, tls)
    extra = [f"h2/curl-{streams}", "h2 vs h1.1"] if tls else []
    hdr = (["measurement", "unit"] + cols + [f"st/curl-{streams}"] + extra
           + ["st/floor", "storefs vs best rclone", "rc?", "target (storefs)", "tgt?"])
    table = [hdr]
    for r in rows:
        u = r["unit"]
        have = r["values"]["storefs"] is not None
        more = [_ratio(r["storefs_h2_over_curl8"]), r["h2_vs_h1"]["text"]] if tls else []
        table.append([r["label"], u + (" ↑" if r["better"] == "higher" else " ↓")]
                     + [fmt(r["values"][c], u) for c in cols]
                     + [_ratio(r["storefs_over_curl8"])] + more
                     + [_ratio(r["storefs_over_floor"]),
                        r["vs_rclone"]["text"], verdict(r["vs_rclone"]["pass"], have),
                        r["target"] or "-", verdict(r["target_pass"], have)])
    print_columns(table, set(range(2, 2 + len(cols) + 2 + (1 if tls else 0))))


def print_header(size_mib: int, runs: int, duration: float, storefs_opts: str, ml: float, noise: dict,
                 streams: int, link_desc: str | None, tls_desc: str | None = None) -> None:
    """What was measured, with which options, and how busy the machine was meanwhile."""
    where = f"through the modelled link {link_desc}" if link_desc else "on loopback"
    if tls_desc:
        where += f", over TLS ({tls_desc})"
    print()
    print(f"storefs benchmark: {size_mib} MiB object, {TREE_DIRS * TREE_FILES_PER_DIR} small files, "
          f"median of {runs} run(s), fake-gcs-server {where}, {os.cpu_count()} CPUs, {duration:.0f} s")
    print(f"storefs opts: {storefs_opts or '(none)'}; memory_limit for the RSS target: {ml:.0f} MiB")
    print(f"curl-1 = one curl GET; curl-{streams} = {streams} curl processes on 1/{streams} ranges each; "
          f"4K GET latency = curl CLI, {LAT_GETS} URLs in one invocation (one reused connection), -w %{{time_total}}")
    if tls_desc:
        print(f"--tls: curl --cacert CA --http1.1 (curl-{streams}-h2: --http2, still one connection per process); "
              "storefs = -o ca_file=CA,http_version=1.1, storefs-h2 = http_version=2; floor = FLOORFS_CA_FILE, "
              "HTTP/1.1; rclone --ca-cert")
    print(other_load_line(noise))
    print("↑ higher is better, ↓ lower is better; rc? = ahead of the best rclone mode; tgt? = design target")
    print()


def print_extras(base: dict, extra: dict, size_mib: int) -> None:
    """The lines below the table: disk, http.client, CPU, bytes served, cache size."""
    lc = median_or_none(base["local_cold"])
    if lc is not None:
        print(f"local copy of {BIG} on this machine's disk, dd bs=1M after drop_caches: {lc:.0f} MiB/s "
              "(the ceiling for a warm re-read whose cache files were dropped too)")
    walk = median_or_none(base["walk"])
    if walk is not None:
        print(f"direct listing walk of tree/ (delimited, sequential, one keep-alive connection, the floor of find "
              f"and ls -lR): {walk:.3f} s")
    if "get_p50_h2" in base:
        g50, g99 = median_or_none(base["get_p50_h2"]), median_or_none(base["get_p99_h2"])
        if g50 is not None:
            print(f"4K GET over TLS with HTTP/2 (curl --http2, one reused connection): p50 {g50:.0f} µs, p99 {g99:.0f} µs "
                  f"(HTTP/1.1: the curl-1 column)")
    hc50, hc99 = median_or_none(base["hc_p50"]), median_or_none(base["hc_p99"])
    if hc50 is not None:
        print(f"4K GET via python http.client keep-alive (for comparison): p50 {hc50:.0f} µs, p99 {hc99:.0f} µs")
    for key, label, unit in [
            ("warm_seq_page_cache_mibs", "warm re-read on a third mount without drop_caches (cache files in the page cache)", "MiB/s"),
            ("rand_cached_after_drop_caches_p50_us", "random 4K p50 cached after drop_caches (daemon cache cold in page cache)", "µs"),
            ("rand_cached_after_drop_caches_p99_us", "random 4K p99 cached after drop_caches", "µs"),
            ("machine_busy_pct_cold_seq", "machine CPU busy during the cold sequential read (all CPUs = 100)", "%"),
            ("machine_busy_pct_par8", f"machine CPU busy during the {READERS} parallel readers", "%"),
            ("spread_par8", f"{READERS} parallel readers: the slowest one's time over the fastest's (1 = an even share)", "×"),
            ("spread_par4", "4 parallel readers: the slowest one's time over the fastest's", "×"),
            ("daemon_cpu_s_per_gib_cold_seq", "daemon CPU-s per GiB, cold sequential", "s"),
            ("server_cpu_s_per_gib_cold_seq", "fake-gcs-server CPU-s per GiB, cold sequential", "s"),
            ("server_mib_sent_cold_seq", f"bytes served by fake-gcs-server during the cold sequential read of {size_mib} MiB", "MiB"),
            ("server_mib_sent_cold_random", f"bytes served during the {RAND_READS} cold random 4K reads "
             f"({RAND_READS * 4 / 1024:.1f} MiB asked; the rest is read-ahead, or a background download)", "MiB"),
            ("cache_dir_mib_after_cold_seq", "cache dir size after cold sequential", "MiB")] + SHARED_EXTRAS:
        if key in extra:
            cells = ", ".join(f"{s} {fmt_extra(median_or_none(v), unit)}" for s, v in extra[key].items())
            print(f"{label}: {cells}")


def print_errors(errors: list) -> None:
    if errors:
        print()
        print("errors / skipped:")
        for e in errors:
            print(f"  - {e}")


def git_head() -> str:
    return subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=False).stdout.strip()


def common_meta(ctx, runs: int, duration: float, noise: dict, systems: list) -> dict:
    """The meta fields every setting's JSON shares: machine, binaries, options, load."""
    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": platform.node(),
        "kernel": platform.release(), "cpus": os.cpu_count(), "runs": runs, "duration_s": round(duration, 1),
        "storefs_bin": ctx.storefs_src, "storefs_sha256": ctx.storefs_sha,
        "storefs_version": ctx.storefs_version, "noise": noise, "storefs_opts": ctx.storefs_opts,
        "rclone_bin": ctx.rclone_bin, "rclone_version": ctx.rclone_version, "rclone_opts": ctx.rclone_opts,
        "systems": systems, "git_head": git_head(),
    }


def loopback_json(ctx, size_mib: int, runs: int, duration: float, noise: dict, ml: float, systems: list,
                  base: dict, rows: list, extra: dict, errors: list, link_info: dict | None,
                  tls_info: dict | None = None) -> dict:
    """--json of the loopback/--link setting: meta, baselines, rows with per-run values, extras."""
    meta = common_meta(ctx, runs, duration, noise, systems)
    meta.update({
        "object_mib": size_mib, "tree_files": TREE_DIRS * TREE_FILES_PER_DIR, "memory_limit_mib": ml,
        "latency_method": f"curl CLI, {LAT_GETS} 4 KiB ranged URLs in one invocation "
                          "(reused connection), -w %{time_total}",
        "random_reads": RAND_READS,
        "cached_pass": "after a full dd read; POSIX_FADV_DONTNEED on the mounted file first, "
                       "so reads reach the daemon while its cache files stay in the page cache",
    })
    if link_info is not None:
        meta["link"] = link_info
    if tls_info is not None:
        meta["tls"] = tls_info
    return {
        "meta": meta,
        "baselines": {k: {"runs": v, "median": median_or_none(v)} for k, v in base.items()},
        "rows": rows,
        "extra": {k: {s: {"runs": v, "median": median_or_none(v) if _numeric(v) else None} for s, v in d.items()}
                  for k, d in extra.items()},
        "errors": errors,
    }


def _numeric(values: list) -> bool:
    return all(v is None or isinstance(v, (int, float)) for v in values)


def write_json(path: str, doc: dict) -> None:
    with open(path, "w") as f:
        json.dump(doc, f, indent=2, ensure_ascii=False)
    print(f"\nJSON written to {path}")


# --------------------------------------------------------------------------- --link
def overhead_line(over: dict) -> str:
    """measure_overhead's result in one line: curl direct vs through a proxy with no delays."""
    n = over.get("streams", 16)
    try:
        return (f"link proxy's own overhead (measure_overhead: curl direct vs through linkproxy with no delays "
                f"or caps, median of {over['runs']}): 1 stream {over['direct_1_mibps']:.0f} → "
                f"{over['proxy_1_mibps']:.0f} MiB/s ({over['ratio_1']:.2f}×), {n} streams "
                f"{over[f'direct_{n}_mibps']:.0f} → {over[f'proxy_{n}_mibps']:.0f} MiB/s ({over[f'ratio_{n}']:.2f}×), "
                f"4 KiB keep-alive GET p50 {over['direct_request_us']:.0f} → {over['proxy_request_us']:.0f} µs "
                f"(+{over['added_us_per_request']:.0f} µs)")
    except (KeyError, TypeError, ValueError):
        return "link proxy's own overhead (measure_overhead): " + json.dumps(over)


def print_link_usage(extra: dict, link_info: dict) -> None:
    """The proxy's own overhead, and what each phase cost on the wire per system."""
    print()
    over = link_info.get("overhead")
    if over is not None:
        print(overhead_line(over))
    elif not link_info.get("tls_topology"):
        print(f"link proxy's own overhead: not measured ({link_info.get('overhead_error', 'unknown')})")
    if link_info.get("tls_topology"):
        print(f"--tls topology: {link_info['tls_topology']}")
    phases = [k for k in extra if k.startswith("link_stats:")]
    if not phases:
        return
    tls = any("http2" in snap for k in phases for snaps in extra[k].values() for snap in snaps)
    print("through the link, per phase (the proxy's stats(), median over runs): requests answered / "
          "connections opened / connections used / MiB sent"
          + ("; --tls: connections are the clients' own (the front proxy's), requests and MiB the back proxy's, "
             "used `-` (TLS hides which connection carried a request), and (h2 N, h1.1 M) the requests nginx "
             "saw per HTTP version" if tls else ""))
    for key in phases:
        cells = []
        for system, snaps in extra[key].items():
            med = {k: median_or_none([s.get(k) for s in snaps if s.get(k) is not None])
                   for k in ("requests", "connections", "connections_used", "bytes", "http2", "http1")}
            cell = (f"{system} {fmt(med['requests'], '')} / {fmt(med['connections'], '')} / "
                    f"{fmt(med['connections_used'], '')} / {(med['bytes'] or 0) / MIB:.1f}")
            if med["http2"] is not None:
                cell += f" (h2 {fmt(med['http2'], '')}, h1.1 {fmt(med['http1'], '')})"
            cells.append(cell)
        print(f"  {key.split(':', 1)[1]}: " + "; ".join(cells))
