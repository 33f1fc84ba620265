"""Counters and phase histograms for sends and receives; Prometheus export on demand.

Each manager records one observation per request (outcome, bytes, phase timings) into its own
:class:`TransferMetrics` (``manager.metrics.snapshot()``) and into the process-wide totals.
An application that serves ``/metrics`` with ``prometheus_client`` calls :func:`register` once
(``pip install omnikv[metrics]``); its scrapes then include, summed over every manager of the
process:

* ``omnikv_requests_total{direction, status}`` (counter),
* ``omnikv_bytes_total{direction}`` (counter),
* ``omnikv_phase_seconds{direction, phase}`` (histogram; buckets :data:`BUCKETS_MS` / 1000).
  ``direction="delivery", phase="handoff"`` is the end-to-end hand-off of a sending manager's
  edge: from its send call to the receiver's verdict on it (``delivered``, ``refused``,
  ``expired``), for connectors that report verdicts (every built-in one).

Prometheus computes percentiles from the histogram (``histogram_quantile(0.99, ...)``);
:meth:`TransferMetrics.snapshot` gives them directly (``p50``/``p90``/``p99``, interpolated within
a bucket as Prometheus does, and kept inside the smallest and largest value seen). To serve
``/metrics`` without an application server of one's own, :func:`serve` starts
``prometheus_client``'s HTTP endpoint (loopback by default)::

    server = omnikv.metrics.serve(9400)      # http://127.0.0.1:9400/metrics
    ...
    server.close()

Recording is cheap and thread-safe and never raises; ``prometheus_client`` is imported only by
:func:`register` and :func:`serve`.
"""

from __future__ import annotations

import math
import threading
import weakref
from bisect import bisect_left
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from prometheus_client.metrics_core import Metric
    from prometheus_client.registry import CollectorRegistry

__all__ = [
    "BUCKETS_MS",
    "PERCENTILES",
    "MetricsServer",
    "TransferMetrics",
    "register",
    "serve",
    "unregister",
]

#: Histogram bucket upper bounds in milliseconds (1-2-5 steps from 1 us to 30 s: a hand-off
#: on one node takes tens of microseconds, its percentiles need buckets that small).
BUCKETS_MS: tuple[float, ...] = (
    0.001,
    0.002,
    0.005,
    0.01,
    0.02,
    0.05,
    0.1,
    0.2,
    0.5,
    1,
    2,
    5,
    10,
    20,
    50,
    100,
    200,
    500,
    1000,
    2000,
    5000,
    10000,
    30000,
)
#: The percentiles :meth:`TransferMetrics.snapshot` reports for every phase.
PERCENTILES: tuple[tuple[str, float], ...] = (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))


class _Histogram:
    __slots__ = ("buckets", "count", "high", "low", "total")

    def __init__(self) -> None:
        self.buckets = [0] * (len(BUCKETS_MS) + 1)  # per bucket, the last one is +Inf
        self.count = 0
        self.total = 0.0
        self.low = math.inf
        self.high = -math.inf

    def observe(self, value: float) -> None:
        self.count += 1
        self.total += value
        self.low = min(self.low, value)
        self.high = max(self.high, value)
        # the first bound >= value; past the last bound: the +Inf bucket
        self.buckets[bisect_left(BUCKETS_MS, value)] += 1

    def quantile(self, q: float) -> float:
        """The ``q``-quantile (0 < q <= 1), interpolated linearly within its bucket (as
        Prometheus' ``histogram_quantile``) and kept within the smallest and largest value seen;
        0.0 when empty."""
        if not self.count:
            return 0.0
        rank = q * self.count
        below = 0
        for i, n in enumerate(self.buckets):
            if n and below + n >= rank:
                lower = BUCKETS_MS[i - 1] if i else 0.0
                upper = BUCKETS_MS[i] if i < len(BUCKETS_MS) else self.high
                lower, upper = max(lower, self.low), min(upper, self.high)
                return lower + (upper - lower) * max(0.0, rank - below) / n
            below += n
        return self.high

    def summary(self) -> dict[str, float]:
        """``count``, ``mean``, :data:`PERCENTILES` and ``max`` (ms), for :meth:`snapshot`."""
        out = {"count": self.count, "mean": self.total / self.count if self.count else 0.0}
        out.update((name, self.quantile(q)) for name, q in PERCENTILES)
        out["max"] = self.high if self.count else 0.0
        return out

    def copy(self) -> _Histogram:
        out = _Histogram()
        out.buckets, out.count, out.total = list(self.buckets), self.count, self.total
        out.low, out.high = self.low, self.high
        return out


