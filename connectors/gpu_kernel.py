"""The fused scatter/gather row mover for the GPU data path (Triton, where present).

One program per (token row, K/V layer buffer) copies a row between the staging block and the
pool through a table of buffer pointers; it is used only after a byte-exact self-check.
"""

from __future__ import annotations

import logging

import torch

from .gpu_errors import GpuTransferError
from .kv_layout import KVLayout

log = logging.getLogger(__name__)

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def pick_kernel(choice: str, device: torch.device):
    """The Triton row mover if asked for (or auto) and it checks out byte-exact, else None."""
    if choice == "torch" or device.type != "cuda":
        return None
    try:
        kernel = _make_triton_kernel()
        _self_check(kernel, device)
        return kernel
    except Exception as exc:  # noqa: BLE001 - any failure means: use the torch path
        if choice == "triton":
            raise GpuTransferError("kernel_unavailable", repr(exc)) from exc
        log.info("GPU scatter: Triton kernel unavailable (%r); using torch index ops", exc)
        return None


def _make_triton_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def _kv_rows(stage_ptr, table_ptr, slots_ptr, first, C: tl.constexpr, L2: tl.constexpr,
                 H: tl.constexpr, BLOCK: tl.constexpr, GATHER: tl.constexpr, D: tl.constexpr,
                 RS: tl.constexpr, HS: tl.constexpr):
        t = tl.program_id(0)  # row of this call (one token)
        b = tl.program_id(1)  # buffer: kv * L + layer
        g = t + first  # row in the stage, counting dropped rows
        chunk = g // C
        r = g - chunk * C
        slot = tl.load(slots_ptr + t)
        base = tl.load(table_ptr + b).to(tl.pointer_type(stage_ptr.dtype.element_ty))
        srow = stage_ptr + ((chunk * L2 + b) * C + r).to(tl.int64) * H
        prow = base + slot * RS  # a pool row: heads of D elements, HS apart
        for i in tl.static_range(0, H, BLOCK):
            offs = i + tl.arange(0, BLOCK)
            m = offs < H
            if HS == D:
                poffs = offs
            else:
                poffs = (offs // D) * HS + offs % D
            if GATHER:
                tl.store(srow + offs, tl.load(prow + poffs, mask=m), mask=m)
            else:
                tl.store(prow + poffs, tl.load(srow + offs, mask=m), mask=m)

    def run(stage, table, slots_dev, rows, first, layout: KVLayout, *, gather: bool,
            strides: tuple[int, int] | None = None) -> None:
        """`strides`: the pool buffers' (row, head) strides in elements when they are not
        dense `[slots, heads, head_dim]` (K and V halves of vLLM's interleaved rows)."""
        it = _INT_OF_SIZE[layout.dtype.itemsize]
        hid, d = layout.hidden_dim, layout.head_dim
        rs, hs = strides or (hid, d)
        block = min(triton.next_power_of_2(hid), 4096)
        _kv_rows[(rows, 2 * layout.num_layers)](
            stage.view(it), table, slots_dev, first, C=layout.chunk_size,
            L2=2 * layout.num_layers, H=hid, BLOCK=block, GATHER=gather, D=d, RS=rs, HS=hs)

    return run


def _self_check(kernel, device: torch.device) -> None:
    """A small scatter and gather against torch indexing, into dense buffers and into K and V
    halves of interleaved rows (vLLM's layout); raises unless byte-exact."""
    lay = KVLayout(num_layers=2, num_heads=2, head_dim=8, dtype=torch.bfloat16, chunk_size=4)
    g = torch.Generator(device="cpu").manual_seed(3)
    stage = torch.randn((2, *lay.chunk_shape), generator=g).to(lay.dtype).to(device)
    slots = torch.randperm(32, generator=g)[:7].to(device)  # first = 1: drops one row
    rows = stage.permute(1, 2, 0, 3, 4).reshape(4, 8, lay.hidden_dim)[:, 1:]
    h, d = lay.num_heads, lay.head_dim
    dense = [torch.zeros(32, h, d, dtype=lay.dtype, device=device) for _ in range(4)]
    kv = [torch.zeros(32, h, 2 * d, dtype=lay.dtype, device=device) for _ in range(2)]
    halves = [kv[0][..., :d], kv[1][..., :d], kv[0][..., d:], kv[1][..., d:]]  # K0 K1 V0 V1
    for pool, strides in ((dense, None), (halves, (2 * h * d, 2 * d))):
        table = torch.tensor([t.data_ptr() for t in pool], dtype=torch.int64, device=device)
        kernel(stage, table, slots, 7, 1, lay, gather=False, strides=strides)
        for b in range(4):
            if not torch.equal(pool[b][slots].reshape(7, -1), rows[b]):
                raise RuntimeError("Triton scatter self-check mismatch")
        back = torch.zeros_like(stage)
        kernel(back, table, torch.cat([slots[:1], slots]), 8, 0, lay, gather=True,
               strides=strides)
        back_rows = back.permute(1, 2, 0, 3, 4).reshape(4, 8, lay.hidden_dim)
        if not torch.equal(back_rows[:, 1:], rows):
            raise RuntimeError("Triton gather self-check mismatch")
