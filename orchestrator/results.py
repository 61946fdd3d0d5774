"""What `match` and `load_back` answer, as small frozen records (like SGLang's `MatchResult`).

The engine reads `.tokens` / `.loaded_tokens` to size its work and `.reason` to know why it
recomputes; nothing outside the orchestrator reads its internal per-prefix records.
"""

from __future__ import annotations

from dataclasses import dataclass

from .states import DegradeReason, PrefixState


@dataclass(frozen=True)
class MatchResult:
    """The answer of `match(request_id, token_ids, local_hit_tokens=...)`.

    The engine allocates exactly `tokens` KV slots and passes them to `load_back`; with
    `tokens == 0` it recomputes everything beyond its local hit and need not call load_back.
    """

    #: Tokens the daemon will load beyond the engine's local hit (0: recompute them).
    tokens: int = 0
    #: The prefix's state after match: MARKED when `tokens > 0`; DEGRADED when the daemon
    #: held more but it will not be loaded; None when no prefix was tracked (a clean miss,
    #: or the daemon was not asked).
    state: PrefixState | None = None
    #: Why `tokens` is 0 although the daemon might hold more (DEGRADED, or BREAKER_OPEN when
    #: the open breaker kept the daemon from being asked); None for a hit or a clean miss.
    reason: DegradeReason | None = None


@dataclass(frozen=True)
class LoadResult:
    """The answer of `load_back(request_id, slots)`. All or nothing: either every promised
    token is in the slots (LOADED, `loaded_tokens` == tokens promised by match) or none is
    usable (DEGRADED, `loaded_tokens` == 0, the engine recomputes them)."""

    #: Tokens now in the engine's slots, byte-exact: the promise, or 0.
    loaded_tokens: int
    #: LOADED or DEGRADED; the prefix's current state when load_back had nothing to do
    #: (None: no prefix for this request, e.g. match answered 0).
    state: PrefixState | None
    #: Why the prefix degraded (None when LOADED or when there is no prefix).
    reason: DegradeReason | None = None
    #: Seconds load_back took, by the orchestrator's clock.
    elapsed_s: float = 0.0
    #: When LOADED on a GPU pool with an asynchronous copy: the torch.cuda.Event recorded
    #: after the last scatter. The engine's stream must wait on it before reading the slots
    #: (`torch.cuda.current_stream().wait_event(ready)`). None: the bytes are already there.
    ready: object | None = None
