"""A page-aligned, pre-faulted host buffer and a first-fit allocator over it.

:class:`BufferAllocator` is omnikv's one allocator: the shared-memory connector uses it over its
memfd pool, the Mooncake connectors over a :class:`HostPool`.

Used by the Mooncake connectors (and any transport that registers one big region with an engine
once and then hands out slots): the region is an anonymous ``mmap`` (page-aligned by
construction), touched once at start-up so no page fault lands on the hot path, and exposed as a
1-D ``uint8`` tensor. :class:`BufferAllocator` hands out offsets into it.

Ownership: the connector that creates a :class:`HostPool` registers ``pool.address`` /
``pool.size`` with its engine, unregisters before :meth:`HostPool.close`, and is the only caller
of ``close``. Slots are returned by :meth:`BufferAllocator.free` exactly once (double frees are
ignored with a warning; a partial overlap is a bug and raises ``RuntimeError``).
"""

from __future__ import annotations

import bisect
import logging
import mmap
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from omnikv.deadline import remaining
from omnikv.errors import ConnectorClosedError, PoolExhaustedError

__all__ = ["ALIGNMENT", "BufferAllocator", "HostPool"]

logger = logging.getLogger(__name__)

ALIGNMENT = 4096


def _round_up(value: int, align: int) -> int:
    return (value + align - 1) // align * align


