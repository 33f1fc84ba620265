"""The sending half of :mod:`omnikv.connectors.shm.connector`: the pool, what is published, who
holds what.

A put allocates a page-aligned slot from the connector's :class:`SenderPool` with the one
allocator (:class:`~omnikv.connectors.pool.BufferAllocator`, which blocks on a condition until
the caller's deadline), the payload is written in place, and the entry is offered to the first
peer waiting for its key, or published. An offered entry is *held* by that reader until it sends
``release`` (or ``return``: the waiter gave up, so the entry is published again).

Data lifetime: a reader may keep a payload as long as it likes. When a put finds no space, the
store asks every reader holding a slot to ``evict`` it: the reader moves the span to private
memory at the same address (one copy, views stay valid) and releases the slot. Zero-copy while
the pool has room; one copy per held payload under pressure; the sender never fails because a
reader keeps data (only a reader that does not answer, or unconsumed puts, fill the pool).

Unconsumed payloads expire (:class:`Unconsumed`): a payload published and claimed by no reader
for ``buffer_ttl_seconds`` after its put is freed, its key forgotten (a later want misses) and
reported once (a WARNING naming key, size and age; counted as ``ttl_reaped`` /
``ttl_reaped_bytes``). Only unclaimed payloads expire: a payload offered to a reader is held by
it from that moment (under the store's lock), so a reader never sees its slot reused. Expiry
is driven by a timer thread that sleeps until the earliest expiry, and by every put and want,
which free what is due before they look (so a late want misses even before the timer ran).

A put that finds no space waits for it until its deadline, except when waiting cannot be
expected to help (see :meth:`SendStore.allocate`): every slot in use holds a published payload
nobody claimed, none expires before the deadline, and none was put more recently than the put
would wait. It then fails at once and says so.

Delivery verdicts (``acks``): with a :class:`~omnikv.connectors.shm.acks.SentVerdicts`, every
put is published there, an offer says ``"ack"`` and is recorded as taken by its link just before
it is sent (undone when it cannot be sent or the reader returns it), an expired payload is
reported ``expired``, a cleanup's are forgotten, and the timer thread also wakes for the
``ack_timeout_s`` watches.

Per-peer state is bounded: at most :data:`MAX_WANTS_PER_LINK` blocking wants per connection
(the peer is disconnected beyond that).
"""

from __future__ import annotations

import itertools
import logging
import math
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from omnikv._logging import RateLimitedLog
from omnikv.connectors.base import HostArrayWriter, Writer, takes_host_arrays
from omnikv.connectors.counters import Counters
from omnikv.connectors.pool import BufferAllocator
from omnikv.connectors.shm.acks import ACK_FLAG, SentVerdicts
from omnikv.connectors.shm.config import DEFAULT_UNCLAIMED_GRACE_S
from omnikv.connectors.shm.mesh import Link
from omnikv.connectors.shm.pool import SenderPool
from omnikv.connectors.shm.shared import COUNTER_NAMES as SHARED_COUNTERS
from omnikv.connectors.shm.shared import Share, claim, drop_ref, unclaim
from omnikv.deadline import remaining
from omnikv.errors import ConnectorClosedError, ConnectorUnavailableError, PoolExhaustedError

__all__ = [
    "COUNTER_NAMES",
    "MAX_WANTS_PER_LINK",
    "Entry",
    "Lifetime",
    "SendStore",
    "Unconsumed",
]


logger = logging.getLogger(__name__)
_outsider = RateLimitedLog(logger)  # lines a peer, client or forger can cause

MAX_WANTS_PER_LINK = 4096
#: The events a sending side counts (in its connector's :class:`Counters`), its expiry included.
COUNTER_NAMES = (
    "puts",
    "put_bytes",
    "put_failures",
    "put_waits",
    "put_timeouts",
    "put_pool_full",
    "releases",
    "returns",
    "replaced",
    "evictions",
    "reclaimed_from_dead_readers",
    "ttl_reaped",
    "ttl_reaped_bytes",
    "grace_evicted",
    "grace_evicted_bytes",
    *SHARED_COUNTERS,
)

Send = Callable[[Link, list[list[Any]], "tuple[int, int, int] | None"], bool]


