"""Shared-memory mappings for :mod:`omnikv.connectors.shm.connector`: the sender's memfd and peers'
maps.

A sender owns one :class:`SenderPool`: a ``memfd_create`` file (no name in ``/dev/shm`` or
anywhere else, so a SIGKILL cannot leak it: the kernel frees the memory when the last descriptor
and mapping are gone), owner-only (``0600``), sealed against growing and shrinking and against
further seals (``F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL``: a reader can never have the file
truncated under it). It is mapped once and *not* populated: memory is committed as it is used
(the allocator is first-fit from offset 0, so a small workload touches a small prefix); a
background thread populates a start-up reserve and then stays ahead of the high-water mark, so
the first and the steady-state puts do not fault.

A receiver maps a descriptor it was sent as a :class:`PeerPool` only after checking that it is a
memfd with those three seals and exactly the announced size (``fstat``); anything else is
refused, so a peer cannot make the receiver fault (SIGBUS) by shrinking the file later.

Views handed out are numpy / torch views whose buffer export pins the mapping, so the mapping
outlives every view even after the pool's owner is gone; it is unmapped when the last view dies.
:func:`MappedRegion.migrate` moves a span of a mapping to private anonymous memory at the same
address (``mremap``), so a receiver can keep a view forever and still give the sender its space.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import logging
import mmap
import os
import threading
import time
from typing import Any

import numpy as np
import torch

__all__ = ["PAGE", "REQUIRED_SEALS", "MappedRegion", "PeerPool", "SenderPool"]

logger = logging.getLogger(__name__)

PAGE = 4096
REQUIRED_SEALS = fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL
_PREFAULT_STEP = 8 << 20
_PREFAULT_AHEAD = 4 << 20
_MADV_POPULATE_WRITE = 23
_MREMAP_MAYMOVE = 1
_MREMAP_FIXED = 2
_MAP_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
)
_libc.mremap.restype = ctypes.c_void_p
_libc.mremap.argtypes = (
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_void_p,
)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def _round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


class MappedRegion:
    """A shared mapping of a memfd with page-granular views and in-place migration."""

    def __init__(self, fd: int, size: int) -> None:
        self.size = size
        self._mm: mmap.mmap | None = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        arr = np.frombuffer(self._mm, dtype=np.uint8)
        self.address = int(arr.ctypes.data)
        self._array: np.ndarray | None = arr
        self._tensor: torch.Tensor | None = torch.from_numpy(arr)
        self.tainted = False  # a span was migrated: new views must come from a fresh mapping
        self._unmapped = False

    def view(self, offset: int, n: int) -> torch.Tensor:
        """A 1-D ``uint8`` view of ``[offset, offset + n)``; pins the mapping while alive."""
        t = self._tensor
        self._check_span(t is None, offset, n)
        assert t is not None
        return t[offset : offset + n]

    def array(self, offset: int, n: int) -> np.ndarray:
        """:meth:`view` as a numpy array (no torch call: the receiver's hot path)."""
        a = self._array
        self._check_span(a is None, offset, n)
        assert a is not None
        return a[offset : offset + n]

    def _check_span(self, unmapped: bool, offset: int, n: int) -> None:
        if unmapped:
            raise RuntimeError("shared-memory pool is unmapped")
        if offset < 0 or n < 0 or offset + n > self.size:
            raise ValueError(f"span [{offset}, {offset + n}) outside a pool of {self.size} bytes")

    def migrate(self, offset: int, n: int) -> None:
        """Replace ``[offset, offset + n)`` (page-rounded) with a private copy at the same address.

        Views of the span stay valid and keep their contents; the shared pages underneath are no
        longer referenced by this mapping, so their owner may reuse them. One copy. Raises
        ``OSError`` if the kernel refuses (the span is then unchanged). Afterwards the mapping is
        ``tainted``: it no longer shows the pool everywhere, so new views use a fresh mapping.
        """
        # a closed region is still mapped while views pin it (a holder's view does)
        if self._unmapped or offset % PAGE or offset < 0 or offset + n > self.size:
            raise ValueError(f"cannot migrate [{offset}, {offset + n}) of this pool")
        span = min(_round_up(max(n, 1), PAGE), self.size - offset)
        addr = self.address + offset
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        tmp = _libc.mmap(None, span, prot, flags, -1, 0)
        if tmp is None or tmp == _MAP_FAILED:
            raise OSError(ctypes.get_errno(), "mmap for migration failed")
        ctypes.memmove(tmp, addr, span)
        self.tainted = True
        moved = _libc.mremap(tmp, span, span, _MREMAP_MAYMOVE | _MREMAP_FIXED, addr)
        if moved is None or moved == _MAP_FAILED:
            err = ctypes.get_errno()
            _libc.munmap(tmp, span)
            raise OSError(err, "mremap for migration failed")

    def close(self) -> None:
        """Drop our reference; unmapped now, or when the last view handed out dies."""
        self._tensor = None
        self._array = None
        mm, self._mm = self._mm, None
        if mm is not None:
            with contextlib.suppress(BufferError):  # views pin it: unmapped when they die
                mm.close()
                self._unmapped = True


class SenderPool(MappedRegion):
    """The sender's memfd pool: created, chmod 0600, sized, sealed, mapped (not populated).

    Population runs in one background thread (``MADV_POPULATE_WRITE`` in 8 MiB steps; ctypes
    releases the GIL, so puts proceed meanwhile), started on the first request for it:
    :meth:`reserve` populates a prefix at once (the start-up reserve), and with ``prefault``
    ``note_used(end)`` keeps the populated prefix ahead of the allocations' high-water mark, so
    memory grows with use and steady-state writes do not fault. Nothing ever waits for it: a
    write to a page not populated yet faults it in. :meth:`close` stops the thread between
    two steps.
    """

    def __init__(self, size: int, name: str, *, prefault: bool = True) -> None:
        if size < PAGE:
            raise ValueError(f"pool_size_bytes must be at least {PAGE}, got {size}")
        size -= size % PAGE
        flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING
        fd = os.memfd_create(name, flags)
        try:
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, REQUIRED_SEALS)
            super().__init__(fd, size)
        except BaseException:
            os.close(fd)
            raise
        self.fd: int | None = fd
        self.prefault = prefault
        self._lock = threading.Lock()
        self._ready = 0  # populated up to here
        self._want = 0  # populate up to here
        self._reserve = 0  # the start-up reserve: [0, _reserve)
        self._reserve_t0 = 0.0
        self._reserve_s: float | None = None  # how long the reserve took, once ready
        self._failed = ""  # why population stopped (the kernel refused)
        self._wake = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None

    def note_used(self, end: int) -> None:
        """An allocation reaches ``end``: keep the populated prefix ahead of it (``prefault``)."""
        if self.prefault:
            self.populate_to(2 * end + _PREFAULT_AHEAD)

    def reserve(self, nbytes: int) -> None:
        """Populate ``[0, nbytes)`` (clamped to the pool) in the background, starting now.

        Never blocks. :meth:`status` says when it is ready and how long it took."""
        target = min(self.size, _round_up(nbytes, PAGE))
        with self._lock:
            if target <= self._reserve:
                return
            self._reserve, self._reserve_t0 = target, time.monotonic()
            self._reserve_s = 0.0 if self._ready >= target else None
        self.populate_to(target)

    def populate_to(self, end: int) -> None:
        """Populate ``[0, end)`` in the background (starts the thread on first use)."""
        target = min(self.size, _round_up(end, PAGE))
        with self._lock:
            if target <= self._want or self._tensor is None or self._failed:
                return
            self._want = target
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._prefault_loop, name="omnikv-shm-prefault", daemon=True
                )
                self._thread.start()
            self._wake.notify()

    @property
    def populated_bytes(self) -> int:
        with self._lock:
            return self._ready

    def status(self) -> dict[str, Any]:
        """Population as ``health()`` shows it: ``pool_populated_bytes``, ``pool_reserve_bytes``,
        ``pool_reserve_ready``, ``pool_reserve_s`` (seconds it took; ``None`` until ready) and
        ``pool_prefault`` (``off`` / ``idle`` / ``populating`` / ``failed: <reason>``)."""
        with self._lock:
            state = f"failed: {self._failed}" if self._failed else "idle"
            if not self.prefault and not self._reserve:
                state = "off"
            if not self._failed and self._ready < self._want and self._tensor is not None:
                state = "populating"
            return {
                "pool_populated_bytes": self._ready,
                "pool_reserve_bytes": self._reserve,
                "pool_reserve_ready": self._ready >= self._reserve,
                "pool_reserve_s": self._reserve_s,
                "pool_prefault": state,
            }

    def _prefault_loop(self) -> None:
        while True:
            with self._lock:
                while self._ready >= self._want and self._tensor is not None:
                    self._wake.wait()
                if self._tensor is None:
                    return
                start, end = self._ready, min(self._want, self._ready + _PREFAULT_STEP)
            # ctypes releases the GIL: the kernel allocates and maps pages meanwhile
            if _libc.madvise(self.address + start, end - start, _MADV_POPULATE_WRITE):
                err = ctypes.get_errno()
                with self._lock:
                    self._failed = os.strerror(err)
                logger.info(
                    "MADV_POPULATE_WRITE failed (%s); pool pages fault on first use", self._failed
                )
                return
            with self._lock:
                self._ready = max(self._ready, end)
                if self._reserve_s is None and self._ready >= self._reserve:
                    self._reserve_s = time.monotonic() - self._reserve_t0
                    logger.debug(
                        "pool reserve of %d bytes populated in %.3fs",
                        self._reserve,
                        self._reserve_s,
                    )

    def close(self) -> None:
        """Idempotent. Stops population between two steps (bounded: one 8 MiB step); unmaps
        now if no view pins the mapping, else when the last view dies."""
        with self._lock:
            self._tensor = None
            self._wake.notify_all()
            fd, self.fd = self.fd, None
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)
        if fd is not None:
            os.close(fd)
        super().close()


