"""Encoding KV payloads: the plan (header and offsets) and the writers that fill it.

:class:`PackedPayload` is the plan: built from a request's K and V tensors (or
:class:`TensorWriter` sources, which gather paged blocks straight into the buffer), it fixes the
header and every tensor's offset (:mod:`omnikv.wire.format`) before a byte is copied, so its
``nbytes`` is exact and the sender can ask the connector for a buffer of that size. Then
:meth:`PackedPayload.pack_into` writes the payload into that buffer with exactly one copy of
each tensor (:meth:`PackedPayload.to_bytes` returns ``bytes``). Small host tensors are copied
through numpy as same-size integer bits (:func:`host_bits`), whose per-call overhead is a
fraction of torch's; large tensors, device tensors and writer sources go through torch.

Where the tensors go depends only on their dtypes and shapes, and a stage sends the same layout
request after request, so each distinct layout (slots and the encoded ``td``) is made once and
kept in a bounded table (:func:`layout_cache_info`).

Every payload carries the data check (``dc``, :func:`omnikv.wire.format.data_check`) unless
asked not to (``checksum=False``, or connector config ``payload_checksum: false``). Into host
memory it is computed in the same pass as the copy: each tensor's bytes are hashed right after
they are written, while they are still in the CPU's caches; into device memory the data
section is copied to host once more for it.
"""

from __future__ import annotations

import ctypes
import functools
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable

import numpy as np
import torch

from omnikv.errors import EncodeError
from omnikv.wire.codec import CODEC_FORMAT_VERSION, Coded, decode_rows
from omnikv.wire.format import (
    ALIGN,
    BITS_NP,
    BITS_TORCH,
    CACHES,
    DATA_CHECK_PLACEHOLDER,
    DATA_CHECK_PREFIX,
    DEFAULT_MAX_HEADER_BYTES,
    DTYPE_ALLOWLIST,
    DTYPE_TO_NAME,
    FORMAT_VERSION,
    HEADER_LENGTH,
    ITEMSIZE,
    LARGE_TENSOR_BYTES,
    PAGE,
    STREAM_FORMAT_VERSION,
    data_check,
    data_hasher,
    encode_header,
)
from omnikv.wire.mac import PayloadSeal, find_seals, tensor_bytes
from omnikv.wire.views import as_byte_tensor, strides

if TYPE_CHECKING:
    from functools import _CacheInfo

__all__ = [
    "PackedPayload",
    "TensorLike",
    "TensorWriter",
    "clear_layout_cache",
    "host_bits",
    "layout_cache_info",
]

#: Most distinct layouts kept (least recently used out first).
_LAYOUTS_MAX = 256


# --------------------------------------------------------------------------------------------
# Sources of tensor data
# --------------------------------------------------------------------------------------------
@runtime_checkable
class TensorWriter(Protocol):
    """A tensor that is not materialised yet: it knows its dtype and shape and writes itself.

    ``write_into(dst)`` is called once with a contiguous tensor of exactly ``dtype`` and
    ``shape`` (a view of the send buffer); :mod:`omnikv.layouts.gather` uses this to gather paged
    blocks straight into the buffer that travels.
    """

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def shape(self) -> tuple[int, ...]: ...

    def write_into(self, dst: torch.Tensor) -> None: ...


TensorLike = torch.Tensor | TensorWriter


def host_bits(t: torch.Tensor) -> np.ndarray | None:
    """A numpy view of a host tensor's elements as same-size integers, or ``None``.

    Copies through numpy cost a fraction of torch's per-call overhead, which is what a small
    payload's send time is made of; copying bits is exact for every dtype (bf16 and fp8 too).
    ``None`` for device tensors and anything numpy cannot view (conjugate/negative bits).
    Called by :meth:`PackedPayload.pack_into` and
    :meth:`omnikv.layouts.gather.BlockGather.write_bits`.
    """
    if not t.is_cpu:
        return None
    size = t.element_size()
    bits = BITS_TORCH.get(size)
    if bits is None:
        return None
    try:
        return (t if t.dtype == bits else t.view(bits)).numpy()
    except (RuntimeError, TypeError):
        return None


