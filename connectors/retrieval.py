"""Retrieval: one retrieve's obligations to the daemon, recorded as its calls go out and
released once, whatever path ends it (loaded, failed part-way, prepared and never used)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

#: An owed release, paid as `pay(timeout_s)`.
Release = Callable[[float], object]


@dataclass(frozen=True)
class Owed:
    """One release the daemon is owed for tokens [start, end) of a retrieval."""

    what: str       # "commit_retrieve" (a prepared range) or "free_locks" (never asked for)
    start: int
    end: int
    pay: Release

    def __repr__(self) -> str:
        return f"{self.what}[{self.start}, {self.end})"


class Retrieval:
    """One retrieve of tokens [start, end), on daemon incarnation `epoch`.

    The caller makes it before any call can raise and keeps it whatever happens. The
    connector records each prepare_retrieve that the daemon may serve (`asked`: answered,
    or sent and unanswered) with its commit_retrieve, and any other release the range needs
    (`owe`: the read locks of pieces never asked for, once earlier pieces were). From the
    first `asked`, the lookup's read locks on [start, end) are no longer the caller's to
    free (`locks_moved`): what this retrieval owes releases every one of them.

    `release(timeout_s)` pays what is owed, each step at most once and in order (released
    twice, paid once; a step that raises stays owed and is tried first next time).
    `hand_over()` answers True exactly once, when something is owed: the caller then queues
    `release` as one debt of incarnation `epoch`; nothing may be recorded after it.
    """

    def __init__(self, epoch: int, start: int, end: int, *, shard: bool = False) -> None:
        if end < start:
            raise ValueError(f"retrieval of [{start}, {end}): end before start")
        self.epoch = epoch
        self.start = start
        self.end = end
        #: The lookup's locks are this KV rank's shard only (a TP rank that retrieves its
        #: own): a free of the range never asked for releases that share alone.
        self.shard = shard
        #: [start, asked_to) was asked for in prepare_retrieve calls the daemon may serve.
        self.asked_to = start
        self._owed: list[Owed] = []
        #: What was paid, in order (tests and debugging read it).
        self.paid: list[Owed] = []
        self._handed_over = False
        self._lock = threading.Lock()  # one payer at a time: each step paid once

    # -- what the connector records, as calls go out ---------------------------------

    def asked(self, end: int, commit: Release | None) -> None:
        """A prepare_retrieve of [asked_to, end) reached the daemon, or may still: the
        lookup's locks on it moved to a daemon transfer that `commit` releases (None: the
        daemon is owed nothing for it)."""
        self._open()
        if not self.asked_to < end <= self.end:
            raise ValueError(f"asked up to {end}, outside ({self.asked_to}, {self.end}]")
        if commit is not None:
            self._owed.append(Owed("commit_retrieve", self.asked_to, end, commit))
        self.asked_to = end

    def owe(self, what: str, start: int, end: int, pay: Release) -> None:
        """Another release the range needs (the free of the pieces never asked for)."""
        self._open()
        self._owed.append(Owed(what, start, end, pay))

    def _open(self) -> None:
        if self._handed_over:
            raise RuntimeError("retrieval already handed over: nothing more may be owed")

    # -- what the caller asks ----------------------------------------------------------

    @property
    def locks_moved(self) -> bool:
        """The lookup's read locks on [start, end) are no longer the caller's to free."""
        return self.asked_to > self.start

    @property
    def owed(self) -> list[Owed]:
        """What is owed and not yet paid, in the order it will be paid."""
        with self._lock:
            return list(self._owed)

    @property
    def owes(self) -> bool:
        return bool(self._owed)

    def hand_over(self) -> bool:
        """True the first time it is asked while something is owed (the caller queues
        `release`, once); False after that, or when nothing is owed. Closes the record."""
        first, self._handed_over = not self._handed_over, True
        return first and self.owes

    def release(self, timeout_s: float) -> bool:
        """Pay what is owed, each step at most once; a step that raises stays at the head
        (its exception goes to the caller, which decides whether to ask again)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._owed:
                step = self._owed[0]
                step.pay(max(0.0, deadline - time.monotonic()))
                self.paid.append(self._owed.pop(0))
        return True

    def __repr__(self) -> str:
        return (f"Retrieval([{self.start}, {self.end}), epoch {self.epoch}, asked to "
                f"{self.asked_to}, owed {self._owed}, paid {self.paid})")
