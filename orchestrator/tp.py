"""One decision per prefix across tensor-parallel ranks: every rank makes the same collectives
in the same order (SGLang's scheduler is SPMD); the leader (rank 0) sends the group's LOOKUP
and `share` hands its answer to every rank in the same all-reduce that lets any rank veto it.
"""

from __future__ import annotations

import torch

#: What a rank that is not the leader contributes to `share` when it has no objection.
_NO_OBJECTION = 2**62


class TPAgreement:
    def __init__(self, group=None) -> None:
        self.group = group
        self.enabled = group is not None and torch.distributed.is_initialized() and \
            torch.distributed.get_world_size(group) > 1
        self.size = torch.distributed.get_world_size(group) if self.enabled else 1
        self.rank = torch.distributed.get_rank(group) if self.enabled else 0

    @property
    def leader(self) -> bool:
        """This rank sends the group's LOOKUPs (and frees what they locked for all ranks)."""
        return self.rank == 0

    def min(self, value: int) -> int:
        return self.min_each([value])[0]

    def min_each(self, values: list[int]) -> list[int]:
        """Each value's minimum over the ranks, in one all-reduce (every rank passes as many
        values)."""
        if not self.enabled:
            return list(values)
        t = torch.tensor(values, dtype=torch.int64)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=self.group)
        return [int(v) for v in t.tolist()]

    def share(self, value: int, *, ok: bool = True) -> int:
        """The leader's `value` on every rank, or -1 when any rank says it cannot (`ok`
        False, or the leader's own value negative). One all-reduce."""
        if not self.enabled:
            return value if ok else -1
        mine = (value if self.leader else _NO_OBJECTION) if ok else -1
        return self.min(mine)
