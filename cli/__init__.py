"""The `loadback` command (console script `loadback = lmcache_loadback.cli:main`): demo,
sglang-demo, chaos, bench, tune, status, config validate|show, configs export, diagram. The
product's edge: it imports the core (orchestrator) and names harness modules, which run only
when their verb does, so `--help`, `--version` and `config` import neither torch nor an engine.
Exit codes: `orchestrator.exit_codes` (printed by `loadback --help`).
"""

from __future__ import annotations

import argparse
import sys
import textwrap

from lmcache_loadback.connectors.telemetry import quiet_telemetry
from lmcache_loadback.orchestrator.commands import installed_version
from lmcache_loadback.orchestrator.exit_codes import EPILOG

from .args import UsageParser
from .demo import add_demo, add_sglang_demo
from .fleet import add_fleet
from .measure import add_bench, add_chaos, add_tune
from .operate import DEFAULT_STATUS_URL, add_config, add_status

__all__ = ["DEFAULT_STATUS_URL", "DESCRIPTION", "build_parser", "main"]

quiet_telemetry()

DESCRIPTION = ("Fault-tolerant load-back between an engine's prefix cache (SGLang's "
               "radix-cache backend `loadback`, vLLM's KV connector `LoadBackConnector`) and an "
               "LMCache multi-process daemon: run the demos, the chaos harness and the "
               "benchmarks, tune deadlines against a running daemon, read a deployment's "
               "status, and check or export configs.")


def build_parser() -> argparse.ArgumentParser:
    parser = UsageParser(prog="loadback", description=textwrap.fill(DESCRIPTION, 88),
                         epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"loadback {installed_version()}",
                        help="print the installed lmcache-loadback version and exit")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    for add in (add_config, add_demo, add_sglang_demo, add_bench, add_chaos, add_tune,
                add_status, add_fleet):
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.fn(args) or 0)
