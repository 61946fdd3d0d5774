"""`loadback bench gpu --concurrency N[,N...]`: N requests with distinct prefixes of S tokens
arrive together and load into one KV pool through one daemon (`gpu_concurrency_steps` says
how each contender is driven); per cell of the grid every contender is first proven
byte-exact, then its steps are timed in turn with the others', medians over the repeats.

Runs on a CUDA device (the figures and the targets are the H200's) or, with `--device cpu`,
on the CPU (a small KV layout, plain copies for the bound, no targets judged): the same code
path, so its logic, its byte-exact check, the table and the JSON are tested without CUDA.

Exit codes: 0 every contender ran and every judged target was met; 1 a contender was dropped
(each named with why), a target missed, the host lacks the memory the grid needs, or no CUDA
device without `--device cpu`.
"""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from lmcache_loadback.connectors.telemetry import quiet_telemetry

quiet_telemetry()
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

import torch  # noqa: E402

from lmcache_loadback.connectors.kv_layout import KVLayout  # noqa: E402
from lmcache_loadback.orchestrator.exit_codes import EXIT_FAILED, EXIT_OK  # noqa: E402
from lmcache_loadback.testing.daemon import DaemonProcess  # noqa: E402

from .common import fmt, median, shut_down, write_json  # noqa: E402
from .gpu import NO_CUDA, drop, page_slots, run_record  # noqa: E402
from .gpu_concurrency import (  # noqa: E402
    COPIES,
    GRID_N,
    GRID_S,
    LMCACHE,
    OURS,
    PIPELINED,
    PIPELINED_THREADS,
    TARGETS,
    call_figures,
    cell_row,
    daemon_rounds,
    distinct_prefixes,
    judged,
    merge_rounds,
    print_report,
    print_verdict,
    size_label,
    targets_met,
)
from .gpu_concurrency_steps import (  # noqa: E402
    CopiesStep,
    LMCacheStep,
    Missed,
    OursStep,
    ReadyClock,
    Workload,
)
from .gpu_contenders import CHUNK, LAYOUT, make_pool  # noqa: E402

#: Timed steps per cell (after the proof, which is also the warm-up).
REPEATS = {"cuda": 7, "cpu": 3}
#: Proof steps ours may take per cell: a step with a short match is not a proof of the bytes.
PROOF_TRIES = 3
#: LMCache's daemon tuned: workers in both its pools (shipped: 1 each). Its transfer pool is
#: keyed by the client's socket, so one engine process's retrieves share one worker anyway;
#: its CPU pool serves the LOOKUPs.
TUNED_WORKERS = 4
#: A CPU device's layout: 4 layers x 2 KV heads x 64 x K,V bf16 = 2 KiB per token (the
#: GPU's Llama-8B-like 128 KiB per token would need 32 GiB per daemon at 16 x 16k).
CPU_LAYOUT = KVLayout(num_layers=4, num_heads=2, head_dim=64, dtype=torch.bfloat16,
                      chunk_size=CHUNK)
#: What a CPU device's LMCache connector waits for a reply (its registration of a CPU pool
#: is not answered by lmcache 0.5.6: the contender is dropped after this long).
CPU_LMCACHE_TIMEOUT_S = 5.0


#: lmcache 0.5.6's L1 evicts (LRU, a fifth of it) once it is this full (EvictionConfig's
#: trigger_watermark): an L1 sized to the prompts plus 5% dropped the first-stored prompts'
#: chunks on the H200, and every contender's match came back short.
L1_WATERMARK = 0.8


def l1_gb(layout: KVLayout, n_max: int, s_max: int) -> float:
    """One daemon's L1: every prompt of the grid at its largest size, held under the
    daemon's eviction watermark with a tenth to spare."""
    data = n_max * s_max * layout.bytes_per_token / 2**30
    return round(max(0.25, data / (L1_WATERMARK * 0.9) + 0.25), 2)


