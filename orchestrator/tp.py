"""One decision per prefix across tensor-parallel ranks.

Every rank runs match/load_back for the same request in the same order (SGLang's
scheduler is SPMD across TP ranks); each reduces its local answer with MIN over the TP
group, so a rank that failed (-1, or 0 for success flags) makes every rank degrade.
"""

from __future__ import annotations

import torch


class TPAgreement:
    def __init__(self, group=None) -> None:
        self.group = group
        self.enabled = group is not None and torch.distributed.is_initialized() and \
            torch.distributed.get_world_size(group) > 1

    def min(self, value: int) -> int:
        if not self.enabled:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=self.group)
        return int(t.item())
