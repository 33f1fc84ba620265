"""Sessions and epochs: each payload is used once, and a restarted sender supersedes its past.

The sender side (:class:`SenderStamps`, owned by :class:`~omnikv.transfer.send.KVSender`) writes
a :class:`~omnikv.wire.format.Stamp` into every payload header: a random session id (one per
sender object), an epoch (the sender's start time in nanoseconds, so a restarted sender's epoch
is larger as long as the host's clock does not go back), a sequence number per payload, and the
configured ``instance_id`` when there is one.

The receiver side (:class:`SessionGuard`, called by :class:`~omnikv.transfer.receive.KVReceiver`
for every payload it decodes) refuses, with a typed error and a count:

* a **duplicate**: a ``(session, sequence)`` it has already taken (a put retried after an
  ambiguous failure that had in fact succeeded, or a payload replayed). Transports consume each
  key once; this catches the same payload arriving again under any key.
* a payload from an **old epoch** of a named instance: once a payload of instance ``X`` at epoch
  ``E`` was taken, a payload of ``X`` at an epoch below ``E`` was sent by an incarnation that has
  since restarted, and is refused. Unnamed senders are never ordered against each other.

**Check, then remember.** A stamp is checked when its payload is decoded, but remembered only
once the payload passed every check it gets (:class:`PendingStamps`): the receive's ``check``
(the vLLM consumer's MAC), or ``on_chunk`` for a chunk handed over as it arrives. A refused
payload (a forgery with a huge epoch, or with a genuine sender's session and next sequence
numbers, refused for its MAC) leaves both memories exactly as they were, so nobody without the
secret can make a later genuine payload fail.

Both memories are bounded (least recently seen dropped first): a duplicate older than
``capacity`` payloads is no longer recognised, which the transports' consume-once and TTLs make
harmless. A receiver that restarts starts with empty memories (a new epoch of its own); what its
earlier incarnation consumed is gone from the transports already.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import threading
import time
from collections import OrderedDict

from omnikv.errors import PayloadRefused
from omnikv.metrics import TransferMetrics
from omnikv.wire.format import Stamp

__all__ = ["DuplicatePayload", "PendingStamps", "SenderStamps", "SessionGuard", "StalePayload"]

logger = logging.getLogger(__name__)

#: Payloads remembered per receiver for duplicate detection.
DEFAULT_SEEN = 65536
#: Named sender instances whose newest epoch a receiver remembers.
DEFAULT_INSTANCES = 4096


class DuplicatePayload(PayloadRefused):
    """The payload's ``(session, sequence)`` was already taken by this receiver."""


class StalePayload(PayloadRefused):
    """The payload comes from an older epoch of its instance than one already taken."""


class SenderStamps:
    """The stamps of one sender: a session and epoch fixed at creation, a sequence per payload.

    Thread-safe (``next`` may be called from several send threads)."""

    def __init__(self, instance_id: str | None = None) -> None:
        self.instance_id = instance_id
        self.session = secrets.token_hex(8)
        self.epoch = time.time_ns()
        self._seq = itertools.count()
        self._lock = threading.Lock()

    def next(self) -> dict[str, object]:
        """The header fields of the next payload's stamp."""
        with self._lock:
            seq = next(self._seq)
        stamp: dict[str, object] = {"s": self.session, "e": self.epoch, "q": seq}
        if self.instance_id is not None:
            stamp["i"] = self.instance_id
        return stamp


