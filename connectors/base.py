"""What the orchestrator needs from a daemon connector.

Implemented by `LMCacheMPConnector` (the daemon over ZMQ) and `InMemoryConnector` (no I/O;
benchmarks of the orchestrator's own cost and property tests). Every method is called by
the orchestrator only, from the scheduler thread or the heartbeat thread, and must return
or raise a `connectors.errors.ConnectorError` within the timeout it is given: it must never
block longer, never retry, never count metrics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence, runtime_checkable

import torch

from .kv_layout import KVLayout


@dataclass
class Retrieved:
    """What `retrieve_into` landed, and what the daemon is still owed for it.

    Returned only when every promised byte is in the slots (or will be once `ready` has
    completed): the load has landed whatever happens to the daemon afterwards.
    """

    #: Bytes written into the engine's KV slots.
    nbytes: int
    #: commit_retrieve, unsent: the caller pays it off the request path (an owed release
    #: tied to the connection epoch), after `ready` has completed, so the daemon's buffer
    #: is released only once the copy has finished reading it. None: nothing is owed.
    commit: Callable[[float], object] | None = None
    #: A completion handle (a torch.cuda.Event) that the engine's stream waits on before it
    #: reads the slots; None when the copy had finished before retrieve_into returned.
    ready: object | None = None


@runtime_checkable
class Connector(Protocol):
    layout: KVLayout

    @property
    def chunk_size(self) -> int: ...

    @property
    def epoch(self) -> int:
        """Increases whenever the daemon behind the connector is a new process
        (restarted): registrations, locks and cached chunks from before are gone."""

    @property
    def late_replies(self) -> int:
        """Replies that arrived after their caller gave up (dropped, never used)."""

    def register(self, timeout_s: float) -> object:
        """Called at start and after every restart by the heartbeat; idempotent."""

    def unregister(self, timeout_s: float) -> None:
        """close(): forget this worker's registration (best effort)."""

    def ping(self, timeout_s: float) -> bool:
        """Heartbeat and breaker probe; keeps the daemon from reaping this worker."""

    def lookup_hit_tokens(self, token_ids: Sequence[int], request_id: str, timeout_s: float,
                          *, cache_salt: str = "") -> int:
        """match(): how many leading tokens the daemon holds (chunk multiple). On a hit
        the daemon holds read locks on those chunks for `request_id`."""

    def free_locks(self, token_ids: Sequence[int], request_id: str, start: int, end: int,
                   timeout_s: float, *, cache_salt: str = "", shard: bool = False) -> None:
        """Release the lookup's read locks on chunks [start, end): every KV rank's share,
        or with `shard` this rank's alone."""

    def settle_lookup(self, token_ids: Sequence[int], request_id: str, timeout_s: float,
                      *, cache_salt: str = "") -> bool:
        """Heartbeat, after a LOOKUP timed out: release what that lookup locked once its
        result exists; False while it cannot tell yet."""

    def retrieve_into(self, token_ids: Sequence[int], request_id: str, pool, slots: torch.Tensor,
                      *, start: int, end: int, timeout_s: float, skip: int = 0,
                      cache_salt: str = "") -> Retrieved:
        """load_back(): copy tokens [start + skip, end) into `slots` (len end-start-skip).
        All or nothing: a return means every chunk arrived, checked out and landed (or
        lands once `ready` completed); a raise means nothing of this load counts and
        nothing is written after it (a load asked for in pieces may have written part of
        the slots before failing: the engine recomputes them). The commit is returned unsent
        (`Retrieved.commit`); a ConnectorError raised after prepare_retrieve was answered
        carries the daemon's owed release in `exc.owed` the same way.

        Optional, where the connector has them (LMCacheMPConnector): `prepare(...)` sends
        prepare_retrieve ahead and `retrieve_into(..., prepared=)` only copies; the
        orchestrator uses them at match when the transfer is shm."""

    def store_from(self, token_ids: Sequence[int], request_id: str, pool, slots: torch.Tensor,
                   *, timeout_s: float, cache_salt: str = "") -> bool:
        """Store the whole chunks of `token_ids` from `slots`."""

    def end_session(self, request_id: str, timeout_s: float) -> None:
        """finish()/abort(): drop the daemon's session for `request_id`."""

    def unanswered(self, request_id: str | None = None) -> int:
        """Calls for `request_id` (None: for any request) that were sent to the current
        daemon, never answered, and that the daemon may still process (a served
        prepare_retrieve or lookup re-creates the request's session). 0 once the daemon is
        proven to have answered or dropped them, or the daemon changed (epoch)."""

    def close(self) -> None: ...
