"""Delivery verdicts of :mod:`omnikv.connectors.shm.connector` (see
:mod:`omnikv.connectors.delivery`): the receiver's verdict travels back to the sender over the
mesh link its offer came on.

Wire: an ``offer`` from a connector that takes verdicts ends with ``"ack"`` (a trailing
argument, ignored by older readers); the reader then answers, once it has used the payload,
``verdict(token, key, verdict[, reason])``: the offer's token and transport key, ``delivered``,
``refused`` or ``expired``, and a one-line reason of at most
:data:`~omnikv.connectors.delivery.MAX_REASON_CHARS` characters. A reader never sends a verdict
for an offer without ``"ack"``, so a sender of an older version (which would drop a peer that
sends a message it does not know) never sees one.

Sender (:class:`SentVerdicts`): every put is ``published``; a payload is watched as *taken* from
the moment its offer to a reader goes out (recorded just before the offer is sent, so a verdict
can never overtake the record) until its verdict. It ends once, as the first of:

* the reader's verdict, accepted only from the link the offer went to and only with that offer's
  token (a peer that did not take the key, or a second verdict, changes nothing: counted as
  ``acks_ignored``);
* ``expired`` when the payload stayed unclaimed past ``buffer_ttl_seconds`` (the TTL,
  :class:`~omnikv.connectors.shm.store.Unconsumed`), when the reader that took it is gone (its
  connection closed: it died, closed or was dropped) before its verdict, or when no verdict came
  within ``ack_timeout_s`` of the offer (swept by the store's timer thread and by ``health()``).

A reader that gives an offer back unused (``return``: its wait had ended) leaves the payload
unclaimed again; ``cleanup`` forgets what it drops (no verdict: its owner dropped it).

Receiver (:class:`TakenPayloads`): remembers, per transport key it took, the link and token of
that offer (bounded by :data:`MAX_TAKEN`, the oldest forgotten first; dropped when acknowledged
or when that link goes), so :meth:`TakenPayloads.acknowledge` can answer the right peer. It
never blocks longer than a control message's send on the mesh and never raises.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

from omnikv._logging import RateLimitedLog
from omnikv.connectors.counters import Counters
from omnikv.connectors.delivery import (
    Verdict,
    clip_reason,
)
from omnikv.connectors.verdict_book import VerdictBook

if TYPE_CHECKING:
    from omnikv.connectors.shm.mesh import Link, Mesh

__all__ = [
    "ACK_FLAG",
    "COUNTER_NAMES",
    "MAX_TAKEN",
    "SentVerdicts",
    "TakenPayloads",
]

logger = logging.getLogger(__name__)
_outsider = RateLimitedLog(logger)  # lines a peer, client or forger can cause

#: The trailing argument of an ``offer`` whose sender takes verdicts.
ACK_FLAG = "ack"
#: Most taken payloads a receiver remembers for their acknowledgement (the oldest forgotten).
MAX_TAKEN = 65536
#: The events counted for verdicts (in the connector's :class:`Counters`): verdicts received
#: (``acks_delivered``, ``acks_refused``), payloads that ended ``expired`` (TTL, reader gone,
#: ``ack_timeout_s``, or a reader's ``expired`` verdict), verdict frames that named nothing the
#: peer took (``acks_ignored``); on the receiving side, verdicts sent (``acks_sent``) and those
#: that could not be (``ack_failures``).
COUNTER_NAMES = (
    "acks_delivered",
    "acks_refused",
    "acks_expired",
    "acks_ignored",
    "acks_sent",
    "ack_failures",
)


class SentVerdicts:
    """The sending side's verdicts (see the module docstring): the mesh's terms on the
    connector's :class:`~omnikv.connectors.verdict_book.VerdictBook` (keyed by transport key;
    a taker is the ``(link, token)`` of the offer that took the payload).

    Owned by the connector and shared with its :class:`~omnikv.connectors.shm.store.SendStore`,
    which calls :meth:`published`, :meth:`taken`, :meth:`returned`, :meth:`expired` and
    :meth:`forget` (never with its own lock held) and asks :meth:`next_due` for its timer; the
    message dispatch calls :meth:`on_verdict`, the connector :meth:`link_gone` and
    :meth:`sweep`. Reports go to the book's listener (the sender's owner), once per key and
    publication.
    """

    def __init__(self, book: VerdictBook) -> None:
        self.book = book
        self.notices = book.notices

    @property
    def ack_timeout_s(self) -> float:
        return self.book.ack_timeout_s

    def published(self, key: str, label: str) -> None:
        """A put of ``label`` (transport key ``key``) is about to be offered or published: its
        verdict is due from now on; a verdict still owed for an earlier put of the key is no
        longer accepted (that publication was superseded)."""
        self.book.published(key, label)

    def taken(self, key: str, label: str, link: Link, token: int) -> None:
        """The payload of ``key`` is being offered to ``link`` as ``token``: only that link may
        give its verdict from now on, and the ``ack_timeout_s`` watch starts."""
        self.book.taken(key, (link, token))

    def returned(self, key: str, link: Link, token: int) -> None:
        """The offer ``token`` of ``key`` to ``link`` did not go out, or the reader gave it back
        unused: the payload is unclaimed again (no verdict from that reader is accepted, and
        its ``ack_timeout_s`` watch stops)."""
        self.book.returned(key, (link, token))

    def expired(self, label: str, reason: str) -> None:
        """The payload put as ``label`` ended without a verdict (its TTL): report ``expired``."""
        self.book.expired_label(label, reason)

    def forget(self, labels: list[str]) -> None:
        """``cleanup`` or ``withdraw`` dropped these unconsumed payloads: no verdict will be
        reported for them."""
        for label in labels:
            self.book.forget_label(label)

    def on_verdict(
        self, link: Link, token: int, key: str, verdict: Verdict, reason: str | None
    ) -> bool:
        """A checked verdict from ``link`` (``protocol.VerdictMsg``): reported when ``link`` took
        ``key`` as ``token`` and has not given its verdict yet; otherwise ignored, counted as
        ``acks_ignored`` and logged at DEBUG. Whether it was taken."""
        if self.book.settle(key, (link, token), verdict, reason):
            return True
        logger.debug("ignored a %s verdict for %s from %s", verdict.value, key, link)
        return False

    def link_gone(self, link: Link) -> None:
        """``link``'s peer is gone: what it took and did not acknowledge is ``expired``."""
        why = (
            f"the receiver that took it ({link.peer}, pid {link.pid}) went away before its verdict"
        )
        self.book.expire_taken_by(lambda taker: _link_of(taker) is link, why)

    def sweep(self) -> int:
        """Expire what was taken and not acknowledged within ``ack_timeout_s``; how many.
        Called by the store's timer thread when :meth:`next_due` passes, and by ``health()``."""
        return len(self.book.sweep())

    def next_due(self) -> float:
        """No ``ack_timeout_s`` watch runs out before this (monotonic; ``inf``: none)."""
        return self.book.next_due()

    def awaiting(self) -> int:
        """How many payloads were taken and wait for their verdict (``health()``)."""
        return self.book.awaiting()


