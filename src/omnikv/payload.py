"""KV payloads and their wire format.

Packed layout (byte-compatible with the reference packed format):

1. 4 bytes: header length ``N``, unsigned 32-bit big-endian;
2. ``N`` bytes: a UTF-8 JSON object ``{"rid", "bids", "meta", "td", "nl", ...}``;
3. the data section: raw tensor bytes, native (little-endian) element order, at the offsets the
   ``td`` descriptors give (relative to the start of the data section).

``td`` lists all ``key_cache`` layers 0..L-1, then all ``value_cache`` layers; an absent layer is
``{"n": "key_cache_3", "x": true}``, a present one ``{"n", "i", "d", "s", "o", "b"}`` (name, layer,
dtype name, shape, offset, byte length).

omnikv's extensions are extra header keys an old reader ignores: ``v`` (format version), ``al``
(the alignment the writer used), ``bo`` (byte order), ``dl`` (data section length) and, when asked
for, ``ck`` (``"crc32:%08x"`` of the data section). The JSON is padded with trailing spaces so the
data section starts on a 64-byte boundary (4096 when a tensor is large), and every tensor starts on
a 64-byte boundary (4096 for tensors of 256 KiB and more); the gaps are zero.

Encoding has two speeds: :meth:`KVCacheTransferData.pack_into` writes into a caller's buffer
(``packed_size()`` bytes; exactly one copy of each tensor), :meth:`KVCacheTransferData.to_bytes`
returns ``bytes``. Decoding returns zero-copy views: the tensors alias the input buffer and are
valid only as long as it is (for a connector buffer: until it is released).

Every malformed input raises :class:`~omnikv.errors.DecodeError` (a ``ValueError``) that says what
was expected, what was found and where. The integrity check costs one extra pass over the data
(crc32 runs at about a third of memcpy speed here), so it is off by default and enabled per payload
(``checksum=True``) or per manager (connector config ``payload_checksum: true``); a payload that
carries ``ck`` is verified on decode.
"""

from __future__ import annotations

import ctypes
import json
import logging
import math
import struct
import sys
import warnings
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeGuard, runtime_checkable

import numpy as np
import torch

from omnikv.errors import DecodeError, EncodeError

__all__ = [
    "DTYPE_ALLOWLIST",
    "FORMAT_VERSION",
    "KVCacheTransferData",
    "PackedPayload",
    "TensorWriter",
    "decode",
    "decode_device",
    "encode",
]

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
ALIGN = 64
PAGE = 4096
LARGE_TENSOR_BYTES = 256 * 1024
MAX_HEADER_BYTES = 16 * 1024 * 1024
MAX_LAYERS = 4096
MAX_DIMS = 8
_LEN = struct.Struct(">I")
_CK_PREFIX = "crc32:"
_CK_PLACEHOLDER = _CK_PREFIX + "00000000"

_DTYPE_NAMES = (
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "float16",
    "float32",
    "float64",
    "bfloat16",
    "complex64",
    "complex128",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
)
#: dtype name (as written in ``td[].d``) -> torch dtype, for the names this torch has.
DTYPE_ALLOWLIST: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in _DTYPE_NAMES
    if isinstance(getattr(torch, name, None), torch.dtype)
}
_DTYPE_TO_NAME: dict[torch.dtype, str] = {v: k for k, v in DTYPE_ALLOWLIST.items()}
_ITEMSIZE: dict[str, int] = {
    name: torch.empty((), dtype=dt).element_size() for name, dt in DTYPE_ALLOWLIST.items()
}
_CACHES = ("key_cache", "value_cache")


# --------------------------------------------------------------------------------------------
# Sources of tensor data
# --------------------------------------------------------------------------------------------
@runtime_checkable
class TensorWriter(Protocol):
    """A tensor that is not materialised yet: it knows its dtype and shape and writes itself.

    ``write_into(dst)`` is called once with a contiguous tensor of exactly ``dtype`` and
    ``shape`` (a view of the send buffer); :mod:`omnikv.layouts` uses this to gather paged
    blocks straight into the buffer that travels.
    """

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def shape(self) -> tuple[int, ...]: ...

    def write_into(self, dst: torch.Tensor) -> None: ...


