"""The scheduler side (vLLM's EngineCore process): LOOKUPs off the scheduler thread, promises,
what each step ships to the worker, releases (docs/vllm.md, "Scheduler side").
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import msgspec

from lmcache_loadback.metrics import start_metrics_server
from lmcache_loadback.orchestrator.factory import create_orchestrator
from lmcache_loadback.orchestrator.lookups import AsyncLookups, Lookup

from .meta import LoadBackMeta, LoadOp, StoreOp
from .settings import Settings

log = logging.getLogger("loadback.vllm")

#: LOOKUPs waiting for the worker thread at most (the one it runs besides); past it a request
#: recomputes (a skipped LOOKUP) rather than queueing behind a daemon that does not answer
MAX_QUEUED_LOOKUPS = 256


@dataclass(eq=False)
class Ask:
    """One request's LOOKUP against one local hit, under an attempt-numbered session
    (`{rid}#ask{n}`); answered by the core's `AsyncLookups` or by its deadline (a miss)."""

    lookup: Lookup
    end: int                  # the prompt tokens the LOOKUP covers (never the whole prompt)
    asked_at: float = 0.0     # the orchestrator's clock when it was queued (its lease's age)
    used: bool = False        # its load was allocated
    released: bool = False    # its LOOKUP's locks and session were given back or handed off

    @property
    def session(self) -> str:
        return self.lookup.request_id

    @property
    def local(self) -> int:
        return self.lookup.local_tokens

    @property
    def tokens(self) -> int:
        """Tokens to load beyond `local` once answered in time (0: recompute, not answered,
        or answered late)."""
        return 0 if self.lookup.abandoned else self.lookup.tokens

    @property
    def done(self) -> bool:
        return self.lookup.done.is_set()


@dataclass(eq=False)
class Track:
    """A running request's prompt chunks to store once they are all computed."""

    token_ids: list[int]
    blocks: list[int]
    salt: str = ""
    stored: bool = False
    stores: int = 0           # stores shipped (each under its own session)


def salt_of(request) -> str | None:
    """The request's cache salt, or None when its KV is not a function of its token ids
    alone (a LoRA adapter, multimodal inputs, prompt embeddings): never looked up or stored."""
    if (request.prompt_token_ids is None or getattr(request, "lora_request", None) is not None
            or getattr(request, "mm_features", None)):
        return None
    return getattr(request, "cache_salt", None) or ""


