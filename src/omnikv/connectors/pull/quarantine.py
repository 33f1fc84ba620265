"""Receive slots a transfer may still write into: the pull receivers' one quarantine.

Used by both pull receivers (Mooncake Transfer Engine, NIXL). When a receive gives up (its
deadline, a silent sender) while its transfer may still be writing into the slot it reserved,
the slot is *quarantined* instead of freed, so no later allocation is overwritten. A reaper
thread (started with the first quarantined slot) asks each slot's :class:`Transfer` what became
of it, every ``interval_s``: a transfer still running keeps its slot; one that finished makes the
slot a *late arrival* (:class:`~omnikv.connectors.pull.connector.LateArrivals`, handed to the next
receive of its key); one that failed, or was given up as dead, frees it (``quarantine_freed``).

The engines differ only in how a transfer is asked (:meth:`Transfer.outcome`): the Transfer
Engine receiver asks the sender (``status``), the NIXL receiver polls its own READ.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from omnikv._logging import RateLimitedLog
from omnikv.connectors.counters import Counters
from omnikv.connectors.pool import HostPool
from omnikv.connectors.pull.connector import LateArrivals

__all__ = ["Outcome", "Quarantine", "Transfer"]

logger = logging.getLogger(__name__)
_outsider = RateLimitedLog(logger)  # a slow or vanishing sender causes these lines


class Outcome(enum.Enum):
    """What a quarantined transfer has become."""

    RUNNING = "running"  # may still write: keep the slot
    DONE = "done"  # finished writing: the slot holds the payload
    GONE = "gone"  # failed, cancelled or given up as dead: nothing will write any more


class Transfer(Protocol):
    """One engine's handle on a quarantined transfer (called on the reaper thread)."""

    def outcome(self) -> Outcome:
        """What became of the transfer now; never raises."""
        ...


@dataclass
class _Slot:
    key: str
    offset: int
    size: int
    transfer: Transfer


class Quarantine:
    """Quarantined receive slots of one receiver, their reaper thread and what they become.

    Thread-safe. ``late`` receives the slots whose transfer finished; ``closed()`` says whether
    the receiver is closing (then a finished transfer's slot is freed, not kept).
    """

    def __init__(
        self,
        pool: HostPool,
        late: LateArrivals,
        counters: Counters,
        *,
        interval_s: float,
        name: str,
        closed: Callable[[], bool],
    ) -> None:
        self._pool = pool
        self._late = late
        self._counters = counters
        self._interval_s = interval_s
        self._name = name
        self._closed = closed
        self._lock = threading.Lock()
        self._slots: dict[str, _Slot] = {}
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None

    def add(self, qid: str, key: str, offset: int, size: int, transfer: Transfer) -> None:
        """Quarantine the slot at ``offset`` (``size`` bytes, for ``key``) until ``transfer``
        is known finished or gone. Counted as ``quarantine_events`` and logged."""
        with self._lock:
            self._slots[qid] = _Slot(key, offset, size, transfer)
            start = self._reaper is None and not self._stop.is_set()
            if start:
                self._reaper = threading.Thread(target=self._reap, name=self._name, daemon=True)
        self._counters.add("quarantine_events")
        _outsider.warning(
            "quarantined a %d-byte receive slot for %s (its transfer may still write)", size, key
        )
        if start and self._reaper is not None:
            self._reaper.start()

    def holds(self, key: str) -> bool:
        """Whether a slot of ``key`` is quarantined (its transfer may yet deliver it)."""
        with self._lock:
            return any(s.key == key for s in self._slots.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._slots)

    @property
    def thread(self) -> threading.Thread | None:
        return self._reaper

    def _reap(self) -> None:
        """Reaper thread: settle each slot whose transfer finished or is gone."""
        while not self._stop.wait(self._interval_s):
            with self._lock:
                items = list(self._slots.items())
            for qid, slot in items:
                if self._stop.is_set():
                    return
                outcome = slot.transfer.outcome()
                if outcome is not Outcome.RUNNING:
                    self._settle(qid, slot, outcome)

    def _settle(self, qid: str, slot: _Slot, outcome: Outcome) -> None:
        with self._lock:
            if self._slots.pop(qid, None) is None:
                return
        keep = outcome is Outcome.DONE and not self._closed()
        if keep and self._late.keep(slot.key, slot.offset, slot.size):
            logger.info("transfer of %s finished after its receiver gave up; kept", slot.key)
        else:
            self._pool.allocator.free(slot.offset)
            self._counters.add("quarantine_freed")

    def close(self, timeout_s: float) -> list[Transfer]:
        """Stop and join the reaper; forget every slot (the pool goes next) and hand back their
        transfers (the engine cancels what it can)."""
        self._stop.set()
        reaper = self._reaper
        if reaper is not None and reaper is not threading.current_thread():
            reaper.join(timeout=timeout_s)
        with self._lock:
            transfers = [s.transfer for s in self._slots.values()]
            self._slots.clear()
        return transfers
