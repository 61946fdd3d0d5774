"""Restricted loading of pickled tensor lists that come off the LMCache daemon socket.

Socket bytes never reach an unrestricted unpickler: only the globals a `list[torch.Tensor]`
pickle names are admitted, storage records are parsed here, and every view is checked against
its storage and the expected chunk before any tensor is built (`load_tensor_list`).
"""

from __future__ import annotations

import bisect
import collections
import ctypes
import io
import pickle
import warnings
import zipfile
from typing import Any

import torch

from lmcache_loadback.connectors.errors import ProtocolError

_STORAGE_DTYPES = {
    "HalfStorage": torch.float16, "BFloat16Storage": torch.bfloat16,
    "FloatStorage": torch.float32, "DoubleStorage": torch.float64,
    "ByteStorage": torch.uint8, "CharStorage": torch.int8, "ShortStorage": torch.int16,
    "IntStorage": torch.int32, "LongStorage": torch.int64, "BoolStorage": torch.bool,
}
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C  # torch.serialization.MAGIC_NUMBER
_LEGACY_PROTOCOL = 1001
_ALIGN = 16  # kv_layout reinterprets rows as complex128: zero-copy only when 16-aligned

# frombuffer on bytes warns once per process (any caller): ours are private, so use it up.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torch.frombuffer(b"\0", dtype=torch.uint8)


class _StorageType:
    """Stands in for torch.<Dtype>Storage in a record; not callable, so REDUCE on it fails."""

    __slots__ = ("dtype",)

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype


class _StorageRef:
    """A storage named by a record's persistent id, before its bytes are attached."""

    __slots__ = ("dtype", "key", "numel")

    def __init__(self, dtype: torch.dtype, key: str, numel: int) -> None:
        self.dtype, self.key, self.numel = dtype, key, numel


class _Storage:
    """What our _load_from_bytes returns: untyped bytes plus the dtype to read them as."""

    __slots__ = ("untyped", "dtype")

    def __init__(self, untyped: torch.UntypedStorage, dtype: torch.dtype) -> None:
        self.untyped, self.dtype = untyped, dtype


class _NoGlobals(pickle.Unpickler):
    """For a record's header pickles (magic, version, sys info, key list): data only."""

    def find_class(self, module: str, name: str) -> Any:
        raise ProtocolError(f"refused global {module}.{name} in a storage record header")

    def persistent_load(self, pid: Any) -> Any:
        raise ProtocolError("unexpected persistent id in a storage record header")


