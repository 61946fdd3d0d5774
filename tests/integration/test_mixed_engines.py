"""A vLLM engine and an SGLang engine of one model share KV through one store, byte for byte.

The chunk the daemon keeps is engine-neutral: every engine registers `[2, layers, chunk,
heads * head_dim]` token-major (`LMCacheMPConnector.register`: block_size 1,
num_physical_slots = chunk), and the L2 key is `model@kv_rank@group@chunk hash[@salt]`, with
nothing of the engine's paging in it. So vLLM's paged CPU cache and SGLang's token pool read
each other's chunks once the model name, chunk size, hash, KV layout and TP size agree.

What is real: lmcache 0.5.6 daemons (and, for the fleet, a redis-server their L2 shares);
on the vLLM side the worker's own path (engines/vllm/worker.py: `PagedCPUView` over layers in
vLLM 0.32's CPU layout `[num_blocks, num_kv_heads, block_size, 2 * head_size]`, its staged
store region, a load landed by `to_blocks`), with the LOOKUP made by the worker's
orchestrator (the same key as the scheduler's: world size = TP size, no worker id); on the
SGLang side the backend's own `mha_layout` over MHATokenToKVPool-shaped buffers (`[slots +
page_size, heads, head_dim]`, slot 0 the padding slot). Neither engine is imported: their
venvs differ, and what decides the bytes is this product's code, which both run.
The expected KV is written into each engine's memory by the kernel's own reading of it (here,
not through the product), and read back the same way.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import pytest
import torch

from lmcache_loadback.connectors.kv_layout import KVLayout
from lmcache_loadback.engines.sglang.pools import mha_layout
from lmcache_loadback.engines.vllm.paged import PagedCPUView
from lmcache_loadback.orchestrator import LoadBackConfig
from lmcache_loadback.orchestrator.factory import create_orchestrator
from lmcache_loadback.testing.daemon import DaemonProcess
from lmcache_loadback.testing.redis import RedisServer
from tests.conftest import require_redis

pytestmark = [pytest.mark.daemon, pytest.mark.timeout(240)]

CHUNK = 64
LAYERS, HEADS, HEAD = 4, 2, 64   # the tiny Llama's (harness/vllm/model/config.json)
DTYPE = torch.bfloat16
MODEL = "tiny-llama"
PROMPT = 4 * CHUNK
SGLANG_SLOTS = 2048


def config(d: DaemonProcess, transfer: str) -> LoadBackConfig:
    """One YAML for both engines (model name, chunk size), as a mixed fleet must share; with
    the daemon's admin API where it has one (a fleet's checks at registration)."""
    return LoadBackConfig.from_dict({
        "mp_port": d.port, "chunk_size": CHUNK, "model_name": MODEL, "transfer": transfer,
        "mp_http_port": d.http_port,
        "deadlines": {"lookup_ms": 5000, "retrieve_max_ms": 10000, "store_ms": 10000},
        # the vLLM worker's own override (WorkerSide.worker_config): any hit is loaded
        "break_even": {"min_tokens": 0, "prefill_tokens_per_s": 0.0},
        # No canary: each check deletes its marker from L2, so redis' DBSIZE, which the L2
        # test waits on, could drop under a STORE's chunks (a fresh-clone run: "not in redis
        # in 15 s"). The fleet's layout record, checked at registration, stays on.
        "l2": {"canary_interval_ms": 0},
    })


def prompt_kv(seed: int) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """A prompt's token ids and its K and V, `[layers, tokens, heads, head_dim]` each."""
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(1, 30000, (PROMPT,), generator=g).tolist()
    k, v = (torch.randn(LAYERS, PROMPT, HEADS, HEAD, generator=g).to(DTYPE) for _ in "kv")
    return toks, k, v


def differing(k: torch.Tensor, v: torch.Tensor, got_k: torch.Tensor, got_v: torch.Tensor
              ) -> list[tuple[int, int, str]]:
    """(layer, token, "K"/"V") of every token whose bytes differ from what was stored."""
    out = []
    for name, want, got in (("K", k, got_k), ("V", v, got_v)):
        same = (want.view(torch.int16) == got.view(torch.int16)).flatten(2).all(-1)
        out += [(int(l), int(t), name) for l, t in (~same).nonzero().tolist()]
    return out


