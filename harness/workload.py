"""A realistic request mix driven through the orchestrator like an SGLang scheduler would, for
`loadback chaos run` and `loadback demo`: a KV pool laid out like SGLang's, a slot allocator
whose every slot must come back, and "prefill" that writes KV derived from the token prefix,
so every loaded token can be compared with what a recompute would have produced.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field

import torch

from lmcache_loadback.connectors.kv_layout import KVLayout, KVPool

from lmcache_loadback.orchestrator.core import LoadBackOrchestrator
from lmcache_loadback.orchestrator.states import PrefixState
from lmcache_loadback.testing.os_delay import OsDelay


class SlotAllocator:
    """Free-list of KV slots; `outstanding` must be 0 when the engine is idle."""

    def __init__(self, size: int) -> None:
        self.free = list(range(size - 1, -1, -1))
        self.size = size

    def alloc(self, n: int) -> torch.Tensor | None:
        if n > len(self.free):
            return None
        out = [self.free.pop() for _ in range(n)]
        return torch.tensor(out, dtype=torch.int64)

    def release(self, slots: torch.Tensor) -> None:
        self.free.extend(int(s) for s in slots.tolist())

    @property
    def outstanding(self) -> int:
        return self.size - len(self.free)


def prefix_kv(layout: KVLayout, token_ids: list[int], start: int, end: int) -> torch.Tensor:
    """KV of positions [start, end) as a function of the whole prefix up to each position:
    `[2, layers, end-start, heads, head_dim]`. Same prefix, same bytes; any other, other."""
    h, seeds = 1469598103934665603, []
    for i, t in enumerate(token_ids[:end]):
        h = (h * 1099511628211 ^ (t + 1)) & 0xFFFFFFFFFFFF
        if i >= start:
            seeds.append(h)
    s = torch.tensor(seeds, dtype=torch.int64).view(1, 1, -1, 1, 1)
    lay = torch.arange(2 * layout.num_layers, dtype=torch.int64).view(2, layout.num_layers, 1, 1, 1)
    head = torch.arange(layout.num_heads, dtype=torch.int64).view(1, 1, 1, -1, 1)
    dim = torch.arange(layout.head_dim, dtype=torch.int64).view(1, 1, 1, 1, -1)
    v = (s * 31 + lay * 1009 + head * 97 + dim * 13) % 65521
    return (v.to(torch.float32) / 65521.0 - 0.5).to(layout.dtype)


def write_kv(pool: KVPool, layout: KVLayout, kv: torch.Tensor, slots: torch.Tensor) -> None:
    for layer in range(layout.num_layers):
        pool.k_buffer[layer][slots] = kv[0, layer]
        pool.v_buffer[layer][slots] = kv[1, layer]


def read_kv(pool: KVPool, layout: KVLayout, slots: torch.Tensor) -> torch.Tensor:
    k = torch.stack([pool.k_buffer[layer][slots] for layer in range(layout.num_layers)])
    v = torch.stack([pool.v_buffer[layer][slots] for layer in range(layout.num_layers)])
    return torch.stack([k, v])


@dataclass
class Tally:
    """What the engine saw, to reconcile with the metrics and to judge the run."""

    requests: int = 0
    hung: int = 0
    wrong_bytes: int = 0
    loaded: int = 0
    degraded: dict[str, int] = field(default_factory=dict)
    promised_tokens: int = 0
    loaded_tokens: int = 0
    recomputed_tokens: int = 0
    return_times: list[float] = field(default_factory=list)
    load_times: list[float] = field(default_factory=list)
    #: The most any match/load_back ran past its deadline, seconds (negative: the least headroom).
    worst_overshoot_s: float = -math.inf
    #: Where the worst call's time went (see `Engine._timed`): ms on this thread's CPU, waiting
    #: for a CPU (the OS run queue; also the other threads'), the fault proxy's CPU, stolen by
    #: the host, in garbage collection (any thread), blocked (sleeping: socket poll, GIL,
    #: locks), and the CPU other threads of this process used meanwhile.
    worst_overshoot_detail: dict = field(default_factory=dict)
    #: The same for the call judged the most late: past its deadline less what was excused.
    worst_judged_s: float = -math.inf
    worst_judged_detail: dict = field(default_factory=dict)
    first_hit_after: dict[str, float] = field(default_factory=dict)
    #: Loads whose KV this engine never sent to the daemon itself: another engine stored it.
    loaded_from_others: int = 0
    #: What the deadline judgement excused (`OsDelay.excused`), summed over every call and
    #: the most for one call, seconds.
    excused_s: float = 0.0
    worst_excused_s: float = 0.0


class Workload:
    """Shared system prompts, multi-turn continuations and one-off prompts.

    `stream`: engines of one deployment share the system prompts of `seed` but each draws its
    own conversations and one-off prompts (stream 0 is the single-engine sequence)."""

    def __init__(self, layout: KVLayout, seed: int, *, system_prompts: int = 4,
                 system_tokens: tuple[int, int] = (256, 768), turn_tokens: tuple[int, int] = (32, 192),
                 stream: int = 0) -> None:
        self.layout = layout
        self.rng = random.Random(seed)
        self.turn_tokens = turn_tokens
        self.systems = [self._tokens(self.rng.randint(*system_tokens)) for _ in range(system_prompts)]
        if stream:
            self.rng = random.Random(f"{seed}:{stream}")
        self.conversations: list[list[int]] = []

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(1, 50000) for _ in range(n)]

    def next_prompt(self) -> tuple[list[int], int]:
        """(token ids, tokens the engine's local radix cache already holds)."""
        r = self.rng.random()
        if r < 0.3 and self.conversations:
            conv = self.rng.choice(self.conversations)
            conv.extend(self._tokens(self.rng.randint(*self.turn_tokens)))
            prompt = list(conv)
        elif r < 0.85:
            prompt = self.rng.choice(self.systems) + self._tokens(self.rng.randint(*self.turn_tokens))
            if len(self.conversations) < 64:
                self.conversations.append(list(prompt))
        else:
            prompt = self._tokens(self.rng.randint(64, 512))
        # Sometimes the engine still has part of it (page-aligned, not chunk-aligned).
        local = 0
        if self.rng.random() < 0.2:
            local = self.rng.randrange(0, len(prompt) // 2 + 1) // 8 * 8
        return prompt, local


def chunk_digests(token_ids: list[int], chunk: int) -> list[int]:
    """A digest of each whole-chunk prefix `token_ids[:k * chunk]`, k = 1, 2, ...: what the
    daemon keys a stored chunk by, so equal digests mean the same cached KV."""
    h, out = 1469598103934665603, []
    for i, t in enumerate(token_ids[:len(token_ids) // chunk * chunk], 1):
        h = (h * 1099511628211 ^ (t + 1)) & 0xFFFFFFFFFFFFFFFF
        if i % chunk == 0:
            out.append(h)
    return out


class Engine:
    """Drives one request at a time through match -> load_back -> prefill -> store -> finish.

    `name`: engines sharing a daemon name their requests `{name}-req-{n}` (the daemon keys
    lookups and sessions by request id, as production engines name requests uniquely); the
    default, no name, gives `req-{n}`."""

    def __init__(self, orch: LoadBackOrchestrator, pool: KVPool, layout: KVLayout,
                 slots: SlotAllocator, *, deadline_slack_s: float = 0.005,
                 abort_ratio: float = 0.05, seed: int = 0, name: str = "",
                 os_delay=OsDelay, excuse_cap_s: float = 0.25) -> None:
        self.orch, self.pool, self.layout, self.slots = orch, pool, layout, slots
        self.slack = deadline_slack_s
        self.excuse_cap_s = excuse_cap_s  # the most the machine may excuse of one call
        self.os_delay = os_delay  # what measures the machine's share of a call (tests swap it)
        self.rng = random.Random(seed ^ 0x5EED)
        self.abort_ratio = abort_ratio
        self.name = name
        self.tally = Tally()
        self.n = 0
        #: chunk_digests of every prefix this engine asked the daemon to store.
        self.stored: set[int] = set()

    def _timed(self, op: str, deadline_s: float, fn, *args, **kwargs):
        """Call `fn` and judge its return time against `deadline_s`: hung when it ran past
        it by more than the slack plus what the machine took from this call's thread
        (`OsDelay`: its wait for a CPU, the host's steal, this process's garbage collection,
        the fault proxy's CPU where it runs in this process), that allowance capped at
        `excuse_cap_s`. A call that waited (on the daemon, a lock, another thread) past its
        deadline is hung. Keeps where the worst call's time went, and what was excused."""
        t = self.tally
        proc0 = time.process_time()
        with self.os_delay() as d:
            result = fn(*args, **kwargs)
        took, proc1 = d.took_s, time.process_time()
        t.return_times.append(took)
        over = took - deadline_s
        allowance = d.excused(self.excuse_cap_s)
        late = over - allowance  # judged: hung past the slack
        excused = min(max(over - self.slack, 0.0), allowance)  # what the verdict needed
        t.excused_s += excused
        t.worst_excused_s = max(t.worst_excused_s, excused)
        if late > self.slack:
            t.hung += 1
        if over > t.worst_overshoot_s or late > t.worst_judged_s:
            own_ms, wait_ms = d.cpu_s * 1e3, d.run_queue_s * 1e3
            detail = {
                "op": op, "took_ms": took * 1e3, "deadline_ms": deadline_s * 1e3,
                "own_cpu_ms": own_ms, "run_queue_wait_ms": wait_ms,
                "others_run_queue_ms": d.others_run_queue_s * 1e3,
                "foreign_cpu_ms": d.foreign_cpu_s * 1e3,
                "steal_ms": d.steal_s * 1e3, "gc_ms": d.gc_s * 1e3,
                "excused_ms": excused * 1e3,
                "blocked_ms": max(0.0, took * 1e3 - own_ms - wait_ms),
                "other_threads_cpu_ms": max(0.0, (proc1 - proc0) * 1e3 - own_ms)}
            if over > t.worst_overshoot_s:
                t.worst_overshoot_s, t.worst_overshoot_detail = over, detail
            if late > t.worst_judged_s:
                t.worst_judged_s, t.worst_judged_detail = late, detail
        return result, took

    def request(self, prompt: list[int], local: int, *, phase: str = "") -> None:
        orch, t = self.orch, self.tally
        self.n += 1
        rid = f"{self.name}-req-{self.n}" if self.name else f"req-{self.n}"
        t.requests += 1
        held: list[torch.Tensor] = []
        try:
            local_slots = self.slots.alloc(local) if local else torch.empty(0, dtype=torch.int64)
            if local_slots is None:
                local, local_slots = 0, torch.empty(0, dtype=torch.int64)
            held.append(local_slots)
            if local:
                write_kv(self.pool, self.layout, prefix_kv(self.layout, prompt, 0, local), local_slots)
            m, _ = self._timed("match", self._match_deadline_s(len(prompt), local),
                               orch.match, rid, prompt, local_hit_tokens=local)
            n = m.tokens
            loaded = 0
            got = None
            if n:
                loaded, got = self._load(rid, prompt, local, n, phase, held)
            elif m.state == PrefixState.DEGRADED:
                reason = m.reason.value
                t.degraded[reason] = t.degraded.get(reason, 0) + 1
            # Recompute whatever did not load, into fresh slots (the engine's prefill).
            start = local + loaded
            rest = self.slots.alloc(len(prompt) - start)
            if rest is not None:  # slots of a failed load go back to the pool unread
                held.append(rest)
                write_kv(self.pool, self.layout, prefix_kv(self.layout, prompt, start, len(prompt)), rest)
            if self.rng.random() < self.abort_ratio:
                orch.abort(rid)
                return
            if rest is not None and (loaded == 0 or got is not None):
                parts = [local_slots] + ([got] if loaded else []) + [rest]
                all_slots = torch.cat(parts)
                if len(all_slots) == len(prompt):
                    self.stored.update(chunk_digests(prompt, self.layout.chunk_size))
                    orch.store(rid, prompt, all_slots)
            orch.finish(rid)
        finally:
            for s in held:
                self.slots.release(s)

    def _match_deadline_s(self, num_tokens: int, local: int) -> float:
        """match's bound: the LOOKUP's deadline (its wait for an L2 store included:
        `lookup_wait_s`); on shared memory with prepare_at_match, plus the retrieve deadline
        of what it may prepare (match takes that round trip)."""
        cfg = self.orch.config
        return cfg.deadlines.match_s(num_tokens - local, prepare=cfg.prepare_at_match
                                     and self.orch.connector.transfer == "shm",
                                     lookup_s=self.orch.lookup_wait_s(num_tokens, local))

    def _load(self, rid: str, prompt: list[int], local: int, n: int, phase: str,
              held: list[torch.Tensor]) -> tuple[int, torch.Tensor | None]:
        """load_back of the `n` promised tokens into fresh slots (appended to `held`), the
        bytes checked against a recompute; (tokens loaded, the slots or None)."""
        orch, t = self.orch, self.tally
        loaded = 0
        got = self.slots.alloc(n)
        if got is not None:
            held.append(got)
        res, took = self._timed("load_back", orch.config.deadlines.retrieve_s(n),
                                orch.load_back, rid, got)
        t.load_times.append(took)
        t.promised_tokens += n
        if res.state == PrefixState.LOADED:
            loaded = res.loaded_tokens
            t.loaded += 1
            t.loaded_tokens += loaded
            want = prefix_kv(self.layout, prompt, local, local + n)
            if not torch.equal(read_kv(self.pool, self.layout, got), want):
                t.wrong_bytes += 1
            whole = chunk_digests(prompt[:local + n], self.layout.chunk_size)
            if whole and whole[-1] not in self.stored:
                t.loaded_from_others += 1
            if phase:
                t.first_hit_after.setdefault(phase, time.monotonic())
        else:
            reason = res.reason.value if res.reason else "unknown"
            t.degraded[reason] = t.degraded.get(reason, 0) + 1
            t.recomputed_tokens += n
        return loaded, got
