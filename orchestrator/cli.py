"""The `loadback` command: demo, chaos, bench, tune, config validate|show, configs export,
diagram.

Exit codes: 0 ok; 1 a check failed (invariant, benchmark target); 2 an invalid config;
3 an unreadable config file; 64 bad usage.
"""

from __future__ import annotations

import argparse
import json
import sys

from connectors.telemetry import quiet_telemetry

quiet_telemetry()

EXIT_INVALID, EXIT_UNREADABLE, EXIT_USAGE = 2, 3, 64


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
        return 64
    print(f"wrote {len(written)} files to {args.dir} (example configs, chaos/ scenarios, "
          "Grafana dashboard, Prometheus alert rules and scrape config)")
    return 0


def _diagram_cmd(args: argparse.Namespace) -> int:
    from .states import mermaid

    print(mermaid())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = _UsageParser(prog="loadback", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("config", help="validate or show a YAML config")
    p.add_argument("action", choices=["validate", "show"])
    p.add_argument("file")
    p.add_argument("--json", action="store_true", help="show: machine-readable output")
    p.set_defaults(fn=_config_cmd)

    p = sub.add_parser("configs", help="write out the shipped example configs, chaos "
                       "scenarios, dashboard and alert rules")
    p.add_argument("action", choices=["export"])
    p.add_argument("dir", help="destination directory (created if missing)")
    p.add_argument("--force", action="store_true", help="overwrite files already there")
    p.set_defaults(fn=_configs_cmd)

    p = sub.add_parser("diagram", help="print the prefix state machine as mermaid")
    p.set_defaults(fn=_diagram_cmd)

    p = sub.add_parser("demo", help="a real daemon, a workload, a kill and a restart")
    p.add_argument("--requests", type=int, default=800)
    p.add_argument("--interval-ms", type=float, default=50.0, help="time between requests")
    p.add_argument("--json", metavar="FILE")
    p.set_defaults(fn=lambda a: __import__("orchestrator.tools.demo", fromlist=["run"]).run(a))

    p = sub.add_parser("sglang-demo", help="a real SGLang 0.5.23 server with this backend "
                       "beside upstream's, the daemon killed and restarted midway")
    __import__("orchestrator.tools.sglang_demo", fromlist=["add_arguments"]).add_arguments(p)
    p.set_defaults(
        fn=lambda a: __import__("orchestrator.tools.sglang_demo", fromlist=["run"]).run(a))

    p = sub.add_parser("bench", help="benchmarks: client (wire), core (orchestrator), "
                       "gpu (CUDA KV pool)")
    p.add_argument("suite", choices=["client", "core", "gpu"])
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--samples", type=int, default=0, help="samples per point (0 = default)")
    p.set_defaults(fn=lambda a: __import__(f"orchestrator.tools.bench.{a.suite}",
                                           fromlist=["run"]).run(a))

    p = sub.add_parser("chaos", help="break the daemon on purpose and check the invariants")
    csub = p.add_subparsers(dest="chaos_cmd", required=True)
    cr = csub.add_parser("run", formatter_class=argparse.RawDescriptionHelpFormatter,
                         epilog="example: loadback chaos run --scenario kill --engines 4 "
                         "--requests 100\n  4 engines share one daemon; in each of 100 rounds "
                         "all 4 issue a request at once")
    cr.add_argument("--scenario", default="all")
    cr.add_argument("--requests", type=int, default=0, help="requests per scenario (0 = its "
                    "own); with --engines, rounds: each engine makes this many")
    cr.add_argument("--engines", type=_engines_arg, default=1, metavar="N",
                    help="engines sharing the one daemon (1..32, default 1), each with its own "
                    "connector, orchestrator, metrics and KV pool, on its own thread; every "
                    "round all N issue a request at the same instant (a burst)")
    cr.add_argument("--json", metavar="FILE")
    cr.set_defaults(fn=lambda a: __import__("orchestrator.tools.chaos", fromlist=["run"]).run(a))

    p = sub.add_parser("tune", help="measure a running daemon and recommend a config")
    p.add_argument("--daemon", required=True, metavar="HOST:PORT")
    p.add_argument("--out", default="loadback-tuned.yaml")
    p.add_argument("--prefill-tokens-per-s", type=float, default=10000.0)
    p.add_argument("--requests", type=int, default=20, help="per prefix size")
    src = p.add_mutually_exclusive_group(required=True)  # the KV layout comes from the model
    src.add_argument("--model-config", metavar="PATH", help="the model's HF config.json")
    src.add_argument("--server", metavar="URL", help="a running SGLang server, e.g. "
                     "http://127.0.0.1:30000 (reads its model directory's config.json)")
    p.add_argument("--tp-size", type=int, default=1, help="with --model-config: tensor-"
                   "parallel ranks sharing the KV heads")
    p.add_argument("--json", metavar="FILE", help="also write the raw measurements")
    p.set_defaults(fn=lambda a: __import__("orchestrator.tools.tune", fromlist=["run"]).run(a))

    args = parser.parse_args(argv)
    return int(args.fn(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
