"""The fleet's verbs: fleet check (two daemons share KV through one L2). The code is the
harness's (harness/fleet.py), imported only when the verb runs."""

from __future__ import annotations

from .args import positive_float, run_tool


def add_fleet(sub) -> None:
    p = sub.add_parser("fleet", help="check that daemons share KV through their L2 store")
    fsub = p.add_subparsers(dest="fleet_cmd", required=True, metavar="ACTION")
    c = fsub.add_parser(
        "check", help="store a marker prefix through daemon A, load it byte-exact through B",
        description="Store a small marker prefix through daemon A (pickle transfer, so it "
        "works across hosts), then LOOKUP and load it through daemon B byte for byte, "
        "waiting up to --wait-s for A's L2 write. Refuses before storing when the daemons "
        "disagree on chunk size, model name or (with --admin-a/--admin-b) hash algorithm or "
        "L2 store, when an L2 node does not answer, or when a Redis Cluster node is used "
        "without cluster_mode; with the admin APIs it also checks that each daemon's stores "
        "reach its L2 (a marker loaded back from L2 once its L1 copy was dropped). One line "
        "per finding. Exits 0 when B loaded the marker, 69 when a daemon or the L2 server "
        "does not answer, 1 for any other finding that rules sharing out.")
    c.add_argument("a", metavar="A", help="the daemon that stores, HOST:PORT")
    c.add_argument("b", metavar="B", help="the daemon that loads, HOST:PORT")
    c.add_argument("--admin-a", metavar="HOST:PORT", help="A's admin API (its --http-host and "
                   "--http-port): compares hash algorithm and L2 store, asks the L2 nodes, "
                   "checks A's stores reach L2")
    c.add_argument("--admin-b", metavar="HOST:PORT", help="B's admin API, with --admin-a")
    c.add_argument("--model-name", action="append", metavar="NAME",
                   help="the engines' model name (default loadback); twice: A's, then B's")
    c.add_argument("--wait-s", type=positive_float, default=5.0, metavar="S",
                   help="how long B may take to see A's L2 write (default 5)")
    c.add_argument("--timeout-s", type=positive_float, default=5.0, metavar="S",
                   help="each call's deadline (default 5)")
    c.set_defaults(fn=run_tool("lmcache_loadback.harness.fleet"))
