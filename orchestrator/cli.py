"""The `loadback` command: demo, sglang-demo, chaos, bench, tune, status, config validate|show,
configs export, diagram. Exit codes: `orchestrator.exit_codes` (printed by `loadback --help`).
Each command's module is imported only when that command runs, so `--help`, `--version` and
`config validate` import neither SGLang nor torch.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import textwrap

from lmcache_loadback.connectors.telemetry import quiet_telemetry

from .exit_codes import EPILOG, EXIT_INVALID, EXIT_UNREADABLE, EXIT_USAGE

quiet_telemetry()

DESCRIPTION = ("Fault-tolerant load-back between an engine's prefix cache (SGLang's "
               "radix-cache backend `loadback`, vLLM's KV connector `LoadBackConnector`) and an "
               "LMCache multi-process daemon: run the demos, the chaos harness and the "
               "benchmarks, tune deadlines against a running daemon, read a deployment's "
               "status, and check or export configs.")
DISTRIBUTION = "lmcache-loadback"
#: `sglang-demo --sides`: the backends it can run, in the order it runs them
SGLANG_DEMO_SIDES = ("ours", "upstream")
#: `status --url`'s default: metrics.port's default (kept equal by a test)
DEFAULT_STATUS_URL = "http://127.0.0.1:9464/metrics"


class _UsageParser(argparse.ArgumentParser):
    """argparse exits 2 on bad usage, which here means an invalid config: use 64 (EX_USAGE)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _deadlines_line(cfg) -> str:
    """What bounds each call, beside upstream's one 300 s timeout for all of them."""
    d = cfg.deadlines
    cap_tokens = (d.retrieve_max_ms - d.retrieve_base_ms) * 1024 / d.retrieve_per_ki_token_ms \
        if d.retrieve_per_ki_token_ms else 0
    return (f"lookup {d.lookup_ms:g} ms; retrieve {d.retrieve_base_ms:g} ms + "
            f"{d.retrieve_per_ki_token_ms:g} ms per 1024 tokens, capped at {d.retrieve_max_ms:g} ms"
            f" (reached at {cap_tokens:,.0f} tokens); control {d.control_ms:g} ms; store "
            f"{d.store_ms:g} ms; connect {d.connect_ms:g} ms. Upstream bounds each of these by "
            "lmcache.mp.mq_timeout (default 300 s); here a dead daemon costs a request at most "
            "its own deadline, then it recomputes")


def _engines_arg(text: str) -> int:
    """`chaos run --engines`: an integer 1..32."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of engines, 1..32, got {text!r}") from None
    if not 1 <= n <= 32:
        raise argparse.ArgumentTypeError(f"engines must be 1..32 (one daemon shared by N engines), got {n}")
    return n


def _config_cmd(args: argparse.Namespace) -> int:
    from .config import ConfigError, LoadBackConfig

    try:
        if args.action == "validate":
            cfg, upstream_rows = LoadBackConfig.read(args.file)
            print(f"{args.file}: valid")
            for row in upstream_rows:  # how an upstream LMCache file's keys map onto ours
                print(f"  {row.key} = {row.value!r}: {row.note}")
            if upstream_rows:
                print(f"  deadlines in force: {_deadlines_line(cfg)}")
            return 0
        rows = LoadBackConfig.explain(args.file)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_UNREADABLE if exc.unreadable else EXIT_INVALID
    if args.json:
        print(json.dumps({k: {"value": v, "from": src} for k, v, src in rows}, indent=2))
        return 0
    width = max(len(k) for k, _, _ in rows)
    for key, value, src in rows:
        print(f"{key:<{width}}  {value!s:<14}  ({src})")
    return 0


def _configs_cmd(args: argparse.Namespace) -> int:
    from .resources import export_configs

    try:
        written = export_configs(args.dir, force=args.force)
    except FileExistsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(f"wrote {len(written)} files to {args.dir} (example configs, chaos/ scenarios, "
          "Grafana dashboard, Prometheus alert rules and scrape config)")
    return 0


def _diagram_cmd(args: argparse.Namespace) -> int:
    from .states import mermaid

    print(mermaid())
    return 0


def _version() -> str:
    """The installed distribution's version (its metadata), not a copy in the source."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:
        return "unknown (no installed lmcache-loadback distribution found)"


