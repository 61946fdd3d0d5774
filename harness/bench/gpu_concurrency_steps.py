"""`loadback bench gpu --concurrency`'s contenders: one scheduling step of N requests whose
prefixes the daemon holds, each driven the way its engine integration drives them, and N
concurrent copies of the same bytes (the bound). Each `step` answers a `Concurrent`: when the
step started and when each request's bytes were in the pool.

- `OursStep`: the product's SGLang 0.5.23 backend path (engines/sglang/prefetch.py and
  radix_cache.py): `prefetch_from_storage` hands each request's match to the core's
  `AsyncLookups` (LOOKUP + prefetch wait + prepare_retrieve at match, on its worker thread),
  `check_prefetch_progress` polls `answer` on every scheduler pass, and a request whose
  answer is in is admitted in that pass: `init_load_back` -> `orchestrator.load_back`, which
  queues the copy and returns its ready event; commits are paid behind the copy.
- `LMCacheStep`: LMCache 0.5.6's SGLang MP connector (`multi_process_adapter`) as SGLang
  0.5.20's LMCRadixCache drives it: `match_prefix` -> `lookup_kv` for each request of the
  step, then `init_load_back` -> `retrieve_kv` for each, which returns once the daemon's
  copy into the engine's pages has completed (its event synchronized).
- `CopiesStep`: N host-to-device copies of S tokens' bytes on N streams from one pinned
  buffer (plain copies on a CPU device): the link's limit for N x S bytes.
"""

from __future__ import annotations

import copy
import itertools
import time
from dataclasses import dataclass

import torch

from lmcache_loadback.connectors.kv_layout import KVLayout, KVPool
from lmcache_loadback.connectors.lmcache_mp import LMCacheMPConnector
from lmcache_loadback.orchestrator.config import LoadBackConfig
from lmcache_loadback.orchestrator.core import LoadBackOrchestrator
from lmcache_loadback.orchestrator.lookups import AsyncLookups

from .gpu_concurrency import Concurrent
from .gpu_contenders import MODEL, T, landed, lmcache_connector, poison

#: A scheduler pass while requests wait for their LOOKUP: SGLang's event loop spins when it
#: has nothing to run, so the pass interval here is small against any load.
PASS_S = 0.0002
#: Request ids unique within the run (daemon sessions).
step_ids = itertools.count(1)
#: The bench's config on a CPU device: deadlines of two busy cores are no measure of a GPU
#: host's, and a request that misses its deadline would leave the step without its load.
CPU_DEADLINES = {"lookup_ms": 5000, "retrieve_base_ms": 5000, "retrieve_per_ki_token_ms": 500,
                 "retrieve_max_ms": 60000}


class Missed(RuntimeError):
    """A step in which some request's match or load came back short: it would recompute."""


@dataclass(frozen=True)
class Workload:
    """The prompts (n_max of s_max tokens, no chunk shared) and their bytes: `src`, a pool
    of s_max slots that holds one prompt's bytes at a time (`fill`), each prompt's drawn
    from a seed of its own, so the source costs one prompt's device memory, not the grid's
    (at 16 x 16k that is 2 GiB instead of 32)."""

    prompts: list
    src: KVPool

    def fill(self, i: int) -> torch.Tensor:
        """Write prompt i's bytes into `src` (the same bytes every time); its slots there."""
        g = torch.Generator(device=self.src.k_buffer[0].device).manual_seed(1000 + i)
        for b in [*self.src.k_buffer, *self.src.v_buffer]:
            b.copy_(torch.randn(b.shape, generator=g, device=b.device))
        return torch.arange(self.src.k_buffer[0].shape[0], device=self.src.k_buffer[0].device)

    def check(self, who: str, dst: KVPool, dst_slots, n: int, tokens: int) -> None:
        """Each of the n requests' bytes in `dst_slots[i]` equal its stored prefix."""
        for i in range(n):
            src_slots = self.fill(i)
            if not landed(self.src, src_slots[:tokens], dst, dst_slots[i][:tokens]):
                raise AssertionError(f"{who}: request {i} of {n} landed other bytes than its "
                                     f"stored prefix at {tokens} tokens")


