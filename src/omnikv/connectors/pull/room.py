"""Room for a new put in a pull sender's full pool: unclaimed payloads past their grace go first.

Used by both pull senders (Mooncake Transfer Engine, NIXL). Their pool is one registered region
of fixed size, and a published payload holds its slot until a receiver pulls it or
``buffer_ttl_seconds`` (300 s) drops it. Payloads nobody comes for (a served deployment's
``do_remote_decode`` requests whose parameters are never used) would then make every newer put
wait until its deadline and fail, for the whole TTL (issue 39 item 9). So a put that finds no
space frees the payloads published at least ``unclaimed_grace_seconds`` ago (10 s) that no
receiver is pulling, oldest first, until it fits; a put within the grace waits for it (woken
when the oldest one passes it, or by any free). Each freed payload is counted
(``grace_evicted``), reported ``expired`` to the delivery listener and named in a rate-limited
WARNING. The shared-memory connector applies the same rule (:mod:`omnikv.connectors.shm.store`).

A sending side builds one :class:`PoolRoom` over its pool and its table of entries, saying
what "unclaimed" means for it (no pull in flight, no lease out) and how an entry is dropped;
the connector's ``put_packed`` reserves and fills each slot through :meth:`PoolRoom.fill`, then
has the side publish it.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, MutableMapping, Sequence
from typing import Any, Generic, Protocol, TypeVar

from omnikv._logging import RateLimitedLog
from omnikv.connectors.base import Writer
from omnikv.connectors.counters import Counters
from omnikv.connectors.pool import HostPool
from omnikv.connectors.pull.verdicts import SentVerdicts
from omnikv.deadline import remaining
from omnikv.errors import PoolExhaustedError

__all__ = [
    "DEFAULT_UNCLAIMED_GRACE_S",
    "MakeRoom",
    "PoolRoom",
    "Published",
    "evict_unclaimed",
    "fill_slot_making_room",
    "report_evicted",
]

logger = logging.getLogger(__name__)
_evictions = RateLimitedLog(logger)  # a client making unused hand-offs causes these lines

#: ``unclaimed_grace_seconds`` when the config has none (the shared-memory connector's too).
DEFAULT_UNCLAIMED_GRACE_S = 10.0
#: A put waiting for space looks again at least this often (a pull that failed makes its entry
#: unclaimed again without freeing anything, so nothing else wakes the wait for it).
_RECHECK_S = 1.0
#: At most this many keys are named in one WARNING (the counter has the total).
_NAMED = 16


class Published(Protocol):
    """A sender's published entry as :func:`evict_unclaimed` sees it."""

    @property
    def key(self) -> str: ...

    @property
    def size(self) -> int: ...

    @property
    def created(self) -> float: ...

    @property
    def pub(self) -> int: ...


_E = TypeVar("_E", bound=Published)

#: ``make_room(fits, now)``: free unclaimed entries past their grace, oldest first, until
#: ``fits()``; returns when the next unclaimed entry passes its grace (``math.inf``: none will).
MakeRoom = Callable[[Callable[[], bool], float], float]


def evict_unclaimed(
    entries: MutableMapping[str, _E],
    unclaimed: Callable[[_E], bool],
    drop: Callable[[_E], None],
    grace_s: float,
    fits: Callable[[], bool],
    now: float,
) -> tuple[list[_E], float]:
    """(the caller's lock held) Drop the ``unclaimed`` entries published at least ``grace_s``
    before ``now``, oldest first, until ``fits()``: ``(dropped, when the next unclaimed entry
    passes its grace)``. ``drop(entry)`` removes one from ``entries`` and frees its slot."""
    gone: list[_E] = []
    for entry in sorted((e for e in entries.values() if unclaimed(e)), key=lambda e: e.created):
        if fits():
            break
        if now - entry.created < grace_s:
            return gone, entry.created + grace_s
        drop(entry)
        gone.append(entry)
    return gone, math.inf


