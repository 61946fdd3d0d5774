"""The verbs that break or measure a daemon: chaos run, bench, tune. Their code is the
harness's, imported only when the verb runs."""

from __future__ import annotations

import argparse
import importlib
import textwrap

from lmcache_loadback.orchestrator.commands import scenario_names

from .args import count, positive_float, run_tool, usage_error

#: bench SUITE -> its module under harness/bench, where the names differ
BENCH_MODULES = {"vllm": "vllm_load", "l2": "l2_wait"}


def _engines_arg(text: str) -> int:
    """`chaos run --engines`: an integer 1..32."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of engines, 1..32, got {text!r}") from None
    if not 1 <= n <= 32:
        raise argparse.ArgumentTypeError(f"engines must be 1..32 (one daemon shared by N engines), got {n}")
    return n


def add_bench(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: client (wire), core (orchestrator), "
                       "gpu (CUDA KV pools), vllm (the vLLM worker's load path on CPU), l2 "
                       "(the LOOKUP's wait for a shared L2 store)",
                       description="Exits 1 when a target is missed or a contender dropped, "
                       "and bench gpu on a host without CUDA.")
    p.add_argument("suite", choices=["client", "core", "gpu", "vllm", "l2"],
                   help="client: the wire client against LMCache's; core: the orchestrator's "
                   "own cost and deadline keeping; gpu: load-back into a CUDA KV pool (and into "
                   "vLLM's CUDA paged layout); vllm: the vLLM worker's load into vLLM's CPU paged "
                   "cache against LMCache's own; l2: prefixes stored through one daemon and "
                   "loaded through another on one redis-server, the break-even wait against "
                   "fixed LOOKUP deadlines of 50 ms and unlimited")
    p.add_argument("--json", metavar="FILE", help="also write the figures and verdicts")
    p.add_argument("--samples", type=count(0), default=0, metavar="N",
                   help="samples per point (0 = the suite's default); with --concurrency, "
                   "timed steps per cell")
    p.add_argument("--concurrency", type=_int_list("concurrency", 1), metavar="N[,N...]",
                   help="gpu only: N requests with distinct prefixes load together through "
                   "one daemon, ours against LMCache's SGLang MP path and N concurrent copies "
                   "(the grid N x --tokens; e.g. 1,4,8,16)")
    p.add_argument("--tokens", type=_int_list("tokens", 256), metavar="S[,S...]",
                   help="with --concurrency: prefix lengths, whole chunks of 256 (1k = 1024; "
                   "default 1k,4k,16k)")
    p.add_argument("--device", choices=["cuda", "cpu"],
                   help="with --concurrency: cpu runs the bench's logic on the CPU (a small KV "
                   "layout, plain copies, no targets judged; default cuda)")
    p.add_argument("--adapter", choices=["resp", "valkey"],
                   help="l2 only: the daemons' L2 adapter (default resp; valkey needs "
                   "valkey-glide-sync)")
    p.set_defaults(fn=lambda a: _bench(p, a))


def _int_list(what: str, step: int):
    """An argparse type: comma-separated whole numbers, each a multiple of `step` (k = 1024)."""
    def parse(text: str) -> list[int]:
        out = []
        for item in text.split(","):
            item = item.strip().lower()
            try:
                n = int(item[:-1]) * 1024 if item.endswith("k") else int(item)
            except ValueError:
                raise argparse.ArgumentTypeError(
                    f"expected comma-separated numbers, got {text!r}") from None
            if n < step or n % step:
                raise argparse.ArgumentTypeError(
                    f"{item} is not a positive multiple of {step}")
            out.append(n)
        return sorted(set(out))
    parse.__name__ = f"{what} list"
    return parse


def _bench(p, a) -> int:
    """Run the suite's module; --tokens and --device belong to --concurrency, which belongs
    to gpu (64 before anything starts)."""
    if a.concurrency is None:
        for flag in ("tokens", "device"):
            if getattr(a, flag) is not None:
                return usage_error(p, f"--{flag} applies to bench gpu --concurrency only")
    elif a.suite != "gpu":
        return usage_error(p, "--concurrency applies to bench gpu only")
    if a.adapter is not None and a.suite != "l2":
        return usage_error(p, "--adapter applies to bench l2 only")
    module = "gpu_concurrency_run" if a.concurrency else BENCH_MODULES.get(a.suite, a.suite)
    return importlib.import_module(f"lmcache_loadback.harness.bench.{module}").run(a)


def add_chaos(sub) -> None:
    p = sub.add_parser("chaos", help="break the daemon on purpose and check the invariants")
    csub = p.add_subparsers(dest="chaos_cmd", required=True, metavar="ACTION")
    names = scenario_names()
    listed = ", ".join(names) if names else "(shipped scenarios not found)"
    cr = csub.add_parser(
        "run", formatter_class=argparse.RawDescriptionHelpFormatter,
        help="run chaos scenarios against a real daemon; exits 1 if an invariant broke",
        description=textwrap.fill(
            "Run the shipped chaos scenarios (configs/chaos/) against a real daemon, each "
            "breaking it in its own way, and check the invariants: bounded time, no leaks, "
            "byte-exact loads, counters that reconcile, recovery. The l2_* scenarios break "
            "the daemon's L2 store instead (a real redis-server; --scenario l2 runs them "
            "all). Exits 1 if one broke.", 88)
        + "\n\n" + textwrap.fill("scenarios: " + listed, 88, subsequent_indent="  "),
        epilog="example: loadback chaos run --scenario kill --engines 4 "
        "--requests 100\n  4 engines share one daemon; in each of 100 rounds "
        "all 4 issue a request at once")
    cr.add_argument("--scenario", default="all", metavar="NAME",
                    choices=["all", "l2", *names] if names else None,
                    help=f"one scenario, l2 (every l2_* one), or all (default): {listed}")
    cr.add_argument("--requests", type=count(0), default=0, metavar="N",
                    help="requests per scenario (0 = its own); with --engines, rounds: each "
                    "engine makes this many")
    cr.add_argument("--engines", type=_engines_arg, default=1, metavar="N",
                    help="engines sharing the one daemon (1..32, default 1), each with its own "
                    "connector, orchestrator, metrics and KV pool, in its own process; every "
                    "round all N issue a request at the same instant (a burst)")
    cr.add_argument("--json", metavar="FILE", help="also write every scenario's result")
    cr.set_defaults(fn=run_tool("lmcache_loadback.harness.chaos"))


def add_tune(sub) -> None:
    p = sub.add_parser("tune", help="measure a running daemon and recommend a config",
                       description="Measure LOOKUP and RETRIEVE of a running daemon with the "
                       "model's KV layout and write a recommended config, for SGLang's backend "
                       "or vLLM's connector alike. The layout comes from the model's config.json "
                       "(--model-config, any engine) or a running SGLang server (--server). "
                       "Exits 69 if the daemon cannot be reached, 1 if nothing could be "
                       "measured.")
    p.add_argument("--daemon", required=True, metavar="HOST:PORT",
                   help="the LMCache daemon to measure")
    p.add_argument("--out", default="loadback-tuned.yaml", metavar="FILE",
                   help="where to write the recommended config (default loadback-tuned.yaml)")
    p.add_argument("--prefill-tokens-per-s", type=positive_float, default=10000.0,
                   metavar="N", help="the engine's prefill speed, for the break-even "
                   "recommendation (default 10000)")
    p.add_argument("--requests", type=count(1), default=20, metavar="N",
                   help="timed LOOKUPs and RETRIEVEs per prefix size (default 20)")
    src = p.add_mutually_exclusive_group(required=True)  # the KV layout comes from the model
    src.add_argument("--model-config", metavar="PATH", help="the model's HF config.json")
    src.add_argument("--server", metavar="URL", help="a running SGLang server, e.g. "
                     "http://127.0.0.1:30000 (reads its model directory's config.json); for "
                     "vLLM pass --model-config with the served model's config.json")
    p.add_argument("--tp-size", type=count(1), default=1, metavar="N",
                   help="with --model-config: tensor-parallel ranks sharing the KV heads")
    p.add_argument("--json", metavar="FILE", help="also write the raw measurements")
    p.set_defaults(fn=run_tool("lmcache_loadback.harness.tune"))
