"""load_tensor_list: byte-exact for real payloads, ProtocolError (only) for everything else."""

from __future__ import annotations

import collections
import io
import os
import pickle
import pickletools
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmcache_loadback.connectors.errors import ProtocolError
from lmcache_loadback.connectors.safe_decode import dump_tensor_list, load_tensor_list

SHAPE = (2, 2, 16, 64)
DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def tensors(dtype, n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(SHAPE, generator=g).to(dtype) for _ in range(n)]


def load(data, dtype=torch.float16, shape=SHAPE, max_items=8):
    return load_tensor_list(data, expected_shape=shape, expected_dtype=dtype, max_items=max_items)


def pickled_globals(data: bytes) -> set[str]:
    """Every string a pickle names (statically, nothing is run): proves a payload is live."""
    return {str(arg) for _, arg, _ in pickletools.genops(data) if isinstance(arg, str)}


class RunsCommand:
    """Unpickling this runs a shell command."""

    def __init__(self, cmd: str) -> None:
        self.cmd = cmd

    def __reduce__(self):
        return (os.system, (self.cmd,))


class StorageRecord:
    """Pickles as torch.storage._load_from_bytes(blob), like a real tensor's storage."""

    def __init__(self, blob: bytes) -> None:
        self.blob = blob

    def __reduce__(self):
        return (torch.storage._load_from_bytes, (self.blob,))


class TensorOver:
    """Pickles as _rebuild_tensor_v2(<record>, ...): a tensor whose storage record we chose."""

    def __init__(self, record, shape, stride, offset=0) -> None:
        self.args = (record, offset, shape, stride, False, collections.OrderedDict())

    def __reduce__(self):
        return (torch._utils._rebuild_tensor_v2, self.args)


