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

from connectors.errors import ProtocolError
from connectors.safe_decode import dump_tensor_list, load_tensor_list

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
