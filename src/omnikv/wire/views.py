"""Zero-copy views of payload memory: buffers as bytes, spans as typed tensors.

:func:`as_byte_tensor` views any buffer (tensor, bytes, bytearray, memoryview, mmap, ndarray)
as a 1-D ``uint8`` tensor; the encoder writes through it and the decoder reads through it.
:class:`Viewer` and :class:`HostViewer` turn the validated spans of a data section
(:class:`~omnikv.wire.format.Span`) into tensors that alias it: one typed view per dtype, then
``as_strided`` per tensor, or one strided view per run of alike tensors. The tensors are valid as
long as the viewed memory is (for a connector buffer: until it is released), and keep the
tensor or array they view alive. :func:`copy_out` gives each span memory of its own instead.

A span whose address is not aligned for its dtype (a writer without alignment, such as the
reference) is copied to fresh, aligned memory rather than misread; spans do not overlap, so such
copies never exceed the data section. :func:`host_reader` and :func:`device_reader` read the
header bytes of a payload on the host or on a device. Called by :mod:`omnikv.wire.decode`
(everything) and :mod:`omnikv.wire.encode` (:func:`as_byte_tensor`, :func:`strides`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from omnikv.wire.format import BITS_NP, DTYPE_ALLOWLIST, ITEMSIZE, NUMPY_OF, Span

__all__ = [
    "HostViewer",
    "Run",
    "Viewer",
    "as_byte_tensor",
    "copy_out",
    "device_reader",
    "host_reader",
    "run_of",
    "strides",
]


def as_byte_tensor(buf: Any, *, writable: bool = False) -> torch.Tensor:
    """View ``buf`` (tensor, bytes, bytearray, memoryview, mmap, ndarray) as 1-D uint8.

    A tensor must already be 1-D, contiguous ``uint8``; anything else is viewed through the
    buffer protocol, without a copy. Raises ``ValueError`` saying what is wrong with ``buf``
    (and, with ``writable``, when it is read-only).
    """
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


def strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Element strides of a contiguous tensor of ``shape`` (a zero dim counts as 1)."""
    out = [1] * len(shape)
    for k in range(len(shape) - 2, -1, -1):
        out[k] = out[k + 1] * max(shape[k + 1], 1)
    return tuple(out)


# --------------------------------------------------------------------------------------------
# Runs: spans viewed together
# --------------------------------------------------------------------------------------------
class Run(NamedTuple):
    """Spans that are ``n`` tensors of one numpy-typed dtype and shape, back to back from
    ``offset``: viewed as one array, split into rows (:meth:`HostViewer.views`)."""

    offset: int
    n: int
    dtype_name: str
    shape: tuple[int, ...]
    nbytes: int  # of one tensor


def run_of(spans: Sequence[Span]) -> Run | None:
    """The :class:`Run` the spans form, or ``None``. Every layer's K and V alike, as omnikv's
    encoder writes them for a model of one head count and dtype, form one."""
    if len(spans) < 2:
        return None
    first = spans[0]
    if first.dtype_name not in NUMPY_OF or not first.nbytes:
        return None
    for i, span in enumerate(spans):
        if (
            span.dtype_name != first.dtype_name
            or span.shape != first.shape
            or span.offset != first.offset + i * first.nbytes
        ):
            return None
    return Run(first.offset, len(spans), first.dtype_name, first.shape, first.nbytes)


def _run_length(spans: list[Span], i: int) -> int:
    """How many spans from ``i`` on share dtype and shape and follow each other at one step."""
    first, j = spans[i], i + 1
    if j == len(spans) or first.nbytes == 0:
        return 1
    step = spans[j].offset - first.offset
    if step < first.nbytes or step % ITEMSIZE[first.dtype_name]:
        return 1
    while (
        j < len(spans)
        and spans[j].dtype_name == first.dtype_name
        and spans[j].shape == first.shape
        and spans[j].offset - spans[j - 1].offset == step
    ):
        j += 1
    return j - i