def report_evicted(
    gone: Sequence[Published],
    for_key: str,
    grace_s: float,
    counters: Counters,
    verdicts: SentVerdicts,
    now: float,
) -> None:
    """Count the entries :func:`evict_unclaimed` dropped for the put of ``for_key``, report each
    ``expired`` and name them in one (rate-limited) WARNING; called without the side's lock."""
    if not gone:
        return
    counters.add("grace_evicted", len(gone))
    keys = [e.key for e in gone]
    more = f" and {len(keys) - _NAMED} more" if len(keys) > _NAMED else ""
    _evictions.warning(
        "pool full: freed %d payload(s) of %d bytes unclaimed for over %gs"
        " (unclaimed_grace_seconds), oldest first, to make room for %s: %s%s",
        len(gone),
        sum(e.size for e in gone),
        grace_s,
        for_key,
        ", ".join(keys[:_NAMED]),
        more,
    )
    for e in gone:
        verdicts.expired(
            e.key,
            e.pub,
            f"unclaimed for {now - e.created:.1f} s when the pool was full; freed for a newer"
            f" payload (unclaimed_grace_seconds {grace_s:g})",
        )


def fill_slot_making_room(
    pool: HostPool, nbytes: int, write: Writer, deadline: float, make_room: MakeRoom
) -> int:
    """Reserve ``nbytes`` in ``pool`` and let ``write`` fill the slot; its offset (called by
    a pull sender's ``put_packed``).

    When nothing fits, ``make_room`` frees unclaimed payloads past their grace; otherwise the
    put waits for a free, for the oldest unclaimed payload to pass its grace, or until
    ``deadline`` (absolute monotonic; ``0``: no wait), then raises
    :class:`~omnikv.errors.PoolExhaustedError`. If ``write`` raises, the slot is freed and the
    exception propagates."""
    if nbytes <= 0:
        raise ValueError(f"nbytes must be > 0, got {nbytes}")
    alloc = pool.allocator
    need = alloc.block_size(nbytes)

    def fits() -> bool:
        return need <= alloc.largest_free()

    while True:
        now = time.monotonic()
        next_grace = math.inf if fits() else make_room(fits, now)
        until = min(deadline, next_grace, now + _RECHECK_S) if deadline else 0.0
        try:
            offset, _ = alloc.alloc(nbytes, deadline=until)
            break
        except PoolExhaustedError:
            if not deadline or remaining(deadline) <= 0 or need > alloc.total:
                raise
    try:
        write(pool.slot(offset, nbytes))
    except BaseException:
        alloc.free(offset)
        raise
    return offset


class PoolRoom(Generic[_E]):
    """A pull sender's pool under the grace rule: one per sending side, built with it, shared by
    every ``put_packed`` call. ``entries`` and ``lock`` are the side's own table and the lock
    that guards it; ``unclaimed(entry)`` says whether no receiver is taking the entry;
    ``drop_locked(entry)`` (called with ``lock`` held) removes it from ``entries`` and frees its
    slot."""

    def __init__(
        self,
        pool: HostPool,
        *,
        entries: MutableMapping[str, _E],
        lock: Any,
        unclaimed: Callable[[_E], bool],
        drop_locked: Callable[[_E], None],
        grace_s: float,
        counters: Counters,
        verdicts: SentVerdicts,
    ) -> None:
        self._pool, self._entries, self._lock = pool, entries, lock
        self._unclaimed, self._drop_locked = unclaimed, drop_locked
        self._grace_s, self._counters, self._verdicts = grace_s, counters, verdicts

    def fill(self, key: str, nbytes: int, write: Writer, deadline: float) -> int:
        """Reserve ``nbytes`` for the put of ``key`` and let ``write`` fill the slot; its offset
        (:func:`fill_slot_making_room`, unclaimed entries past their grace freed first and
        reported once the lock is released)."""
        evicted: list[_E] = []

        def make_room(fits: Callable[[], bool], now: float) -> float:
            with self._lock:
                gone, next_grace = evict_unclaimed(
                    self._entries, self._unclaimed, self._drop_locked, self._grace_s, fits, now
                )
            evicted.extend(gone)
            return next_grace

        try:
            return fill_slot_making_room(self._pool, nbytes, write, max(0.0, deadline), make_room)
        finally:
            report_evicted(
                evicted, key, self._grace_s, self._counters, self._verdicts, time.monotonic()
            )
