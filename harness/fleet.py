"""`loadback fleet check A B`: do two LMCache daemons share KV through one L2 store?

Stores a small marker prefix through A (through each daemon's shared-memory pool where it
offers one, else pickled: across hosts for daemons without --shm-name), then LOOKUPs
and loads it through B, byte for byte, waiting up to --wait-s for A's L2 write (it starts
after STORE returns). Before that, what can be told without storing: both daemons answer,
agree on the chunk size and the model name, and (with --admin-a/--admin-b, each daemon's
--http-port) on the hash algorithm and the L2 store, whose nodes must answer from here and be
Redis Cluster nodes only where the adapter runs in cluster_mode. Then, with the admin APIs,
each daemon's own L2 round trip (the L2 canary: a marker stored, its L1 copy dropped, loaded
back from L2), which tells stores lost on their way to L2 from daemons that share nothing.
The L2 key (`<model>@<rank>@<group>@<chunk hash>`) names no layout, so a mismatch is refused
before anything is written. One line per finding; exit codes from `orchestrator.exit_codes`.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass

import torch
from prometheus_client import CollectorRegistry

from lmcache_loadback.connectors.daemon_settings import adapter_kind, admin_call
from lmcache_loadback.connectors.errors import ConnectorError
from lmcache_loadback.connectors.kv_layout import KVLayout
from lmcache_loadback.connectors.lmcache_mp import LMCacheMPConnector
from lmcache_loadback.orchestrator.config import L2, LoadBackConfig
from lmcache_loadback.orchestrator.exit_codes import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
)
from lmcache_loadback.orchestrator.instruments import product_metrics
from lmcache_loadback.orchestrator.l2_canary import MARKER_LAYOUT as _LAYOUT
from lmcache_loadback.orchestrator.l2_canary import L2Canary, marker
from lmcache_loadback.testing.redis import resp_command

from .tune import _parse_daemon

__all__ = ["Finding", "check", "l2_stores", "run"]

#: The marker's keys carry this salt (`...@<hash>@loadback-fleet-check`): never an engine's key.
MARKER_SALT = "loadback-fleet-check"
MARKER_CHUNKS = 2
#: The L2 canary's own lines: its finding says the same, once.
_QUIET = logging.getLogger("loadback.fleet-check")
_QUIET.propagate = False
_QUIET.addHandler(logging.NullHandler())
#: /config keys of an adapter that do not change which store it reads and writes.
_NOT_IDENTITY = {"num_workers", "request_timeout", "connection_timeout", "affinity_tag",
                 "shared", "eviction_config", "persist_config", "serde_config",
                 "max_capacity_gb", "ttl_seconds", "username", "password", "tls_enable"}


@dataclass
class Finding:
    ok: bool
    line: str
    code: int = EXIT_OK  # the exit code when not ok

    def __str__(self) -> str:
        return f"{'ok  ' if self.ok else 'FAIL'} {self.line}"


@dataclass(frozen=True)
class L2Store:
    """One adapter of a daemon's /config, as far as it names where the chunks live."""

    kind: str                          # resp | valkey | fs | the adapter's other keys
    nodes: frozenset[tuple[str, int]]  # resp/valkey: host, port (a cluster: its seeds)
    where: tuple                       # everything else that changes the keys or the place

    def describe(self) -> str:
        nodes = ",".join(f"{h}:{p}" for h, p in sorted(self.nodes))
        rest = ", ".join(f"{k}={v}" for k, v in self.where if v not in ('""', "null", "false"))
        return " ".join(x for x in (self.kind, nodes, rest) if x)

    def same_place(self, other: "L2Store") -> bool:
        # Two seed lists of one cluster need not be equal: one node in common is enough.
        return self.where == other.where and (self.nodes & other.nodes or
                                              (not self.nodes and not other.nodes))


def l2_stores(config: dict) -> list[L2Store]:
    """The L2 adapters named in a daemon's `/config` (lmcache 0.5.6 omits their type)."""
    out = []
    for a in config.get("storage_manager", {}).get("l2_adapter_config", {}).get("adapters", []):
        kind, nodes = adapter_kind(a), set()
        if kind.startswith("valkey"):
            nodes = {(str(h), int(p)) for h, p in a["startup_nodes"]}
        elif kind == "resp":
            nodes = {(str(a["host"]), int(a["port"]))}
        skip = _NOT_IDENTITY | {"startup_nodes", "host", "port", "cluster_mode"}
        where = tuple(sorted((k, json.dumps(v)) for k, v in a.items() if k not in skip))
        out.append(L2Store(kind, frozenset(nodes), where))
    return out


def _get_config(admin: str, timeout_s: float) -> dict:
    host, port = _parse_daemon(admin)
    return admin_call(host, port, "/config", timeout_s)


