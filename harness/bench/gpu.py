"""`loadback bench gpu`: load-back into a CUDA KV pool, ours against the copy limit and LMCache.

Exit codes (`orchestrator.exit_codes`): 0 every contender ran and every target was met; 1 a
contender was dropped (each named with why), a target missed (`TARGETS`) or no CUDA device
(a GPU benchmark that could not run has failed).
"""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from lmcache_loadback.connectors.telemetry import quiet_telemetry

quiet_telemetry()
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

import torch  # noqa: E402

from lmcache_loadback.connectors.kv_layout import KVPool  # noqa: E402
from lmcache_loadback.orchestrator.exit_codes import EXIT_FAILED, EXIT_OK  # noqa: E402
from lmcache_loadback.testing.daemon import DaemonProcess  # noqa: E402

from .common import fmt, median, shut_down, write_json  # noqa: E402
from .gpu_contenders import (  # noqa: E402
    CHUNK,
    LAYOUT,
    MODEL,
    SKIP,
    T,
    Copy,
    LMCache,
    Ours,
    make_pool,
    prove,
    request_ids,
)
from .gpu_daemon_ops import daemon_ops  # noqa: E402
from .gpu_report import TARGETS, report, size_row, whole_path  # noqa: E402
from .gpu_vllm import add_vllm_cuda  # noqa: E402

__all__ = ["CHUNK", "LAYOUT", "MODEL", "NO_CUDA", "PICKLE_MAX_TOKENS", "SIZES", "SKIP", "T",
           "TARGETS", "Copy", "LMCache", "Ours", "drop", "page_slots", "run", "run_sizes",
           "verdict"]

SIZES = (1024, 4096, 16384, 65536)
#: Timed samples per size after WARMUP; the pickle path is slow at 64k, so fewer there.
SAMPLES = {1024: 40, 4096: 25, 16384: 8, 65536: 4}
PICKLE_SAMPLES = {1024: 3, 4096: 2, 16384: 1, 65536: 0}  # seconds each; its proof warms it
#: LMCache's daemon's L1, in prefixes of the largest size (it stores two: page 1, page 256).
LMCACHE_L1_PREFIXES = 6
WARMUP = 2
#: One msgpack bin carries < 4 GiB: a pickle reply (or store) of more tokens cannot be sent,
#: so ours-pickle runs only at sizes below that (16k of this layout); shm has no such limit.
PICKLE_MAX_TOKENS = (2**32 - (64 << 20)) // LAYOUT.bytes_per_token // CHUNK * CHUNK
#: Contenders dropped (named; the run exits 1) when they fail; ours raise.
DROPPABLE = ("lmcache", "vllm")
NO_CUDA = "bench gpu needs a CUDA device; none found (torch.cuda.is_available() is False)"


def drop(dropped: dict[str, str], name: str, exc: BaseException, where: str = "") -> None:
    """Record (and print) that contender `name` left the run, and why."""
    dropped[name] = f"{where}{type(exc).__name__}: {exc}"
    print(f"contender dropped: {name}: {dropped[name]}", flush=True)


def verdict(result: dict) -> tuple[int, list[str]]:
    """The exit code of a finished run and the lines that say why it is not 0: every
    dropped contender (`result["dropped"]`, name -> reason) and every missed target
    (`result["targets_met"]`)."""
    why = [f"contender dropped: {k}: {reason}"
           for k, reason in (result.get("dropped") or {}).items()]
    why += [f"target missed: {k} = {fmt(result.get(k), 3)}, target >= {TARGETS.get(k, '?')}"
            for k, ok in (result.get("targets_met") or {}).items() if not ok]
    return (EXIT_FAILED if why else EXIT_OK), why


def _counts(n: int, cap: int) -> dict[str, int]:
    """Timed samples per contender at n tokens (at most `cap` when cap > 0)."""
    base, slow = SAMPLES.get(n, 5), PICKLE_SAMPLES.get(n, 3)
    if cap:
        base, slow = min(base, cap), min(slow, cap)
    return {"ours-pickle": slow, "default": base}