class _RecordUnpickler(_NoGlobals):
    """For a record's data pickle: admits torch.<Dtype>Storage names and storage ids only."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file)
        self.refs: list[_StorageRef] = []

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(_STORAGE_DTYPES[name])
        raise ProtocolError(f"refused global {module}.{name} in a storage record")

    def persistent_load(self, pid: Any) -> Any:
        # legacy: ('storage', type, key, location, numel, view_metadata); zip: no view_metadata
        ok = isinstance(pid, tuple) and len(pid) in (5, 6) and pid[0] == "storage"
        if ok:
            _, stype, key, location, numel = pid[:5]
            ok = (isinstance(stype, _StorageType) and isinstance(key, str) and location == "cpu"
                  and type(numel) is int and numel >= 0 and (len(pid) == 5 or pid[5] is None))
        if not ok or self.refs:  # type name only: the repr of a hostile id can recurse
            raise ProtocolError(f"unexpected persistent id ({type(pid).__name__}) in a "
                                "storage record")
        self.refs.append(_StorageRef(stype.dtype, key, numel))
        return self.refs[-1]


def _attach(b: bytes, off: int, ref: _StorageRef) -> _Storage:
    """Storage over b[off:off+nbytes]: shared with b when aligned, else one aligned copy.

    Both are fixed-size (frombuffer storages cannot be resized), so no later call can grow
    a storage over memory the payload never supplied.
    """
    nbytes = ref.numel * ref.dtype.itemsize
    if off < 0 or off + nbytes > len(b):
        raise ProtocolError(f"storage record claims {nbytes} bytes at {off}, has {len(b)}")
    if nbytes == 0:
        raise ProtocolError("storage record holds no elements; a chunk needs at least one")
    raw = torch.frombuffer(b, dtype=torch.uint8, count=nbytes, offset=off)
    if raw.data_ptr() % _ALIGN:
        # a bytes slice is one plain memcpy (faster than torch's threaded copy_ on busy
        # cores) and CPython puts its data 16-aligned on 64-bit builds
        raw = torch.frombuffer(b[off:off + nbytes], dtype=torch.uint8)
        if raw.data_ptr() % _ALIGN:  # another allocator: pad a zeroed buffer instead
            buf = bytearray(nbytes + _ALIGN)
            pad = -torch.frombuffer(buf, dtype=torch.uint8, count=1).data_ptr() % _ALIGN
            dst = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=pad)
            ctypes.memmove(dst.data_ptr(), raw.data_ptr(), nbytes)
            raw = dst
    return _Storage(raw.untyped_storage(), ref.dtype)


def _legacy_record(b: bytes) -> _Storage:
    """torch.save(storage, _use_new_zipfile_serialization=False): what torch 2.x pickles."""
    f = io.BytesIO(b)
    if _NoGlobals(f).load() != _LEGACY_MAGIC or _NoGlobals(f).load() != _LEGACY_PROTOCOL:
        raise ProtocolError("storage record has a wrong magic number or protocol version")
    info = _NoGlobals(f).load()
    if not isinstance(info, dict) or info.get("little_endian") is not True:
        raise ProtocolError("storage record is not little-endian")
    up = _RecordUnpickler(f)
    ref = up.load()
    keys = _NoGlobals(f).load()
    if not isinstance(ref, _StorageRef) or keys != [ref.key]:
        raise ProtocolError("storage record does not hold exactly one storage")
    pos = f.tell()
    if int.from_bytes(b[pos:pos + 8], "little", signed=True) != ref.numel:
        raise ProtocolError("storage record's element count does not match its header")
    storage = _attach(b, pos + 8, ref)
    if pos + 8 + storage.untyped.nbytes() != len(b):
        raise ProtocolError("storage record has trailing bytes")
    return storage


def _zip_record(b: bytes) -> _Storage:
    """torch.save(storage) zip format: entries <name>/data.pkl and <name>/data/<key>, stored."""
    zf = zipfile.ZipFile(io.BytesIO(b))
    pkls = [i for i in zf.infolist() if i.filename.endswith("data.pkl")]
    if len(pkls) != 1 or any(i.compress_type != zipfile.ZIP_STORED for i in zf.infolist()):
        raise ProtocolError("storage zip record must hold one data.pkl and no compressed entry")
    prefix = pkls[0].filename[: -len("data.pkl")]
    if prefix + "byteorder" in zf.namelist() and zf.read(prefix + "byteorder") != b"little":
        raise ProtocolError("storage zip record is not little-endian")
    up = _RecordUnpickler(io.BytesIO(zf.read(pkls[0])))
    ref = up.load()
    if not isinstance(ref, _StorageRef):
        raise ProtocolError("storage zip record does not hold a storage")
    info = zf.getinfo(f"{prefix}data/{ref.key}")
    head = b[info.header_offset:info.header_offset + 30]
    if len(head) != 30 or head[:4] != b"PK\x03\x04":
        raise ProtocolError("storage zip record has a broken local header")
    off = (info.header_offset + 30 + int.from_bytes(head[26:28], "little")
           + int.from_bytes(head[28:30], "little"))
    storage = _attach(b, off, ref)
    if info.file_size != storage.untyped.nbytes():
        raise ProtocolError("storage zip entry size does not match its element count")
    return storage


def _load_storage(b: Any) -> _Storage:
    """Replaces torch.storage._load_from_bytes, which would run an unrestricted load on b."""
    if not isinstance(b, bytes):
        raise ProtocolError(f"storage record must be bytes, got {type(b).__name__}")
    return _zip_record(b) if b[:4] == b"PK\x03\x04" else _legacy_record(b)


class _TensorListUnpickler(pickle.Unpickler):
    """Outer pickle: the three globals a pickled tensor list names, two of them replaced."""

    def __init__(self, file: io.BytesIO, max_items: int, shape: tuple[int, ...],
                 dtype: torch.dtype) -> None:
        super().__init__(file)
        self.budget = max_items
        self.shape, self.dtype = shape, dtype
        self.rebuilt = 0
        self.spans: list[tuple[int, int]] = []  # sorted [start, end) addresses of views so far

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return self._rebuild
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return _load_storage
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        raise ProtocolError(f"refused global {module}.{name} in a tensor-list payload")

    def persistent_load(self, pid: Any) -> Any:
        raise ProtocolError("unexpected persistent id in a tensor-list payload")

    def _rebuild(self, storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any,
                 hooks: Any, metadata: Any = None) -> torch.Tensor:
        """Only a plain tensor over a storage we built; stops early past max_items tensors."""
        self.budget -= 1
        if self.budget < 0:
            raise ProtocolError("payload holds more tensors than allowed")
        dims = (size, stride) if isinstance(size, tuple) and isinstance(stride, tuple) else ()
        if (not isinstance(storage, _Storage) or type(offset) is not int or offset < 0
                or len(dims) != 2 or len(size) != len(stride) or requires_grad is not False
                or not isinstance(hooks, collections.OrderedDict) or hooks or metadata is not None
                or not all(type(x) is int and x >= 0 for x in size + stride)):
            raise ProtocolError("tensor rebuild with unexpected arguments")
        item, self.rebuilt = self.rebuilt, self.rebuilt + 1
        if size != self.shape or storage.dtype != self.dtype:
            raise ProtocolError(f"item {item}: expected {self.shape} {self.dtype}, "
                                f"got {size} {storage.dtype}")
        self._claim(item, storage, offset, size, stride)
        t = torch.empty((0,), dtype=storage.dtype)
        return t.set_(storage.untyped, offset, size, stride)  # in bounds: checked by _claim

    def _claim(self, item: int, storage: _Storage, offset: int, size: tuple[int, ...],
               stride: tuple[int, ...]) -> None:
        """Refuse a view that reaches past its storage, aliases itself or an earlier view."""
        itemsize = storage.dtype.itemsize
        have = storage.untyped.nbytes() // itemsize
        if 0 in size:
            if offset > have:
                raise ProtocolError(f"item {item}: offset {offset} is past its storage of "
                                    f"{have} elements")
            return
        reach = 0  # exact integers: a hostile stride cannot overflow this arithmetic
        for st, n in sorted((st, n) for n, st in zip(size, stride) if n > 1):
            if st <= reach:
                raise ProtocolError(f"item {item}: strides {stride} make elements of shape "
                                    f"{size} overlap")
            reach += (n - 1) * st
        if offset + reach + 1 > have:
            raise ProtocolError(f"item {item}: view of {offset + reach + 1} elements (offset "
                                f"{offset}, strides {stride}) exceeds its storage of {have}")
        start = storage.untyped.data_ptr() + offset * itemsize
        span = (start, start + (reach + 1) * itemsize)
        at = bisect.bisect(self.spans, span)
        if ((at and self.spans[at - 1][1] > span[0])
                or (at < len(self.spans) and self.spans[at][0] < span[1])):
            raise ProtocolError(f"item {item}: view overlaps the bytes of an earlier tensor")
        self.spans.insert(at, span)


def load_tensor_list(data: bytes | memoryview, *, expected_shape: tuple[int, ...],
                     expected_dtype: torch.dtype, max_items: int) -> list[torch.Tensor]:
    """Decode a prepare_retrieve payload; called by the connector for every retrieve reply.

    Returns at most ``max_items`` CPU tensors, each exactly ``expected_shape`` and
    ``expected_dtype``. Raises ProtocolError, and only ProtocolError, for anything else:
    garbage, truncation, refused globals, nested code, wrong types. Never runs code named by
    the payload and never calls an unrestricted loader.

    In engine-driven pickle mode the payload is ``pickle.dumps(list[torch.Tensor])``. The
    unpickler admits exactly the three globals such a pickle names
    (``torch._utils._rebuild_tensor_v2``, ``torch.storage._load_from_bytes``,
    ``collections.OrderedDict``) and replaces the first two: ``_load_from_bytes`` would run an
    unrestricted load on the storage record it carries. That record is parsed here: torch 2.x
    pickles storages in torch.save's legacy format (five pickles, then the raw bytes), the zip
    format is accepted too. Its small pickles go through a second restricted unpickler that
    admits only ``torch.<Dtype>Storage`` names; the raw data is used in place when 16-byte
    aligned (zip entries are), else copied once with memcpy (legacy data sits at an odd
    offset) into a fixed-size buffer. Every storage is non-resizable, and every view's extent,
    strides, shape and dtype are checked against its storage and the expected chunk before any
    tensor is built; views may neither overlap each other nor themselves. Nothing else is ever
    copied and nothing named by the payload ever runs.
    """
    try:
        obj = _TensorListUnpickler(io.BytesIO(data), max_items, tuple(expected_shape),
                                   expected_dtype).load()
    except ProtocolError:
        raise
    except Exception as e:  # garbage or truncation: pickle/zipfile/torch raise many types
        raise ProtocolError(f"undecodable tensor-list payload: {type(e).__name__}: "
                            f"{str(e)[:200]}") from e
    if type(obj) is not list:
        raise ProtocolError(f"expected a list of tensors, got {type(obj).__name__}")
    if len(obj) > max_items:  # the rebuild budget misses one tensor referenced many times
        raise ProtocolError(f"payload holds {len(obj)} items, at most {max_items} allowed")
    want = f"{tuple(expected_shape)} {expected_dtype}"
    out: list[torch.Tensor] = []
    seen: dict[int, int] = {}
    for i, t in enumerate(obj):
        if type(t) is not torch.Tensor:
            raise ProtocolError(f"item {i}: expected a tensor {want}, got {type(t).__name__}")
        if seen.setdefault(id(t), i) != i:  # a memoized tensor listed twice: aliased chunks
            raise ProtocolError(f"item {i}: the same tensor as item {seen[id(t)]}")
        if t.dtype != expected_dtype or tuple(t.shape) != tuple(expected_shape):
            raise ProtocolError(f"item {i}: expected {want}, got {tuple(t.shape)} {t.dtype}")
        out.append(t.detach())  # drops anything a BUILD opcode may have attached
    return out


def dump_tensor_list(tensors: list[torch.Tensor]) -> bytes:
    """Encode chunk tensors for commit_store; called by the connector before each store.

    Plain pickle of CPU tensors that each own exactly their bytes: a view would pickle its
    whole base storage (once per view). Never mutates the inputs.
    """
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"expected a list of tensors, got {type(tensors).__name__}")
    out = []
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"item {i} is a {type(t).__name__}, expected a tensor")
        t = t.detach().cpu()
        if (not t.is_contiguous() or t.storage_offset()
                or t.untyped_storage().nbytes() != t.numel() * t.element_size()):
            t = t.clone(memory_format=torch.contiguous_format)
        out.append(t)
    return pickle.dumps(out)
