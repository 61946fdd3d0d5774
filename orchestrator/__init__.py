"""The load-back orchestrator: state machine, two-phase protocol, policies.

The public names are imported on first use (PEP 562), so that `import orchestrator.commands` or
`orchestrator.config` does not import torch through `orchestrator.core`: `loadback --help`,
`--version` and `config validate` stay light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

#: public name -> the submodule that defines it
_HOME = {"LoadBackOrchestrator": "core", "MatchResult": "results", "LoadResult": "results",
         "LoadBackConfig": "config", "ConfigError": "config", "PrefixState": "states",
         "DegradeReason": "states"}

__all__ = ["LoadBackOrchestrator", "MatchResult", "LoadResult", "LoadBackConfig", "ConfigError",
           "PrefixState", "DegradeReason"]

if TYPE_CHECKING:
    from .config import ConfigError, LoadBackConfig
    from .core import LoadBackOrchestrator
    from .results import LoadResult, MatchResult
    from .states import DegradeReason, PrefixState


def __getattr__(name: str):
    """A public name, or a submodule (`orchestrator.core` after a bare `import orchestrator`,
    as when the package imported them all eagerly)."""
    home = _HOME.get(name)
    if home is not None:
        value = getattr(importlib.import_module(f".{home}", __name__), name)
        globals()[name] = value
        return value
    try:
        return importlib.import_module(f".{name}", __name__)
    except ModuleNotFoundError as exc:
        if exc.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
