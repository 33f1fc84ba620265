"""Delivery acknowledgements: how a sender learns what became of a payload it published.

A receive ends with a verdict on each payload it took: ``delivered`` (decoded and accepted by
every check the receiver runs, the caller's included) or ``refused`` (taken, then rejected, with
the receiver's reason). The receiver hands the verdict to its connector
(:meth:`~omnikv.connectors.base.OmniConnectorBase.acknowledge`), which carries it back to the
sending connector on the transport's own control path. A payload nobody takes ends ``expired``:
its time to live ran out at the sender, or the receiver that took it went away (or stayed silent
past ``ack_timeout_s``) without a verdict. The sending connector reports each verdict once, as a
:class:`DeliveryReport`, to the listener its owner installed
(:meth:`~omnikv.connectors.base.OmniConnectorBase.set_delivery_listener`); the transfer layer
turns reports into the send results' ``delivered`` / ``refused`` / ``expired``.

:class:`DeliveryNotices` is the sending connector's side of that: a listener slot, one report per
key and publication, and the watch on payloads taken but not yet acknowledged. Every connector
that acknowledges uses it, so the rules are the same everywhere; the transports (shared memory,
the pull connectors, the Store) use it through :class:`~omnikv.connectors.verdict_book.VerdictBook`,
which adds who took each publication and which verdict may settle it.

Verdicts from outside the process are hostile input like any other: a transport bounds the key
and reason it accepts (:data:`MAX_KEY_CHARS`, :data:`MAX_REASON_CHARS`) and reports a verdict
only for a key it published and has not reported yet, so a peer can neither invent deliveries
nor overwrite one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from omnikv._logging import RateLimitedLog

__all__ = [
    "DEFAULT_ACK_TIMEOUT_S",
    "MAX_KEY_CHARS",
    "MAX_REASON_CHARS",
    "DeliveryListener",
    "DeliveryNotices",
    "DeliveryReport",
    "Verdict",
    "clip_reason",
]

logger = logging.getLogger(__name__)
_outsider = RateLimitedLog(logger)  # lines a peer, client or forger can cause

#: Seconds a payload may stay taken by a receiver without a verdict before it counts as expired.
DEFAULT_ACK_TIMEOUT_S = 60.0
#: Longest key a verdict may name (keys are built from request ids, bounded far below this).
MAX_KEY_CHARS = 1024
#: Longest reason a verdict carries; longer ones are cut.
MAX_REASON_CHARS = 512
#: Most keys a sending connector watches for a verdict (the oldest are dropped with a warning).
MAX_WATCHED = 65536


class Verdict(str, Enum):
    """What became of one published payload."""

    DELIVERED = "delivered"
    REFUSED = "refused"
    EXPIRED = "expired"


@dataclass(frozen=True)
class DeliveryReport:
    """One payload's verdict, as the sending connector reports it: ``key`` is the key given to
    ``put`` / ``put_packed``; ``reason`` says why for ``refused`` and ``expired``."""

    key: str
    verdict: Verdict
    reason: str | None = None


DeliveryListener = Callable[[DeliveryReport], object]


def clip_reason(reason: object) -> str | None:
    """``reason`` as one bounded line (``None`` stays ``None``)."""
    if reason is None:
        return None
    text = " ".join(str(reason).split())
    return text if len(text) <= MAX_REASON_CHARS else text[: MAX_REASON_CHARS - 3] + "..."


class DeliveryNotices:
    """The sending connector's verdict bookkeeping (thread-safe).

    ``published(key)`` when a put succeeded; ``taken(key)`` when a receiver took it (starts the
    ``ack_timeout_s`` watch); ``report(key, verdict, reason)`` when the verdict is known (from the
    receiver's acknowledgement, the TTL, or the receiver's death). A key is reported at most once
    per publication; a report for a key not published (or already reported) is ignored and
    ``False`` returned. :meth:`sweep` expires taken keys whose watch ran out; the connector calls
    it from a timer it already runs. The listener is called outside the lock and never raises
    into the connector.
    """

    def __init__(self, ack_timeout_s: float = DEFAULT_ACK_TIMEOUT_S) -> None:
        self.ack_timeout_s = float(ack_timeout_s)
        self._listener: DeliveryListener | None = None
        self._lock = threading.Lock()
        # key -> deadline of its acknowledgement (inf until taken)
        self._open: OrderedDict[str, float] = OrderedDict()

    def set_listener(self, listener: DeliveryListener | None) -> None:
        self._listener = listener

    @property
    def listening(self) -> bool:
        return self._listener is not None

    def published(self, key: str) -> None:
        with self._lock:
            self._open[key] = float("inf")
            self._open.move_to_end(key)
            dropped = len(self._open) - MAX_WATCHED
            for _ in range(max(0, dropped)):
                old, _deadline = self._open.popitem(last=False)
                _outsider.warning(
                    "no verdict kept for %s: more than %d payloads open", old, MAX_WATCHED
                )

    def taken(self, key: str, now: float | None = None) -> None:
        with self._lock:
            if key in self._open:
                self._open[key] = (time.monotonic() if now is None else now) + self.ack_timeout_s

    def is_open(self, key: str) -> bool:
        with self._lock:
            return key in self._open

    def forget(self, key: str) -> None:
        """The key's payload is gone without a verdict to give (cleanup by its owner)."""
        with self._lock:
            self._open.pop(key, None)

    def report(self, key: str, verdict: Verdict, reason: object = None) -> bool:
        with self._lock:
            if self._open.pop(key, None) is None:
                return False
        self._emit(DeliveryReport(key, verdict, clip_reason(reason)))
        return True

    def sweep(self, now: float | None = None) -> int:
        """Expire every taken key whose acknowledgement is overdue; how many were expired."""
        now = time.monotonic() if now is None else now
        with self._lock:
            due = [k for k, d in self._open.items() if d <= now]
            for k in due:
                del self._open[k]
        why = f"taken by a receiver that sent no verdict within {self.ack_timeout_s:g} s"
        for k in due:
            self._emit(DeliveryReport(k, Verdict.EXPIRED, why))
        return len(due)

    def next_due(self) -> float:
        """The earliest acknowledgement deadline (``inf``: none is watched)."""
        with self._lock:
            return min(self._open.values(), default=float("inf"))

    def _emit(self, report: DeliveryReport) -> None:
        logger.debug("delivery of %s: %s (%s)", report.key, report.verdict.value, report.reason)
        listener = self._listener
        if listener is None:
            return
        try:
            listener(report)
        except Exception:
            logger.exception("delivery listener failed on %s", report.key)
