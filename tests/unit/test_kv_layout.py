"""gather_chunks / scatter_chunks: byte-exact round trips between two SGLang-style pools."""

from __future__ import annotations

import pytest
import torch

from lmcache_loadback.connectors.errors import ProtocolError, SlotsError
from lmcache_loadback.connectors.kv_copy import gather_chunks, scatter_chunks
from lmcache_loadback.connectors.kv_layout import KVLayout, KVPool, check_pool, check_slots
from lmcache_loadback.engines.sglang.pools import latent_layout, mha_layout

HEADS, HEAD_DIM, POOL = 2, 32, 4096


def make_pool(layout: KVLayout, slots: int = POOL, seed: int = 0):
    """Random bit patterns (NaN payloads included) so any value-changing copy shows."""
    g = torch.Generator().manual_seed(seed)
    shape = (slots + 1, layout.num_heads, layout.head_dim)

    def layer():
        bits = torch.randint(-(2**15), 2**15, shape, generator=g, dtype=torch.int16)
        return bits.view(layout.dtype) if layout.dtype.itemsize == 2 else bits.to(layout.dtype)

    return ([layer() for _ in range(layout.num_layers)],
            [layer() for _ in range(layout.num_layers)])


def beq(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality: torch.equal says NaN != NaN, and the pools hold NaN payloads."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def same_pool(k, v, before) -> bool:
    return all(beq(a, b) for a, b in zip(k + v, before[0] + before[1]))


def clone_pool(k, v):
    return [t.clone() for t in k], [t.clone() for t in v]


def assert_rows_equal(layout, k1, v1, s1, k2, v2, s2):
    for l in range(layout.num_layers):
        for a, b in ((k1[l], k2[l]), (v1[l], v2[l])):
            assert beq(a[s1], b[s2]), f"layer {l}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_layers", [1, 4])
@pytest.mark.parametrize("chunk_size", [16, 256])
def test_round_trip_between_pools(dtype, num_layers, chunk_size):
    layout = KVLayout(num_layers, HEADS, HEAD_DIM, dtype, chunk_size)
    k1, v1 = make_pool(layout, seed=1)
    k2, v2 = make_pool(layout, seed=2)
    g = torch.Generator().manual_seed(3)
    src = torch.randperm(POOL, generator=g)[:2048] + 1
    dst = torch.randperm(POOL, generator=g)[:2048] + 1
    chunks = gather_chunks(layout, k1, v1, src)
    assert len(chunks) == 2048 // chunk_size
    assert all(c.shape == layout.chunk_shape and c.dtype == dtype for c in chunks)
    before = clone_pool(k2, v2)
    scatter_chunks(layout, chunks, k2, v2, dst)
    assert_rows_equal(layout, k1, v1, src, k2, v2, dst)
    untouched = torch.ones(POOL + 1, dtype=torch.bool)
    untouched[dst] = False
    for l in range(num_layers):  # nothing outside dst moved
        assert beq(k2[l][untouched], before[0][l][untouched])
        assert beq(v2[l][untouched], before[1][l][untouched])


@pytest.mark.parametrize("chunk_size", [16, 256])
def test_chunk_content_layout(chunk_size):
    """Chunk j is [K|V, layer, token, hidden] of tokens j*chunk..(j+1)*chunk-1."""
    layout = KVLayout(3, HEADS, HEAD_DIM, torch.float32, chunk_size)
    k, v = make_pool(layout)
    slots = torch.randperm(POOL)[: 2 * chunk_size] + 1
    chunks = gather_chunks(layout, k, v, slots)
    for j, c in enumerate(chunks):
        s = slots[j * chunk_size:(j + 1) * chunk_size]
        for l in range(3):
            assert beq(c[0, l], k[l][s].reshape(chunk_size, -1))
            assert beq(c[1, l], v[l][s].reshape(chunk_size, -1))


@pytest.mark.parametrize("chunk_size", [16, 256])
def test_contiguous_range_fast_path(chunk_size):
    layout = KVLayout(2, HEADS, HEAD_DIM, torch.float16, chunk_size)
    k1, v1 = make_pool(layout, seed=1)
    k2, v2 = make_pool(layout, seed=2)
    src = torch.arange(100, 100 + 1024)
    dst = torch.arange(7, 7 + 1024)
    scatter_chunks(layout, gather_chunks(layout, k1, v1, src), k2, v2, dst)
    assert_rows_equal(layout, k1, v1, src, k2, v2, dst)


