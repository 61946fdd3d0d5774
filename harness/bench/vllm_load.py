"""`loadback bench vllm`: the vLLM worker's load path on CPU, ours against LMCache 0.5.6's own.

Every contender loads a stored prefix into the same vLLM 0.32 CPU paged KV cache (per layer one
`[num_blocks, num_kv_heads, block_size, 2 * head_size]` tensor, random block ids):
  ours-shm     what our vLLM worker does for a load (engines/vllm/worker.py): LOOKUP, then
               `retrieve_into` the PagedCPUView's staging slots over the daemon's shared
               memory, `to_blocks` into the paged layers, commit, END_SESSION;
  ours-pickle  the same with the chunks pickled in the prepare_retrieve reply;
  lmc-pickle   what LMCache's vLLM connector runs on CPU (LMCacheMPWorkerAdapter): its
               `create_transfer_context` with mode auto (engine-driven on CPU) registered with
               vLLM's engine type and the layout hints vLLM's CPU attention gives, LOOKUP +
               prefetch status, EngineDrivenContextPickle.prepare_retrieve, its own
               `scatter_cpu_to_paged_kv`, commit_retrieve, END_SESSION.
Each family loads what it stored itself (ours from the token-major staging slots, LMCache by its
own gather from a source paged cache). Before timing, every contender's landed blocks are read
back as vLLM's CPU kernel reads them (cpu_attn.py: per block and head, block_size K rows then
block_size V rows) and compared with the stored K and V of every token and head.
The contenders are in vllm_contenders.py; here the byte-exact judge, the timing and the report.
Exit code: 0 when every contender ran byte-exact (the figures are reported, not gated), else 1.
"""

from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ThreadPoolExecutor

from lmcache_loadback.connectors.telemetry import quiet_telemetry

quiet_telemetry()
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

import torch  # noqa: E402

from lmcache_loadback.connectors.kv_layout import KVLayout, KVPool  # noqa: E402
from lmcache_loadback.engines.vllm.paged import PagedCPUView  # noqa: E402
from lmcache_loadback.testing.daemon import DaemonProcess  # noqa: E402

from .common import fmt, median, print_table, shut_down, write_json  # noqa: E402
from .vllm_contenders import CHUNK, PHASES, BenchFailure, LMCache, Ours, request_ids  # noqa: E402

SIZES = (512, 2048, 8192)
BLOCK = 16
DEFAULT_SAMPLES = 20
MIN_SAMPLES = 3
BUDGET_S = 50.0  # per size: stop sampling past this (after MIN_SAMPLES)
NAMES = ("ours-shm", "ours-pickle", "lmc-pickle")


def make_layout(layers: int = 8, heads: int = 8, head_dim: int = 128) -> KVLayout:
    return KVLayout(num_layers=layers, num_heads=heads, head_dim=head_dim,
                    dtype=torch.bfloat16, chunk_size=CHUNK)


def _kernel_kv(layer: torch.Tensor, bs: int, layout: KVLayout):
    """(K, V) views `[blocks, heads, block_size, head]` as cpu_attn.py reads a layer."""
    kv = layer.view(layer.shape[0], layout.num_heads, 2 * bs, layout.head_dim)
    return kv.chunk(2, dim=2)


def write_tokens(layers, ids, ref: KVPool, bs: int, layout: KVLayout) -> None:
    """Token-major K and V of `ref` -> the blocks `ids` of vLLM CPU `layers`, kernel order."""
    idx = torch.tensor(ids, dtype=torch.int64)
    n, h, d = len(ids) * bs, layout.num_heads, layout.head_dim
    for layer, k, v in zip(layers, ref.k_buffer, ref.v_buffer):
        kc, vc = _kernel_kv(layer, bs, layout)
        kc.index_copy_(0, idx, k[:n].view(len(ids), bs, h, d).transpose(1, 2))
        vc.index_copy_(0, idx, v[:n].view(len(ids), bs, h, d).transpose(1, 2))


def landed_exact(layers, ids, ref: KVPool, bs: int, layout: KVLayout) -> bool:
    """Whether the blocks `ids` hold, read as the kernel reads them, every token's K and V."""
    idx = torch.tensor(ids, dtype=torch.int64)
    n, h, d = len(ids) * bs, layout.num_heads, layout.head_dim
    for layer, k, v in zip(layers, ref.k_buffer, ref.v_buffer):
        kc, vc = _kernel_kv(layer, bs, layout)
        for cache, want in ((kc, k), (vc, v)):
            got = cache.index_select(0, idx).transpose(1, 2).reshape(n, h, d)
            if not torch.equal(got, want[:n]):
                return False
    return True