def _round_up(value: int, align: int) -> int:
    return (value + align - 1) // align * align


# --------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------
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


#: A payload's layout signature: its layer count, then per tensor ``None`` or (dtype, shape).
_Signature = tuple[tuple[torch.dtype, tuple[int, ...]] | None, ...]


class PackedPayload:
    """An encoding plan: header computed, data offsets fixed, tensors not yet copied.

    Built by :class:`~omnikv.wire.transfer_data.KVCacheTransferData`, by the intra-stage frames
    and by the sender's extraction (with :class:`TensorWriter` sources). ``nbytes`` is the exact
    packed size; :meth:`pack_into` writes the payload into a caller's buffer with one copy per
    tensor. Raises :class:`EncodeError` for a dtype the format cannot name, metadata that is not
    JSON-serialisable, or a header larger than receivers accept by default. Not thread-safe;
    cheap to build. With ``coded`` the sources are already coded
    (:func:`omnikv.wire.codec.encode_rows`) and the header names the codec and the original
    dtype, the one a receiver decodes them to. ``stamp`` (the sender's
    :class:`~omnikv.wire.format.Stamp` fields) goes into the header as ``ss``; ``stream`` (the
    :class:`~omnikv.wire.format.StreamMark` fields of a streamed send's piece) as ``sm``, which
    makes it format version :data:`~omnikv.wire.format.STREAM_FORMAT_VERSION` (codec or not).
    ``checksum`` (default) gives the payload its data check (``dc``), which every omnikv
    reader verifies and readers of the reference format ignore. A
    :class:`~omnikv.wire.mac.PayloadSeal` in ``metadata`` (at most one) is the KV MAC of the
    tensors written: computed in the same pass and written in its place.

    A plan is itself the writer a connector's ``put_packed`` takes: called with a tensor, or
    (:meth:`write_host`, the :class:`omnikv.connectors.base.HostArrayWriter` protocol) with a
    host slot as numpy, so a shared-memory connector need not make a torch view of its slot (a
    torch operator call, costly on a process that has just been idle).
    """

    def __init__(  # noqa: PLR0913 - one keyword per optional header extension
        self,
        request_id: str,
        key_cache: Sequence[TensorLike | None],
        value_cache: Sequence[TensorLike | None],
        block_ids: Sequence[int] = (),
        metadata: Mapping[str, Any] | None = None,
        *,
        checksum: bool = True,
        coded: Coded | None = None,
        stamp: Mapping[str, Any] | None = None,
        stream: Mapping[str, Any] | None = None,
    ) -> None:
        num_layers = len(key_cache)
        self._checksum = checksum
        self._coded = coded
        seals = find_seals(metadata) if metadata else []
        if len(seals) > 1:
            raise EncodeError(f"a payload carries at most one MAC seal, got {len(seals)}")
        self._seal: PayloadSeal | None = seals[0] if seals else None
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
        if stamp is not None:  # the sender's session, epoch and sequence (wire.format.Stamp)
            header["ss"] = dict(stamp)
        if coded is not None:  # the sources are coded rows (omnikv.wire.codec.encode_rows)
            header.update(v=CODEC_FORMAT_VERSION, cx=coded.codec, od=coded.original_dtype)
        if stream is not None:  # a piece of a streamed send: readers that predate it refuse it
            header.update(v=STREAM_FORMAT_VERSION, sm=dict(stream))
        # the layout's descriptors are encoded once per layout, then spliced in as the last key;
        # the data check's placeholder just before them, where it is filled in (no other key's
        # text, metadata included, can be taken for it)
        raw = encode_header(header)[:-1]
        self._check_at = -1
        if checksum:
            raw += b',"dc":"'
            self._check_at = 4 + len(raw)
            raw += DATA_CHECK_PLACEHOLDER.encode("ascii") + b'"'
        raw += b',"td":' + layout.td_json + b"}"
        self._seal_at = -1
        if self._seal is not None:
            mark = self._seal.placeholder.encode("ascii")
            if raw.count(mark) != 1:  # pragma: no cover - 128 random bits
                raise EncodeError("the MAC seal's placeholder is not once in the header")
            self._seal_at = 4 + raw.index(mark)
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
        """The 4-byte length plus the padded JSON header (without the data check filled in)."""
        return HEADER_LENGTH.pack(len(self._header)) + self._header

    def pack_into(self, buf: Any, offset: int = 0) -> int:
        """Write the payload into ``buf`` at ``offset``; return the bytes written (``nbytes``).

        ``buf`` is a 1-D ``uint8`` tensor (host or device) or any writable buffer. Each tensor is
        copied once, straight into its slot; padding gaps are zeroed so the data check is
        stable. Into host memory the check hashes each slot right after writing it (one pass
        over memory); into device memory the data section is copied to host for it. Raises
        ``ValueError`` if ``buf`` is too small.
        """
        if _is_byte_array(buf):  # a host slot handed over as numpy: no torch call at all
            self._check_room(buf.size, offset)
            self._pack_host(buf, None, offset)
            return self.nbytes
        out = as_byte_tensor(buf, writable=True)
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
        check = data_check(data) if self._checksum else None
        mac = None
        if self._seal is not None:  # a device buffer: hashed from a host copy of the data
            host_data = data.cpu().numpy()
            stream = self._seal.stream()
            for slot, src in zip(self._slots, self._sources, strict=True):
                if src is not None:
                    self._seal_slot(stream, slot, host_data)
            mac = stream.mac()
        _copy_bytes_in(region, self._final_header(check, mac))
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
        slot numpy cannot take, through torch. With the data check, each slot (and the zeroed
        gap before it) is hashed right after it is written, while it is still in the CPU's
        caches."""
        whole = array[offset : offset + self.nbytes]
        host = whole[self.data_start :]
        # slots are ALIGN-aligned within the data section, so its start decides for every
        # element size (<= 8 bytes)
        aligned = host.__array_interface__["data"][0] % 8 == 0
        data: torch.Tensor | None = None
        typed: _TypedBases | None = None
        hasher = data_hasher() if self._checksum else None
        stream = self._seal.stream() if self._seal is not None else None
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
            end = slot.offset + slot.nbytes
            if hasher is not None and end > prev_end:
                hasher.update(host[prev_end:end].data)
            if stream is not None:
                self._seal_slot(stream, slot, host)
            prev_end = end
        check = None
        if hasher is not None:
            if prev_end < self.data_nbytes:  # pragma: no cover - slots end the data section
                hasher.update(host[prev_end : self.data_nbytes].data)
            check = DATA_CHECK_PREFIX + str(hasher.hexdigest())
        header = self._final_header(check, None if stream is None else stream.mac())
        whole[: len(header)] = np.frombuffer(header, dtype=np.uint8)

    def _seal_slot(self, stream: Any, slot: _Slot, host: np.ndarray) -> None:
        """Feed the seal's MAC one written tensor: its bytes in the host data section ``host``,
        or, coded, the tensor the receiver decodes from them."""
        raw = host[slot.offset : slot.offset + slot.nbytes]
        dtype = DTYPE_ALLOWLIST[slot.dtype_name]
        if self._coded is None:
            stream.tensor(dtype, slot.shape, raw.data)
            return
        coded = torch.from_numpy(raw).view(dtype).view(slot.shape)
        plain = decode_rows(coded, self._coded.codec, DTYPE_ALLOWLIST[self._coded.original_dtype])
        stream.tensor(plain.dtype, plain.shape, tensor_bytes(plain))

    def _final_header(self, check: str | None, mac: str | None) -> bytes:
        """The length-prefixed header, with the data check ``check`` (the data section's
        :func:`~omnikv.wire.format.data_check`) and the seal's ``mac`` in their placeholders'
        places when asked (the seal then records its value)."""
        header = self.header_bytes
        for at, text in ((self._check_at, check), (self._seal_at, mac)):
            if text is not None:
                header = header[:at] + text.encode("ascii") + header[at + len(text) :]
        if mac is not None:
            assert self._seal is not None
            self._seal.settle(mac)
        return header

    def __call__(self, dst: Any) -> int:
        """Fill ``dst`` (exactly :attr:`nbytes`) as a connector's ``put_packed`` writer."""
        return self.pack_into(dst)

    def write_host(self, dst: np.ndarray) -> int:
        """Fill a host slot handed over as a 1-D ``uint8`` numpy array (``HostArrayWriter``)."""
        return self.pack_into(dst)

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


