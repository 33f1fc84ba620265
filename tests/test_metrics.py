"""Metrics: per-manager snapshots, process totals, and export through a real prometheus_client."""

from __future__ import annotations

from typing import Any

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
    encode, put = snap["phases_ms"]["send.encode"], snap["phases_ms"]["send.put"]
    assert (encode["count"], encode["mean"], encode["max"]) == (2, 3.0, 4.0)
    assert (put["count"], put["mean"], put["p50"], put["p99"]) == (1, 4.0, 4.0, 4.0)


def test_record_is_deferred_but_bounded_and_reads_its_timings_at_once() -> None:
    """``record`` queues (the request's path does not fold histograms); every read folds, the
    queue never outgrows ``FOLD_AT`` (each record above it folds two), a later change to the
    caller's dict is not seen, and a phase that is not a number is skipped, not raised."""
    m = TransferMetrics(process_wide=False)
    timings: dict[str, float] = {"wait_ms": 1.0}
    m.record("recv", "ok", 10, timings)
    timings["wait_ms"] = 1000.0
    m.record("recv", "ok", 10, {"wait_ms": "soon"})  # type: ignore[dict-item]
    assert m.queued == 2  # queued, not folded yet
    snap = m.snapshot()
    assert snap["outcomes"] == {"recv.ok": 2} and snap["bytes"] == {"recv": 20}
    wait = snap["phases_ms"]["recv.wait"]
    assert (wait["count"], wait["mean"], wait["max"]) == (1, 1.0, 1.0)
    for _ in range(3 * TransferMetrics.FOLD_AT):
        m.record("send", "sent", 1, {"put_ms": 0.5})
        assert m.queued <= TransferMetrics.FOLD_AT  # two folded per record above it
    assert m.snapshot()["outcomes"]["send.sent"] == 3 * TransferMetrics.FOLD_AT
    assert m.queued == 0


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
    for value in (0.0, 0.1, 0.1000001, 1.0, 30000.0, 30000.1, 1e9):
        h.observe(value)
    bounds = metrics.BUCKETS_MS
    assert h.buckets[bounds.index(0.001)] == 1  # 0.0
    assert h.buckets[bounds.index(0.1)] == 1  # 0.1
    assert h.buckets[bounds.index(0.2)] == 1  # just above 0.1
    assert h.buckets[bounds.index(1)] == 1
    assert h.buckets[bounds.index(30000)] == 1
    assert h.buckets[-1] == 2  # +Inf
    assert h.count == 7 and sum(h.buckets) == 7
    parent_before = metrics._PROCESS.snapshot()["phases_ms"].get("recv.decode", {"count": 0})
    m = TransferMetrics()
    m.record("recv", "ok", 1, {"decode_ms": 0.2})
    after = metrics._PROCESS.snapshot()["phases_ms"]["recv.decode"]
    assert after["count"] == parent_before["count"] + 1


def test_snapshot_percentiles_follow_the_distribution() -> None:
    """p50/p90/p99 within one bucket of the true value, never outside what was observed."""
    m = TransferMetrics(process_wide=False)
    values = [0.3 + 0.01 * i for i in range(90)] + [40.0 + i for i in range(10)]  # 10% slow
    for v in values:
        m.record("recv", "ok", 1, {"wait_ms": v})
    wait = m.snapshot()["phases_ms"]["recv.wait"]
    assert wait["count"] == 100 and wait["max"] == 49.0
    # the true values (the 50th, 90th and 99th of 100) and their buckets: 0.79 in (0.5, 1],
    # 1.19 in (1, 2], 48 in (20, 50] (whose top is cut to the largest value seen, 49)
    assert 0.5 <= wait["p50"] <= 1.0
    assert 1.0 <= wait["p90"] <= 2.0
    assert 20.0 <= wait["p99"] <= 49.0
    assert wait["p50"] <= wait["p90"] <= wait["p99"] <= wait["max"]
    single = TransferMetrics(process_wide=False)
    single.record("send", "sent", 1, {"put_ms": 123.0})
    put = single.snapshot()["phases_ms"]["send.put"]
    assert put["p50"] == put["p99"] == put["max"] == 123.0  # one value: exact


