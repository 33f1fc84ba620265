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
returns ``bytes``.

Decoding (:func:`decode_kv`) returns a typed :class:`DecodedKV` of zero-copy views: the tensors
alias the input buffer and are valid only as long as it is (for a connector buffer: until it is
released); ``copy=True`` copies each into fresh memory of its own (no more than the data section
in all). The seed's dict is :meth:`DecodedKV.to_seed_dict` (``decode``/``decode_device`` return it).

The decoder treats its input as hostile. Before anything proportional to a claimed size is
allocated it checks: the header length (``max_header_bytes``, 1 MiB by default), the header's
types (a typed msgspec decoder), ``nl`` <= :data:`MAX_LAYERS`, at most two descriptors per layer,
allowlisted dtypes, shapes of at most :data:`MAX_DIMS` non-negative dims and
:data:`MAX_ELEMENTS` elements (zero dims do not hide huge others), spans inside the data section
(``dl`` when given) whose length matches the shape, no two spans sharing a byte (K and V at the
same bytes included), no duplicate layers. Every failure is a
:class:`~omnikv.errors.DecodeError` (a ``ValueError``) that says what was expected, what was
found and where.

Alignment: a payload carrying ``al`` (omnikv's writers) must place every tensor on a multiple of
its element size, or it is refused. A payload without ``al`` (the reference writes no padding) is
accepted, and a tensor whose bytes are not aligned for its dtype is copied to aligned memory
(spans do not overlap, so these copies never exceed the data section).

The integrity check costs one extra pass over the data (crc32 runs at about a third of memcpy
speed here), so it is off by default and enabled per payload (``checksum=True``) or per manager
(connector config ``payload_checksum: true``); a payload that carries ``ck`` is verified on
decode. It detects corruption, not tampering.
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
from typing import Any, NamedTuple, Protocol, runtime_checkable

import msgspec
import numpy as np
import torch

from omnikv.errors import DecodeError, EncodeError

__all__ = [
    "DEFAULT_MAX_HEADER_BYTES",
    "DTYPE_ALLOWLIST",
    "FORMAT_VERSION",
    "HOST_ARRAY_WRITER",
    "DecodedKV",
    "KVCacheTransferData",
    "PackedPayload",
    "TensorWriter",
    "decode",
    "decode_device",
    "decode_kv",
    "writes_host_arrays",
]

logger = logging.getLogger(__name__)

#: Attribute of a writer (a connector's ``put_packed`` ``write``) that also takes its slot as a
#: writable 1-D ``uint8`` numpy array when the slot is host memory, so the connector need not
#: make a torch view of it (a torch operator call, which on a process that has just been idle
#: costs tens of microseconds). :meth:`PackedPayload.pack_into` carries it.
HOST_ARRAY_WRITER = "omnikv_host_array"


FORMAT_VERSION = 1
ALIGN = 64
PAGE = 4096
LARGE_TENSOR_BYTES = 256 * 1024
#: Largest JSON header a decoder accepts unless told otherwise (and the most an encoder writes).
DEFAULT_MAX_HEADER_BYTES = 1 << 20
#: Most layers a payload may claim (the largest open models have fewer than 200).
MAX_LAYERS = 1024
MAX_DIMS = 8
#: Most elements one tensor may claim, counting zero dims as 1 (torch sizes are int64).
MAX_ELEMENTS = 1 << 48
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
#: numpy's type of each allowed dtype that numpy has (bf16 and fp8 have none: viewed as bits).
_NUMPY_OF: dict[str, type[np.generic]] = {
    name: getattr(np, "bool_" if name == "bool" else name)
    for name in DTYPE_ALLOWLIST
    if name in ("bool", "uint8", "int8", "int16", "int32", "int64")
    or name in ("float16", "float32", "float64", "complex64", "complex128")
}


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

#: Same-size integer types: a host tensor of any allowed dtype is copied as these bits.
_BITS_NP: dict[int, type[np.generic]] = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}
_BITS_TORCH: dict[int, torch.dtype] = {
    1: torch.uint8,
    2: torch.int16,
    4: torch.int32,
    8: torch.int64,
}


def host_bits(t: torch.Tensor) -> np.ndarray | None:
    """A numpy view of a host tensor's elements as same-size integers, or ``None``.

    Copies through numpy cost a fraction of torch's per-call overhead, which is what a small
    payload's send time is made of; copying bits is exact for every dtype (bf16 and fp8 too).
    ``None`` for device tensors and anything numpy cannot view (conjugate/negative bits).
    Called by :meth:`PackedPayload.pack_into` and :meth:`omnikv.layouts.BlockGather.write_bits`.
    """
    if not t.is_cpu:
        return None
    size = t.element_size()
    bits = _BITS_TORCH.get(size)
    if bits is None:
        return None
    try:
        return (t if t.dtype == bits else t.view(bits)).numpy()
    except (RuntimeError, TypeError):
        return None


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


_HEADER_ENCODER = msgspec.json.Encoder(enc_hook=_json_default)


