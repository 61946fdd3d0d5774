"""The L2 canary's marker (orchestrator/l2_canary.py): a prefix no engine has, its tiny KV,
and its keys as the daemon names them (computed with lmcache's own resolver, so that its L1
copy can be dropped through the admin API)."""

from __future__ import annotations

import dataclasses
import os

import torch

from lmcache_loadback.connectors.kv_layout import KVPool

__all__ = ["CANARY_MODEL", "CANARY_SALT", "KeysUnavailable", "MARKER_CHUNKS", "MARKER_LAYOUT",
           "marker", "object_keys"]

#: The canary's keys: `loadback-l2-canary@<rank>@0@<hash>@loadback-l2-canary`, never an
#: engine's (its own model name: registering a tiny layout under the engine's would replace
#: the engine's in the daemon's layout registry).
CANARY_MODEL = "loadback-l2-canary"
CANARY_SALT = "loadback-l2-canary"
#: Several chunks: against a cluster without cluster_mode only some chunks are lost.
MARKER_CHUNKS = 4
#: 2 layers x 1 head x 16 dim, bf16: the marker is tiny whatever the chunk size.
MARKER_LAYOUT = dict(num_layers=2, num_heads=1, head_dim=16, dtype=torch.bfloat16)


class KeysUnavailable(Exception):
    """The daemon's keys cannot be computed in this process (lmcache is not importable)."""


def marker(chunk_size: int, chunks: int) -> tuple[list[int], KVPool]:
    """Random tokens (a key no engine has) and their KV in slots [0, n); [n, 2n) receive."""
    n = chunks * chunk_size
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    layers = MARKER_LAYOUT["num_layers"]
    shape = (2 * n, MARKER_LAYOUT["num_heads"], MARKER_LAYOUT["head_dim"])
    bufs = [torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(2 * layers)]
    toks = torch.randint(0, 50000, (n,), generator=g).tolist()
    return toks, KVPool(bufs[:layers], bufs[layers:])


def object_keys(model_name: str, token_ids: list[int], cache_salt: str, chunk_size: int,
                hash_algorithm: str, world_size: int = 1) -> list[dict]:
    """The daemon's keys of `token_ids` (one per chunk and rank), in the admin API's JSON
    form, made by lmcache's own resolver (imported here: seconds, once, off the request path)."""
    try:
        from lmcache.v1.multiprocess.cache_control.key_resolver import resolve_object_keys
    except ImportError:
        raise KeysUnavailable(
            "the canary computes the daemon's keys with lmcache's own resolver, and lmcache is "
            "not importable in this environment: install it without its dependencies (`pip "
            "install --no-deps lmcache==0.5.6`), or turn the canary off "
            "(l2.canary_interval_ms: 0)") from None

    keys, _ = resolve_object_keys(_hasher(chunk_size, hash_algorithm), model_name, world_size,
                                  token_ids, cache_salt)
    return [dataclasses.asdict(k.to_encoded_object_key()) for k in keys]


_hashers: dict[tuple[int, str], object] = {}


def _hasher(chunk_size: int, hash_algorithm: str):
    key = (chunk_size, hash_algorithm)
    if key not in _hashers:
        from lmcache.v1.multiprocess.token_hasher import TokenHasher

        _hashers[key] = TokenHasher(chunk_size, hash_algorithm)
    return _hashers[key]
