"""Metrics: per-manager snapshots, process totals, and export through a real prometheus_client."""

from __future__ import annotations

import pytest

prometheus_client = pytest.importorskip("prometheus_client")

from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from omnikv import metrics  # noqa: E402
from omnikv.metrics import TransferMetrics  # noqa: E402


def _sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_snapshot_counts_outcomes_bytes_and_phases() -> None:
    m = TransferMetrics(process_wide=False)
    m.record("send", "sent", 100, {"encode_ms": 2.0, "put_ms": 4.0})
    m.record("send", "failed", 0, {"encode_ms": 4.0})
    snap = m.snapshot()
    assert snap["outcomes"] == {"send.failed": 1, "send.sent": 1}
    assert snap["bytes"] == {"send": 100}
    assert snap["phases_ms"]["send.encode"] == {"count": 2, "mean": 3.0}
    assert snap["phases_ms"]["send.put"] == {"count": 1, "mean": 4.0}


def test_record_is_deferred_but_bounded_and_reads_its_timings_at_once() -> None:
    """``record`` queues (the request's path does not fold histograms); every read folds, the
    queue never outgrows ``FOLD_AT`` (each record above it folds two), a later change to the
    caller's dict is not seen, and a phase that is not a number is skipped, not raised."""
    m = TransferMetrics(process_wide=False)
    timings: dict[str, float] = {"wait_ms": 1.0}
    m.record("recv", "ok", 10, timings)
    timings["wait_ms"] = 1000.0
    m.record("recv", "ok", 10, {"wait_ms": "soon"})  # type: ignore[dict-item]
    assert m._outcomes == {}  # queued, not folded yet
    snap = m.snapshot()
    assert snap["outcomes"] == {"recv.ok": 2} and snap["bytes"] == {"recv": 20}
    assert snap["phases_ms"]["recv.wait"] == {"count": 1, "mean": 1.0}
    for _ in range(3 * TransferMetrics.FOLD_AT):
        m.record("send", "sent", 1, {"put_ms": 0.5})
        assert len(m._pending) <= TransferMetrics.FOLD_AT  # two folded per record above it
    assert m.snapshot()["outcomes"]["send.sent"] == 3 * TransferMetrics.FOLD_AT
    assert not m._pending


def test_register_exports_counters_and_histograms_to_a_real_registry() -> None:
    registry = CollectorRegistry()
    collector = metrics.register(registry)
    try:
        assert metrics.register(registry) is collector  # idempotent per registry
        labels = {"direction": "recv", "status": "ok"}
        before = _sample(registry, "omnikv_requests_total", **labels)
        before_bytes = _sample(registry, "omnikv_bytes_total", direction="recv")
        phase = {"direction": "recv", "phase": "wait"}
        before_count = _sample(registry, "omnikv_phase_seconds_count", **phase)
        before_fast = _sample(registry, "omnikv_phase_seconds_bucket", le="0.001", **phase)
        a, b = TransferMetrics(), TransferMetrics()  # two managers: totals are summed
        a.record("recv", "ok", 10, {"wait_ms": 0.3})
        b.record("recv", "ok", 5, {"wait_ms": 40.0})
        assert _sample(registry, "omnikv_requests_total", **labels) == before + 2
        assert _sample(registry, "omnikv_bytes_total", direction="recv") == before_bytes + 15
        assert _sample(registry, "omnikv_phase_seconds_count", **phase) == before_count + 2
        assert _sample(registry, "omnikv_phase_seconds_bucket", le="0.001", **phase) == (
            before_fast + 1
        )
        assert a.snapshot()["outcomes"] == {"recv.ok": 1}  # each manager keeps its own view
    finally:
        metrics.unregister(registry)
    assert registry.get_sample_value("omnikv_requests_total", labels) is None


def test_exposition_parses_as_prometheus_text() -> None:
    registry = CollectorRegistry()
    metrics.register(registry)
    try:
        TransferMetrics().record("send", "sent", 1, {"put_ms": 1.0})
        text = generate_latest(registry).decode()
        families = {f.name: f for f in text_string_to_metric_families(text)}
        assert families["omnikv_requests"].type == "counter"
        assert families["omnikv_phase_seconds"].type == "histogram"
        buckets = [
            s for s in families["omnikv_phase_seconds"].samples if s.name.endswith("_bucket")
        ]
        assert buckets[-1].labels["le"] == "+Inf"
    finally:
        metrics.unregister(registry)


def test_default_registry_and_unregister() -> None:
    collector = metrics.register()
    try:
        assert collector is metrics.register(prometheus_client.REGISTRY)
    finally:
        metrics.unregister()
    metrics.unregister()  # absent: no-op


def test_histogram_buckets_are_upper_bounds_inclusive_and_overflow_to_inf() -> None:
    """A value equal to a bound counts in that bound's bucket (Prometheus' ``le``); one above the
    last bound goes to +Inf; the process totals see the same observations."""
    h = metrics._Histogram()
    for value in (0.0, 0.1, 0.1000001, 1.0, 5000.0, 5000.1, 1e9):
        h.observe(value)
    bounds = metrics.BUCKETS_MS
    assert h.buckets[bounds.index(0.1)] == 2  # 0.0 and 0.1
    assert h.buckets[bounds.index(0.5)] == 1  # just above 0.1
    assert h.buckets[bounds.index(1)] == 1
    assert h.buckets[bounds.index(5000)] == 1
    assert h.buckets[-1] == 2  # +Inf
    assert h.count == 7 and sum(h.buckets) == 7
    parent_before = metrics._PROCESS.snapshot()["phases_ms"].get("recv.decode", {"count": 0})
    m = TransferMetrics()
    m.record("recv", "ok", 1, {"decode_ms": 0.2})
    after = metrics._PROCESS.snapshot()["phases_ms"]["recv.decode"]
    assert after["count"] == parent_before["count"] + 1
