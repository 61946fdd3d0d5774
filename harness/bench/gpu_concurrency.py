"""`loadback bench gpu --concurrency`'s figures and verdict (no device needed): N requests with
distinct prefixes of S tokens arrive together and load into one KV pool through one daemon;
per contender the makespan, p50/p99 ready time, aggregate GB/s, and the bound: the N x S
bytes at the speed of N concurrent pinned copies (their measured makespan, same run). The
contenders are in `gpu_concurrency_steps`, the run in `gpu_concurrency_run`.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Sequence

from .common import fmt, median, percentile, print_table

#: Requests arriving together, and prefix lengths (tokens).
GRID_N = (1, 4, 8, 16)
GRID_S = (1024, 4096, 16384)


def distinct_prefixes(n: int, tokens: int, chunk: int, seed: int = 0) -> list[list[int]]:
    """n prompts of `tokens` token ids that share no chunk: each one's first chunk differs
    from every other's (so no request hits another's chunks through the prefix hash)."""
    if tokens < chunk or tokens % chunk:
        raise ValueError(f"{tokens} tokens is not a whole number of chunks of {chunk}")
    rng = random.Random(seed)
    out, firsts = [], set()
    while len(out) < n:
        p = [rng.randrange(1, 32000) for _ in range(tokens)]
        if tuple(p[:chunk]) not in firsts:
            firsts.add(tuple(p[:chunk]))
            out.append(p)
    return out


@dataclass(frozen=True)
class Concurrent:
    """One contender's N requests, started together at `start_s`; `ready_s[i]`: when request
    i's bytes were in the pool (its ready event completed), same clock."""

    start_s: float
    ready_s: Sequence[float]
    bytes_each: int

    def figures(self, copy_makespan_s: float | None = None) -> dict:
        """makespan_ms (start to the last ready), p50/p99_ready_ms, gbps (all bytes over the
        makespan); with the makespan of N concurrent pinned copies of the same bytes, the
        bound_ms and bound_ratio (bound over makespan: 1.0 is the copy limit)."""
        if not self.ready_s or any(r < self.start_s for r in self.ready_s):
            raise ValueError("every request needs a ready time at or after the start")
        waits = [(r - self.start_s) * 1e3 for r in self.ready_s]
        makespan = max(waits)
        total = self.bytes_each * len(waits)
        out = {"n": len(waits), "makespan_ms": makespan, "p50_ready_ms": percentile(waits, 50),
               "p99_ready_ms": percentile(waits, 99),
               "gbps": total / (makespan / 1e3) / 1e9 if makespan > 0 else None}
        if copy_makespan_s is not None:
            out["bound_ms"] = copy_makespan_s * 1e3
            out["bound_ratio"] = copy_makespan_s * 1e3 / makespan if makespan > 0 else None
        return out


#: Our contender, the bound (N concurrent copies) and LMCache's (page 256: its best case;
#: its daemon's workers as shipped, 1, and tuned).
OURS, COPIES = "ours", "copies"
#: Ours with several LOOKUP worker threads (`sglang.lookup_threads`), side by side with ours.
PIPELINED, PIPELINED_THREADS = "ours-pipelined", 4
LMCACHE = ("lmcache-p256", "lmcache-p256-tuned")
#: Judged cells (H200 targets of issue 25): N 8 and 16 at S 4k and 16k, CUDA only.
JUDGED_N, JUDGED_S = (8, 16), (4096, 16384)
#: bound_ratio: the copies' makespan over ours (1.0 = the link's limit); vs_lmcache: the
#: faster LMCache setting's makespan over ours; p99_vs_lmcache: its p99 ready time over ours'
#: (>= 1.0: ours' p99 is no later). Each the worst over the judged cells.
TARGETS = {"conc_bound_ratio": 0.9, "conc_vs_lmcache": 1.2, "conc_p99_vs_lmcache": 1.0}


