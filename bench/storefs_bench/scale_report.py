"""The --scale report: the table of walk times against the direct listing walk, memory,
requests per phase, and the JSON file (bench/README.md, "--scale"). The numbers come from
scale.py's ScaleBench; the shared formatting and verdict wording from report.py.
"""

from __future__ import annotations

import os

from .host import other_load_line
from .report import common_meta, fmt, print_columns, verdict, versus
from .scale import (FIND_REPEATS, FIND_TARGET, LSR_TARGET, NAMES_PER_LIST_TARGET, PHASES, RSS_GROWTH_SLACK,
                    RSS_TARGET_MIB, STAT_PATHS, STAT_SEED, V0_SYSTEM, ScaleBench)
from .stats import median_or_none


def _walk_seconds(sb: ScaleBench, which: str):
    return median_or_none([w["seconds"] for w in sb.walks.get(which, [])])


def table_rows(sb: ScaleBench, rclone_reason: str | None) -> list:
    """One dict per (phase, cold|warm): medians, ratio to the walk, rclone, target."""
    rows = []
    phases = [p for p in PHASES if sb.shape.wide or p.walk != "wide"]
    for phase in phases:
        for temp in ("cold", "warm"):
            k = f"{phase.key}:{temp}"
            vals = {s: median_or_none(sb.res.get(k, {}).get(s, [])) for s in sb.systems}
            w = _walk_seconds(sb, phase.walk)
            row = {"key": k, "label": f"{phase.label}, {temp}", "unit": "s", "walk": w, "values": vals,
                   "runs": {s: sb.res.get(k, {}).get(s, []) for s in sb.systems}}
            row["over_walk"] = {s: (v / w if (v is not None and w) else None) for s, v in vals.items()}
            others = {s: vals[s] for s in vals if s.startswith("rclone") and vals[s] is not None}
            row["vs_rclone"] = versus(vals.get("storefs"), others, False, "s")
            if not others and "rclone" in sb.systems:
                row["vs_rclone"]["text"] = "no rclone" if rclone_reason else "-"
            row["target"], row["target_pass"] = None, None
            limit = {"find": FIND_TARGET, "lsR": LSR_TARGET}.get(phase.key)
            if limit and temp == "cold" and w:
                rc_ok = row["vs_rclone"]["pass"]  # None: rclone not measured, so only the walk is judged
                row["target"] = f"≤{limit}×walk ({limit * w:.2f})" + (
                    " and ahead of rclone" if rc_ok is not None else "; rclone not measured")
                st = vals.get("storefs")
                if st is not None:
                    row["target_pass"] = st <= limit * w and rc_ok is not False
            rows.append(row)
        if phase.key == "find" and V0_SYSTEM in sb.systems:
            rows.extend(v0_rows(sb))
    return rows


def v0_rows(sb: ScaleBench) -> list:
    """The Firebase v0 variant of find, against the v0 walk; its target is the requests it
    makes (about one list request per 1,000 names), not a time."""
    rows = []
    w = _walk_seconds(sb, "v0")
    for temp in ("cold", "warm"):
        k = f"find:{temp}"
        v = median_or_none(sb.res.get(k, {}).get(V0_SYSTEM, []))
        row = {"key": f"v0 {k}", "label": f"find MNT | wc -l, {temp}: storefs-v0 (v0 API, walk(api=v0))",
               "unit": "s", "walk": w, "values": {s: (v if s == "storefs" else None) for s in sb.systems},
               "runs": {V0_SYSTEM: sb.res.get(k, {}).get(V0_SYSTEM, [])},
               "over_walk": {"storefs": (v / w if (v is not None and w) else None)},
               "vs_rclone": {"text": "-", "pass": None}, "target": None, "target_pass": None}
        req = find_requests(sb, V0_SYSTEM) if temp == "cold" else None
        if req is not None:
            row["target"] = f"~1 request per 1,000 names ({req['names_per_request']:,.0f})"
            row["target_pass"] = req["pass"]
        rows.append(row)
    return rows


