"""The receiving core of the pull connectors: one wait loop, late arrivals and the quarantine.

Both pull receivers (Mooncake Transfer Engine, NIXL) receive a key the same way: ask its sender
for it (a long-poll: the sender answers once the key is published or the hold ends), start the
transfer into a slot of the receiver's registered pool once it is granted, and see it done. What
is around that is the same for both and lives here, in :class:`PullReceiver`:

* ``wait``: the loop of long-polls until the payload is in hand, the deadline passes (``None``,
  counted as a miss) or ``abort`` is set (each hold then lasts at most
  :data:`~omnikv.connectors.base.ABORT_POLL_S`); while a slot of the key is quarantined the
  hold is short (:data:`PARKED_HOLD_S`), since its transfer may finish any moment and become a
  late arrival; ``on_incoming`` hears the granted size before the transfer starts;
* ``take``: one ask without a hold, then the transfer (the reference-shaped ``get``);
* late arrivals (:class:`~omnikv.connectors.pull.connector.LateArrivals`): a transfer that
  finished after its receive gave up is handed to the next ``wait`` / ``take`` of its key and
  answers ``held`` (a probe);
* the quarantine (:mod:`omnikv.connectors.pull.quarantine`): a slot whose transfer may still be
  writing when its receive gives up is parked until the transfer is known over.

A backend supplies a :class:`PullBackend`: ``claim`` (ask the sender for a key, held at most a
given time: a grant with the payload's size, or ``None``) and ``transfer`` (start the transfer of
a grant into a receive slot and see it done: the buffer, ``None`` to ask again, or an error;
a transfer given up while it may still write puts its slot into :attr:`PullReceiver.quarantine`).
The Transfer Engine backend asks with ``query`` and is done when the sender answers its ``pull``
with ``done``; the NIXL backend asks with ``claim`` and is done when its own READ completes.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from omnikv.connectors.base import ABORT_POLL_S, ManagedBuffer, notify_incoming
from omnikv.connectors.counters import Counters
from omnikv.connectors.pool import HostPool
from omnikv.connectors.pull.connector import LateArrivals, transfer_budget_s
from omnikv.connectors.pull.control import Endpoint
from omnikv.connectors.pull.quarantine import Quarantine, Transfer
from omnikv.deadline import remaining
from omnikv.errors import ConnectorClosedError

__all__ = ["PARKED_HOLD_S", "Grant", "PullBackend", "PullReceiver"]

#: The hold of an ask while a slot of the same key is quarantined (it may become a late arrival).
PARKED_HOLD_S = 0.25


class Grant(Protocol):
    """What a sender granted: at least the payload's size (a backend adds its own fields)."""

    @property
    def size(self) -> int: ...


_G = TypeVar("_G", bound=Grant)


class PullBackend(Protocol[_G]):
    """What one pull engine supplies to :class:`PullReceiver` (called on the receiving thread)."""

    def claim(self, key: str, endpoint: Endpoint, deadline: float, hold_s: float) -> _G | None:
        """Ask ``endpoint`` for ``key``, the answer held at most ``hold_s`` (``0``: at once,
        ``math.inf``: up to the engine's long-poll cap) and never past ``deadline``: the grant,
        or ``None`` when it is not there (yet), the sender is unreachable or silent within its
        hold. Raises ``PeerGoneError`` for a sender that fell silent, ``ConnectorError`` for a
        refusal."""
        ...

    def transfer(self, grant: _G, deadline: float) -> ManagedBuffer | None:
        """Start the transfer of ``grant`` into a receive slot and see it done by ``deadline``:
        the filled slot, or ``None`` when it was not done (the sender took the grant back, or
        the deadline passed: the slot then went to the quarantine). Raises as ``claim`` and
        ``PoolExhaustedError`` when no slot freed up."""
        ...


