"""Shared-memory pools for :mod:`omnikv.connectors.shm`: an anonymous memfd and its allocator.

A sender owns one :class:`SenderPool`: a ``memfd_create`` file (it has no name in ``/dev/shm`` or
anywhere else, so a SIGKILL cannot leak it: the kernel frees the memory when the last descriptor
and mapping are gone), owner-only (``0600``), sealed against growing and shrinking (a reader cannot
truncate it under the sender and make it fault), mapped once and pre-faulted.

A receiver maps the descriptor it was sent as a :class:`PeerPool`. Views handed out are numpy /
torch views whose buffer export pins the mapping, so the mapping outlives every view even after
the pool's owner is gone or the connector is closed; it is unmapped when the last view dies.
"""

from __future__ import annotations

import bisect
import contextlib
import fcntl
import mmap
import os
import threading

import numpy as np
import torch

__all__ = ["PAGE", "Allocator", "PeerPool", "SenderPool"]

PAGE = 4096


def _round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


class Allocator:
    """First-fit allocator over ``[0, total)`` with page-aligned, page-rounded blocks.

    Called by the connector under its own lock (not thread-safe by itself). ``alloc`` returns an
    offset or ``None`` when nothing fits; ``free`` takes back exactly what ``alloc`` gave and
    merges neighbours; a double free raises ``RuntimeError`` (it would corrupt the pool).
    """

    def __init__(self, total: int, align: int = PAGE) -> None:
        self.total = total - total % align
        self.align = align
        self._starts: list[int] = [0] if self.total else []  # sorted free block starts
        self._sizes: dict[int, int] = {0: self.total} if self.total else {}
        self._used: dict[int, int] = {}

    def block_size(self, n: int) -> int:
        return max(_round_up(n, self.align), self.align)

    def alloc(self, n: int) -> int | None:
        need = self.block_size(n)
        for i, start in enumerate(self._starts):
            size = self._sizes[start]
            if size >= need:
                del self._sizes[start]
                if size == need:
                    del self._starts[i]
                else:
                    self._starts[i] = start + need
                    self._sizes[start + need] = size - need
                self._used[start] = need
                return start
        return None

    def free(self, offset: int) -> None:
        size = self._used.pop(offset, None)
        if size is None:
            raise RuntimeError(f"free of offset {offset} that is not allocated")
        i = bisect.bisect_left(self._starts, offset)
        # merge with the next free block
        if i < len(self._starts) and self._starts[i] == offset + size:
            size += self._sizes.pop(self._starts[i])
            del self._starts[i]
        # merge with the previous free block
        if i > 0:
            prev = self._starts[i - 1]
            if prev + self._sizes[prev] == offset:
                self._sizes[prev] += size
                return
        self._starts.insert(i, offset)
        self._sizes[offset] = size

    @property
    def free_bytes(self) -> int:
        return sum(self._sizes.values())

    @property
    def largest_free(self) -> int:
        return max(self._sizes.values(), default=0)

    @property
    def used_blocks(self) -> int:
        return len(self._used)


class SenderPool:
    """The sender's memfd pool: created, sealed, chmod 0600, mapped once, pre-faulted.

    Built by the connector on its first put. ``slot(offset, n)`` is a writable 1-D ``uint8``
    tensor over pool memory. ``close`` drops the descriptor and, once no view is alive, the
    mapping; a mapping still pinned by a view is unmapped when that view dies.
    """

    def __init__(self, size: int, name: str, *, prefault: bool = True) -> None:
        if size < PAGE:
            raise ValueError(f"pool_size_bytes must be at least {PAGE}, got {size}")
        self.size = size - size % PAGE
        flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING
        self.fd: int | None = os.memfd_create(name, flags)
        try:
            os.fchmod(self.fd, 0o600)
            os.ftruncate(self.fd, self.size)
            fcntl.fcntl(
                self.fd,
                fcntl.F_ADD_SEALS,
                fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL,
            )
            mflags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if prefault else 0)
            self._mm: mmap.mmap | None = mmap.mmap(self.fd, self.size, flags=mflags)
        except BaseException:
            os.close(self.fd)
            raise
        self._tensor: torch.Tensor | None = torch.from_numpy(
            np.frombuffer(self._mm, dtype=np.uint8)
        )
        self._lock = threading.Lock()

    def slot(self, offset: int, n: int) -> torch.Tensor:
        t = self._tensor
        if t is None:
            raise RuntimeError("pool is closed")
        return t[offset : offset + n]

    def close(self) -> None:
        """Idempotent. Unmaps now if no view pins the mapping, else when the last view dies."""
        with self._lock:
            self._tensor = None
            mm, self._mm = self._mm, None
            fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)
        if mm is not None:
            with contextlib.suppress(BufferError):
                mm.close()


class PeerPool:
    """A receiver's mapping of a sender's pool (from the descriptor passed over the socket).

    The descriptor is closed right after mapping; the mapping alone keeps the memory. ``view``
    returns 1-D ``uint8`` tensors whose buffer export pins the mapping.
    """

    def __init__(self, pool_id: int, fd: int, size: int, *, prefault: bool = True) -> None:
        try:
            actual = os.fstat(fd).st_size
            if actual != size:
                raise ValueError(f"pool descriptor has {actual} bytes, announced {size}")
            mflags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if prefault else 0)
            mm = mmap.mmap(fd, size, flags=mflags)
        finally:
            os.close(fd)
        self.pool_id = pool_id
        self.size = size
        self._mm: mmap.mmap | None = mm
        self._tensor: torch.Tensor | None = torch.from_numpy(np.frombuffer(mm, dtype=np.uint8))

    def view(self, offset: int, n: int) -> torch.Tensor:
        t = self._tensor
        if t is None:
            raise RuntimeError("peer pool is unmapped")
        if offset < 0 or n < 0 or offset + n > self.size:
            raise ValueError(f"span [{offset}, {offset + n}) outside a pool of {self.size} bytes")
        return t[offset : offset + n]

    def close(self) -> None:
        """Drop our reference; unmapped now, or when the last view handed out dies."""
        self._tensor = None
        mm, self._mm = self._mm, None
        if mm is not None:
            with contextlib.suppress(BufferError):
                mm.close()