class ReadyClock:
    """When each request's bytes were in the pool, seconds after the step's start. On CUDA
    as the GPU saw it: a timing event recorded at the start on an idle stream, and per
    request one on a stream of its own that first waits for the load's ready event (or runs
    after its copy); elsewhere the host's clock when the load returned (the bytes are there
    then)."""

    def __init__(self, dev: torch.device, n_max: int) -> None:
        self.dev = dev
        self.cuda = dev.type == "cuda"
        if self.cuda:
            self.base = torch.cuda.Stream(dev)
            self.streams = [torch.cuda.Stream(dev) for _ in range(n_max)]
        self.t0 = 0.0
        self.marks: dict[int, object] = {}

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.dev)
            self.ev0 = torch.cuda.Event(enable_timing=True)
            self.ev0.record(self.base)
        self.marks = {}
        self.t0 = time.perf_counter()

    def landed(self, i: int, ready=None) -> None:
        """Request i's load returned; `ready`: the event its copy completes (None: done)."""
        if self.cuda:
            s = self.streams[i]
            if ready is not None:
                s.wait_event(ready)
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(s)
            self.marks[i] = ev
        else:
            self.marks[i] = time.perf_counter()

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.t0

    def concurrent(self, n: int, bytes_each: int) -> Concurrent:
        if self.cuda:
            torch.cuda.synchronize(self.dev)
            ready = [self.ev0.elapsed_time(self.marks[i]) / 1e3 for i in range(n)]
        else:
            ready = [self.marks[i] - self.t0 for i in range(n)]
        return Concurrent(start_s=0.0, ready_s=ready, bytes_each=bytes_each)


class CallTimes:
    """Each daemon call the connector's daemon answered between `begin` and `end`, by op:
    seconds from its send to its answer, as the connector tells them (`on_call`, which also
    feeds loadback_daemon_call_duration_seconds; the orchestrator's metric still counts)."""

    def __init__(self, conn) -> None:
        self.on, self.s = False, {}
        counted = conn.on_call

        def told(op: str, seconds: float) -> None:
            if self.on:
                self.s.setdefault(op, []).append(seconds)
            if counted is not None:
                counted(op, seconds)
        conn.on_call = told

    def begin(self) -> None:
        self.s, self.on = {}, True

    def end(self) -> dict[str, list[float]]:
        self.on = False
        return self.s