def _link_of(taker: Hashable) -> Any:
    return taker[0] if isinstance(taker, tuple) else None


class TakenPayloads:
    """The receiving side's memory of whom each payload came from (see the module docstring);
    thread-safe.

    The connector calls :meth:`took` for every offer it accepted, :meth:`acknowledge` for a
    receiver's verdict and :meth:`link_gone` when a peer goes; counts ``acks_sent`` and
    ``ack_failures``.
    """

    def __init__(self, mesh: Mesh, counters: Counters) -> None:
        self._mesh = mesh
        self._counters = counters
        self._lock = threading.Lock()
        self._taken: OrderedDict[str, tuple[Link, int]] = OrderedDict()
        self._warned = False

    def took(self, key: str, link: Link, token: int, acks: bool) -> None:
        """An offer of ``key`` from ``link`` as ``token`` was accepted; remembered when its
        sender takes verdicts (``acks``: the offer said so)."""
        if not acks:
            return
        with self._lock:
            self._taken[key] = (link, token)
            self._taken.move_to_end(key)
            while len(self._taken) > MAX_TAKEN:
                self._taken.popitem(last=False)

    def acknowledge(self, key: str, verdict: Verdict, reason: object) -> None:
        """Send ``verdict`` (and its reason, one bounded line) for the payload taken as ``key``
        to the peer that offered it, once. Never raises; blocks at most as long as the mesh's
        send of one small frame. A key not taken here (or from a sender without verdicts) is
        logged at DEBUG; a verdict that cannot be sent is logged (a WARNING the first time, then
        DEBUG) and counted as ``ack_failures``: its sender then sees ``expired`` from its own
        watch."""
        try:
            with self._lock:
                took = self._taken.pop(key, None)
            if took is None:
                logger.debug(
                    "no verdict sent for %s: not taken here from a live peer that takes verdicts"
                    " (or already acknowledged)",
                    key,
                )
                return
            link, token = took
            msg = ["verdict", token, key, verdict.value, clip_reason(reason)]
            if self._mesh.send(link, [msg]):
                self._counters.add("acks_sent")
                return
            self._failed(key, f"the connection to {link} is closed")
        except Exception as exc:  # never into the receiver: its sender times out instead
            self._failed(key, f"{type(exc).__name__}: {exc}")

    def _failed(self, key: str, why: str) -> None:
        self._counters.add("ack_failures")
        log = logger.debug if self._warned else logger.warning
        self._warned = True
        log(
            "the verdict on shared-memory payload %s could not be sent (%s); its sender will"
            " report it expired",
            key,
            why,
        )

    def link_gone(self, link: Link) -> None:
        """``link``'s peer is gone: nothing taken from it can be acknowledged any more."""
        with self._lock:
            for k in [k for k, (lk, _t) in self._taken.items() if lk is link]:
                del self._taken[k]

    def pending(self) -> int:
        """How many taken payloads wait for this receiver's verdict (``health()``)."""
        with self._lock:
            return len(self._taken)
