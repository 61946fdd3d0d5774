"""The load-back orchestrator: state machine, two-phase protocol, policies."""

from .config import ConfigError, LoadBackConfig
from .core import LoadBackOrchestrator, LoadResult
from .states import DegradeReason, PrefixState

__all__ = ["LoadBackOrchestrator", "LoadResult", "LoadBackConfig", "ConfigError",
           "PrefixState", "DegradeReason"]