def storage_record(t: torch.Tensor, *, zip_format: bool) -> bytes:
    typed = torch.storage.TypedStorage(wrap_storage=t.untyped_storage(), dtype=t.dtype,
                                       _internal=True)
    buf = io.BytesIO()
    torch.save(typed, buf, _use_new_zipfile_serialization=zip_format)
    return buf.getvalue()


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_is_byte_exact(dtype):
    orig = tensors(dtype)
    for data in (pickle.dumps(orig), dump_tensor_list(orig), memoryview(pickle.dumps(orig))):
        got = load(data, dtype)
        assert len(got) == len(orig)
        for a, b in zip(orig, got):
            assert type(b) is torch.Tensor and not b.requires_grad
            assert torch.equal(a, b)
            assert torch.equal(a.view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_nan_payloads_survive(dtype):
    bits = torch.randint(-(2**15), 2**15, SHAPE, dtype=torch.int16)
    got = load(pickle.dumps([bits.view(dtype)]), dtype)
    assert torch.equal(got[0].contiguous().view(torch.int16), bits)


@pytest.mark.parametrize("dtype", DTYPES)
def test_zip_storage_records_load_too(dtype):
    """torch.save's zip format (64-byte aligned entries) takes the zero-copy path."""
    orig = tensors(dtype, n=2)
    payload = pickle.dumps([TensorOver(StorageRecord(storage_record(t, zip_format=True)),
                                       SHAPE, t.stride()) for t in orig])
    assert "torch.storage" in pickled_globals(payload)
    got = load(payload, dtype)
    assert all(torch.equal(a, b) for a, b in zip(orig, got))


def test_view_with_offset_into_larger_storage():
    base = torch.arange(3 * 4096, dtype=torch.float32)
    view = base[4096:8192].view(SHAPE)
    got = load(pickle.dumps([view]), torch.float32)
    assert torch.equal(got[0], view)


def test_dump_sends_only_each_views_bytes():
    staging = torch.randn(4, *SHAPE).half()
    views = list(staging.unbind(0))
    data = dump_tensor_list(views)
    assert len(data) < 1.1 * staging.numel() * 2
    assert all(torch.equal(a, b) for a, b in zip(views, load(data)))
    with pytest.raises(TypeError):
        dump_tensor_list([staging[0], "x"])


def test_os_system_payload_refused(tmp_path):
    marker = tmp_path / "pwned"
    payload = pickle.dumps([RunsCommand(f"touch {marker}")])
    assert "system" in " ".join(pickled_globals(payload))
    with pytest.raises(ProtocolError, match=r"refused global (posix|os)\.system"):
        load(payload)
    assert not marker.exists()


@pytest.mark.parametrize("zip_format", [True, False])
def test_nested_payload_in_storage_record_refused(tmp_path, zip_format):
    """The outer pickle names only admitted globals; the code hides in the storage record."""
    marker = tmp_path / "pwned"
    buf = io.BytesIO()
    torch.save(RunsCommand(f"touch {marker}"), buf, _use_new_zipfile_serialization=zip_format)
    blob = buf.getvalue()
    if zip_format:
        import zipfile

        with zipfile.ZipFile(io.BytesIO(blob)) as zf:
            inner = zf.read(next(n for n in zf.namelist() if n.endswith("data.pkl")))
        assert "system" in " ".join(pickled_globals(inner))
    else:
        assert b"system" in blob
    payload = pickle.dumps([TensorOver(StorageRecord(blob), SHAPE, (2048, 1024, 64, 1))])
    assert pickled_globals(payload) >= {"torch.storage", "_load_from_bytes"}
    with pytest.raises(ProtocolError, match="system"):
        load(payload)
    assert not marker.exists()


@pytest.mark.parametrize("dtype", DTYPES)
def test_wrong_dtype_refused(dtype):
    other = torch.float32 if dtype != torch.float32 else torch.float16
    want = re.escape(f"expected {SHAPE} {other}, got {SHAPE} {dtype}")
    with pytest.raises(ProtocolError, match=want):
        load(pickle.dumps(tensors(dtype)), other)


def test_wrong_shape_refused():
    t = torch.zeros(2, 2, 8, 64, dtype=torch.float16)
    want = r"item 0: expected \(2, 2, 16, 64\).*got \(2, 2, 8, 64\)"
    with pytest.raises(ProtocolError, match=want):
        load(pickle.dumps([t]))


def test_too_many_items_refused():
    with pytest.raises(ProtocolError, match="more tensors than allowed"):
        load(pickle.dumps(tensors(torch.float16, n=3)), max_items=2)
    assert len(load(pickle.dumps(tensors(torch.float16, n=2)), max_items=2)) == 2
    with pytest.raises(ProtocolError, match="at most 2"):  # one tensor, memoized thrice
        load(pickle.dumps(tensors(torch.float16, n=1) * 3), max_items=2)


@pytest.mark.parametrize("obj", [{"a": 1}, 5, (torch.zeros(SHAPE).half(),), [1, 2],
                                 [torch.zeros(SHAPE).half().requires_grad_(False), None]])
def test_wrong_container_or_items_refused(obj):
    with pytest.raises(ProtocolError):
        load(pickle.dumps(obj))


def test_requires_grad_refused():
    t = torch.zeros(SHAPE, dtype=torch.float32, requires_grad=True)
    with pytest.raises(ProtocolError, match="unexpected arguments"):
        load(pickle.dumps([t]), torch.float32)


def test_record_claiming_more_bytes_than_it_has_refused():
    t = torch.zeros(SHAPE, dtype=torch.float16)
    blob = storage_record(t, zip_format=False)
    payload = pickle.dumps([TensorOver(StorageRecord(blob[:-100]), SHAPE, t.stride())])
    with pytest.raises(ProtocolError):
        load(payload)


@pytest.mark.parametrize("data", [b"", b"\x80", b"not a pickle at all", os.urandom(4096),
                                  b"\x80\x04\x95" + os.urandom(64)])
def test_garbage_refused(data):
    with pytest.raises(ProtocolError):
        load(data)


def test_every_truncation_refused():
    data = pickle.dumps(tensors(torch.float16, n=2))
    cuts = sorted(set(range(0, 800, 7)) | set(range(len(data) - 800, len(data), 7)))
    for cut in cuts:
        with pytest.raises(ProtocolError):
            load(data[:cut])


# built once: storage keys are object ids, so every pickle.dumps differs in length
SMALL = pickle.dumps([torch.zeros(2, 1, 4, 8, dtype=torch.float16)] * 2)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_corrupted_payload_only_ever_raises_protocol_error(data):
    """Flip bytes anywhere: the result is either well-formed tensors or a ProtocolError."""
    payload = bytearray(SMALL)
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(payload) - 1))
        payload[pos] = data.draw(st.integers(0, 255))
    try:
        got = load(bytes(payload), shape=(2, 1, 4, 8))
    except ProtocolError:
        return
    assert all(type(t) is torch.Tensor and t.shape == (2, 1, 4, 8) for t in got)