_PHASE_KEYS: dict[tuple[str, str], tuple[str, str]] = {}


def _phase_key(direction: str, phase: str) -> tuple[str, str]:
    """``(direction, phase without "_ms")``, made once per name (a bounded set: the phases)."""
    key = _PHASE_KEYS.get((direction, phase))
    if key is None:
        key = (direction, phase.removesuffix("_ms"))
        if len(_PHASE_KEYS) < 1024:
            _PHASE_KEYS[(direction, phase)] = key
    return key


#: One pending observation: (direction, status, bytes, phase timings).
_Observation = tuple[str, str, int, tuple[tuple[str, Any], ...]]


class TransferMetrics:
    """Outcome counters (``direction``, ``status``), bytes, and per-phase latency histograms.

    :meth:`record` is on every request's path (the receiver's return waits for it), so it only
    queues the observation; the queue is folded into the counters by whoever reads them
    (:meth:`snapshot`, a Prometheus scrape). When nobody reads, a :meth:`record` that finds
    more than :attr:`FOLD_AT` queued folds two of them: the queue stays bounded and no
    request ever pays for a whole batch.
    """

    FOLD_AT = 4096

    def __init__(self, *, process_wide: bool = True) -> None:
        self._lock = threading.Lock()
        self._outcomes: dict[tuple[str, str], int] = {}
        self._bytes: dict[str, int] = {}
        self._phases: dict[tuple[str, str], _Histogram] = {}
        self._pending: deque[_Observation] = deque()
        # Every manager's metrics also count towards the process totals that register() exports.
        self._parent = _PROCESS if process_wide else None

    def record(
        self, direction: str, status: str, nbytes: int, timings_ms: Mapping[str, float]
    ) -> None:
        """Called by the manager once per request; never raises. ``timings_ms`` is read now
        (a caller may change its dict afterwards); the histograms see it at the next fold."""
        obs = (direction, status, nbytes, tuple(timings_ms.items()))
        for target in (self, self._parent):
            if target is not None:
                target._pending.append(obs)  # deque.append: atomic, no lock
                if len(target._pending) > self.FOLD_AT:
                    target._fold(2)

    @property
    def queued(self) -> int:
        """Observations recorded but not yet folded into the counters (a diagnostic: reads fold
        them all; it never exceeds :attr:`FOLD_AT` for long)."""
        return len(self._pending)

    def _fold(self, limit: int = -1) -> None:
        """Move the queued observations (at most ``limit``; -1: all) into the counters."""
        pending = self._pending
        with self._lock:
            while pending and limit:  # pops happen under the lock only: never empty here
                limit -= 1
                direction, status, nbytes, timings = pending.popleft()
                outcome = (direction, status)
                self._outcomes[outcome] = self._outcomes.get(outcome, 0) + 1
                self._bytes[direction] = self._bytes.get(direction, 0) + int(nbytes)
                for phase, ms in timings:
                    try:
                        value = float(ms)
                    except (TypeError, ValueError):
                        continue  # a phase that is not a number is not a latency
                    pkey = _phase_key(direction, phase)
                    hist = self._phases.get(pkey)
                    if hist is None:
                        hist = self._phases[pkey] = _Histogram()
                    hist.observe(value)

    def snapshot(self) -> dict[str, Any]:
        """Plain-data copy: outcomes, bytes, and per phase (``"recv.wait"``, ...) its ``count``,
        ``mean``, ``p50``, ``p90``, ``p99`` and ``max`` in milliseconds (percentiles from the
        histogram: exact to within one bucket of :data:`BUCKETS_MS`)."""
        self._fold()
        with self._lock:
            return {
                "outcomes": {f"{d}.{s}": n for (d, s), n in sorted(self._outcomes.items())},
                "bytes": dict(self._bytes),
                "phases_ms": {
                    f"{d}.{p}": h.summary() for (d, p), h in sorted(self._phases.items())
                },
            }

    def _state(
        self,
    ) -> tuple[dict[tuple[str, str], int], dict[str, int], dict[tuple[str, str], _Histogram]]:
        self._fold()
        with self._lock:
            phases = {k: h.copy() for k, h in self._phases.items()}
            return dict(self._outcomes), dict(self._bytes), phases