TensorLike = torch.Tensor | TensorWriter


def _round_up(value: int, align: int) -> int:
    return (value + align - 1) // align * align


def _json_default(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        if obj.numel() > 4096:
            raise TypeError("tensors of more than 4096 elements do not belong in metadata")
        return obj.detach().cpu().tolist()
    if isinstance(obj, np.ndarray | np.generic):
        return obj.tolist()
    if isinstance(obj, set | frozenset):
        return sorted(obj)
    raise TypeError(f"object of type {type(obj).__name__} is not JSON serializable")


@dataclass(frozen=True)
class _Slot:
    name: str
    layer: int
    source: TensorLike | None
    dtype_name: str = ""
    shape: tuple[int, ...] = ()
    offset: int = 0
    nbytes: int = 0


class PackedPayload:
    """An encoding plan: header computed, data offsets fixed, tensors not yet copied.

    Built by :class:`KVCacheTransferData` and by the sender's extraction (with
    :class:`TensorWriter` sources). ``nbytes`` is the exact packed size; :meth:`pack_into` writes
    the payload into a caller's buffer with one copy per tensor. Not thread-safe; cheap to build.
    """

    def __init__(
        self,
        request_id: str,
        key_cache: Sequence[TensorLike | None],
        value_cache: Sequence[TensorLike | None],
        block_ids: Sequence[int] = (),
        metadata: Mapping[str, Any] | None = None,
        *,
        checksum: bool = False,
    ) -> None:
        num_layers = len(key_cache)
        self._checksum = checksum
        slots: list[_Slot] = []
        td: list[dict[str, Any]] = []
        cursor = 0
        any_large = False
        for cache, layers in zip(_CACHES, (key_cache, value_cache), strict=True):
            for idx, src in enumerate(layers):
                name = f"{cache}_{idx}"
                if src is None:
                    slots.append(_Slot(name, idx, None))
                    td.append({"n": name, "x": True})
                    continue
                dtype = src.dtype
                dname = _DTYPE_TO_NAME.get(dtype)
                if dname is None:
                    raise EncodeError(f"unsupported dtype {dtype} in {name}")
                shape = tuple(int(d) for d in src.shape)
                nbytes = math.prod(shape) * _ITEMSIZE[dname]
                align = PAGE if nbytes >= LARGE_TENSOR_BYTES else ALIGN
                any_large = any_large or align == PAGE
                cursor = _round_up(cursor, align)
                slots.append(_Slot(name, idx, src, dname, shape, cursor, nbytes))
                td.append(
                    {"n": name, "i": idx, "d": dname, "s": list(shape), "o": cursor, "b": nbytes}
                )
                cursor += nbytes
        self.data_nbytes = cursor
        self._slots = slots
        header: dict[str, Any] = {
            "rid": str(request_id),
            "bids": [int(b) for b in block_ids],
            "meta": dict(metadata or {}),
            "td": td,
            "nl": num_layers,
            "v": FORMAT_VERSION,
            "al": ALIGN,
            "bo": sys.byteorder,
            "dl": cursor,
        }
        if checksum:
            header["ck"] = _CK_PLACEHOLDER
        try:
            raw = json.dumps(
                header, separators=(",", ":"), ensure_ascii=False, default=_json_default
            ).encode("utf-8")
        except (TypeError, ValueError) as exc:
            raise EncodeError(f"KV payload metadata is not JSON-serialisable: {exc}") from exc
        if len(raw) > MAX_HEADER_BYTES:
            raise EncodeError(f"header of {len(raw)} bytes exceeds {MAX_HEADER_BYTES}")
        data_align = PAGE if any_large else ALIGN
        self.data_start = _round_up(4 + len(raw), data_align)
        self._header = raw + b" " * (self.data_start - 4 - len(raw))
        self.nbytes = self.data_start + cursor

    @property
    def header_bytes(self) -> bytes:
        """The 4-byte length plus the padded JSON header (without checksum filled in)."""
        return _LEN.pack(len(self._header)) + self._header

    def pack_into(self, buf: Any, offset: int = 0) -> int:
        """Write the payload into ``buf`` at ``offset``; return the bytes written (``nbytes``).

        ``buf`` is a 1-D ``uint8`` tensor (host or device) or any writable buffer. Each tensor is
        copied once, straight into its slot; padding gaps are zeroed so checksums are stable.
        Raises ``ValueError`` if ``buf`` is too small.
        """
        out = _as_byte_tensor(buf, writable=True)
        if offset < 0 or offset + self.nbytes > out.numel():
            raise ValueError(
                f"buffer of {out.numel()} bytes cannot hold {self.nbytes} bytes at offset {offset}"
            )
        region = out[offset : offset + self.nbytes]
        data = region[self.data_start :]
        prev_end = 0
        for slot in self._slots:
            if slot.source is None:
                continue
            if slot.offset > prev_end:
                data[prev_end : slot.offset].zero_()
            if slot.nbytes:
                _write_tensor(slot, data[slot.offset : slot.offset + slot.nbytes])
            prev_end = slot.offset + slot.nbytes
        header = self.header_bytes
        if self._checksum:
            crc = _crc32(data)
            header = header.replace(
                _CK_PLACEHOLDER.encode("ascii"), f"{_CK_PREFIX}{crc:08x}".encode("ascii"), 1
            )
        _copy_bytes_in(region, header)
        return self.nbytes

    def to_bytes(self) -> bytes:
        """The packed payload as ``bytes`` (one copy of each tensor where CPython allows)."""
        fresh = _new_bytes(self.nbytes)
        if fresh is None:
            scratch = bytearray(self.nbytes)
            self.pack_into(scratch)
            return bytes(scratch)
        result, view = fresh
        self.pack_into(view)
        return result


def _write_tensor(slot: _Slot, dst_bytes: torch.Tensor) -> None:
    dtype = DTYPE_ALLOWLIST[slot.dtype_name]
    src = slot.source
    itemsize = _ITEMSIZE[slot.dtype_name]
    if dst_bytes.data_ptr() % itemsize == 0:
        dst = dst_bytes.view(dtype).view(slot.shape)
        if isinstance(src, torch.Tensor):
            if tuple(src.shape) != slot.shape:
                raise EncodeError(f"{slot.name} changed shape while encoding")
            dst.copy_(src.detach())
        else:
            assert src is not None
            src.write_into(dst)
        return
    # Unaligned destination (caller passed an odd offset): go through a temporary.
    if isinstance(src, torch.Tensor):
        tmp = src.detach().contiguous()
    else:
        assert src is not None
        tmp = torch.empty(slot.shape, dtype=dtype, device=dst_bytes.device)
        src.write_into(tmp)
    dst_bytes.copy_(tmp.reshape(-1).view(torch.uint8))


def _crc32(data: torch.Tensor) -> int:
    if data.numel() == 0:
        return 0
    host = data if data.device.type == "cpu" else data.cpu()
    return zlib.crc32(host.numpy().data) & 0xFFFFFFFF


def _copy_bytes_in(region: torch.Tensor, header: bytes) -> None:
    src = torch.frombuffer(bytearray(header), dtype=torch.uint8)
    region[: len(header)].copy_(src)


# --------------------------------------------------------------------------------------------
# Buffers
# --------------------------------------------------------------------------------------------
_pybytes_new: Callable[[Any, int], bytes] | None = None
if sys.implementation.name == "cpython":  # pragma: no branch
    try:
        _fn = ctypes.pythonapi.PyBytes_FromStringAndSize
        _fn.restype = ctypes.py_object
        _fn.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t]
        _pybytes_new = _fn
        _BYTES_DATA_OFFSET = sys.getsizeof(b"") - 1
    except AttributeError:  # pragma: no cover
        _pybytes_new = None