# -- hostile views: every extent is checked against its storage before a tensor exists ----

STRIDES = (2048, 1024, 64, 1)  # contiguous SHAPE


def legacy_record(numel: int, body: bytes, *, pid=None, key: str = "0") -> bytes:
    """torch.save's legacy storage record built by hand, so its header can lie."""

    class _Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            return obj if isinstance(obj, tuple) else None

    data = io.BytesIO()
    _Pickler(data, protocol=2).dump(pid or ("storage", torch.HalfStorage, key, "cpu", numel, None))
    info = {"protocol_version": 1001, "little_endian": True,
            "type_sizes": {"short": 2, "int": 4, "long": 4}}
    return (pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2) + pickle.dumps(1001, protocol=2)
            + pickle.dumps(info, protocol=2) + data.getvalue() + pickle.dumps([key], protocol=2)
            + numel.to_bytes(8, "little", signed=True) + body)


def half_record(numel: int, *, zip_format: bool) -> bytes:
    return storage_record(torch.arange(numel).half(), zip_format=zip_format)


@pytest.mark.parametrize("zip_format", [False, True])
def test_view_larger_than_its_storage_refused(zip_format):
    """(2, 2, 16, 64) fp16 over 16 bytes: once accepted, the rest was uninitialised heap."""
    payload = pickle.dumps([TensorOver(StorageRecord(half_record(8, zip_format=zip_format)),
                                       SHAPE, STRIDES)])
    with pytest.raises(ProtocolError, match=r"item 0: view of 4096 elements .* storage of 8"):
        load(payload)


@pytest.mark.parametrize("zip_format", [False, True])
@pytest.mark.parametrize("offset", [1, 4096, 2**62])
def test_offset_past_the_end_refused(zip_format, offset):
    payload = pickle.dumps([TensorOver(StorageRecord(half_record(4096, zip_format=zip_format)),
                                       SHAPE, STRIDES, offset=offset)])
    with pytest.raises(ProtocolError, match="exceeds its storage of 4096"):
        load(payload)


@pytest.mark.parametrize("stride, fragment", [
    ((2048, 1024, 64, -1), "unexpected arguments"),
    ((-2048, 1024, 64, 1), "unexpected arguments"),
    ((2**62, 1024, 64, 1), "exceeds its storage"),
    ((2**63 - 1, 2**57, 2**50, 1), "exceeds its storage"),
    ((2**64 + 2048, 1024, 64, 1), "exceeds its storage"),
    ((0, 1024, 64, 1), "overlap"),            # both K and V would read the same bytes
    ((2048, 1024, 32, 1), "overlap"),         # rows alias half of the next row
])
def test_hostile_strides_refused(stride, fragment):
    record = StorageRecord(half_record(1 << 20, zip_format=False))
    with pytest.raises(ProtocolError, match=fragment):
        load(pickle.dumps([TensorOver(record, SHAPE, stride)]))


def test_permuted_dense_view_accepted():
    """A dense view in another dimension order is not an overlap."""
    t = torch.randn(2, 2, 64, 16).half().transpose(2, 3)
    assert not t.is_contiguous()
    assert torch.equal(load(pickle.dumps([t]))[0], t)