def _config_findings(names: tuple[str, str], admins: tuple[str, str], timeout_s: float
                     ) -> list[Finding]:
    """Hash algorithm and L2 store of both daemons, from their admin API's /config."""
    out: list[Finding] = []
    cfgs = []
    for name, admin in zip(names, admins):
        try:
            cfgs.append(_get_config(admin, timeout_s))
        except ConnectorError as exc:
            return [Finding(False, f"daemon {name}'s admin API {admin}: /config unreadable "
                            f"({exc}); pass its --http-host:--http-port", EXIT_UNAVAILABLE)]
    hashes = [c.get("mp", {}).get("hash_algorithm") for c in cfgs]
    if hashes[0] != hashes[1]:
        return [Finding(False, f"hash algorithm: {names[0]} {hashes[0]}, {names[1]} {hashes[1]}: "
                        "the same tokens get other chunk keys (no sharing); start every daemon "
                        "with the same --hash-algorithm", EXIT_FAILED)]
    out.append(Finding(True, f"hash algorithm {hashes[0]} on both"))
    stores = [l2_stores(c) for c in cfgs]
    for name, s in zip(names, stores):
        if not s:
            out.append(Finding(False, f"daemon {name} has no --l2-adapter: what it stores stays "
                               "in its own L1 (no sharing); start it with the fleet's "
                               "--l2-adapter", EXIT_FAILED))
    if not all(stores):
        return out
    if not any(x.same_place(y) for x in stores[0] for y in stores[1]):
        out.append(Finding(False, f"different L2 stores: {names[0]} uses "
                           f"{'; '.join(x.describe() for x in stores[0])}, {names[1]} uses "
                           f"{'; '.join(y.describe() for y in stores[1])} (no sharing); give "
                           "every daemon the same --l2-adapter", EXIT_FAILED))
        return out
    out.append(Finding(True, f"one L2 store: {stores[0][0].describe()}"))
    if any(s.kind == "resp" for s in stores[0] + stores[1]):
        out.append(Finding(True, "note: the resp adapter has no timeout and never reconnects "
                           "(a restarted L2 server stays unused until each daemon restarts); "
                           "the valkey adapter bounds both"))
    pinged: set[tuple[str, int]] = set()
    for name, store in ((n, s) for n, ss in zip(names, stores) for s in ss):
        out += _node_findings(name, store, pinged, timeout_s)
    return out


def _node_findings(name: str, store: L2Store, pinged: set[tuple[str, int]], timeout_s: float
                   ) -> list[Finding]:
    """Each node of a daemon's store answers PING from here (once per node), and is a Redis
    Cluster node only where the adapter is valkey with cluster_mode."""
    out = []
    for host, port in sorted(store.nodes):
        try:
            info = resp_command(host, port, "INFO", "cluster", timeout_s=timeout_s)
        except RuntimeError:
            continue  # an error reply (NOAUTH) is still an answer
        except OSError as exc:
            if (host, port) not in pinged:
                out.append(Finding(False, f"L2 unreachable: {host}:{port} ({store.kind}) does "
                                   f"not answer from here ({exc}); every LOOKUP of the fleet "
                                   "waits on it", EXIT_UNAVAILABLE))
            pinged.add((host, port))
            continue
        pinged.add((host, port))
        if "cluster_enabled:1" in info and "cluster" not in store.kind:
            fix = ('add "cluster_mode": true to its --l2-adapter' if store.kind == "valkey" else
                   'the resp adapter does not speak Redis Cluster: use {"type": "valkey", '
                   '"startup_nodes": "h1:p1,h2:p2", "cluster_mode": true}')
            out.append(Finding(False, f"cluster_mode forgotten: {host}:{port} is a Redis Cluster "
                               f"node, but daemon {name}'s {store.kind} adapter treats it as one "
                               "server: its hits stop at the first chunk on another shard and "
                               f"those chunks' writes fail; {fix}", EXIT_FAILED))
            return out
    return out


def _round_trip(name: str, endpoint: str, admin: str, chunk: int, timeout_s: float) -> Finding:
    """The L2 canary on one daemon: its stores reach its L2 and load back from there."""
    host, port = _parse_daemon(endpoint)
    admin_host, admin_port = _parse_daemon(admin)
    if admin_host != host:
        return Finding(True, f"note: daemon {name}'s own L2 round trip not made (its admin API "
                       f"is on {admin_host}, not {host})")
    cfg = LoadBackConfig(mp_host=host, mp_port=port, mp_http_port=admin_port, chunk_size=chunk,
                         l2=L2(canary_deadline_ms=timeout_s * 1000))
    canary = L2Canary(lambda: cfg, product_metrics(CollectorRegistry()), background=False,
                      logger=_QUIET)
    try:
        result = canary.check()
    finally:
        canary.close(timeout_s)
    why = canary.last[1] if canary.last else ""
    if result == "ok":
        return Finding(True, f"stores through {name} reach its L2: a marker loaded back from L2 "
                       "byte-exact once its L1 copy was dropped")
    if result in ("lost", "wrong_bytes"):
        return Finding(False, f"stores through {name} do not reach its L2 ({result}): {why}",
                       EXIT_FAILED)
    return Finding(False, f"L2 unreachable through {name} ({result}): {why}", EXIT_UNAVAILABLE)


