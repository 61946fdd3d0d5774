"""Retrieval: one retrieve's obligations to the daemon, recorded as its calls go out and
released once, whatever path ends it (loaded, failed part-way, prepared and never used)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Hashable

from .errors import ConnectorError

#: An owed release, paid as `pay(timeout_s)`.
Release = Callable[[float], object]


@dataclass(frozen=True)
class Owed:
    """One release the daemon is owed for tokens [start, end) of a retrieval."""

    what: str       # "commit_retrieve" (a prepared range) or "free_locks" (never asked for)
    start: int
    end: int
    pay: Release
    #: Told when the step is handed over to be paid (`Outstanding.mark_due`).
    due: Callable[[], None] | None = None

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

    Each step owed is an obligation of its own: `release(timeout_s)` tries every step, in
    order, each with the whole `timeout_s` (released twice, paid once; a step that raises
    stays owed, the steps after it are still tried, and the first raise goes to the caller).
    `hand_over()` answers True exactly once, when something is owed: the caller then queues
    each of `owed` as a debt of incarnation `epoch`, paid by `pay_step`; nothing may be
    recorded after it.
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
        #: The free of [asked_to, end) at release, whatever asked_to is by then (`owe_rest`).
        self._rest: Callable[[int, int, float], object] | None = None
        #: What was paid, in order (tests and debugging read it).
        self.paid: list[Owed] = []
        self._handed_over = False
        self._lock = threading.Lock()  # one payer at a time: each step paid once

    # -- what the connector records, as calls go out ---------------------------------

    def asked(self, end: int, commit: Release | None,
              due: Callable[[], None] | None = None) -> None:
        """A prepare_retrieve of [asked_to, end) reached the daemon, or may still: the
        lookup's locks on it moved to a daemon transfer that `commit` releases (None: the
        daemon is owed nothing for it); `due` is told when the commit is handed over."""
        self._open()
        if not self.asked_to < end <= self.end:
            raise ValueError(f"asked up to {end}, outside ({self.asked_to}, {self.end}]")
        if commit is not None:
            self._owed.append(Owed("commit_retrieve", self.asked_to, end, commit, due))
        self.asked_to = end

    def owe(self, what: str, start: int, end: int, pay: Release) -> None:
        """Another release the range needs (the free of the pieces never asked for)."""
        self._open()
        self._owed.append(Owed(what, start, end, pay))

    def owe_rest(self, pay: Callable[[int, int, float], object]) -> None:
        """Once any of the range was asked for (`locks_moved`), the lookup's locks on what
        was not are this retrieval's to free: `pay(asked_to, end, timeout_s)` at release,
        for whatever is still not asked for then (a load that goes on asking in pieces
        leaves less, or nothing). A range prepared in part at match owes it from the start."""
        self._open()
        self._rest = pay

    @property
    def rest_owed(self) -> bool:
        """`owe_rest` was recorded (it covers any free of what is never asked for)."""
        return self._rest is not None

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
            rest = [self._rest_step()] if self._rest_due else []
            return list(self._owed) + rest

    @property
    def owes(self) -> bool:
        return bool(self._owed) or self._rest_due

    @property
    def _rest_due(self) -> bool:
        return self._rest is not None and self.start < self.asked_to < self.end

    def hand_over(self) -> bool:
        """True the first time it is asked while something is owed (the caller queues each
        step of `owed`, once); False after that, or when nothing is owed. Closes the record:
        the free of what was never asked for becomes a step of its own."""
        first, self._handed_over = not self._handed_over, True
        if first:
            with self._lock:
                self._fix_rest()
                for step in self._owed:
                    if step.due is not None:
                        step.due()
        return first and self.owes

    def release(self, timeout_s: float) -> bool:
        """Pay every step owed, each at most once and with its own `timeout_s`: a step that
        raises stays owed and the steps after it are still tried; the first raise then goes
        to the caller, which decides whether to ask again."""
        failed: BaseException | None = None
        with self._lock:
            self._fix_rest()
            for step in list(self._owed):
                try:
                    step.pay(timeout_s)
                except Exception as exc:  # noqa: BLE001 - owed still; raised after the rest
                    failed = failed or exc
                    continue
                self._settle(step)
        if failed is not None:
            raise failed
        return True

    def pay_step(self, step: Owed, timeout_s: float) -> object:
        """Pay one step of `owed` (a debt of its own once handed over); a step already paid
        is not sent again. What it raises leaves it owed."""
        with self._lock:
            if not any(o is step for o in self._owed):
                return True
            result = step.pay(timeout_s)
            self._settle(step)
            return result

    def _settle(self, step: Owed) -> None:
        self._owed = [o for o in self._owed if o is not step]
        self.paid.append(step)

    def _rest_step(self) -> Owed:
        s, pay = self.asked_to, self._rest
        return Owed("free_locks", s, self.end, lambda t: pay(s, self.end, t))

    def _fix_rest(self) -> None:
        """The free of [asked_to, end), due now, becomes a step like the others."""
        if self._rest_due:
            self._owed.append(self._rest_step())
        self._rest = None

    def pay_commits(self, upto: int, timeout_s: float) -> int:
        """Pay, now, the commits at the head of what is owed that end by `upto` (pieces
        whose copy completed): a pipelined load releases them behind its copy. Returns how
        many were paid; one that raises stays owed (the caller's release tries it again)."""
        deadline, n = time.monotonic() + timeout_s, 0
        with self._lock:
            while self._owed and self._owed[0].what == "commit_retrieve" \
                    and self._owed[0].end <= upto:
                self._owed[0].pay(max(0.0, deadline - time.monotonic()))
                self.paid.append(self._owed.pop(0))
                n += 1
        return n

    def __repr__(self) -> str:
        return (f"Retrieval([{self.start}, {self.end}), epoch {self.epoch}, asked to "
                f"{self.asked_to}, owed {self._owed}, paid {self.paid})")


class CommitBehind:
    """A pipelined load's commits, paid behind its copy: each piece's commit_retrieve once
    that piece's copy completed (its `ready` event answers `query()` True), while later
    pieces are asked for and copied. Never waits; what is left (the last pieces, or all
    after a commit that raised) the caller's release pays, as before."""

    def __init__(self, retrieval: Retrieval) -> None:
        self.retrieval = retrieval
        self._landed: list[tuple[int, object]] = []  # (piece end, its ready event)
        self.failed = False

    def landed(self, end: int, ready) -> None:
        """The copy of the piece ending at token `end` is queued; `ready` completes after."""
        if ready is not None:
            self._landed.append((end, ready))

    def pay_landed(self, timeout_s: float) -> int:
        """Pay the commits of the pieces whose copy completed; how many were paid."""
        done_to = None
        while self._landed and self._landed[0][1].query():
            done_to = self._landed.pop(0)[0]
        if done_to is None or self.failed:
            return 0
        try:
            return self.retrieval.pay_commits(done_to, timeout_s)
        except Exception:  # noqa: BLE001 - stays owed; the release pays it off the path
            self.failed = True
            return 0


class TransferBusy(ConnectorError):
    """A prepare_retrieve not sent: this instance has one of the same key identity
    outstanding (`Outstanding`). Nothing moved: the lookup's locks are still the caller's."""


class Outstanding:
    """The key identities this registered instance has a shared-memory prepare_retrieve
    outstanding for: from just before it is sent until its commit_retrieve was answered.

    lmcache 0.5.6 parks a prepared retrieve's read locks under (instance, key), and its key
    equality leaves out request_id: a second prepare of one identity would overwrite the
    first's entry (its locks orphaned until the read TTL) and the first commit would release
    the second's while it copies. So a second claim raises `TransferBusy` at once while the
    first's commit is not yet due (its load may still be queued: waiting would spend the
    caller's deadline for nothing), and waits up to `wait_s` for it once it is due (handed
    over to be paid: a range released and asked for again). An entry of another daemon
    incarnation (`epoch`) is gone with it: a claim on a new epoch drops them all. One whose
    commit was given up stops counting after `max_age_s` (the daemon's read TTL ends its
    locks by then). Thread-safe; holds only what is outstanding.
    """

    def __init__(self, max_age_s: float = 300.0, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self.max_age_s = max_age_s
        self._clock = clock
        self._epoch: int | None = None
        self._held: dict[Hashable, list] = {}  # identity -> [claim, since, due]
        self._changed = threading.Condition()

    def claim(self, identity: Hashable, epoch: int, wait_s: float = 0.0) -> object:
        """Mark `identity` outstanding on incarnation `epoch`; the claim `release` takes.
        Raises TransferBusy when it is outstanding already (after up to `wait_s` if due)."""
        deadline = time.monotonic() + wait_s
        with self._changed:
            if epoch != self._epoch:  # the old incarnation's transfers are gone with it
                self._epoch, self._held = epoch, {}
            while True:
                held = self._held.get(identity)
                if held is None or self._clock() - held[1] >= self.max_age_s:
                    break
                left = deadline - time.monotonic()
                if not held[2] or left <= 0:
                    raise TransferBusy("a prepare_retrieve of the same range is outstanding "
                                       "from this instance (another request of this prefix)")
                self._changed.wait(left)
            claim = object()
            self._held[identity] = [claim, self._clock(), False]
            return claim

    def mark_due(self, identity: Hashable, claim: object) -> None:
        """`claim`'s commit was handed over to be paid: a claim of it may wait for it."""
        with self._changed:
            held = self._held.get(identity)
            if held is not None and held[0] is claim:
                held[2] = True

    def release(self, identity: Hashable, claim: object) -> None:
        """`claim` ended (its commit answered, or its prepare never sent or refused)."""
        with self._changed:
            held = self._held.get(identity)
            if held is not None and held[0] is claim:
                del self._held[identity]
                self._changed.notify_all()

    def __len__(self) -> int:
        with self._changed:
            return len(self._held)