class OursStep:
    """The product through its SGLang 0.5.23 backend's calls (module docstring)."""

    note = ("the SGLang 0.5.23 backend's calls: match (LOOKUP + prepare_retrieve) on "
            "AsyncLookups, load_back copies from the daemon's shared memory")

    def __init__(self, endpoint: str, layout: KVLayout, dst: KVPool, dev: torch.device,
                 clock: ReadyClock, work: Workload, slots) -> None:
        """Loads request i into `slots[i]` of `dst` (random slots, as a radix cache hands
        them out)."""
        extra = {} if dev.type == "cuda" else {"deadlines": CPU_DEADLINES}
        self.config = LoadBackConfig.from_dict({"chunk_size": layout.chunk_size,
                                                "model_name": MODEL, **extra})
        self.conn = LMCacheMPConnector(endpoint, layout, model_name=MODEL, device=dev)
        self.orch = LoadBackOrchestrator(self.config, self.conn, kv_pool=dst)
        self.lookups = AsyncLookups(self.orch, threads=self.config.sglang.lookup_threads)
        self.owner = True  # closes the orchestrator (a sibling shares it)
        self.layout, self.dst, self.clock = layout, dst, clock
        self.work, self.slots = work, slots
        if not self.orch.wait_registered(T):
            raise RuntimeError(f"ours: not registered with the daemon at {endpoint}")
        if self.conn.transfer != "shm":
            raise RuntimeError(f"ours: the daemon offers {self.conn.transfer}, not shm")
        #: Per step: seconds after the start when the last request's match was answered.
        self.matched_s: list[float] = []
        #: Per finished step: its daemon calls' seconds from send to answer, by op (where a
        #: match's time goes on the device: the LOOKUP, its status polls, the prepare).
        self.step_calls: list[dict[str, list[float]]] = []
        self.calls = CallTimes(self.conn)  # shared with a sibling: steps run one at a time

    def sibling(self, threads: int) -> "OursStep":
        """The same engine (connector, orchestrator, slots) with `threads` LOOKUP worker
        threads (`sglang.lookup_threads`): its steps run side by side with this one's."""
        twin = copy.copy(self)
        twin.lookups = AsyncLookups(self.orch, threads=threads)
        twin.matched_s, twin.owner, twin.step_calls = [], False, []
        twin.note = f"the same, sglang.lookup_threads {threads}: {threads} matches at once"
        return twin

    def store(self) -> None:
        w = self.work
        for i, toks in enumerate(w.prompts):
            rid = f"conc-store-{i}-{next(step_ids)}"
            if not self.conn.store_from(toks, rid, w.src, w.fill(i), timeout_s=T):
                raise RuntimeError(f"ours: the daemon refused to store prompt {i}")
            self.conn.end_session(rid, T)

    def step(self, n: int, tokens: int) -> Concurrent:
        """One scheduling step of the first n prompts, `tokens` tokens each. A request whose
        match answered less (a deadline, a daemon error: in a server it recomputes) is not
        loaded; the step then raises `Missed` once the others landed and were released."""
        c, cfg, prompts, slots = self.clock, self.config, self.work.prompts, self.slots
        rids = [f"conc-{n}x{tokens}-{i}-{next(step_ids)}" for i in range(n)]
        self.calls.begin()
        c.start()
        budget = cfg.deadlines.match_s(tokens, prepare=cfg.prepare_at_match) + 0.05
        jobs = {i: self.lookups.submit(rids[i], prompts[i][:tokens], 0, "",
                                       time.monotonic() + budget) for i in range(n)}
        matched, missed = 0.0, []
        try:
            while jobs:  # scheduler passes: admit each request whose answer came in
                answered = []
                for i, job in list(jobs.items()):
                    got = self.lookups.answer(job)
                    if got is not None:
                        del jobs[i]
                        answered.append((i, got))
                for i, got in answered:
                    if got != tokens:
                        missed.append((i, got))
                        continue
                    matched = c.elapsed_s()
                    r = self.orch.load_back(rids[i], slots[i][:tokens])
                    if r.loaded_tokens != tokens:
                        missed.append((i, r.loaded_tokens))
                        continue
                    c.landed(i, r.ready)
                if jobs:
                    time.sleep(PASS_S)
            out = None if missed else c.concurrent(n, tokens * self.layout.bytes_per_token)
        finally:
            for job in jobs.values():
                self.lookups.abandon(job)
            for rid in rids:
                self.orch.finish(rid)
        try:
            self._settle()
        finally:
            self.step_calls.append(self.calls.end())
        if missed:
            i, got = missed[0]
            raise Missed(f"{len(missed)} of {n} requests got less than {tokens} tokens "
                         f"(request {i}: {got}); counted so far: {self._why_not()}")
        self.matched_s.append(matched)
        return out

    def warm(self, tokens: int, tries: int = 10) -> tuple[int, str]:
        """One request's step until it loads whole, at most `tries` (a daemon's first calls
        set up what later ones reuse, as a server's first request would pay it): (tries
        taken, why the first missed, or "")."""
        first = ""
        for k in range(1, tries + 1):
            try:
                self.step(1, tokens)
                self.matched_s.pop()
                return k, first
            except Missed as exc:
                first = first or str(exc)
        raise RuntimeError(f"ours: no whole load in {tries} warm-up steps: {first}")

    def _why_not(self) -> str:
        """What the orchestrator counted so far: LOOKUPs by result, prefixes degraded by
        reason (a miss on the device says why without another run)."""
        snap = self.orch.metrics.snapshot()
        return ", ".join(f"{k} {v:g}" for k, v in sorted(snap.items())
                         if v and k.startswith("loadback_") and "_total" in k)

    def _settle(self, wait_s: float = 30.0) -> None:
        """The step's commits and session ends paid before the next step prepares the same
        ranges again (an outstanding range is not prepared twice)."""
        deadline = time.monotonic() + wait_s
        while self.orch.pending_debts() and time.monotonic() < deadline:
            time.sleep(0.001)
        if self.orch.pending_debts():
            raise RuntimeError(f"ours: {self.orch.pending_debts()} releases unpaid after "
                               f"{wait_s:.0f} s")

    def prove(self, n: int, tokens: int) -> Concurrent:
        for s in self.slots[:n]:
            poison(self.dst, s[:tokens])
        out = self.step(n, tokens)
        self.work.check("ours", self.dst, self.slots, n, tokens)
        return out

    def close(self) -> None:
        self.lookups.close()
        if self.owner:
            self.orch.close()