def _bench_size(n, contenders, toks, dst, perm, cap, dropped) -> dict[str, list[float]]:
    """Timed samples at n tokens, contenders alternating; an LMCache one that fails while
    timed is dropped (named in `dropped`), ours raise."""
    slots = perm[:n].clone()
    slots_for = {k: (c.own_slots[:n] if getattr(c, "own_slots", None) is not None else slots)
                 for k, c in contenders.items()}
    times = {k: [] for k in contenders}
    counts = _counts(n, cap)
    rounds = WARMUP + max(counts.values())
    names = list(contenders)
    for i in range(rounds):
        order = names[i % len(names):] + names[:i % len(names)]
        for k in order:
            if k not in contenders:
                continue
            want = counts.get(k, counts["default"])
            if k == "ours-pickle" and (n > PICKLE_MAX_TOKENS or i >= want):
                continue
            if i >= WARMUP + want:
                continue
            rid = f"b{n}-{k}-{i}-{next(request_ids)}"
            try:
                dt = contenders[k].run(toks[:n], rid, dst, slots_for[k], n)
            except Exception as exc:
                if not k.startswith(DROPPABLE):
                    raise
                drop(dropped, k, exc, f"timing at {n} tokens: ")
                del contenders[k]
                continue
            if i >= WARMUP or k == "ours-pickle":
                times[k].append(dt)
    return times


@dataclass
class _Bench:
    """One run's data and contenders: a filled source pool, a destination pool, the prefix's
    token ids, the slots it was stored from, random destination slots."""

    dev: torch.device
    src: KVPool
    dst: KVPool
    toks: list
    stored: torch.Tensor
    perm: torch.Tensor
    gen: torch.Generator
    top: int  # the largest size
    ptop: int  # the largest size the pickle path can carry
    contenders: dict = field(default_factory=dict)
    store_s: dict = field(default_factory=dict)
    dropped: dict = field(default_factory=dict)
    proofs: dict = field(default_factory=dict)
    restored: dict = field(default_factory=dict)


