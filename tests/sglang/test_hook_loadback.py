"""LoadBackRadixCache on SGLang's real pools and a real daemon: store, evict, load back."""

from __future__ import annotations

import pytest

from .conftest import (
    CHUNK,
    NEW_API,
    Sched,
    fresh_ids,
    kv_matches,
    make_config,
    page_sizes,
    tree_consistent,
    wait_for,
)

pytestmark = pytest.mark.daemon


def ready(cache, timeout_s: float = 30.0) -> None:
    orch = cache.orch
    if hasattr(orch, "wait_registered"):
        assert orch.wait_registered(timeout_s), "never registered with the daemon"
    else:
        wait_for(lambda: orch._registered(), timeout_s, "registration with the daemon")


@pytest.mark.parametrize("page", page_sizes())
def test_stored_prefix_evicted_then_loaded_back_byte_exact(live_daemon, make_cache, page):
    cache = make_cache(page, make_config(live_daemon.port))
    ready(cache)
    s = Sched(cache)
    ids = fresh_ids(5 * CHUNK + 3)        # 5 whole chunks and a tail
    a = s.new_req("a", ids)
    got = s.admit(a)
    assert got["loaded"] == 0
    s.finish(a)
    s.flush()
    free_before = cache.token_to_kv_pool_allocator.available_size()
    assert cache.evictable_size() == 0
    b = s.new_req("b", ids + [7, 8, 9])
    if NEW_API:
        s.prefetch(b)
        s.poll(b)
        # What SGLang reports as the storage hit (cached_tokens_details "storage").
        assert cache.pop_prefetch_loaded_span(b.cache_request_handle) == (5 * CHUNK, 0)
    got = s.admit(b, prefetch=not NEW_API)
    assert got["host_hit"] == 5 * CHUNK and got["loaded"] == 5 * CHUNK
    assert kv_matches(s.pool, got["loaded_slots"], ids[: 5 * CHUNK], 0)
    tree_consistent(cache)
    s.finish(b)
    tree_consistent(cache, idle=True)
    # Every slot b took is in the tree or free again.
    assert cache.token_to_kv_pool_allocator.available_size() + cache.evictable_size() == free_before
    assert cache.orch.live_prefixes() == 0
