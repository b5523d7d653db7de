"""The two statistics every table uses: nearest-rank percentiles of samples, medians of runs."""

from __future__ import annotations

import math
import statistics


def percentile(values: list, p: float):
    """Nearest-rank percentile (bench/README.md: "Latency rows use the nearest-rank percentile")."""
    s = sorted(values)
    if not s:
        return None
    k = max(1, math.ceil(p / 100.0 * len(s)))
    return s[k - 1]


def median_or_none(values: list):
    """Median of the runs that produced a value; None when none did (the cell shows `-`)."""
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None
