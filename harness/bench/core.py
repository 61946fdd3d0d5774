"""`loadback bench core`: what the orchestrator itself costs, and how it keeps deadlines.

P2-P5 (`p2_p4_p5`, `p3`) and P6 (`p6`), each against its target; contenders alternate within
one run, figures are medians (p99 where stated). Exit code: 1 when any target is missed (each
is printed MET or MISS), else 0.
"""

from __future__ import annotations

import multiprocessing
import threading
import time

import torch
import zmq

from lmcache_loadback.connectors.base import Retrieved
from lmcache_loadback.testing.daemon import DaemonProcess
from lmcache_loadback.connectors.errors import ConnectorError
from lmcache_loadback.connectors.kv_layout import KVLayout, KVPool
from lmcache_loadback.connectors.lmcache_mp import LMCacheMPConnector
from lmcache_loadback.harness.bench.common import fmt, median, percentile, print_table, write_json
from lmcache_loadback.orchestrator.config import LoadBackConfig
from lmcache_loadback.orchestrator.core import LoadBackOrchestrator

LAYOUT = KVLayout(num_layers=4, num_heads=8, head_dim=128, dtype=torch.float16, chunk_size=256)


class NullConnector:
    """Answers like a daemon that holds everything, moving no bytes (no I/O at all)."""

    layout = LAYOUT
    chunk_size = LAYOUT.chunk_size
    endpoint = "null"
    transfer = transfer_setting = "null"  # no daemon's transfer mode: never asked to prepare
    writer = True
    epoch = 0
    late_replies = 0
    fences_dropped = 0

    def register(self, t): return None
    def ping(self, t): return True
    def unregister(self, t): return None
    def get_chunk_size(self, t): return LAYOUT.chunk_size
    def lookup_hit_tokens(self, toks, rid, t, *, cache_salt="", wait_s=0.0):
        return len(toks) // 256 * 256
    def free_locks(self, *a, **k): return None
    def abandon_lookup(self, *a, **k): return True
    def end_session(self, rid, t): return None
    def unanswered(self, request_id=None): return 0
    def close(self): return None

    def prepare(self, *a, **k):
        raise NotImplementedError("the null connector has no prepare step (transfer 'null')")

    def retrieve_into(self, toks, rid, pool, slots, *, start, end, timeout_s, skip=0,
                      cache_salt="", prepared=None, retrieval=None):
        return Retrieved((end - start) * LAYOUT.bytes_per_token)

    def store_from(self, *a, **k): return True


def _echo_server(endpoint: str, ready) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(endpoint)
    ready.set()
    while True:
        frames = sock.recv_multipart()
        if frames[-1] == b"stop":
            sock.send_multipart(frames)
            break
        sock.send_multipart(frames)
    sock.close(linger=0)
    ctx.term()


class RoundTrip:
    """One bare pyzmq DEALER->ROUTER->DEALER round trip on loopback (echo in its own process)."""

    def __init__(self) -> None:
        from lmcache_loadback.connectors.ports import free_port

        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        ctx = multiprocessing.get_context("spawn")
        ready = ctx.Event()
        self.proc = ctx.Process(target=_echo_server, args=(self.endpoint, ready), daemon=True)
        self.proc.start()
        ready.wait(30)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.connect(self.endpoint)
        for _ in range(200):
            self.once()

    def once(self) -> float:
        t0 = time.perf_counter()
        self.sock.send_multipart([b"\x01", b"\x18"])
        self.sock.recv_multipart()
        return time.perf_counter() - t0

    def close(self) -> None:
        self.sock.send_multipart([b"stop"])
        self.sock.recv_multipart()
        self.proc.join(10)
        self.sock.close(linger=0)
        self.ctx.term()


def _orch(connector, **over) -> LoadBackOrchestrator:
    cfg = LoadBackConfig.from_dict({"chunk_size": 256, "heartbeat": {"enabled": False}, **over})
    pool = KVPool([torch.empty(0)], [torch.empty(0)])
    o = LoadBackOrchestrator(cfg, connector, kv_pool=pool, start_heartbeat=False)
    o.tick()
    return o