def _memory_row(sb: ScaleBench, key: str, label: str, per_system: dict, target: bool) -> dict:
    vals = {s: median_or_none(v) for s, v in per_system.items()}
    st = vals.get("storefs")
    rc = {s: v for s, v in vals.items() if s.startswith("rclone") and v is not None}
    return {"key": key, "label": label, "unit": "MiB", "walk": None, "values": vals, "over_walk": {},
            "runs": per_system, "vs_rclone": versus(st, rc, False, "MiB"),
            "target": f"≤{RSS_TARGET_MIB}" if target else None,
            "target_pass": (None if st is None else st <= RSS_TARGET_MIB) if target else None}


def rss_rows(sb: ScaleBench) -> list:
    """Daemon memory: VmRSS after find and after ls -lR (target), and the peak over all mounts."""
    systems = [s for s in sb.systems if s != V0_SYSTEM]
    rows = [_memory_row(sb, f"rss_{key}", f"daemon VmRSS after {name} (higher of cold, warm)",
                        {s: sb.rss_max.get(key, {}).get(s, []) for s in systems}, True)
            for key, name in (("find", "find"), ("lsR", "ls -lR"))]
    rows.append(_memory_row(sb, "hwm", "daemon peak RSS (VmHWM, highest of the phases' mounts)",
                            {s: list(sb.peak.get(s, {}).values()) for s in systems}, False))
    return rows


def memory_lines(sb: ScaleBench) -> list:
    """VmRSS after every pass and VmHWM per mount, median over runs, per phase and system."""
    out = []
    for phase in PHASES:
        cells = []
        for s in sb.systems:
            c = median_or_none(sb.rss.get(f"{phase.key}:cold", {}).get(s, []))
            w = median_or_none(sb.rss.get(f"{phase.key}:warm", {}).get(s, []))
            h = median_or_none(sb.hwm.get(phase.key, {}).get(s, []))
            if c is not None or w is not None:
                cells.append(f"{s} {fmt(c, 'MiB')} / {fmt(w, 'MiB')} / {fmt(h, 'MiB')}")
        if cells:
            out.append(f"  {phase.key}: " + "; ".join(cells))
    return out


def print_table(sb: ScaleBench, rows: list) -> None:
    """The --scale table: walk, each system's time and ratio to the walk, rclone, target."""
    cols = [s for s in sb.systems if s != V0_SYSTEM]
    hdr = (["measurement", "unit", "walk"] + cols + [f"{s}/walk" for s in cols]
           + ["storefs vs rclone", "rc?", "target (storefs)", "tgt?"])
    table = [hdr]
    for r in rows:
        have = r["values"].get("storefs") is not None
        table.append([r["label"], r["unit"] + " ↓", fmt(r["walk"], "s") if r["walk"] is not None else "-"]
                     + [_fmt_scale(r["values"].get(s), r["unit"]) for s in cols]
                     + ["-" if r["over_walk"].get(s) is None else f"{r['over_walk'][s]:.2f}×" for s in cols]
                     + [r["vs_rclone"]["text"], verdict(r["vs_rclone"]["pass"], have),
                        r["target"] or "-", verdict(r["target_pass"], have)])
    print_columns(table, set(range(2, 3 + 2 * len(cols))))


def _fmt_scale(v, unit: str) -> str:
    if v is None:
        return "-"
    return f"{v:.2f}" if unit == "s" else fmt(v, unit)


def request_lines(sb: ScaleBench) -> list:
    """Requests the server saw per phase and system (kinds as the server counts them), and
    names per list request against the walk's pages (target: about 1,000 per list request)."""
    lines = []
    for k, by_system in sb.requests.items():
        cells = []
        for s, snaps in by_system.items():
            kinds = sorted({kind for c in snaps for kind in c})
            med = {kind: median_or_none([c.get(kind, 0) for c in snaps]) for kind in kinds}
            cells.append(f"{s} " + (" ".join(f"{kind}={med[kind]:,.0f}" for kind in kinds) or "none"))
        lines.append(f"  {k}: " + "; ".join(cells))
    return lines


