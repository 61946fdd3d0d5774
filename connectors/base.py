"""The connector contract: what the orchestrator needs from a daemon connector, whole.

Implemented by `LMCacheMPConnector` (the daemon over ZMQ) and `InMemoryConnector` (no I/O).
Every call returns or raises a `ConnectorError` within the timeout it is given: never
longer, never retried inside, never counted in metrics (the orchestrator sets `on_call`, and
`LMCacheMPConnector` tells it each answered call's time, which the orchestrator counts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence, runtime_checkable

import torch

from .kv_layout import KVLayout
from .retrieval import Retrieval


@dataclass
class Retrieved:
    """What `retrieve_into` landed.

    Returned only when every promised byte is in the slots (or will be once `ready` has
    completed): the load has landed whatever happens to the daemon afterwards.
    """

    #: Bytes written into the engine's KV slots.
    nbytes: int
    #: The retrieval's release (its commit_retrieve, unsent), for callers that pay it
    #: themselves; the orchestrator pays its own `Retrieval` off the request path, after
    #: `ready` has completed. None: nothing is owed.
    commit: Callable[[float], object] | None = None
    #: A completion handle (a torch.cuda.Event) that the engine's stream waits on before it
    #: reads the slots; None when the copy had finished before retrieve_into returned.
    ready: object | None = None


@dataclass
class Prepared:
    """A range the daemon has prepared for retrieval (`Connector.prepare`).

    `chunks` are validated host tensors (views into the daemon's segment in shm mode,
    decoded tensors in pickle mode); `retrieval` owes the range's commit_retrieve on every
    path, to the daemon incarnation it was prepared on (a restarted daemon voids it)."""

    start: int
    end: int
    chunks: list
    retrieval: Retrieval
    #: The transfer mode it was prepared in ("shm" or "pickle").
    transfer: str
    #: Chunks per piece still to ask for, after `chunks` (a range prepared in part: its
    #: first piece at match, the rest asked for by the load while that piece copies).
    rest: tuple = ()

    @property
    def epoch(self) -> int:
        return self.retrieval.epoch


@runtime_checkable
class Connector(Protocol):
    """Every method and attribute the orchestrator and the engine hooks use; a connector
    that cannot do something still has the member and says so (`InMemoryConnector`)."""

    layout: KVLayout
    #: Where the daemon is, for operators' lines ("in-memory" where there is none).
    endpoint: str
    #: The transfer mode in use: "shm" or "pickle" (for "auto", what the last
    #: registration chose); any other value names a connector with no daemon behind it,
    #: which the orchestrator never asks to `prepare`.
    transfer: str
    #: The transfer mode configured ("auto", "shm", "pickle", or the connector's own).
    transfer_setting: str
    #: Whether this rank STOREs: False on a rank whose stores another rank makes for it
    #: (TP-replicated MLA: TP rank 0 writes the one copy).
    writer: bool

    @property
    def chunk_size(self) -> int: ...

    @property
    def epoch(self) -> int:
        """Increases whenever the daemon behind the connector is a new process
        (restarted): registrations, locks and cached chunks from before are gone."""

    @property
    def late_replies(self) -> int:
        """Replies that arrived after their caller gave up (dropped, never used)."""

    @property
    def fences_dropped(self) -> int:
        """Abandoned calls no longer tracked (their fence never answered in time)."""

    def register(self, timeout_s: float) -> object:
        """Called at start and after every restart by the heartbeat; idempotent."""

    def unregister(self, timeout_s: float) -> None:
        """close(): forget this worker's registration (best effort)."""

    def ping(self, timeout_s: float) -> bool:
        """Heartbeat and breaker probe; keeps the daemon from reaping this worker."""

    def get_chunk_size(self, timeout_s: float) -> int:
        """The daemon's own chunk size (its --chunk-size), checked at registration."""

    def lookup_hit_tokens(self, token_ids: Sequence[int], request_id: str, timeout_s: float,
                          *, cache_salt: str = "", wait_s: float = 0.0) -> int:
        """match(): how many leading tokens the daemon holds (chunk multiple). On a hit
        the daemon holds read locks on those chunks for `request_id`. The daemon answers
        within `timeout_s`; while it says its prefetch from L2 runs, the wait goes on up to
        `wait_s` (then PrefetchPending)."""

    def free_locks(self, token_ids: Sequence[int], request_id: str, start: int, end: int,
                   timeout_s: float, *, cache_salt: str = "", shard: bool = False) -> None:
        """Release the lookup's read locks on chunks [start, end): every KV rank's share,
        or with `shard` this rank's alone."""

    def abandon_lookup(self, token_ids: Sequence[int], request_id: str, timeout_s: float,
                       *, cache_salt: str = "") -> bool:
        """Heartbeat, after a LOOKUP whose answer will not be used (it timed out): once its
        prefetch has finished, release what it locked; False while that is not known yet."""

    def prepare(self, token_ids: Sequence[int], request_id: str, *, start: int, end: int,
                timeout_s: float, cache_salt: str = "",
                retrieval: Retrieval | None = None) -> Prepared:
        """match() with shared memory: prepare_retrieve of [start, end) now, the copy later
        (`retrieve_into(prepared=)`). `retrieval` (the caller's, made before the call)
        records what the daemon is owed, whatever happens."""

    def retrieve_into(self, token_ids: Sequence[int], request_id: str, pool, slots: torch.Tensor,
                      *, start: int, end: int, timeout_s: float, skip: int = 0,
                      cache_salt: str = "", prepared: Prepared | None = None,
                      retrieval: Retrieval | None = None) -> Retrieved:
        """load_back(): copy tokens [start + skip, end) into `slots` (len end-start-skip).
        All or nothing: a return means every chunk arrived, checked out and landed (or
        lands once `ready` completed); a raise means nothing of this load counts and
        nothing is written after it (a load asked for in pieces may have written part of
        the slots before failing: the engine recomputes them). What the daemon is owed,
        on a return or a raise, is in `retrieval` (the caller's, made before the call; a
        prepared range's own): the caller pays it off the request path."""

    def store_from(self, token_ids: Sequence[int], request_id: str, pool, slots: torch.Tensor,
                   *, timeout_s: float, cache_salt: str = "", on_owed=None) -> bool:
        """Store the whole chunks of `token_ids` from `slots`. `on_owed(store)`: what a
        store that raised still owes the daemon (connectors/store.py), before the raise."""

    def end_session(self, request_id: str, timeout_s: float) -> None:
        """finish()/abort(): drop the daemon's session for `request_id`."""

    def unanswered(self, request_id: str | None = None) -> int:
        """Calls for `request_id` (None: for any request) that were sent to the current
        daemon, never answered, and that the daemon may still process (a served
        prepare_retrieve or lookup re-creates the request's session). 0 once the daemon is
        proven to have answered or dropped them, or the daemon changed (epoch)."""

    def close(self) -> None: ...
