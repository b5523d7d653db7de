"""The comparison the run printed, drawn as a PNG with matplotlib (`--chart`, `--chart-from`).

It is drawn from the document `--json` writes (report.loopback_json, scale_report.scale_json),
so a chart made right after a run and one redrawn later from its JSON file are the same. Each
row of the table is a group of horizontal bars, one per system that has a value there: the
baselines (curl-1, curl-N; the walk with --scale), the floor, storefs, rclone. Rows go into one
panel per unit (MiB/s: higher is better; µs, ms, s, MiB: lower is better), on a log scale when
the panel's values span more than LOG_SPAN times. The title names the setting, the date, the
git commit and the number of runs the medians are of.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import textwrap

from .host import log
from .report import fmt
from .scale import V0_SYSTEM

LOG_SPAN = 20          # a panel whose largest value is more than this × its smallest gets a log axis
FIG_WIDTH_IN = 11.0
BAR_IN = 0.2           # height of one bar, inches
GROUP_GAP = 0.7        # space between two rows' groups, in bars
PANEL_IN = 0.9         # a panel's title, axis labels and spacing, inches
HEADER_IN = 1.1        # the figure's title and legend, inches
LABEL_WIDTH = 34       # characters per line of a row's label
DPI = 110

COLORS = {
    "curl-1": "#bdbdbd", "curl-8": "#757575", "curl-16": "#757575", "walk": "#757575",
    "floor": "#a1887f", "storefs": "#1565c0", V0_SYSTEM: "#64b5f6",
    "rclone-off": "#ef6c00", "rclone-full": "#c62828", "rclone": "#ef6c00",
    "baseline": "#757575",
}
OTHER_COLOR = "#9575cd"  # a system not named above
KINDS = {"MiB/s": "throughput", "µs": "latency", "ms": "time", "s": "time", "MiB": "memory",
         "files/s": "throughput", "requests": "count", "connections": "count"}
LEGEND = {
    "curl-1": "curl-1 (one GET)", "curl-8": "curl-8 (8 ranged GETs)", "curl-16": "curl-16 (16 ranged GETs)",
    "walk": "walk (direct listing: the floor)", "floor": "floor (floorfs.c)",
    V0_SYSTEM: "storefs-v0 (protocol=firebase)",
    "baseline": "baseline (workload rows: 16 connections, curl-N, the disk)",
}


def pyplot():
    """matplotlib's pyplot on the Agg backend: files only, no display. Imported here, not at
    the top, so that bench/run without --chart does not need matplotlib."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def png_path(path: str) -> str:
    """argparse type of --chart: checked before the run starts, so a long run never ends
    without its chart for want of matplotlib or of the directory."""
    if not path.endswith(".png"):
        raise argparse.ArgumentTypeError(f"{path}: the chart is a PNG; name it FILE.png")
    if not os.path.isdir(os.path.dirname(path) or "."):
        raise argparse.ArgumentTypeError(f"{path}: no such directory")
    try:
        pyplot()
    except ImportError as exc:
        raise argparse.ArgumentTypeError(f"needs matplotlib ({exc}): python3 -m pip install matplotlib")
    return path


# --------------------------------------------------------------------------- what is drawn
def _loopback_bars(row: dict) -> list:
    """(system, value) of a loopback/--link row: the curl columns first, then the mounts."""
    vals = row["values"]
    order = sorted(vals, key=lambda s: not (s.startswith("curl-") or s == "baseline"))
    return [(s, vals[s]) for s in order if vals[s] is not None]


def _scale_bars(row: dict) -> list:
    """(system, value) of a --scale row: the walk, then the systems of the printed table;
    the v0 rows hold storefs-v0's value in the storefs column."""
    if row["key"].startswith("v0 "):
        bars = [("walk", row["walk"]), (V0_SYSTEM, row["values"].get("storefs"))]
    else:
        bars = [("walk", row["walk"])] + [(s, v) for s, v in row["values"].items() if s != V0_SYSTEM]
    return [(s, v) for s, v in bars if v is not None]


def panels(doc: dict) -> list:
    """[(unit, higher_is_better, [(row label, bars)])]: one panel per unit and direction, rows
    in the table's order; rows without any value are left out."""
    scale = doc["meta"].get("setting") == "scale"
    out: dict = {}
    for row in doc["rows"]:
        bars = _scale_bars(row) if scale else _loopback_bars(row)
        if bars:
            out.setdefault((row["unit"], row.get("better") == "higher"), []).append((row["label"], bars))
    return [(unit, higher, rows) for (unit, higher), rows in out.items()]