class PeerPool:
    """A reader's access to a sender's pool through the descriptor it was given.

    Refuses (``ValueError``) a descriptor that is not a sealed memfd of exactly ``size`` bytes
    (the descriptor is then closed). Views come from :meth:`region`: one shared mapping, replaced
    by a fresh one once a span of it was migrated (the old one lives on as long as views of it
    do), so a reused slot is always read through the shared pages.
    """

    def __init__(self, pool_id: int, fd: int, size: int) -> None:
        try:
            check_pool_fd(fd, size)
            region = MappedRegion(fd, size)
        except BaseException:
            os.close(fd)
            raise
        self.pool_id = pool_id
        self.size = size
        self._fd: int | None = fd
        self._region: MappedRegion | None = region
        self._lock = threading.Lock()

    def region(self) -> MappedRegion:
        """The current shared mapping (a fresh one after a migration)."""
        with self._lock:
            region, fd = self._region, self._fd
            if region is None or fd is None:
                raise RuntimeError("peer pool is closed")
            if region.tainted:
                region.close()
                region = self._region = MappedRegion(fd, self.size)
            return region

    def close(self) -> None:
        """Drop the descriptor and our mapping; views handed out keep theirs alive."""
        with self._lock:
            region, self._region = self._region, None
            fd, self._fd = self._fd, None
        if region is not None:
            region.close()
        if fd is not None:
            os.close(fd)


def check_pool_fd(fd: int, size: int) -> None:
    """Raise ``ValueError`` unless ``fd`` is a memfd sealed with :data:`REQUIRED_SEALS` whose size
    is exactly ``size`` (a positive multiple of the page size)."""
    if size <= 0 or size % PAGE:
        raise ValueError(f"announced pool size {size} is not a positive multiple of {PAGE}")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as exc:
        raise ValueError(f"pool descriptor is not a sealable memfd: {exc}") from exc
    if seals & REQUIRED_SEALS != REQUIRED_SEALS:
        raise ValueError(f"pool descriptor seals {seals:#x} lack {REQUIRED_SEALS:#x}")
    actual = os.fstat(fd).st_size
    if actual != size:
        raise ValueError(f"pool descriptor has {actual} bytes, announced {size}")