def _layout(num_layers: int, sources: Sequence[TensorLike | None]) -> _Layout:
    """The :class:`_Layout` of a payload whose K then V tensors are ``sources`` (the first
    ``num_layers`` are K), from the table of layouts (:func:`_lay_out`). Raises
    :class:`EncodeError` for a dtype the format has no name for."""
    sig: list[tuple[torch.dtype, tuple[int, ...]] | None] = []
    for src in sources:
        if src is None:
            sig.append(None)
            continue
        shape = src.shape
        if not getattr(src, "shape_is_ints", False):  # torch.Size, numpy ints: plain ints
            shape = tuple(map(int, shape))
        sig.append((src.dtype, shape))
    return _lay_out(num_layers, tuple(sig))


@functools.lru_cache(maxsize=_LAYOUTS_MAX)
def _lay_out(num_layers: int, sig: _Signature) -> _Layout:
    """Place every tensor of a payload: its slot, its header descriptor, the data length, and
    whether any tensor is large enough for page alignment. Memoised per distinct layout (a
    stage sends the same one request after request); a layout that raises is not kept."""
    slots: list[_Slot] = []
    td: list[dict[str, Any]] = []
    cursor = 0
    any_large = False
    for pos, entry in enumerate(sig):
        cache, idx = (CACHES[0], pos) if pos < num_layers else (CACHES[1], pos - num_layers)
        name = f"{cache}_{idx}"
        if entry is None:
            slots.append(_Slot(name, idx))
            td.append({"n": name, "x": True})
            continue
        dtype, shape = entry
        dname = DTYPE_TO_NAME.get(dtype)
        if dname is None:
            raise EncodeError(f"unsupported dtype {dtype} in {name}")
        nbytes = math.prod(shape) * ITEMSIZE[dname]
        align = PAGE if nbytes >= LARGE_TENSOR_BYTES else ALIGN
        any_large = any_large or align == PAGE
        cursor = _round_up(cursor, align)
        slots.append(_Slot(name, idx, dname, shape, cursor, nbytes))
        td.append({"n": name, "i": idx, "d": dname, "s": list(shape), "o": cursor, "b": nbytes})
        cursor += nbytes
    return _Layout(tuple(slots), encode_header(td), cursor, any_large)


def layout_cache_info() -> _CacheInfo:
    """Hits, misses, bound and size of the table of layouts (``functools.lru_cache``'s
    counters). A test hook, and a diagnostic: a stage whose misses keep growing sends payloads
    of ever new layouts."""
    return _lay_out.cache_info()


def clear_layout_cache() -> None:
    """Empty the table of layouts and reset its counters (a test hook)."""
    _lay_out.cache_clear()


# --------------------------------------------------------------------------------------------
# Writers
# --------------------------------------------------------------------------------------------
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
        itemsize = ITEMSIZE[name]
        return typed.as_strided(slot.shape, strides(slot.shape), origin + slot.offset // itemsize)

    def _make(self, name: str) -> tuple[torch.Tensor, int] | None:
        itemsize = ITEMSIZE[name]
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
    :data:`~omnikv.wire.format.LARGE_TENSOR_BYTES` or more, which torch copies faster (several
    threads, wide copies)."""
    if slot.nbytes >= LARGE_TENSOR_BYTES:
        return False
    itemsize = ITEMSIZE[slot.dtype_name]
    np_bits = BITS_NP.get(itemsize)
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
