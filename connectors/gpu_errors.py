"""GpuTransferError: a CUDA call that failed while moving KV, as a typed connector error.

`cuda_call` wraps every torch CUDA operation of the GPU data path so that nothing but this
error leaves it; the orchestrator degrades the load with its `reason`.
"""

from __future__ import annotations

import torch

from .errors import ConnectorError


class GpuTransferError(ConnectorError):
    """A CUDA call failed while moving KV (registration, copy, scatter, gather).

    `reason` is a short machine-readable cause (e.g. "host_register_failed", "copy_failed").
    The load is degraded: the slots may hold part of it and must be recomputed.
    """

    def __init__(self, reason: str, detail: str) -> None:
        self.reason = reason
        super().__init__(f"GPU transfer failed ({reason}): {detail}")


def cuda_call(reason: str, fn, *args, **kwargs):
    """Run a torch CUDA operation; RuntimeError (torch's CUDA errors) -> GpuTransferError."""
    try:
        return fn(*args, **kwargs)
    except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:  # AcceleratorError is one
        raise GpuTransferError(reason, str(exc).splitlines()[0]) from exc