def run_sizes(sizes, dev: torch.device, *, lmcache: bool = True, samples: int = 0,
              partial=None) -> dict:
    """The whole benchmark at `sizes` on `dev` (a CPU `dev` runs ours and copy only: a smoke
    test of this harness, no figures).

    KV of a Llama-8B-like model (128 KiB per token, chunk 256) into random slots; real
    daemons: ours with `--shm-name` (and `--no-l1-use-lazy`), ours without (pickle), and
    LMCache's own (L1 for LMCACHE_L1_PREFIXES prefixes of the largest size).
    Contenders, timed per sample from after the lookup until the bytes are in the slots:
    ours-shm (prepare_retrieve at match, then retrieve_into(prepared=) through the
    page-locked segment, `ready` waited; the match phase is timed apart), ours-shm-cold (the
    load sends its own prepare_retrieve calls, pipelined in pieces), ours-pickle (decode ->
    pinned staging -> device), copy (a pinned host-to-device copy: the link limit), lmcache
    (LMCache's SGLang MP connector, lmcache_driven RETRIEVE through CUDA IPC, page size 1)
    and lmcache-p256 (page size 256, its best case). Each size is first proven byte-exact
    (ours with a non-chunk-aligned local hit); contenders alternate sample by sample;
    medians after warm-up.
    """
    t_start = time.monotonic()
    top = max(sizes)
    prefix_gb = top * LAYOUT.bytes_per_token / 2**30
    shm_gb = round(max(1.0, prefix_gb * 2 + 1), 1)
    d_shm = DaemonProcess(chunk_size=CHUNK, l1_size_gb=shm_gb, shm_name=f"lbg{os.getpid()}")
    ptop = max(n for n in sizes if n <= PICKLE_MAX_TOKENS)
    l1_gb = round(max(1.0, ptop * LAYOUT.bytes_per_token / 2**30 * 1.25 + 0.5), 1)
    d_pickle = DaemonProcess(chunk_size=CHUNK, l1_size_gb=l1_gb)
    # LMCache's own daemon: its two prefixes (page 1, page 256) with room to spare, so
    # neither is evicted at the largest size (a shared 41 GB L1 kept 54784 of 65536 tokens)
    daemons = [d_shm, d_pickle]
    lmc_gb = round(max(2.0, prefix_gb * LMCACHE_L1_PREFIXES + 2), 1)
    if lmcache and dev.type == "cuda":
        daemons.append(DaemonProcess(chunk_size=CHUNK, l1_size_gb=lmc_gb))
    closers, result = [], {}
    try:
        with ThreadPoolExecutor(len(daemons)) as ex:
            for f in [ex.submit(d.start, 180.0) for d in daemons]:
                f.result()
        print(f"daemons up in {time.monotonic() - t_start:.1f} s (L1 ours {shm_gb} / pickle "
              f"{l1_gb} / LMCache {lmc_gb if len(daemons) > 2 else '-'} GB)", flush=True)
        b = _data(sizes, dev, ptop)
        _add_ours(b, d_shm, d_pickle, closers)
        b.contenders["copy"] = Copy(top * LAYOUT.bytes_per_token, dev)
        add_vllm_cuda(b, d_shm.endpoint, closers, drop)
        if len(daemons) > 2:
            _add_lmcache(b, daemons[2], closers)
        result = _measure(b, sizes, samples, partial)
        result["daemon_ops"] = _daemon_ops(b, sizes)
        if partial is not None:  # the whole report, before the (slow) shutdown
            partial({**result, "wall_s": time.monotonic() - t_start})
    finally:
        shut_down(closers, daemons)
    result["wall_s"] = time.monotonic() - t_start
    return result


def _daemon_ops(b: _Bench, sizes) -> list[dict] | str:
    """Where the daemon's time goes per request and prefix length (`gpu_daemon_ops`)."""
    try:
        return daemon_ops(b.contenders["ours-shm"].conn, b.toks, sizes, T, request_ids)
    except Exception as exc:  # noqa: BLE001 - the account is extra: the figures stand
        print(f"daemon ops: {type(exc).__name__}: {exc}", flush=True)
        return f"{type(exc).__name__}: {exc}"


def _data(sizes, dev: torch.device, ptop: int) -> _Bench:
    top = max(sizes)
    pool_slots = top + 4096
    src, dst = make_pool(pool_slots, dev, True), make_pool(pool_slots, dev, False)
    g = torch.Generator().manual_seed(11)
    toks = torch.randint(1, 32000, (top,), generator=g).tolist()
    stored = torch.randperm(pool_slots, generator=g)[:top].to(dev)
    perm = torch.randperm(pool_slots, generator=g)[:top]
    return _Bench(dev, src, dst, toks, stored, perm, g, top, ptop)


#: Our contenders: the product's default (the whole range prepared at match) and, side by
#: side, the first piece prepared at match with the rest asked for in the load, and pieces
#: in the load with commits behind the copy (-cold) or after the load (-cold-late).
OURS = (("ours-shm", "shm", {"early": True}),
        ("ours-shm-first", "shm", {"early": True, "first": True}),
        ("ours-shm-cold", "shm", {}),
        ("ours-shm-cold-late", "shm", {"late": True}),
        ("ours-pickle", "pickle", {}))