def title(meta: dict) -> str:
    """The setting, then the date, the commit and how many runs each bar is the median of."""
    if meta.get("setting") == "scale":
        setting = f"--scale: {meta['objects']:,} objects in {meta['directories']:,} directories"
    elif "link" in meta:
        setting = f"--link {meta['link']['profile']}: {meta['object_mib']} MiB object through the modelled link"
    else:
        setting = f"loopback: {meta['object_mib']} MiB object, {meta['tree_files']:,} small files"
    runs = meta["runs"]
    line = (f"{meta['date'][:10]} · commit {meta['git_head'][:10] or 'unknown'} · "
            + ("1 run" if runs == 1 else f"median of {runs} runs") + f" · {meta['cpus']} CPUs")
    if meta.get("storefs_opts"):
        line += f" · storefs -o {meta['storefs_opts']}"
    return f"storefs benchmark, {setting}\n{line}"


# --------------------------------------------------------------------------- drawing
def _value_text(v: float, unit: str) -> str:
    """A bar's label: the table's format, but seconds with two decimals (as --scale prints them)."""
    if unit == "s":
        return f"{v:.2f}" if v < 100 else f"{v:.0f}"
    return fmt(v, unit)


def _span_is_wide(values: list) -> bool:
    """Whether a panel needs a log axis: all values positive, the largest over LOG_SPAN × the smallest."""
    return min(values) > 0 and max(values) > LOG_SPAN * min(values)


def _draw_panel(ax, unit: str, higher: bool, rows: list) -> None:
    """One panel: a group of bars per row, each bar labelled with its value."""
    ticks, labels, values = [], [], []
    y = 0.0
    for label, bars in rows:
        for i, (system, v) in enumerate(bars):
            bar = ax.barh(y + i, v, height=0.85, color=COLORS.get(system, OTHER_COLOR))
            ax.bar_label(bar, labels=[_value_text(v, unit)], padding=3, fontsize=8)
            values.append(v)
        ticks.append(y + (len(bars) - 1) / 2)
        labels.append(textwrap.fill(label, LABEL_WIDTH))
        y += len(bars) + GROUP_GAP
    ax.set_yticks(ticks, labels, fontsize=9)
    ax.set_ylim(y - GROUP_GAP + 0.3, -0.7)  # first row on top
    log_axis = _span_is_wide(values)
    if log_axis:
        ax.set_xscale("log")
        ax.set_xlim(10 ** math.floor(math.log10(min(values))), max(values) * 4)
    else:
        ax.set_xlim(0, max(values) * 1.15)  # room for the value labels
    ax.set_xlabel(unit)
    ax.set_title(f"{KINDS.get(unit, unit)}, {unit}: {'higher' if higher else 'lower'} is better"
                 + (" (log scale)" if log_axis else ""), loc="left", fontsize=10, fontweight="bold")
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)


def _legend(fig, groups: list, heading: str) -> None:
    """One legend for all panels, under the chart's title (its heading): every system drawn,
    in the order they first appear."""
    from matplotlib.patches import Patch
    systems = list(dict.fromkeys(s for _, _, rows in groups for _, bars in rows for s, _ in bars))
    handles = [Patch(color=COLORS.get(s, OTHER_COLOR), label=LEGEND.get(s, s)) for s in systems]
    lines = math.ceil(len(handles) / 4)  # at most 4 entries a line, the lines evenly filled
    fig.legend(handles=handles, loc="outside upper center", ncols=math.ceil(len(handles) / lines), fontsize=9,
               frameon=False, title=heading, title_fontsize=11)


def draw(doc: dict, path: str) -> None:
    """The chart of one run's document (as --json writes it), saved as a PNG to `path`."""
    groups = panels(doc)
    if not groups:
        raise ValueError("no row has a value: nothing to draw")
    plt = pyplot()
    heights = [sum(len(bars) + GROUP_GAP for _, bars in rows) * BAR_IN + PANEL_IN for _, _, rows in groups]
    size = (FIG_WIDTH_IN, HEADER_IN + sum(heights))
    fig, axes = plt.subplots(len(groups), 1, figsize=size, layout="constrained", squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    for ax, (unit, higher, rows) in zip(axes[:, 0], groups):
        _draw_panel(ax, unit, higher, rows)
    _legend(fig, groups, title(doc["meta"]))
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    print(f"chart written to {path}")


def draw_from(json_path: str, path: str) -> int:
    """--chart-from: the chart of a JSON file an earlier `bench/run --json` wrote; runs nothing."""
    try:
        with open(json_path) as f:
            doc = json.load(f)
        draw(doc, path)
    except (OSError, ValueError, KeyError) as exc:
        log(f"FATAL: cannot draw {json_path}: {type(exc).__name__}: {exc}")
        return 2
    return 0