def _verify(name, c, toks, ids, view: PagedCPUView, layers, ref: KVPool) -> None:
    """Clear the blocks (and our staging slots), load once, read back as the kernel does."""
    idx = torch.tensor(ids, dtype=torch.int64)
    for layer in layers:
        layer.index_fill_(0, idx, 0)
    for b in list(view.pool.k_buffer) + list(view.pool.v_buffer):
        b[:len(toks)] = 0
    ph = {p: [] for p in PHASES}
    try:
        c.run(toks, f"verify-{name}-{len(toks)}-{next(request_ids)}", ids, ph)
    except Exception as exc:
        if isinstance(exc, BenchFailure):
            raise
        raise BenchFailure(f"{name}: the load at {len(toks)} tokens failed: {exc!r}") from exc
    if not landed_exact(layers, ids, ref, view.block_size, view.layout):
        raise BenchFailure(f"{name}: the K/V landed in vLLM's blocks at {len(toks)} tokens "
                           "differ from the stored ones")


def _bench_size(n, contenders, data, samples):
    """Verify each contender, then time them in turn, the order rotated every sample."""
    all_toks, all_ids, view, layers, ref = data
    toks, ids = all_toks[:n], all_ids[:n // view.block_size]
    for name, c in contenders.items():
        _verify(name, c, toks, ids, view, layers, ref)
    times = {k: [] for k in contenders}
    phases = {k: {p: [] for p in PHASES} for k in contenders}
    names, start = list(contenders), time.monotonic()
    for i in range(samples):
        for name in names[i % len(names):] + names[:i % len(names)]:
            t0 = time.perf_counter()
            contenders[name].run(toks, f"b{n}-{name}-{i}-{next(request_ids)}", ids, phases[name])
            times[name].append(time.perf_counter() - t0)
        if i + 1 >= MIN_SAMPLES and time.monotonic() - start > BUDGET_S:
            break
    return times, phases


def _row(n, nbytes, times, phases):
    ms = {k: median(v) * 1e3 for k, v in times.items()}
    return {
        "tokens": n, "bytes": nbytes, "samples": len(times["lmc-pickle"]), "median_ms": ms,
        "min_ms": {k: min(v) * 1e3 for k, v in times.items()},
        "gbps": {k: nbytes / (v / 1e3) / 1e9 for k, v in ms.items()},
        "phases_median_ms": {k: {p: median(v) * 1e3 for p, v in ph.items()}
                             for k, ph in phases.items()},
        "samples_ms": {k: [round(x * 1e3, 3) for x in v] for k, v in times.items()},
        "ours_shm_vs_lmc_pickle": ms["ours-shm"] / ms["lmc-pickle"],
        "ours_pickle_vs_lmc_pickle": ms["ours-pickle"] / ms["lmc-pickle"],
    }


def _report(rows, notes, layout, bs, info) -> None:
    print(f"\nloadback bench vllm: vLLM 0.32 CPU paged KV, {layout.num_layers} layers x "
          f"{layout.num_heads} KV heads x {layout.head_dim} {layout.dtype_str} "
          f"({layout.bytes_per_token} B/token), block {bs}, chunk {CHUNK}, random block ids; "
          f"median ms per load (lookup -> end_session); torch threads "
          f"{torch.get_num_threads()}")
    heads = ["contender (data path)"]
    for r in rows:
        heads += [f"{r['tokens']} tok ms", "GB/s"]
    body = [[f"{k} ({notes[k]})"] + [x for r in rows for x in (fmt(r["median_ms"][k]),
                                                               fmt(r["gbps"][k]))]
            for k in NAMES]
    for key in ("ours_shm_vs_lmc_pickle", "ours_pickle_vs_lmc_pickle"):
        body.append([key + " (time)"] + [x for r in rows for x in (fmt(r[key], 3), "")])
    body += [[f"{k} fastest sample ms"] + [x for r in rows for x in (fmt(r["min_ms"][k]), "")]
             for k in NAMES]
    body.append(["samples"] + [x for r in rows for x in (r["samples"], "")])
    print_table(heads, body)
    print("\nwhere time goes (median ms): lookup = LOOKUP + prefetch status; retrieve = "
          "prepare_retrieve and decode (ours: also into the staging slots); blocks = into "
          "the paged layers; end = commit + END_SESSION")
    print_table(["contender @ tokens", *PHASES],
                [[f"{k} @ {r['tokens']}"] + [fmt(ph[p]) for p in PHASES]
                 for r in rows for k, ph in r["phases_median_ms"].items()])
    print(f"\nLMCache's reading of the layout: {info['lmc_kv_format']}; its chunks hold each "
          f"token's K|V per head: {info['lmc_chunks_token_major']}; load average (1 min) "
          f"{os.getloadavg()[0]:.2f} at the end")


def _setup(n_max, bs, layout):
    """The stored K/V (token-major), a source paged cache holding it, the destination one."""
    g = torch.Generator().manual_seed(7)
    shape = (n_max, layout.num_heads, layout.head_dim)
    mk = lambda: torch.randn(shape, generator=g).to(layout.dtype)  # noqa: E731
    ref = KVPool([mk() for _ in range(layout.num_layers)],
                 [mk() for _ in range(layout.num_layers)])
    nb, per = n_max // bs, (layout.num_heads, bs, 2 * layout.head_dim)
    src = {f"model.layers.{i}.self_attn.attn": torch.zeros((nb, *per), dtype=layout.dtype)
           for i in range(layout.num_layers)}
    src_ids = torch.randperm(nb, generator=g).tolist()
    write_tokens(list(src.values()), src_ids, ref, bs, layout)
    dst = {k: torch.zeros((2 * nb, *per), dtype=layout.dtype) for k in src}
    view = PagedCPUView(list(dst.values()), layout, bs, staging_tokens=n_max)
    ids = torch.randperm(2 * nb, generator=g)[:nb].tolist()
    toks = torch.randint(1, 32000, (n_max,), generator=g).tolist()
    return ref, src, src_ids, dst, view, ids, toks


def _contenders(d_pickle, d_shm, n_max, bs, layout, closers):
    ref, src, src_ids, dst, view, ids, toks = _setup(n_max, bs, layout)
    out = {}
    for name, d, transfer in (("ours-shm", d_shm, "shm"), ("ours-pickle", d_pickle, "pickle")):
        c = out[name] = Ours(d.endpoint, view, transfer)
        closers.append(c.close)
        c.store(toks, ref)
    lmc = out["lmc-pickle"] = LMCache(d_pickle.endpoint, dst, bs)
    closers.append(lmc.close)
    lmc.store(toks, src, src_ids)
    info = {"lmc_kv_format": lmc.format, "lmc_layout_hints": lmc.hints,
            "lmc_chunks_token_major": lmc.token_major(src, src_ids, ref, layout)}
    return out, (toks, ids, view, list(dst.values()), ref), info


def run(args) -> int:
    samples = int(getattr(args, "samples", 0) or 0) or DEFAULT_SAMPLES
    sizes = tuple(getattr(args, "sizes", None) or SIZES)
    bs = int(getattr(args, "block_size", 0) or BLOCK)
    layout = make_layout()
    if any(n % CHUNK for n in sizes) or CHUNK % bs:
        raise SystemExit(f"sizes must be multiples of the chunk {CHUNK}, itself of the block")
    t_start = time.monotonic()
    gb = 2 * max(sizes) * layout.bytes_per_token / 2**30 + 0.25
    d_pickle = DaemonProcess(chunk_size=CHUNK, l1_size_gb=round(gb, 2))
    d_shm = DaemonProcess(chunk_size=CHUNK, l1_size_gb=round(gb / 2 + 0.125, 2),
                          shm_name=f"lbv{os.getpid()}")
    closers = []
    try:
        with ThreadPoolExecutor(2) as ex:  # both daemons start at once
            for f in [ex.submit(d.start) for d in (d_pickle, d_shm)]:
                f.result()
        contenders, data, info = _contenders(d_pickle, d_shm, max(sizes), bs, layout, closers)
        rows = [_row(n, n * layout.bytes_per_token, *_bench_size(n, contenders, data, samples))
                for n in sorted(sizes)]
        notes = {k: c.note for k, c in contenders.items()}
        _report(rows, notes, layout, bs, info)
    except BenchFailure as exc:
        print(f"loadback bench vllm FAILED: {exc}")
        return 1
    finally:
        shut_down(closers, (d_pickle, d_shm))
    result = {"layout": {"layers": layout.num_layers, "kv_heads": layout.num_heads,
                         "head_dim": layout.head_dim, "dtype": layout.dtype_str,
                         "block_size": bs, "chunk": CHUNK, "bytes_per_token":
                         layout.bytes_per_token}, "load_average_1m": os.getloadavg()[0],
              "byte_exact": {k: True for k in NAMES}, "data_paths": notes, **info,
              "rows": rows, "wall_s": time.monotonic() - t_start}
    print(f"total wall time {result['wall_s']:.1f} s")
    if getattr(args, "json", None):
        write_json(args.json, result)
        print(f"wrote {args.json}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m lmcache_loadback.harness.bench.vllm_load",
                                description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, default=0, help="samples per size (0: default)")
    p.add_argument("--sizes", type=int, nargs="+", help=f"tokens per load (default {SIZES})")
    p.add_argument("--block-size", type=int, default=BLOCK, help="vLLM's --block-size")
    p.add_argument("--json", metavar="FILE", help="also write the figures")
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