def test_overlapping_views_of_one_storage_refused():
    record = StorageRecord(half_record(3 * 4096, zip_format=False))  # pickled once, memoized
    ok = [TensorOver(record, SHAPE, STRIDES, offset=0), TensorOver(record, SHAPE, STRIDES, 4096)]
    assert len(load(pickle.dumps(ok))) == 2
    bad = [TensorOver(record, SHAPE, STRIDES, offset=0), TensorOver(record, SHAPE, STRIDES, 4000)]
    with pytest.raises(ProtocolError, match="item 1: view overlaps the bytes of an earlier"):
        load(pickle.dumps(bad))


def test_one_storage_record_listed_twice_refused():
    """A memoized record reappears as a second storage over the very same bytes."""
    blob = storage_record(torch.zeros(SHAPE, dtype=torch.float16), zip_format=True)
    payload = pickle.dumps([TensorOver(StorageRecord(blob), SHAPE, STRIDES),
                            TensorOver(StorageRecord(blob), SHAPE, STRIDES)])
    with pytest.raises(ProtocolError, match="overlaps"):
        load(payload)


def test_one_tensor_listed_twice_refused():
    with pytest.raises(ProtocolError, match="item 1: the same tensor as item 0"):
        load(pickle.dumps(tensors(torch.float16, n=1) * 2))


@pytest.mark.parametrize("numel", [2**62, 2**63 - 1])
def test_record_declaring_numel_near_2_63_refused(numel):
    payload = pickle.dumps([TensorOver(StorageRecord(legacy_record(numel, b"\0" * 16)),
                                       SHAPE, STRIDES)])
    with pytest.raises(ProtocolError, match="storage record claims"):
        load(payload)


def test_view_declaring_numel_near_2_63_refused():
    big = (2**31, 2**31, 2, 1)
    payload = pickle.dumps([TensorOver(StorageRecord(half_record(8, zip_format=False)),
                                       big, (0, 0, 0, 0))])
    with pytest.raises(ProtocolError, match=r"item 0: expected \(2, 2, 16, 64\)"):
        load(payload)


def test_storages_are_fixed_size_and_aligned():
    """Legacy records take the copy path: that copy must not be resizable either."""
    orig = tensors(torch.float16, n=2)
    for payload in (pickle.dumps(orig), pickle.dumps(
            [TensorOver(StorageRecord(storage_record(t, zip_format=True)), SHAPE, STRIDES)
             for t in orig])):
        for t in load(payload):
            assert not t.untyped_storage().resizable()
            assert t.data_ptr() % 16 == 0
            with pytest.raises(RuntimeError):
                t.untyped_storage().resize_(t.untyped_storage().nbytes() * 2)


DEPTH = 200_000


def nested_storage_id() -> bytes:
    """A storage record whose persistent id is a tuple nested DEPTH levels deep."""
    record = legacy_record(4096, b"\0" * 8192, pid=("storage",))
    head = pickle.dumps("storage", protocol=2)[2:-1]  # the string's opcode, as the id holds it
    assert record.count(head + b"\x85") == 1
    record = record.replace(head + b"\x85", head + b"\x85" * DEPTH)
    return pickle.dumps([TensorOver(StorageRecord(record), SHAPE, STRIDES)])


@pytest.mark.parametrize("payload, fragment", [
    (b"\x80\x02" + b"]" * DEPTH + b"a" * (DEPTH - 1) + b".", "item 0: expected a tensor"),
    (b"\x80\x02)" + b"\x85" * DEPTH + b".", "expected a list of tensors, got tuple"),
    (nested_storage_id(), r"unexpected persistent id \(tuple\)"),
], ids=["list", "tuple", "storage-id"])
def test_deeply_nested_payload_refused(payload, fragment):
    with pytest.raises(ProtocolError, match=fragment):
        load(payload)