@pytest.mark.parametrize("chunk_size", [16, 256])
def test_partial_gather_into_out_buffers(chunk_size):
    layout = KVLayout(2, HEADS, HEAD_DIM, torch.bfloat16, chunk_size)
    k, v = make_pool(layout)
    slots = torch.randperm(POOL)[: 8 * chunk_size] + 1
    full = gather_chunks(layout, k, v, slots)
    # out tensors as views of one shared staging buffer, like a shm mapping
    staging = torch.zeros((3, *layout.chunk_shape), dtype=layout.dtype)
    out = list(staging.unbind(0))
    got = gather_chunks(layout, k, v, slots, out=out, chunk_indices=[5, 0, 7])
    assert all(g is o for g, o in zip(got, out))
    for o, j in zip(staging, [5, 0, 7]):
        assert beq(o, full[j])


def test_token_major_views_round_trip():
    """Chunks that are slices of one [2, L, N, hidden] staging take the one-op path."""
    layout = KVLayout(2, HEADS, HEAD_DIM, torch.float16, 16)
    k1, v1 = make_pool(layout, seed=1)
    k2, v2 = make_pool(layout, seed=2)
    src, dst = torch.randperm(POOL)[:256] + 1, torch.randperm(POOL)[:256] + 1
    staging = torch.empty(2, 2, 256, layout.hidden_dim, dtype=torch.float16)
    views = [staging[:, :, j * 16:(j + 1) * 16] for j in range(16)]
    gather_chunks(layout, k1, v1, src, out=views)
    assert beq(torch.stack(views), torch.stack(gather_chunks(layout, k1, v1, src)))
    scatter_chunks(layout, views, k2, v2, dst)
    assert_rows_equal(layout, k1, v1, src, k2, v2, dst)


@pytest.mark.parametrize("op_bytes", [1, 64 << 10, 1 << 30])
@pytest.mark.parametrize("contiguous", [False, True])
def test_every_path_is_exact(monkeypatch, op_bytes, contiguous):
    """Per-chunk ops, grouped scratch and one whole-range group must all give the same bytes."""
    import lmcache_loadback.connectors.kv_copy as kvl

    monkeypatch.setattr(kvl, "_OP_BYTES", op_bytes)
    layout = KVLayout(3, HEADS, HEAD_DIM, torch.bfloat16, 16)
    k1, v1 = make_pool(layout, seed=1)
    k2, v2 = make_pool(layout, seed=2)
    if contiguous:
        src, dst = torch.arange(33, 33 + 1024), torch.arange(2000, 2000 + 1024)
    else:
        src, dst = torch.randperm(POOL)[:1024] + 1, torch.randperm(POOL)[:1024] + 1
    chunks = gather_chunks(layout, k1, v1, src)
    scatter_chunks(layout, chunks, k2, v2, dst)
    assert_rows_equal(layout, k1, v1, src, k2, v2, dst)
    out = [torch.empty(layout.chunk_shape, dtype=layout.dtype) for _ in range(3)]
    gather_chunks(layout, k2, v2, dst, out=out, chunk_indices=[63, 1, 2])
    assert all(beq(a, chunks[j]) for a, j in zip(out, [63, 1, 2]))


def test_misaligned_chunks_scatter_exactly():
    """Chunks at odd element offsets cannot be reinterpreted wide; the slow path is exact."""
    layout = KVLayout(2, HEADS, HEAD_DIM, torch.float16, 16)
    k1, v1 = make_pool(layout, seed=1)
    k2, v2 = make_pool(layout, seed=2)
    src, dst = torch.randperm(POOL)[:64] + 1, torch.randperm(POOL)[:64] + 1
    chunks = gather_chunks(layout, k1, v1, src)
    n = chunks[0].numel()
    odd = []
    for c in chunks:
        base = torch.empty(n + 1, dtype=torch.float16)
        base[1:].copy_(c.reshape(-1))
        odd.append(base[1:].view(layout.chunk_shape))
    scatter_chunks(layout, odd, k2, v2, dst)
    assert_rows_equal(layout, k1, v1, src, k2, v2, dst)


def test_layout_properties_and_validation():
    layout = KVLayout(4, 8, 128, torch.float16, 256)
    assert layout.hidden_dim == 1024
    assert layout.chunk_shape == (2, 4, 256, 1024)
    assert layout.bytes_per_token == 2 * 4 * 1024 * 2
    assert layout.chunk_bytes == layout.bytes_per_token * 256
    assert layout.dtype_str == "float16"
    for field, bad in (("num_layers", 0), ("head_dim", -1), ("chunk_size", 1.5),
                       ("num_heads", True)):
        kwargs = dict(num_layers=4, num_heads=8, head_dim=128, dtype=torch.float16,
                      chunk_size=256)
        kwargs[field] = bad
        with pytest.raises(ValueError, match=field):
            KVLayout(**kwargs)
    with pytest.raises(ValueError, match="dtype"):
        KVLayout(4, 8, 128, "float16", 256)