class SchedulerSide:
    def __init__(self, settings: Settings, *, orchestrator=None) -> None:
        self.settings = settings
        self.chunk = settings.chunk_size
        self.block_size = settings.block_size
        cfg = settings.config
        tp = settings.tp_size
        # The worker ranks serve the YAML's metrics (rank r on metrics.port + r): every load
        # and store is counted there. This process's series are served only on request
        # (loadback.scheduler_metrics_port): its prefixes end `unused` once their load is
        # handed to the worker, which a degraded-ratio alert must not read as failures.
        # This process holds no KV: it never prepares a retrieve at match. Its LOOKUP is
        # the request's only one: the worker ranks load under its session (handoff.py).
        cfg = msgspec.structs.replace(cfg, prepare_at_match=False, metrics=msgspec.structs.replace(
            cfg.metrics, enabled=False))
        # One LOOKUP per request for every TP rank (worker_id None, world size tp): it
        # read-locks each rank's shard of the hit chunks.
        self.orch = orchestrator or create_orchestrator(cfg, layout=settings.layout,
                                                        kv_pool=None, kv_rank=0, world_size=tp,
                                                        engine_model=settings.model)
        # Every LOOKUP's locks stay whole here until its release or its hand-off: the worker
        # ranks free what they do not load, so the session's last call is theirs (handoff.py).
        self.orch.handoff.hands_off = True
        if orchestrator is None and settings.scheduler_metrics_port is not None:
            server = start_metrics_server(cfg.metrics.host, settings.scheduler_metrics_port,
                                          registry=self.orch.metrics)
            self.orch.on_close(server.close)
        self._asks: dict[str, Ask] = {}
        self._attempts: dict[str, int] = {}
        self._salts: dict[str, str | None] = {}           # rid -> cache salt, None: not served
        self._failed: set[str] = set()
        self._loads: dict[str, LoadOp] = {}               # to ship with the next step
        self._load_blocks: dict[str, set[int]] = {}       # rid -> blocks of its load
        self._tracks: dict[str, Track] = {}
        self._step = 0
        self._closed = False
        # A miss's session ends on the LOOKUP thread at once: only hits are released here.
        self.lookups = AsyncLookups(self.orch, max_queued=MAX_QUEUED_LOOKUPS + 1,
                                    name="loadback-vllm-lookup", end_misses=True)

    # ------------------------------------------------------------ vLLM calls

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        rid = request.request_id
        toks = request.prompt_token_ids
        if rid not in self._salts:
            self._salts[rid] = salt_of(request)
        salt = self._salts[rid]
        if salt is None or rid in self._failed or self._closed:
            return 0, False
        # never the whole prompt (one token is left to compute), never more than staging
        limit = min(len(toks) - 1, num_computed_tokens + self.settings.staging_tokens)
        end = limit // self.chunk * self.chunk
        ask = self._asks.get(rid)
        if ask is not None and (ask.local != num_computed_tokens or ask.used or ask.end != end
                                or self._aged(ask)):
            self._drop(rid)
            ask = None
        if end <= num_computed_tokens:
            return 0, False
        if ask is None:
            ask = self._submit(rid, list(toks[:end]), num_computed_tokens, end, salt)
        return self.lookups.answer(ask.lookup), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        rid = request.request_id
        ask = self._asks.get(rid)
        # vLLM may take fewer tokens than offered: whole chunks of them are still served
        promised = (ask is not None and ask.done and not ask.used
                    and num_external_tokens <= ask.tokens
                    and (ask.local + num_external_tokens) % self.chunk == 0)
        if not promised:
            log.warning("%s: vLLM allocated %d external tokens this connector did not "
                        "promise; they are reported as load errors", rid, num_external_tokens)
        local = 0 if ask is None else ask.local
        if promised:
            ask.used = True
        end = local + num_external_tokens
        hit = local + ask.tokens if promised else end  # the worker frees [end, hit) (hand-off)
        ids = list(blocks.get_block_ids()[0])
        bs = self.block_size
        self._loads[rid] = LoadOp(session=ask.session if ask is not None else f"{rid}#none",
                                  token_ids=list(request.prompt_token_ids[:hit]), start=local,
                                  end=end, block_ids=ids[local // bs:-(-end // bs)],
                                  cache_salt=self._salts.get(rid) or "", promised=promised)

    def build_connector_meta(self, scheduler_output) -> LoadBackMeta:
        self._step += 1
        for rid in scheduler_output.preempted_req_ids or ():
            # its blocks are gone (vLLM reuses their ids: another request's load error there
            # is not this one's); it asks again (a new LOOKUP) when it is scheduled again
            self._drop(rid)
            self._loads.pop(rid, None)
            self._load_blocks.pop(rid, None)
        meta = LoadBackMeta(loads=self._loads)
        self._loads = {}
        for rid, op in meta.loads.items():
            self._load_blocks[rid] = set(op.block_ids)
            if op.promised:
                op.promised = self._hand_off(rid, op)
        self._collect_stores(scheduler_output, meta)
        return meta

    def update_connector_output(self, connector_output) -> None:
        bad = connector_output.invalid_block_ids
        if not bad:
            return
        for rid, blocks in list(self._load_blocks.items()):
            if blocks & bad:
                del self._load_blocks[rid]
                self._failed.add(rid)
                log.info("%s: load failed, recomputed; no further hit is promised to it", rid)
                tr = self._tracks.get(rid)
                if tr is not None:
                    tr.stored = False  # the worker skipped its store: ship it again later

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._drop(rid)
        self._loads.pop(rid, None)
        self._load_blocks.pop(rid, None)
        self._tracks.pop(rid, None)
        self._failed.discard(rid)
        self._attempts.pop(rid, None)
        self._salts.pop(rid, None)
        return False, None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for rid in list(self._asks):
            self._drop(rid)
        self.lookups.close(timeout_s=5)
        self.orch.close()

    # ------------------------------------------------------------- plumbing

    def _submit(self, rid: str, token_ids: list[int], local: int, end: int, salt: str) -> Ask:
        attempt = self._attempts.get(rid, 0) + 1
        self._attempts[rid] = attempt
        budget = self.orch.lookup_wait_s(len(token_ids), local)
        asked_at = self.orch.clock()
        lookup = self.lookups.submit(f"{rid}#ask{attempt}", token_ids, local, salt,
                                     time.monotonic() + budget)
        # A skipped LOOKUP is a miss that took nothing on the daemon.
        ask = self._asks[rid] = Ask(lookup, end, asked_at, released=lookup.skipped)
        return ask

    def _aged(self, ask: Ask) -> bool:
        """A hit not loaded yet whose LOOKUP is older than lease_max_age_ms: never served
        (the daemon's read TTL may end its locks before the load, or before the worker's
        frees); the request asks again, and the old prefix ends lease_expired, its locks
        forfeited. Before its hand-off only: a handed-off load runs in that step."""
        return (ask.tokens > 0 and not ask.used and not ask.released
                and self.orch.clock() - ask.asked_at > self.orch.config.lease_max_age_ms / 1000)

    def _drop(self, rid: str) -> None:
        """Forget the request's ask; release what its LOOKUP holds (here, or by the worker
        thread if it is still running)."""
        ask = self._asks.pop(rid, None)
        if ask is not None and self.lookups.abandon(ask.lookup) and ask.tokens > 0:
            self._release(rid, ask)

    def _hand_off(self, rid: str, op: LoadOp) -> bool:
        """The shipped load's worker ranks load under this LOOKUP's session and release
        everything it still locks (`op.locked`) and the session: nothing of it is released
        or sent from here any more. False: the LOOKUP is not held here (its locks released,
        or a release of it still owed from here), so the load cannot be served."""
        ask = self._asks.get(rid)
        op.locked = (None if ask is None or ask.released
                     else self.orch.handoff.hand_off(ask.session, op.end))
        if op.locked is None:
            log.info("%s: the LOOKUP behind this load is no longer held; load error, "
                     "recomputed", rid)
            return False
        ask.released = True
        return True

    def _release(self, rid: str, ask: Ask) -> None:
        if ask.tokens > 0 and not ask.released:
            ask.released = True
            self.orch.finish(ask.session)

    def _collect_stores(self, so, meta: LoadBackMeta) -> None:
        """Ship a store for each request whose prompt's whole chunks are computed by the end
        of this step (at most `staging_tokens`), once per request."""
        sched = so.num_scheduled_tokens
        cap = self.settings.staging_tokens
        for new in so.scheduled_new_reqs:
            toks = new.prompt_token_ids
            salt = self._salts.get(new.req_id)
            end = min(len(toks) // self.chunk * self.chunk, cap) if toks is not None else 0
            if end == 0 or salt is None:
                continue
            tr = self._tracks.get(new.req_id)
            if tr is None:
                tr = self._tracks[new.req_id] = Track(list(toks[:end]), [], salt)
            tr.blocks = list(new.block_ids[0])
            if not tr.stored:
                self._maybe_store(new.req_id, tr, new.num_computed_tokens + sched.get(new.req_id, 0),
                              meta)
        cached = so.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", set()) or set()
        for i, rid in enumerate(cached.req_ids):
            tr = self._tracks.get(rid)
            if tr is None:
                continue
            nb = cached.new_block_ids[i]
            if rid in resumed:
                tr.blocks = list(nb[0]) if nb is not None else []
            elif nb is not None:
                tr.blocks.extend(nb[0])
            if not tr.stored:
                self._maybe_store(rid, tr, cached.num_computed_tokens[i] + sched.get(rid, 0),
                                  meta)

    def _maybe_store(self, rid: str, tr: Track, computed: int, meta: LoadBackMeta) -> None:
        n = len(tr.token_ids)
        nb = n // self.block_size
        if computed < n or len(tr.blocks) < nb:
            return
        tr.stored = True
        tr.stores += 1
        meta.stores[rid] = StoreOp(f"{rid}#store{tr.stores}", tr.token_ids, tr.blocks[:nb],
                                   tr.salt)
