"""Tensor-parallel tests: run one function per rank in spawned processes (gloo needs a
process per rank) and collect what each rank reported, bounded in time."""

from __future__ import annotations

import torch.multiprocessing as mp


def run_ranks(target, *args, world: int = 2, timeout_s: float = 240.0) -> list[dict]:
    """Call `target(rank, *args, out)` in `world` processes; each puts `(rank, dict)` on
    `out` (with an "error" key holding its traceback if it failed). Returns the dicts by
    rank; any rank's error fails the caller's test with every rank's traceback."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, *args, out)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        results = dict(out.get(timeout=timeout_s) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    errors = [results[r]["error"] for r in range(world) if "error" in results[r]]
    assert not errors, "\n".join(errors)
    return [results[r] for r in range(world)]
