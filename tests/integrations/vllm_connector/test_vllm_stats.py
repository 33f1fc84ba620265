"""Counts and durations to vLLM's stats logger and Prometheus (``vllm:omnikv_*``)."""

from __future__ import annotations

import time
from importlib.util import find_spec
from types import SimpleNamespace
from typing import Any

import pytest

from support import vllm_halves as halves
from support.vllm_fixtures import edge_fixture  # noqa: F401 (fixtures)

pytestmark = pytest.mark.skipif(
    find_spec("vllm") is None, reason="vLLM not installed (make test-vllm builds .venv-vllm)"
)


def test_stats_reach_vllms_logger_and_prometheus(edge: Any) -> None:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    from omnikv.integrations.vllm import OmniKVConnector

    t0 = time.time()
    params = halves.send(edge.producer, [3, 5, 1])
    halves.load(edge.consumer, params, "c1", [6, 2, 7])
    t1 = time.time()
    sent = edge.producer.worker.get_kv_connector_stats()
    loaded = edge.consumer.worker.get_kv_connector_stats()
    assert sent is not None and sent.data["sends_ok"] == 1 and sent.data["bytes_sent"] > 0
    assert loaded is not None and loaded.data["loads_ok"] == 1
    # the hand-off: the producer's send began after t0, the KV was written before t1, and it
    # is within the load (admission to end, the consumer admitted after the send returned)
    (handoff,) = loaded.data["handoff_seconds"]
    (load,) = loaded.data["load_seconds"]
    assert 0 < handoff < t1 - t0 and handoff > load
    assert sent.data["handoff_seconds"] == []  # a producer measures none
    assert edge.consumer.worker.get_kv_connector_stats() is None  # the interval was taken
    # vLLM rebuilds the stats from their data dict in the frontend and aggregates them.
    total = OmniKVConnector.build_kv_connector_stats(dict(sent.data))
    total = total.aggregate(OmniKVConnector.build_kv_connector_stats(dict(loaded.data)))
    reduced = total.reduce()
    assert reduced["sends_ok"] == 1 and reduced["loads_ok"] == 1
    assert "load_seconds p50 (ms)" in reduced and "handoff_seconds p50 (ms)" in reduced
    registry = CollectorRegistry()

    def bound(cls: type) -> type:
        class _InRegistry(cls):  # type: ignore[misc, valid-type]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, registry=registry, **kwargs)

        return _InRegistry

    metric_types = {Gauge: bound(Gauge), Counter: bound(Counter), Histogram: bound(Histogram)}
    vllm_config = SimpleNamespace(kv_transfer_config=None)
    prom = OmniKVConnector.build_prom_metrics(
        vllm_config, metric_types, ["model_name", "engine"], {0: ["tiny", "0"]}
    )
    prom.observe(total.data, 0)
    text = generate_latest(registry).decode()
    assert 'vllm:omnikv_loads_ok_total{engine="0",model_name="tiny"} 1.0' in text
    assert 'vllm:omnikv_sends_ok_total{engine="0",model_name="tiny"} 1.0' in text
    assert "vllm:omnikv_load_seconds_bucket" in text
    assert 'vllm:omnikv_handoff_seconds_count{engine="0",model_name="tiny"} 1.0' in text
    assert "# HELP vllm:omnikv_handoff_seconds Per loaded request: from the producer" in text


def test_every_count_is_exported_to_prometheus() -> None:
    from omnikv.integrations.vllm.stats import _COUNTER_DOCS, _DURATION_DOCS, COUNTS, DURATIONS

    assert set(_COUNTER_DOCS) == set(COUNTS)
    assert set(_DURATION_DOCS) == set(DURATIONS)


def test_a_hand_off_stamp_is_measured_only_when_it_is_a_plausible_time() -> None:
    from omnikv.integrations.vllm.worker import HANDOFF_BOUND_S, handoff_seconds

    now = 1_000_000.0
    assert handoff_seconds(now - 0.25, now) == 0.25
    assert handoff_seconds(int(now) - 2, now) == 2.0
    assert handoff_seconds(now + 0.5, now) == 0.0  # the producer's clock ahead: not negative
    for bad in (None, "1.0", True, float("nan"), float("inf"), now - HANDOFF_BOUND_S - 1, [now]):
        assert handoff_seconds(bad, now) is None, bad