def cell_row(n: int, tokens: int, steps: dict[str, list[Concurrent]], extra: dict) -> dict:
    """One (N, S) cell: per contender the medians over its timed steps of makespan, p50 and
    p99 ready time and GB/s; the bound (the copies' median makespan) and each contender's
    bound ratio; ours against the faster LMCache setting. `extra`: added per contender
    (e.g. matched_ms, when the last match was answered)."""
    bound = median([c.figures()["makespan_ms"] for c in steps.get(COPIES, [])]) \
        if steps.get(COPIES) else None
    row = {"n": n, "tokens": tokens, "contenders": {}}
    for name, runs in steps.items():
        figs = [c.figures() for c in runs]
        m = {k: median([f[k] for f in figs]) for k in ("makespan_ms", "p50_ready_ms",
                                                       "p99_ready_ms")}
        m["gbps"] = n * runs[0].bytes_each / (m["makespan_ms"] / 1e3) / 1e9 \
            if m["makespan_ms"] > 0 else None
        m["repeats"] = len(runs)
        m["makespan_samples_ms"] = [round(f["makespan_ms"], 3) for f in figs]
        if bound is not None and m["makespan_ms"] > 0:
            m["bound_ratio"] = bound / m["makespan_ms"]
        m.update(extra.get(name, {}))
        row["contenders"][name] = m
    row["bound_ms"] = bound
    lmc = [row["contenders"][k] for k in LMCACHE if k in row["contenders"]]
    ours = row["contenders"].get(OURS)
    piped = row["contenders"].get(PIPELINED)
    if ours and piped:  # > 1: the pipelined matches answer sooner / the step ends sooner
        if ours.get("matched_ms") and piped.get("matched_ms"):
            row["pipelined_match_ratio"] = ours["matched_ms"] / piped["matched_ms"]
        row["pipelined_makespan_ratio"] = ours["makespan_ms"] / piped["makespan_ms"]
    if lmc and ours:
        best = min(lmc, key=lambda m: m["makespan_ms"])
        row["vs_lmcache"] = best["makespan_ms"] / ours["makespan_ms"]
        row["p99_vs_lmcache"] = min(m["p99_ready_ms"] for m in lmc) / ours["p99_ready_ms"]
    if lmc and bound:  # the most any client reaches: one at the link's limit (the copies)
        row["lmcache_vs_bound"] = min(m["makespan_ms"] for m in lmc) / bound
    return row


def daemon_rounds(lmcache: bool, all_fit: bool) -> list[tuple[str, ...]]:
    """Which LMCache contenders' daemons run beside ours, round by round: both in one round,
    or, when the host cannot hold three daemons' L1 at once (16 x 16k on the H200 host), one
    a round, ours and the bound timed again in each round beside it."""
    if not lmcache:
        return [()]
    return [tuple(LMCACHE)] if all_fit else [(k,) for k in LMCACHE]


def merge_rounds(per_round: list[list[dict]]) -> list[dict]:
    """One row per cell out of rounds run one LMCache daemon at a time: the first round's row
    (ours, ours-pipelined, the bound, its LMCache contender) with each later round's LMCache
    contender added; the ratios against LMCache the worst over the rounds, each round's
    LMCache over ours of the same round (side by side, as in one round); misses of every
    round counted; each round's own row kept under `rounds`."""
    if len(per_round) == 1:
        return per_round[0]
    out = []
    for cells in zip(*per_round):
        row = {**cells[0], "contenders": dict(cells[0]["contenders"]),
               "missed": dict(cells[0].get("missed", {}))}
        for i, later in enumerate(cells[1:], start=2):
            for k in LMCACHE:
                if k in later["contenders"] and k not in row["contenders"]:
                    row["contenders"][k] = later["contenders"][k]
            for key in ("vs_lmcache", "p99_vs_lmcache", "lmcache_vs_bound"):
                vals = [c[key] for c in (row, later) if c.get(key) is not None]
                if vals:
                    row[key] = min(vals)
            for k, m in later.get("missed", {}).items():
                row["missed"][f"{k} (round {i})"] = m
        row["rounds"] = [dict(c) for c in cells]
        out.append(row)
    return out


def call_figures(step_calls: list[dict[str, list[float]]]) -> dict:
    """Per op over the timed steps: the median call in ms, and calls per step (median)."""
    ops = sorted({op for st in step_calls for op in st})
    return {op: {"median_ms": median([x for st in step_calls for x in st.get(op, [])]) * 1e3,
                 "per_step": median([len(st.get(op, [])) for st in step_calls])}
            for op in ops}