def _new_bytes(n: int) -> tuple[bytes, torch.Tensor] | None:
    """A new, not yet shared ``bytes`` object of ``n`` bytes and a writable tensor over it.

    The object is created uninitialised (``PyBytes_FromStringAndSize(NULL, n)``) and filled
    before anyone else sees it, which the C API allows. ``None`` where that is not available.
    """
    if _pybytes_new is None or n <= 0:
        return None
    obj = _pybytes_new(None, n)
    carr = (ctypes.c_char * n).from_address(id(obj) + _BYTES_DATA_OFFSET)
    return obj, torch.frombuffer(carr, dtype=torch.uint8)


def _as_byte_tensor(buf: Any, *, writable: bool = False) -> torch.Tensor:
    """View ``buf`` (tensor, bytes, bytearray, memoryview, mmap, ndarray) as 1-D uint8."""
    if isinstance(buf, torch.Tensor):
        if buf.dtype != torch.uint8 or buf.dim() != 1:
            raise ValueError(f"expected a 1-D uint8 tensor, got dtype={buf.dtype} dim={buf.dim()}")
        if not buf.is_contiguous():
            raise ValueError("expected a contiguous uint8 tensor")
        return buf
    try:
        mv = memoryview(buf)
    except TypeError as exc:
        raise ValueError(f"expected a bytes-like buffer, got {type(buf).__name__}") from exc
    if writable and mv.readonly:
        raise ValueError("buffer is read-only")
    if mv.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    if not mv.c_contiguous:
        raise ValueError("expected a contiguous buffer")
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mv, dtype=torch.uint8)