def memory_shortfall(layout: KVLayout, n_max: int, s_max: int, daemons: int,
                     dev: torch.device) -> str | None:
    """Why the host cannot hold the grid (None: it can): the daemons' L1 against the host's
    available memory; on CUDA the destination and copies' pools and one prompt's source
    against the free device memory."""
    need = daemons * l1_gb(layout, n_max, s_max) * 2**30
    avail = _mem_available()
    fix = "narrow the grid with --concurrency / --tokens"
    if avail is not None and need > 0.9 * avail:
        return (f"{daemons} daemons' L1 need {need / 2**30:.1f} GiB of host memory for "
                f"{n_max} x {size_label(s_max)} tokens, {avail / 2**30:.1f} GiB available: {fix}")
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        pools = (2 * n_max + 1) * s_max * layout.bytes_per_token
        if pools > 0.9 * free:
            return (f"the destination and copies' pools and a prompt's source need "
                    f"{pools / 2**30:.1f} GiB "
                    f"on {torch.cuda.get_device_name(dev)}, {free / 2**30:.1f} GiB free: {fix}")
    return None


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _workload(layout: KVLayout, n_max: int, s_max: int, dev: torch.device):
    """The prompts and their source (one prompt's slots, filled per prompt: `Workload`), the
    destination pool, ours' random destination slots and LMCache's pages per prompt."""
    slots = n_max * s_max + CHUNK  # page 0 is LMCache's null block
    src, dst = make_pool(s_max, dev, False, layout), make_pool(slots, dev, False, layout)
    prompts = distinct_prefixes(n_max, s_max, CHUNK, seed=25)
    g = torch.Generator().manual_seed(25)
    perm = torch.randperm(slots, generator=g)
    rand = [perm[i * s_max:(i + 1) * s_max].to(dev) for i in range(n_max)]
    pages = page_slots(slots, n_max * s_max, g).view(n_max, s_max)
    return Workload(prompts, src), dst, rand, [p.to(dev) for p in pages]


def run_grid(ns, sizes, dev: torch.device, *, repeats: int, lmcache: bool = True,
             partial=None) -> dict:
    """The whole grid on `dev`; the report (JSON-ready). Raises when the host cannot hold it
    (`memory_shortfall`, with LMCache's daemons one at a time if need be) or one of ours
    fails; an LMCache contender that fails is dropped."""
    t_start = time.monotonic()
    cuda = dev.type == "cuda"
    layout = LAYOUT if cuda else CPU_LAYOUT
    n_max, s_max = max(ns), max(sizes)
    gb = l1_gb(layout, n_max, s_max)
    rounds = daemon_rounds(lmcache, memory_shortfall(layout, n_max, s_max, 3, dev) is None)
    why = memory_shortfall(layout, n_max, s_max, 1 + len(rounds[0]), dev)
    if why:
        raise MemoryError(why)
    daemons = {OURS: DaemonProcess(chunk_size=CHUNK, l1_size_gb=gb, shm_name=f"lbc{os.getpid()}")}
    for k in (LMCACHE if lmcache else ()):
        daemons[k] = DaemonProcess(chunk_size=CHUNK, l1_size_gb=gb, extra_args=[
            "--max-workers", str(TUNED_WORKERS)] if k.endswith("tuned") else [])
    closers, dropped, notes, store_s, per_round = [], {}, {}, {}, []
    try:
        _start(daemons[k] for k in (OURS, *rounds[0]))
        print(f"{1 + len(rounds[0])} daemons up in {time.monotonic() - t_start:.1f} s, L1 {gb} "
              f"GB each" + (f"; LMCache's daemons one a round ({len(rounds)} rounds): three "
                            "do not fit the host" if len(rounds) > 1 else ""), flush=True)
        base, wl = _ours(daemons[OURS], layout, dev, n_max, s_max, closers, store_s)
        for r, names in enumerate(rounds):
            if r:
                _start(daemons[k] for k in names)
                print(f"round {r + 1} of {len(rounds)}: {', '.join(names)}, with ours and the "
                      "copies again", flush=True)
            own: list = []
            lmc = _lmcache(daemons, names, layout, dev, wl, own, dropped, store_s)
            contenders = {**(base if r == 0 else {k: base[k] for k in (OURS, COPIES)}), **lmc}
            notes.update({k: c.note for k, c in contenders.items()})
            rows = []
            for tokens in sizes:
                for n in ns:
                    rows.append(_cell(contenders, n, tokens, repeats, dropped))
                    if partial is not None:  # a run cut short still leaves its figures
                        partial({"partial": True, "rows": per_round + [rows],
                                 "dropped": dropped})
            per_round.append(rows)
            if len(rounds) > 1:  # its daemon's L1 goes back before the next round's starts
                shut_down(own, [daemons[k] for k in names])
            else:
                closers.extend(own)
        result = _report(merge_rounds(per_round), notes, dev, layout, repeats)
        result.update(dropped=dropped, store_s=store_s,
                      lmcache_rounds=[list(x) for x in rounds],
                      daemons={k: " ".join(d.command()[3:]) for k, d in daemons.items()})
    finally:
        shut_down(closers, list(daemons.values()))
    result["wall_s"] = time.monotonic() - t_start
    return result


