"""`loadback bench l2`: how long a LOOKUP should wait for the daemon's L2 store, measured on
cross-daemon traffic. Daemons A and B share one real redis-server (`--adapter resp` or
`valkey`); each prefix is stored through A and, once redis holds it, matched and loaded
through B, whose own memory never had it. Three orchestrators on B take the same prefixes,
in an order rotated every round:

  break-even   the product's wait (`L2Wait`: up to the break-even point, the cap and
               `wait_slack` times the expected fetch), prefill at `PREFILL_TOKENS_PER_S`
  fixed-50ms   a fixed 50 ms LOOKUP deadline (`l2.max_wait_ms` 50)
  unlimited    a fixed 30 s deadline: every prefix the store holds is a hit

Per size and contender: hits, the LOOKUP's time (match), the time until the KV is in the
slots for hits (match + load_back), and the time until the KV is ready for every request, a
miss paying its LOOKUP plus recomputing the prefix at `PREFILL_TOKENS_PER_S` (modelled: this
bench has no engine). With the default prefetch policy B copies from L2 again at every
LOOKUP, so each contender pays its own fetch; a LOOKUP given up on goes on copying on the
daemon, so the next request starts only once it is released (untimed). The store-stall
detection is switched off (`l2.stall_after` 10**6): the wait alone is measured. Exit 1 when break-even hits fewer
prefixes than the fixed 50 ms deadline at some size, or the unlimited wait misses any (the
set-up is broken), else 0. Bounded: at most `BUDGET_S` of traffic after start-up.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass

from lmcache_loadback.connectors.telemetry import quiet_telemetry

quiet_telemetry()
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

import torch  # noqa: E402

from lmcache_loadback.connectors.kv_layout import KVLayout, KVPool  # noqa: E402
from lmcache_loadback.connectors.lmcache_mp import LMCacheMPConnector  # noqa: E402
from lmcache_loadback.orchestrator import LoadBackConfig, LoadBackOrchestrator  # noqa: E402
from lmcache_loadback.orchestrator import PrefixState  # noqa: E402
from lmcache_loadback.testing.daemon import DaemonProcess  # noqa: E402
from lmcache_loadback.testing.redis import RedisServer  # noqa: E402

from .common import fmt, median, print_table, shut_down, write_json  # noqa: E402

SIZES = (1024, 4096, 16384)
CHUNK = 256
#: 4 layers x 2 KV heads x 64 dims, bf16: 2 KiB a token, a 16k prefix 32 MiB (the L2 notes').
LAYOUT = KVLayout(num_layers=4, num_heads=2, head_dim=64, dtype=torch.bfloat16,
                  chunk_size=CHUNK)
DEFAULT_ROUNDS = 8
BUDGET_S = 240.0
#: The engine's recompute speed the break-even wait and the modelled misses assume.
PREFILL_TOKENS_PER_S = 10000.0
NO_STALL = {"stall_after": 10 ** 6}
CONTENDERS: dict[str, dict] = {
    "break-even": {"l2": NO_STALL, "break_even": {"prefill_tokens_per_s": PREFILL_TOKENS_PER_S}},
    "fixed-50ms": {"deadlines": {"lookup_ms": 50}, "l2": {"max_wait_ms": 50, **NO_STALL}},
    "unlimited": {"deadlines": {"lookup_ms": 30000}, "l2": {"max_wait_ms": 30000, **NO_STALL}},
}
BASE = "break-even"


@dataclass(frozen=True)
class Sample:
    """One request of one contender: `lookup_s` its match, `load_s` its load_back (None: a
    miss, the prefix recomputed)."""

    size: int
    contender: str
    lookup_s: float
    load_s: float | None
    why: str = ""  # a miss's degrade reason (match's, else load_back's)

    @property
    def hit(self) -> bool:
        return self.load_s is not None

    def ready_s(self, prefill_tokens_per_s: float) -> float:
        """Until the prefix's KV is in the slots: loaded, or recomputed after the LOOKUP."""
        return self.lookup_s + (self.load_s if self.hit else self.size / prefill_tokens_per_s)


