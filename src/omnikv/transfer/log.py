"""Bounded, thread-safe logs of per-request outcomes (the edge's ``send_result`` /
``receive_result`` views, the seed facade's ``get_*_result``).

Next to the metrics: the metrics count outcomes, these logs keep the latest outcome of each of the
most recent requests (default 4096), oldest forgotten first, so a long-running stage never grows.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Generic, TypeVar

from omnikv.metrics import TransferMetrics
from omnikv.transfer.results import ReceiveResult, SendResult, SendStatus

__all__ = ["DEFAULT_KEPT", "ResultLog", "TransferLog"]

DEFAULT_KEPT = 4096
_VERDICTS = (SendStatus.DELIVERED, SendStatus.REFUSED, SendStatus.EXPIRED)

T = TypeVar("T")


class ResultLog(Generic[T]):
    """``request_id -> latest outcome``, at most ``capacity`` entries (oldest dropped first)."""

    def __init__(self, capacity: int = DEFAULT_KEPT) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._items: OrderedDict[str, T] = OrderedDict()
        self._lock = threading.Lock()

    def record(self, key: str, value: T) -> None:
        """Store ``value`` as the latest outcome of ``key`` (moves it to the newest end)."""
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def get(self, key: str) -> T | None:
        """The latest outcome of ``key``, or ``None`` when unknown (or already forgotten)."""
        with self._lock:
            return self._items.get(key)

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)


class TransferLog:
    """Send and receive outcomes of one transfer edge: the latest per request, plus the metrics.

    The receive log keeps the outcome, not the tensors (holding them would pin pool memory).
    """

    def __init__(self, metrics: TransferMetrics, capacity: int = DEFAULT_KEPT) -> None:
        self.metrics = metrics
        self.sends: ResultLog[SendResult] = ResultLog(capacity)
        # a receive's fields but its KV, as a tuple (built on the receiver's return path; the
        # ReceiveResult is made when asked for, see :meth:`receive_result`)
        self._receives: ResultLog[tuple[Any, ...]] = ResultLog(capacity)
        #: The results of the latest batch of sends, in order.
        self.last_sends: list[SendResult] = []

    def sent(self, results: list[SendResult]) -> list[SendResult]:
        for r in results:
            self.sends.record(r.request_id, r)
            # a verdict that came in before the batch ended is counted by ``delivered``
            status = "sent" if r.status in _VERDICTS else r.status.value
            self.metrics.record("send", status, r.nbytes, r.timings_ms)
        self.last_sends = results
        return results

    def delivered(self, result: SendResult) -> None:
        """Count a send's verdict (``delivery.delivered`` / ``.refused`` / ``.expired``)."""
        self.metrics.record("delivery", result.status.value, result.nbytes, {})

    def received(self, result: ReceiveResult) -> ReceiveResult:
        """Log ``result`` (without its KV) and count it; returns it."""
        kept = (
            result.status,
            result.nbytes,
            result.keys,
            result.reason,
            result.waited_s,
            result.timings_ms,
        )
        self._receives.record(result.request_id, kept)
        self.metrics.record("recv", result.status.value, result.nbytes, result.timings_ms)
        return result

    def receive_result(self, request_id: str) -> ReceiveResult | None:
        """The latest receive outcome of ``request_id`` without its KV (``None``: unknown)."""
        kept = self._receives.get(request_id)
        return None if kept is None else ReceiveResult(request_id, kept[0], None, *kept[1:])
