"""The load-back orchestrator: state machine, two-phase protocol, policies."""

from .config import ConfigError, LoadBackConfig
from .core import LoadBackOrchestrator
from .results import LoadResult, MatchResult
from .states import DegradeReason, PrefixState

__all__ = ["LoadBackOrchestrator", "MatchResult", "LoadResult", "LoadBackConfig", "ConfigError",
           "PrefixState", "DegradeReason"]