def _encode_header(header: dict[str, Any] | list[Any]) -> bytes:
    """Compact UTF-8 JSON of a payload header. msgspec first (several times faster); what it
    cannot encode (non-string keys of odd types) goes through ``json`` as before."""
    try:
        return _HEADER_ENCODER.encode(header)
    except (TypeError, ValueError, msgspec.EncodeError):
        pass
    try:
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False, default=_json_default)
    except (TypeError, ValueError) as exc:
        raise EncodeError(f"KV payload metadata is not JSON-serialisable: {exc}") from exc
    return text.encode("utf-8")


class _Slot(NamedTuple):
    """Where one tensor of a payload goes (``dtype_name`` empty: a ``None`` layer)."""

    name: str
    layer: int
    dtype_name: str = ""
    shape: tuple[int, ...] = ()
    offset: int = 0
    nbytes: int = 0


class _Layout(NamedTuple):
    """Where a payload's tensors go, made from their dtypes and shapes alone, so payloads of
    the same layout share it (:func:`_layout`): slots, the header's ``td`` as JSON, the data
    section's length, and whether any tensor is large enough for page alignment."""

    slots: tuple[_Slot, ...]
    td_json: bytes
    data_nbytes: int
    any_large: bool


#: Layouts by ``(layers, per tensor None or (dtype, shape))``; bounded (cleared when full).
_LAYOUTS: dict[tuple[Any, ...], _Layout] = {}
_LAYOUTS_MAX = 256


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
        self._sources: list[TensorLike | None] = [*key_cache, *value_cache]
        layout = _layout(num_layers, self._sources)
        self._slots = layout.slots
        self.data_nbytes = cursor = layout.data_nbytes
        any_large = layout.any_large
        header: dict[str, Any] = {
            "rid": str(request_id),
            "bids": [int(b) for b in block_ids],
            "meta": dict(metadata or {}),
            "nl": num_layers,
            "v": FORMAT_VERSION,
            "al": ALIGN,
            "bo": sys.byteorder,
            "dl": cursor,
        }
        if checksum:
            header["ck"] = _CK_PLACEHOLDER
        # the layout's descriptors are encoded once per layout, then spliced in as the last key
        raw = _encode_header(header)[:-1] + b',"td":' + layout.td_json + b"}"
        if len(raw) > DEFAULT_MAX_HEADER_BYTES:
            raise EncodeError(
                f"header of {len(raw)} bytes exceeds {DEFAULT_MAX_HEADER_BYTES} (what receivers "
                "accept by default): metadata or block ids too large"
            )
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
        if _is_byte_array(buf):  # a host slot handed over as numpy: no torch call at all
            self._check_room(buf.size, offset)
            self._pack_host(buf, None, offset)
            return self.nbytes
        out = _as_byte_tensor(buf, writable=True)
        self._check_room(out.numel(), offset)
        if out.is_cpu:
            self._pack_host(out.numpy(), out, offset)
            return self.nbytes
        region = out[offset : offset + self.nbytes]
        data = region[self.data_start :]
        typed = _TypedBases(data)
        prev_end = 0
        for slot, src in zip(self._slots, self._sources, strict=True):
            if src is None:
                continue
            if slot.offset > prev_end:
                data[prev_end : slot.offset].zero_()
            if slot.nbytes:
                _write_tensor(slot, src, data, typed)
            prev_end = slot.offset + slot.nbytes
        _copy_bytes_in(region, self._final_header(data))
        return self.nbytes

    def _check_room(self, size: int, offset: int) -> None:
        if offset < 0 or offset + self.nbytes > size:
            raise ValueError(
                f"buffer of {size} bytes cannot hold {self.nbytes} bytes at offset {offset}"
            )

    def _pack_host(self, array: np.ndarray, out: torch.Tensor | None, offset: int) -> None:
        """:meth:`pack_into` for host memory (``array``; ``out``: the same memory as a tensor,
        when the caller gave one): small tensors through numpy (a fraction of torch's per-call
        overhead, which is what a small payload's send time is made of), large ones, and any
        slot numpy cannot take, through torch."""
        whole = array[offset : offset + self.nbytes]
        host = whole[self.data_start :]
        # slots are ALIGN-aligned within the data section, so its start decides for every
        # element size (<= 8 bytes)
        aligned = host.__array_interface__["data"][0] % 8 == 0
        data: torch.Tensor | None = None
        typed: _TypedBases | None = None
        prev_end = 0
        for slot, src in zip(self._slots, self._sources, strict=True):
            if src is None:
                continue
            if slot.offset > prev_end:
                host[prev_end : slot.offset] = 0
            if slot.nbytes and not (aligned and _write_bits(slot, src, host)):
                if data is None:
                    if out is not None:
                        data = out[offset + self.data_start : offset + self.nbytes]
                    else:
                        data = torch.from_numpy(host)
                    typed = _TypedBases(data)
                assert typed is not None
                _write_tensor(slot, src, data, typed)
            prev_end = slot.offset + slot.nbytes
        header = self._final_header(host)
        whole[: len(header)] = np.frombuffer(header, dtype=np.uint8)

    def _final_header(self, data: torch.Tensor | np.ndarray) -> bytes:
        """The length-prefixed header, with the checksum of ``data`` (written) when asked."""
        header = self.header_bytes
        if self._checksum:
            crc = _crc32(data)
            header = header.replace(
                _CK_PLACEHOLDER.encode("ascii"), f"{_CK_PREFIX}{crc:08x}".encode("ascii"), 1
            )
        return header

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


