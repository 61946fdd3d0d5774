"""`loadback tune --daemon HOST:PORT --model-config config.json`: measure a running LMCache
daemon with the model's KV layout (harness/tune_layout.py), fit retrieve time to prefix size,
and recommend a config (deadlines, retries, break-even), each value beside its measurement
(harness/tune_recommend.py). Here: the measurement and the command.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass

import torch
import yaml

from lmcache_loadback.connectors.errors import ConnectorError, VersionSkew
from lmcache_loadback.connectors.kv_layout import KVLayout, KVPool
from lmcache_loadback.connectors.lmcache_mp import LMCacheMPConnector
from lmcache_loadback.connectors.wire import PROTOCOL_VERSION
from lmcache_loadback.orchestrator.config import ConfigError, LoadBackConfig
from lmcache_loadback.orchestrator.exit_codes import EXIT_FAILED, EXIT_USAGE
from lmcache_loadback.orchestrator.exit_codes import EXIT_UNAVAILABLE as EXIT_UNREACHABLE

from .bench.common import fmt, median, percentile, print_table, progress_bar, write_json
from .tune_layout import (
    DTYPES,
    LayoutError,
    ModelLayout,
    layout_from_model_config,
    layout_from_server,
    resolve_layout,
)
from .tune_recommend import LOOKUP_FACTOR, RETRIEVE_FACTOR, Size, fit, recommend, render_yaml

__all__ = ["DTYPES", "LOOKUP_FACTOR", "LayoutError", "ModelLayout", "RETRIEVE_FACTOR", "Size",
           "fit", "layout_from_model_config", "layout_from_server", "measure", "recommend",
           "render_yaml", "resolve_layout", "run"]

SIZES_CHUNKS = (1, 4, 16, 64)
MAX_PREFIX_BYTES = 64 << 20
CALL_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 3.0            # get_chunk_size + register: an absent daemon fails fast
WALL_BUDGET_S = 120.0
MODEL = "loadback-tune"
_ids = itertools.count(1)


def _parse_daemon(addr: str) -> tuple[str, int]:
    host, sep, port = addr.strip().removeprefix("tcp://").rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--daemon {addr!r}: expected HOST:PORT, e.g. 127.0.0.1:5555")
    return host, int(port)


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000


def _store(conn: LMCacheMPConnector, toks, pool: KVPool) -> None:
    rid = f"tune-store-{os.getpid()}-{next(_ids)}"
    try:
        conn.store_from(toks, rid, pool, torch.randperm(pool.num_slots)[:len(toks)],
                        timeout_s=CALL_TIMEOUT_S)
    finally:
        conn.end_session(rid, CALL_TIMEOUT_S)


def _sample(conn: LMCacheMPConnector, s: Size, toks, pool: KVPool) -> None:
    rid = f"tune-{os.getpid()}-{next(_ids)}"
    try:
        t0 = time.perf_counter()
        hit = conn.lookup_hit_tokens(toks, rid, CALL_TIMEOUT_S)
        s.lookup_ms.append(_ms(t0))
        if hit != s.tokens:  # evicted: release what the lookup locked, store it again
            s.misses += 1
            conn.free_locks(toks, rid, 0, hit, CALL_TIMEOUT_S)
            _store(conn, toks, pool)
            return
        slots = torch.randperm(pool.num_slots)[:s.tokens]
        t0 = time.perf_counter()
        got = conn.retrieve_into(toks, rid, pool, slots, start=0, end=hit,
                                 timeout_s=CALL_TIMEOUT_S)
        s.retrieve_ms.append(_ms(t0))  # the engine waits this long; the commit is off its path
        s.nbytes = got.nbytes
        if got.commit is not None:
            got.commit(CALL_TIMEOUT_S)
    except ConnectorError as exc:
        s.errors.append(f"{type(exc).__name__}: {exc}")
    finally:
        try:
            conn.end_session(rid, CALL_TIMEOUT_S)
        except ConnectorError:
            pass


def measure(conn: LMCacheMPConnector, sizes: list[Size], requests: int,
            budget_s: float) -> tuple[bool, float]:
    """Fill `sizes` with samples; (stopped early at the budget, seconds spent)."""
    t_start = time.monotonic()
    layout = conn.layout
    n_slots = max(s.tokens for s in sizes)
    shape = (n_slots, layout.num_heads, layout.head_dim)
    pool = KVPool([torch.randn(shape, dtype=layout.dtype) for _ in range(layout.num_layers)],
                  [torch.randn(shape, dtype=layout.dtype) for _ in range(layout.num_layers)])
    rng, stopped = random.Random(), False
    bar = progress_bar(len(sizes) * requests, "tune")
    try:
        for s in sizes:
            if stopped or time.monotonic() - t_start > budget_s:
                stopped = True
                break
            toks = [rng.randrange(1, 50000) for _ in range(s.tokens)]
            try:
                _store(conn, toks, pool)
            except ConnectorError as exc:
                s.errors.append(f"store: {type(exc).__name__}: {exc}")
                bar.update(requests)
                continue
            _sample(conn, Size(s.chunks, s.tokens), toks, pool)  # warm-up, not counted
            for _ in range(requests):
                if time.monotonic() - t_start > budget_s:
                    stopped = True
                    break
                _sample(conn, s, toks, pool)
                bar.update(1)
    finally:
        bar.close()
    return stopped, time.monotonic() - t_start


def daemon_command(host: str, port: int) -> str:
    """The daemon's command line as docs/operations.md gives it (N: the config's chunk_size)."""
    return (f"python -m lmcache.v1.multiprocess.server --host {host} --port {port} "
            "--chunk-size N --l1-size-gb GB --eviction-policy LRU --supported-transfer-mode auto "
            "--shm-name NAME --no-l1-use-lazy")


def _unreachable(host: str, port: int, endpoint: str, exc: Exception) -> None:
    """Say why the daemon cannot be used, and how to fix it."""
    addr = f"{host}:{port}"
    fix = (f"install lmcache=={PROTOCOL_VERSION} on the daemon's side" if isinstance(exc, VersionSkew)
           else f"start the daemon there ({daemon_command(host, port)}; docs/operations.md, "
                "\"Starting the daemon\") or pass the address it listens on: --daemon HOST:PORT")
    print(f"error: cannot use the LMCache daemon at {addr} ({endpoint}) within "
          f"{CONNECT_TIMEOUT_S:g} s: {type(exc).__name__}: {exc}\nfix: {fix}", file=sys.stderr)


@dataclass
class _Measured:
    """What the daemon answered: its chunk size, the layout registered, the samples."""

    chunk: int
    layout: KVLayout
    layout_txt: str
    sizes: list[Size]
    stopped: bool
    spent: float


def run(args: argparse.Namespace) -> int:
    """Connect, read the daemon's chunk size, register the model's layout, store one random
    prefix of 1, 4, 16 and 64 chunks (each capped below 64 MiB of KV) under model name
    `loadback-tune` (apart from the engine's cache), time `--requests` LOOKUPs and RETRIEVEs
    (into random pool slots) per size, fit retrieve_ms = a + b * tokens/1024 to the p99s and
    p50s, and write the recommended YAML to `--out` (validated first; its header records
    the layout and where it came from), the raw measurements to `--json`. Every call has a
    10 s timeout and the whole run a 120 s budget: past it, measuring stops, said in the
    report. Exit codes (`orchestrator.exit_codes`): 0 ok; 1 nothing could be measured; 69
    the daemon cannot be reached; 64 bad usage (a malformed --daemon, no KV layout)."""
    try:
        host, port = _parse_daemon(args.daemon)
        model = resolve_layout(args)  # LayoutError is a ValueError too
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    requests = max(1, int(args.requests))
    addr = f"{host}:{port}"
    m = _measure_daemon(host, port, model, requests)
    if m is None:
        return EXIT_UNREACHABLE
    _print_measured(m, requests)
    if not any(s.retrieve_ms for s in m.sizes):
        print(f"error: no RETRIEVE of the daemon at {addr} succeeded; nothing to recommend "
              "(see the errors above)", file=sys.stderr)
        return EXIT_FAILED
    fits, recs = recommend(m.sizes, m.chunk, args.prefill_tokens_per_s)
    _print_recommended(fits, recs)
    text = render_yaml(host, port, m.chunk, recs, _header(addr, model, m, requests))
    try:
        LoadBackConfig.from_dict(yaml.safe_load(text), source=args.out)  # before writing
    except (ConfigError, yaml.YAMLError) as exc:
        print(f"error: the recommended config does not validate: {exc}", file=sys.stderr)
        return EXIT_FAILED
    tmp = f"{args.out}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, args.out)
    print(f"wrote {args.out}")
    if getattr(args, "json", None):
        write_json(args.json, _raw(addr, model, m, requests, fits, recs))
        print(f"wrote {args.json}")
    return 0


def _measure_daemon(host: str, port: int, model: ModelLayout, requests: int
                    ) -> _Measured | None:
    """Register the model's layout at the daemon's chunk size and measure every size; None
    (said why) when the daemon cannot be used."""
    endpoint, addr = f"tcp://{host}:{port}", f"{host}:{port}"
    probe = LMCacheMPConnector(endpoint, model.kv_layout(1), model_name=MODEL,
                               connect_timeout_s=1.0)
    try:
        try:
            chunk = probe.get_chunk_size(CONNECT_TIMEOUT_S)
            if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0:
                raise ConnectorError(f"get_chunk_size answered {chunk!r}, not a chunk size")
            layout = model.kv_layout(chunk)
            conn = LMCacheMPConnector(endpoint, layout, model_name=MODEL,
                                      transport=probe.transport)
            conn.register(CONNECT_TIMEOUT_S)
        except ConnectorError as exc:
            _unreachable(host, port, endpoint, exc)
            return None
        layout_txt = f"{model.describe()}, {layout.bytes_per_token} B/token"
        print(f"daemon {addr}: chunk size {chunk}; KV layout {layout_txt} (from {model.source})")
        max_chunks = max(1, MAX_PREFIX_BYTES // layout.chunk_bytes)
        sizes = [Size(c, c * chunk) for c in sorted({min(c, max_chunks) for c in SIZES_CHUNKS})]
        stopped, spent = measure(conn, sizes, requests, WALL_BUDGET_S)
        try:
            conn.unregister(CALL_TIMEOUT_S)
        except ConnectorError:
            pass
    finally:
        probe.close()
    return _Measured(chunk, layout, layout_txt, sizes, stopped, spent)


def _print_measured(m: _Measured, requests: int) -> None:
    sizes, layout = m.sizes, m.layout
    rows = [(s.chunks, s.tokens, fmt(s.tokens * layout.bytes_per_token / 2**20, 2),
             f"{len(s.retrieve_ms)}/{len(s.lookup_ms)}", fmt(median(s.lookup_ms), 3),
             fmt(percentile(s.lookup_ms, 99), 3), fmt(median(s.retrieve_ms), 3),
             fmt(percentile(s.retrieve_ms, 99), 3), s.misses, len(s.errors)) for s in sizes]
    print_table(["chunks", "tokens", "MiB", "n ret/look", "lookup p50", "lookup p99", "retrieve p50",
                 "retrieve p99", "misses", "errors"], rows,
                title=f"measured (ms; {requests} samples per size after 1 warm-up):")
    for s in sizes:
        for e in s.errors[:3]:
            print(f"  {s.tokens} tokens: {e}")
    if m.stopped:
        print(f"STOPPED EARLY: the {WALL_BUDGET_S:g} s budget ran out after {m.spent:.1f} s")


def _print_recommended(fits: dict, recs: list) -> None:
    for name, (a, b) in fits.items():
        print(f"fit {name}: retrieve_ms = {fmt(a, 3)} + {fmt(b, 4)} * tokens/1024")
    print("recommended (value  <- the measurement it came from):")
    width = max(len(k) + len(repr(v)) for k, v, _ in recs) + 2
    for key, value, why in recs:
        print(f"  {f'{key}: {value!r}':<{width}}  <- {why}")


def _header(addr: str, model: ModelLayout, m: _Measured, requests: int) -> list[str]:
    """The YAML's comment lines: when, against which daemon, how many samples, which layout."""
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")
    return [
        f"Tuned by `loadback tune` at {when} against the LMCache daemon at {addr}",
        f"(chunk size {m.chunk}, protocol lmcache=={PROTOCOL_VERSION}); "
        f"{requests} samples per prefix size of {[s.tokens for s in m.sizes]} tokens"
        + (f", stopped early at the {WALL_BUDGET_S:g} s budget" if m.stopped else "") + ".",
        f"KV layout per rank: {m.layout_txt}, from {model.source}.",
        "Deadlines scale with bytes per token: re-run tune for another model.",
    ]


def _raw(addr: str, model: ModelLayout, m: _Measured, requests: int, fits: dict,
         recs: list) -> dict:
    """The `--json` report: every sample, the fits and the recommendation."""
    return {
        "daemon": addr, "chunk_size": m.chunk, "layout": asdict(model),
        "bytes_per_token": m.layout.bytes_per_token, "requests": requests,
        "stopped_early": m.stopped,
        "sizes": [{"chunks": s.chunks, "tokens": s.tokens, "nbytes": s.nbytes,
                   "misses": s.misses, "errors": s.errors, "lookup_ms": s.lookup_ms,
                   "retrieve_ms": s.retrieve_ms} for s in m.sizes],
        "fits": {k: {"a_ms": a, "b_ms_per_ki": b} for k, (a, b) in fits.items()},
        "recommended": {k: v for k, v, _ in recs},
    }