def _lifecycle(o: LoadBackOrchestrator, rid: str, toks, slots) -> float:
    t0 = time.perf_counter()
    n = o.match(rid, toks).tokens
    o.load_back(rid, slots[:n])
    o.finish(rid)
    return time.perf_counter() - t0


def p2_p4_p5(samples: int) -> dict:
    """P2: lifecycle overhead (match, load_back, finish) over a connector that does no I/O,
    as a ratio to one loopback pyzmq round trip measured in the same run (target <= 1.0).
    P4: match with the breaker open, as a ratio to one round trip (target <= 0.2). P5:
    per-lifecycle cost with 10,000 live prefixes vs 100 (target <= 1.2)."""
    rt = RoundTrip()
    try:
        toks = list(range(1024))
        slots = torch.arange(1024)
        orch = _orch(NullConnector())
        broken = _orch(NullConnector(), breaker={"consecutive_failures": 1})
        broken.breaker.record(False)  # open; its cooldown is long enough for the run
        rts, life, opened = [], [], []
        for i in range(samples):
            rts.append(rt.once())
            life.append(_lifecycle(orch, f"p2-{i}", toks, slots))
            t0 = time.perf_counter()
            broken.match(f"p4-{i}", toks)
            opened.append(time.perf_counter() - t0)
        scale = {}
        for live in (100, 10_000):
            o = _orch(NullConnector())
            for j in range(live):
                o.match(f"live-{j}", toks)  # marked, never loaded: live prefixes
            scale[live] = o
        s100, s10k = [], []
        for i in range(samples):
            s100.append(_lifecycle(scale[100], f"s-{i}", toks, slots))
            s10k.append(_lifecycle(scale[10_000], f"s-{i}", toks, slots))
        assert scale[10_000].live_prefixes() == 10_000
        return {
            "round_trip_us": median(rts) * 1e6,
            "lifecycle_us": median(life) * 1e6,
            "breaker_open_match_us": median(opened) * 1e6,
            "lifecycle_100_live_us": median(s100) * 1e6,
            "lifecycle_10k_live_us": median(s10k) * 1e6,
            "p2_overhead_ratio": median(life) / median(rts),
            "p4_breaker_open_ratio": median(opened) / median(rts),
            "p5_scale_ratio": median(s10k) / median(s100),
        }
    finally:
        rt.close()


def p3(samples: int) -> dict:
    """P3, deadlines against a hung (SIGSTOPped) real daemon: p99 return time of match and
    load_back minus their deadlines (target <= 5 ms), beside what LMCache's own client does
    (waits mq_timeout). The breaker is kept out of the way (it would answer in
    microseconds) so every call really waits on the socket."""
    lookup_ms, retrieve_ms = 20.0, 50.0
    layout = KVLayout(num_layers=2, num_heads=4, head_dim=16, dtype=torch.float16, chunk_size=16)
    d = DaemonProcess(chunk_size=16).start()
    pool = KVPool([torch.zeros(4096, 4, 16, dtype=torch.float16) for _ in range(2)],
                  [torch.zeros(4096, 4, 16, dtype=torch.float16) for _ in range(2)])
    cfg = LoadBackConfig.from_dict({
        "mp_port": d.port, "chunk_size": 16, "retries": {"max_attempts": 3},
        "deadlines": {"lookup_ms": lookup_ms, "retrieve_base_ms": retrieve_ms,
                      "retrieve_per_ki_token_ms": 0, "retrieve_max_ms": retrieve_ms},
        "heartbeat": {"interval_ms": 100}})
    orch = LoadBackOrchestrator(cfg, LMCacheMPConnector(d.endpoint, layout), kv_pool=pool)
    orch.breaker.record = lambda ok: None  # keep it closed: P4 measures the open breaker
    out: dict = {"lookup_deadline_ms": lookup_ms, "retrieve_deadline_ms": retrieve_ms}
    try:
        if not orch.wait_registered(30):
            raise RuntimeError("orchestrator did not register with the daemon")
        toks = list(range(256))
        if not orch.store("seed", toks, torch.arange(256)):
            raise RuntimeError("could not store the seed prefix")
        orch.finish("seed")
        marked = [f"m{i}" for i in range(samples)]
        for rid in marked:
            if orch.match(rid, toks).tokens != 256:
                raise RuntimeError("expected a hit before the daemon hangs")
        d.pause()
        m_times, l_times = [], []
        for i, rid in enumerate(marked):
            t0 = time.perf_counter()
            orch.match(f"h{i}", toks)
            m_times.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            orch.load_back(rid, torch.arange(512, 768))
            l_times.append(time.perf_counter() - t0)
        out.update({
            "match_p50_ms": median(m_times) * 1e3, "match_p99_ms": percentile(m_times, 99) * 1e3,
            "load_back_p50_ms": median(l_times) * 1e3,
            "load_back_p99_ms": percentile(l_times, 99) * 1e3,
        })
        out["p3_match_p99_over_deadline_ms"] = out["match_p99_ms"] - lookup_ms
        out["p3_load_back_p99_over_deadline_ms"] = out["load_back_p99_ms"] - retrieve_ms
        out["lmcache_client_wait_s"] = _lmcache_client_wait(d.endpoint, mq_timeout_s=0.5)
        out["lmcache_client_mq_timeout_s"] = 0.5
    finally:
        d.resume()
        orch.close()
        d.stop()
    return out


