"""An operator's verbs on a deployment: config validate|show, configs export, diagram, status.
What they do is the core's (`orchestrator.commands`, `orchestrator.status`); here only their
command lines."""

from __future__ import annotations

from lmcache_loadback.orchestrator import commands
from lmcache_loadback.orchestrator.status import DEFAULT_URL as DEFAULT_STATUS_URL

from .args import positive_float, run_tool


def add_config(sub) -> None:
    """config validate|show, configs export, diagram."""
    p = sub.add_parser("config", help="validate or show a YAML config",
                       description="validate: check FILE (exit 0, 2 invalid, 3 unreadable); "
                       "show: print every effective value and where it came from")
    p.add_argument("action", choices=["validate", "show"], help="validate or show")
    p.add_argument("file", help="a loadback YAML config (or an upstream LMCache one)")
    p.add_argument("--json", action="store_true", help="show: machine-readable output")
    p.set_defaults(fn=lambda a: commands.config_command(a.action, a.file, as_json=a.json))

    p = sub.add_parser("configs", help="write out the shipped example configs, chaos "
                       "scenarios, dashboard and alert rules")
    p.add_argument("action", choices=["export"], help="export (the only action)")
    p.add_argument("dir", help="destination directory (created if missing)")
    p.add_argument("--force", action="store_true", help="overwrite files already there")
    p.set_defaults(fn=lambda a: commands.export_command(a.dir, force=a.force))

    p = sub.add_parser("diagram", help="print the prefix state machine as mermaid")
    p.set_defaults(fn=lambda a: commands.diagram_command())


def add_status(sub) -> None:
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
    p.add_argument("--timeout-s", type=positive_float, default=5.0, metavar="S",
                   help="how long to wait for the endpoint (default 5)")
    p.set_defaults(fn=run_tool("lmcache_loadback.orchestrator.status"))