@dataclass(frozen=True)
class Lifetime:
    """How long a published payload nobody claimed lives: freed ``ttl_s`` after its put
    (``buffer_ttl_seconds``; 0: never), and giving its space to newer payloads that find the
    pool full ``grace_s`` after its put (``unclaimed_grace_seconds``)."""

    ttl_s: float = 0.0
    grace_s: float = DEFAULT_UNCLAIMED_GRACE_S


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
    published_at: float = 0.0  # monotonic time of the put's publication (its age counts from it)
    share: Share | None = None  # several readers' claims on this slot (``shared``)
    acks: bool = True  # its offer asks for a verdict (a shared slot's: only its last claim's)


class Unconsumed:
    """The payloads published and claimed by no reader yet, by transport key, and their expiry.

    Owned by one :class:`SendStore` and guarded by its ``lock`` (``changed`` is the store's
    condition over it, notified when space is freed here); every method but :meth:`expire_due`
    and :meth:`join` is called with the lock held. An entry leaves by :meth:`pop` (a reader
    claims it), :meth:`pop_matching` (cleanup), :meth:`clear` (close) or expiry: ``ttl_s``
    (``buffer_ttl_seconds``; 0: never) after its put it is freed here, counted in ``counters``
    (``ttl_reaped``, ``ttl_reaped_bytes``) and reported once with a WARNING. Expiry runs in a
    timer thread (started by :meth:`start` with the pool) that sleeps until the earliest
    expiry, and in every put and want (:meth:`expire_due`, :meth:`reap`), so it never depends
    on that thread being scheduled.

    ``next_expiry`` is a lower bound of the earliest expiry (``math.inf``: none; exact after
    :meth:`reap` and :meth:`first_expiry`); reading it without the lock is safe (one float), so
    a put or a want skips the lock when nothing is due.
    """

    def __init__(
        self,
        ttl_s: float,
        lock: threading.Lock,
        changed: threading.Condition,
        counters: Counters,
        verdicts: SentVerdicts | None = None,
        grace_s: float = DEFAULT_UNCLAIMED_GRACE_S,
    ) -> None:
        self.ttl_s = ttl_s
        self.grace_s = grace_s
        self.next_expiry = math.inf
        self._counters = counters
        self._verdicts = verdicts
        self._sleeps_until = math.inf  # what the timer sleeps until (lock held to read/write)
        self._entries: dict[str, Entry] = {}
        self._changed = changed
        self._wake = threading.Condition(lock)  # the timer sleeps on it
        self._alloc: BufferAllocator | None = None
        self._timer: threading.Thread | None = None
        self._closed = False

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def get(self, key: str) -> Entry | None:
        return self._entries.get(key)

    def entries(self) -> list[Entry]:
        return list(self._entries.values())

    def newest(self, limit: int) -> list[str]:
        """The keys of the ``limit`` payloads published last, newest first."""
        return list(itertools.islice(reversed(self._entries), limit))

    def expiry(self, entry: Entry) -> float:
        """When ``entry`` expires (monotonic; ``math.inf`` when expiry is off)."""
        return entry.published_at + self.ttl_s if self.ttl_s else math.inf

    def start(self, alloc: BufferAllocator) -> None:
        """The pool exists (``alloc`` frees its slots): start the timer if payloads expire or
        verdicts are watched (``ack_timeout_s``)."""
        self._alloc = alloc
        if self.ttl_s or self._verdicts is not None:
            self._timer = threading.Thread(target=self._run, name="omnikv-shm-ttl", daemon=True)
            self._timer.start()

    def add(self, entry: Entry) -> Entry | None:
        """Publish ``entry`` under its key (``published_at`` set by its put and kept when a
        reader returns it); the entry it replaces, if any (the caller frees it)."""
        old = self._entries.pop(entry.key, None)
        self._entries[entry.key] = entry
        expiry = self.expiry(entry)
        if expiry < self.next_expiry:  # the timer sleeps until a later one: wake it
            self.next_expiry = expiry
            self._wake.notify()
        return old

    def claim(self, key: str) -> Entry | None:
        """A reader claims ``key`` (its want): the entry to offer it. An entry leaves (and can
        no longer expire) with its last claim; a shared one with claims left stays published
        and the reader gets a copy on the same slot (:func:`~omnikv.connectors.shm.shared.claim`).
        """
        entry = self._entries.get(key)
        if entry is None:
            return None
        taken, stays = claim(entry)
        if not stays:
            del self._entries[key]
        return taken

    def pop_matching(self, match: Callable[[str], bool]) -> list[Entry]:
        """``cleanup``: the entries whose transport key matches leave (the caller frees them)."""
        return [self._entries.pop(k) for k in [k for k in self._entries if match(k)]]

    def clear(self) -> list[Entry]:
        """Close: stop the timer (see :meth:`join`) and hand back every entry (not freed)."""
        self._closed = True
        self._wake.notify_all()
        entries = list(self._entries.values())
        self._entries.clear()
        return entries

    def join(self) -> None:
        """After :meth:`clear`, without the lock: wait for the timer thread to leave."""
        if self._timer is not None and self._timer is not threading.current_thread():
            self._timer.join(timeout=5.0)

    # -- expiry -------------------------------------------------------------------------------
    def expire_due(self) -> None:
        """Free and report what expired. Called by a put before it allocates and by the timer;
        one float compare, without the lock, when nothing is due."""
        if time.monotonic() < self.next_expiry:
            return
        with self._changed:
            gone = self.reap(time.monotonic())
        self.report(gone)

    def reap(self, now: float) -> list[tuple[Entry, float]]:
        """(lock held) Free every entry expired at ``now`` (waking puts that wait for space);
        each with its age, for :meth:`report` once the lock is released."""
        if now < self.next_expiry or self._alloc is None:
            return []
        gone = [e for e in self._entries.values() if self.expiry(e) <= now]
        for e in gone:
            del self._entries[e.key]
            if drop_ref(e):  # a shared slot stays while readers hold it
                self._alloc.free(e.offset)
            self._counters.add("ttl_reaped")
            self._counters.add("ttl_reaped_bytes", e.nbytes)
        self.first_expiry()
        if gone:
            self._changed.notify_all()
        return [(e, now - e.published_at) for e in gone]

    def report(self, gone: list[tuple[Entry, float]]) -> None:
        """One WARNING per expired payload, and its ``expired`` verdict (lock not held)."""
        for e, age in gone:
            _outsider.warning(
                "shared-memory payload %s (%d bytes) expired unconsumed after %.1fs"
                " (buffer_ttl_seconds %g); its pool space is free again",
                e.key,
                e.nbytes,
                age,
                self.ttl_s,
            )
            if self._verdicts is not None:
                self._verdicts.expired(
                    e.label,
                    f"unconsumed for {age:.1f} s, past its TTL (buffer_ttl_seconds {self.ttl_s:g})",
                )

    def ack_watch_started(self, due: float) -> None:
        """(lock held) A verdict is due by ``due`` (monotonic): wake the timer if it sleeps
        past that (it then sleeps until the earliest ``ack_timeout_s`` watch)."""
        if due < self._sleeps_until:
            self._wake.notify()

    def _run(self) -> None:
        """The timer: sleep until the earliest expiry or ``ack_timeout_s`` watch (woken sooner
        by :meth:`add` when an earlier expiry is published, by :meth:`ack_watch_started`, and
        by :meth:`clear`), free and report what is due, again."""
        verdicts = self._verdicts
        while True:
            with self._changed:
                while not self._closed:
                    due = self.next_expiry
                    if verdicts is not None:
                        due = min(due, verdicts.next_due())
                    left = due - time.monotonic()
                    if left <= 0:
                        break
                    self._sleeps_until = due
                    self._wake.wait(min(left, 3600.0))
                    self._sleeps_until = math.inf
                if self._closed:
                    return
            self.expire_due()
            if verdicts is not None:
                verdicts.sweep()

    def first_expiry(self) -> float:
        """The earliest expiry of the entries now published (exact; kept as ``next_expiry``)."""
        self.next_expiry = min(map(self.expiry, self._entries.values()), default=math.inf)
        return self.next_expiry

    # -- making room for a newer payload ----------------------------------------------------------
    def grace_ends(self) -> float:
        """When the oldest payload published here passes its grace (monotonic; ``math.inf``
        when none is published)."""
        oldest = min((e.published_at for e in self._entries.values()), default=math.inf)
        return oldest + self.grace_s

    def make_room(self, fits: Callable[[], bool], now: float) -> list[tuple[Entry, float]]:
        """(lock held) A put found no space: free the payloads unclaimed for at least
        ``grace_s`` (``unclaimed_grace_seconds``), oldest first, until ``fits()``; each with its
        age, for :meth:`report_room` once the lock is released. Counted as
        ``grace_evicted`` / ``grace_evicted_bytes``."""
        if self._alloc is None:
            return []
        gone: list[tuple[Entry, float]] = []
        for entry in sorted(self._entries.values(), key=lambda e: e.published_at):
            if fits() or now - entry.published_at < self.grace_s:
                break
            del self._entries[entry.key]
            if drop_ref(entry):  # a shared slot stays while readers hold it
                self._alloc.free(entry.offset)
            self._counters.add("grace_evicted")
            self._counters.add("grace_evicted_bytes", entry.nbytes)
            gone.append((entry, now - entry.published_at))
        if gone:
            self.first_expiry()
        return gone

    def report_room(self, gone: list[tuple[Entry, float]], key: str) -> None:
        """One WARNING naming the payloads :meth:`make_room` freed for the put of ``key``, and
        their ``expired`` verdicts (lock not held)."""
        if not gone:
            return
        labels = [e.label for e, _ in gone]
        more = f" and {len(labels) - 16} more" if len(labels) > 16 else ""
        shown = ", ".join(labels[:16]) + more
        logger.warning(
            "pool full: freed %d payload(s) of %d bytes unclaimed for over %gs"
            " (unclaimed_grace_seconds), oldest first, to make room for %s: %s",
            len(gone),
            sum(e.nbytes for e, _ in gone),
            self.grace_s,
            key,
            shown,
        )
        if self._verdicts is not None:
            for e, age in gone:
                self._verdicts.expired(
                    e.label,
                    f"unclaimed for {age:.1f} s when the pool was full; freed for a newer payload"
                    f" (unclaimed_grace_seconds {self.grace_s:g})",
                )

    # -- what a full pool reports ---------------------------------------------------------------
    def refusal(self, slots_in_use: int, deadline: float, now: float) -> str | None:
        """Why a put that found no space at ``now`` should not wait until ``deadline``, or
        ``None`` (the rule: :meth:`SendStore.allocate`): every one of the ``slots_in_use`` holds
        a payload published here and claimed by no reader, none of them expires before
        ``deadline``, and the youngest has waited at least ``deadline - now``. Says how many
        payloads of how many bytes, their ages and when they expire."""
        entries = self._entries.values()
        if not entries or slots_in_use != len(entries) or self.first_expiry() < deadline:
            return None
        if any(e.share is not None and e.share.refs > 1 for e in entries):
            return None  # readers hold a shared slot: their releases free it
        if self.grace_ends() < deadline:
            return None  # the oldest makes room for this put before its deadline
        youngest = max(e.published_at for e in entries)
        if now - youngest < deadline - now:
            return None
        oldest = min(entries, key=lambda e: e.published_at)
        text = (
            f"the space in use is held by {len(entries)} published payload(s) of"
            f" {sum(e.nbytes for e in entries)} bytes that no receiver has claimed, the youngest"
            f" for {now - youngest:.1f}s (at least as long as this put may wait,"
            f" {max(0.0, deadline - now):.1f}s), the oldest ({oldest.label}) for"
            f" {now - oldest.published_at:.1f}s; "
        )
        text += (
            f"the oldest makes room for newer payloads {self.grace_s:g}s after its put"
            f" (unclaimed_grace_seconds), in {max(0.0, self.grace_ends() - now):.1f}s; "
        )
        if not self.ttl_s:
            return text + "buffer_ttl_seconds is 0, so they never expire"
        return text + (
            f"they expire {self.ttl_s:g}s after their put (buffer_ttl_seconds), the first in"
            f" {max(0.0, self.next_expiry - now):.1f}s, after this put's deadline"
        )

    def status(self, now: float) -> dict[str, Any]:
        """``published``, ``published_bytes``, ``oldest_published_s`` and
        ``youngest_published_s`` (ages in seconds; 0.0 when none), for ``health()``."""
        ages = [now - e.published_at for e in self._entries.values()]
        return {
            "published": len(ages),
            "published_bytes": sum(e.nbytes for e in self._entries.values()),
            "oldest_published_s": max(ages, default=0.0),
            "youngest_published_s": min(ages, default=0.0),
        }