def test_histogram_quantiles_past_the_last_bound_stay_below_the_largest_value() -> None:
    h = metrics._Histogram()
    for v in (1e5, 2e5, 4e5):
        h.observe(v)
    assert 1e5 <= h.quantile(0.5) <= 4e5 and h.quantile(1.0) == 4e5
    assert metrics._Histogram().quantile(0.5) == 0.0


def test_serve_exposes_metrics_over_http_on_loopback() -> None:
    import urllib.request

    registry = CollectorRegistry()
    server = metrics.serve(0, registry=registry)
    try:
        assert server.host == "127.0.0.1" and server.port > 0
        m = TransferMetrics()
        m.record("recv", "ok", 64, {"wait_ms": 2.0})
        with urllib.request.urlopen(server.url, timeout=5) as response:
            text = response.read().decode()
        families = {f.name: f for f in text_string_to_metric_families(text)}
        assert "omnikv_phase_seconds" in families and "omnikv_requests" in families
        buckets = [
            s for s in families["omnikv_phase_seconds"].samples if s.name.endswith("_bucket")
        ]
        assert any(s.labels.get("phase") == "wait" for s in buckets)
    finally:
        server.close()
        metrics.unregister(registry)


def test_a_managers_snapshot_has_percentiles(manager_pair: Any) -> None:
    import torch

    sender, receiver = manager_pair()
    caches = [torch.ones(2, 3, 4, 2, 8) for _ in range(2)]
    for i in range(5):
        sender.handle_finished_requests_kv_transfer(
            {f"r{i}": {"block_ids": [0, 1], "seq_len": 6}}, caches, 4, "float32"
        )
        assert receiver.receive_kv_cache_for_request(f"r{i}")[0] is not None
    for manager, phase in ((sender, "send.encode_put"), (receiver, "recv.wait")):
        stats = manager.metrics.snapshot()["phases_ms"][phase]
        assert stats["count"] == 5
        assert 0.0 <= stats["p50"] <= stats["p90"] <= stats["p99"] <= stats["max"]


def test_buckets_resolve_microseconds() -> None:
    """Waits of a few microseconds get percentiles of that size, not a 50 us bucket's guess."""
    m = TransferMetrics(process_wide=False)
    for i in range(100):
        m.record("recv", "ok", 1, {"wait_ms": 0.003 + 0.00001 * i})  # 3..4 us
    wait = m.snapshot()["phases_ms"]["recv.wait"]
    assert 0.002 <= wait["p50"] <= 0.005 and wait["p99"] <= 0.005
    assert metrics.BUCKETS_MS[0] == 0.001


def test_the_hand_off_latency_runs_from_the_send_call_to_the_verdict(manager_pair: Any) -> None:
    import time

    import torch

    sender, receiver = manager_pair()
    caches = [torch.ones(2, 3, 4, 2, 8) for _ in range(2)]
    t0 = time.perf_counter()
    sender.handle_finished_requests_kv_transfer(
        {"r0": {"block_ids": [0, 1], "seq_len": 6}}, caches, 4, "float32"
    )
    assert receiver.receive_kv_cache_for_request("r0")[0] is not None
    result = sender.wait_delivered("r0", timeout=10)
    elapsed_ms = (time.perf_counter() - t0) * 1e3
    assert result is not None and result.status.value == "delivered"
    handoff = result.timings_ms["handoff_ms"]
    assert result.timings_ms["encode_put_ms"] < handoff <= elapsed_ms
    stats = sender.metrics.snapshot()["phases_ms"]["delivery.handoff"]
    assert stats["count"] == 1 and stats["max"] == handoff
    registry = CollectorRegistry()
    metrics.register(registry)
    try:
        text = generate_latest(registry).decode()
    finally:
        metrics.unregister(registry)
    assert 'direction="delivery",phase="handoff"' in text