class VllmWorker:
    """vLLM's CPU KV cache (all layers views of one allocation, as vLLM allocates it) and the
    connector's worker path on it."""

    def __init__(self, d: DaemonProcess, transfer: str, block_size: int,
                 num_blocks: int = 64) -> None:
        self.bs = block_size
        per = num_blocks * HEADS * block_size * 2 * HEAD
        raw = torch.zeros(LAYERS * per, dtype=DTYPE)
        self.layers = [raw[i * per:(i + 1) * per].view(num_blocks, HEADS, block_size, 2 * HEAD)
                       for i in range(LAYERS)]
        self.layout = KVLayout(LAYERS, HEADS, HEAD, DTYPE, CHUNK)  # settings.from_vllm's
        self.view = PagedCPUView(self.layers, self.layout, block_size, staging_tokens=PROMPT)
        self.orch = create_orchestrator(config(d, transfer), layout=self.layout,
                                        kv_pool=self.view.pool)
        # blocks handed out out of order, as vLLM's free list does after frees
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(7))
        self.free = self.free.tolist()

    def place(self, n_tokens: int) -> list[int]:
        """Blocks for `n_tokens`."""
        got, self.free = self.free[:n_tokens // self.bs], self.free[n_tokens // self.bs:]
        return got

    def _rows(self, layer: int, block: int) -> torch.Tensor:
        """The CPU attention kernel's reading of a block: `[heads, 2 * block_size, head]`,
        per head block_size K rows then block_size V rows (cpu_attn.py)."""
        nb = self.layers[layer].shape[0]
        return self.layers[layer].view(nb, HEADS, 2 * self.bs, HEAD)[block]

    def compute(self, block_ids: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """The forward pass writing a prompt's KV into its blocks."""
        for layer in range(LAYERS):
            for j, b in enumerate(block_ids):
                rows, span = self._rows(layer, b), slice(j * self.bs, (j + 1) * self.bs)
                rows[:, :self.bs] = k[layer, span].transpose(0, 1)
                rows[:, self.bs:] = v[layer, span].transpose(0, 1)

    def read(self, block_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        k = torch.empty(LAYERS, len(block_ids) * self.bs, HEADS, HEAD, dtype=DTYPE)
        v = torch.empty_like(k)
        for layer in range(LAYERS):
            for j, b in enumerate(block_ids):
                rows, span = self._rows(layer, b), slice(j * self.bs, (j + 1) * self.bs)
                k[layer, span] = rows[:, :self.bs].transpose(0, 1)
                v[layer, span] = rows[:, self.bs:].transpose(0, 1)
        return k, v

    def store(self, rid: str, toks: list[int], block_ids: list[int]) -> bool:
        """WorkerSide.save + _store: staged into the store region, stored from there."""
        n, base = len(toks), self.view.store_base
        self.view.from_blocks(block_ids, n, base)
        try:
            return self.orch.store(rid, toks, self.view.slots(n, base),
                                   pool=self.view.store_pool)
        finally:
            self.orch.finish(rid)

    def load(self, rid: str, toks: list[int], block_ids: list[int]) -> int:
        """The tokens loaded into `block_ids` (WorkerSide._load: staged, then `to_blocks`)."""
        n = len(toks)
        try:
            if self.orch.match(rid, toks).tokens != n:
                return 0
            return self.orch.load_back(
                rid, self.view.load_slots(block_ids, n),
                land=lambda got: self.view.to_blocks(block_ids, n, ready=got.ready)
            ).loaded_tokens
        finally:
            self.orch.finish(rid)

    def close(self) -> None:
        self.orch.close()


class SglangPool:
    """SGLang's MHATokenToKVPool buffers (page size 1: slot 0 pads) and the backend's path."""

    def __init__(self, d: DaemonProcess, transfer: str, dtype: torch.dtype = DTYPE) -> None:
        shape = (SGLANG_SLOTS + 1, HEADS, HEAD)
        k = [torch.zeros(shape, dtype=dtype) for _ in range(LAYERS)]
        v = [torch.zeros(shape, dtype=dtype) for _ in range(LAYERS)]
        self.layout, self.pool = mha_layout(k, v, CHUNK)  # what LoadBackRadixCache registers
        self.orch = create_orchestrator(config(d, transfer), layout=self.layout,
                                        kv_pool=self.pool)
        self.free = (torch.randperm(SGLANG_SLOTS, generator=torch.Generator().manual_seed(3))
                     + 1)

    def place(self, n: int) -> torch.Tensor:
        """Slots for `n` tokens."""
        got, self.free = self.free[:n], self.free[n:]
        return got

    def compute(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        for layer in range(LAYERS):
            self.pool.k_buffer[layer][slots] = k[layer]
            self.pool.v_buffer[layer][slots] = v[layer]

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.stack([b[slots] for b in self.pool.k_buffer]),
                torch.stack([b[slots] for b in self.pool.v_buffer]))

    def store(self, rid: str, toks: list[int], slots: torch.Tensor) -> bool:
        try:
            return self.orch.store(rid, toks, slots)
        finally:
            self.orch.finish(rid)

    def load(self, rid: str, toks: list[int], slots: torch.Tensor) -> int:
        try:
            if self.orch.match(rid, toks).tokens != len(toks):
                return 0
            return self.orch.load_back(rid, slots).loaded_tokens
        finally:
            self.orch.finish(rid)

    def close(self) -> None:
        self.orch.close()


@pytest.fixture(scope="module", params=["pickle", "shm"])
def daemon(request):
    """A daemon per transfer mode: pickled KV (no pool) or its shared-memory pool."""
    shm = f"lbmix{os.getpid()}" if request.param == "shm" else None
    with DaemonProcess(chunk_size=CHUNK, shm_name=shm) as d:
        yield d, request.param


@pytest.fixture
def engines():
    """Makes a vLLM worker and an SGLang pool, each on its daemon; closes them after."""
    made = []

    def make(vllm_daemon: DaemonProcess, sglang_daemon: DaemonProcess, transfer: str,
             block_size: int = 32) -> tuple[VllmWorker, SglangPool]:
        vl = VllmWorker(vllm_daemon, transfer, block_size)
        sg = SglangPool(sglang_daemon, transfer)
        made.extend((vl, sg))
        assert vl.orch.wait_registered(10) and sg.orch.wait_registered(10)
        return vl, sg

    yield make
    for e in made:
        e.close()


def differences_loaded(source, target, seed: int,
                       stored: Callable[[Callable[[], bool]], bool] = lambda st: st()) -> list:
    """A prompt computed by `source`, stored, looked up and loaded by `target`: the (layer,
    token, K/V) whose bytes differ, or "not loaded". `stored` runs a STORE and returns once
    `target` can find it."""
    toks, k, v = prompt_kv(seed)
    at = source.place(PROMPT)
    source.compute(at, k, v)
    assert stored(lambda: source.store(f"store-{seed}", toks, at))
    into = target.place(PROMPT)
    got = target.load(f"load-{seed}", toks, into)
    return differing(k, v, *target.read(into)) if got == PROMPT else [
        f"not loaded: {got} of {PROMPT} tokens"]


def cross_load_differences(vl: VllmWorker, sg: SglangPool, seed: int, **kw) -> dict[str, list]:
    """Both directions, a prompt of its own each."""
    return {"vllm->sglang": differences_loaded(vl, sg, seed, **kw),
            "sglang->vllm": differences_loaded(sg, vl, seed + 1, **kw)}


@pytest.mark.parametrize("block_size", [16, 32])
def test_vllm_and_sglang_load_each_others_kv_byte_exact(daemon, engines, block_size):
    """vLLM's paged blocks (16 or 32 tokens) and SGLang's token slots on one daemon: its
    chunk is the same either way, so each loads what the other stored, every byte."""
    d, transfer = daemon
    vl, sg = engines(d, d, transfer, block_size)
    assert cross_load_differences(vl, sg, seed=block_size) == {
        "vllm->sglang": [], "sglang->vllm": []}


@pytest.fixture(scope="module")
def fleet():
    """Daemons A and B with shared-memory pools and admin APIs, one redis as their L2."""
    require_redis()
    with RedisServer(maxmemory="128mb") as redis:
        a, b = (DaemonProcess(chunk_size=CHUNK, http=True, shm_name=f"lbmix{n}{os.getpid()}",
                              l2_adapter=redis.l2_adapter("resp")) for n in "ab")
        try:
            with ThreadPoolExecutor(2) as ex:
                for f in [ex.submit(d.start) for d in (a, b)]:
                    f.result()
            yield redis, a, b
        finally:
            for d in (a, b):
                d.stop()


def test_a_vllm_server_and_an_sglang_server_share_kv_through_one_l2(fleet, engines):
    """The fleet: the vLLM engine on daemon A, the SGLang engine on daemon B. The fleet's
    checks at registration (hash, the KV layout recorded under the model name) accept both,
    and each loads from L2 what the other stored, every byte."""
    redis, a, b = fleet
    vl, sg = engines(a, b, "shm")
    assert (vl.orch.link.refused, sg.orch.link.refused) == (None, None)

    def in_l2(store: Callable[[], bool]) -> bool:
        """STORE, then wait until redis holds its chunks (the daemon writes to L2 after
        STORE returns; a LOOKUP on the other daemon before is a miss)."""
        before = redis.dbsize()
        ok = store()
        end = time.monotonic() + 15
        while redis.dbsize() < before + PROMPT // CHUNK:
            assert time.monotonic() < end, "the prompt's chunks not in redis in 15 s"
            time.sleep(0.01)
        return ok

    assert cross_load_differences(vl, sg, seed=99, stored=in_l2) == {
        "vllm->sglang": [], "sglang->vllm": []}


def test_an_sglang_engine_of_another_dtype_is_refused_by_the_vllm_engines_record(fleet):
    """Through L2 the loading daemon lays the bytes out by its own registration, so a
    float16 engine would load bfloat16 KV as its own: the layout the vLLM engine recorded
    refuses it at registration, also on daemons with a shared-memory pool."""
    _, a, b = fleet
    vl = VllmWorker(a, "shm", 32)
    sg = SglangPool(b, "shm", dtype=torch.float16)
    try:
        assert vl.orch.wait_registered(10) and vl.orch.link.refused is None
        end = time.monotonic() + 15
        while sg.orch.link.refused is None:
            assert time.monotonic() < end, "the float16 engine not refused in 15 s"
            time.sleep(0.01)
        assert sg.orch.link.refused.startswith(
            f"model_name {MODEL!r} (world size 1) is used in this fleet's L2 for a KV layout "
            "of 4 layers x 2 heads x 64 dim bfloat16 (K and V)")
        assert not sg.orch.link.registered()
    finally:
        vl.close()
        sg.close()