vars(PackedPayload.pack_into)[HOST_ARRAY_WRITER] = True


def _layout(num_layers: int, sources: Sequence[TensorLike | None]) -> _Layout:
    """The :class:`_Layout` of a payload whose K then V tensors are ``sources`` (the first
    ``num_layers`` are K). Made once per distinct layout; a stage sends the same one request
    after request. Raises :class:`EncodeError` for a dtype the format has no name for."""
    sig: list[tuple[torch.dtype, tuple[int, ...]] | None] = []
    for src in sources:
        if src is None:
            sig.append(None)
            continue
        shape = src.shape
        if not getattr(src, "shape_is_ints", False):  # torch.Size, numpy ints: plain ints
            shape = tuple(map(int, shape))
        sig.append((src.dtype, shape))
    key = (num_layers, tuple(sig))
    layout = _LAYOUTS.get(key)
    if layout is None:
        layout = _lay_out(num_layers, sig)
        if len(_LAYOUTS) >= _LAYOUTS_MAX:
            _LAYOUTS.clear()
        _LAYOUTS[key] = layout
    return layout


def _lay_out(num_layers: int, sig: Sequence[tuple[torch.dtype, tuple[int, ...]] | None]) -> _Layout:
    """Place every tensor of a payload: its slot, its header descriptor, the data length, and
    whether any tensor is large enough for page alignment. Called by :func:`_layout`."""
    slots: list[_Slot] = []
    td: list[dict[str, Any]] = []
    cursor = 0
    any_large = False
    for pos, entry in enumerate(sig):
        cache, idx = (_CACHES[0], pos) if pos < num_layers else (_CACHES[1], pos - num_layers)
        name = f"{cache}_{idx}"
        if entry is None:
            slots.append(_Slot(name, idx))
            td.append({"n": name, "x": True})
            continue
        dtype, shape = entry
        dname = _DTYPE_TO_NAME.get(dtype)
        if dname is None:
            raise EncodeError(f"unsupported dtype {dtype} in {name}")
        nbytes = math.prod(shape) * _ITEMSIZE[dname]
        align = PAGE if nbytes >= LARGE_TENSOR_BYTES else ALIGN
        any_large = any_large or align == PAGE
        cursor = _round_up(cursor, align)
        slots.append(_Slot(name, idx, dname, shape, cursor, nbytes))
        td.append({"n": name, "i": idx, "d": dname, "s": list(shape), "o": cursor, "b": nbytes})
        cursor += nbytes
    return _Layout(tuple(slots), _encode_header(td), cursor, any_large)


