"""Shared fixtures: a real lmcache 0.5.6 daemon per test module, KV pools, orchestrators."""

from __future__ import annotations

import pytest
import torch

from lmcache_loadback.connectors.telemetry import quiet_telemetry

quiet_telemetry()

from lmcache_loadback.testing.daemon import DaemonProcess  # noqa: E402
from lmcache_loadback.connectors.kv_layout import KVLayout, KVPool  # noqa: E402
from lmcache_loadback.connectors.lmcache_mp import LMCacheMPConnector  # noqa: E402

CHUNK = 16


def require_redis() -> None:
    """Fail, never skip, where redis-server is missing: a skipped L2 test lets a broken fleet
    pass. `make test` installs it (its redis-tools target); the message says how otherwise."""
    from lmcache_loadback.testing.redis import RedisUnavailable, find_redis
    try:
        find_redis()
    except RedisUnavailable as exc:
        pytest.fail(str(exc), pytrace=False)


def lookups_sent(orch) -> int:
    """LOOKUP results `orch` counted (every one but `skipped`: the breaker or no daemon)."""
    return sum(int(c._value.get()) for r, c in orch.metrics._lookups.items() if r != "skipped")


def make_pool(layout: KVLayout, num_slots: int = 4096, *, fill: bool = True) -> KVPool:
    """An SGLang-shaped pool: per layer K and V `[num_slots, heads, head_dim]`."""
    shape = (num_slots, layout.num_heads, layout.head_dim)
    if fill:
        k = [torch.randn(shape).to(layout.dtype) for _ in range(layout.num_layers)]
        v = [torch.randn(shape).to(layout.dtype) for _ in range(layout.num_layers)]
    else:
        k = [torch.zeros(shape, dtype=layout.dtype) for _ in range(layout.num_layers)]
        v = [torch.zeros(shape, dtype=layout.dtype) for _ in range(layout.num_layers)]
    return KVPool(k, v)


def kv_of(pool: KVPool, slots: torch.Tensor) -> list[torch.Tensor]:
    """The bytes a prefix occupies in a pool, for byte-exact comparisons."""
    idx = slots.to(torch.int64)
    return [t[idx].clone() for t in list(pool.k_buffer) + list(pool.v_buffer)]


def same_kv(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.fixture
def layout() -> KVLayout:
    return KVLayout(num_layers=2, num_heads=4, head_dim=16, dtype=torch.float16, chunk_size=CHUNK)


@pytest.fixture(scope="module")
def daemon():
    """A real daemon with the admin API (lock and session counts), stopped by PID."""
    d = DaemonProcess(chunk_size=CHUNK, http=True)
    d.start()
    yield d
    d.stop()


@pytest.fixture
def live_daemon(daemon):
    """The module's daemon, guaranteed running and not paused when the test starts."""
    daemon.resume()
    if daemon.proc is None or daemon.proc.poll() is not None:
        daemon.start()
    yield daemon
    daemon.resume()


@pytest.fixture
def connector_factory(layout):
    made = []

    def make(d: DaemonProcess, **kw) -> LMCacheMPConnector:
        c = LMCacheMPConnector(d.endpoint, kw.pop("layout", layout), **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()