def _start(daemons) -> None:
    daemons = list(daemons)
    with ThreadPoolExecutor(max(1, len(daemons))) as ex:
        for f in [ex.submit(d.start, 180.0) for d in daemons]:
            f.result()


def _ours(daemon, layout, dev, n_max, s_max, closers, store_s):
    """Ours (its prompts stored), ours-pipelined and the bound; and the workload the LMCache
    contenders share (prompts, destination pool, pages, ready clock)."""
    work, dst, rand, pages = _workload(layout, n_max, s_max, dev)
    clock = ReadyClock(dev, n_max)
    t0 = time.perf_counter()
    ours = OursStep(daemon.endpoint, layout, dst, dev, clock, work, rand)
    closers.append(ours.close)
    ours.store()
    store_s[OURS] = time.perf_counter() - t0
    tries, first = ours.warm(min(s_max, 4 * CHUNK))
    print(f"ours: warm after {tries} one-request step(s)"
          + (f"; the first missed: {first}" if first else ""), flush=True)
    print(f"{OURS}: {n_max} prompts of {s_max} tokens stored in {store_s[OURS]:.2f} s",
          flush=True)
    piped = ours.sibling(PIPELINED_THREADS)
    closers.append(piped.close)
    return ({OURS: ours, PIPELINED: piped, COPIES: CopiesStep(layout, n_max, s_max, dev, clock)},
            (work, dst, pages, clock))


def _lmcache(daemons, names, layout, dev, wl, closers, dropped, store_s):
    """The LMCache contenders `names`, each built and its prompts stored; one that fails is
    dropped (named, with its daemon's last logged error)."""
    work, dst, pages, clock = wl
    out = {}
    timeout = None if dev.type == "cuda" else CPU_LMCACHE_TIMEOUT_S
    for name in names:
        d = daemons[name]
        workers = "tuned, --max-workers 4" if name.endswith("tuned") else "as shipped, 1 worker"
        t0 = time.perf_counter()
        try:
            c = LMCacheStep(d.host, d.port, layout, dst, CHUNK, LMCACHE.index(name) + 1, clock,
                            work, pages,
                            f"LMCache SGLang MP connector (SGLang 0.5.20's LMCRadixCache "
                            f"calls), lmcache_driven, page {CHUNK}, daemon {workers}",
                            **({"timeout_s": timeout} if timeout else {}))
            closers.append(c.close)
            c.store()
        except Exception as exc:  # noqa: BLE001 - report without it, loudly
            drop(dropped, name, exc, f"setup ({_daemon_error(d)}): ")
            continue
        store_s[name] = time.perf_counter() - t0
        out[name] = c
        print(f"{name}: prompts stored in {store_s[name]:.2f} s", flush=True)
    return out


def _daemon_error(d: DaemonProcess) -> str:
    """The daemon's last logged error, the cause of a call it never answered."""
    lines = [ln for ln in d.log_tail(400).splitlines() if "Error" in ln and ":" in ln]
    return f"its log: {lines[-1].strip()}" if lines else "nothing in its log"


def _cell(contenders: dict, n: int, tokens: int, repeats: int, dropped: dict) -> dict:
    """One (N, S) cell: each contender proven byte-exact (its first step, untimed; ours may
    try PROOF_TRIES times), then `repeats` timed steps each, contenders in turn (the order
    rotates every repeat). A step of ours in which a request came back short is not timed
    and is counted in the row's `missed` (the run then exits 1)."""
    steps = {k: [] for k in contenders}
    missed: dict[str, list[str]] = {}

    def attempt(k, where, fn, tries=1):
        for _ in range(tries):
            try:
                return _attempt(contenders, k, dropped, where, fn), True
            except Missed as exc:
                missed.setdefault(k, []).append(f"{where}{exc}")
        return None, False

    proven = [k for k in list(contenders)
              if attempt(k, f"proof at {n} x {tokens}: ", lambda c: c.prove(n, tokens),
                         PROOF_TRIES)[1] and k in contenders]
    for rep in range(repeats if proven else 0):
        for k in proven[rep % len(proven):] + proven[:rep % len(proven)]:
            if k in contenders:
                got, _ = attempt(k, f"timing at {n} x {tokens}: ", lambda c: c.step(n, tokens))
                if got is not None:
                    steps[k].append(got)
    # when the step's last match was answered (ours: in AsyncLookups; LMCache: lookup_kv)
    extra = {k: {"matched_ms": median(c.matched_s[-len(steps[k]):]) * 1e3}
             for k, c in contenders.items() if getattr(c, "matched_s", None) and steps.get(k)}
    for k, c in contenders.items():  # ours: each daemon call's time, by op
        if getattr(c, "step_calls", None) and steps.get(k):
            extra.setdefault(k, {})["calls"] = call_figures(c.step_calls[-len(steps[k]):])
    row = cell_row(n, tokens, {k: v for k, v in steps.items() if v and k in contenders}, extra)
    row["missed"] = {k: {"steps": len(v), "first": v[0]} for k, v in missed.items()}
    ours = row["contenders"].get(OURS, {})
    if "calls" in row["contenders"].get(OURS, {}):
        print(f"  ours' daemon calls at {n} x {size_label(tokens)}, median ms (calls per "
              "step): " + ", ".join(f"{op} {fmt(f['median_ms'])} ({f['per_step']:g})"
                                   for op, f in row["contenders"][OURS]["calls"].items()),
              flush=True)
    print(f"{n} x {size_label(tokens)}: " + ", ".join(
        f"{k} {fmt(m['makespan_ms'])} ms" for k, m in row["contenders"].items())
        + f"; bound/ours {fmt(ours.get('bound_ratio'), 3)}"
        + "".join(f"; {k} missed {len(v)} step(s): {v[0]}" for k, v in missed.items()),
        flush=True)
    return row