def judged(rows, cuda: bool) -> dict:
    """The targets' figures: the worst over the judged cells that ran (None: none ran, or a
    CPU device: not judged)."""
    cells = [r for r in rows if cuda and r["n"] in JUDGED_N and r["tokens"] in JUDGED_S]

    def worst(get):
        vals = [get(r) for r in cells]
        return None if not vals or any(v is None for v in vals) else min(vals)

    return {"conc_bound_ratio": worst(lambda r: r["contenders"].get(OURS, {}).get(
                "bound_ratio")),
            "conc_vs_lmcache": worst(lambda r: r.get("vs_lmcache")),
            "conc_p99_vs_lmcache": worst(lambda r: r.get("p99_vs_lmcache")),
            "conc_vs_lmcache_ceiling": worst(lambda r: r.get("lmcache_vs_bound")),
            "judged_cells": [[r["n"], r["tokens"]] for r in cells]}


def targets_met(figures: dict) -> dict[str, bool]:
    """Each target met or not; with no judged cell no target is judged (none listed)."""
    if not figures.get("judged_cells"):
        return {}
    return {k: figures[k] is not None and figures[k] >= v for k, v in TARGETS.items()}


def size_label(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


def print_report(rows, notes: dict[str, str], device: str, layout_line: str) -> None:
    """The table: one line per cell and contender, then ours over the bound and LMCache."""
    print(f"\nloadback bench gpu --concurrency: {device}, {layout_line}; N requests with "
          "distinct prefixes of S tokens in one step, one daemon per contender; medians over "
          "the repeats; ready = when a request's bytes were in the pool, from the step's "
          "first call; bound = N concurrent copies of the same bytes")
    for k, v in notes.items():
        print(f"  {k}: {v}")
    heads = ["N", "S", "contender", "makespan ms", "p50 ready ms", "p99 ready ms", "GB/s",
             "bound/this", "matched ms"]
    body = []
    for r in rows:
        for k, m in r["contenders"].items():
            body.append([r["n"], size_label(r["tokens"]), k, fmt(m["makespan_ms"]),
                         fmt(m["p50_ready_ms"]), fmt(m["p99_ready_ms"]),
                         fmt(m["gbps"], 1), fmt(m.get("bound_ratio"), 3),
                         fmt(m.get("matched_ms"))])
    print_table(heads, body)
    ratios = [[r["n"], size_label(r["tokens"]), fmt(r["contenders"].get(OURS, {}).get(
        "bound_ratio"), 3), fmt(r.get("vs_lmcache"), 3), fmt(r.get("p99_vs_lmcache"), 3),
        fmt(r.get("lmcache_vs_bound"), 3), fmt(r.get("pipelined_match_ratio"), 3),
        fmt(r.get("pipelined_makespan_ratio"), 3)] for r in rows]
    print()
    print_table(["N", "S", "bound / ours", "LMCache / ours (makespan)",
                 "LMCache / ours (p99 ready)", "LMCache / bound (makespan)",
                 "ours / pipelined (matched)", "ours / pipelined (makespan)"], ratios)


def print_verdict(figures: dict, met: dict, cuda: bool) -> None:
    print()
    if not met:
        print("targets not judged: " + ("no cell of N 8/16 x S 4k/16k ran" if cuda
                                        else "a CPU device (targets are the H200's)"))
    for k, target in TARGETS.items():
        v = figures.get(k)
        state = ("MET" if met[k] else "NOT MET") if k in met else "not judged"
        shown = fmt(v, 3) if v is not None and math.isfinite(v) else "-"
        print(f"{k:<20} = {shown:>7}   target >= {target}   {state}")
    ceiling = figures.get("conc_vs_lmcache_ceiling")
    if ceiling is not None and ceiling < TARGETS["conc_vs_lmcache"]:
        print(f"conc_vs_lmcache is out of reach on this card: in its worst judged cell LMCache's "
              f"makespan is {fmt(ceiling, 3)} x the bound's, so a client at the link's limit "
              f"would reach {fmt(ceiling, 3)}")