class BufferAllocator:
    """Thread-safe first-fit allocator over ``[0, total)``; sizes rounded up to ``alignment``.

    ``alloc`` raises :class:`~omnikv.errors.PoolExhaustedError` (a ``ConnectorError``; callers of
    the reference API may also catch ``MemoryError`` through :meth:`try_alloc`) when nothing fits
    before the deadline; it waits on a condition woken by ``free`` (no polling). The free list is
    kept sorted by offset with neighbours merged.
    """

    def __init__(self, total: int, alignment: int = ALIGNMENT) -> None:
        if total <= 0:
            raise ValueError(f"pool size must be > 0 bytes, got {total}")
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        self.total = total // alignment * alignment
        if self.total == 0:
            raise ValueError(f"pool size {total} is smaller than the alignment {alignment}")
        self.alignment = alignment
        self._starts: list[int] = [0]
        self._sizes: list[int] = [self.total]
        self._used: dict[int, int] = {}
        self._cond = threading.Condition()
        self._closed = False

    @property
    def used_bytes(self) -> int:
        with self._cond:
            return sum(self._used.values())

    @property
    def allocations(self) -> int:
        with self._cond:
            return len(self._used)

    def block_size(self, nbytes: int) -> int:
        """The reserved size for a request of ``nbytes`` (rounded up; at least one unit)."""
        return max(_round_up(nbytes, self.alignment), self.alignment)

    def largest_free(self) -> int:
        with self._cond:
            return max(self._sizes, default=0)

    def close(self) -> None:
        """Wake every waiting ``alloc``; they (and later ones) raise ``ConnectorClosedError``."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _take(self, size: int) -> int | None:
        for i, avail in enumerate(self._sizes):
            if avail >= size:
                start = self._starts[i]
                if avail == size:
                    del self._starts[i]
                    del self._sizes[i]
                else:
                    self._starts[i] = start + size
                    self._sizes[i] = avail - size
                self._used[start] = size
                return start
        return None

    def _take_or_raise(self, size: int, deadline: float) -> int | None:
        """One attempt under the lock: the offset, ``None`` to wait, or raise."""
        if self._closed:
            raise ConnectorClosedError("the pool is closed")
        start = self._take(size)
        if start is not None:
            return start
        if (remaining(deadline) if deadline else 0.0) <= 0:
            free = sum(self._sizes)
            raise PoolExhaustedError(
                f"no {size}-byte slot in the pool ({free} of {self.total} bytes free, "
                f"{len(self._used)} slots in use)"
            )
        return None

    def alloc(
        self,
        nbytes: int,
        *,
        deadline: float = 0.0,
        on_wait: Callable[[int], object] | None = None,
    ) -> tuple[int, int]:
        """Reserve ``nbytes`` (rounded up); returns ``(offset, reserved_size)``.

        Blocks on a condition woken by :meth:`free` (no polling) until ``deadline`` (absolute
        monotonic; ``0.0``: do not wait) and then raises :class:`PoolExhaustedError`; raises
        ``ConnectorClosedError`` once :meth:`close` was called. A request larger than the pool
        fails at once. ``on_wait(size)`` is called once, without the lock held, before the
        first wait (a caller's chance to ask holders of space to give it back).
        """
        if nbytes <= 0:
            raise ValueError(f"allocation size must be > 0 bytes, got {nbytes}")
        size = _round_up(nbytes, self.alignment)
        if size > self.total:
            raise PoolExhaustedError(f"{nbytes} bytes requested, the pool holds {self.total}")
        with self._cond:
            start = self._take_or_raise(size, deadline)
        if start is not None:
            return start, size
        if on_wait is not None:
            on_wait(size)
        with self._cond:
            while True:
                start = self._take_or_raise(size, deadline)
                if start is not None:
                    return start, size
                self._cond.wait(timeout=min(remaining(deadline), 3600.0))

    def try_alloc(self, nbytes: int) -> int:
        """Reference-shaped allocation: the offset, or ``MemoryError`` when nothing fits."""
        try:
            return self.alloc(nbytes)[0]
        except PoolExhaustedError as exc:
            raise MemoryError(str(exc)) from exc

    def free(self, offset: int) -> None:
        """Return the slot that starts at ``offset``; wakes waiting ``alloc`` calls."""
        with self._cond:
            size = self._used.pop(offset, None)
            if size is None:
                i = bisect.bisect_right(self._starts, offset) - 1
                if i >= 0 and offset < self._starts[i] + self._sizes[i]:
                    logger.warning("double free of pool offset %d ignored", offset)
                    return
                raise RuntimeError(f"free of unknown pool offset {offset}")
            i = bisect.bisect_left(self._starts, offset)
            self._starts.insert(i, offset)
            self._sizes.insert(i, size)
            # merge with the right neighbour, then with the left one
            if i + 1 < len(self._starts) and offset + size == self._starts[i + 1]:
                self._sizes[i] += self._sizes[i + 1]
                del self._starts[i + 1]
                del self._sizes[i + 1]
            if i > 0 and self._starts[i - 1] + self._sizes[i - 1] == offset:
                self._sizes[i - 1] += self._sizes[i]
                del self._starts[i]
                del self._sizes[i]
            self._cond.notify_all()

    def free_bytes(self) -> int:
        with self._cond:
            return sum(self._sizes)


class HostPool:
    """One anonymous, page-aligned, pre-faulted host region with an allocator.

    Built by a connector at start-up (the page touch costs about 5 us per 4 KiB page, once).
    ``tensor`` is a 1-D ``uint8`` view of the whole region; ``slot(offset, n)`` a view of part of
    it. ``close`` drops the views and unmaps; the caller must have unregistered the region first.
    """

    def __init__(self, size: int, alignment: int = ALIGNMENT) -> None:
        size = _round_up(max(int(size), alignment), mmap.PAGESIZE)
        self._mm: mmap.mmap | None = mmap.mmap(
            -1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        )
        self.size = size
        arr = np.frombuffer(self._mm, dtype=np.uint8)
        self.address = int(arr.ctypes.data)
        arr[:: mmap.PAGESIZE] = 0  # pre-fault every page
        self._tensor: torch.Tensor | None = torch.from_numpy(arr)
        self.allocator = BufferAllocator(size, alignment)
        self.created = time.monotonic()

    @property
    def tensor(self) -> torch.Tensor:
        t = self._tensor
        if t is None:
            raise RuntimeError("the pool is closed")
        return t

    def slot(self, offset: int, nbytes: int) -> torch.Tensor:
        """A zero-copy view of ``nbytes`` at ``offset``."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise ValueError(
                f"slot [{offset}, {offset + nbytes}) outside the {self.size}-byte pool"
            )
        return self.tensor[offset : offset + nbytes]

    def close(self) -> None:
        """Unmap the region. Idempotent. Views still alive keep the mapping until they die."""
        mm = self._mm
        self._mm = None
        self._tensor = None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                # a tensor view outlived the connector; the mapping goes when that view dies
                logger.debug("pool views still alive at close; the mapping outlives the pool")

    @property
    def closed(self) -> bool:
        return self._mm is None

    def __repr__(self) -> str:
        used = self.allocator.used_bytes
        return f"HostPool({self.size} bytes at {self.address:#x}, {used} used)"