class SessionGuard:
    """One receiver's memory of the stamps it took (thread-safe, bounded)."""

    def __init__(
        self,
        metrics: TransferMetrics | None = None,
        *,
        seen: int = DEFAULT_SEEN,
        instances: int = DEFAULT_INSTANCES,
    ) -> None:
        self.metrics = metrics
        self._cap_seen, self._cap_instances = seen, instances
        self._seen: OrderedDict[tuple[str, int], None] = OrderedDict()
        self._newest: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()
        self.counts = {"duplicates": 0, "stale_epoch": 0}

    def admit(self, stamp: Stamp | None, request_id: str) -> None:
        """Check ``stamp`` and remember it at once: for a payload that gets no other check.
        Raises :class:`DuplicatePayload` / :class:`StalePayload` (counted). A payload that is
        checked further (a MAC, the consumer's ``check`` or ``on_chunk``) goes through
        :meth:`pending` instead, so that a refused one leaves no mark."""
        self.check(stamp, request_id)
        self.remember(stamp, request_id)

    def pending(self) -> PendingStamps:
        """A new, empty :class:`PendingStamps` of this guard (one per receive or chunk)."""
        return PendingStamps(self)

    def check(self, stamp: Stamp | None, request_id: str) -> None:
        """Raise :class:`DuplicatePayload` / :class:`StalePayload` (counted) when ``stamp``'s
        payload must be refused; change nothing else. ``None`` (a payload without a stamp: the
        reference's encoder, an older omnikv) passes unchecked."""
        if stamp is None:
            return
        with self._lock:
            error = self._refusal(stamp, request_id)
        if error is not None:
            self._refuse(error)

    def remember(self, stamp: Stamp | None, request_id: str) -> None:
        """Take ``stamp``'s payload for good: called once it passed every check it gets.
        Checks again under the same lock (two copies of one payload checked at once: the second
        to be remembered is refused) and raises as :meth:`check` does."""
        if stamp is None:
            return
        with self._lock:
            error = self._refusal(stamp, request_id)
            if error is None:
                self._remember((stamp.s, stamp.q), stamp)
                return
        self._refuse(error)

    def _refusal(self, stamp: Stamp, request_id: str) -> PayloadRefused | None:
        """Why ``stamp``'s payload is refused (called with the lock held), counted; reads only
        the memories (their order included)."""
        if (stamp.s, stamp.q) in self._seen:
            self.counts["duplicates"] += 1
            return DuplicatePayload(
                f"payload {stamp.q} of sender session {stamp.s} for {request_id} was "
                "already received (duplicate)"
            )
        if stamp.i is not None and stamp.e < self._newest.get(stamp.i, stamp.e):
            self.counts["stale_epoch"] += 1
            return StalePayload(
                f"payload for {request_id} comes from an old epoch of sender instance "
                f"{stamp.i!r} ({stamp.e} < {self._newest[stamp.i]}: it has restarted since)"
            )
        return None

    def _refuse(self, error: PayloadRefused) -> None:
        kind = "duplicates" if isinstance(error, DuplicatePayload) else "stale_epoch"
        logger.debug("refused KV payload: %s", error)  # the receive's result says it too
        if self.metrics is not None:
            self.metrics.record("guard", kind, 0, {})
        raise error

    def _remember(self, ident: tuple[str, int], stamp: Stamp) -> None:
        self._seen[ident] = None
        while len(self._seen) > self._cap_seen:
            self._seen.popitem(last=False)
        if stamp.i is not None:
            self._newest[stamp.i] = max(stamp.e, self._newest.get(stamp.i, stamp.e))
            self._newest.move_to_end(stamp.i)
            while len(self._newest) > self._cap_instances:
                self._newest.popitem(last=False)


class PendingStamps:
    """The stamps of payloads checked by a :class:`SessionGuard` but not yet remembered.

    Made by :meth:`SessionGuard.pending` for one receive (its tail and chunks) or one chunk
    handed to ``on_chunk``: :meth:`admit` checks a stamp and holds it, :meth:`commit` remembers
    every stamp held once the payload passed every later check (the consumer's MAC among
    them). A receive that is refused never commits, so a forged payload (which can carry any
    stamp: a huge epoch, a genuine sender's session and next sequence numbers) changes nothing
    a later genuine payload is judged by. Not thread-safe: one receive's thread uses it."""

    def __init__(self, guard: SessionGuard) -> None:
        self.guard = guard
        self._held: list[tuple[Stamp, str]] = []

    def admit(self, stamp: Stamp | None, request_id: str) -> None:
        """Check ``stamp`` (raises as :meth:`SessionGuard.check`) and hold it."""
        self.guard.check(stamp, request_id)
        if stamp is not None:
            self._held.append((stamp, request_id))

    def commit(self) -> None:
        """Remember every stamp held (raises as :meth:`SessionGuard.remember` for one that a
        copy remembered meanwhile; those before it stay remembered) and forget them here."""
        held, self._held = self._held, []
        for stamp, request_id in held:
            self.guard.remember(stamp, request_id)
