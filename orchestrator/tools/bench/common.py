"""Small helpers shared by the `loadback bench` suites: statistics, tables, JSON."""

from __future__ import annotations

import json
import math
from typing import Sequence


def median(xs: Sequence[float]) -> float:
    return percentile(xs, 50.0)


def percentile(xs: Sequence[float], p: float) -> float:
    """Linear-interpolated percentile (p in [0, 100]); NaN for no samples."""
    s = sorted(xs)
    if not s:
        return math.nan
    pos = (len(s) - 1) * min(max(p, 0.0), 100.0) / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def fmt(x: float, digits: int = 2) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:.{digits}f}"


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]], title: str = "") -> None:
    """Left-align the first column, right-align the rest."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    if title:
        print(title)
    for n, r in enumerate(cells):
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                        for i, (c, w) in enumerate(zip(r, widths))))
        if n == 0:
            print("  ".join("-" * w for w in widths))


def write_json(path: str, obj: object) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=False, allow_nan=False)
        f.write("\n")
