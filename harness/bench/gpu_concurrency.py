"""`loadback bench gpu --concurrency`'s figures (CPU-side: no device needed): N requests with
distinct prefixes of S tokens arrive together and load into one CUDA KV pool through one
daemon; per contender the makespan, p50/p99 ready time, aggregate GB/s, and the bound: the
N x S bytes at the speed of N concurrent pinned copies (their measured makespan).

Not yet wired to the CLI or run on a device: the contenders (ours through the SGLang
backend's path, LMCache's own SGLang MP path, N concurrent pinned copies) are still to come.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

from .common import percentile

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