#: Totals of every manager in this process (what :func:`register` exports).
_PROCESS = TransferMetrics(process_wide=False)


class _Collector:
    """A ``prometheus_client`` collector over :data:`_PROCESS` (built at scrape time)."""

    def __init__(self, source: TransferMetrics, prefix: str) -> None:
        self.source = source
        self.prefix = prefix

    def describe(self) -> list[Metric]:
        return []  # unchecked collector: names are fixed, nothing to pre-declare

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

        outcomes, nbytes, phases = self.source._state()
        p = self.prefix
        requests = CounterMetricFamily(
            f"{p}_requests", "KV transfers by direction and outcome", labels=["direction", "status"]
        )
        for (direction, status), n in sorted(outcomes.items()):
            requests.add_metric([direction, status], n)
        yield requests
        moved = CounterMetricFamily(f"{p}_bytes", "KV payload bytes moved", labels=["direction"])
        for direction, n in sorted(nbytes.items()):
            moved.add_metric([direction], n)
        yield moved
        hist = HistogramMetricFamily(
            f"{p}_phase_seconds", "Per-request phase latency", labels=["direction", "phase"]
        )
        for (direction, phase), h in sorted(phases.items()):
            cumulative, acc = [], 0
            for bound, n in zip((*BUCKETS_MS, float("inf")), h.buckets, strict=True):
                acc += n
                le = "+Inf" if bound == float("inf") else repr(bound / 1000)
                cumulative.append((le, float(acc)))
            hist.add_metric([direction, phase], cumulative, h.total / 1000)
        yield hist


_registered: weakref.WeakKeyDictionary[Any, _Collector] = weakref.WeakKeyDictionary()
_registered_lock = threading.Lock()


def register(registry: CollectorRegistry | None = None, *, prefix: str = "omnikv") -> Any:
    """Register omnikv's collector with ``registry`` (default: ``prometheus_client.REGISTRY``).

    Idempotent per registry; returns the collector. Raises ``ImportError`` naming the extra
    when ``prometheus_client`` is not installed.
    """
    try:
        import prometheus_client
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "omnikv.metrics.register needs prometheus_client: pip install 'omnikv[metrics]'"
        ) from exc
    target = prometheus_client.REGISTRY if registry is None else registry
    with _registered_lock:
        collector = _registered.get(target)
        if collector is None:
            collector = _Collector(_PROCESS, prefix)
            target.register(collector)  # type: ignore[arg-type]
            _registered[target] = collector
        return collector


def unregister(registry: CollectorRegistry | None = None) -> None:
    """Remove omnikv's collector from ``registry`` (default registry when None); no-op if absent."""
    import prometheus_client

    target = prometheus_client.REGISTRY if registry is None else registry
    with _registered_lock:
        collector = _registered.pop(target, None)
        if collector is not None:
            target.unregister(collector)  # type: ignore[arg-type]


@dataclass
class MetricsServer:
    """A running ``/metrics`` endpoint made by :func:`serve`; :meth:`close` stops it."""

    host: str
    port: int
    _server: Any
    _thread: threading.Thread

    @property
    def url(self) -> str:
        """``http://host:port/metrics``."""
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and join the server thread. Idempotent."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def serve(
    port: int = 0, addr: str = "127.0.0.1", registry: CollectorRegistry | None = None
) -> MetricsServer:
    """Serve Prometheus' text format at ``http://addr:port/metrics`` from a daemon thread.

    For a process that has no HTTP server of its own: registers omnikv's collector with
    ``registry`` (:func:`register`; default: ``prometheus_client.REGISTRY``, so the process's
    other metrics are served too) and starts ``prometheus_client.start_http_server``. Binds
    ``addr`` as given: loopback unless told otherwise. ``port`` 0 picks a free port (see
    :attr:`MetricsServer.port`). Raises ``ImportError`` naming the extra without
    ``prometheus_client`` and ``OSError`` when the address cannot be bound.
    """
    register(registry)
    import prometheus_client

    target = prometheus_client.REGISTRY if registry is None else registry
    server, thread = prometheus_client.start_http_server(port, addr=addr, registry=target)
    return MetricsServer(addr, int(server.server_port), server, thread)