class PullReceiver(Generic[_G]):
    """The wait loop, late arrivals and quarantine of one pull receiver (thread-safe).

    Built by a receiving side with its ``backend``; ``quarantine_interval_s`` and
    ``quarantine_name`` are its reaper's period and thread name, ``max_late`` bounds the late
    arrivals held (``None``: unbounded), ``peer_timeout_s`` bounds ``take``'s ask.
    """

    def __init__(
        self,
        backend: PullBackend[_G],
        pool: HostPool,
        counters: Counters,
        *,
        peer_timeout_s: float,
        quarantine_interval_s: float,
        quarantine_name: str,
        engine: str,
        max_late: int | None = None,
    ) -> None:
        self._backend = backend
        self._counters = counters
        self._peer_timeout_s = peer_timeout_s
        self._engine = engine
        self._closed = threading.Event()
        self.late = LateArrivals(pool, counters, limit=max_late)
        self.quarantine = Quarantine(
            pool,
            self.late,
            counters,
            interval_s=quarantine_interval_s,
            name=quarantine_name,
            closed=self._closed.is_set,
        )

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def park(self, qid: str, key: str, offset: int, size: int, transfer: Transfer) -> None:
        """Quarantine the slot at ``offset`` (called by a backend whose transfer may still
        write it when it gives up)."""
        self.quarantine.add(qid, key, offset, size, transfer)

    # -- receives (caller threads) -----------------------------------------------------------
    def wait(
        self,
        key: str,
        endpoint: Endpoint,
        deadline: float,
        on_incoming: Callable[[int], object] | None = None,
        abort: threading.Event | None = None,
    ) -> ManagedBuffer | None:
        """Ask, transfer and hand over ``key``; ``None`` at ``deadline`` (a miss: nothing was
        consumed) or once ``abort`` is set (each hold then lasts at most
        :data:`~omnikv.connectors.base.ABORT_POLL_S`; a transfer that started runs until
        ``deadline``). ``on_incoming`` hears the granted size before each transfer starts.
        Raises ``ConnectorClosedError`` once the receiver closes."""
        late = self.late.take(key)
        while late is None:
            if self.closed:
                raise ConnectorClosedError(f"{self._engine} is closed")
            if remaining(deadline) <= 0:
                self._counters.add("misses")
                return None
            parked = self.quarantine.holds(key)
            if abort is not None and abort.is_set():
                return None
            hold_s = PARKED_HOLD_S if parked else math.inf
            if abort is not None:
                hold_s = min(hold_s, ABORT_POLL_S)
            grant = self._backend.claim(key, endpoint, deadline, hold_s)
            if grant is not None:
                notify_incoming(on_incoming, grant.size)
                got = self._backend.transfer(grant, deadline)
                if got is not None:
                    return got
            late = self.late.take(key)
        return late

    def take(self, key: str, endpoint: Endpoint) -> ManagedBuffer | None:
        """One ask without a hold (within the peer timeout), then the transfer if granted (the
        reference-shaped ``get``); ``None`` (a miss) otherwise."""
        late = self.late.take(key)
        if late is not None:
            return late
        grant = self._backend.claim(key, endpoint, time.monotonic() + self._peer_timeout_s, 0.0)
        got = None
        if grant is not None:
            budget = time.monotonic() + transfer_budget_s(grant.size)
            got = self._backend.transfer(grant, budget)
        if got is None:
            self._counters.add("misses")
        return got

    def held(self, key: str) -> int | None:
        """The size of ``key`` when its transfer finished after its receive gave up (held here
        for the next receive), else ``None``."""
        return self.late.size(key)

    def cleanup(self, request_id: str) -> None:
        """Free the late arrivals of ``request_id``
        (:func:`~omnikv.connectors.base.matches_request`)."""
        self.late.cleanup(request_id)

    def stats(self) -> dict[str, int]:
        return {"quarantined": len(self.quarantine), "late_arrivals_held": len(self.late)}

    @property
    def reaper(self) -> threading.Thread | None:
        """The quarantine's reaper thread (started with the first quarantined slot)."""
        return self.quarantine.thread

    def close(self, timeout_s: float) -> list[Transfer]:
        """Stop receiving and the reaper; forget the late arrivals (the pool goes next) and hand
        back the transfers still quarantined (the engine cancels what it can)."""
        self._closed.set()
        left = self.quarantine.close(timeout_s)
        self.late.clear()
        return left
