"""The L2 canary: does what this engine's daemon stores reach its L2 store?

LMCache 0.5.6's `resp` adapter reports a store that never reaches L2 as a success: once its
server restarted it never reconnects, the daemon logs one WARNING per lost write, and its
`/status` still says `is_healthy: true` (it reports nothing else about L2). So the canary
proves it end to end, through the daemon's own L2 path: every `l2.canary_interval_ms`, off the
request path on its own thread, it

1. stores a marker prefix (MARKER_CHUNKS chunks of random tokens, its own model name and salt:
   no engine's key, and a tiny KV layout) through the daemon, through its shared-memory
   pool where it offers one (lmcache 0.5.6 answers a pickled load there with slots), else
   by pickle;
2. waits, within the check's deadline, until the daemon's store controllers hold nothing
   pending or in flight (`/status`): the L2 write starts after STORE returns;
3. drops the marker's L1 copy (`DELETE /cache/objects`, tier l1; its keys computed here as the
   daemon computes them, with lmcache's own resolver and the daemon's hash algorithm): a key
   still locked by its L2 write is skipped, and dropped again until it is free;
4. LOOKUPs the marker through the same daemon, which now only its L2 can answer, and loads
   it back byte for byte; then deletes it from L2 (each check writes a new one).

Redis' own EXISTS would show the keys but needs the store's address, credentials and cluster
routing here, and says nothing of the daemon's read path; a second daemon is not ours to have.
Each check runs under `l2.canary_deadline_ms` as a whole. It needs the daemon's admin API
(`mp_http_port`), whose `/config` also says whether the daemon has an L2 at all: without one,
the canary idles (`loadback_l2_canary_interval_seconds` 0). A LOOKUP that timed out is owed a
release: the next check settles it first, and counts `timeout` while it still runs.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable

import torch

from lmcache_loadback.connectors.daemon_settings import adapter_kind, admin_call, read_settings
from lmcache_loadback.connectors.errors import ConnectorError, DaemonTimeout
from lmcache_loadback.connectors.kv_layout import KVLayout, KVPool
from lmcache_loadback.connectors.lmcache_mp import LMCacheMPConnector
from lmcache_loadback.metrics import LoadbackMetrics

from .config import LoadBackConfig
from .l2_marker import (CANARY_MODEL, CANARY_SALT, MARKER_CHUNKS, MARKER_LAYOUT,
                        KeysUnavailable, marker, object_keys)

log = logging.getLogger("loadback")

__all__ = ["L2Canary", "MARKER_CHUNKS", "MARKER_LAYOUT", "marker", "object_keys",
           "start_l2_canary"]

#: How often the daemon's store queue and a locked L1 copy are looked at again.
POLL_S = 0.01
#: The floor of an admin API call's timeout (a clean-up made as the deadline ends).
MIN_CALL_S = 0.05
#: Keys of earlier markers kept for deletion (the rest is left to the store's eviction).
MAX_LEFTOVER_KEYS = 64 * MARKER_CHUNKS
#: Where the canary is off, how often it reads the config again (live reload).
IDLE_RECHECK_S = 1.0


#: What `lost` means, by the daemon's (first) L2 adapter, with the fix.
_LOST_HINTS = {
    "resp": "the resp adapter never reconnects after its server restarted: restart the daemon "
            "(or move it to the valkey adapter); resp does not speak Redis Cluster either",
    "valkey": "the valkey adapter's server is down, hung or full (each write failed within "
              "request_timeout; it reconnects by itself once the server answers); a Redis "
              'Cluster needs "cluster_mode": true',
    "valkey cluster": "a shard of the cluster is down, hung or full (the chunks on it are "
                      "lost; set cluster-require-full-coverage no on every shard)",
    "other": "check the L2 store and the daemon's log (`Store task N to adapter 0 failed`)",
}


class _Verdict(Exception):
    """Ends a check with its result and the line that says why."""

    def __init__(self, result: str, why: str) -> None:
        super().__init__(why)
        self.result = result


class L2Canary:
    """One per engine (its TP rank 0 that holds KV: the factory starts it). `check` runs on
    the canary's thread (tests call it directly with `background=False`); `close` on the
    orchestrator's closing thread. Only `_stop` crosses threads."""

    def __init__(self, config: Callable[[], LoadBackConfig], metrics: LoadbackMetrics, *,
                 background: bool = True, clock: Callable[[], float] = time.monotonic,
                 logger: logging.Logger = log) -> None:
        self.config = config  # read at every check: live reload applies
        self.metrics = metrics
        self.log = logger
        self.clock = clock
        self._conn: LMCacheMPConnector | None = None
        #: A LOOKUP that timed out: (token ids, request id, epoch), settled by the next check.
        self._owed: tuple[list[int], str, int] | None = None
        #: Keys of earlier markers that may still sit in L1 or L2 (a check that ended before
        #: dropping or deleting them): dropped first, deleted from L2 at the next ok.
        self._leftovers: list[dict] = []
        self.checks = 0  # checks made (tests wait on it)
        self._failing: str | None = None  # the result of the run of failures now, if any
        self._said: set[str] = set()  # lasting causes already logged
        self._lost_hint = _LOST_HINTS["other"]
        self.last: tuple[str, str] | None = None  # (result, why) of the last check
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        metrics.l2_canary_running(0)
        if background:
            self._thread = threading.Thread(target=self._loop, name="loadback-l2-canary",
                                            daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ the thread

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                cfg = self.config()
                interval = cfg.l2.canary_interval_ms / 1000
                if interval <= 0 or not cfg.mp_http_port:  # off (both reload live)
                    self.metrics.l2_canary_running(0)
                    self._stop.wait(IDLE_RECHECK_S)
                    continue
                self.check()
                self._stop.wait(interval)
        finally:
            self._release()

    @property
    def owes_release(self) -> bool:
        """A check's LOOKUP timed out and is not released yet (a close could not settle it)."""
        return self._owed is not None

    def close(self, timeout_s: float) -> None:
        """Stop the thread, which unregisters as it ends (a check in progress ends within
        its deadline; past `timeout_s` it is left to finish on its own)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        else:
            self._release()

    def _release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            control_s = self.config().deadlines.control_ms / 1000
            end = self.clock() + control_s
            while self._owed is not None:  # a timed-out LOOKUP's locks, within the budget
                try:
                    self._settle_owed(conn, lambda: max(MIN_CALL_S, end - self.clock()))
                except _Verdict:  # its prefetch still runs
                    if self.clock() >= end:
                        break  # the daemon's read TTL ends it
                    time.sleep(POLL_S)
            try:
                conn.unregister(control_s)
            except ConnectorError:
                pass  # the daemon's reaper ends it
            conn.close()

    # ------------------------------------------------------------------ one check

    def check(self) -> str | None:
        """One check; its result (counted in `loadback_l2_canary_checks_total`), or None when
        there is nothing to check (the daemon has no L2 adapter)."""
        cfg = self.config()
        self.checks += 1
        try:
            result, why = self._check(cfg), ""
        except _Verdict as v:
            result, why = v.result, str(v)
        except KeysUnavailable as exc:  # lasting: said once at WARNING, not each check
            result, why = "unchecked", str(exc)
            if why not in self._said:
                self._said.add(why)
                self.log.warning("L2 canary: no check can be made: %s", why)
        except Exception as exc:  # noqa: BLE001 - the thread outlives any bug in one check
            self.log.exception("L2 canary check failed")
            result, why = "unchecked", f"the check raised {exc!r}"
        if result is None:
            self.metrics.l2_canary_running(0)
            return None
        self.metrics.l2_canary_running(cfg.l2.canary_interval_ms / 1000)
        self.metrics.l2_canary_checked(result)
        self.last = (result, why)
        self._say(cfg, result, why)
        return result

    def _say(self, cfg: LoadBackConfig, result: str, why: str) -> None:
        """One WARNING when checks start failing (or fail another way), one when they pass
        again; `unchecked` at DEBUG (the daemon's own state has its lines and alert)."""
        if result == "ok":
            if self._failing is not None:
                self.log.warning("L2 canary: the daemon %s's L2 works again: the marker was "
                                 "loaded back from L2 byte-exact", cfg.endpoint)
            self._failing = None
        elif result == "unchecked":
            self.log.debug("L2 canary: check not made: %s", why)
        elif result != self._failing:
            self._failing = result
            self.log.warning("L2 canary %s: %s", result, why)

    def _check(self, cfg: LoadBackConfig) -> str | None:
        budget = cfg.l2.canary_deadline_ms / 1000
        host, port = cfg.mp_host, cfg.mp_http_port
        try:
            settings = read_settings(host, port, budget)
        except ConnectorError as exc:
            raise _Verdict("unchecked", str(exc)) from None
        if not settings.l2_adapters:
            return None
        kind = adapter_kind(settings.l2_adapters[0])
        self._lost_hint = _LOST_HINTS.get(kind, _LOST_HINTS["other"])
        conn = self._connector(cfg, settings.chunk_size)
        toks, pool = marker(settings.chunk_size, MARKER_CHUNKS)
        n = len(toks)
        keys = object_keys(CANARY_MODEL, toks, CANARY_SALT, settings.chunk_size,
                           settings.hash_algorithm)
        deadline = self.clock() + budget
        left = lambda: max(0.0, deadline - self.clock())  # noqa: E731
        self._settle_owed(conn, left)
        self._drop_l1(host, port, self._leftovers, left, "an earlier marker's L2 write still "
                      "waits on the L2 store: it hangs")
        rid = f"l2-canary-{os.getpid()}-{self.checks}"
        try:
            conn.register(left())  # every check: the daemon reaps registrations silent 120 s
            try:
                if not conn.store_from(toks, f"{rid}-store", pool, torch.arange(n),
                                       timeout_s=left(), cache_salt=CANARY_SALT):
                    raise _Verdict("unchecked", "the daemon did not take the marker's STORE")
            finally:
                self._end(conn, f"{rid}-store", left)
        except DaemonTimeout as exc:
            raise _Verdict("timeout", f"the daemon {cfg.endpoint} did not take the marker "
                           f"within {budget:g} s ({exc})") from None
        except ConnectorError as exc:
            raise _Verdict("unchecked", f"the daemon {cfg.endpoint}: {exc}") from None
        self._leftovers = (self._leftovers + keys)[-MAX_LEFTOVER_KEYS:]
        backlog = self._store_backlog(host, port, left)
        dropped = self._drop_l1(host, port, keys, left, f"the marker's L2 write did not end "
                                f"within {cfg.l2.canary_deadline_ms:g} ms of its STORE: the "
                                "L2 store hangs or is too slow")
        if not dropped:
            raise _Verdict("unchecked", "the marker's keys as computed here were not in the "
                           "daemon's L1: this process cannot compute its hash algorithm's keys")
        result = self._load_back(conn, cfg, toks, pool, f"{rid}-lookup", left, backlog)
        try:  # each check writes a new marker: leave none behind, in L1 or L2
            self._delete(host, port, self._leftovers, "all", left)
            self._leftovers = []
        except _Verdict:
            pass  # the next ok deletes them, or the store's eviction
        return result

    def _connector(self, cfg: LoadBackConfig, chunk_size: int) -> LMCacheMPConnector:
        if self._conn is not None and self._conn.chunk_size != chunk_size:
            self._conn.close()
            self._conn = None
        if self._conn is None:
            self._conn = LMCacheMPConnector(
                cfg.endpoint, KVLayout(**MARKER_LAYOUT, chunk_size=chunk_size),
                model_name=CANARY_MODEL, transfer="auto",
                connect_timeout_s=cfg.deadlines.connect_ms / 1000)
        return self._conn

    def _end(self, conn: LMCacheMPConnector, rid: str, left: Callable[[], float]) -> None:
        try:
            conn.end_session(rid, max(left(), MIN_CALL_S))
        except ConnectorError:
            pass  # the daemon's session TTL ends it

    def _settle_owed(self, conn: LMCacheMPConnector, left: Callable[[], float]) -> None:
        """Release the LOOKUP an earlier check left unanswered; while it still runs (its
        prefetch waits on L2), this check is a timeout too and sends nothing new."""
        if self._owed is None:
            return
        toks, rid, epoch = self._owed
        if conn.epoch != epoch:  # that daemon is gone, and what it held with it
            self._owed = None
            return
        if conn.unanswered(rid):
            # A LOOKUP the daemon may still serve: an abandon served first finds no job
            # (nothing freed, the session ended), and the LOOKUP then holds it all again.
            raise _Verdict("timeout", "the daemon has not answered the LOOKUP of an earlier "
                           "check yet")
        try:
            done = conn.abandon_lookup(toks, rid, left(), cache_salt=CANARY_SALT)
        except ConnectorError:
            done = False
        if not done:
            raise _Verdict("timeout", "the LOOKUP of an earlier check still waits on the L2 "
                           "store: it hangs (the resp adapter has no timeout)")
        self._owed = None
        self._end(conn, rid, left)

    def _delete(self, host: str, port: int, keys: list[dict], tier: str,
                left: Callable[[], float]) -> dict:
        try:
            return admin_call(host, port, "/cache/objects", max(left(), MIN_CALL_S),
                              method="DELETE", body={"keys": keys, "tier": tier})
        except ConnectorError as exc:
            raise _Verdict("unchecked", str(exc)) from None

    def _store_backlog(self, host: str, port: int, left: Callable[[], float]) -> int:
        """Wait, at most half what is left of the check, until the daemon's store queue holds
        nothing pending or in flight: the keys it still holds then."""
        backlog, until = -1, left() / 2
        while backlog != 0 and left() > until:
            try:
                st = admin_call(host, port, "/status", left())
            except ConnectorError as exc:
                raise _Verdict("unchecked", str(exc)) from None
            stores = st.get("storage_manager", {}).get("store_controllers", {}).values()
            backlog = sum(int(s.get("pending_keys_count", 0))
                          + int(s.get("in_flight_task_count", 0)) for s in stores)
            if backlog:
                time.sleep(min(POLL_S, max(0.0, left() - until)))
        return max(backlog, 0)

    def _drop_l1(self, host: str, port: int, keys: list[dict], left: Callable[[], float],
                 hung: str) -> int:
        """Drop the L1 copy of `keys`: the number dropped. A key its L2 write still holds is
        skipped by the daemon, and dropped again until it is free (a timeout past the
        check's deadline, saying `hung`)."""
        if not keys:
            return 0
        while True:
            r = self._delete(host, port, keys, "l1", left)
            if not r.get("skipped"):
                return int(r.get("deleted", 0))
            if left() <= 2 * POLL_S:
                raise _Verdict("timeout", hung)
            time.sleep(POLL_S)

    def _load_back(self, conn: LMCacheMPConnector, cfg: LoadBackConfig, toks: list[int],
                   pool: KVPool, rid: str, left: Callable[[], float], backlog: int) -> str:
        n = len(toks)
        try:
            hit = conn.lookup_hit_tokens(toks, rid, left(), cache_salt=CANARY_SALT)
        except DaemonTimeout:
            self._owed = (toks, rid, conn.epoch)
            raise _Verdict("timeout", f"a LOOKUP on the daemon {cfg.endpoint} of the marker, "
                           f"only in L2, did not answer within the check's "
                           f"{cfg.l2.canary_deadline_ms:g} ms: its L2 store hangs") from None
        except ConnectorError as exc:
            self._end(conn, rid, left)
            raise _Verdict("unchecked", f"the daemon {cfg.endpoint}: {exc}") from None
        try:
            if hit < n:
                conn.free_locks(toks, rid, 0, hit, max(left(), MIN_CALL_S), cache_salt=CANARY_SALT)
                busy = (f"; its store queue still held {backlog} keys when the L1 copy was "
                        "dropped (L2 writes lag)" if backlog else "")
                raise _Verdict("lost", f"the daemon {cfg.endpoint} took the marker's STORE but "
                               f"its L2 holds {hit} of {n} tokens{busy}: stores are lost "
                               f"silently; {self._lost_hint}")
            got = conn.retrieve_into(toks, rid, pool, torch.arange(n, 2 * n), start=0, end=n,
                                     timeout_s=left(), cache_salt=CANARY_SALT)
            if got.commit is not None:
                got.commit(max(left(), MIN_CALL_S))
        except DaemonTimeout as exc:
            raise _Verdict("timeout", f"loading the marker back from {cfg.endpoint}: "
                           f"{exc}") from None
        except ConnectorError as exc:
            raise _Verdict("unchecked", f"the daemon {cfg.endpoint}: {exc}") from None
        finally:
            self._end(conn, rid, left)
        bufs = list(pool.k_buffer) + list(pool.v_buffer)
        if not all(torch.equal(t[:n], t[n:]) for t in bufs):
            raise _Verdict("wrong_bytes", f"the marker loaded back from the L2 of "
                           f"{cfg.endpoint} holds other bytes than were stored")
        return "ok"


def start_l2_canary(orch) -> L2Canary:
    """The canary of an orchestrator's daemon, on its own thread, stopped by `orch.close()`."""
    canary = orch.l2_canary = L2Canary(lambda: orch.config, orch.metrics)
    orch.on_close(lambda: canary.close(orch.config.deadlines.close_ms / 1000))
    return canary