def summarize(samples: list[Sample], prefill_tokens_per_s: float = PREFILL_TOKENS_PER_S
              ) -> list[dict]:
    """One row per (size, contender): hits, medians in ms, and ratios to break-even's."""
    rows = []
    for size in sorted({s.size for s in samples}):
        base = None
        for name in CONTENDERS:
            mine = [s for s in samples if s.size == size and s.contender == name]
            if not mine:
                continue
            hits = [s for s in mine if s.hit]
            why = [s.why or "miss" for s in mine if not s.hit]
            row = {"tokens": size, "contender": name, "requests": len(mine), "hits": len(hits),
                   "misses": {w: why.count(w) for w in sorted(set(why))},
                   "lookup_ms": 1e3 * median([s.lookup_s for s in mine]),
                   "loaded_ms": 1e3 * median([s.lookup_s + s.load_s for s in hits]),
                   "ready_ms": 1e3 * median([s.ready_s(prefill_tokens_per_s) for s in mine])}
            if name == BASE:
                base = row
            if base is not None:
                row["hits_vs_base"] = row["hits"] / base["hits"] if base["hits"] else float("nan")
                row["ready_vs_base"] = row["ready_ms"] / base["ready_ms"]
            rows.append(row)
    return rows


def verdicts(rows: list[dict]) -> dict[str, bool]:
    """Break-even hits at least what the fixed 50 ms deadline hits, at every size; the
    unlimited wait hits every prefix (else the set-up, not the policy, failed)."""
    out = {}
    for size in sorted({r["tokens"] for r in rows}):
        by = {r["contender"]: r for r in rows if r["tokens"] == size}
        if BASE in by and "fixed-50ms" in by:
            out[f"break_even_hits_ge_fixed_50ms_{size}"] = by[BASE]["hits"] >= by["fixed-50ms"]["hits"]
        if "unlimited" in by:
            out[f"unlimited_hits_all_{size}"] = by["unlimited"]["hits"] == by["unlimited"]["requests"]
    return out


def report(rows: list[dict], targets: dict[str, bool], *, adapter: str, rounds: int) -> None:
    print_table(
        ["tokens", "contender", "hits", "LOOKUP p50 ms", "loaded p50 ms",
         "KV ready p50 ms", "hits / break-even", "KV ready / break-even", "misses"],
        [[r["tokens"], r["contender"], f"{r['hits']}/{r['requests']}", fmt(r["lookup_ms"], 1),
          fmt(r["loaded_ms"], 1), fmt(r["ready_ms"], 1), fmt(r.get("hits_vs_base"), 2),
          fmt(r.get("ready_vs_base"), 2),
          " ".join(f"{w}:{k}" for w, k in r["misses"].items()) or "-"] for r in rows],
        title=f"loadback bench l2 ({adapter} adapter, {rounds} rounds; a miss recomputes at "
              f"{PREFILL_TOKENS_PER_S:g} tokens/s, modelled; medians)")
    for name, ok in targets.items():
        print(f"{'MET ' if ok else 'MISS'} {name}")


def _orchestrator(d: DaemonProcess, sections: dict, slots: int) -> LoadBackOrchestrator:
    cfg = LoadBackConfig.from_dict({"mp_port": d.port, "chunk_size": CHUNK, **sections})
    conn = LMCacheMPConnector(d.endpoint, LAYOUT, model_name=cfg.cache_model())
    return LoadBackOrchestrator(cfg, conn, kv_pool=_pool(slots))


def _pool(slots: int) -> KVPool:
    g = torch.Generator().manual_seed(slots)
    shape = (slots, LAYOUT.num_heads, LAYOUT.head_dim)
    return KVPool(*([torch.randn(shape, generator=g).to(LAYOUT.dtype)
                     for _ in range(LAYOUT.num_layers)] for _ in range(2)))


def _until(cond, bound_s: float, what: str) -> None:
    end = time.monotonic() + bound_s
    while not cond():
        if time.monotonic() > end:
            raise RuntimeError(f"bench l2: not within {bound_s} s: {what}")
        time.sleep(0.005)


