"""The sending half of :mod:`omnikv.connectors.shm`: the pool, what is published, who holds what.

A put allocates a page-aligned slot from the connector's :class:`SenderPool` with the one
allocator (:class:`~omnikv.connectors._pool.BufferAllocator`, which blocks on a condition until
the caller's deadline), the payload is written in place, and the entry is offered to the first
peer waiting for its key, or published. An offered entry is *held* by that reader until it sends
``release`` (or ``return``: the waiter gave up, so the entry is published again).

Data lifetime: a reader may keep a payload as long as it likes. When a put finds no space, the
store asks every reader holding a slot to ``evict`` it: the reader moves the span to private
memory at the same address (one copy, views stay valid) and releases the slot. Zero-copy while
the pool has room; one copy per held payload under pressure; the sender never fails because a
reader keeps data (only a reader that does not answer, or unconsumed puts, fill the pool).

Per-peer state is bounded: at most :data:`MAX_WANTS_PER_LINK` blocking wants per connection
(the peer is disconnected beyond that).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from omnikv.connectors._pool import BufferAllocator
from omnikv.connectors._shm_mesh import Link
from omnikv.connectors._shm_pool import SenderPool
from omnikv.connectors.base import Writer
from omnikv.deadline import remaining
from omnikv.errors import ConnectorUnavailableError, PoolExhaustedError
from omnikv.payload import writes_host_arrays

__all__ = ["MAX_WANTS_PER_LINK", "Entry", "SendStore"]

logger = logging.getLogger(__name__)

MAX_WANTS_PER_LINK = 4096

Send = Callable[[Link, list[list[Any]], "tuple[int, int, int] | None"], bool]


@dataclass
class Entry:
    """A payload in our pool: published under ``key`` or held by ``holder`` as ``token``."""

    key: str
    label: str  # the caller's key, for flush / linger reports
    offset: int
    nbytes: int
    kind: str
    token: int = 0
    holder: Link | None = None
    evicting: bool = False
    sent: bool = False  # the offer to ``holder`` has left (until then it is not consumed)


class SendStore:
    """Sender-side state of one connector; thread-safe (one lock, never held while sending)."""

    def __init__(
        self,
        pool_size: int,
        prefault: bool,
        send: Send,
        drop: Callable[..., None],
        *,
        reserve: int = 0,
    ) -> None:
        self.pool_size = pool_size
        self.prefault = prefault
        self.reserve = reserve  # populated in the background as soon as the pool exists
        self._send = send
        self._drop = drop
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._pool_lock = threading.Lock()
        self.pool: SenderPool | None = None
        self.alloc: BufferAllocator | None = None
        self.pool_id = secrets.randbits(48)
        self._published: dict[str, Entry] = {}
        self._held: dict[int, Entry] = {}
        self._wanters: dict[str, list[tuple[Link, int]]] = {}
        self._want_count: dict[Link, int] = {}
        self._next_token = 1
        self._waiting = 0  # puts waiting for space
        self.closed = False
        self.counters = dict.fromkeys(
            ("puts", "put_failures", "bytes_put", "put_waits", "put_timeouts", "releases",
             "returns", "replaced", "evictions", "reclaimed_from_dead_readers"),
            0,
        )  # fmt: skip

    # -- pool ---------------------------------------------------------------------------------
    def ensure_pool(self, on_create: Callable[[SenderPool], None]) -> BufferAllocator:
        """The allocator of our pool, creating the pool on first use (cheap: not populated;
        the start-up reserve, if any, starts populating in the background)."""
        alloc = self.alloc
        if alloc is not None:
            return alloc
        with self._pool_lock:
            if self.alloc is None:
                try:
                    pool = SenderPool(self.pool_size, "omnikv-shm", prefault=self.prefault)
                except OSError as exc:
                    raise ConnectorUnavailableError(
                        f"cannot create a shared-memory pool of {self.pool_size} bytes: {exc}"
                    ) from exc
                on_create(pool)
                self.pool = pool
                self.alloc = BufferAllocator(pool.size)
                if self.reserve:
                    pool.reserve(self.reserve)
            return self.alloc

    def pool_handle(self) -> tuple[int, int, int] | None:
        pool = self.pool
        fd = pool.fd if pool is not None else None
        return None if pool is None or fd is None else (self.pool_id, pool.size, fd)

    def allocate(self, key: str, nbytes: int, deadline: float) -> int:
        """A slot for ``nbytes``; waits (asking holders to evict) until ``deadline``."""
        alloc = self.alloc
        assert alloc is not None and self.pool is not None
        if alloc.block_size(nbytes) > alloc.total:
            raise PoolExhaustedError(
                f"payload of {nbytes} bytes ({key}) can never fit the pool of {alloc.total} bytes;"
                " raise pool_size_bytes"
            )
        t0 = time.monotonic()
        waited = False

        def on_wait(size: int) -> None:
            nonlocal waited
            waited = True
            with self._lock:
                self._waiting += 1
                self.counters["put_waits"] += 1
            self._evict(size)

        try:
            offset, _ = alloc.alloc(max(nbytes, 1), deadline=deadline, on_wait=on_wait)
        except PoolExhaustedError as exc:
            with self._lock:
                self.counters["put_timeouts"] += 1
                held, published = len(self._held), len(self._published)
            raise PoolExhaustedError(
                f"no space for {nbytes} bytes ({key}) after {time.monotonic() - t0:.3f}s: pool of"
                f" {alloc.total} bytes has {alloc.free_bytes()} free (largest"
                f" {alloc.largest_free()}); {held} payload(s) held by readers that did not give"
                f" them back, {published} published and unconsumed"
            ) from exc
        finally:
            if waited:
                with self._lock:
                    self._waiting -= 1
        return offset

    def _evict(self, size: int) -> None:
        """The pool is full: ask every reader holding a slot to migrate it and release it.

        Called when a put starts to wait, and after every offer while one waits (a payload
        published while the pool was full is held only once a reader takes it)."""
        with self._lock:
            targets = [e for e in self._held.values() if not e.evicting and e.holder is not None]
            for e in targets:
                e.evicting = True
            self.counters["evictions"] += len(targets)
        for e in targets:
            if e.holder is not None:
                self._send(e.holder, [["evict", e.token]], None)
        if targets:
            logger.debug(
                "pool full (%d bytes wanted): asked %d holder(s) to evict", size, len(targets)
            )

    def free(self, entry: Entry) -> None:
        """Return an entry's slot (``self._lock`` held)."""
        if self.alloc is not None:
            self.alloc.free(entry.offset)
        self._changed.notify_all()

    # -- publishing ---------------------------------------------------------------------------
    def publish(self, entry: Entry) -> None:
        self.deliver(entry)
        if self.pool is not None:  # after the write, so prefaulting ahead never competes with it
            self.pool.note_used(entry.offset + max(entry.nbytes, 1))
        with self._lock:
            self.counters["puts"] += 1
            self.counters["bytes_put"] += entry.nbytes

    def _hold(self, entry: Entry, link: Link, wid: int) -> list[Any]:
        """Mark ``entry`` as offered to ``link`` (lock held); the offer message to send."""
        entry.token = self._next_token
        self._next_token += 1
        entry.holder = link
        entry.evicting = False
        entry.sent = False
        self._held[entry.token] = entry
        return ["offer", wid, entry.token, entry.offset, entry.nbytes, entry.kind]

    def _next_target(self, entry: Entry) -> tuple[Link, list[Any]] | None:
        """(lock held) Offer to the first live waiter, else publish (replacing) and ``None``."""
        queue = self._wanters.get(entry.key)
        target: tuple[Link, list[Any]] | None = None
        while queue and target is None:
            link, wid = queue.pop(0)
            self._want_count[link] = self._want_count.get(link, 1) - 1
            if link.alive:
                target = (link, self._hold(entry, link, wid))
        if not queue:
            self._wanters.pop(entry.key, None)
        if target is None:
            old = self._published.pop(entry.key, None)
            if old is not None:
                self.counters["replaced"] += 1
                logger.warning("key %s put again before it was consumed", entry.key)
                self.free(old)
            self._published[entry.key] = entry
        return target

    def deliver(self, entry: Entry) -> None:
        """Offer ``entry`` to the first live waiter of its key, else publish it."""
        while True:
            with self._lock:
                if self.closed:
                    return
                target = self._next_target(entry)
            if target is None:
                return
            if self._send(target[0], [target[1]], self.pool_handle()):
                self._offer_sent(entry)
                return
            self._take_back(entry)

    def _take_back(self, entry: Entry) -> None:
        """An offer could not be sent: the entry is ours again (lock not held)."""
        with self._lock:
            if self._held.get(entry.token) is entry:
                del self._held[entry.token]
            entry.holder = None

    # -- messages from readers ------------------------------------------------------------------
    def on_want(self, link: Link, wid: int, key: str, block: bool) -> None:
        over = False
        with self._lock:
            entry = self._published.pop(key, None)
            if entry is not None:
                reply: list[Any] | None = self._hold(entry, link, wid)
            elif block:
                reply = None
                over = self._want_count.get(link, 0) >= MAX_WANTS_PER_LINK
                if not over:
                    self._wanters.setdefault(key, []).append((link, wid))
                    self._want_count[link] = self._want_count.get(link, 0) + 1
            else:
                reply = ["miss", wid]
        if over:
            self._drop(link, f"more than {MAX_WANTS_PER_LINK} outstanding wants")
            return
        if reply is None:
            return
        pool = self.pool_handle() if entry is not None else None
        if self._send(link, [reply], pool):
            if entry is not None:
                self._offer_sent(entry)
        elif entry is not None:
            self._take_back(entry)
            self.deliver(entry)

    def _offer_sent(self, entry: Entry) -> None:
        """The offer of ``entry`` left: it counts as consumed (flush); a put waiting for space
        asks its new holder to evict at once."""
        with self._lock:
            entry.sent = True
            self._changed.notify_all()
            waiting = self._waiting
        if waiting:
            self._evict(0)

    def on_cancel(self, link: Link, wid: int) -> None:
        with self._lock:
            for key, queue in list(self._wanters.items()):
                before = len(queue)
                queue[:] = [(lk, w) for lk, w in queue if not (lk is link and w == wid)]
                self._want_count[link] = self._want_count.get(link, 0) - (before - len(queue))
                if not queue:
                    del self._wanters[key]

    def on_release(self, link: Link, token: int, *, republish: bool) -> None:
        with self._lock:
            entry = self._held.get(token)
            if entry is None or entry.holder is not link:
                logger.debug("%s released unknown token %d", link, token)
                return
            del self._held[token]
            entry.holder = None
            if not republish or entry.key in self._published:
                # released, or returned after a newer put of the key (the newer one wins)
                self.counters["releases"] += 1
                self.free(entry)
                return
            self.counters["returns"] += 1
        self.deliver(entry)

    def on_link_gone(self, link: Link) -> None:
        with self._lock:
            for token, entry in list(self._held.items()):
                if entry.holder is link:
                    del self._held[token]
                    entry.holder = None
                    self.counters["reclaimed_from_dead_readers"] += 1
                    self.free(entry)
            for key, queue in list(self._wanters.items()):
                queue[:] = [(lk, w) for lk, w in queue if lk is not link]
                if not queue:
                    del self._wanters[key]
            self._want_count.pop(link, None)

    # -- cleanup, flush, status -------------------------------------------------------------------
    def drop_matching(self, match: Callable[[str], bool]) -> list[str]:
        """Drop published entries whose transport key matches; their labels."""
        with self._lock:
            gone = [k for k in self._published if match(k)]
            entries = [self._published.pop(k) for k in gone]
            for e in entries:
                self.free(e)
        return [e.label for e in entries]

    def flush(self, deadline: float) -> list[str]:
        """Wait until every published payload was taken by a reader, or ``deadline``; the
        labels still unconsumed."""
        with self._changed:
            while self._unconsumed() and not self.closed:
                left = remaining(deadline)
                if left <= 0:
                    break
                self._changed.wait(min(left, 3600.0))
            return sorted(e.label for e in self._unconsumed())

    def _unconsumed(self) -> list[Entry]:
        """(lock held) Published entries and those whose offer has not left yet."""
        in_flight = [e for e in self._held.values() if not e.sent]
        return [*self._published.values(), *in_flight]

    def snapshot(self) -> dict[str, Any]:
        alloc = self.alloc
        pool = self.pool
        with self._lock:
            return {
                "pool_size_bytes": alloc.total if alloc else 0,
                "pool_free_bytes": alloc.free_bytes() if alloc else 0,
                "pool_largest_free": alloc.largest_free() if alloc else 0,
                **(pool.status() if pool else self._no_pool_status()),
                "published": len(self._published),
                "held_by_readers": len(self._held),
                "waiting_receivers": sum(len(q) for q in self._wanters.values()),
                **self.counters,
            }

    def _no_pool_status(self) -> dict[str, Any]:
        """:meth:`SenderPool.status` before the pool exists (it is made by the first put)."""
        return {
            "pool_populated_bytes": 0,
            "pool_reserve_bytes": self.reserve,
            "pool_reserve_ready": not self.reserve,
            "pool_reserve_s": None,
            "pool_prefault": "on first put" if self.reserve or self.prefault else "off",
        }

    def count_failure(self) -> None:
        with self._lock:
            self.counters["put_failures"] += 1

    def write_slot(self, entry: Entry, write: Writer) -> None:
        """Let ``write`` fill the entry's slot (as numpy when it takes that, see
        :func:`omnikv.payload.writes_host_arrays`); frees it if ``write`` raises."""
        pool = self.pool
        assert pool is not None
        try:
            if writes_host_arrays(write):
                cast(Callable[[np.ndarray], object], write)(pool.array(entry.offset, entry.nbytes))
            else:
                write(pool.view(entry.offset, entry.nbytes))
        except BaseException:
            with self._lock:
                self.free(entry)
                self.counters["put_failures"] += 1
            raise

    def close(self) -> list[str]:
        """Drop everything; the labels of payloads dropped unconsumed."""
        with self._lock:
            self.closed = True
            dropped = sorted(e.label for e in self._published.values())
            self._published.clear()
            self._held.clear()
            self._wanters.clear()
            self._changed.notify_all()
        if self.alloc is not None:
            self.alloc.close()
        if self.pool is not None:
            self.pool.close()
        return dropped
