"""CUDA staging for the prefetch worker: host -> device copies on a side stream, the free-memory
guard, and stream bookkeeping at hand-over.

Who calls what: :class:`~omnikv.transfer.prefetch.KVPrefetcher` owns one :class:`PinnedStager`
and uses it from its worker thread only (:meth:`PinnedStager.side_stream`,
:meth:`PinnedStager.to_device`); it asks :func:`device_memory_ok` before queueing a prefetch for
a device and calls :func:`record_stream_for` on the consumer's thread when it hands the KV over.

Why: the receive of request N+1 overlaps the forward of request N, so its device copy must not
run on the consumer's stream, must not stall the CPU on pageable memory, and must not let the
caching allocator reuse the copied tensors while the consumer's stream may still read them. On
machines without CUDA nothing here touches the driver: host targets skip every step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from omnikv.transfer.received import ReceivedKV

__all__ = ["MemInfo", "PinnedStager", "device_memory_ok", "record_stream_for"]

logger = logging.getLogger(__name__)

#: ``(device) -> (free_bytes, total_bytes)``, as ``torch.cuda.mem_get_info``.
MemInfo = Callable[[torch.device], tuple[int, int]]


def record_stream_for(kv: ReceivedKV | None) -> int:
    """``record_stream(current stream)`` on every device tensor of ``kv``; returns the count.

    Called on the consumer's thread at consume time: tensors born on the prefetch side stream are
    then not reused by the allocator while the consumer's stream may still use them. Host
    tensors are skipped (a no-op on CPU-only machines).
    """
    if kv is None or not torch.cuda.is_available():
        return 0
    n = 0
    for t in kv.tensors():
        if t.device.type == "cuda":
            t.record_stream(torch.cuda.current_stream(t.device))
            n += 1
    return n


def device_memory_ok(
    device: torch.device | str | None, ratio: float, mem_info: MemInfo | None = None
) -> bool:
    """False iff ``ratio > 0`` and the device's free/total memory is below ``ratio``.

    Host targets, ``ratio <= 0``, a failing query and ``total <= 0`` all count as enough memory
    (the reference's rule). ``mem_info`` defaults to ``torch.cuda.mem_get_info``.
    """
    if ratio <= 0 or device is None:
        return True
    dev = torch.device(device)
    if dev.type == "cpu":
        return True
    query: MemInfo = mem_info if mem_info is not None else torch.cuda.mem_get_info
    try:
        free, total = query(dev)
    except Exception as exc:  # no driver, bad index: the guard cannot judge, so it allows
        logger.debug("Free-memory query for %s failed (%s); assuming enough", dev, exc)
        return True
    if total <= 0:
        return True
    return free / total >= ratio


class PinnedStager:
    """Host -> device copies through two reusable pinned chunks, on a side stream per device.

    Used by one thread (the prefetch worker), so the chunks and streams need no lock. The CPU
    memcpy of chunk ``k + 1`` overlaps the DMA of chunk ``k``; an event per chunk guards its
    reuse. Nothing is allocated until the first device copy: no pinned memory and no stream on
    host-only runs.
    """

    def __init__(self, chunk_bytes: int = 32 << 20) -> None:
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        self._chunks: list[torch.Tensor] = []
        self._events: list[Any] = [None, None]
        self._streams: dict[int, Any] = {}

    @property
    def pinned_bytes(self) -> int:
        """Pinned host memory held for staging (0 until the first chunked device copy)."""
        return sum(int(c.numel()) for c in self._chunks)

    @property
    def side_streams(self) -> int:
        """Side streams made so far (one per target device)."""
        return len(self._streams)

    def side_stream(self, device: torch.device) -> Any:
        """The side stream of ``device`` (made on first use; never the default stream)."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        stream = self._streams.get(index)
        if stream is None:
            stream = torch.cuda.Stream(device=index)  # type: ignore[no-untyped-call]
            self._streams[index] = stream
        return stream

    def _ensure(self) -> None:
        if not self._chunks:
            self._chunks = [
                torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)
            ]

    def copy(self, t: torch.Tensor, device: torch.device, stream: Any) -> torch.Tensor:
        """A copy of host tensor ``t`` on ``device``, enqueued on ``stream`` (not yet synced)."""
        out = torch.empty(t.shape, dtype=t.dtype, device=device)
        n = t.numel() * t.element_size()
        if n == 0:
            return out
        src = t.contiguous().reshape(-1).view(torch.uint8)
        dst = out.reshape(-1).view(torch.uint8)
        if src.is_pinned():
            dst.copy_(src, non_blocking=True)
            return out
        self._ensure()
        for k, off in enumerate(range(0, n, self.chunk_bytes)):
            m = min(self.chunk_bytes, n - off)
            i = k % 2
            ev = self._events[i]
            if ev is not None:
                ev.synchronize()
            chunk = self._chunks[i][:m]
            chunk.copy_(src[off : off + m])
            dst[off : off + m].copy_(chunk, non_blocking=True)
            ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ev.record(stream)
            self._events[i] = ev
        return out

    def to_device(self, kv: ReceivedKV, device: torch.device, stream: Any) -> ReceivedKV:
        """``kv`` with every host tensor copied to ``device``; ``stream`` is synchronised.

        Raises whatever the copy raises (e.g. ``torch.OutOfMemoryError``); ``kv`` is unchanged.
        """
        moved: dict[int, torch.Tensor] = {}
        for t in kv.tensors():
            if t.device.type == "cpu" and id(t) not in moved:
                moved[id(t)] = self.copy(t, device, stream)
        stream.synchronize()
        return kv.map_tensors(lambda t: moved.get(id(t), t))
