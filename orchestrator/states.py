"""The per-prefix state machine: one table (TRANSITIONS), one shared `transitions.Machine`
built and validated from it. `fire` applies the transition the Machine defines for (state,
trigger), read from its event table, without running its execution engine per trigger (no
callbacks or conditions are declared); a test pins `fire` to the Machine for every pair.
"""

from __future__ import annotations

import enum

from transitions import Machine, MachineError

__all__ = ["PrefixState", "DegradeReason", "TRANSITIONS", "fire", "MachineError", "mermaid"]


class PrefixState(str, enum.Enum):
    LOOKING_UP = "looking_up"   # LOOKUP sent; no answer yet (a clean miss leaves no trace)
    MATCHED = "matched"         # the daemon holds more than the local cache, under read locks
    MARKED = "marked"           # promised to the engine; the marker is stored
    RETRIEVING = "retrieving"   # RETRIEVE in flight (attempt k of n, deadline t)
    LOADED = "loaded"           # terminal: every promised token landed, checked
    DEGRADED = "degraded"       # terminal: the engine recomputes; always has a reason

    @property
    def terminal(self) -> bool:
        return self in (PrefixState.LOADED, PrefixState.DEGRADED)


class DegradeReason(str, enum.Enum):
    LOOKUP_TIMEOUT = "lookup_timeout"
    LOOKUP_ERROR = "lookup_error"
    BREAKER_OPEN = "breaker_open"
    BELOW_BREAK_EVEN = "below_break_even"
    RETRIEVE_TIMEOUT = "retrieve_timeout"
    RETRIEVE_ERROR = "retrieve_error"
    SHORT_READ = "short_read"
    CORRUPT_DATA = "corrupt_data"
    ALLOC_FAILED = "alloc_failed"
    BAD_SLOTS = "bad_slots"
    DAEMON_RESTARTED = "daemon_restarted"
    TP_PEER_FAILED = "tp_peer_failed"
    ABORTED = "aborted"         # the engine aborted the request
    UNUSED = "unused"           # the request finished without loading what was promised
    LEASE_EXPIRED = "lease_expired"  # promised past lease_max_age_ms: the locks may be gone
    TRANSFER_BUSY = "transfer_busy"  # the same range is prepared for another request already
    L2_STALLED = "l2_stalled"   # the daemon's L2 store is stalled: a miss at once, no LOOKUP
    CLOSED = "closed"


_LIVE = [PrefixState.LOOKING_UP, PrefixState.MATCHED, PrefixState.MARKED,
         PrefixState.RETRIEVING]

#: (trigger, sources, destination). Fits on one screen; everything else derives from it.
TRANSITIONS: list[tuple[str, list[PrefixState], PrefixState]] = [
    ("hit", [PrefixState.LOOKING_UP], PrefixState.MATCHED),
    ("mark", [PrefixState.MATCHED], PrefixState.MARKED),
    ("start_retrieve", [PrefixState.MARKED], PrefixState.RETRIEVING),
    ("retry", [PrefixState.RETRIEVING], PrefixState.RETRIEVING),
    ("land", [PrefixState.RETRIEVING], PrefixState.LOADED),
    ("degrade", _LIVE, PrefixState.DEGRADED),
]

MACHINE = Machine(
    model=None,
    states=[s.value for s in PrefixState],
    transitions=[
        {"trigger": t, "source": [s.value for s in src], "dest": dst.value}
        for t, src, dst in TRANSITIONS
    ],
    initial=PrefixState.LOOKING_UP.value,
    auto_transitions=False,
)
_EVENTS = MACHINE.events
#: (source, trigger) -> destination, read from the Machine built above.
_COMPILED: dict[tuple[str, str], str] = {
    (src, name): transitions[0].dest
    for name, event in MACHINE.events.items()
    for src, transitions in event.transitions.items()
}


def fire(prefix, trigger: str) -> tuple[str, str]:
    """Apply `trigger` to `prefix` (which has a `.state` str); returns (src, dst).

    Raises transitions.MachineError for a transition the table does not define.
    """
    src = prefix.state
    try:
        prefix.state = dst = _COMPILED[(src, trigger)]
    except KeyError:
        raise MachineError(f"Can't trigger event {trigger} from state {src}!") from None
    return src, dst


def fire_with_machine(prefix, trigger: str) -> tuple[str, str]:
    """The same through transitions' execution engine (reference for the tests)."""
    src = prefix.state
    _EVENTS[trigger].trigger(prefix)
    return src, prefix.state


def transition_pairs() -> list[tuple[str, str]]:
    return [(s.value, dst.value) for _, src, dst in TRANSITIONS for s in src]


def mermaid() -> str:
    """The table as a mermaid state diagram (the README embeds this output)."""
    lines = ["stateDiagram-v2", f"    [*] --> {PrefixState.LOOKING_UP.value}"]
    for trigger, src, dst in TRANSITIONS:
        for s in src:
            lines.append(f"    {s.value} --> {dst.value}: {trigger}")
    lines.append(f"    {PrefixState.LOOKING_UP.value} --> [*]: miss (no trace)")
    for s in (PrefixState.LOADED, PrefixState.DEGRADED):
        lines.append(f"    {s.value} --> [*]")
    return "\n".join(lines)