def test_layout_from_an_sglang_pool():
    """The SGLang adapter reads the layout off MHATokenToKVPool-shaped buffers."""
    k = [torch.zeros(65, 4, 16, dtype=torch.bfloat16) for _ in range(3)]
    v = [torch.zeros(65, 4, 16, dtype=torch.bfloat16) for _ in range(3)]
    layout, pool = mha_layout(k, v, 16)
    assert layout == KVLayout(3, 4, 16, torch.bfloat16, 16)
    assert list(pool.k_buffer) == k and list(pool.v_buffer) == v
    with pytest.raises(ValueError):
        mha_layout(k, v[:2], 16)
    with pytest.raises(ValueError, match="v_buffer"):
        mha_layout(k, v[:2] + [torch.zeros(65, 4, 16)], 16)
    with pytest.raises(ValueError, match="k_buffer must be"):
        mha_layout([], [], 16)


def test_a_paged_pool_needs_no_connector_code():
    """A vLLM-style layer `[2, blocks, block_size, heads, dim]`: the layout from numbers, the
    pool from views (slot = block * block_size + offset), chunks land at those rows."""
    layout = KVLayout(2, HEADS, HEAD_DIM, torch.float16, 16)
    paged = [torch.zeros(2, 8, 16, HEADS, HEAD_DIM, dtype=torch.float16) for _ in range(2)]
    pool = KVPool([kv[0].flatten(0, 1) for kv in paged], [kv[1].flatten(0, 1) for kv in paged])
    check_pool(layout, pool)
    k, v = make_pool(layout, slots=255)
    src, dst = torch.randperm(255)[:32] + 1, torch.randperm(128)[:32]
    scatter_chunks(layout, gather_chunks(layout, k, v, src), pool.k_buffer, pool.v_buffer, dst)
    blocks, offs = dst // 16, dst % 16
    for l in range(2):
        assert beq(paged[l][0, blocks, offs], k[l][src])
        assert beq(paged[l][1, blocks, offs], v[l][src])
    with pytest.raises(ValueError, match="k_buffer"):
        check_pool(layout, KVPool([kv[0] for kv in paged], [kv[1] for kv in paged]))


@pytest.fixture
def small():
    layout = KVLayout(2, HEADS, HEAD_DIM, torch.float16, 16)
    k, v = make_pool(layout, slots=255)
    return layout, k, v


def test_wrong_slot_length(small):
    layout, k, v = small
    with pytest.raises(SlotsError, match=r"expected 32 slots .* got 31.*slots\[:32\]"):
        check_slots(layout, torch.arange(1, 32), 32)


def test_not_whole_chunks(small):
    layout, k, v = small
    with pytest.raises(SlotsError, match=r"num_tokens=40 is not a multiple of chunk_size=16.*32"):
        gather_chunks(layout, k, v, torch.arange(1, 41))
    with pytest.raises(SlotsError, match="multiple of chunk_size"):
        check_slots(layout, torch.arange(1, 41), 40)


@pytest.mark.parametrize("bad, where", [(-1, 3), (256, 9), (10**6, 0)])
def test_slot_out_of_range(small, bad, where):
    layout, k, v = small
    slots = torch.arange(1, 33)
    slots[where] = bad
    with pytest.raises(SlotsError, match=rf"slot {bad} at position {where} is out of range"
                                         r" \[0, 256\)"):
        gather_chunks(layout, k, v, slots)
    before = clone_pool(k, v)
    chunks = [torch.zeros(layout.chunk_shape, dtype=torch.float16)] * 2
    with pytest.raises(SlotsError):
        scatter_chunks(layout, chunks, k, v, slots)
    assert same_pool(k, v, before)


def test_slot_dtype_and_shape(small):
    layout, k, v = small
    with pytest.raises(SlotsError, match="integer tensor.*float32"):
        check_slots(layout, torch.arange(32, dtype=torch.float32), 32)
    with pytest.raises(SlotsError, match="1-D"):
        check_slots(layout, torch.arange(32).view(2, 16), 32)
    with pytest.raises(SlotsError, match="torch.Tensor"):
        check_slots(layout, list(range(32)), 32)
    out = check_slots(layout, torch.arange(32, dtype=torch.int32), 32, pool_size=256)
    assert out.dtype == torch.int64 and out.is_contiguous() and out.device.type == "cpu"