@dataclass
class _Side:
    name: str
    conn: LMCacheMPConnector


def _connect(name: str, endpoint: str, model: str, timeout_s: float) -> tuple[_Side | None, Finding]:
    host, port = _parse_daemon(endpoint)
    ep = f"tcp://{host}:{port}"
    probe = LMCacheMPConnector(ep, KVLayout(**_LAYOUT, chunk_size=1), model_name=model,
                               connect_timeout_s=timeout_s, transfer="pickle")
    try:
        chunk = probe.get_chunk_size(timeout_s)
    except ConnectorError as exc:
        probe.close()
        return None, Finding(False, f"daemon {name} {host}:{port}: no answer ({exc}); start it "
                             "or fix the address", EXIT_UNAVAILABLE)
    # a daemon with a pool answers a pickled load with slots (lmcache 0.5.6): use its pool
    conn = LMCacheMPConnector(ep, KVLayout(**_LAYOUT, chunk_size=chunk), model_name=model,
                              transport=probe.transport, transfer="auto")
    return _Side(name, conn), Finding(True, f"daemon {name} {host}:{port} answers, chunk size {chunk}")


def _release(side: _Side, rid: str, timeout_s: float) -> None:
    try:
        side.conn.end_session(rid, timeout_s)
    except ConnectorError:
        pass  # the daemon's session TTL ends it


def _poll_hit(a: _Side, b: _Side, toks: list[int], tag: str, t0: float, wait_s: float,
              timeout_s: float) -> tuple[str, int] | Finding:
    """LOOKUP the marker through B until a full hit (its request id, the LOOKUPs it took:
    its locks are the caller's to retrieve) or `wait_s` after `t0` (the finding)."""
    n, tries, deadline = len(toks), 0, t0 + wait_s
    while True:
        tries += 1
        rid = f"{tag}-lookup-b{tries}"
        try:
            hit = b.conn.lookup_hit_tokens(toks, rid, timeout_s, cache_salt=MARKER_SALT)
            if hit == n:
                return rid, tries
            b.conn.free_locks(toks, rid, 0, hit, timeout_s, cache_salt=MARKER_SALT)
        except ConnectorError as exc:
            _release(b, rid, timeout_s)
            return Finding(False, f"L2 unreachable: a LOOKUP on {b.name} did not answer "
                           f"({exc}); its L2 server hangs or was down when it started",
                           EXIT_UNAVAILABLE)
        _release(b, rid, timeout_s)
        if time.monotonic() >= deadline:
            why = ("no sharing: the daemons do not read and write one L2 (no --l2-adapter on one "
                   "of them, other servers, key_prefix or database, a cluster without "
                   "cluster_mode), or what A stores does not "
                   "reach it (resp after its server restarted: restart A); --admin-a/--admin-b "
                   "say which" if hit == 0 else "some chunks never reached L2 or were evicted "
                   "(maxmemory too small, allkeys-lru), lost around a reconnect, or sit on "
                   "shards a daemon without cluster_mode cannot reach")
            return Finding(False, f"{b.name} found {hit}/{n} marker tokens {wait_s:g} s after "
                           f"the STORE through {a.name}: {why}", EXIT_FAILED)
        time.sleep(0.05)


