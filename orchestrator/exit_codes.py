"""The `loadback` command's exit codes, one table for every subcommand (shown in `--help`).

Imports nothing, so the CLI and every tool can share it without cost.
"""

from __future__ import annotations

EXIT_OK = 0
#: a check failed: an invariant violated (chaos, demo, sglang-demo), a benchmark target missed
#: or a contender dropped (bench), nothing could be measured (tune), two daemons that do not
#: share KV through their L2 (fleet check)
EXIT_FAILED = 1
#: `config validate|show`: the file is not a valid config
EXIT_INVALID = 2
#: `config validate|show`: the file cannot be read
EXIT_UNREADABLE = 3
#: bad usage (EX_USAGE): unknown command or flag, a bad flag value, an unknown scenario,
#: `configs export` onto existing files without --force, a model config with no KV layout
EXIT_USAGE = 64
#: something the command needs is not there (EX_UNAVAILABLE): the daemon unreachable (tune),
#: no Python with sglang 0.5.23 (sglang-demo), the /metrics endpoint unreadable or without
#: loadback_* series (status), a daemon or the L2 server not answering (fleet check)
EXIT_UNAVAILABLE = 69

EPILOG = f"""exit codes:
  {EXIT_OK}   ok
  {EXIT_FAILED}   a check failed: invariant violated (chaos, demo, sglang-demo), benchmark
      target missed, contender dropped or no CUDA device (bench), nothing measured (tune),
      daemons that do not share (fleet check)
  {EXIT_INVALID}   config validate|show: invalid config (one line: file, key, fix)
  {EXIT_UNREADABLE}   config validate|show: unreadable config file
  {EXIT_USAGE}  bad usage: unknown command or flag, bad value, unknown scenario, configs export
      onto existing files without --force, a model config without a KV layout (tune)
  {EXIT_UNAVAILABLE}  a needed resource is missing: daemon unreachable (tune), no Python with
      sglang 0.5.23 (sglang-demo), /metrics unreadable (status), a daemon or L2 server
      not answering (fleet check)"""