def test_chunk_indices_out_of_range(small):
    layout, k, v = small
    with pytest.raises(SlotsError, match="chunk_indices"):
        gather_chunks(layout, k, v, torch.arange(1, 33), chunk_indices=[2])


@pytest.mark.parametrize("bad_index, bad", [
    (1, torch.zeros(2, 2, 8, HEADS * HEAD_DIM, dtype=torch.float16)),
    (0, torch.zeros(2, 2, 16, HEADS * HEAD_DIM, dtype=torch.bfloat16)),
    (1, torch.zeros(2, 3, 16, HEADS * HEAD_DIM, dtype=torch.float16)),
    (1, "not a tensor"),
])
def test_bad_chunk_refused_and_pool_unchanged(small, bad_index, bad):
    layout, k, v = small
    good = torch.ones(layout.chunk_shape, dtype=torch.float16)
    chunks = [good, good, good]
    chunks[bad_index] = bad
    before = clone_pool(k, v)
    with pytest.raises(ProtocolError, match=rf"chunk {bad_index}.*expected"):
        scatter_chunks(layout, chunks, k, v, torch.arange(1, 49))
    assert same_pool(k, v, before)


def test_empty_is_a_no_op(small):
    layout, k, v = small
    assert gather_chunks(layout, k, v, torch.empty(0, dtype=torch.int64)) == []
    scatter_chunks(layout, [], k, v, torch.empty(0, dtype=torch.int64))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_pool_with_cpu_out():
    layout = KVLayout(2, HEADS, HEAD_DIM, torch.float16, 16)
    k1, v1 = (list(map(lambda t: t.cuda(), x)) for x in make_pool(layout, seed=1))
    k2, v2 = (list(map(lambda t: t.cuda(), x)) for x in make_pool(layout, seed=2))
    src, dst = torch.randperm(POOL)[:512] + 1, torch.randperm(POOL)[:512] + 1
    out = [torch.empty(layout.chunk_shape, dtype=torch.float16) for _ in range(32)]
    gather_chunks(layout, k1, v1, src, out=out)
    scatter_chunks(layout, out, k2, v2, dst.cuda())
    assert_rows_equal(layout, k1, v1, src.cuda(), k2, v2, dst.cuda())
    on_dev = gather_chunks(layout, k1, v1, src.cuda())
    assert all(a.is_cuda and beq(a.cpu(), b) for a, b in zip(on_dev, out))


# -- MLA: one latent buffer per layer, chunks [L, chunk, hidden] (the daemon's use_mla shape)

LATENT = 576  # DeepSeek-V2/V3: kv_lora_rank 512 + qk_rope_head_dim 64


def latent_pool(layout: KVLayout, slots: int = POOL, seed: int = 0) -> list[torch.Tensor]:
    """SGLang's MLATokenToKVPool.kv_buffer: per layer [slots + 1, 1, latent]; random bits."""
    g = torch.Generator().manual_seed(seed)
    shape = (slots + 1, layout.num_heads, layout.head_dim)
    return [torch.randint(-(2**15), 2**15, shape, generator=g, dtype=torch.int16)
            .view(layout.dtype) for _ in range(layout.num_layers)]


def mla_layout(num_layers: int = 3, chunk_size: int = 16, dtype=torch.bfloat16) -> KVLayout:
    return latent_layout([torch.zeros(8, 1, LATENT, dtype=dtype)] * num_layers, chunk_size)[0]


def test_mla_layout_shape_matches_the_daemons_use_mla_registration():
    layout = mla_layout(4, 256)
    assert layout == KVLayout(4, 1, LATENT, torch.bfloat16, 256, mla=True)
    assert layout.planes == 1 and layout.hidden_dim == LATENT
    assert layout.chunk_shape == (4, 256, LATENT)  # [num_layers, slots, hidden]
    assert layout.bytes_per_token == 4 * LATENT * 2
    assert layout.chunk_bytes == layout.bytes_per_token * 256
    with pytest.raises(ValueError, match="mla"):
        KVLayout(4, 1, LATENT, torch.bfloat16, 256, mla=1)
    kv = [torch.zeros(65, 1, LATENT) for _ in range(2)]
    with pytest.raises(ValueError, match="no v_buffer"):
        gather_chunks(mla_layout(2), kv, kv, torch.arange(16))
    with pytest.raises(ValueError, match="kv_buffer"):
        latent_layout(kv[:1] + [torch.zeros(65, 1, 8)], 16)


