"""Decoding KV payloads: validation of hostile input, then zero-copy views.

:func:`decode_kv` returns a typed :class:`DecodedKV` of zero-copy views: the tensors alias the
input buffer and are valid only as long as it is (for a connector buffer: until it is
released); ``copy=True`` copies each into fresh memory of its own (no more than the data section
in all). The seed's dict is :meth:`DecodedKV.to_seed_dict` (:func:`decode` and
:func:`decode_device` return it). Called by the receiver, the intra-stage frames and the seed's
``KVCacheTransferData.from_bytes*``.

The decoder treats its input as hostile. Before anything proportional to a claimed size is
allocated it checks: the header length (``max_header_bytes``, 1 MiB by default), the header's
types (a typed msgspec decoder), ``nl`` <= :data:`~omnikv.wire.format.MAX_LAYERS`, at most two
descriptors per layer, allowlisted dtypes, shapes of at most
:data:`~omnikv.wire.format.MAX_DIMS` non-negative dims and
:data:`~omnikv.wire.format.MAX_ELEMENTS` elements (zero dims do not hide huge others), spans
inside the data section (``dl`` when given) whose length matches the shape, no two spans sharing
a byte (K and V at the same bytes included), no duplicate layers. Every failure is a
:class:`~omnikv.errors.DecodeError` (a ``ValueError``) that says what was expected, what was
found and where.

Alignment: a payload carrying ``al`` (omnikv's writers) must place every tensor on a multiple of
its element size, or it is refused. A payload without ``al`` (the reference writes no padding) is
accepted, and a tensor whose bytes are not aligned for its dtype is copied to aligned memory
(:mod:`omnikv.wire.views`).

A piece of a streamed send (format version 3, header ``sm``: a chunk or the tail that is its
manifest) decodes like any payload and says so in :attr:`DecodedKV.stream`; assembling the
pieces is the receiver's (:mod:`omnikv.transfer.stream`). A reader that predates version 3
refuses such a piece, so a tail is never taken for a whole request's KV.

A payload that carries the data check ``dc`` (omnikv's writers, by default), or the crc32
``ck`` of older writers, has it verified against the data section before any view is made
(unless ``verify=False``): a mismatch, or a check of a form this reader does not know, is a
:class:`~omnikv.errors.DecodeError` (the receiver's ``corrupt``). It detects corruption, not
tampering.

A stage receives the same layout request after request, so the spans of a validated layout are
kept in a bounded table (:func:`span_cache_info`), keyed by everything their validation read.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
import torch

from omnikv.errors import DecodeError
from omnikv.wire.codec import CODEC_FORMAT_VERSION, CODECS, decode_rows
from omnikv.wire.format import (
    CACHES,
    CHECKSUM_PLACEHOLDER,
    CHECKSUM_PREFIX,
    DATA_CHECK_PLACEHOLDER,
    DATA_CHECK_PREFIX,
    DEFAULT_MAX_HEADER_BYTES,
    DTYPE_ALLOWLIST,
    HEADER_DECODER,
    HEADER_LENGTH,
    ITEMSIZE,
    MAX_DIMS,
    MAX_ELEMENTS,
    MAX_LAYERS,
    PAGE,
    STREAM_FORMAT_VERSION,
    Header,
    Span,
    Stamp,
    StreamMark,
    TensorDesc,
    crc32,
    data_check,
)
from omnikv.wire.views import (
    HostViewer,
    Run,
    Viewer,
    as_byte_tensor,
    copy_out,
    device_reader,
    host_reader,
    run_of,
)

if TYPE_CHECKING:
    from functools import _CacheInfo

__all__ = [
    "DecodedKV",
    "clear_span_cache",
    "decode",
    "decode_device",
    "decode_kv",
    "span_cache_info",
]

#: Most validated layouts kept (least recently used out first).
_SPANS_MAX = 256


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
    #: The sender's stamp (header ``ss``), when it wrote one.
    stamp: Stamp | None = None
    #: Which piece of a streamed send this is (header ``sm``; ``None``: a whole send).
    stream: StreamMark | None = None

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


# --------------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------------
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
    all at most the data section) and ``buffer`` may be reused at once. ``verify`` checks the
    data check (``dc``, or an older writer's ``ck``) when the payload carries one. Every
    malformed input raises :class:`DecodeError` before anything proportional to a claimed size
    is allocated.
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
        t = as_byte_tensor(buffer)
    except ValueError as exc:
        raise _fail(str(exc)) from exc
    head4, read = host_reader(t) if t.device.type == "cpu" else device_reader(t)
    header, hlen = _read_header(head4, t.numel(), read, max_header_bytes)
    data_len = _check_header(header, t.numel() - 4 - hlen)
    data = t[4 + hlen : 4 + hlen + data_len]
    spans, _run = _spans_and_run(header, data_len)
    if verify:
        _verify_checks(header, data)
    tensors = copy_out(data, spans) if copy else Viewer(data).views(spans)
    return _assemble(header, spans, tensors)


def _decode_array(array: np.ndarray, verify: bool, max_header_bytes: int) -> DecodedKV:
    """:func:`decode_kv` of a host payload in a 1-D ``uint8`` numpy array, as views of it.

    The receiver's hot path (an adopted pool span): the same checks in the same order, with
    the header read and the data section sliced in numpy (see :class:`HostViewer`).
    """
    mv = array.data
    header, hlen = _read_header(
        bytes(mv[:4]), array.size, lambda start, n: mv[start : start + n], max_header_bytes
    )
    data_len = _check_header(header, array.size - 4 - hlen)
    data = array[4 + hlen : 4 + hlen + data_len]
    spans, run = _spans_and_run(header, data_len)
    if verify:
        _verify_checks(header, data)
    tensors = HostViewer(data).views(spans, run)
    return _assemble(header, spans, tensors)


def _assemble(header: Header, spans: list[Span], tensors: list[torch.Tensor]) -> DecodedKV:
    if header.cx is not None:  # checked by _check_header: a known codec and a float dtype
        dtype = DTYPE_ALLOWLIST[str(header.od)]
        tensors = [decode_rows(t, header.cx, dtype) for t in tensors]
    caches: tuple[list[torch.Tensor | None], list[torch.Tensor | None]] = (
        [None] * header.nl,
        [None] * header.nl,
    )
    for span, tensor in zip(spans, tensors, strict=True):
        caches[span.cache][span.layer] = tensor
    return DecodedKV(
        header.rid, header.bids, header.meta, caches[0], caches[1], header.ss, header.sm
    )


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
# The header
# --------------------------------------------------------------------------------------------
def _fail(msg: str) -> DecodeError:
    return DecodeError(f"corrupt KV payload: {msg}")


def _fail_at(pos: int, msg: str) -> DecodeError:
    return _fail(f"td[{pos}]: {msg}")


def _read_header(
    head4: bytes, total: int, read: Callable[[int, int], Any], max_header_bytes: int
) -> tuple[Header, int]:
    """The typed header and its length, from a payload of ``total`` bytes whose first 4 are
    ``head4``; ``read(start, n)`` gives bytes of the payload. The length is checked against
    ``max_header_bytes`` and the buffer before the header is read."""
    if total < 4 or len(head4) < 4:
        raise _fail(f"missing 4-byte header length (buffer has {total} bytes)")
    (hlen,) = HEADER_LENGTH.unpack(head4[:4])
    if hlen > max_header_bytes:
        raise _fail(f"header_len={hlen} exceeds the limit of {max_header_bytes} bytes")
    if hlen > total - 4:
        raise _fail(f"header_len={hlen} exceeds buffer size {total} - 4")
    try:
        header = HEADER_DECODER.decode(read(4, hlen))
    except RecursionError as exc:
        raise _fail("header JSON is nested too deeply") from exc
    except msgspec.ValidationError as exc:
        raise _fail(f"header: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise _fail(f"header is not valid UTF-8 JSON ({exc})") from exc
    return header, hlen


def _check_header(header: Header, available: int) -> int:
    """Header-level checks; returns the length of the data section."""
    if not 0 <= header.nl <= MAX_LAYERS:
        raise _fail(f"nl={header.nl} outside [0, {MAX_LAYERS}]")
    if len(header.td) > 2 * MAX_LAYERS:
        raise _fail(f"td has {len(header.td)} entries, more than {2 * MAX_LAYERS}")
    streamed = header.v == STREAM_FORMAT_VERSION
    if header.sm is None and not 0 <= header.v < STREAM_FORMAT_VERSION:
        raise _fail(
            f"unsupported format version {header.v} (this reader knows <= "
            f"{CODEC_FORMAT_VERSION}, and {STREAM_FORMAT_VERSION} for a streamed send's pieces)"
        )
    if header.sm is not None and not streamed:
        raise _fail(f"stream mark with format version {header.v}")
    if not streamed and (header.v == CODEC_FORMAT_VERSION) != (header.cx is not None):
        raise _fail(f"format version {header.v} with wire codec {header.cx!r:.40}")
    if header.cx is not None:
        if header.cx not in CODECS:
            raise _fail(f"unknown wire codec {header.cx!r:.40}; this reader knows {CODECS}")
        if header.od not in ("float16", "bfloat16", "float32"):
            raise _fail(f"wire codec {header.cx} with original dtype {header.od!r:.40}")
    if header.bo != sys.byteorder:
        raise _fail(f"payload byte order {header.bo!r} differs from this machine's {sys.byteorder}")
    if header.al is not None and not (0 < header.al <= PAGE and header.al & (header.al - 1) == 0):
        raise _fail(f"al={header.al} is not a power of two in [1, {PAGE}]")
    if header.dl is None:
        return available
    if not 0 <= header.dl <= available:
        raise _fail(f"dl={header.dl} outside the {available} bytes after the header")
    return header.dl


def _verify_checks(header: Header, data: torch.Tensor | np.ndarray) -> None:
    """The data section against each check the header carries (``dc``, an older ``ck``)."""
    if header.dc is not None:
        _verify_data_check(header.dc, data)
    if header.ck is not None:
        _verify_checksum(header.ck, data)


def _verify_data_check(dc: str, data: torch.Tensor | np.ndarray) -> None:
    if not dc.startswith(DATA_CHECK_PREFIX) or len(dc) != len(DATA_CHECK_PLACEHOLDER):
        raise _fail(f"data check of an unknown form {dc!r:.40} (this reader knows xxh3)")
    got = data_check(data)
    if got != dc:
        raise _fail(f"data check mismatch: header says {dc[5:]}, data has {got[5:]}")


def _verify_checksum(ck: str, data: torch.Tensor | np.ndarray) -> None:
    if not ck.startswith(CHECKSUM_PREFIX) or len(ck) != len(CHECKSUM_PLACEHOLDER):
        raise _fail(f"malformed checksum field {ck!r:.40}")
    try:
        want = int(ck[len(CHECKSUM_PREFIX) :], 16)
    except ValueError as exc:
        raise _fail(f"malformed checksum field {ck!r:.40}") from exc
    got = crc32(data)
    if got != want:
        raise _fail(f"data checksum mismatch: header says {want:08x}, data has {got:08x}")


# --------------------------------------------------------------------------------------------
# Spans
# --------------------------------------------------------------------------------------------
def _spans_and_run(header: Header, data_len: int) -> tuple[list[Span], Run | None]:
    """Every KV tensor's span, validated (in the data section, no overlap, no duplicates), and
    the :class:`~omnikv.wire.views.Run` they form (if any), from the table of validated
    layouts (:func:`_validated`)."""
    spans, run = _validated(tuple(header.td), header.nl, header.al is not None, data_len)
    return list(spans), run


@functools.lru_cache(maxsize=_SPANS_MAX)
def _validated(
    td: tuple[TensorDesc, ...], nl: int, aligned: bool, data_len: int
) -> tuple[tuple[Span, ...], Run | None]:
    """The validated spans of descriptors ``td`` and the run they form.

    A stage receives the same layout request after request (only the lengths change with the
    prompt), so the outcome of a successful validation is kept, keyed by every input it read:
    the descriptors (compared field by field), ``nl``, whether ``al`` is present and the data
    length. A payload whose descriptors differ in any way is validated afresh; failures raise
    and are never kept. The table is bounded (least recently used out first), so a peer varying
    its headers only costs itself the validation."""
    spans = []
    taken = [False] * (2 * nl)
    for pos, entry in enumerate(td):
        span = _span_of(entry, pos, nl, data_len, aligned)
        if span is None:
            continue
        slot = span.cache * nl + span.layer
        if taken[slot]:
            raise _fail_at(pos, f"duplicate tensor for {CACHES[span.cache]}_{span.layer}")
        taken[slot] = True
        spans.append(span)
    _check_disjoint(spans)
    return tuple(spans), run_of(spans)


def span_cache_info() -> _CacheInfo:
    """Hits, misses, bound and size of the table of validated layouts
    (``functools.lru_cache``'s counters). A test hook, and a diagnostic: a receiver whose
    misses keep growing gets payloads of ever new layouts."""
    return _validated.cache_info()


def clear_span_cache() -> None:
    """Empty the table of validated layouts and reset its counters (a test hook)."""
    _validated.cache_clear()


def _span_of(e: TensorDesc, pos: int, nl: int, data_len: int, aligned: bool) -> Span | None:
    """``td[pos]`` checked: its dtype, span, shape and layer; ``None`` for an absent layer and
    for a tensor that is not a KV layer (the reference ignores such names; so do we)."""
    if e.x:
        _layer_of(e.n, None, pos, nl)
        return None
    dname = e.d
    itemsize = ITEMSIZE.get(dname) if dname is not None else None
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
        return None
    return Span(pos, cache, layer, dname, tuple(e.s), o, b)


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


def _check_disjoint(spans: list[Span]) -> None:
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