def _share(a: _Side, b: _Side, wait_s: float, timeout_s: float) -> list[Finding]:
    """STORE the marker through A, LOOKUP it through A (its L1: only L2's EXISTS can hang it),
    then through B until a full hit or `wait_s`, RETRIEVE and compare."""
    chunk = a.conn.chunk_size
    toks, pool = marker(chunk, MARKER_CHUNKS)
    n = len(toks)
    tag = f"fleet-{os.getpid()}-{time.monotonic_ns()}"
    for side in (a, b):
        side.conn.register(timeout_s)
    t0 = time.monotonic()
    rid = f"{tag}-store"
    try:
        a.conn.store_from(toks, rid, pool, torch.arange(n), timeout_s=timeout_s, cache_salt=MARKER_SALT)
    finally:
        _release(a, rid, timeout_s)
    rid = f"{tag}-lookup-a"
    try:
        hit = a.conn.lookup_hit_tokens(toks, rid, timeout_s, cache_salt=MARKER_SALT)
        a.conn.free_locks(toks, rid, 0, hit, timeout_s, cache_salt=MARKER_SALT)
    except ConnectorError as exc:
        return [Finding(False, f"L2 unreachable: a LOOKUP on {a.name} of the marker in its own L1 "
                        f"did not answer ({exc}); each LOOKUP waits on L2's EXISTS: the L2 server "
                        "hangs, or was down when the daemon started (resp then never recovers: "
                        "restart the daemon once L2 answers)", EXIT_UNAVAILABLE)]
    finally:
        _release(a, rid, timeout_s)
    out = [Finding(True, f"marker of {n} tokens stored through {a.name}, LOOKUP there "
                   f"{hit}/{n} in {(time.monotonic() - t0) * 1e3:.0f} ms from the STORE")]
    polled = _poll_hit(a, b, toks, tag, t0, wait_s, timeout_s)
    if isinstance(polled, Finding):
        return out + [polled]
    rid, tries = polled
    took_ms = (time.monotonic() - t0) * 1e3
    dst = torch.arange(n, 2 * n)
    try:
        got = b.conn.retrieve_into(toks, rid, pool, dst, start=0, end=n, timeout_s=timeout_s,
                                   cache_salt=MARKER_SALT)
        if got.commit is not None:
            got.commit(timeout_s)
    finally:
        _release(b, rid, timeout_s)
    same = all(torch.equal(t[:n], t[n:]) for t in list(pool.k_buffer) + list(pool.v_buffer))
    if not same:
        return out + [Finding(False, f"{b.name} loaded other bytes than {a.name} stored: one "
                              "model name is used for two layouts (the L2 key has no layout); "
                              "give each its own model name", EXIT_FAILED)]
    return out + [Finding(True, f"{b.name} hit {n}/{n} through L2 {took_ms:.0f} ms after the "
                          f"STORE ({tries} LOOKUP{'s' if tries > 1 else ''}) and loaded it byte-exact")]


def check(a: str, b: str, *, models: tuple[str, str] = ("loadback", "loadback"),
          admins: tuple[str, str] | None = None, wait_s: float = 5.0,
          timeout_s: float = 5.0) -> list[Finding]:
    """Every finding in order; the checks stop at the first one that rules sharing out."""
    if models[0] != models[1]:
        return [Finding(False, f"model name: A's engines use {models[0]!r}, B's {models[1]!r}: "
                        "their L2 keys never meet (no sharing); one model, one name on every "
                        "engine, and each KV layout its own", EXIT_FAILED)]
    out: list[Finding] = []
    sides = []
    try:
        for name, ep in (("A", a), ("B", b)):
            side, f = _connect(name, ep, models[0], timeout_s)
            out.append(f)
            if side is None:
                return out
            sides.append(side)
        ca, cb = (s.conn.chunk_size for s in sides)
        if ca != cb:
            return out + [Finding(False, f"chunk size: A {ca}, B {cb}: the L2 key names no "
                                  "layout, so chunks of one are no chunks of the other; start "
                                  "every daemon with the same --chunk-size", EXIT_FAILED)]
        if admins:
            out += _config_findings(("A", "B"), admins, timeout_s)
            if any(not f.ok for f in out):
                return out
            out += [_round_trip(n, ep, adm, ca, timeout_s)
                    for n, ep, adm in zip(("A", "B"), (a, b), admins)]
            if any(not f.ok for f in out):
                return out
        try:
            return out + _share(sides[0], sides[1], wait_s, timeout_s)
        except ConnectorError as exc:  # registration or the STORE: the daemon, not L2
            return out + [Finding(False, f"a call to a daemon failed: {exc}", EXIT_UNAVAILABLE)]
    finally:
        for s in sides:
            try:
                s.conn.unregister(timeout_s)
            except ConnectorError:
                pass
            s.conn.close()


def run(args) -> int:
    """0 when B loaded A's marker byte-exact; 69 when a daemon or the L2 does not answer;
    1 for any other finding that rules sharing out; 64 for bad addresses."""
    models = list(args.model_name or ["loadback"])
    if len(models) > 2 or bool(args.admin_a) != bool(args.admin_b):
        print("FAIL usage: --model-name at most twice (A's, then B's); --admin-a and --admin-b "
              "go together (each daemon's --http-host:--http-port)")
        return EXIT_USAGE
    admins = (args.admin_a, args.admin_b) if args.admin_a else None
    try:
        for addr in [args.a, args.b, *(admins or ())]:
            _parse_daemon(addr)
    except ValueError as exc:
        print(f"FAIL usage: {exc}")
        return EXIT_USAGE
    findings = check(args.a, args.b, models=(models[0], models[-1]), admins=admins,
                     wait_s=args.wait_s, timeout_s=args.timeout_s)
    for f in findings:
        print(f)
    codes = {f.code for f in findings if not f.ok}
    if EXIT_UNAVAILABLE in codes:
        return EXIT_UNAVAILABLE
    return EXIT_FAILED if codes else EXIT_OK