# --------------------------------------------------------------------------------------------
# Decoding
# --------------------------------------------------------------------------------------------
def _fail(msg: str) -> DecodeError:
    return DecodeError(f"corrupt KV payload: {msg}")


def _parse_header(head4: bytes, total: int, read: Callable[[int, int], bytes]) -> dict[str, Any]:
    if total < 4 or len(head4) < 4:
        raise _fail(f"missing 4-byte header length (buffer has {total} bytes)")
    (hlen,) = _LEN.unpack(head4[:4])
    if hlen > total - 4:
        raise _fail(f"header_len={hlen} exceeds buffer size {total} - 4")
    if hlen > MAX_HEADER_BYTES:
        raise _fail(f"header_len={hlen} exceeds the limit of {MAX_HEADER_BYTES} bytes")
    raw = read(4, hlen)
    try:
        header = json.loads(raw)
    except RecursionError as exc:
        raise _fail("header JSON is nested too deeply") from exc
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise _fail(f"header is not valid UTF-8 JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise _fail(f"header must be a JSON object, got {type(header).__name__}")
    header["__hlen__"] = hlen
    return header


def _require(header: Mapping[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    if key not in header:
        raise _fail(f"header is missing key {key!r}")
    value = header[key]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise _fail(f"header key {key!r} has type {type(value).__name__}")
    return value


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class _Desc:
    cache: int
    layer: int
    dtype: torch.dtype
    dtype_name: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def _layer_from_name(name: str) -> tuple[int, int | None]:
    for ci, cache in enumerate(_CACHES):
        prefix = cache + "_"
        if name.startswith(prefix):
            suffix = name[len(prefix) :]
            if not suffix.isdigit() or len(suffix) > 9:
                return ci, None
            return ci, int(suffix)
    return -1, None


def _descriptors(header: Mapping[str, Any], data_len: int) -> tuple[int, list[_Desc | None]]:
    nl = _require(header, "nl", int)
    if nl < 0 or nl > MAX_LAYERS:
        raise _fail(f"nl={nl} outside [0, {MAX_LAYERS}]")
    td = _require(header, "td", list)
    if len(td) > 2 * MAX_LAYERS:
        raise _fail(f"td has {len(td)} entries, more than {2 * MAX_LAYERS}")
    version = header.get("v", FORMAT_VERSION)
    if not _is_int(version) or version < 0 or version > FORMAT_VERSION:
        raise _fail(
            f"unsupported format version {version!r} (this reader knows <= {FORMAT_VERSION})"
        )
    order = header.get("bo", "little")
    if order not in ("little", "big"):
        raise _fail(f"unknown byte order {order!r}")
    if order != sys.byteorder:
        raise _fail(f"payload byte order {order} differs from this machine's {sys.byteorder}")
    out: list[_Desc | None] = []
    for pos, entry in enumerate(td):
        where = f"td[{pos}]"
        if not isinstance(entry, dict):
            raise _fail(f"{where} must be an object, got {type(entry).__name__}")
        name = entry.get("n")
        if not isinstance(name, str):
            raise _fail(f"{where}.n must be a string, got {type(name).__name__}")
        if entry.get("x"):
            cache, idx = _layer_from_name(name)
            if cache >= 0 and idx is not None and 0 <= idx < nl:
                out.append(None)
                continue
            if cache < 0:
                out.append(None)
                continue
            raise _fail(f"Invalid layer index in {where} ({name!r}, nl={nl})")
        dname = entry.get("d")
        if not isinstance(dname, str) or dname not in DTYPE_ALLOWLIST:
            raise _fail(
                f"Unsupported dtype in KV payload: got {dname!r} at {where}, "
                f"expected one of {sorted(DTYPE_ALLOWLIST)}"
            )
        o, b = entry.get("o"), entry.get("b")
        if not (_is_int(o) and _is_int(b)):
            raise _fail(f"tensor span of {where} needs integer o and b, got o={o!r} b={b!r}")
        if o < 0 or b < 0 or o + b > data_len:
            raise _fail(
                f"tensor span [{o}, {o}+{b}) of {where} outside data section of {data_len} bytes"
            )
        shape = entry.get("s")
        if not isinstance(shape, list) or len(shape) > MAX_DIMS:
            raise _fail(f"{where}.s must be a list of at most {MAX_DIMS} dims, got {shape!r:.80}")
        if not all(_is_int(d) and d >= 0 for d in shape):
            raise _fail(f"{where}.s must hold non-negative integers, got {shape!r:.80}")
        expected = math.prod(shape) * _ITEMSIZE[dname]
        if expected != b:
            raise _fail(f"shape {shape} of dtype {dname} needs {expected} bytes, {where}.b={b}")
        cache, idx = _layer_from_name(name)
        if "i" in entry:
            idx = entry["i"]
            if not _is_int(idx):
                raise _fail(f"Invalid layer index {idx!r} in {where}")
        if cache < 0:
            # Not a KV tensor: the reference ignores such names; so do we.
            out.append(None)
            continue
        if idx is None:
            raise _fail(f"Invalid KV tensor name {name!r} at {where}")
        if not 0 <= idx < nl:
            raise _fail(f"Invalid layer index {idx} at {where} (nl={nl})")
        out.append(_Desc(cache, idx, DTYPE_ALLOWLIST[dname], dname, tuple(shape), o, b))
    return nl, out


def _verify_checksum(header: Mapping[str, Any], data: torch.Tensor) -> None:
    ck = header.get("ck")
    if ck is None:
        return
    if not isinstance(ck, str) or not ck.startswith(_CK_PREFIX) or len(ck) != len(_CK_PLACEHOLDER):
        raise _fail(f"malformed checksum field {ck!r:.40}")
    try:
        want = int(ck[len(_CK_PREFIX) :], 16)
    except ValueError as exc:
        raise _fail(f"malformed checksum field {ck!r:.40}") from exc
    dl = header.get("dl")
    span = data[:dl] if _is_int(dl) and 0 <= dl <= data.numel() else data
    got = _crc32(span)
    if got != want:
        raise _fail(f"data checksum mismatch: header says {want:08x}, data has {got:08x}")


def _build(
    header: Mapping[str, Any],
    nl: int,
    descs: list[_Desc | None],
    make: Callable[[_Desc], torch.Tensor],
) -> dict[str, Any]:
    rid = _require(header, "rid", str)
    bids = _require(header, "bids", list)
    meta = _require(header, "meta", dict)
    lists: tuple[list[torch.Tensor | None], list[torch.Tensor | None]] = (
        [None] * nl,
        [None] * nl,
    )
    seen: set[tuple[int, int]] = set()
    for desc in descs:
        if desc is None:
            continue
        key = (desc.cache, desc.layer)
        if key in seen:
            raise _fail(f"duplicate tensor for {_CACHES[desc.cache]}_{desc.layer}")
        seen.add(key)
        lists[desc.cache][desc.layer] = make(desc)
    return {
        "request_id": rid,
        "layer_blocks": {"key_cache": lists[0], "value_cache": lists[1]},
        "block_ids": bids,
        "metadata": meta,
    }


def _view(data: torch.Tensor, desc: _Desc, *, copy: bool) -> torch.Tensor:
    if desc.nbytes == 0:
        return torch.empty(desc.shape, dtype=desc.dtype, device=data.device)
    chunk = data[desc.offset : desc.offset + desc.nbytes]
    itemsize = _ITEMSIZE[desc.dtype_name]
    if chunk.data_ptr() % itemsize:
        # A foreign writer left this tensor unaligned: copy it to aligned memory.
        aligned = torch.empty(desc.nbytes, dtype=torch.uint8, device=data.device)
        aligned.copy_(chunk)
        chunk = aligned
    elif copy:
        chunk = chunk.clone()
    return chunk.view(desc.dtype).view(desc.shape)


def decode(buf: Any, *, verify: bool = True) -> dict[str, Any]:
    """Decode a packed payload from host memory into zero-copy tensor views.

    ``buf``: bytes, bytearray, memoryview, mmap, ndarray or a 1-D ``uint8`` host tensor. The
    returned tensors alias ``buf`` (except tensors a foreign writer left unaligned, which are
    copied). ``verify`` checks the data checksum when the payload carries one.
    Raises :class:`DecodeError` for every malformed input.
    """
    try:
        t = _as_byte_tensor(buf)
    except ValueError as exc:
        raise _fail(str(exc)) from exc
    if t.device.type != "cpu":
        return decode_device(t, copy=False, verify=verify)
    total = t.numel()
    mv = t.numpy().data if total else memoryview(b"")
    header = _parse_header(bytes(mv[:4]), total, lambda s, n: bytes(mv[s : s + n]))
    data = t[4 + header["__hlen__"] :]
    nl, descs = _descriptors(header, data.numel())
    if verify:
        _verify_checksum(header, data)
    return _build(header, nl, descs, lambda d: _view(data, d, copy=False))


def decode_device(t: torch.Tensor, *, copy: bool = True, verify: bool = True) -> dict[str, Any]:
    """Decode a packed payload held in a 1-D ``uint8`` tensor on any device.

    The header is read with two small device-to-host copies. ``copy=True`` (the reference's
    behaviour) gives every tensor its own memory; ``copy=False`` returns views into ``t``.
    """
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 1:
        raise _fail("device payload must be a 1-D uint8 tensor")
    total = t.numel()

    def read(start: int, n: int) -> bytes:
        return t[start : start + n].cpu().numpy().tobytes()

    header = _parse_header(read(0, 4), total, read)
    data = t[4 + header["__hlen__"] :]
    nl, descs = _descriptors(header, data.numel())
    if verify:
        _verify_checksum(header, data)
    return _build(header, nl, descs, lambda d: _view(data, d, copy=copy))


def encode(data: KVCacheTransferData, *, checksum: bool = False) -> bytes:
    """Convenience: ``data`` packed to ``bytes``."""
    return data.plan(checksum=checksum).to_bytes()


# --------------------------------------------------------------------------------------------
# The seed's dataclass
# --------------------------------------------------------------------------------------------
@dataclass
class KVCacheTransferData:
    """Container for KV cache transfer data.

    ``layer_blocks`` holds ``{"key_cache": [...], "value_cache": [...]}``, one tensor (or None)
    per layer, each ``[seq_len, heads, head_dim]``; ``metadata`` must be JSON-serialisable for the
    packed format (tuples become lists; small tensors and numpy values become lists).
    """

    request_id: str
    layer_blocks: dict[str, Any]
    block_ids: list[int] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """A plain dict with the same tensors (no deep copy of tensor data)."""
        return {
            "request_id": self.request_id,
            "layer_blocks": {k: list(v) for k, v in self.layer_blocks.items()},
            "block_ids": list(self.block_ids),
            "metadata": dict(self.metadata),
        }

    def _caches(self) -> tuple[list[Any], list[Any]]:
        keys = list(self.layer_blocks.get("key_cache") or [])
        values = list(self.layer_blocks.get("value_cache") or [])
        if len(values) < len(keys):
            values += [None] * (len(keys) - len(values))
        return keys, values[: max(len(keys), len(values))]

    def plan(self, *, checksum: bool = False) -> PackedPayload:
        """The encoding plan (header and offsets) for this payload."""
        keys, values = self._caches()
        return PackedPayload(
            self.request_id, keys, values, self.block_ids, self.metadata, checksum=checksum
        )

    def packed_size(self, *, checksum: bool = False) -> int:
        """Exact number of bytes :meth:`pack_into` writes."""
        return self.plan(checksum=checksum).nbytes

    def pack_into(self, buf: Any, offset: int = 0, *, checksum: bool = False) -> int:
        """Encode into ``buf`` (1-D uint8 tensor or writable buffer) at ``offset``; one copy."""
        return self.plan(checksum=checksum).pack_into(buf, offset)

    def to_bytes(self, *, checksum: bool = False) -> bytes:
        """The packed format as ``bytes``."""
        return self.plan(checksum=checksum).to_bytes()

    def to_gpu_tensor(self) -> torch.Tensor:
        """The packed format as a 1-D uint8 tensor on the device of the first device tensor.

        Raises ``RuntimeError`` when no tensor lives on a device (use :meth:`to_bytes`).
        """
        device = None
        for t in _iter_tensors(self.layer_blocks):
            if t.device.type != "cpu":
                device = t.device
                break
        if device is None:
            raise RuntimeError("No device tensors found, use to_bytes() instead")
        plan = self.plan()
        out = torch.empty(plan.nbytes, dtype=torch.uint8, device=device)
        plan.pack_into(out)
        return out

    @staticmethod
    def from_bytes(raw: Any) -> dict[str, Any]:
        """Reconstruct KV cache data from the packed bytes format (zero-copy views)."""
        return decode(raw)

    @staticmethod
    def from_bytes_device(t: torch.Tensor) -> dict[str, Any]:
        """Reconstruct KV cache data from a packed device tensor (tensors are fresh copies)."""
        return decode_device(t, copy=True)

    @staticmethod
    def from_bytes_gpu(t: torch.Tensor) -> dict[str, Any]:
        """Compatibility alias for callers using the old GPU-specific name."""
        return decode_device(t, copy=True)


def _iter_tensors(layer_blocks: Mapping[str, Any]) -> Iterator[torch.Tensor]:
    for cache in _CACHES:
        for t in layer_blocks.get(cache) or []:
            if isinstance(t, torch.Tensor):
                yield t