class SendStore:
    """Sender-side state of one connector; thread-safe (one lock, never held while sending).

    Counts the events of :data:`COUNTER_NAMES` in ``counters`` (the connector's).
    """

    def __init__(
        self,
        pool_size: int,
        prefault: bool,
        send: Send,
        drop: Callable[..., None],
        *,
        counters: Counters,
        reserve: int = 0,
        lifetime: Lifetime = Lifetime(),
        verdicts: SentVerdicts | None = None,
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
        self._counters = counters
        #: Delivery verdicts of what is put here (``acks``); ``None``: not watched.
        self.verdicts = verdicts
        # claimed by no reader
        self._published = Unconsumed(
            lifetime.ttl_s, self._lock, self._changed, counters, verdicts, grace_s=lifetime.grace_s
        )
        self._held: dict[int, Entry] = {}
        self._wanters: dict[str, list[tuple[Link, int]]] = {}
        self._want_count: dict[Link, int] = {}
        self._next_token = 1
        self._waiting = 0  # puts waiting for space
        self.closed = False

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
                self._published.start(self.alloc)
            return self.alloc

    def pool_handle(self) -> tuple[int, int, int] | None:
        pool = self.pool
        fd = pool.fd if pool is not None else None
        return None if pool is None or fd is None else (self.pool_id, pool.size, fd)

    def allocate(self, key: str, nbytes: int, deadline: float) -> int:
        """A slot for ``nbytes``; called by a put before it writes (the pool exists).

        Takes free space when there is some (after freeing what expired). Otherwise it waits
        until ``deadline``, asking the readers that hold our payloads to give their slots back
        (``evict``), and then raises :class:`PoolExhaustedError` (counted as ``put_timeouts``).
        When no space is free, payloads published and unclaimed for at least
        ``unclaimed_grace_seconds`` are freed, oldest first, until the put fits (counted as
        ``grace_evicted``, logged with their keys, reported ``expired``): a full pool serves
        the newest hand-off, and payloads nobody comes for cannot starve a producer for the
        TTL. It raises at once when the payload can never fit, and at once (counted as
        ``put_pool_full``) when waiting cannot be expected to help: every slot in use holds a
        payload published here and claimed by no reader (none is held, offered or being
        written), none of them expires or passes its grace before ``deadline``, and even the
        youngest has waited
        unclaimed for at least as long as this put may still wait. Only a receiver coming for
        one of them could free space then, and none came for any of them in that long; a wait
        would hold the caller (and what it holds, e.g. an engine's KV blocks) for nothing. The
        message says how many payloads of how many bytes, their ages and when they expire.
        Raises ``ConnectorClosedError`` when the store closes meanwhile.
        """
        alloc = self.alloc
        assert alloc is not None and self.pool is not None
        if alloc.block_size(nbytes) > alloc.total:
            raise PoolExhaustedError(
                f"payload of {nbytes} bytes ({key}) can never fit the pool of {alloc.total} bytes;"
                " raise pool_size_bytes"
            )
        self._published.expire_due()
        t0 = time.monotonic()
        gone: list[tuple[Entry, float]] = []
        try:
            with self._lock:
                offset = self._alloc_or_make_room(alloc, nbytes, t0, gone)
                if offset is not None:
                    return offset
                return self._wait_for_space(alloc, key, nbytes, deadline, t0, gone)
        finally:
            self._published.report_room(gone, key)

    def _alloc_or_make_room(
        self, alloc: BufferAllocator, nbytes: int, now: float, gone: list[tuple[Entry, float]]
    ) -> int | None:
        """(lock held) A slot if one fits, after freeing payloads past their grace when none
        does (added to ``gone``, reported by the caller without the lock)."""
        offset = _try_alloc(alloc, nbytes)
        if offset is not None:
            return offset
        freed = self._published.make_room(
            lambda: alloc.block_size(nbytes) <= alloc.largest_free(), now
        )
        if not freed:
            return None
        gone.extend(freed)
        self._changed.notify_all()
        return _try_alloc(alloc, nbytes)

    def _wait_for_space(
        self,
        alloc: BufferAllocator,
        key: str,
        nbytes: int,
        deadline: float,
        t0: float,
        gone: list[tuple[Entry, float]],
    ) -> int:
        """(lock held, released while waiting) The rest of :meth:`allocate`: refuse at once,
        or wait for space until ``deadline``."""
        why = self._published.refusal(alloc.allocations, deadline, t0)
        if why is not None:
            self._counters.add("put_pool_full")
            raise PoolExhaustedError(
                f"{self._no_space(key, nbytes, t0)}; {why}: failing at once rather than"
                " waiting, as only a receiver taking one of them (or cleanup()) could free"
                " space before the deadline"
            )
        self._check_deadline(key, nbytes, deadline, t0)
        self._waiting += 1
        self._counters.add("put_waits")
        try:
            self._lock.release()  # readers are asked to give slots back without the lock
            try:
                self._evict(nbytes)
            finally:
                self._lock.acquire()
            while True:
                offset = self._alloc_or_make_room(alloc, nbytes, time.monotonic(), gone)
                if offset is not None:
                    return offset
                self._check_deadline(key, nbytes, deadline, t0)
                # woken by every free (a release, an expiry, a cleanup) and when the oldest
                # unclaimed payload passes its grace
                grace = self._published.grace_ends() - time.monotonic()
                self._changed.wait(max(0.001, min(remaining(deadline), grace, 3600.0)))
        finally:
            self._waiting -= 1

    def _check_deadline(self, key: str, nbytes: int, deadline: float, t0: float) -> None:
        """(lock held) Raise when a put waiting for space since ``t0`` must stop: closed, or
        ``deadline`` passed."""
        if self.closed:
            raise ConnectorClosedError("SharedMemoryConnector is closed")
        if remaining(deadline) > 0:
            return
        self._counters.add("put_timeouts")
        raise PoolExhaustedError(
            f"{self._no_space(key, nbytes, t0)}; {len(self._held)} payload(s) held by readers"
            f" that did not give them back, {len(self._published)} published and unconsumed"
        )

    def _no_space(self, key: str, nbytes: int, t0: float) -> str:
        alloc = self.alloc
        assert alloc is not None
        return (
            f"no space for {nbytes} bytes ({key}) after {time.monotonic() - t0:.3f}s: pool of"
            f" {alloc.total} bytes has {alloc.free_bytes()} free (largest"
            f" {alloc.largest_free()})"
        )

    def _evict(self, size: int) -> None:
        """The pool is full: ask every reader holding a slot to migrate it and release it.

        Called when a put starts to wait, and after every offer while one waits (a payload
        published while the pool was full is held only once a reader takes it)."""
        with self._lock:
            targets = [e for e in self._held.values() if not e.evicting and e.holder is not None]
            for e in targets:
                e.evicting = True
            self._counters.add("evictions", len(targets))
        for e in targets:
            if e.holder is not None:
                self._send(e.holder, [["evict", e.token]], None)
        if targets:
            logger.debug(
                "pool full (%d bytes wanted): asked %d holder(s) to evict", size, len(targets)
            )

    def free(self, entry: Entry) -> None:
        """Return an entry's slot (``self._lock`` held); a shared slot once no entry of its
        readers references it."""
        if self.alloc is not None and drop_ref(entry):
            self.alloc.free(entry.offset)
        self._changed.notify_all()

    # -- publishing ---------------------------------------------------------------------------
    def wanted(self, key: str) -> bool:
        """Whether a reader's blocking want for ``key`` is registered here now (a hint, read
        without the lock: a want may come or go right after)."""
        return key in self._wanters

    def publish(self, entry: Entry) -> bool:
        """A put's written entry becomes visible: offered to a waiting reader or published (its
        TTL runs from now); whether it was offered (a reader has it: nothing is left to find)."""
        entry.published_at = time.monotonic()
        if entry.share is not None:
            self._counters.add("shared_puts")
        if self.verdicts is not None:  # before the offer: a verdict may follow it at once
            self.verdicts.published(entry.key, entry.label)
        offered = self.deliver(entry)
        if self.pool is not None:  # after the write, so prefaulting ahead never competes with it
            self.pool.note_used(entry.offset + max(entry.nbytes, 1))
        self._counters.add("puts")
        self._counters.add("put_bytes", entry.nbytes)
        return offered

    def _hold(self, entry: Entry, link: Link, wid: int) -> list[Any]:
        """Mark ``entry`` as offered to ``link`` (lock held); the offer message to send."""
        entry.token = self._next_token
        self._next_token += 1
        entry.holder = link
        entry.evicting = False
        entry.sent = False
        self._held[entry.token] = entry
        msg: list[Any] = ["offer", wid, entry.token, entry.offset, entry.nbytes, entry.kind]
        if entry.share is not None:
            self._counters.add("shared_claims")
        # a shared slot's verdict is asked of the reader that takes its last claim
        entry.acks = self.verdicts is not None and (entry.share is None or entry.share.claims < 1)
        if entry.acks:
            msg.append(ACK_FLAG)  # the reader answers with its verdict (``acks``)
        return msg

    def _next_target(self, entry: Entry) -> tuple[Entry, Link, list[Any]] | None:
        """(lock held) Offer to the first live waiter (``entry``, or a claim on its shared
        slot), else publish (replacing) and ``None``."""
        queue = self._wanters.get(entry.key)
        target: tuple[Entry, Link, list[Any]] | None = None
        while queue and target is None:
            link, wid = queue.pop(0)
            self._want_count[link] = self._want_count.get(link, 1) - 1
            if link.alive:
                taken, _more = claim(entry)
                target = (taken, link, self._hold(taken, link, wid))
        if not queue:
            self._wanters.pop(entry.key, None)
        if target is None:
            old = self._published.add(entry)
            if old is not None:
                self._counters.add("replaced")
                _outsider.warning("key %s put again before it was consumed", entry.key)
                self.free(old)
        return target

    def deliver(self, entry: Entry) -> bool:
        """Offer ``entry`` to the first live waiter of its key, else publish it; whether it
        was offered (a shared entry: to as many waiters as it has claims, and published with
        the claims left; whether its last claim went)."""
        while True:
            with self._lock:
                if self.closed:
                    return False
                target = self._next_target(entry)
            if target is None:
                return False
            taken, link, offer = target
            self._offering(taken, link, offer[2])
            if self._send(link, [offer], self.pool_handle()):
                self._offer_sent(taken)
                if taken is entry:
                    return True
                continue  # a claim on a shared slot went: the next waiter, or publish
            self._take_back(taken, link, offer[2])
            if taken is not entry:
                with self._lock:
                    unclaim(taken)

    def _offering(self, entry: Entry, link: Link, token: int) -> None:
        """(lock not held) The offer of ``entry`` to ``link`` as ``token`` is about to be
        sent: the verdict is awaited from that link (recorded before the send, so a verdict
        never overtakes it)."""
        if self.verdicts is not None and entry.acks:
            self.verdicts.taken(entry.key, entry.label, link, token)

    def _take_back(self, entry: Entry, link: Link, token: int) -> None:
        """An offer could not be sent: the entry is ours again (lock not held)."""
        if self.verdicts is not None and entry.acks:
            self.verdicts.returned(entry.key, link, token)
        with self._lock:
            if self._held.get(entry.token) is entry:
                del self._held[entry.token]
            entry.holder = None

    # -- messages from readers ------------------------------------------------------------------
    def on_want(self, link: Link, wid: int, key: str, block: bool) -> None:
        over = False
        now = time.monotonic()
        with self._lock:
            # what expired is gone before the key is looked up: a late want misses
            gone = self._published.reap(now)
            entry = self._published.claim(key)
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
        self._published.report(gone)
        if over:
            self._drop(link, f"more than {MAX_WANTS_PER_LINK} outstanding wants")
            return
        if reply is None:
            return
        pool = self.pool_handle() if entry is not None else None
        if entry is not None:
            self._offering(entry, link, reply[2])
        if self._send(link, [reply], pool):
            if entry is not None:
                self._offer_sent(entry)
        elif entry is not None:
            self._take_back(entry, link, reply[2])
            if not self._return_claim(entry):
                self.deliver(entry)

    def _return_claim(self, entry: Entry) -> bool:
        """A claim on a shared slot comes back unused (its offer was not sent, or was
        returned): whether it went back to the share's published entry (else the caller
        publishes ``entry`` again: it carries the share's last claim)."""
        if entry.share is None:
            return False
        with self._lock:
            published = self._published.get(entry.key)
            if published is None or published is entry or published.share is not entry.share:
                return False
            unclaim(entry)
            return True

    def _offer_sent(self, entry: Entry) -> None:
        """The offer of ``entry`` left: it counts as consumed (flush); a put waiting for space
        asks its new holder to evict at once; the timer wakes for its ``ack_timeout_s``."""
        with self._lock:
            entry.sent = True
            self._changed.notify_all()
            waiting = self._waiting
            if self.verdicts is not None:
                self._published.ack_watch_started(time.monotonic() + self.verdicts.ack_timeout_s)
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
            published = self._published.get(entry.key)
            same_share = published is not None and published.share is entry.share
            if republish and entry.share is not None and same_share:  # the claim counts again
                unclaim(entry)
                self._counters.add("returns")
                self._changed.notify_all()
                return
            if not republish or entry.key in self._published:
                # released, or returned after a newer put of the key (the newer one wins)
                self._counters.add("releases")
                self.free(entry)
                republish = False
            else:
                self._counters.add("returns")
        if not republish:
            return
        if self.verdicts is not None and entry.acks:  # given back unused: unclaimed again
            self.verdicts.returned(entry.key, link, token)
        self.deliver(entry)

    def on_link_gone(self, link: Link) -> None:
        with self._lock:
            for token, entry in list(self._held.items()):
                if entry.holder is link:
                    del self._held[token]
                    entry.holder = None
                    self._counters.add("reclaimed_from_dead_readers")
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
            entries = self._published.pop_matching(match)
            for e in entries:
                self.free(e)
        labels = [e.label for e in entries]
        if self.verdicts is not None:
            self.verdicts.forget(labels)
        return labels

    def published_summary(self, key: str, limit: int) -> dict[str, Any]:
        """A probe's answer (``diag``): how many payloads are published here, the newest
        ``limit`` keys, whether ``key`` is one of them and, if so, its size."""
        with self._lock:
            entry = self._published.get(key)
            answer = {"n": len(self._published), "keys": self._published.newest(limit)}
            answer["has"] = entry is not None
            if entry is not None:
                answer["size"] = entry.nbytes
            return answer

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
        return [*self._published.entries(), *in_flight]

    def snapshot(self) -> dict[str, Any]:
        alloc = self.alloc
        pool = self.pool
        with self._lock:
            return {
                "pool_size_bytes": alloc.total if alloc else 0,
                "pool_free_bytes": alloc.free_bytes() if alloc else 0,
                "pool_largest_free": alloc.largest_free() if alloc else 0,
                **(pool.status() if pool else self._no_pool_status()),
                **self._published.status(time.monotonic()),
                "held_by_readers": len(self._held),
                "waiting_receivers": sum(len(q) for q in self._wanters.values()),
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
        """A put failed before it wrote (no space, closed)."""
        self._counters.add("put_failures")

    def write_slot(self, entry: Entry, write: Writer) -> None:
        """Let ``write`` fill the entry's slot (as numpy when it is a
        :class:`~omnikv.connectors.base.HostArrayWriter`); frees it if ``write`` raises."""
        pool = self.pool
        assert pool is not None
        try:
            if takes_host_arrays(write):
                cast(HostArrayWriter, write).write_host(pool.array(entry.offset, entry.nbytes))
            else:
                write(pool.view(entry.offset, entry.nbytes))
        except BaseException:
            with self._lock:
                self.free(entry)
                self._counters.add("put_failures")
            raise

    def close(self) -> list[str]:
        """Drop everything and stop the TTL timer; the labels of payloads dropped unconsumed."""
        with self._lock:
            self.closed = True
            dropped = sorted(e.label for e in self._published.clear())
            self._held.clear()
            self._wanters.clear()
            self._changed.notify_all()
        self._published.join()
        if self.alloc is not None:
            self.alloc.close()
        if self.pool is not None:
            self.pool.close()
        return dropped


def _try_alloc(alloc: BufferAllocator, nbytes: int) -> int | None:
    """A slot's offset if one fits now, else ``None`` (``ConnectorClosedError`` once closed)."""
    try:
        return alloc.alloc(max(nbytes, 1))[0]
    except PoolExhaustedError:
        return None