class _TypedBases:
    """Typed views of a payload's data section, one per dtype, made on first use by
    :meth:`PackedPayload.pack_into`; a slot's destination is then one ``as_strided`` of it."""

    __slots__ = ("_bases", "data")

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data
        self._bases: dict[str, tuple[torch.Tensor, int] | None] = {}

    def dst(self, slot: _Slot) -> torch.Tensor | None:
        """The slot's destination as a typed view, or ``None`` where the address is misaligned."""
        name = slot.dtype_name
        if name in self._bases:
            base = self._bases[name]
        else:
            base = self._bases[name] = self._make(name)
        if base is None:
            return None
        typed, origin = base
        itemsize = _ITEMSIZE[name]
        return typed.as_strided(slot.shape, _strides(slot.shape), origin + slot.offset // itemsize)

    def _make(self, name: str) -> tuple[torch.Tensor, int] | None:
        itemsize = _ITEMSIZE[name]
        if self.data.data_ptr() % itemsize:
            return None
        usable = self.data.numel() // itemsize * itemsize
        try:
            typed = self.data[:usable].view(DTYPE_ALLOWLIST[name])
        except RuntimeError:  # storage offset misaligned for the dtype: per-slot path
            return None
        return typed, int(typed.storage_offset())


def _write_bits(slot: _Slot, src: TensorLike, host: np.ndarray) -> bool:
    """Host fast path of :meth:`PackedPayload.pack_into` for small tensors: copy the slot's
    source into the host data section ``host`` through numpy, whose per-call overhead is a
    fraction of torch's. ``False`` (nothing written) where it does not apply, and for tensors of
    :data:`LARGE_TENSOR_BYTES` or more, which torch copies faster (several threads, wide copies:
    224 MiB of 4 MiB tensors took 2.5 x longer through numpy)."""
    if slot.nbytes >= LARGE_TENSOR_BYTES:
        return False
    itemsize = _ITEMSIZE[slot.dtype_name]
    np_bits = _BITS_NP.get(itemsize)
    if np_bits is None or slot.offset % itemsize:
        return False
    dst = host[slot.offset : slot.offset + slot.nbytes].view(np_bits)
    if isinstance(src, torch.Tensor):
        if tuple(src.shape) != slot.shape:
            raise EncodeError(f"{slot.name} changed shape while encoding")
        bits = host_bits(src.detach())
        if bits is None:
            return False
        np.copyto(dst.reshape(slot.shape), bits, casting="no")
        return True
    write_bits = getattr(src, "write_bits", None)
    return bool(write_bits(dst)) if write_bits is not None else False


def _write_tensor(slot: _Slot, src: TensorLike, data: torch.Tensor, typed: _TypedBases) -> None:
    dst = typed.dst(slot)
    if dst is not None:
        if isinstance(src, torch.Tensor):
            if tuple(src.shape) != slot.shape:
                raise EncodeError(f"{slot.name} changed shape while encoding")
            dst.copy_(src.detach())
        else:
            assert src is not None
            src.write_into(dst)
        return
    # Unaligned destination (caller passed an odd offset): go through a temporary.
    dst_bytes = data[slot.offset : slot.offset + slot.nbytes]
    dtype = DTYPE_ALLOWLIST[slot.dtype_name]
    if isinstance(src, torch.Tensor):
        tmp = src.detach().contiguous()
    else:
        assert src is not None
        tmp = torch.empty(slot.shape, dtype=dtype, device=dst_bytes.device)
        src.write_into(tmp)
    dst_bytes.copy_(tmp.reshape(-1).view(torch.uint8))


def _crc32(data: torch.Tensor | np.ndarray) -> int:
    if isinstance(data, np.ndarray):
        return zlib.crc32(data.data) & 0xFFFFFFFF
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


def _is_byte_array(buf: Any) -> bool:
    """``buf`` is a writable, contiguous 1-D ``uint8`` numpy array."""
    return (
        isinstance(buf, np.ndarray)
        and buf.dtype == np.uint8
        and buf.ndim == 1
        and buf.flags.c_contiguous
        and buf.flags.writeable
    )


def writes_host_arrays(write: Any) -> bool:
    """Whether ``write`` carries :data:`HOST_ARRAY_WRITER` (called by connectors' puts)."""
    return getattr(write, HOST_ARRAY_WRITER, False) is True


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
class _TensorDesc(msgspec.Struct, frozen=True, gc=False):
    """One ``td`` entry as written; fields are checked by :func:`_span_of`."""

    n: str
    x: bool = False
    i: int | None = None
    d: str | None = None
    s: tuple[int, ...] | None = None  # a tuple: the entry is hashable (see _spans)
    o: int | None = None
    b: int | None = None


class _Header(msgspec.Struct, frozen=True, gc=False):
    """The JSON header: the reference's keys plus omnikv's optional extensions."""

    rid: str
    bids: list[int]
    meta: dict[str, Any]
    td: list[_TensorDesc]
    nl: int
    v: int = FORMAT_VERSION
    al: int | None = None
    bo: str = "little"
    dl: int | None = None
    ck: str | None = None


_HEADER_DECODER = msgspec.json.Decoder(_Header)


class _Span(NamedTuple):
    """A validated tensor descriptor: where its bytes are and what they are."""

    pos: int
    cache: int
    layer: int
    dtype_name: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class DecodedKV:
    """A decoded KV payload: per-layer key and value tensors (``None`` for absent layers).

    The tensors are views of the decoded buffer unless the decode copied (``copy=True``, or a
    legacy tensor whose bytes were not aligned for its dtype): they are valid as long as the
    buffer is (for a connector buffer: until it is released).
    """

    request_id: str
    block_ids: list[int]
    metadata: dict[str, Any]
    key_cache: list[torch.Tensor | None]
    value_cache: list[torch.Tensor | None]

    @property
    def num_layers(self) -> int:
        return len(self.key_cache)

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data (key and value tensors together)."""
        return sum(
            t.numel() * t.element_size()
            for t in (*self.key_cache, *self.value_cache)
            if t is not None
        )

    def to_seed_dict(self) -> dict[str, Any]:
        """The reference's decoded shape: ``request_id``, ``layer_blocks``, ``block_ids``, ..."""
        return {
            "request_id": self.request_id,
            "layer_blocks": {"key_cache": self.key_cache, "value_cache": self.value_cache},
            "block_ids": self.block_ids,
            "metadata": self.metadata,
        }


def _fail(msg: str) -> DecodeError:
    return DecodeError(f"corrupt KV payload: {msg}")


def _read_header(
    head4: bytes, total: int, read: Callable[[int, int], Any], max_header_bytes: int
) -> tuple[_Header, int]:
    if total < 4 or len(head4) < 4:
        raise _fail(f"missing 4-byte header length (buffer has {total} bytes)")
    (hlen,) = _LEN.unpack(head4[:4])
    if hlen > max_header_bytes:
        raise _fail(f"header_len={hlen} exceeds the limit of {max_header_bytes} bytes")
    if hlen > total - 4:
        raise _fail(f"header_len={hlen} exceeds buffer size {total} - 4")
    try:
        header = _HEADER_DECODER.decode(read(4, hlen))
    except RecursionError as exc:
        raise _fail("header JSON is nested too deeply") from exc
    except msgspec.ValidationError as exc:
        raise _fail(f"header: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise _fail(f"header is not valid UTF-8 JSON ({exc})") from exc
    return header, hlen


def _check_header(header: _Header, available: int) -> int:
    """Header-level checks; returns the length of the data section."""
    if not 0 <= header.nl <= MAX_LAYERS:
        raise _fail(f"nl={header.nl} outside [0, {MAX_LAYERS}]")
    if len(header.td) > 2 * MAX_LAYERS:
        raise _fail(f"td has {len(header.td)} entries, more than {2 * MAX_LAYERS}")
    if not 0 <= header.v <= FORMAT_VERSION:
        raise _fail(
            f"unsupported format version {header.v} (this reader knows <= {FORMAT_VERSION})"
        )
    if header.bo != sys.byteorder:
        raise _fail(f"payload byte order {header.bo!r} differs from this machine's {sys.byteorder}")
    if header.al is not None and not (0 < header.al <= PAGE and header.al & (header.al - 1) == 0):
        raise _fail(f"al={header.al} is not a power of two in [1, {PAGE}]")
    if header.dl is None:
        return available
    if not 0 <= header.dl <= available:
        raise _fail(f"dl={header.dl} outside the {available} bytes after the header")
    return header.dl


def _numel(shape: tuple[int, ...], pos: int) -> int:
    """Element count of ``shape``; refuses negative dims and more than ``MAX_ELEMENTS``, also
    when a zero dim hides huge others (``[2**62, 2**62, 0]``: torch cannot build it)."""
    if len(shape) > MAX_DIMS:
        raise _fail_at(pos, f"s must have at most {MAX_DIMS} dims, got {len(shape)}")
    if shape and min(shape) < 0:
        raise _fail_at(pos, f"s must hold non-negative integers, got {shape!r:.80}")
    numel = math.prod(shape)
    extent = numel if numel else math.prod(d for d in shape if d)
    if extent > MAX_ELEMENTS:
        raise _fail_at(pos, f"s={shape!r:.80} claims more than {MAX_ELEMENTS} elements")
    return numel


def _fail_at(pos: int, msg: str) -> DecodeError:
    return _fail(f"td[{pos}]: {msg}")


def _layer_of(name: str, index: int | None, pos: int, nl: int) -> tuple[int, int]:
    """(0 for ``key_cache_*`` / 1 for ``value_cache_*`` / -1 for other names, the layer).

    The layer is ``i`` when given, else the name's suffix; it must be in ``[0, nl)``.
    """
    if name.startswith("key_cache_"):
        cache, suffix = 0, name[10:]
    elif name.startswith("value_cache_"):
        cache, suffix = 1, name[12:]
    else:
        return -1, -1
    if index is None:
        if not (suffix.isascii() and suffix.isdigit() and len(suffix) <= 9):
            raise _fail_at(pos, f"Invalid KV tensor name {name!r:.40}")
        index = int(suffix)
    if not 0 <= index < nl:
        raise _fail_at(pos, f"Invalid layer index {index} (nl={nl})")
    return cache, index


def _span_of(e: _TensorDesc, pos: int, nl: int, data_len: int, aligned: bool) -> _Span | None:
    if e.x:
        _layer_of(e.n, None, pos, nl)
        return None
    dname = e.d
    itemsize = _ITEMSIZE.get(dname) if dname is not None else None
    if dname is None or itemsize is None:
        raise _fail_at(
            pos,
            f"Unsupported dtype in KV payload: got {dname!r:.40}, "
            f"expected one of {sorted(DTYPE_ALLOWLIST)}",
        )
    o, b = e.o, e.b
    if o is None or b is None or o < 0 or b < 0 or o + b > data_len:
        raise _fail_at(pos, f"tensor span [{o}, {o}+{b}) outside data section of {data_len} bytes")
    if e.s is None:
        raise _fail_at(pos, "no shape")
    need = _numel(e.s, pos) * itemsize
    if need != b:
        raise _fail_at(pos, f"shape {e.s!r:.80} of dtype {e.d} needs {need} bytes, b={b}")
    if aligned and o % itemsize:
        raise _fail_at(pos, f"offset {o} is misaligned for {e.d} ({itemsize}-byte elements)")
    cache, layer = _layer_of(e.n, e.i, pos, nl)
    if cache < 0:
        return None  # not a KV tensor: the reference ignores such names; so do we
    return _Span(pos, cache, layer, dname, tuple(e.s), o, b)


class _Run(NamedTuple):
    """Spans that are ``n`` tensors of one numpy-typed dtype and shape, back to back from
    ``offset``: viewed as one array, split into rows (:meth:`_HostViewer.views`)."""

    offset: int
    n: int
    dtype_name: str
    shape: tuple[int, ...]
    nbytes: int  # of one tensor


def _run_of(spans: Sequence[_Span]) -> _Run | None:
    """The :class:`_Run` the spans form, or ``None``."""
    if len(spans) < 2:
        return None
    first = spans[0]
    if first.dtype_name not in _NUMPY_OF or not first.nbytes:
        return None
    for i, span in enumerate(spans):
        if (
            span.dtype_name != first.dtype_name
            or span.shape != first.shape
            or span.offset != first.offset + i * first.nbytes
        ):
            return None
    return _Run(first.offset, len(spans), first.dtype_name, first.shape, first.nbytes)


#: Validated spans (and their run) by everything their validation reads (see :func:`_spans`);
#: bounded.
_SPANS_SEEN: dict[
    tuple[tuple[_TensorDesc, ...], int, bool, int], tuple[tuple[_Span, ...], _Run | None]
] = {}
_SPANS_SEEN_MAX = 256


def _spans(header: _Header, data_len: int) -> list[_Span]:
    """Every KV tensor's span, validated: in the data section, no overlap, no duplicates."""
    return _spans_and_run(header, data_len)[0]


def _spans_and_run(header: _Header, data_len: int) -> tuple[list[_Span], _Run | None]:
    """:func:`_spans`, and the :class:`_Run` they form (if any).

    A stage receives the same layout request after request (only the lengths change with the
    prompt), so the outcome of a successful validation is kept, keyed by every input it read:
    the descriptors (compared field by field), ``nl``, whether ``al`` is present and the data
    length. A payload whose descriptors differ in any way is validated afresh; failures are
    never kept. The table is bounded (cleared when full), so a peer varying its headers only
    costs itself the validation."""
    key = (tuple(header.td), header.nl, header.al is not None, data_len)
    seen = _SPANS_SEEN.get(key)
    if seen is not None:
        return list(seen[0]), seen[1]
    spans = _validate_spans(header, data_len)
    run = _run_of(spans)
    if len(_SPANS_SEEN) >= _SPANS_SEEN_MAX:
        _SPANS_SEEN.clear()
    _SPANS_SEEN[key] = (tuple(spans), run)
    return spans, run


def _validate_spans(header: _Header, data_len: int) -> list[_Span]:
    """:func:`_spans` without the table."""
    aligned, nl = header.al is not None, header.nl
    spans = []
    taken = [False] * (2 * nl)
    for pos, entry in enumerate(header.td):
        span = _span_of(entry, pos, nl, data_len, aligned)
        if span is None:
            continue
        slot = span.cache * nl + span.layer
        if taken[slot]:
            raise _fail_at(pos, f"duplicate tensor for {_CACHES[span.cache]}_{span.layer}")
        taken[slot] = True
        spans.append(span)
    _check_disjoint(spans)
    return spans


def _check_disjoint(spans: list[_Span]) -> None:
    """No two non-empty spans share a byte (one pass when offsets already increase)."""
    end = 0
    for span in spans:
        if span.nbytes and span.offset < end:
            break
        end = max(end, span.offset + span.nbytes)
    else:
        return
    end, prev = 0, -1
    for span in sorted((s for s in spans if s.nbytes), key=lambda s: s.offset):
        if span.offset < end:
            raise _fail_at(
                span.pos,
                f"span [{span.offset}, {span.offset + span.nbytes}) overlaps td[{prev}] "
                "(tensor spans must not share bytes)",
            )
        end, prev = span.offset + span.nbytes, span.pos


def _verify_checksum(ck: str | None, data: torch.Tensor | np.ndarray) -> None:
    if ck is None:
        return
    if not ck.startswith(_CK_PREFIX) or len(ck) != len(_CK_PLACEHOLDER):
        raise _fail(f"malformed checksum field {ck!r:.40}")
    try:
        want = int(ck[len(_CK_PREFIX) :], 16)
    except ValueError as exc:
        raise _fail(f"malformed checksum field {ck!r:.40}") from exc
    got = _crc32(data)
    if got != want:
        raise _fail(f"data checksum mismatch: header says {want:08x}, data has {got:08x}")


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out = [1] * len(shape)
    for k in range(len(shape) - 2, -1, -1):
        out[k] = out[k + 1] * max(shape[k + 1], 1)
    return tuple(out)


def _run_length(spans: list[_Span], i: int) -> int:
    """How many spans from ``i`` on share dtype and shape and follow each other at one step."""
    first, j = spans[i], i + 1
    if j == len(spans) or first.nbytes == 0:
        return 1
    step = spans[j].offset - first.offset
    if step < first.nbytes or step % _ITEMSIZE[first.dtype_name]:
        return 1
    while (
        j < len(spans)
        and spans[j].dtype_name == first.dtype_name
        and spans[j].shape == first.shape
        and spans[j].offset - spans[j - 1].offset == step
    ):
        j += 1
    return j - i


class _Viewer:
    """Makes tensor views of a byte tensor: one typed view per dtype, then ``as_strided``.

    Spans of one dtype and shape at a constant step (every layer of a model) become one strided
    view that ``unbind`` splits, which is what makes decoding cheap. A span whose address is not
    aligned for its dtype (legacy writers have no alignment) is copied to fresh memory; spans do
    not overlap, so those copies never exceed the data section.
    """

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data
        self._ptr = data.data_ptr()
        self._typed: dict[str, tuple[torch.Tensor, int] | None] = {}

    def _typed_view(self, name: str) -> tuple[torch.Tensor, int] | None:
        if name not in self._typed:
            itemsize = _ITEMSIZE[name]
            lead = -self._ptr % itemsize
            usable = (self.data.numel() - lead) // itemsize * itemsize
            try:
                typed = self.data[lead : lead + usable].view(DTYPE_ALLOWLIST[name])
                self._typed[name] = (typed, int(typed.storage_offset()) - lead // itemsize)
            except RuntimeError:  # storage itself misaligned: per-tensor copies instead
                self._typed[name] = None
        return self._typed[name]

    def views(self, spans: list[_Span]) -> list[torch.Tensor]:
        """One tensor per span, in order."""
        out: list[torch.Tensor] = []
        i = 0
        while i < len(spans):
            count = _run_length(spans, i)
            if count == 1:
                out.append(self._one(spans[i]))
            else:
                out.extend(self._run(spans[i], count, spans[i + 1].offset - spans[i].offset))
            i += count
        return out

    def _run(self, first: _Span, count: int, step: int) -> tuple[torch.Tensor, ...]:
        itemsize = _ITEMSIZE[first.dtype_name]
        typed = (
            self._typed_view(first.dtype_name)
            if (self._ptr + first.offset) % itemsize == 0
            else None
        )
        if typed is None:
            return tuple(
                self._one(first._replace(offset=first.offset + k * step)) for k in range(count)
            )
        base, origin = typed
        shape, strides = (count, *first.shape), (step // itemsize, *_strides(first.shape))
        return base.as_strided(shape, strides, origin + first.offset // itemsize).unbind(0)

    def _one(self, span: _Span) -> torch.Tensor:
        dtype = DTYPE_ALLOWLIST[span.dtype_name]
        if span.nbytes == 0:
            return torch.empty(span.shape, dtype=dtype, device=self.data.device)
        itemsize = _ITEMSIZE[span.dtype_name]
        typed = (
            self._typed_view(span.dtype_name) if (self._ptr + span.offset) % itemsize == 0 else None
        )
        if typed is None:
            chunk = self.data[span.offset : span.offset + span.nbytes].clone()
            return chunk.view(dtype).view(span.shape)
        base, origin = typed
        return base.as_strided(span.shape, _strides(span.shape), origin + span.offset // itemsize)


class _HostViewer(_Viewer):
    """:class:`_Viewer` over a host payload given as a numpy array: the typed bases are numpy
    views turned into tensors with one ``from_numpy`` each (bf16 and fp8, which numpy lacks,
    through same-size integers and a torch ``view``), so decoding makes no torch slice. The
    tensors keep ``array`` (and whatever owns it) alive."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array
        self._ptr = int(array.__array_interface__["data"][0])
        self._typed = {}

    def _typed_view(self, name: str) -> tuple[torch.Tensor, int] | None:
        if name not in self._typed:
            itemsize = _ITEMSIZE[name]
            lead = -self._ptr % itemsize
            usable = (self.array.size - lead) // itemsize * itemsize
            raw = self.array[lead : lead + usable]
            np_type = _NUMPY_OF.get(name)
            bits = _BITS_NP.get(itemsize)
            if np_type is not None:
                typed = torch.from_numpy(raw.view(np_type))
            elif bits is not None:
                typed = torch.from_numpy(raw.view(bits)).view(DTYPE_ALLOWLIST[name])
            else:  # pragma: no cover - every allowed dtype is one of the two
                self._typed[name] = None
                return None
            self._typed[name] = (typed, -(lead // itemsize))
        return self._typed[name]

    def views(self, spans: list[_Span], run: _Run | None = None) -> list[torch.Tensor]:
        """One tensor per span, in order. Spans of a dtype numpy has, aligned and not empty,
        are shaped in numpy and handed over with one ``from_numpy`` each: that path makes no
        torch operator call (no dispatcher), which on a process that has just been idle costs
        several times less than a strided view and an ``unbind``. Spans that form a ``run``
        (:func:`_run_of`: every layer's K and V alike, back to back, the common case) are
        shaped with one numpy view for all. Any other span goes the :class:`_Viewer` way."""
        out: list[torch.Tensor] = []
        array, ptr = self.array, self._ptr
        if run is not None and not (ptr + run.offset) % _ITEMSIZE[run.dtype_name]:
            end = run.offset + run.n * run.nbytes
            rows = array[run.offset : end].view(_NUMPY_OF[run.dtype_name])
            return [torch.from_numpy(row) for row in rows.reshape(run.n, *run.shape)]
        for i, span in enumerate(spans):
            np_type = _NUMPY_OF.get(span.dtype_name)
            if (
                np_type is None
                or not span.nbytes
                or (ptr + span.offset) % _ITEMSIZE[span.dtype_name]
            ):
                return out + super().views(spans[i:])
            chunk = array[span.offset : span.offset + span.nbytes].view(np_type)
            out.append(torch.from_numpy(chunk.reshape(span.shape)))
        return out

    def _one(self, span: _Span) -> torch.Tensor:
        if span.nbytes == 0:
            return torch.empty(span.shape, dtype=DTYPE_ALLOWLIST[span.dtype_name])
        typed = self._typed_view(span.dtype_name)
        itemsize = _ITEMSIZE[span.dtype_name]
        if typed is None or (self._ptr + span.offset) % itemsize:
            chunk = torch.from_numpy(self.array[span.offset : span.offset + span.nbytes].copy())
            return chunk.view(DTYPE_ALLOWLIST[span.dtype_name]).view(span.shape)
        base, origin = typed
        return base.as_strided(span.shape, _strides(span.shape), origin + span.offset // itemsize)


def _copied(data: torch.Tensor, spans: list[_Span]) -> list[torch.Tensor]:
    """Every span copied into a fresh tensor of its own (in all at most the data section).

    One allocation per tensor, as before the restructuring: with one payload-sized buffer per
    request, ``bench prefetch``'s synchronous receive took 28-55 ms instead of 30 ms. Whether a
    copy lands on fresh pages (a fault per page, ~20 ms per 32 MiB on this VM) depends on the C
    allocator's thresholds either way; a recycled copy-out pool would not.
    """
    out = []
    for span in spans:
        dtype = DTYPE_ALLOWLIST[span.dtype_name]
        if span.nbytes == 0:
            out.append(torch.empty(span.shape, dtype=dtype, device=data.device))
            continue
        chunk = data[span.offset : span.offset + span.nbytes].clone()
        out.append(chunk.view(dtype).view(span.shape))
    return out


def _host_reader(t: torch.Tensor) -> tuple[bytes, Callable[[int, int], Any]]:
    mv = t.numpy().data if t.numel() else memoryview(b"")
    return bytes(mv[:4]), lambda start, n: mv[start : start + n]


def _device_reader(t: torch.Tensor) -> tuple[bytes, Callable[[int, int], Any]]:
    def read(start: int, n: int) -> bytes:
        return t[start : start + n].cpu().numpy().tobytes()

    return read(0, 4), read


def decode_kv(
    buffer: Any,
    *,
    copy: bool = False,
    verify: bool = True,
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
) -> DecodedKV:
    """Decode a packed payload into a :class:`DecodedKV`.

    ``buffer``: bytes, bytearray, memoryview, mmap, ndarray, or a 1-D ``uint8`` tensor on any
    device (the header is then read with two small device-to-host copies). With ``copy=False``
    the tensors are views of ``buffer``; with ``copy=True`` each has fresh memory of its own (in
    all at most the data section) and ``buffer`` may be reused at once. ``verify`` checks the data
    checksum when the payload carries one. Every malformed input raises :class:`DecodeError`
    before anything proportional to a claimed size is allocated.
    """
    if (
        not copy
        and isinstance(buffer, np.ndarray)
        and buffer.dtype == np.uint8
        and buffer.ndim == 1
        and buffer.flags.c_contiguous
    ):
        return _decode_array(buffer, verify, max_header_bytes)
    try:
        t = _as_byte_tensor(buffer)
    except ValueError as exc:
        raise _fail(str(exc)) from exc
    head4, read = _host_reader(t) if t.device.type == "cpu" else _device_reader(t)
    header, hlen = _read_header(head4, t.numel(), read, max_header_bytes)
    data_len = _check_header(header, t.numel() - 4 - hlen)
    data = t[4 + hlen : 4 + hlen + data_len]
    spans = _spans(header, data_len)
    if verify:
        _verify_checksum(header.ck, data)
    tensors = _copied(data, spans) if copy else _Viewer(data).views(spans)
    return _assemble(header, spans, tensors)


def _decode_array(array: np.ndarray, verify: bool, max_header_bytes: int) -> DecodedKV:
    """:func:`decode_kv` of a host payload in a 1-D ``uint8`` numpy array, as views of it.

    The receiver's hot path (an adopted pool span): the same checks in the same order, with
    the header read and the data section sliced in numpy (see :class:`_HostViewer`).
    """
    mv = array.data
    header, hlen = _read_header(
        bytes(mv[:4]), array.size, lambda start, n: mv[start : start + n], max_header_bytes
    )
    data_len = _check_header(header, array.size - 4 - hlen)
    data = array[4 + hlen : 4 + hlen + data_len]
    spans, run = _spans_and_run(header, data_len)
    if verify:
        _verify_checksum(header.ck, data)
    tensors = _HostViewer(data).views(spans, run)
    return _assemble(header, spans, tensors)


def _assemble(header: _Header, spans: list[_Span], tensors: list[torch.Tensor]) -> DecodedKV:
    caches: tuple[list[torch.Tensor | None], list[torch.Tensor | None]] = (
        [None] * header.nl,
        [None] * header.nl,
    )
    for span, tensor in zip(spans, tensors, strict=True):
        caches[span.cache][span.layer] = tensor
    return DecodedKV(header.rid, header.bids, header.meta, caches[0], caches[1])


def decode(buf: Any, *, verify: bool = True) -> dict[str, Any]:
    """The seed's decoded dict of :func:`decode_kv` (zero-copy views of ``buf``)."""
    return decode_kv(buf, verify=verify).to_seed_dict()


def decode_device(t: torch.Tensor, *, copy: bool = True, verify: bool = True) -> dict[str, Any]:
    """The seed's decoded dict of a payload in a 1-D ``uint8`` tensor on any device.

    ``copy=True`` (the reference's behaviour) gives the tensors their own memory (at most the
    data section in all); ``copy=False`` returns views into ``t``.
    """
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 1:
        raise _fail("device payload must be a 1-D uint8 tensor")
    return decode_kv(t, copy=copy, verify=verify).to_seed_dict()


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
        return decode_kv(raw).to_seed_dict()

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
