"""What the SGLang backend uses of the orchestrator, whole: `LoadBackOrchestrator` implements
it, and so must any stand-in (a test's) the backend or its workers are given."""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

import torch

from lmcache_loadback.metrics import LoadbackMetrics
from lmcache_loadback.orchestrator.results import LoadResult, MatchResult
from lmcache_loadback.orchestrator.states import DegradeReason
from lmcache_loadback.orchestrator.tp import TPAgreement


class Orchestrator(Protocol):
    #: Where the backend's own series go (scheduler waits, queue depths); None: nowhere.
    metrics: LoadbackMetrics | None
    #: The TP group's agreement (the store drain is one collective every rank joins).
    tp: TPAgreement

    def match(self, request_id: str, token_ids: Sequence[int], *, local_hit_tokens: int = 0,
              cache_salt: str = "") -> MatchResult: ...

    def lookup_wait_s(self, num_tokens: int, local_hit_tokens: int = 0) -> float: ...

    def load_back(self, request_id: str, slots: torch.Tensor | None, *,
                  decline: DegradeReason | None = None) -> LoadResult: ...

    def store(self, request_id: str, token_ids: Sequence[int], slots: torch.Tensor,
              *, cache_salt: str = "") -> bool: ...

    def finish(self, request_id: str) -> None: ...

    def abort(self, request_id: str) -> None: ...

    def on_tick(self, fn: Callable[[], None]) -> None: ...

    def close(self) -> None: ...
