"""What every verb's parser shares: the parser class that exits 64 on bad usage, the value
types (a bad value exits 64, never with a traceback) and the lazy tool runner."""

from __future__ import annotations

import argparse
import importlib
import sys

from lmcache_loadback.orchestrator.exit_codes import EXIT_USAGE


class UsageParser(argparse.ArgumentParser):
    """argparse exits 2 on bad usage, which here means an invalid config: use 64 (EX_USAGE)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def usage_error(p: argparse.ArgumentParser, message: str) -> int:
    """What a verb returns for flags that do not go together (checked after parsing): the
    usage line and the message on stderr, EX_USAGE."""
    p.print_usage(sys.stderr)
    print(f"{p.prog}: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def count(low: int):
    """An argparse type: an integer >= `low`."""
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


def positive_float(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not x > 0 or x == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return x


def run_tool(module: str):
    """The `fn` of a verb whose code lives in `module` (its `run(args)`): imported only when
    the verb runs, so `--help`, `--version` and `config` import neither torch nor an engine."""
    return lambda args: importlib.import_module(module).run(args)