def _attempt(contenders: dict, k: str, dropped: dict, where: str, fn):
    """fn(contender k); an LMCache contender that fails leaves the run (named), ours raise."""
    try:
        return fn(contenders[k])
    except Exception as exc:
        if k not in LMCACHE:
            raise
        drop(dropped, k, exc, where)
        del contenders[k]  # closed with the others at the end
        return None


def _report(rows, notes: dict, dev, layout: KVLayout, repeats: int) -> dict:
    cuda = dev.type == "cuda"
    device = torch.cuda.get_device_name(dev) if cuda else "cpu"
    layout_line = (f"KV {layout.num_layers} layers x {layout.num_heads} heads x "
                   f"{layout.head_dim} x K,V {layout.dtype_str} "
                   f"({layout.bytes_per_token // 1024} KiB/token), chunk {CHUNK}")
    print_report(rows, notes, device, layout_line)
    figures = judged(rows, cuda)
    met = targets_met(figures)
    print_verdict(figures, met, cuda)
    return {**figures, "targets": {k: f">= {v}" for k, v in TARGETS.items()},
            "targets_met": met, "device": device, "torch": torch.__version__,
            "layout": {"layers": layout.num_layers, "kv_heads": layout.num_heads,
                       "head_dim": layout.head_dim, "dtype": layout.dtype_str, "chunk": CHUNK,
                       "bytes_per_token": layout.bytes_per_token},
            "repeats": repeats, "data_paths": notes, "rows": rows}


def verdict(result: dict) -> tuple[int, list[str]]:
    """The exit code of a finished run and the lines that say why it is not 0."""
    why = [f"contender dropped: {k}: {reason}" for k, reason in result["dropped"].items()]
    why += [f"{k} missed {m['steps']} step(s) at {r['n']} x {size_label(r['tokens'])}: "
            f"{m['first']}" for r in result.get("rows", []) for k, m in r.get("missed", {}).items()]
    why += [f"target missed: {k} = {fmt(result.get(k), 3)}, target >= {TARGETS[k]}"
            for k, ok in result["targets_met"].items() if not ok]
    return (EXIT_FAILED if why else EXIT_OK), why


def run(args) -> int:
    dev = torch.device(args.device or "cuda")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            print(NO_CUDA + "; --device cpu runs the bench's logic on the CPU", file=sys.stderr)
            return EXIT_FAILED
        dev = torch.device("cuda", torch.cuda.current_device())
    ns, sizes = args.concurrency, args.tokens or list(GRID_S)
    path = getattr(args, "json", None)
    run_of = run_record(grid={"n": ns, "tokens": sizes})
    try:
        result = run_grid(ns, sizes, dev, repeats=args.samples or REPEATS[dev.type],
                          partial=(lambda r: write_json(path, {"run": run_of, **r}))
                          if path else None)
    except MemoryError as exc:
        print(f"bench gpu --concurrency: {exc}", file=sys.stderr)
        return EXIT_FAILED
    result = {"run": run_of, **result}
    print(f"total wall time {result['wall_s']:.1f} s")
    if path:
        write_json(path, result)
        print(f"wrote {path}")
    code, why = verdict(result)
    for line in why:
        print(line)
    return code


__all__ = ["GRID_N", "REPEATS", "daemon_rounds", "merge_rounds", "run", "run_grid", "verdict"]
