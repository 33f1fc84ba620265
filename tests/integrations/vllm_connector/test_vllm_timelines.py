"""The hand-off timelines the connector logs at DEBUG, read back as ``omnikv bench vllm`` reads
them for its per-step breakdown: one hand-off through the real halves, every step present, in
the order the hand-off takes them; nothing kept or logged without DEBUG."""

from __future__ import annotations

import logging
import time
from importlib.util import find_spec
from types import SimpleNamespace
from typing import Any

import pytest

from support import vllm_halves as halves
from support.vllm_fixtures import edge_fixture  # noqa: F401 (fixture)

pytestmark = pytest.mark.skipif(
    find_spec("vllm") is None, reason="vLLM not installed (make test-vllm builds .venv-vllm)"
)


def _hand_off(edge: Any, rid: str) -> tuple[str, float]:
    """A send, a load and the step that schedules the loaded request; (transfer id, the
    monotonic time after that step)."""
    params = halves.send(edge.producer, [3, 5, 1], rid="p" + rid)
    results = halves.load(edge.consumer, params, rid, [6, 2, 7])
    assert results.finished_recving == {rid} and not results.failed_recving
    scheduled = halves.output([SimpleNamespace(req_id=rid)], [], {rid: 1})
    edge.consumer.sched.build_connector_meta(scheduled)
    return str(params["omnikv_transfer_id"]), time.monotonic()


def test_a_hand_off_logs_every_step_in_order(edge: Any, caplog: pytest.LogCaptureFixture) -> None:
    from omnikv.bench.vllm import PRODUCER_STEPS, STEPS, WRITE_CPU, breakdown, read_timelines

    caplog.set_level(logging.DEBUG, logger="omnikv.integrations.vllm")
    tid, after = _hand_off(edge, "c1")
    timeline = read_timelines(caplog.text)[tid]
    assert {"hand-off", "load", "send", "written"} <= set(timeline)
    hand, load, send = timeline["hand-off"], timeline["load"], timeline["send"]
    assert hand["ok"] == 1.0
    assert hand["admitted"] <= hand["to_worker"] <= load["submitted"] <= load["end"]
    assert load["end"] <= load["reported"] <= hand["reported"] <= hand["scheduled"] <= after
    assert send["submitted"] <= send["start"] <= send["end"] <= send["reported"]
    assert timeline["written"]["write"] >= 0 and "wait" in timeline["written"]
    finish = send["submitted"]
    steps = breakdown(finish, hand["admitted"], after, timeline)
    assert steps is not None
    assert list(steps) == [name for name, _ in (*STEPS, *PRODUCER_STEPS)] + [WRITE_CPU]
    assert 0 <= steps[WRITE_CPU] <= timeline["written"]["write"] / 1e3 + 0.001  # thread CPU
    assert sum(steps[name] for name, _ in STEPS) == pytest.approx(after - finish)


def test_without_debug_nothing_is_kept(edge: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="omnikv.integrations.vllm")
    _hand_off(edge, "c2")
    assert "timeline" not in caplog.text
    assert not edge.consumer.sched._scheduler._timelines
    assert not edge.consumer.worker._worker._traced


def test_a_failed_load_gives_no_breakdown(edge: Any, caplog: pytest.LogCaptureFixture) -> None:
    """A load that failed (here: its payload never sent, the deadline passed) is logged with
    ``ok=0`` and left out of the breakdown (the request recomputed)."""
    from omnikv.bench.vllm import breakdown, read_timelines
    from omnikv.integrations.vllm.binding import new_transfer_id, producer_tag, request_binding

    caplog.set_level(logging.DEBUG, logger="omnikv.integrations.vllm")
    sched = edge.consumer.sched._scheduler
    request = halves.make_request("c3", None)
    binding = request_binding(sched.fingerprint, request, len(halves.PROMPT))
    tag = producer_tag(edge.conn["namespace"])
    tid = new_transfer_id(tag, binding, None)
    params = {
        "do_remote_prefill": True,
        "omnikv_transfer_id": tid,
        "omnikv_num_tokens": len(halves.PROMPT),
    }
    results = halves.load(edge.consumer, params, "c3", [6, 2, 7])
    assert results.failed_recving == {"c3"}
    edge.consumer.sched.build_connector_meta(halves.output([SimpleNamespace(req_id="c3")], [], {}))
    timeline = read_timelines(caplog.text)[tid]
    assert timeline["hand-off"]["ok"] == 0.0
    assert breakdown(0.0, 0.0, 1.0, timeline) is None