class LMCacheStep:
    """LMCache's SGLang MP connector as SGLang 0.5.20's LMCRadixCache drives it (module
    docstring); whole pages of `page` slots."""

    def __init__(self, host: str, port: int, layout: KVLayout, dst: KVPool, page: int,
                 instance: int, clock: ReadyClock, work: Workload, pages, note: str,
                 timeout_s: float = T) -> None:
        """Stores and loads request i through `pages[i]`: whole pages of `dst`, never page 0
        (LMCache's null block)."""
        from lmcache.integration.sglang.sglang_adapter import LoadMetadata, StoreMetadata
        self.LoadMetadata, self.StoreMetadata = LoadMetadata, StoreMetadata
        self.conn = lmcache_connector(host, port, dst, page, instance, timeout_s)
        self.layout, self.dst, self.clock = layout, dst, clock
        self.work, self.pages = work, pages
        self.note = note
        self.matched_s: list[float] = []

    def store(self) -> None:
        """Each prompt stored its own way from its own pages, holding the source's bytes."""
        w, pages = self.work, self.pages
        for i, toks in enumerate(w.prompts):
            src_slots = w.fill(i)
            for a, d in zip([*w.src.k_buffer, *w.src.v_buffer], [*self.dst.k_buffer,
                                                                  *self.dst.v_buffer]):
                d[pages[i]] = a[src_slots]
            self.conn.store_kv(self.StoreMetadata(
                last_node=None, token_ids=list(toks), kv_indices=pages[i], offset=0,
                request_id=f"lmc-store-{i}-{next(step_ids)}"))

    def step(self, n: int, tokens: int) -> Concurrent:
        c, prompts, pages = self.clock, self.work.prompts, self.pages
        rids = [f"lmc-{n}x{tokens}-{i}-{next(step_ids)}" for i in range(n)]
        c.start()
        try:
            for i in range(n):  # match_prefix of every request of the step
                hit = self.conn.lookup_kv(list(prompts[i][:tokens]), rids[i])
                if hit != tokens:
                    raise RuntimeError(f"lmcache: request {i} hit {hit} of {tokens} tokens")
            self.matched_s.append(c.elapsed_s())
            for i in range(n):  # init_load_back of each: returns once its copy completed
                got = self.conn.retrieve_kv(self.LoadMetadata(
                    token_ids=list(prompts[i][:tokens]), slot_mapping=pages[i][:tokens],
                    offset=0, request_id=rids[i]))
                if got != tokens:
                    raise RuntimeError(f"lmcache: request {i} retrieved {got} of {tokens}")
                c.landed(i)
            return c.concurrent(n, tokens * self.layout.bytes_per_token)
        finally:
            for rid in rids:
                self.conn.end_session(rid)

    def prove(self, n: int, tokens: int) -> Concurrent:
        for p in self.pages[:n]:
            poison(self.dst, p[:tokens])
        out = self.step(n, tokens)
        self.work.check("lmcache", self.dst, self.pages, n, tokens)
        return out

    def close(self) -> None:
        self.conn.close()


class CopiesStep:
    """N concurrent copies of S tokens' bytes (module docstring)."""

    def __init__(self, layout: KVLayout, n_max: int, s_max: int, dev: torch.device,
                 clock: ReadyClock) -> None:
        bpt = layout.bytes_per_token
        pin = dev.type == "cuda"
        self.src = torch.empty(s_max * bpt, dtype=torch.uint8, pin_memory=pin)
        # random bytes, one token's worth repeated (fast to fill)
        self.src.view(-1, bpt)[:] = torch.randint(0, 255, (bpt,), dtype=torch.uint8)
        self.dst = torch.empty(n_max, s_max * bpt, dtype=torch.uint8, device=dev)
        self.layout, self.clock = layout, clock
        self.note = ("pinned host-to-device copy_, one stream each" if pin
                     else "plain copy_ (CPU device: no pinned memory)")

    def step(self, n: int, tokens: int) -> Concurrent:
        nb, c = tokens * self.layout.bytes_per_token, self.clock
        c.start()
        for i in range(n):
            if c.cuda:
                with torch.cuda.stream(c.streams[i]):
                    self.dst[i, :nb].copy_(self.src[:nb], non_blocking=True)
            else:
                self.dst[i, :nb].copy_(self.src[:nb])
            c.landed(i)
        return c.concurrent(n, nb)

    def prove(self, n: int, tokens: int) -> Concurrent:
        nb = tokens * self.layout.bytes_per_token
        self.dst[:n, :nb].fill_(7)
        out = self.step(n, tokens)
        for i in range(n):
            if not torch.equal(self.dst[i, :nb].cpu(), self.src[:nb]):
                raise AssertionError(f"copies: copy {i} of {n} differs at {tokens} tokens")
        return out

    def close(self) -> None:
        pass