# --------------------------------------------------------------------------------------------
# Viewers
# --------------------------------------------------------------------------------------------
class Viewer:
    """Makes tensor views of a byte tensor: one typed view per dtype, then ``as_strided``.

    Spans of one dtype and shape at a constant step (every layer of a model) become one strided
    view that ``unbind`` splits, which is what makes decoding cheap. A span whose address is not
    aligned for its dtype (legacy writers have no alignment) is copied to fresh memory; spans do
    not overlap, so those copies never exceed the data section. Used by
    :func:`omnikv.wire.decode.decode_kv` for tensors on any device.
    """

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data
        self._ptr = data.data_ptr()
        self._typed: dict[str, tuple[torch.Tensor, int] | None] = {}

    def _typed_view(self, name: str) -> tuple[torch.Tensor, int] | None:
        if name not in self._typed:
            itemsize = ITEMSIZE[name]
            lead = -self._ptr % itemsize
            usable = (self.data.numel() - lead) // itemsize * itemsize
            try:
                typed = self.data[lead : lead + usable].view(DTYPE_ALLOWLIST[name])
                self._typed[name] = (typed, int(typed.storage_offset()) - lead // itemsize)
            except RuntimeError:  # storage itself misaligned: per-tensor copies instead
                self._typed[name] = None
        return self._typed[name]

    def views(self, spans: list[Span]) -> list[torch.Tensor]:
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

    def _run(self, first: Span, count: int, step: int) -> tuple[torch.Tensor, ...]:
        itemsize = ITEMSIZE[first.dtype_name]
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
        shape, steps = (count, *first.shape), (step // itemsize, *strides(first.shape))
        return base.as_strided(shape, steps, origin + first.offset // itemsize).unbind(0)

    def _one(self, span: Span) -> torch.Tensor:
        dtype = DTYPE_ALLOWLIST[span.dtype_name]
        if span.nbytes == 0:
            return torch.empty(span.shape, dtype=dtype, device=self.data.device)
        itemsize = ITEMSIZE[span.dtype_name]
        typed = (
            self._typed_view(span.dtype_name) if (self._ptr + span.offset) % itemsize == 0 else None
        )
        if typed is None:
            chunk = self.data[span.offset : span.offset + span.nbytes].clone()
            return chunk.view(dtype).view(span.shape)
        base, origin = typed
        return base.as_strided(span.shape, strides(span.shape), origin + span.offset // itemsize)


class HostViewer(Viewer):
    """:class:`Viewer` over a host payload given as a numpy array: the typed bases are numpy
    views turned into tensors with one ``from_numpy`` each (bf16 and fp8, which numpy lacks,
    through same-size integers and a torch ``view``), so decoding makes no torch slice. The
    tensors keep ``array`` (and whatever owns it) alive. Used by
    :func:`omnikv.wire.decode.decode_kv` for a 1-D ``uint8`` array (the shared-memory
    receiver's path)."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array
        self._ptr = int(array.__array_interface__["data"][0])
        self._typed = {}

    def _typed_view(self, name: str) -> tuple[torch.Tensor, int] | None:
        if name not in self._typed:
            itemsize = ITEMSIZE[name]
            lead = -self._ptr % itemsize
            usable = (self.array.size - lead) // itemsize * itemsize
            raw = self.array[lead : lead + usable]
            np_type = NUMPY_OF.get(name)
            bits = BITS_NP.get(itemsize)
            if np_type is not None:
                typed = torch.from_numpy(raw.view(np_type))
            elif bits is not None:
                typed = torch.from_numpy(raw.view(bits)).view(DTYPE_ALLOWLIST[name])
            else:  # pragma: no cover - every allowed dtype is one of the two
                self._typed[name] = None
                return None
            self._typed[name] = (typed, -(lead // itemsize))
        return self._typed[name]

    def views(self, spans: list[Span], run: Run | None = None) -> list[torch.Tensor]:
        """One tensor per span, in order. Spans of a dtype numpy has, aligned and not empty,
        are shaped in numpy and handed over with one ``from_numpy`` each: that path makes no
        torch operator call (no dispatcher), which on a process that has just been idle costs
        several times less than a strided view and an ``unbind``. Spans that form a ``run``
        (:func:`run_of`: every layer's K and V alike, back to back, the common case) are
        shaped with one numpy view for all. Any other span goes the :class:`Viewer` way."""
        out: list[torch.Tensor] = []
        array, ptr = self.array, self._ptr
        if run is not None and not (ptr + run.offset) % ITEMSIZE[run.dtype_name]:
            end = run.offset + run.n * run.nbytes
            rows = array[run.offset : end].view(NUMPY_OF[run.dtype_name])
            return [torch.from_numpy(row) for row in rows.reshape(run.n, *run.shape)]
        for i, span in enumerate(spans):
            np_type = NUMPY_OF.get(span.dtype_name)
            if (
                np_type is None
                or not span.nbytes
                or (ptr + span.offset) % ITEMSIZE[span.dtype_name]
            ):
                return out + super().views(spans[i:])
            chunk = array[span.offset : span.offset + span.nbytes].view(np_type)
            out.append(torch.from_numpy(chunk.reshape(span.shape)))
        return out

    def _one(self, span: Span) -> torch.Tensor:
        if span.nbytes == 0:
            return torch.empty(span.shape, dtype=DTYPE_ALLOWLIST[span.dtype_name])
        typed = self._typed_view(span.dtype_name)
        itemsize = ITEMSIZE[span.dtype_name]
        if typed is None or (self._ptr + span.offset) % itemsize:
            chunk = torch.from_numpy(self.array[span.offset : span.offset + span.nbytes].copy())
            return chunk.view(DTYPE_ALLOWLIST[span.dtype_name]).view(span.shape)
        base, origin = typed
        return base.as_strided(span.shape, strides(span.shape), origin + span.offset // itemsize)


def copy_out(data: torch.Tensor, spans: list[Span]) -> list[torch.Tensor]:
    """Every span copied into a fresh tensor of its own (in all at most the data section), on
    ``data``'s device; ``decode_kv(copy=True)``'s tensors, so the caller may reuse the buffer.

    One allocation per tensor rather than one payload-sized block per request: whether a copy
    lands on fresh pages (a fault per page) depends on the C allocator's thresholds, which a
    payload-sized block crosses far more often than a tensor-sized one. (A pool recycled across
    requests would avoid the faults, at the price of knowing when the caller lets go of a copy.)
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


def host_reader(t: torch.Tensor) -> tuple[bytes, Callable[[int, int], Any]]:
    """The first 4 bytes of a host payload, and a reader of ``n`` bytes from ``start`` (a
    memoryview slice: no copy)."""
    mv = t.numpy().data if t.numel() else memoryview(b"")
    return bytes(mv[:4]), lambda start, n: mv[start : start + n]


def device_reader(t: torch.Tensor) -> tuple[bytes, Callable[[int, int], Any]]:
    """:func:`host_reader` for a payload on a device: each read is one small device-to-host
    copy (the header only; the data section stays where it is)."""

    def read(start: int, n: int) -> bytes:
        return t[start : start + n].cpu().numpy().tobytes()

    return read(0, 4), read