def find_requests(sb: ScaleBench, system: str) -> dict | None:
    """What the cold find of `system` asked the server (median over runs): list and metadata
    requests (scale_server.py counts GCS and v0 kinds apart), and names per request."""
    snaps = sb.requests.get("find:cold", {}).get(system, [])
    if not snaps:
        return None
    lists = median_or_none([c.get("list", 0) + c.get("v0list", 0) for c in snaps])
    metas = median_or_none([c.get("metadata", 0) + c.get("v0metadata", 0) for c in snaps])
    names = sb.count + sb.dir_count
    per = names / (lists + metas) if (lists + metas) else float("inf")
    walk_key = "v0" if system == V0_SYSTEM else "full"
    pages = median_or_none([w["pages"] for w in sb.walks.get(walk_key, [])])
    return {"lists": lists, "metadata": metas, "names": names, "names_per_request": per,
            "walk": walk_key, "walk_pages": pages, "pass": per >= NAMES_PER_LIST_TARGET}


def list_request_verdicts(sb: ScaleBench) -> list:
    """For the cold find of each system: names per request against the target of about
    one list request per 1,000 names (metadata requests count too: a walk needs none)."""
    out = []
    for system in sb.systems:
        r = find_requests(sb, system)
        if r is None:
            continue
        out.append(f"  {system}: {r['lists']:,.0f} list + {r['metadata']:,.0f} metadata requests for "
                   f"{r['names']:,} names = {r['names_per_request']:,.0f} names per request"
                   + (f" (walk({r['walk']}): {r['walk_pages']:,.0f} pages, no metadata)" if r["walk_pages"] else "")
                   + f"; target about 1,000 (≥{NAMES_PER_LIST_TARGET}): {'PASS' if r['pass'] else 'MISS'}")
    return out


def repeat_lines(sb: ScaleBench) -> list:
    """VmRSS after each of the repeated finds on one mount: steady, or GROWS past the slack."""
    out = []
    grow, slack = RSS_GROWTH_SLACK
    for system, runs in sb.repeat_rss.items():
        for i, rss in enumerate(runs):
            if not rss or any(x is None for x in rss):
                continue
            steady = rss[-1] <= rss[0] * grow + slack
            out.append(f"  {system} run {i + 1}: VmRSS after each find " + " → ".join(f"{x:.1f}" for x in rss)
                       + f" MiB: {'steady' if steady else 'GROWS'} (allowed: +{(grow - 1) * 100:.0f}% +{slack:.0f} MiB)")
    return out


def busy_lines(sb: ScaleBench) -> list:
    """How busy the whole machine was (all CPUs = 100%) during the cold find and ls -lR."""
    out = []
    for k in ("find:cold", "lsR:cold"):
        if k in sb.busy:
            out.append(f"machine CPU busy during {k.replace(':', ' ')} (all CPUs = 100): "
                       + ", ".join(f"{s} {median_or_none(v):.0f}%" for s, v in sb.busy[k].items()))
    return out


def server_lines(server_cost: dict) -> list:
    c = server_cost
    if not c:
        return []
    return [f"scale server (pid {c['pid']} and {c['processes'] - 1} more process(es)): VmRSS {c['rss']:.0f} MiB, "
            f"VmHWM {c['hwm']:.0f} MiB (summed over its processes), {c['cpu_s']:.0f} CPU-s in all, "
            f"started in {c['start_s']:.1f} s; expectations (names, sample) computed in {c['expect_s']:.1f} s"]


