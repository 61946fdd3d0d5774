"""What the scheduler side ships to the worker side each step (vLLM pickles it): plain data.

Per request: the blocks to fill from the daemon (`LoadOp`) and the blocks to save to it
(`StoreOp`), each with the daemon session it runs under and the token ids it is keyed by.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass
class LoadOp:
    """Load tokens [start, end) of the prompt into `block_ids` (one block per `block_size`
    tokens of that range; `start` and `end` are block aligned, `end` chunk aligned), under
    the daemon session of the scheduler's LOOKUP, whose read locks (`locked`) and session
    the worker ranks now release (orchestrator/handoff.py)."""

    session: str
    token_ids: list[int]      # the prompt's tokens up to the LOOKUP's hit (what it is keyed by)
    start: int
    end: int
    block_ids: list[int]
    cache_salt: str = ""
    #: False: nothing on the daemon backs these blocks (vLLM allocated tokens that were not
    #: promised, or the LOOKUP's locks were released): the worker reports them as errors.
    promised: bool = True
    #: The tokens [start, end) the LOOKUP still read-locks, all the worker ranks' to free or
    #: load (the scheduler's hand_off); None: not handed off.
    locked: tuple[int, int] | None = None


@dataclass
class StoreOp:
    """Save the whole chunks `token_ids` (from token 0) held in `block_ids`."""

    session: str
    token_ids: list[int]
    block_ids: list[int]
    cache_salt: str = ""


@dataclass
class LoadBackMeta(KVConnectorMetadata):
    loads: dict[str, LoadOp] = field(default_factory=dict)
    stores: dict[str, StoreOp] = field(default_factory=dict)
