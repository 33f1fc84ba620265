"""The sender's view of delivery: which requests' payloads were delivered, refused or expired.

Made by the transfer edge; called by :class:`~omnikv.transfer.send.KVSender` (``expect``
before a request's puts, ``settle`` after them), by the edge's streams (``expect_chunks`` as
each chunk is published, so that a verdict on a chunk that comes before the finish is kept
until the send settles) and by the sending connector's listener thread (``on_report``, one
:class:`~omnikv.connectors.delivery.DeliveryReport` per payload). A request with several keys
(TP ranks of the receiving stage) is ``delivered`` only when every key was, ``refused`` as soon
as one was refused, ``expired`` as soon as one expired (and none was refused). The manager's
``get_send_result`` shows the latest status; ``wait`` blocks (bounded) until a request's
verdict is in.

A send decided ``refused`` or ``expired`` takes back the keys nobody took (``withdraw``, the
edge's :meth:`~omnikv.connectors.base.OmniConnectorBase.withdraw` of the sending connector):
an early hand-off whose receiver refused a chunk after the finish leaves no tail published
until its TTL. A key that could not be taken back is listed for the streams to drop.

Reports may arrive before ``settle`` (a fast receiver acknowledges while the sender is still
putting the next key): ``expect`` registers the keys before the first put, so no report is lost.
Memory is bounded: at most ``capacity`` requests are watched (the oldest are dropped first).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from omnikv.connectors.delivery import DeliveryReport, Verdict
from omnikv.transfer.results import SendResult, SendStatus

__all__ = ["DeliveryBook"]

logger = logging.getLogger(__name__)

#: Unsettled keys kept for the streams to drop (the oldest beyond it are left to the TTL).
_MAX_UNSETTLED = 65536
_STATUS = {
    Verdict.DELIVERED: SendStatus.DELIVERED,
    Verdict.REFUSED: SendStatus.REFUSED,
    Verdict.EXPIRED: SendStatus.EXPIRED,
}


@dataclass
class _Watch:
    """One request's keys and their verdicts; ``result`` is ``None`` until its send settles
    (a stream's chunks are watched from their publication on)."""

    keys: frozenset[str]
    verdicts: dict[str, DeliveryReport] = field(default_factory=dict)
    result: SendResult | None = None
    #: when the send's first put was about to start (the hand-off clock, with its extract_ms)
    started: float = field(default_factory=time.perf_counter)


class DeliveryBook:
    """Request -> verdicts of its keys; the send results it updates (thread-safe)."""

    def __init__(
        self,
        record: Callable[[SendResult], object] | None = None,
        capacity: int = 4096,
        withdraw: Callable[[str], bool] | None = None,
    ) -> None:
        #: Called once with each result when its verdict is decided (the edge's metrics).
        self.record = record
        #: Takes back one untaken key of a refused or expired send; whether it went.
        self.withdraw = withdraw
        self.capacity = capacity
        self._cond = threading.Condition()
        self._watches: OrderedDict[str, _Watch] = OrderedDict()
        self._owner: dict[str, str] = {}  # key -> request id
        #: keys of refused or expired sends that had no verdict (nobody will take them)
        self._unsettled: list[str] = []

    def expect(self, request_id: str, keys: Iterable[str]) -> None:
        """``request_id`` is about to be published under ``keys`` (a re-send starts afresh;
        the verdicts its stream's chunks among ``keys`` already got are kept)."""
        watch = _Watch(frozenset(keys))
        with self._cond:
            old = self._watches.get(request_id)
            if old is not None and old.result is None:  # the chunks of this send's stream
                watch.verdicts = {k: r for k, r in old.verdicts.items() if k in watch.keys}
            self._drop(request_id)
            self._watch_locked(request_id, watch)

    def expect_chunks(self, request_id: str, keys: Iterable[str]) -> None:
        """A chunk of ``request_id``'s stream is about to be published under ``keys``: their
        verdicts are kept until the request's finish settles (:meth:`expect` then takes them
        over; :meth:`early` tells the finish about a refusal)."""
        keys = list(keys)
        with self._cond:
            watch = self._watches.get(request_id)
            if watch is None or watch.result is not None:
                self._drop(request_id)
                watch = _Watch(frozenset())
                self._watch_locked(request_id, watch)
            watch.keys = watch.keys | frozenset(keys)
            for key in keys:
                self._owner[key] = request_id

    def early(self, request_id: str) -> SendResult | None:
        """The verdict a receiver gave ``request_id``'s stream before its send settled, when it
        was not ``delivered`` (the worst of them: ``refused`` before ``expired``), as a result
        to settle the finish with; ``None`` when none came. Called by the sender's finish."""
        with self._cond:
            watch = self._watches.get(request_id)
            if watch is None or watch.result is not None:
                return None
            reports = [r for r in watch.verdicts.values() if r.verdict is not Verdict.DELIVERED]
        for verdict in (Verdict.REFUSED, Verdict.EXPIRED):
            hits = [r for r in reports if r.verdict is verdict]
            if hits:
                reason = "; ".join(f"{r.key}: {r.reason}" for r in hits if r.reason) or None
                return SendResult(request_id, _STATUS[verdict], reason=reason)
        return None

    def forget_unsent(self, request_id: str) -> None:
        """Stop watching ``request_id``'s stream (aborted before its finish); a settled send's
        watch stays."""
        with self._cond:
            watch = self._watches.get(request_id)
            if watch is not None and watch.result is None:
                self._drop(request_id)

    def take_unsettled(self) -> list[str]:
        """The keys of refused or expired sends that had no verdict when the send was decided
        (nobody will take them), each returned once: the edge's streams drop their chunks
        among them on the sender's thread."""
        with self._cond:
            keys, self._unsettled = self._unsettled, []
        return keys

    def _watch_locked(self, request_id: str, watch: _Watch) -> None:
        self._watches[request_id] = watch
        for key in watch.keys:
            self._owner[key] = request_id
        while len(self._watches) > self.capacity:
            self._drop(next(iter(self._watches)))

    def settle(self, result: SendResult) -> SendResult:
        """The send of ``result.request_id`` ended: watch it if it was sent, else forget it.
        Returns the result, with the verdict already applied when every report came first."""
        with self._cond:
            watch = self._watches.get(result.request_id)
            if watch is None:
                return result
            if result.status is not SendStatus.SENT:
                self._drop(result.request_id)
                return result
            watch.result = result
            final = self._apply(watch)
            untaken = self._untaken(watch, final)
            if not untaken:
                self._cond.notify_all()
        self._take_back(untaken)  # before waiters see the verdict: what it frees is free
        if final is not None and self.record is not None:
            self.record(final)
        return final or result

    def result(self, request_id: str) -> SendResult | None:
        """The watched send result of ``request_id`` with its verdict so far (``None``: not
        watched: never sent through a connector that acknowledges, or forgotten)."""
        with self._cond:
            watch = self._watches.get(request_id)
            return None if watch is None else watch.result

    def on_report(self, report: DeliveryReport) -> None:
        """The sending connector's listener: one payload's verdict."""
        changed: SendResult | None = None
        with self._cond:
            rid = self._owner.get(report.key)
            watch = None if rid is None else self._watches.get(rid)
            if watch is None or report.key in watch.verdicts:
                logger.debug("verdict for unwatched key %s ignored", report.key)
                return
            watch.verdicts[report.key] = report
            if watch.result is not None:
                changed = self._apply(watch)
            untaken = self._untaken(watch, changed)
            if not untaken:
                self._cond.notify_all()
        self._take_back(untaken)  # before waiters see the verdict: what it frees is free
        if changed is not None and self.record is not None:
            self.record(changed)

    @staticmethod
    def _untaken(watch: _Watch, decided: SendResult | None) -> list[str]:
        """(lock held) The keys without a verdict of a send just decided ``refused`` or
        ``expired``: nobody will take them."""
        if decided is None or decided.status is SendStatus.DELIVERED:
            return []
        return sorted(k for k in watch.keys if k not in watch.verdicts)

    def _take_back(self, keys: list[str]) -> None:
        """Withdraw ``keys`` from the sending connector (lock not held); those it could not
        take back are listed for :meth:`take_unsettled`; then the waiters wake."""
        if not keys:
            return
        left = keys
        if self.withdraw is not None:
            left = [k for k in keys if not self._withdrawn(k)]
            logger.debug("took back %d untaken key(s)", len(keys) - len(left))
        with self._cond:
            self._unsettled.extend(left)
            del self._unsettled[:-_MAX_UNSETTLED]
            self._cond.notify_all()

    def _withdrawn(self, key: str) -> bool:
        assert self.withdraw is not None
        try:
            return bool(self.withdraw(key))
        except Exception:  # a connector's failure: the key is left to the streams and the TTL
            logger.exception("withdrawing %s failed", key)
            return False

    def wait(self, request_id: str, timeout: float | None) -> SendResult | None:
        """Block until ``request_id``'s verdict is in or ``timeout`` s passed (``None``: no
        limit); the latest result then, ``None`` when the request is not watched."""
        end = None if timeout is None else time.monotonic() + max(0.0, timeout)
        with self._cond:
            while True:
                watch = self._watches.get(request_id)
                if watch is None or watch.result is None:
                    return None
                if watch.result.status is not SendStatus.SENT:
                    return watch.result
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return watch.result
                self._cond.wait(timeout=left)

    def _apply(self, watch: _Watch) -> SendResult | None:
        """The watched result with its verdict, once one is decided (the caller holds the lock).
        Once decided the watch stops taking reports (its keys are released)."""
        assert watch.result is not None
        if watch.result.status is not SendStatus.SENT:
            return None
        reports = list(watch.verdicts.values())
        worst = _decide(reports, watch.keys)
        if worst is None:
            return None
        reasons = [f"{r.key}: {r.reason}" for r in reports if r.verdict is worst and r.reason]
        reason = "; ".join(reasons) or None
        # the hand-off: the send call (its planning, extract_ms, came before expect) to this verdict
        timings = dict(watch.result.timings_ms)
        timings["handoff_ms"] = (time.perf_counter() - watch.started) * 1e3 + float(
            timings.get("extract_ms", 0.0)
        )
        watch.result = dataclasses.replace(
            watch.result, status=_STATUS[worst], reason=reason, timings_ms=timings
        )
        for key in watch.keys:
            if self._owner.get(key) == watch.result.request_id:
                del self._owner[key]
        return watch.result

    def _drop(self, request_id: str) -> None:
        watch = self._watches.pop(request_id, None)
        if watch is None:
            return
        for key in watch.keys:
            if self._owner.get(key) == request_id:
                del self._owner[key]


def _decide(reports: list[DeliveryReport], keys: frozenset[str]) -> Verdict | None:
    """Refused if any key was, then expired if any, delivered when every key was."""
    verdicts = {r.verdict for r in reports}
    if Verdict.REFUSED in verdicts:
        return Verdict.REFUSED
    if Verdict.EXPIRED in verdicts:
        return Verdict.EXPIRED
    if len(reports) == len(keys):
        return Verdict.DELIVERED
    return None