def _add_ours(b: _Bench, d_shm: DaemonProcess, d_pickle: DaemonProcess, closers: list) -> None:
    """Our three contenders, each registered; the prefix stored once per daemon."""
    for name, expect, kw in OURS:
        t0 = time.perf_counter()
        d = d_shm if expect == "shm" else d_pickle
        c = b.contenders[name] = Ours(d.endpoint, b.dev, expect, **kw)
        closers.append(c.close)
        print(f"{name}: registered in {time.perf_counter() - t0:.2f} s ({c.note})",
              flush=True)
        if name not in ("ours-shm", "ours-pickle"):
            continue  # the same daemon and prefix as ours-shm
        t0 = time.perf_counter()
        m = b.top if expect == "shm" else b.ptop
        assert c.conn.store_from(b.toks[:m], f"store-{name}", b.src, b.stored[:m], timeout_s=T)
        b.store_s[name] = time.perf_counter() - t0
        c.conn.end_session(f"store-{name}", T)
        print(f"{name}: stored {m} tokens from the {b.dev.type} pool in "
              f"{b.store_s[name]:.2f} s", flush=True)


def page_slots(num_slots: int, tokens: int, gen: torch.Generator) -> torch.Tensor:
    """Slots of `tokens // CHUNK` random whole pages of CHUNK slots, never page 0: LMCache's
    daemon takes block 0 for the null block (`null_block_id`, as SGLang's page 0 is never
    handed out) and does not store a chunk on it, so a prefix through page 0 hits only up to
    it (seen: 54784 of 65536 tokens, page 0 drawn 215th)."""
    pages = 1 + torch.randperm(num_slots // CHUNK - 1, generator=gen)[:tokens // CHUNK]
    return (pages[:, None] * CHUNK + torch.arange(CHUNK)).reshape(-1)


def _add_lmcache(b: _Bench, d_lmc: DaemonProcess, closers: list) -> None:
    """LMCache's connector at page size 1 and 256, each with its own prefix (other token
    ids) holding the same bytes, stored its own way; one that fails is dropped, named."""
    pslots = page_slots(b.src.num_slots, b.top, b.gen)
    for k, page, own, inst in (("lmcache-p256", CHUNK, pslots, 2),
                               ("lmcache", 1, b.perm, 1)):
        try:  # its own prefix (other token ids) holding the same bytes, stored its way
            own = own.to(b.dev)
            for a, d in zip([*b.src.k_buffer, *b.src.v_buffer],
                            [*b.dst.k_buffer, *b.dst.v_buffer]):
                d[own] = a[b.stored]
            t0 = time.perf_counter()
            c = LMCache(d_lmc.host, d_lmc.port, b.dst, [t + inst for t in b.toks], page,
                        own, inst)
            closers.append(c.close)
            c.store()
            b.store_s[k] = time.perf_counter() - t0
            b.contenders[k] = c
        except Exception as exc:  # noqa: BLE001 - report without it, not nothing
            drop(b.dropped, k, exc)


def _measure(b: _Bench, sizes, samples: int, partial) -> dict:
    """Prove, then time, every contender at each size; the report of all sizes."""
    notes = {k: c.note for k, c in b.contenders.items()}
    b.proofs, rows = {k: [] for k in b.contenders}, []
    for n in sizes:
        _prove_size(b, n)
        rows.append(_time_size(b, n, samples))
        if partial is not None:  # a run cut short still leaves its figures
            partial({"partial": True, "rows": rows, "proof": b.proofs, "store_s": b.store_s})
        print(f"{n} tokens: " + ", ".join(
            f"{k} {v:.2f} ms" for k, v in rows[-1]["median_ms"].items()), flush=True)
    result = report(rows, notes, b.dev)
    result["dropped"] = b.dropped
    result["lmcache_error"] = "; ".join(f"{k}: {v}" for k, v in b.dropped.items()) or None
    result["pickle_max_tokens"] = PICKLE_MAX_TOKENS
    result["proof"] = b.proofs
    result["store_s"] = b.store_s
    result["lmcache_restored"] = b.restored
    return result


def _lmcache_present(b: _Bench, n: int) -> None:
    """Before LMCache's proof at n tokens: its whole prefix hits, or it is stored again
    (each time recorded in `b.restored`: what hit, what hit after)."""
    for k, c in b.contenders.items():
        if not isinstance(c, LMCache):
            continue
        rid = f"present-{k}-{n}-{next(request_ids)}"
        hit = c.conn.lookup_kv(list(c.toks[:n]), rid)
        c.conn.end_session(rid)
        if hit < n:
            c.store()
            rid += "-again"
            again = c.conn.lookup_kv(list(c.toks[:n]), rid)
            c.conn.end_session(rid)
            b.restored.setdefault(k, []).append({"tokens": n, "hit": hit, "after": again})
            print(f"{k}: {hit} of {n} tokens hit before its proof; stored again: {again}",
                  flush=True)


def _prove_size(b: _Bench, n: int) -> None:
    """Byte-exact proof of every contender at n tokens; a failing LMCache one is dropped."""
    _lmcache_present(b, n)
    for k, c in list(b.contenders.items()):
        if k == "ours-pickle" and n > b.ptop:
            continue
        try:
            b.proofs[k].append(prove(k, c, b.toks, b.src, b.stored, b.dst, b.perm, n))
        except Exception as exc:
            if not k.startswith(DROPPABLE):
                raise
            drop(b.dropped, k, exc, f"proof at {n} tokens: ")
            del b.contenders[k]
    print(f"{n} tokens: byte-exact for "
          f"{', '.join(k for k in b.contenders if b.proofs[k][-1]['tokens'] == n)}",
          flush=True)


def _time_size(b: _Bench, n: int, samples: int) -> dict:
    """The timed samples at n tokens as one row, with the phases, the match times and the
    whole path per contender (`whole_path`: ours match/load/commit, LMCache lookup/retrieve)."""
    contenders = b.contenders
    times = _bench_size(n, contenders, b.toks, b.dst, b.perm, samples, b.dropped)
    times = {k: v for k, v in times.items() if k in contenders}
    row = size_row(n, times)
    for k, c in contenders.items():
        if getattr(c, "phases", None) and k != "ours-pickle":
            row[k.replace("-", "_") + "_returned_ms"] = median(c.phases) * 1e3
            c.phases.clear()
    row["whole_path"] = {k: whole_path(c.split[-len(times[k]):]) for k, c in contenders.items()
                         if getattr(c, "split", None) and times.get(k)}
    row["match_ms"] = {k: median(c.match_s[-len(times[k]):]) * 1e3
                       for k, c in contenders.items()
                       if getattr(c, "match_s", None) and times.get(k)}
    for c in contenders.values():
        for name in ("match_s", "split"):
            if getattr(c, name, None):
                getattr(c, name).clear()
    return row


def run_record(**extra) -> dict:
    """What ran, written by the bench itself into its JSON (the file is its output, nothing
    added): the command, when, at which commit (LOADBACK_COMMIT), and `extra`."""
    return {"command": "loadback bench gpu " + " ".join(sys.argv[sys.argv.index("gpu") + 1:]
                                                        if "gpu" in sys.argv else []),
            "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "commit": os.environ.get("LOADBACK_COMMIT"), **extra}


def run(args) -> int:
    if not torch.cuda.is_available():
        print(NO_CUDA, file=sys.stderr)
        return EXIT_FAILED
    path = getattr(args, "json", None)
    run_of = run_record()
    result = run_sizes(SIZES, torch.device("cuda", torch.cuda.current_device()),
                       samples=int(getattr(args, "samples", 0) or 0),
                       partial=(lambda r: write_json(path, {"run": run_of, **r}))
                       if path else None)
    result = {"run": run_of, **result}
    print(f"total wall time {result['wall_s']:.1f} s")
    if getattr(args, "json", None):
        write_json(args.json, result)
        print(f"wrote {args.json}")
    code, why = verdict(result)
    for line in why:
        print(line)
    return code
