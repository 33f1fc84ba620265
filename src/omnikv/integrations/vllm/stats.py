"""What the connector counts, and how it reaches vLLM's logs and ``/metrics``.

The worker half records every send and load in :class:`TransferCounters` (thread-safe: its send
and load threads record concurrently). vLLM asks the worker each step for the stats of the last
interval (``get_kv_connector_stats``), ships them to the frontend, aggregates them with
:class:`OmniKVConnectorStats` and hands them to :class:`OmniKVPromMetrics`, which the connector
class builds for the server's Prometheus registry (``build_prom_metrics``), as vLLM's own NIXL
and Mooncake connectors do.

Counts (cumulative in :meth:`TransferCounters.counts`, per interval in the stats):
``sends_ok``, ``sends_failed``, the consumers' verdicts on the sends (``sends_delivered``,
``sends_refused``, ``sends_expired``; connectors that carry verdicts), ``bytes_sent``,
``loads_ok``, ``loads_failed`` (the request recomputes its prefill), ``loads_refused``
(parameters refused at admission, never waited for), ``router_ids_refused`` (a producer given a
transfer id it cannot use: not a router id of its own, or used already), ``tokens_loaded``,
``bytes_loaded``; durations ``send_seconds`` (a producer's send of a finished request's KV:
gather, encode, put), ``load_seconds`` (a consumer's load: from its admission of the request to
the KV written, the wait for the producer included) and ``handoff_seconds`` (per loaded request,
the hand-off itself: from the producer beginning to send the finished request's KV to that KV
written into the consumer's blocks, on the two hosts' wall clocks).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from omnikv.integrations.vllm._vllm import KVConnectorPromMetrics, KVConnectorStats

__all__ = [
    "COUNTS",
    "DURATIONS",
    "OmniKVConnectorStats",
    "OmniKVPromMetrics",
    "TransferCounters",
]

COUNTS = (
    "sends_ok",
    "sends_failed",
    "sends_delivered",
    "sends_refused",
    "sends_expired",
    "bytes_sent",
    "chunks_streamed",
    "layer_groups_streamed",
    "bytes_streamed",
    "chunks_loaded",
    "loads_ok",
    "loads_failed",
    "loads_refused",
    "router_ids_refused",
    "tokens_loaded",
    "bytes_loaded",
)
DURATIONS = ("send_seconds", "load_seconds", "handoff_seconds")
#: Durations kept per interval (vLLM reads them every few seconds; beyond this they are dropped).
DURATIONS_KEPT = 8192
#: Per-transfer records kept for :meth:`TransferCounters.get`.
RECORDS_KEPT = 1024


def _empty() -> dict[str, Any]:
    data: dict[str, Any] = dict.fromkeys(COUNTS, 0)
    data.update({name: [] for name in DURATIONS})
    return data


class TransferCounters:
    """Cumulative counts, the current interval's stats, and a bounded per-transfer record."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals: dict[str, int] = {}
        self._interval = _empty()
        self._records: OrderedDict[str, dict[str, Any]] = OrderedDict()

    def add(self, name: str, n: int = 1) -> None:
        """Count ``n`` of ``name`` (one of :data:`COUNTS`)."""
        if n <= 0:
            return
        with self._lock:
            self._totals[name] = self._totals.get(name, 0) + n
            self._interval[name] += n

    def observe(self, name: str, seconds: float) -> None:
        """Record one duration of ``name`` (one of :data:`DURATIONS`)."""
        with self._lock:
            values = self._interval[name]
            if len(values) < DURATIONS_KEPT:
                values.append(seconds)

    def record(self, key: str, **values: Any) -> None:
        """Merge ``values`` into the record of transfer ``key`` (oldest records dropped)."""
        with self._lock:
            entry = self._records.setdefault(key, {})
            entry.update(values)
            self._records.move_to_end(key)
            while len(self._records) > RECORDS_KEPT:
                self._records.popitem(last=False)

    def counts(self) -> dict[str, int]:
        """Cumulative counts since start (only those that happened)."""
        with self._lock:
            return dict(self._totals)

    def get(self, key: str) -> dict[str, Any] | None:
        """A copy of the record of transfer ``key``, if still kept."""
        with self._lock:
            entry = self._records.get(key)
            return dict(entry) if entry is not None else None

    def take_interval(self) -> OmniKVConnectorStats | None:
        """The stats since the last call (``None`` if nothing happened); starts a new interval."""
        with self._lock:
            data, self._interval = self._interval, _empty()
        stats = OmniKVConnectorStats(data=data)
        return None if stats.is_empty() else stats