def p6(deadline_ms: float = 50.0) -> dict:
    """P6: SIGKILL the real daemon while one thread calls LOOKUP back to back (50 ms
    deadlines): time from the kill to the first call that returns in under 1 ms, and how
    many calls paid the whole deadline."""
    layout = KVLayout(num_layers=2, num_heads=4, head_dim=16, dtype=torch.float16, chunk_size=16)
    d = DaemonProcess(chunk_size=16).start()
    conn = LMCacheMPConnector(d.endpoint, layout, connect_timeout_s=0.2)
    deadline_s = deadline_ms / 1000
    calls: list[tuple[float, float]] = []  # (start, end), perf_counter
    stop = threading.Event()

    def caller() -> None:
        toks = list(range(256))
        for i in range(200_000):  # bounded; stopped long before
            if stop.is_set():
                return
            t0 = time.perf_counter()
            try:
                conn.lookup_hit_tokens(toks, f"p6-{i}", deadline_s)
            except ConnectorError:
                pass
            calls.append((t0, time.perf_counter()))

    th = threading.Thread(target=caller, daemon=True)
    try:
        conn.register(5.0)
        th.start()
        until = time.monotonic() + 10
        while len(calls) < 50 and time.monotonic() < until:
            time.sleep(0.001)
        t_kill = time.perf_counter()
        d.kill()
        t_reaped = time.perf_counter()
        until = time.monotonic() + 5
        first_fast = None
        while first_fast is None and time.monotonic() < until:
            time.sleep(0.001)
            first_fast = next((e for s, e in list(calls) if e > t_kill and e - s < 0.001), None)
        stop.set()
        th.join(5)
        after = [(s, e) for s, e in calls if e > t_kill]
        return {
            "p6_deadline_ms": deadline_ms,
            "p6_kill_to_first_fast_call_ms":
                None if first_fast is None else (first_fast - t_kill) * 1e3,
            "p6_calls_paid_full_deadline": sum(1 for s, e in after if e - s >= deadline_s),
            "p6_calls_after_kill": len(after),
            "p6_paid_after_sockets_closed": sum(
                1 for s, e in after if s > t_reaped and e - s >= deadline_s),
            # The kernel closes the daemon's sockets only once its memory is torn down.
            "p6_kill_to_reaped_ms": (t_reaped - t_kill) * 1e3,
        }
    finally:
        stop.set()
        conn.close()
        d.stop()


def _lmcache_client_wait(endpoint: str, mq_timeout_s: float) -> float:
    """LMCache's own client against the same hung daemon: it blocks for its whole
    mq_timeout (300 s by default) and neither retries nor cancels."""
    from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

    client = RequestClientFactory.create(endpoint)
    try:
        t0 = time.perf_counter()
        try:
            client.noop().result(timeout=mq_timeout_s)
        except Exception:  # its TimeoutError; anything else is reported the same way
            pass
        return time.perf_counter() - t0
    finally:
        client.close()