def _count(low: int):
    """An argparse type: an integer >= `low` (a bad value exits 64, not with a traceback)."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
        if n < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {n}")
        return n
    parse.__name__ = f"integer >= {low}"
    return parse


def _positive_float(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not x > 0 or x == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return x


def _sides_arg(text: str) -> str:
    """`sglang-demo --sides`: a comma-separated subset of SGLANG_DEMO_SIDES."""
    names = [s for s in text.split(",") if s]
    bad = [s for s in names if s not in SGLANG_DEMO_SIDES]
    if not names or bad:
        raise argparse.ArgumentTypeError(
            f"expected some of {','.join(SGLANG_DEMO_SIDES)} (comma-separated), got {text!r}")
    return text


def scenario_names() -> list[str]:
    """The shipped chaos scenarios' names, read from configs/chaos/*.yaml (no torch, no
    harness import); empty if the shipped files cannot be found or read."""
    import yaml

    from .resources import configs_dir

    try:
        files = sorted((configs_dir() / "chaos").glob("*.yaml"))
        return [str(yaml.safe_load(f.read_text())["name"]) for f in files]
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return []


def _run_tool(module: str):
    """The `fn` of a command whose code lives in `module`: imported only when it runs."""
    return lambda args: importlib.import_module(module).run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = _UsageParser(prog="loadback", description=textwrap.fill(DESCRIPTION, 88),
                          epilog=EPILOG,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"loadback {_version()}",
                        help="print the installed lmcache-loadback version and exit")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    for add in (_add_config_cmds, _add_demo, _add_sglang_demo, _add_bench, _add_chaos,
                _add_tune, _add_status):
        add(sub)
    return parser


def _add_config_cmds(sub) -> None:
    """config validate|show, configs export, diagram."""
    p = sub.add_parser("config", help="validate or show a YAML config",
                       description="validate: check FILE (exit 0, 2 invalid, 3 unreadable); "
                       "show: print every effective value and where it came from")
    p.add_argument("action", choices=["validate", "show"], help="validate or show")
    p.add_argument("file", help="a loadback YAML config (or an upstream LMCache one)")
    p.add_argument("--json", action="store_true", help="show: machine-readable output")
    p.set_defaults(fn=_config_cmd)

    p = sub.add_parser("configs", help="write out the shipped example configs, chaos "
                       "scenarios, dashboard and alert rules")
    p.add_argument("action", choices=["export"], help="export (the only action)")
    p.add_argument("dir", help="destination directory (created if missing)")
    p.add_argument("--force", action="store_true", help="overwrite files already there")
    p.set_defaults(fn=_configs_cmd)

    p = sub.add_parser("diagram", help="print the prefix state machine as mermaid")
    p.set_defaults(fn=_diagram_cmd)


def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help="a real daemon, a workload, a kill and a restart",
                       description="A real LMCache daemon, /metrics on 127.0.0.1, a workload "
                       "through the orchestrator, the daemon SIGKILLed at 35% of the requests "
                       "and restarted at 55%, then a summary. Exits 1 if an invariant broke.")
    p.add_argument("--requests", type=_count(1), default=800, metavar="N",
                   help="requests in the workload (default 800)")
    p.add_argument("--interval-ms", type=_positive_float, default=50.0, metavar="MS",
                   help="time between requests (default 50)")
    p.add_argument("--json", metavar="FILE", help="also write the result and the metrics")
    p.set_defaults(fn=_run_tool("lmcache_loadback.harness.demo"))


def _add_sglang_demo(sub) -> None:
    p = sub.add_parser("sglang-demo", help="a real SGLang 0.5.23 server with this backend "
                       "beside upstream's, the daemon killed and restarted midway")
    p.add_argument("--sglang-python", metavar="PATH",
                   help="Python of a venv with sglang 0.5.23 (default: this one)")
    p.add_argument("--duration-s", type=_positive_float, default=60.0, metavar="S",
                   help="traffic window per side (default 60)")
    # one a second: what this CPU server sustains with room to spare on a loaded 2-core machine
    p.add_argument("--interval-ms", type=_positive_float, default=1000.0, metavar="MS",
                   help="time between requests (default 1000)")
    p.add_argument("--deadline-s", type=_positive_float, default=10.0, metavar="S",
                   help="client deadline per request (default 10)")
    p.add_argument("--mq-timeout-s", type=_positive_float, default=3.0, metavar="S",
                   help="upstream's lmcache.mp.mq_timeout (its default is 300 s; here 3)")
    p.add_argument("--sides", type=_sides_arg, default=",".join(SGLANG_DEMO_SIDES),
                   metavar="LIST", help="which backends to run, comma-separated: "
                   f"{', '.join(SGLANG_DEMO_SIDES)} or both (default both)")
    p.add_argument("--probe", action="store_true",
                   help="time the scheduler thread inside each backend (test-only plugin in "
                   "harness/sglang/probe, loaded through PYTHONPATH)")
    p.add_argument("--json", metavar="FILE", help="also write both sides' summaries")
    p.set_defaults(fn=_run_tool("lmcache_loadback.harness.sglang.demo"))


_BENCH_MODULES = {"vllm": "vllm_load"}


def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: client (wire), core (orchestrator), "
                       "gpu (CUDA KV pools), vllm (the vLLM worker's load path on CPU)",
                       description="Exits 1 when a target is missed or a contender dropped, "
                       "and bench gpu on a host without CUDA.")
    p.add_argument("suite", choices=["client", "core", "gpu", "vllm"],
                   help="client: the wire client against LMCache's; core: the orchestrator's "
                   "own cost and deadline keeping; gpu: load-back into a CUDA KV pool (and into "
                   "vLLM's CUDA paged layout); vllm: the vLLM worker's load into vLLM's CPU paged "
                   "cache against LMCache's own")
    p.add_argument("--json", metavar="FILE", help="also write the figures and verdicts")
    p.add_argument("--samples", type=_count(0), default=0, metavar="N",
                   help="samples per point (0 = the suite's default)")
    p.set_defaults(fn=lambda a: importlib.import_module(
        f"lmcache_loadback.harness.bench.{_BENCH_MODULES.get(a.suite, a.suite)}").run(a))


def _add_chaos(sub) -> None:
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
            "byte-exact loads, counters that reconcile, recovery. Exits 1 if one broke.", 88)
        + "\n\n" + textwrap.fill("scenarios: " + listed, 88, subsequent_indent="  "),
        epilog="example: loadback chaos run --scenario kill --engines 4 "
        "--requests 100\n  4 engines share one daemon; in each of 100 rounds "
        "all 4 issue a request at once")
    cr.add_argument("--scenario", default="all", metavar="NAME",
                    choices=["all", *names] if names else None,
                    help=f"one scenario, or all (default): {listed}")
    cr.add_argument("--requests", type=_count(0), default=0, metavar="N",
                    help="requests per scenario (0 = its own); with --engines, rounds: each "
                    "engine makes this many")
    cr.add_argument("--engines", type=_engines_arg, default=1, metavar="N",
                    help="engines sharing the one daemon (1..32, default 1), each with its own "
                    "connector, orchestrator, metrics and KV pool, on its own thread; every "
                    "round all N issue a request at the same instant (a burst)")
    cr.add_argument("--json", metavar="FILE", help="also write every scenario's result")
    cr.set_defaults(fn=_run_tool("lmcache_loadback.harness.chaos"))


def _add_tune(sub) -> None:
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
    p.add_argument("--prefill-tokens-per-s", type=_positive_float, default=10000.0,
                   metavar="N", help="the engine's prefill speed, for the break-even "
                   "recommendation (default 10000)")
    p.add_argument("--requests", type=_count(1), default=20, metavar="N",
                   help="timed LOOKUPs and RETRIEVEs per prefix size (default 20)")
    src = p.add_mutually_exclusive_group(required=True)  # the KV layout comes from the model
    src.add_argument("--model-config", metavar="PATH", help="the model's HF config.json")
    src.add_argument("--server", metavar="URL", help="a running SGLang server, e.g. "
                     "http://127.0.0.1:30000 (reads its model directory's config.json); for "
                     "vLLM pass --model-config with the served model's config.json")
    p.add_argument("--tp-size", type=_count(1), default=1, metavar="N",
                   help="with --model-config: tensor-parallel ranks sharing the KV heads")
    p.add_argument("--json", metavar="FILE", help="also write the raw measurements")
    p.set_defaults(fn=_run_tool("lmcache_loadback.harness.tune"))


def _add_status(sub) -> None:
    p = sub.add_parser(
        "status", help="how a running deployment is: daemon, breaker, queues, owed releases",
        description="Read a running deployment's /metrics (this product's own server: "
        "SGLang's scheduler, or each vLLM worker rank, on metrics.port + rank; or SGLang's "
        "with --enable-metrics, which carries ours) and print the daemon address, "
        "registration epoch, breaker state, transfer mode, live prefixes, owed releases, "
        "worker queue depths, dropped fences, scheduler wait and the last refusal reason. "
        "Exits 69 if the endpoint cannot be read or serves no loadback_* series.")
    p.add_argument("--url", default=DEFAULT_STATUS_URL, metavar="URL",
                   help=f"the /metrics endpoint (default {DEFAULT_STATUS_URL}, metrics.port's "
                   "default; TP rank r serves on metrics.port + r)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--timeout-s", type=_positive_float, default=5.0, metavar="S",
                   help="how long to wait for the endpoint (default 5)")
    p.set_defaults(fn=_run_tool("lmcache_loadback.orchestrator.status"))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.fn(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