@pytest.mark.parametrize("chunk_size", [16, 256])
@pytest.mark.parametrize("contiguous", [False, True])
def test_mla_round_trip_between_latent_pools(chunk_size, contiguous):
    layout = mla_layout(3, chunk_size)
    a, b = latent_pool(layout, seed=1), latent_pool(layout, seed=2)
    before = [t.clone() for t in b]
    if contiguous:
        src, dst = torch.arange(40, 40 + 1024), torch.arange(3, 3 + 1024)
    else:
        g = torch.Generator().manual_seed(3)
        src = torch.randperm(POOL, generator=g)[:1024] + 1
        dst = torch.randperm(POOL, generator=g)[:1024] + 1
    chunks = gather_chunks(layout, a, (), src)
    assert all(c.shape == layout.chunk_shape and c.dtype == layout.dtype for c in chunks)
    for j, c in enumerate(chunks):  # chunk j: [layer, token, latent] of its tokens
        s = src[j * chunk_size:(j + 1) * chunk_size]
        assert all(beq(c[l], a[l][s].reshape(chunk_size, -1)) for l in range(3))
    scatter_chunks(layout, chunks, b, (), dst)
    untouched = torch.ones(POOL + 1, dtype=torch.bool)
    untouched[dst] = False
    for l in range(3):
        assert beq(b[l][dst], a[l][src])
        assert beq(b[l][untouched], before[l][untouched])


@pytest.mark.parametrize("op_bytes", [1, 64 << 10, 1 << 30])
def test_mla_every_path_is_exact(monkeypatch, op_bytes):
    """Per-chunk, grouped scratch, token-major views and shared out buffers, for MLA."""
    import lmcache_loadback.connectors.kv_copy as kvl

    monkeypatch.setattr(kvl, "_OP_BYTES", op_bytes)
    layout = mla_layout(2, 16)
    a, b = latent_pool(layout, seed=1), latent_pool(layout, seed=2)
    src, dst = torch.randperm(POOL)[:256] + 1, torch.randperm(POOL)[:256] + 1
    chunks = gather_chunks(layout, a, (), src)
    staging = torch.empty(2, 256, LATENT, dtype=layout.dtype)  # token-major: [L, N, hidden]
    views = [staging[:, j * 16:(j + 1) * 16] for j in range(16)]
    gather_chunks(layout, a, (), src, out=views)
    assert beq(torch.stack(views), torch.stack(chunks))
    block = torch.empty((3, *layout.chunk_shape), dtype=layout.dtype)  # back to back (shm)
    gather_chunks(layout, a, (), src, out=list(block.unbind(0)), chunk_indices=[15, 0, 7])
    assert all(beq(block[i], chunks[j]) for i, j in enumerate([15, 0, 7]))
    scatter_chunks(layout, views, b, (), dst)
    assert all(beq(b[l][dst], a[l][src]) for l in range(2))


def test_mla_scatter_skipping_and_refusals():
    from lmcache_loadback.connectors.kv_copy import scatter_skipping

    layout = mla_layout(2, 16)
    a, b = latent_pool(layout, seed=1), latent_pool(layout, seed=2)
    pool = KVPool.latent(b)
    assert pool.kv_buffer is pool.k_buffer and pool.num_slots == POOL + 1
    src, dst = torch.randperm(POOL)[:48] + 1, torch.randperm(POOL)[:48] + 1
    chunks = gather_chunks(layout, a, (), src)
    scatter_skipping(layout, chunks, pool, dst[5:], 5)  # the first 5 tokens already cached
    assert all(beq(b[l][dst[5:]], a[l][src[5:]]) for l in range(2))
    before = [t.clone() for t in b]
    mha_shaped = [torch.zeros((2, *layout.chunk_shape), dtype=layout.dtype)] * 3
    with pytest.raises(ProtocolError, match="expected"):
        scatter_chunks(layout, mha_shaped, b, (), dst)
    with pytest.raises(ProtocolError):
        scatter_skipping(layout, chunks[:2] + mha_shaped[:1], pool, dst[5:], 5)
    assert all(beq(x, y) for x, y in zip(b, before))
    with pytest.raises(AttributeError, match="MHA"):
        KVPool([torch.zeros(4, 1, 8)], [torch.zeros(4, 1, 8)]).kv_buffer