def run(args) -> int:
    samples = args.samples or 2000
    core = p2_p4_p5(samples)
    hung = p3(min(200, max(50, samples // 10)))
    killed = p6()
    fast_ms = killed["p6_kill_to_first_fast_call_ms"]
    print_table(["figure", "value", "target"], [
        ["loopback pyzmq round trip, median (us)", fmt(core["round_trip_us"], 1), ""],
        ["lifecycle match+load_back+finish, median (us)", fmt(core["lifecycle_us"], 1), ""],
        ["P2 lifecycle / round trip", fmt(core["p2_overhead_ratio"]), "<= 1.0 (stretch 0.5)"],
        ["match with breaker open, median (us)", fmt(core["breaker_open_match_us"], 2), ""],
        ["P4 breaker-open match / round trip", fmt(core["p4_breaker_open_ratio"], 3), "<= 0.2"],
        ["lifecycle with 100 live prefixes (us)", fmt(core["lifecycle_100_live_us"], 1), ""],
        ["lifecycle with 10,000 live prefixes (us)", fmt(core["lifecycle_10k_live_us"], 1), ""],
        ["P5 10k / 100 live", fmt(core["p5_scale_ratio"]), "<= 1.2"],
        [f"hung daemon: match p50 / p99 (ms), deadline {hung['lookup_deadline_ms']:.0f}",
         f"{fmt(hung['match_p50_ms'])} / {fmt(hung['match_p99_ms'])}", ""],
        ["P3 match p99 - deadline (ms)", fmt(hung["p3_match_p99_over_deadline_ms"]), "<= 5"],
        [f"hung daemon: load_back p50 / p99 (ms), deadline {hung['retrieve_deadline_ms']:.0f}",
         f"{fmt(hung['load_back_p50_ms'])} / {fmt(hung['load_back_p99_ms'])}", ""],
        ["P3 load_back p99 - deadline (ms)", fmt(hung["p3_load_back_p99_over_deadline_ms"]), "<= 5"],
        [f"LMCache's own client, same hung daemon, mq_timeout {hung['lmcache_client_mq_timeout_s']} s"
         " (default 300 s): waited (s)", fmt(hung["lmcache_client_wait_s"], 3), ""],
        [f"P6 SIGKILL -> first call back in < 1 ms (ms), deadline {killed['p6_deadline_ms']:.0f}",
         "never" if fast_ms is None else fmt(fast_ms), ""],
        ["P6 SIGKILL -> daemon reaped, its sockets closed (ms)",
         fmt(killed["p6_kill_to_reaped_ms"]), ""],
        ["P6 calls after SIGKILL that paid the whole deadline (sent while it was dying)",
         f"{killed['p6_calls_paid_full_deadline']} of {killed['p6_calls_after_kill']}", ""],
        ["P6 ... of them sent after its sockets closed",
         str(killed["p6_paid_after_sockets_closed"]), "0"],
    ], title=f"loadback bench core ({samples} samples; medians unless stated)")
    targets = {
        "p2_overhead_ratio": core["p2_overhead_ratio"] <= 1.0,
        "p3_match_p99_over_deadline_ms": hung["p3_match_p99_over_deadline_ms"] <= 5,
        "p3_load_back_p99_over_deadline_ms": hung["p3_load_back_p99_over_deadline_ms"] <= 5,
        "p4_breaker_open_ratio": core["p4_breaker_open_ratio"] <= 0.2,
        "p5_scale_ratio": core["p5_scale_ratio"] <= 1.2,
        "p6_paid_after_sockets_closed": killed["p6_paid_after_sockets_closed"] == 0,
    }
    for name, ok in targets.items():
        print(f"{'MET ' if ok else 'MISS'} {name}")
    if args.json:
        write_json(args.json, {**core, **hung, **killed, "samples": samples,
                               "targets_met": targets})
    return 0 if all(targets.values()) else 1