def measure(rounds: int, adapter: str, budget_s: float = BUDGET_S) -> list[Sample]:
    """Start redis and daemons A and B, then `rounds` prefixes of each size, each stored
    through A and matched and loaded through B by every contender."""
    n_max = max(SIZES)
    redis = RedisServer(maxmemory="1gb").start()
    daemons = [DaemonProcess(chunk_size=CHUNK, l1_size_gb=1.0, l2_adapter=redis.l2_adapter(adapter),
                             shm_name=f"lbl2bench{name}{os.getpid()}") for name in "ab"]
    closers: list = []
    try:
        for d in daemons:
            d.start()
        a, b = daemons
        writer = _orchestrator(a, {"deadlines": {"store_ms": 30000}}, n_max)
        closers.append(writer.close)
        readers = {}
        for name, sections in CONTENDERS.items():
            readers[name] = _orchestrator(b, sections, 2 * n_max)
            closers.append(readers[name].close)
        for o in (writer, *readers.values()):
            if not o.wait_registered(30):
                raise RuntimeError(f"bench l2: {o.connector.endpoint} did not register")
        return _traffic(redis, writer, readers, rounds, time.monotonic() + budget_s)
    finally:
        shut_down(closers, daemons)
        redis.stop()


def _traffic(redis: RedisServer, writer: LoadBackOrchestrator,
             readers: dict[str, LoadBackOrchestrator], rounds: int, end: float) -> list[Sample]:
    samples: list[Sample] = []
    names = list(readers)
    g = torch.Generator().manual_seed(26)
    for size in SIZES:
        for r in range(rounds):
            if time.monotonic() > end:
                logging.getLogger("loadback").warning("bench l2: budget spent at %d tokens, "
                                                      "round %d", size, r)
                return samples
            toks = torch.randint(0, 50000, (size,), generator=g).tolist()
            before = redis.dbsize()
            sid = f"st{size}-{r}"
            if not writer.store(sid, toks, torch.arange(size)):
                raise RuntimeError(f"bench l2: STORE of {size} tokens through A failed")
            writer.finish(sid)
            _until(lambda: redis.dbsize() >= before + size // CHUNK, 30, "the prefix in redis")
            for name in names[r % len(names):] + names[:r % len(names)]:
                samples.append(_request(readers[name], name, toks, f"{name}-{size}-{r}"))
    return samples


def _request(orch: LoadBackOrchestrator, name: str, toks: list[int], rid: str) -> Sample:
    n = len(toks)
    t0 = time.perf_counter()
    found = orch.match(rid, toks)
    t1 = time.perf_counter()
    load_s, why = None, found.reason.value if found.reason else "miss"
    if found.tokens == n:
        loaded = orch.load_back(rid, torch.arange(n, 2 * n))
        if loaded.state == PrefixState.LOADED:
            load_s = time.perf_counter() - t1
        why = loaded.reason.value if loaded.reason else ""
    elif found.tokens:
        why = f"short_{found.tokens}"
    orch.finish(rid)
    # A LOOKUP given up on still copies from L2 on the daemon: the next contender's LOOKUP
    # of the same prefix must not share the store with it (its abandon is paid once done).
    _until(lambda: orch.pending_debts() == 0, 30, f"{name}'s releases paid")
    return Sample(n, name, t1 - t0, load_s, "" if load_s is not None else why)


def run(args) -> int:
    rounds = args.samples or DEFAULT_ROUNDS
    adapter = getattr(args, "adapter", None) or "resp"
    rows = summarize(measure(rounds, adapter))
    targets = verdicts(rows)
    report(rows, targets, adapter=adapter, rounds=rounds)
    if args.json:
        finite = [{k: None if isinstance(v, float) and not math.isfinite(v) else v
                   for k, v in r.items()} for r in rows]
        write_json(args.json, {"adapter": adapter, "rounds": rounds,
                               "prefill_tokens_per_s": PREFILL_TOKENS_PER_S, "rows": finite,
                               "targets_met": targets})
    return 0 if targets and all(targets.values()) else 1
