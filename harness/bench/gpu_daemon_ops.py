"""`loadback bench gpu`'s account of where the daemon's time goes: each operation of one
request against the prefix length (LOOKUP + prefetch wait, prepare_retrieve of the whole
range, commit_retrieve, end_session, and prepare_retrieve piece by piece), the hashing the
daemon does for it, and the encoding of the key that every call carries.

The 0.5.6 daemon hashes a prefix twice per request: LOOKUP hashes the key's tokens with
`TokenHasher.compute_chunk_hashes` (no session), then the first call that resolves object
keys (prepare_retrieve, commit_retrieve) hashes them again through the request's `Session`,
which keeps them for the request's later calls. `hash_ms` times one such hashing in this
process (same host CPU as the daemon).
"""

from __future__ import annotations

import time

import msgspec

from lmcache_loadback.connectors import wire
from lmcache_loadback.connectors.retrieval import Retrieval

from .common import median

#: Requests timed per size (each after one untimed warm-up).
OPS_SAMPLES = 5


def _timed(fn, *a, **k):
    t0 = time.perf_counter()
    out = fn(*a, **k)
    return out, (time.perf_counter() - t0) * 1e3


def _one_request(conn, toks, rid, n, timeout_s, pieces: bool) -> dict:
    """One LOOKUP, prepare (whole or in pieces), commits and end_session, each timed (ms)."""
    hit, t_lookup = _timed(conn.lookup_hit_tokens, toks, rid, timeout_s)
    assert hit == n, f"daemon ops: {hit} of {n} tokens hit"
    plan = conn.piece_plan(n // conn.chunk_size) if pieces else [n // conn.chunk_size]
    r = Retrieval(conn.epoch, 0, n)
    prep, s = [], 0
    for cnt in plan:
        e = s + cnt * conn.chunk_size
        key = conn.key(toks, rid, start=s, end=e)
        _, dt = _timed(conn._prepare_range, key, cnt, timeout_s, r)
        prep.append(dt)
        s = e
    commits = []
    for step in r.owed:
        _, dt = _timed(step.pay, timeout_s)
        commits.append(dt)
    _, t_end = _timed(conn.end_session, rid, timeout_s)
    return {"lookup": t_lookup, "prepare": sum(prep), "prepare_first": prep[0],
            "prepare_pieces": len(prep), "commit": sum(commits), "end_session": t_end}


def _hash_ms(toks, chunk: int) -> float | None:
    """One hashing of the prefix as the daemon does it (blake3 rolling chunk hashes)."""
    try:
        from lmcache.v1.multiprocess.token_hasher import TokenHasher
    except Exception:  # noqa: BLE001 - an account without it still says the rest
        return None
    h = TokenHasher(chunk)
    return min(_timed(h.compute_chunk_hashes, list(toks), end=len(toks))[1] for _ in range(3))


def _key_codec_ms(conn, toks, rid) -> float:
    """Encoding and decoding one call's key of these tokens (both ends pay it)."""
    key = conn.key(toks, rid)
    t0 = time.perf_counter()
    for _ in range(3):
        msgspec.msgpack.decode(wire.encode(key), type=wire.CacheKey)
    return (time.perf_counter() - t0) / 3 * 1e3


def daemon_ops(conn, toks, sizes, timeout_s: float, ids) -> list[dict]:
    """Per size: medians (ms) of each operation of a request, whole and in pieces."""
    out = []
    for n in sizes:
        row = {"tokens": n, "chunks": n // conn.chunk_size}
        for mode, pieces in (("whole", False), ("pieces", True)):
            runs = [_one_request(conn, toks[:n], f"ops-{n}-{mode}-{next(ids)}", n, timeout_s,
                                 pieces) for _ in range(OPS_SAMPLES + 1)][1:]
            row[mode] = {k: median([r[k] for r in runs]) for k in runs[0]}
        row["hash_ms"] = _hash_ms(toks[:n], conn.chunk_size)
        try:
            row["key_codec_ms"] = _key_codec_ms(conn, toks[:n], "ops")
        except Exception as exc:  # noqa: BLE001 - reported, not fatal
            row["key_codec_ms"] = f"{type(exc).__name__}: {exc}"
        out.append(row)
        print(f"daemon ops at {n} tokens: {row}", flush=True)
    return out
