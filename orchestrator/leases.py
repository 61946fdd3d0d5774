"""Read locks as a type: what one LOOKUP locked on the daemon, and what we may still free.
The daemon counts read locks per chunk, not per holder, so freeing a range this request no
longer holds strips another reader's lock: a `Lease` answers "which range may I free now?",
and "none" once anything may have released them daemon-side (their `Retrieval` owes that, or
the daemon's read TTL ended them: a lease past its age is forfeited, never freed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class RequestKey:
    """What names a request's prefix to the daemon."""

    request_id: str
    token_ids: tuple[int, ...]
    cache_salt: str = ""

    @classmethod
    def of(cls, request_id: str, token_ids: Sequence[int], cache_salt: str = "") -> "RequestKey":
        return cls(request_id, tuple(token_ids), cache_salt)


@dataclass
class Lease:
    """Read locks held on daemon incarnation `epoch` for tokens [start, end) of `key`."""

    key: RequestKey
    epoch: int
    start: int = 0
    end: int = 0
    #: Something may have released the locks daemon-side: none of them is ours to free.
    forfeited: bool = False
    #: Only this KV rank's shard of each chunk (a TP rank after its own prepare_retrieve
    #: was asked for); otherwise every rank's, as the group's LOOKUP locked them.
    shard: bool = False
    #: The clock of the process that sent the LOOKUP, read just before it was sent (the
    #: daemon's TTL starts later); None where another process sent it (handed off, a TP
    #: leader's): that one judges the age before the locks are given over.
    taken_at: float | None = None

    @property
    def held(self) -> tuple[int, int] | None:
        """The range still ours to free, or None."""
        return None if self.forfeited or self.end <= self.start else (self.start, self.end)

    def give_back(self, start: int, end: int) -> tuple[int, int] | None:
        """Stop holding [start, end) and return the part of it that must be freed on the
        daemon (None: nothing of it is held). Only an edge of the held range may go, so
        what is held stays one range."""
        held = self.held
        if held is None:
            return None
        s, e = max(start, held[0]), min(end, held[1])
        if e <= s:
            return None
        if s == held[0]:
            self.start = e
        elif e == held[1]:
            self.end = s
        else:
            raise ValueError(f"cannot free [{s}, {e}) from the middle of held {held}")
        if self.end <= self.start:
            self.start = self.end = 0
        return s, e

    def aged(self, now: float, max_age_s: float) -> bool:
        """Older than `max_age_s` at `now` (the same clock as `taken_at`): the daemon's read
        TTL may end the locks (and lend them to another reader) before a free could land."""
        return self.taken_at is not None and now - self.taken_at > max_age_s

    def forfeit(self) -> None:
        """A call that may consume these locks reached (or may still reach) the daemon."""
        self.forfeited = True
