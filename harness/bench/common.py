"""Small helpers shared by the `loadback bench` suites, chaos and tune: statistics, tables, JSON.

Percentiles and medians are the standard library's `statistics` (linear interpolation between
closest ranks, numpy's default), with NaN for no samples so a report prints "-".
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from typing import Sequence

from tqdm import tqdm

#: Seconds between progress redraws when stderr is a log, not a terminal: a few lines per
#: long run instead of a frame per step.
LOG_MININTERVAL_S = 30.0


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if len(xs) else math.nan


def percentile(xs: Sequence[float], p: float) -> float:
    """The p-th percentile (p a whole number in [0, 100]); NaN for no samples."""
    if not 0 <= p <= 100 or p != int(p):
        raise ValueError(f"percentile {p!r}: expected a whole number from 0 to 100")
    if not len(xs):
        return math.nan
    if len(xs) == 1 or p in (0, 100):
        return float(min(xs) if p == 0 else max(xs))
    return statistics.quantiles(xs, n=100, method="inclusive")[int(p) - 1]


def progress_bar(total: int, desc: str = "", *, file=None) -> tqdm:
    """A tqdm bar on stderr; in a log (not a TTY) it redraws at most every LOG_MININTERVAL_S
    and once at the end, as plain ASCII."""
    file = sys.stderr if file is None else file
    tty = bool(getattr(file, "isatty", lambda: False)())
    return tqdm(total=total, desc=desc, file=file, leave=True, ascii=not tty,
                dynamic_ncols=tty, mininterval=0.1 if tty else LOG_MININTERVAL_S,
                maxinterval=LOG_MININTERVAL_S if not tty else 10.0)


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


def shut_down(closers: Sequence, daemons: Sequence) -> None:
    """Close what the bench opened, last first (best effort), then stop its daemons."""
    for close in reversed(closers):
        try:
            close()
        except Exception:  # noqa: BLE001 - best effort; the daemons stop next
            pass
    for d in daemons:
        d.stop()
