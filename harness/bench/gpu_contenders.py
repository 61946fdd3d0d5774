"""`loadback bench gpu`'s contenders (ours through shm or pickle, a pinned copy, LMCache's own
SGLang MP connector) on a Llama-8B-like KV layout, and the byte-exact proof each passes first.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from types import SimpleNamespace

from lmcache_loadback.connectors.telemetry import quiet_telemetry

quiet_telemetry()
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

import torch  # noqa: E402

from lmcache_loadback.connectors.kv_layout import KVLayout, KVPool  # noqa: E402
from lmcache_loadback.connectors.lmcache_mp import LMCacheMPConnector  # noqa: E402

CHUNK = 256
SKIP = 100  # tokens of the first chunk the engine already holds (proof only)
T = 120.0  # per-operation timeout, seconds
MODEL = "loadback-gpu"
LAYOUT = KVLayout(num_layers=32, num_heads=8, head_dim=128, dtype=torch.bfloat16,
                  chunk_size=CHUNK)
#: Request ids unique within the run (samples and proofs).
request_ids = itertools.count(1)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class Ours:
    """`early`: the product's default on shared memory (prepare_at_match): prepare_retrieve
    runs in the match phase, after the lookup, and the timed load only copies; without it
    the load sends its own prepare_retrieve calls, pipelined in pieces (`piece_plan`)."""

    def __init__(self, endpoint: str, dev: torch.device, expect: str, *,
                 early: bool = False, first: bool = False, late: bool = False) -> None:
        """`first`: prepare only the first piece at match, the load asks for the rest
        (`prepare_in_pieces`); `late`: pay every commit after the load (as before commits
        were paid behind the copy)."""
        self.conn = LMCacheMPConnector(endpoint, LAYOUT, model_name=MODEL, device=dev)
        self.conn.prepare_in_pieces = first
        self.conn.commit_behind = not late
        self.conn.register(T)
        assert self.conn.transfer == expect, f"auto chose {self.conn.transfer}, want {expect}"
        self.phases: list[float] = []
        self.match_s: list[float] = []
        #: Per timed sample: (match, load, commit) seconds; their sum is the whole path.
        self.split: list[tuple[float, float, float]] = []
        self.early = early
        self.prepared = None
        gpu = self.conn._gpu
        self.note = (f"{expect}, scatter {gpu.scatter_impl}" if gpu is not None
                     else f"{expect}, CPU pool")
        self.note += (", first piece prepared at match" if first else ", prepare at match")\
            if early else (", pieces in the load" if expect == "shm" else "")
        self.note += ", commits after the load" if late else ""

    def lookup(self, toks, rid, n) -> None:
        t0 = time.perf_counter()
        hit = self.conn.lookup_hit_tokens(toks, rid, T)
        assert hit == n, f"ours: {hit} of {n} tokens hit"
        if self.early:
            self.prepared = self.conn.prepare(toks, rid, start=0, end=n, timeout_s=T)
        self.match_s.append(time.perf_counter() - t0)

    def load(self, toks, rid, pool, slots, n, skip=0):
        t0 = time.perf_counter()
        prepared, self.prepared = self.prepared, None
        kw = {"prepared": prepared} if prepared is not None else {}
        r = self.conn.retrieve_into(toks, rid, pool, slots, start=0, end=n, timeout_s=T,
                                    skip=skip, **kw)
        self.returned_s = time.perf_counter() - t0  # prepare_retrieve RPC + queueing
        if r.ready is not None:
            r.ready.synchronize()
        return r

    def after(self, r, rid) -> float:
        """Pay the commit (timed: its round trip is part of the whole path, wherever the
        engine pays it), then end the session (untimed, as LMCache's end_session)."""
        t0 = time.perf_counter()
        if r.commit is not None:
            r.commit(T)
        dt = time.perf_counter() - t0
        self.conn.end_session(rid, T)
        return dt

    def run(self, toks, rid, pool, slots, n) -> float:
        self.lookup(toks, rid, n)
        t0 = time.perf_counter()
        r = self.load(toks, rid, pool, slots, n)
        dt = time.perf_counter() - t0
        self.split.append((self.match_s[-1], dt, self.after(r, rid)))
        self.phases.append(self.returned_s)
        return dt

    def close(self) -> None:
        self.conn.close()


class Copy:
    """The link limit: one pinned host buffer -> device buffer of the prefix's byte size."""

    def __init__(self, nbytes: int, dev: torch.device) -> None:
        pin = dev.type == "cuda"
        self.src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        row = LAYOUT.bytes_per_token  # random bytes, one token's worth repeated (fast to fill)
        self.src.view(-1, row)[:] = torch.randint(0, 255, (row,), dtype=torch.uint8)
        self.dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        self.dev = dev
        self.note = "pinned torch copy_" if pin else "torch copy_"

    def run(self, toks, rid, pool, slots, n) -> float:
        nb = n * LAYOUT.bytes_per_token
        sync(self.dev)
        t0 = time.perf_counter()
        self.dst[:nb].copy_(self.src[:nb], non_blocking=True)
        sync(self.dev)
        return time.perf_counter() - t0

    def check(self, n) -> bool:
        nb = n * LAYOUT.bytes_per_token
        return torch.equal(self.dst[:nb].cpu(), self.src[:nb])


def lmcache_connector(host: str, port: int, pool: KVPool, page: int, instance: int,
                      timeout_s: float = T):
    """LMCache 0.5.6's SGLang MP connector (`multi_process_adapter.LMCacheMPConnector`, what
    SGLang 0.5.20's LMCRadixCache builds) registering `pool` with `page` slots per block;
    `instance` sets its instance id apart from another one in this process (LMCache takes
    the pid). `timeout_s`: its mq_timeout, every call's wait."""
    from unittest import mock
    from lmcache.integration.sglang.multi_process_adapter import (
        LMCacheMPConnector as LMCConnector)
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("lmcache"):
            logging.getLogger(name).setLevel(logging.WARNING)
    pid = os.getpid()  # its instance id is the pid: two configs need two ids
    with mock.patch.object(os, "getpid", return_value=pid + instance):
        return LMCConnector(SimpleNamespace(model_path=MODEL), 1, 0, page, f"tcp://{host}",
                            port, list(pool.k_buffer), list(pool.v_buffer),
                            mq_timeout=timeout_s)


class LMCache:
    """LMCache 0.5.6's own SGLang MP connector (lmcache_driven: the daemon writes the KV)."""

    def __init__(self, host: str, port: int, pool: KVPool, toks, page: int,
                 own_slots: torch.Tensor, instance: int) -> None:
        """Registers `pool` with `page` slots per block; `store` saves `toks` from
        `own_slots` with LMCache's own STORE (its prefix, its format; ours' bytes)."""
        from lmcache.integration.sglang.sglang_adapter import LoadMetadata, StoreMetadata
        self.LoadMetadata = LoadMetadata
        self.conn = lmcache_connector(host, port, pool, page, instance)
        self.own_slots = own_slots
        assert self.conn.chunk_size() == CHUNK
        self.dev = pool.k_buffer[0].device
        self.toks = list(toks)
        self.StoreMetadata = StoreMetadata
        self.note = f"lmcache_driven RETRIEVE, CUDA IPC, page {page}"
        self.match_s: list[float] = []
        #: Per timed sample: (lookup, retrieve) seconds; the retrieve releases its locks.
        self.split: list[tuple[float, float]] = []

    def store(self) -> None:
        self.conn.store_kv(self.StoreMetadata(last_node=None, token_ids=self.toks,
                                              kv_indices=self.own_slots, offset=0,
                                              request_id=f"lmc-store-{id(self)}"))

    def run(self, toks, rid, pool, slots, n) -> float:
        toks = self.toks[:n]
        t0 = time.perf_counter()
        hit = self.conn.lookup_kv(list(toks), rid)
        self.match_s.append(time.perf_counter() - t0)
        assert hit == n, f"lmcache: {hit} of {n} tokens hit"
        sync(self.dev)
        t0 = time.perf_counter()
        got = self.conn.retrieve_kv(self.LoadMetadata(token_ids=list(toks), slot_mapping=slots,
                                                      offset=0, request_id=rid))
        sync(self.dev)
        dt = time.perf_counter() - t0
        assert got == n, f"lmcache: retrieved {got} of {n} tokens"
        self.split.append((self.match_s[-1], dt))
        self.conn.end_session(rid)
        return dt

    def close(self) -> None:
        self.conn.close()


def make_pool(num_slots: int, dev: torch.device, fill: bool,
              layout: KVLayout = LAYOUT) -> KVPool:
    shape = (num_slots, layout.num_heads, layout.head_dim)
    g = torch.Generator(device=dev).manual_seed(7)
    mk = (lambda: torch.randn(shape, generator=g, device=dev).to(layout.dtype)) if fill \
        else (lambda: torch.zeros(shape, dtype=layout.dtype, device=dev))
    layers = range(layout.num_layers)
    return KVPool([mk() for _ in layers], [mk() for _ in layers])


def landed(src: KVPool, src_slots, dst: KVPool, dst_slots) -> bool:
    """Every layer's K and V rows of the prefix equal in both pools (byte-exact)."""
    return all(torch.equal(a[src_slots].view(torch.int16), b[dst_slots].view(torch.int16))
               for a, b in zip([*src.k_buffer, *src.v_buffer], [*dst.k_buffer, *dst.v_buffer]))


def poison(pool: KVPool, slots) -> None:
    for b in [*pool.k_buffer, *pool.v_buffer]:
        b[slots] = -7.0


def prove(name, c, toks, src, stored, dst, perm, n) -> dict:
    """Byte-exact proof for one contender at one size; returns what was checked (a
    contender with a `prove` of its own checks its own destination)."""
    if hasattr(c, "prove"):
        return c.prove(toks, src, stored, n)
    dev = dst.k_buffer[0].device
    skip = SKIP if isinstance(c, Ours) else 0
    own = getattr(c, "own_slots", None)
    slots = own[:n] if own is not None else perm[:n - skip].clone()
    poison(dst, slots)
    rid = f"prove-{name}-{n}-{next(request_ids)}"
    if isinstance(c, Ours):
        c.lookup(toks[:n], rid, n)
        r = c.load(toks[:n], rid, dst, slots, n, skip=skip)
        c.after(r, rid)
    elif isinstance(c, Copy):
        c.run(toks, rid, dst, slots, n)
        ok = c.check(n)
        assert ok, f"copy: bytes differ at {n}"
        return {"tokens": n, "ok": True}
    else:
        c.run(toks[:n], rid, dst, slots.to(dev), n)
    sync(dev)
    ok = landed(src, stored[skip:n], dst, slots.to(dev))
    assert ok, f"{name}: landed bytes differ from the stored prefix at {n} tokens (skip {skip})"
    return {"tokens": n, "skip": skip, "random_slots": True, "ok": True}