def print_report(sb: ScaleBench, runs: int, duration: float, noise: dict, rclone_reason: str | None,
                 server_cost: dict, opts: str) -> list:
    """Prints the --scale report; returns the table rows (for the JSON file)."""
    rows = table_rows(sb, rclone_reason) + rss_rows(sb)
    walks = ", ".join(f"{k} {median_or_none([w['seconds'] for w in v]):.2f} s "
                      f"({v[0]['objects']:,} objects, {v[0]['pages']:,} pages)" for k, v in sb.walks.items())
    print()
    print(f"storefs --scale benchmark: {sb.count:,} objects ({sb.shape.label}) in {sb.dir_count:,} directories, "
          f"median of {runs} run(s), scale_server.py on loopback, {os.cpu_count()} CPUs, {duration:.0f} s")
    print(f"storefs opts: {opts or '(defaults)'} (plus endpoint, anonymous, a fresh cache_dir); "
          f"rclone: its defaults (vfs-cache-mode off, --read-only)")
    print(f"walk = the floor: scale_server.walk(), the direct listing walk (delimited, sequential, one keep-alive "
          f"connection, JSON decoded, storefs's fields=): {walks or 'not measured'}")
    print("cold = fresh mount and cache dir, right after drop_caches; warm = the same mount, at once again")
    print(other_load_line(noise))
    print("↓ lower is better; X/walk = time ÷ the walk's; rc? = ahead of rclone; tgt? = the issue's target")
    loud = [e for e in sb.errors if "LOUD ERROR" in e]
    if loud:
        print()
        print("!" * 100)
        for e in loud:
            print(f"!!! COUNT CHECK FAILED: {e}")
        print("!" * 100)
    print()
    print_table(sb, rows)
    print()
    print("daemon VmRSS after the cold pass / after the warm pass / VmHWM at the end of that mount (MiB, median):")
    for line in memory_lines(sb):
        print(line)
    lines = repeat_lines(sb)
    if lines:
        print(f"VmRSS across {FIND_REPEATS} finds on one mount (drop_caches before each):")
        for line in lines:
            print(line)
    print("requests the server answered, by kind (median over runs):")
    for line in request_lines(sb):
        print(line)
    lines = list_request_verdicts(sb)
    if lines:
        print("list requests of the cold find (the ideal is the walk's pages: one per 1,000 names):")
        for line in lines:
            print(line)
    for line in busy_lines(sb) + server_lines(server_cost):
        print(line)
    return rows


def scale_json(ctx, sb: ScaleBench, runs: int, duration: float, noise: dict, systems: list, rows: list,
               server_cost: dict) -> dict:
    meta = common_meta(ctx, runs, duration, noise, systems)
    meta.update({"setting": "scale", "objects": sb.count, "directories": sb.dir_count,
                 "shape": vars(sb.shape), "api": sb.api, "stat_paths": STAT_PATHS, "stat_seed": STAT_SEED,
                 "server": server_cost})
    return {"meta": meta, "walks": sb.walks, "rows": rows, "rss": sb.rss, "hwm": sb.hwm,
            "repeat_rss": sb.repeat_rss, "requests": sb.requests, "busy_pct": sb.busy, "errors": sb.errors}


def print_manifest(sb: ScaleBench) -> None:
    """--manifest: the index build, its size, a mount reusing it, and the first byte of a file
    on a fresh mount (storefs lists the root first; storefs-manifest lists nothing)."""
    m = sb.manifest
    if "build_s" not in m:
        return
    per_million = m["index_bytes"] / max(1, m["objects"]) * 1e6
    print(f"\nmanifest of {m['objects']:,} objects: index built by the first mount in {m['build_s']:.1f} s, "
          f"{m['index_bytes'] / 1e6:,.0f} MB ({per_million / 1e6:.1f} MB per million objects); "
          f"a mount reusing it {m['remount_s']:.2f} s (VmRSS {fmt(m.get('remount_rss'), 'MiB')})")
    for system, v in m.get("first_byte", {}).items():
        print(f"  {system}: fresh mount after drop_caches {v['mount_s']:.2f} s, then the first byte of a file "
              f"in {v['first_byte_s'] * 1000:.0f} ms")