class OmniKVConnectorStats(KVConnectorStats):  # type: ignore[misc]
    """One interval's counts and durations; plain ints and lists, so vLLM can serialise it."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()
        else:
            for key, default in _empty().items():
                self.data.setdefault(key, default)

    def reset(self) -> None:
        self.data = _empty()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name in COUNTS:
            self.data[name] += int(other.data.get(name, 0))
        for name in DURATIONS:
            self.data[name].extend(other.data.get(name, ()))
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {name: int(self.data[name]) for name in COUNTS}
        for name in DURATIONS:
            values = sorted(self.data[name])
            if values:
                out[f"{name} p50 (ms)"] = round(values[len(values) // 2] * 1e3, 3)
                out[f"{name} max (ms)"] = round(values[-1] * 1e3, 3)
        return out

    def is_empty(self) -> bool:
        return not any(self.data[name] for name in COUNTS) and not any(
            self.data[name] for name in DURATIONS
        )


_COUNTER_DOCS = {
    "sends_ok": "Prompt KV payloads this producer sent through omnikv.",
    "sends_failed": "Prompt KV sends that failed (the consumer recomputes).",
    "sends_delivered": "Prompt KV payloads a consumer accepted (its verdict).",
    "sends_refused": "Prompt KV payloads a consumer took and refused (binding, MAC, shape).",
    "sends_expired": "Prompt KV payloads nobody took in time, or taken without a verdict.",
    "bytes_sent": "Bytes of KV this producer sent through omnikv.",
    "chunks_streamed": "Chunks of prompt KV shipped while their request was prefilled.",
    "layer_groups_streamed": "Of those chunks, layer groups (runs of a step's layers).",
    "bytes_streamed": "Bytes of prompt KV shipped while their request was prefilled.",
    "chunks_loaded": "Streamed chunks checked and written into the cache as they arrived.",
    "loads_ok": "Prompt KV payloads this consumer loaded through omnikv.",
    "loads_failed": "Admitted loads that failed or timed out (the prefill was recomputed).",
    "loads_refused": "kv_transfer_params refused at admission (never waited for).",
    "router_ids_refused": "Transfer ids offered to this producer that it could not use.",
    "tokens_loaded": "Prompt tokens whose KV this consumer loaded instead of computing.",
    "bytes_loaded": "Bytes of KV this consumer loaded through omnikv.",
}
_DURATION_DOCS = {
    "send_seconds": "Duration of one omnikv send of a finished request's KV (gather, encode, put).",
    "load_seconds": "Duration of one omnikv load, from the consumer's admission of the request "
    "to its KV written (the wait for the producer included).",
    "handoff_seconds": "Per loaded request: from the producer beginning to send the finished "
    "request's KV to that KV written into this consumer's blocks (wall clocks of both hosts).",
}
_SECONDS_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 30.0]


class OmniKVPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """``vllm:omnikv_*`` counters and ``vllm:omnikv_*_seconds`` histograms, one per engine."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        self._histograms: dict[str, dict[int, Any]] = {}
        for name, doc in _COUNTER_DOCS.items():
            metric = self._counter_cls(
                name=f"vllm:omnikv_{name}", documentation=doc, labelnames=labelnames
            )
            self._counters[name] = self._per_engine(metric)
        for name, doc in _DURATION_DOCS.items():
            metric = self._histogram_cls(
                name=f"vllm:omnikv_{name}",
                documentation=doc,
                buckets=_SECONDS_BUCKETS,
                labelnames=labelnames,
            )
            self._histograms[name] = self._per_engine(metric)

    def _per_engine(self, metric: Any) -> dict[int, Any]:
        return {idx: metric.labels(*values) for idx, values in self.per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, per_engine in self._counters.items():
            n = int(transfer_stats_data.get(name, 0))
            if n > 0 and engine_idx in per_engine:
                per_engine[engine_idx].inc(n)
        for name, per_engine in self._histograms.items():
            if engine_idx not in per_engine:
                continue
            for value in transfer_stats_data.get(name, ()):
                per_engine[engine_idx].observe(float(value))
