"""OmniKVConnector's scheduler and worker halves without an engine (fast; needs vLLM installed).

The halves are driven the way vLLM's scheduler and model runner drive them (bind, start_load_kv,
wait_for_save, get_transfer_results; and the speculative-decoding order, where results come
before wait_for_save), over LocalConnector (producer and consumer in this process), on
CPU_ATTN-layout caches. Attacks with real engines and processes:
tests/integrations/test_vllm_engine.py.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from importlib.util import find_spec
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.skipif(
    find_spec("vllm") is None, reason="vLLM not installed (make test-vllm builds .venv-vllm)"
)

BLOCKS, HEADS, BS, DIM = 8, 4, 4, 8
PROMPT = list(range(10, 20))  # 10 tokens: 2 full blocks and a partial one


def _config(
    role: str, omni: dict[str, Any], extra: dict[str, Any] | None = None, model: str | None = None
) -> Any:
    from vllm.config import KVTransferConfig

    ktc = KVTransferConfig(
        kv_connector="OmniKVConnector",
        kv_connector_module_path="omnikv.integrations.vllm",
        kv_role=role,
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={
            "omni_kv_config": omni,
            "vllm_kv_layout": "vllm_cpu",
            **(extra or {}),
        },
    )
    cfg = SimpleNamespace(
        kv_transfer_config=ktc,
        cache_config=SimpleNamespace(block_size=BS, enable_prefix_caching=True),
    )
    if model is not None:
        cfg.model_config = SimpleNamespace(model=model, revision=None, dtype="float32")
    return cfg


def _pair(
    role: str,
    omni: dict[str, Any],
    layers: int = 2,
    dtype: torch.dtype = torch.float32,
    model: str | None = None,
    **extra: Any,
) -> Any:
    """(scheduler half, worker half with registered caches, caches)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from omnikv.integrations.vllm import OmniKVConnector

    cfg = _config(role, omni, extra, model)
    sched = OmniKVConnector(cfg, KVConnectorRole.SCHEDULER, SimpleNamespace(kv_cache_groups=[0]))
    worker = OmniKVConnector(cfg, KVConnectorRole.WORKER, None)
    caches = {
        f"model.layers.{i}.attn": torch.zeros(BLOCKS, HEADS, BS, 2 * DIM, dtype=dtype)
        for i in range(layers)
    }
    worker.register_kv_caches(caches)
    return SimpleNamespace(sched=sched, worker=worker, caches=caches)


def _request(
    rid: str, params: dict[str, Any] | None, computed: int = 0, prompt: list[int] | None = None
) -> Any:
    prompt = list(PROMPT if prompt is None else prompt)
    return SimpleNamespace(
        request_id=rid,
        prompt_token_ids=prompt,
        num_prompt_tokens=len(prompt),
        num_computed_tokens=computed,
        kv_transfer_params=params,
        status=SimpleNamespace(name="FINISHED_LENGTH_CAPPED"),
        lora_request=None,
        cache_salt=None,
        mm_features=[],
    )


def _blocks(ids: list[int]) -> Any:
    return SimpleNamespace(get_block_ids=lambda: (list(ids),))


def _step(side: Any, finished: set[str], *, spec_order: bool = False) -> Any:
    """One engine step: metadata to the worker, its hooks, its transfers, results back.

    ``spec_order``: vLLM's deferred finalize (speculative decoding), where the transfer results
    are asked for before ``wait_for_save``.
    """
    sched, worker = side.sched, side.worker
    worker.bind_connector_metadata(sched.build_connector_meta(None))
    worker.start_load_kv(None)
    early = None
    if spec_order:
        early = worker.get_transfer_results(finished)
        finished = set()
    worker.wait_for_save()
    assert worker.wait_transfers(10.0)
    results = worker.get_transfer_results(finished)
    worker.clear_connector_metadata()
    if early is not None:
        results.finished_sending |= early.finished_sending
        results.finished_recving |= early.finished_recving
        results.failed_recving |= early.failed_recving
    sched.update_connector_output(results)
    return results


@pytest.fixture
def edge() -> Any:
    ns = f"vllm-{uuid.uuid4().hex[:8]}"
    conn = {"type": "LocalConnector", "namespace": ns}
    producer = _pair(
        "kv_producer", {"omni_from_stage": 0, "omni_to_stage": 1, "connector_config": conn}
    )
    consumer_omni = {"stage_id": 1, "recv_timeout": 0.5, "connector_config": conn}
    consumer = _pair("kv_consumer", consumer_omni)
    made = [producer, consumer]
    yield SimpleNamespace(
        producer=producer, consumer=consumer, consumer_omni=consumer_omni, conn=conn, made=made
    )
    for side in made:
        side.worker.shutdown()


def _send(
    producer: Any, blocks: list[int], rid: str = "p1", *, spec_order: bool = False, **req: Any
) -> dict[str, Any]:
    for t in producer.caches.values():
        t.copy_(torch.randn_like(t))
    request = _request(rid, {"do_remote_decode": True}, computed=len(PROMPT))
    for name, value in req.items():
        setattr(request, name, value)
    delay, params = producer.sched.request_finished(request, blocks)
    assert delay and params is not None
    assert producer.sched.has_pending_push_work()
    results = _step(producer, {rid}, spec_order=spec_order)
    assert results.finished_sending == {rid}
    assert not producer.sched.has_pending_push_work()
    return dict(params)


def _load(consumer: Any, params: dict[str, Any], rid: str, blocks: list[int], **req: Any) -> Any:
    request = _request(rid, params)
    for name, value in req.items():
        setattr(request, name, value)
    assert consumer.sched.get_num_new_matched_tokens(request, 0) == (len(PROMPT), True)
    consumer.sched.update_state_after_alloc(request, _blocks(blocks), len(PROMPT))
    return _step(consumer, set())


def _tokens(worker: Any, blocks: list[int]) -> list[torch.Tensor]:
    out = []
    for k, v in worker.layer_tokens(blocks, len(PROMPT)):
        out += [k, v]
    return out


def _same_tokens(edge: Any, consumer_blocks: list[int], producer_blocks: list[int]) -> bool:
    got = _tokens(edge.consumer.worker, consumer_blocks)
    want = _tokens(edge.producer.worker, producer_blocks)
    return all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


# -- the protocol -------------------------------------------------------------------------------
def test_send_then_load_writes_the_same_tokens(edge: Any) -> None:
    params = _send(edge.producer, [3, 5, 1])
    assert params["do_remote_prefill"] and params["omnikv_num_tokens"] == len(PROMPT)
    assert len(params["omnikv_binding"]) == 32
    assert edge.producer.worker.stats()["sends_ok"] == 1
    results = _load(edge.consumer, params, "c1", [6, 2, 7])
    assert results.finished_recving == {"c1"} and not results.failed_recving
    stats = edge.consumer.worker.stats()
    assert stats["loads_ok"] == 1 and stats["tokens_loaded"] == len(PROMPT)
    assert _same_tokens(edge, [6, 2, 7], [3, 5, 1])
    # The producer learns that the consumer accepted the KV.
    record = edge.producer.worker.transfer_record(params["omnikv_transfer_id"])
    assert record is not None and record["delivery"] == "delivered"
    _step(edge.producer, set())  # the producer counts the verdict on its next step
    assert edge.producer.worker.stats()["sends_delivered"] == 1
    # Loaded once: the request is not offered for loading again (e.g. after a preemption).
    assert edge.consumer.sched.get_num_new_matched_tokens(_request("c1", params), 0) == (0, False)


def test_free_blocks_on_verdict_holds_the_blocks_until_the_consumer_answers(edge: Any) -> None:
    """With ``free_blocks_on: verdict`` the producer reports the send finished (vLLM frees the
    blocks) only once the consumer's verdict is in; by default it does at once."""
    omni = {"omni_from_stage": 0, "omni_to_stage": 1, "connector_config": edge.conn}
    producer = _pair("kv_producer", omni, free_blocks_on="verdict")
    edge.made.append(producer)
    request = _request("p9", {"do_remote_decode": True}, computed=len(PROMPT))
    _, params = producer.sched.request_finished(request, [3, 5, 1])
    assert params is not None
    assert _step(producer, {"p9"}).finished_sending == set()  # staged, no verdict yet
    assert producer.sched.has_pending_push_work()
    assert _step(producer, set()).finished_sending == set()
    results = _load(edge.consumer, dict(params), "c9", [6, 2, 7])
    assert results.finished_recving == {"c9"}
    assert _step(producer, set()).finished_sending == {"p9"}  # delivered: blocks go back
    assert not producer.sched.has_pending_push_work()
    assert producer.worker.stats()["sends_delivered"] == 1


def test_free_blocks_on_verdict_frees_an_untaken_payloads_blocks_at_its_ttl(edge: Any) -> None:
    conn = {**edge.conn, "buffer_ttl_seconds": 0.2}
    omni = {"omni_from_stage": 0, "omni_to_stage": 1, "connector_config": conn}
    producer = _pair("kv_producer", omni, free_blocks_on="verdict")
    edge.made.append(producer)
    request = _request("p8", {"do_remote_decode": True}, computed=len(PROMPT))
    producer.sched.request_finished(request, [3, 5, 1])
    assert _step(producer, {"p8"}).finished_sending == set()
    deadline = time.monotonic() + 10
    while not _step(producer, set()).finished_sending:  # steps, as an idle engine runs them
        assert time.monotonic() < deadline, "the blocks were never given back"
        time.sleep(0.05)
    assert producer.worker.stats()["sends_expired"] == 1
    assert not producer.sched.has_pending_push_work()


def test_transfer_ids_are_fresh_and_unguessable(edge: Any) -> None:
    from omnikv.integrations.vllm.binding import check_transfer_id, producer_tag

    ids = set()
    for i in range(50):
        request = _request(f"r{i}", {"do_remote_decode": True}, computed=len(PROMPT))
        _, params = edge.producer.sched.request_finished(request, [1])
        ids.add(params["omnikv_transfer_id"])
    assert len(ids) == 50
    tag = producer_tag(edge.conn["namespace"])
    for tid in ids:
        assert check_transfer_id(tid, frozenset({tag}), "0" * 32, None) is None
        assert tid.startswith(f"okv1-{tag}-") and len(tid.split("-")[2]) == 32
    _step(edge.producer, {f"r{i}" for i in range(50)})


def test_partial_local_hit_loads_the_rest(edge: Any) -> None:
    params = _send(edge.producer, [3, 5, 1])
    sched, worker = edge.consumer.sched, edge.consumer.worker
    req = _request("c2", params)
    assert sched.get_num_new_matched_tokens(req, 4) == (6, True)  # one block computed locally
    sched.update_state_after_alloc(req, _blocks([0, 4, 6]), 6)
    assert _step(edge.consumer, set()).finished_recving == {"c2"}
    got, want = _tokens(worker, [0, 4, 6]), _tokens(edge.producer.worker, [3, 5, 1])
    for g, w in zip(got, want, strict=True):
        assert not g[:4].any()  # tokens of the local hit are not written
        assert torch.equal(g[4:], w[4:])


def test_speculative_decoding_order_still_reports_the_send(edge: Any) -> None:
    """vLLM 0.32 with speculative_config asks for results before wait_for_save."""
    params = _send(edge.producer, [3, 5, 1], spec_order=True)
    results = _load(edge.consumer, params, "c-spec", [6, 2, 7])
    assert results.finished_recving == {"c-spec"} and not results.failed_recving


def test_sends_run_concurrently(edge: Any) -> None:
    """One stuck send does not hold back the others (max_concurrent_sends threads)."""
    from omnikv.connectors.factory import OmniConnectorFactory
    from omnikv.connectors.local import LocalConnector

    gate = threading.Event()
    stuck_ids: list[str] = []

    class _Gated(LocalConnector):
        def put_packed(
            self, from_stage: str, to_stage: str, put_key: str, *a: Any, **k: Any
        ) -> Any:
            if any(t in put_key for t in stuck_ids):
                gate.wait(10)
            return super().put_packed(from_stage, to_stage, put_key, *a, **k)

    OmniConnectorFactory.register_connector("GatedLocalConnector", _Gated)
    conn = {"type": "GatedLocalConnector", "namespace": edge.conn["namespace"] + "g"}
    producer = _pair(
        "kv_producer", {"omni_from_stage": 0, "omni_to_stage": 1, "connector_config": conn}
    )
    edge.made.append(producer)
    stuck_req = _request("stuck", {"do_remote_decode": True}, computed=len(PROMPT))
    _, stuck = producer.sched.request_finished(stuck_req, [1, 2, 3])
    stuck_ids.append(stuck["omnikv_transfer_id"])
    ok_req = _request("ok", {"do_remote_decode": True}, computed=len(PROMPT))
    producer.sched.request_finished(ok_req, [4, 5, 6])
    producer.worker.bind_connector_metadata(producer.sched.build_connector_meta(None))
    producer.worker.start_load_kv(None)
    producer.worker.wait_for_save()
    deadline = time.monotonic() + 10
    sent: set[str] = set()
    while "ok" not in sent and time.monotonic() < deadline:
        sent |= producer.worker.get_transfer_results({"stuck", "ok"}).finished_sending
    assert sent == {"ok"}  # the stuck send is still in flight
    gate.set()
    assert producer.worker.wait_transfers(10)
    assert producer.worker.get_transfer_results(set()).finished_sending == {"stuck"}


def test_missing_kv_is_a_counted_failed_receive(edge: Any) -> None:
    params = _send(edge.producer, [3, 5, 1])
    tid = params["omnikv_transfer_id"]
    never = tid[:-6] + ("000000" if not tid.endswith("000000") else "111111")
    params = dict(params, omnikv_transfer_id=never)
    results = _load(edge.consumer, params, "c3", [1, 2, 3])
    assert results.finished_recving == {"c3"} and results.failed_recving == {"c3"}
    assert edge.consumer.worker.stats() == {"loads_failed": 1}
    assert "timeout" in edge.consumer.worker.transfer_record(never)["reason"]
    assert not any(t.any() for t in edge.consumer.caches.values())


def test_payload_that_does_not_fit_the_engine_is_refused(edge: Any) -> None:
    params = _send(edge.producer, [3, 5, 1])
    other = _pair("kv_consumer", edge.consumer_omni, layers=3)
    edge.made.append(other)
    results = _load(other, params, "c4", [1, 2, 3])
    assert results.failed_recving == {"c4"}
    reason = other.worker.transfer_record(params["omnikv_transfer_id"])["reason"]
    assert "2 layers, the engine 3" in reason
    assert not any(t.any() for t in other.caches.values())


def test_payload_of_another_dtype_is_refused_not_cast(edge: Any) -> None:
    params = _send(edge.producer, [3, 5, 1])
    other = _pair("kv_consumer", edge.consumer_omni, dtype=torch.bfloat16)
    edge.made.append(other)
    assert _load(other, params, "c5", [1, 2, 3]).failed_recving == {"c5"}
    reason = other.worker.transfer_record(params["omnikv_transfer_id"])["reason"]
    assert "dtype torch.float32, the engine torch.bfloat16" in reason
    assert not any(t.any() for t in other.caches.values())


# -- admission: client input is refused at once, never waited for --------------------------------
@pytest.mark.parametrize(
    "change",
    [
        {"omnikv_transfer_id": ""},
        {"omnikv_transfer_id": 12},
        {"omnikv_transfer_id": "never-sent"},
        {"omnikv_transfer_id": "okv1-" + "a" * 200},
        {"omnikv_transfer_id": "okv1-0000000g-" + "0" * 32},
        {"omnikv_transfer_id": "okv1-deadbeef-" + "0" * 32},  # a foreign producer tag
        {"omnikv_transfer_id": "OKV1-deadbeef-" + "0" * 32},
        {"omnikv_binding": "0" * 32},  # the client's binding is not this request's
        {"omnikv_binding": "not-hex"},
        {"omnikv_num_tokens": True},
        {"omnikv_num_tokens": 0},
        {"omnikv_num_tokens": "10"},
    ],
)
def test_params_that_cannot_be_ours_are_refused_at_once(edge: Any, change: dict[str, Any]) -> None:
    ns = edge.consumer_omni["connector_config"]["namespace"]
    from omnikv.integrations.vllm.binding import new_transfer_id, producer_tag

    params = {
        "do_remote_prefill": True,
        "omnikv_transfer_id": new_transfer_id(producer_tag(ns), "0" * 32, None),
        "omnikv_num_tokens": len(PROMPT),
    }
    sched = edge.consumer.sched
    assert sched.get_num_new_matched_tokens(_request("ok", params), 0) == (len(PROMPT), True)
    t0 = time.monotonic()
    assert sched.get_num_new_matched_tokens(_request("x", params | change), 0) == (0, False)
    assert time.monotonic() - t0 < 0.05
    assert sched.stats() == {"loads_refused": 1}
    stats = sched.get_kv_connector_stats()
    assert stats is not None and stats.data["loads_refused"] == 1
    assert sched.get_kv_connector_stats() is None  # one interval each


@pytest.mark.parametrize("params", [None, {}, {"do_remote_prefill": False}, ["x"], "x"])
def test_requests_without_remote_prefill_are_left_alone(edge: Any, params: Any) -> None:
    sched = edge.consumer.sched
    assert sched.get_num_new_matched_tokens(_request("a", params), 0) == (0, False)
    assert sched.stats() == {}


def test_a_stolen_id_with_another_prompt_neither_loads_nor_destroys(edge: Any) -> None:
    """Check first, consume only what fits: the thief's key is not the victim's."""
    params = _send(edge.producer, [3, 5, 1])
    thief_params = {k: v for k, v in params.items() if k != "omnikv_binding"}
    other_prompt = [t + 1 for t in PROMPT]
    thief = _request("thief", thief_params, prompt=other_prompt)
    sched = edge.consumer.sched
    assert sched.get_num_new_matched_tokens(thief, 0) == (len(PROMPT), True)
    sched.update_state_after_alloc(thief, _blocks([0, 1, 2]), len(PROMPT))
    assert _step(edge.consumer, set()).failed_recving == {"thief"}
    assert not any(t.any() for t in edge.consumer.caches.values())
    # The victim still gets its KV.
    results = _load(edge.consumer, params, "victim", [6, 2, 7])
    assert results.finished_recving == {"victim"} and not results.failed_recving
    assert _same_tokens(edge, [6, 2, 7], [3, 5, 1])


@pytest.mark.parametrize(
    "change",
    [
        {"lora_request": SimpleNamespace(lora_name="adapter-a")},
        {"cache_salt": "tenant-b"},
        {"mm_features": [SimpleNamespace(identifier="image-hash-1")]},
        {"prompt_token_ids": [*PROMPT[:-1], 999]},
    ],
)
def test_the_binding_covers_adapter_salt_media_and_tokens(
    edge: Any, change: dict[str, Any]
) -> None:
    """KV sent for one request never loads into a request that differs in any bound input."""
    params = _send(edge.producer, [3, 5, 1])
    request = _request("c", {k: v for k, v in params.items() if k != "omnikv_binding"})
    for name, value in change.items():
        setattr(request, name, value)
    sched = edge.consumer.sched
    assert sched.get_num_new_matched_tokens(request, 0) == (len(PROMPT), True)
    sched.update_state_after_alloc(request, _blocks([0, 1, 2]), len(PROMPT))
    assert _step(edge.consumer, set()).failed_recving == {"c"}
    assert not any(t.any() for t in edge.consumer.caches.values())
    # With the client's binding kept, the mismatch is refused at admission instead.
    request2 = _request("c2", params)
    for name, value in change.items():
        setattr(request2, name, value)
    assert sched.get_num_new_matched_tokens(request2, 0) == (0, False)


def test_a_different_model_never_loads(edge: Any) -> None:
    params = _send(edge.producer, [3, 5, 1])
    other = _pair("kv_consumer", edge.consumer_omni, model="another-model")
    edge.made.append(other)
    assert other.sched.get_num_new_matched_tokens(_request("c", params), 0) == (0, False)
    request = _request("c2", {k: v for k, v in params.items() if k != "omnikv_binding"})
    assert other.sched.get_num_new_matched_tokens(request, 0) == (len(PROMPT), True)
    other.sched.update_state_after_alloc(request, _blocks([0, 1, 2]), len(PROMPT))
    assert _step(other, set()).failed_recving == {"c2"}  # its key is not the payload's
    assert not any(t.any() for t in other.caches.values())


# -- concurrency and deadlines --------------------------------------------------------------------
def test_bogus_loads_do_not_delay_a_genuine_one(edge: Any) -> None:
    """Three admitted loads that will never arrive, then a genuine one, on ONE main load thread:
    each bogus load leaves it after ``load_first_wait_s`` to wait on the waiting pool."""
    from omnikv.integrations.vllm.binding import new_transfer_id

    ns = edge.consumer_omni["connector_config"]["namespace"]
    conn = dict(edge.conn)
    slow = {"stage_id": 1, "recv_timeout": 5.0, "connector_config": conn}
    consumer = _pair("kv_consumer", slow, max_concurrent_loads=1, load_first_wait_s=0.1)
    edge.made.append(consumer)
    from omnikv.integrations.vllm.binding import producer_tag

    sched = consumer.sched
    for i in range(3):
        bogus = {
            "do_remote_prefill": True,
            "omnikv_transfer_id": new_transfer_id(producer_tag(ns), "0" * 32, None),
            "omnikv_num_tokens": len(PROMPT),
        }
        req = _request(f"bogus{i}", bogus)
        assert sched.get_num_new_matched_tokens(req, 0) == (len(PROMPT), True)
        sched.update_state_after_alloc(req, _blocks([i, i, i]), len(PROMPT))
    consumer.worker.bind_connector_metadata(sched.build_connector_meta(None))
    consumer.worker.start_load_kv(None)
    params = _send(edge.producer, [3, 5, 1])
    req = _request("genuine", params)
    assert sched.get_num_new_matched_tokens(req, 0) == (len(PROMPT), True)
    sched.update_state_after_alloc(req, _blocks([6, 7, 4]), len(PROMPT))
    t0 = time.monotonic()
    consumer.worker.bind_connector_metadata(sched.build_connector_meta(None))
    consumer.worker.start_load_kv(None)
    done: set[str] = set()
    while "genuine" not in done and time.monotonic() - t0 < 5:
        results = consumer.worker.get_transfer_results(set())
        assert not results.failed_recving
        done |= results.finished_recving
    assert done == {"genuine"}
    assert time.monotonic() - t0 < 2.0  # not after the bogus ones' 5 s
    for side in (consumer,):
        side.worker.shutdown()  # cancels the bogus waits


def test_a_load_queued_past_its_deadline_fails_without_waiting(edge: Any) -> None:
    params = _send(edge.producer, [3, 5, 1])
    sched = edge.consumer.sched
    req = _request("late", params)
    assert sched.get_num_new_matched_tokens(req, 0) == (len(PROMPT), True)
    sched.update_state_after_alloc(req, _blocks([6, 2, 7]), len(PROMPT))
    time.sleep(0.6)  # the request's recv_timeout (0.5 s) passes before the step runs
    t0 = time.monotonic()
    results = _step(edge.consumer, set())
    assert results.failed_recving == {"late"}
    assert time.monotonic() - t0 < 0.3
    reason = edge.consumer.worker.transfer_record(params["omnikv_transfer_id"])["reason"]
    assert "before the load could start" in reason


def test_an_aborted_request_stops_its_load(edge: Any) -> None:
    from omnikv.integrations.vllm.binding import new_transfer_id, producer_tag

    ns = edge.consumer_omni["connector_config"]["namespace"]
    slow = {"stage_id": 1, "recv_timeout": 30.0, "connector_config": edge.conn}
    consumer = _pair("kv_consumer", slow)
    edge.made.append(consumer)
    params = {
        "do_remote_prefill": True,
        "omnikv_transfer_id": new_transfer_id(producer_tag(ns), "0" * 32, None),
        "omnikv_num_tokens": len(PROMPT),
    }
    req = _request("gone", params)
    sched, worker = consumer.sched, consumer.worker
    assert sched.get_num_new_matched_tokens(req, 0) == (len(PROMPT), True)
    sched.update_state_after_alloc(req, _blocks([1, 2, 3]), len(PROMPT))
    worker.bind_connector_metadata(sched.build_connector_meta(None))
    worker.start_load_kv(None)
    req.status = SimpleNamespace(name="FINISHED_ABORTED")
    assert sched.request_finished(req, [1, 2, 3]) == (False, None)
    t0 = time.monotonic()
    worker.bind_connector_metadata(sched.build_connector_meta(None))  # carries the cancel
    assert worker.wait_transfers(5.0)
    assert time.monotonic() - t0 < 2.0
    assert worker.get_transfer_results(set()).failed_recving == {"gone"}
    assert "cancel" in worker.transfer_record(params["omnikv_transfer_id"])["reason"]


def test_n_greater_than_one_loads_once_and_shares(edge: Any) -> None:
    """vLLM copies the params to every child: one loads, the others wait, then use the cache."""
    params = _send(edge.producer, [3, 5, 1])
    sched = edge.consumer.sched
    first, second = _request("0_parent", params), _request("1_parent", params)
    assert sched.get_num_new_matched_tokens(first, 0) == (len(PROMPT), True)
    sched.update_state_after_alloc(first, _blocks([6, 2, 7]), len(PROMPT))
    assert sched.get_num_new_matched_tokens(second, 0) == (None, False)  # ask again later
    results = _step(edge.consumer, set())
    assert results.finished_recving == {"0_parent"} and not results.failed_recving
    # Loaded: the sibling finds the blocks in the prefix cache (vLLM passes its local hit).
    assert sched.get_num_new_matched_tokens(second, 8) == (0, False)
    assert edge.consumer.worker.stats()["loads_ok"] == 1
    assert "loads_failed" not in edge.consumer.worker.stats()


# -- authentication ----------------------------------------------------------------------------
@pytest.fixture
def secure(edge: Any) -> Any:
    conn = dict(edge.conn, namespace=edge.conn["namespace"] + "s")
    producer = _pair(
        "kv_producer",
        {"omni_from_stage": 0, "omni_to_stage": 1, "connector_config": conn},
        auth_secret="s3cret",
    )
    consumer = _pair(
        "kv_consumer",
        {"stage_id": 1, "recv_timeout": 0.5, "connector_config": conn},
        auth_secret="s3cret",
    )
    edge.made += [producer, consumer]
    return SimpleNamespace(producer=producer, consumer=consumer, conn=conn)


def test_with_a_secret_ids_and_payloads_are_authenticated(secure: Any) -> None:
    params = _send(secure.producer, [3, 5, 1])
    assert len(params["omnikv_transfer_id"].split("-")) == 4  # carries its MAC
    results = _load(secure.consumer, params, "c1", [6, 2, 7])
    assert results.finished_recving == {"c1"} and not results.failed_recving


def test_with_a_secret_a_forged_id_is_refused_at_admission(secure: Any) -> None:
    params = _send(secure.producer, [3, 5, 1])
    tid = params["omnikv_transfer_id"]
    forged = tid[:-1] + ("0" if tid[-1] != "0" else "1")
    sched = secure.consumer.sched
    bad = dict(params, omnikv_transfer_id=forged)
    assert sched.get_num_new_matched_tokens(_request("x", bad), 0) == (0, False)
    no_mac = dict(params, omnikv_transfer_id=tid.rsplit("-", 1)[0])
    assert sched.get_num_new_matched_tokens(_request("y", no_mac), 0) == (0, False)
    # Another prompt with the genuine id: the MAC binds the id to its request.
    other = _request("z", {k: v for k, v in params.items() if k != "omnikv_binding"})
    other.prompt_token_ids = [t + 1 for t in PROMPT]
    assert sched.get_num_new_matched_tokens(other, 0) == (0, False)
    assert sched.stats() == {"loads_refused": 3}


def _attacker(conn: dict[str, Any], **options: Any) -> Any:
    """A sending manager on the engines' connector that does not hold their secret."""
    from omnikv.config import config_from_dict, options_from_dict
    from omnikv.manager import OmniKVTransferManager

    cfg = {
        "omni_from_stage": 0,
        "omni_to_stage": 1,
        "need_send_cache": True,
        "connector_config": conn,
        **options,
    }
    return OmniKVTransferManager(config_from_dict(cfg), options=options_from_dict(cfg))


def _forged_caches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """An attacker's KV cache (every value 1), shaped like the engines'."""
    return [
        (torch.ones(BLOCKS, BS, HEADS, DIM), torch.ones(BLOCKS, BS, HEADS, DIM)) for _ in range(2)
    ]


def test_with_a_secret_forged_kv_under_the_right_key_is_refused(secure: Any) -> None:
    """Someone who can write into the namespace but lacks the secret cannot inject KV."""
    from omnikv.config import config_from_dict, options_from_dict
    from omnikv.manager import OmniKVTransferManager

    params = _send(secure.producer, [3, 5, 1])
    key = f"{params['omnikv_transfer_id']}.{params['omnikv_binding']}"
    consumer_cfg = {
        "stage_id": 1,
        "recv_timeout": 2.0,
        "need_recv_cache": True,
        "connector_config": secure.conn,
    }
    with OmniKVTransferManager(
        config_from_dict(consumer_cfg), options=options_from_dict(consumer_cfg)
    ) as thief:
        assert thief.receive_kv_cache_result(key).ok  # take the genuine payload away
    caches = _forged_caches()
    with _attacker(secure.conn) as attacker:
        attacker.handle_finished_requests_kv_transfer(
            {
                key: {
                    "block_ids": [3, 5, 1],
                    "seq_len": len(PROMPT),
                    "custom_metadata": {
                        "omnikv_binding": params["omnikv_binding"],
                        "omnikv_mac": "0" * 32,
                    },
                }
            },
            kv_caches=caches,
            block_size=BS,
            cache_dtype="float32",
        )
        assert attacker.get_send_result(key).ok
        results = _load(secure.consumer, params, "c1", [6, 2, 7])
        # the forger learns its KV was refused, and why
        verdict = attacker.wait_delivered(key, timeout=5)
        assert verdict is not None and verdict.status.value == "refused"
        assert "MAC" in (verdict.reason or "")
    assert results.failed_recving == {"c1"}
    reason = secure.consumer.worker.transfer_record(params["omnikv_transfer_id"])["reason"]
    assert "MAC" in reason
    assert not any(t.any() for t in secure.consumer.caches.values())


# -- the producer -------------------------------------------------------------------------------
def test_producer_keeps_blocks_only_for_remote_decode(edge: Any) -> None:
    sched = edge.producer.sched
    plain = _request("a", None, computed=10)
    assert sched.request_finished(plain, [1, 2, 3]) == (False, None)
    aborted = _request("b", {"do_remote_decode": True}, computed=10)
    aborted.status = SimpleNamespace(name="FINISHED_ABORTED")
    assert sched.request_finished(aborted, [1, 2, 3]) == (False, None)
    embeds = _request("e", {"do_remote_decode": True}, computed=10)
    embeds.prompt_token_ids = None
    assert sched.request_finished(embeds, [1, 2, 3]) == (False, None)
    assert not sched.has_pending_push_work()
    # The consumer role never sends.
    consumer_sched = edge.consumer.sched
    assert consumer_sched.request_finished(_request("c", {"do_remote_decode": True}, 10), [1]) == (
        False,
        None,
    )


# -- metrics ----------------------------------------------------------------------------------
def test_stats_reach_vllms_logger_and_prometheus(edge: Any) -> None:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    from omnikv.integrations.vllm import OmniKVConnector

    params = _send(edge.producer, [3, 5, 1])
    _load(edge.consumer, params, "c1", [6, 2, 7])
    sent = edge.producer.worker.get_kv_connector_stats()
    loaded = edge.consumer.worker.get_kv_connector_stats()
    assert sent is not None and sent.data["sends_ok"] == 1 and sent.data["bytes_sent"] > 0
    assert loaded is not None and loaded.data["loads_ok"] == 1
    assert edge.consumer.worker.get_kv_connector_stats() is None  # the interval was taken
    # vLLM rebuilds the stats from their data dict in the frontend and aggregates them.
    total = OmniKVConnector.build_kv_connector_stats(dict(sent.data))
    total = total.aggregate(OmniKVConnector.build_kv_connector_stats(dict(loaded.data)))
    reduced = total.reduce()
    assert reduced["sends_ok"] == 1 and reduced["loads_ok"] == 1
    assert "load_seconds p50 (ms)" in reduced
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


def test_unknown_and_wrong_settings(edge: Any, caplog: pytest.LogCaptureFixture) -> None:
    from omnikv.errors import ConfigError
    from omnikv.integrations.vllm.options import parse_options

    with caplog.at_level("WARNING"):
        parse_options({"max_concurent_loads": 3}, producer=False, consumer=True)
    assert "max_concurent_loads" in caplog.text
    for bad in (
        {"max_concurrent_loads": 0},
        {"max_concurrent_sends": "many"},
        {"producer_tag": "xyz"},
        {"accept_producer_tags": []},
        {"auth_secret": ""},
        {"verify_finite": "yes"},
        {"vllm_kv_layout": "nope"},
        {"omni_kv_config": ["x"]},
        {"idle_step_wait_s": 1.0},
        {"idle_step_wait_s": -0.001},
        {"stream_layer_groups": 0},
        {"stream_layer_groups": 65},
        {"stream_layer_groups": "two"},
    ):
        with pytest.raises(ConfigError):
            parse_options(bad, producer=False, consumer=True)


def test_the_cpu_layout_follows_the_isa_vllm_picks(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """CPU_ATTN's caches have one shape and two layouts: the layout comes from the ISA vLLM's
    backend picks for the dtype, block size and head size; an ISA omnikv does not know turns
    transfers off with the reason logged, never a guess."""
    from vllm.v1.attention.backends import cpu_attn

    from omnikv.integrations.vllm.connector import cpu_cache_layout

    def config(dtype: torch.dtype, block_size: int, head_size: int) -> Any:
        model = SimpleNamespace(dtype=dtype, get_head_size=lambda: head_size)
        cache = SimpleNamespace(block_size=block_size, cache_dtype="auto")
        return SimpleNamespace(model_config=model, cache_config=cache)

    assert cpu_cache_layout(config(torch.float32, 32, 64)) == "vllm_cpu"
    assert cpu_cache_layout(config(torch.bfloat16, 16, 64)) == "vllm_cpu"  # vec16
    packed = "vllm_cpu_amx" if torch.cpu._is_amx_tile_supported() else "vllm_cpu"
    assert cpu_cache_layout(config(torch.bfloat16, 32, 64)) == packed
    monkeypatch.setattr(cpu_attn, "_get_attn_isa", lambda *args: "neon")
    with caplog.at_level(logging.ERROR):
        assert cpu_cache_layout(config(torch.float32, 32, 64)) is None
    assert "ISA 'neon'" in caplog.text


def test_a_shared_memory_producer_declares_its_payload_size() -> None:
    """The shared-memory reserve is sized from the engine: 2 x layers x heads x head size x dtype
    bytes per token, times max_model_len; declared keys win, other connectors are left alone."""
    from omnikv.integrations.vllm.connector import declare_payload_size

    model = SimpleNamespace(
        dtype=torch.bfloat16,
        max_model_len=4096,
        get_num_kv_heads=lambda parallel: 4,
        get_num_layers=lambda parallel: 28,
        get_head_size=lambda: 128,
    )
    vllm_config = SimpleNamespace(model_config=model, parallel_config=None)
    cfg = {"need_send_cache": True, "connector_config": {"type": "SharedMemoryConnector"}}
    declare_payload_size(cfg, vllm_config)
    assert cfg["connector_config"]["kv_bytes_per_token"] == 2 * 28 * 4 * 128 * 2
    assert cfg["connector_config"]["max_model_len"] == 4096
    declared = {
        "need_send_cache": True,
        "connector_config": {"type": "SharedMemoryConnector", "max_model_len": 512},
    }
    declare_payload_size(declared, vllm_config)
    assert declared["connector_config"]["max_model_len"] == 512
    for other in (
        {"need_send_cache": True, "connector_config": {"type": "LocalConnector"}},
        {"need_recv_cache": True, "connector_config": {"type": "SharedMemoryConnector"}},
    ):
        declare_payload_size(other, vllm_config)
        assert "kv_bytes_per_token" not in other["connector_config"]


_PINNED_WORKER = r"""
import json, os, sys, threading, time
from types import SimpleNamespace
os.sched_setaffinity(0, {0})  # what vLLM's CPU backend does to its worker's thread
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from omnikv.integrations.vllm import OmniKVConnector
conn = {"type": "SharedMemoryConnector", "namespace": sys.argv[1], "pool_size_bytes": 4 << 20}
omni = {"omni_from_stage": 0, "omni_to_stage": 1, "connector_config": conn}
ktc = KVTransferConfig(kv_connector="OmniKVConnector", kv_role="kv_producer",
    kv_connector_module_path="omnikv.integrations.vllm",
    kv_connector_extra_config={"omni_kv_config": omni, "vllm_kv_layout": "vllm_cpu"})
cfg = SimpleNamespace(kv_transfer_config=ktc, cache_config=SimpleNamespace(block_size=4))
worker = OmniKVConnector(cfg, KVConnectorRole.WORKER, None)
out = {}
for tid in os.listdir("/proc/self/task"):
    with open(f"/proc/self/task/{tid}/status") as f:
        line = next(l for l in f if l.startswith("Cpus_allowed_list"))
    out[tid] = line.split(":")[1].strip()
worker.shutdown()
print(json.dumps({"main": out.pop(str(os.getpid())), "others": sorted(set(out.values()))}))
"""


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two CPUs")
def test_transfer_threads_are_not_pinned_to_the_engines_core(namespace: str) -> None:
    """vLLM's CPU backend pins its worker's thread to a compute core and threads inherit it:
    omnikv's transport threads (here a shared-memory sender's) run on every allowed CPU."""
    import json
    import subprocess
    import sys

    from omnikv.integrations.vllm.worker import transfer_cpus

    proc = subprocess.run(
        [sys.executable, "-c", _PINNED_WORKER, namespace],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["main"] == "0"
    cpus = transfer_cpus()
    assert cpus is not None and len(cpus) >= 2
    assert report["others"] and "0" not in report["others"]  # no thread left on the pinned core


# -- stream_kv: the producer ships blocks while it prefills ---------------------------------------
def _step_with(
    side: Any,
    scheduler_output: Any,
    finished: set[str],
    *,
    by_layer: bool = False,
    between: Any = None,
) -> Any:
    """One engine step with vLLM's scheduler output (what ``build_connector_meta`` gets).
    ``by_layer``: its forward pass calls ``save_kv_layer`` after each layer (vLLM's attention
    wrapper), then ``between(layer_index)``."""
    sched, worker = side.sched, side.worker
    worker.bind_connector_metadata(sched.build_connector_meta(scheduler_output))
    worker.start_load_kv(None)
    for i, (name, cache) in enumerate(side.caches.items() if by_layer else ()):
        worker.wait_for_layer_load(name)
        worker.save_kv_layer(name, cache, None)
        if between is not None:
            between(i)
    worker.wait_for_save()
    assert worker.wait_transfers(10.0)
    results = worker.get_transfer_results(finished)
    worker.clear_connector_metadata()
    sched.update_connector_output(results)
    return results


def _output(new: list[Any], cached: list[tuple[str, int, list[int] | None]], sched: dict) -> Any:
    """A scheduler output: new requests, cached ones as (id, computed, new blocks), tokens."""
    return SimpleNamespace(
        scheduled_new_reqs=new,
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[c[0] for c in cached],
            num_computed_tokens=[c[1] for c in cached],
            new_block_ids=[None if c[2] is None else (c[2],) for c in cached],
            resumed_req_ids=set(),
        ),
        num_scheduled_tokens=sched,
    )


def test_a_streaming_producer_ships_blocks_during_chunked_prefill(edge: Any) -> None:
    """vLLM's call sequence for a prompt prefilled in two chunks (4 then 6 tokens, blocks of
    4): each chunk's full blocks ship after its forward pass, the finish sends the partial
    block and the manifest under the same transfer id; the consumer writes the same tokens."""
    conn = edge.conn
    omni = {"omni_from_stage": 0, "omni_to_stage": 1, "connector_config": conn, "stream_kv": True}
    producer = _pair("kv_producer", omni)
    edge.made.append(producer)
    for t in producer.caches.values():
        t.copy_(torch.randn_like(t))
    request = _request("s1", {"do_remote_decode": True})
    producer.sched.update_state_after_alloc(request, _blocks([3, 5, 1]), 0)
    new = SimpleNamespace(req_id="s1", block_ids=([3, 5, 1],), num_computed_tokens=0)
    _step_with(producer, _output([new], [], {"s1": 4}), set())
    assert producer.worker.stats()["chunks_streamed"] == 1  # block 3, after the first chunk
    _step_with(producer, _output([], [("s1", 4, None)], {"s1": 6}), set())
    assert producer.worker.stats()["chunks_streamed"] == 2  # block 5; block 1 is partial
    request.num_computed_tokens = len(PROMPT)
    delay, params = producer.sched.request_finished(request, [3, 5, 1])
    assert delay and params is not None
    results = _step_with(producer, _output([], [], {}), {"s1"})
    assert results.finished_sending == {"s1"}
    record = producer.worker.transfer_record(params["omnikv_transfer_id"])
    assert record is not None and record["ok"], record
    load = _load(edge.consumer, dict(params), "c1", [6, 2, 7])
    assert load.finished_recving == {"c1"} and not load.failed_recving
    got = _tokens(edge.consumer.worker, [6, 2, 7])
    want = _tokens(producer.worker, [3, 5, 1])
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_a_streamed_request_that_is_aborted_leaves_no_chunk(edge: Any) -> None:
    conn = edge.conn
    omni = {"omni_from_stage": 0, "omni_to_stage": 1, "connector_config": conn, "stream_kv": True}
    producer = _pair("kv_producer", omni)
    edge.made.append(producer)
    request = _request("s2", {"do_remote_decode": True})
    producer.sched.update_state_after_alloc(request, _blocks([0, 1, 2]), 0)
    new = SimpleNamespace(req_id="s2", block_ids=([0, 1, 2],), num_computed_tokens=0)
    _step_with(producer, _output([new], [], {"s2": 8}), set())
    assert producer.worker.stats()["chunks_streamed"] == 1
    from omnikv.connectors.local import LocalConnector

    probe = LocalConnector(conn)
    try:
        assert any("#c0" in k for k in probe.pending_keys())
        request.status = SimpleNamespace(name="FINISHED_ABORTED")
        assert producer.sched.request_finished(request, [0, 1, 2]) == (False, None)
        _step_with(producer, _output([], [], {}), set())  # the abort reaches the worker
        assert probe.pending_keys() == []
    finally:
        probe.close()


# -- early hand-off: a router's id, the consumer waiting while the producer streams --------------
def _early_edge(
    edge: Any,
    secret: str | None = "r0uter",
    recv_timeout: float = 10.0,
    layers: int = 2,
    **producer_options: Any,
) -> Any:
    """A streaming producer and a streaming consumer (``stream_kv``), with ``auth_secret``;
    ``producer_options``: more of the producer's ``kv_connector_extra_config``."""
    conn = dict(edge.conn, namespace=edge.conn["namespace"] + "e")
    extra = {} if secret is None else {"auth_secret": secret}
    base = {"connector_config": conn, "stream_kv": True}
    producer_omni = {"omni_from_stage": 0, "omni_to_stage": 1, **base}
    producer = _pair("kv_producer", producer_omni, layers, **extra, **producer_options)
    consumer_omni = {"stage_id": 1, "recv_timeout": recv_timeout, **base}
    consumer = _pair("kv_consumer", consumer_omni, layers, **extra)
    edge.made += [producer, consumer]
    return SimpleNamespace(producer=producer, consumer=consumer, conn=conn)


def _router_id(conn: dict[str, Any], secret: bytes = b"r0uter") -> str:
    from omnikv.integrations.vllm.binding import new_router_transfer_id, producer_tag

    return new_router_transfer_id(producer_tag(conn["namespace"]), secret)


def _finish_early_hand_off(producer: Any, request: Any, tid: str, consumer: Any) -> None:
    """The producer finishes ``request`` (prompt blocks 3, 5, 1) under the router's id
    ``tid``; the consumer's load (blocks 6, 2, 7) then ends with the producer's tokens."""
    request.num_computed_tokens = len(PROMPT)
    delay, params = producer.sched.request_finished(request, [3, 5, 1])
    assert delay and params is not None and params["omnikv_transfer_id"] == tid
    assert _step_with(producer, _output([], [], {}), {"s1"}).finished_sending == {"s1"}
    worker = consumer.worker
    assert worker.wait_transfers(10.0)
    results = worker.get_transfer_results(set())
    assert results.finished_recving == {"c1"} and not results.failed_recving
    got = _tokens(worker, [6, 2, 7])
    want = _tokens(producer.worker, [3, 5, 1])
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def _start_early_load(consumer: Any, params: dict[str, Any], rid: str, blocks: list[int]) -> None:
    """Admit and start a consumer's load without waiting for it (its KV does not exist yet)."""
    request = _request(rid, params)
    assert consumer.sched.get_num_new_matched_tokens(request, 0) == (len(PROMPT), True)
    consumer.sched.update_state_after_alloc(request, _blocks(blocks), len(PROMPT))
    worker = consumer.worker
    worker.bind_connector_metadata(consumer.sched.build_connector_meta(None))
    worker.start_load_kv(None)
    worker.wait_for_save()
    assert worker.get_transfer_results(set()).finished_recving == set()  # still waiting
    worker.clear_connector_metadata()


def test_an_early_hand_off_loads_what_the_producer_streams_under_the_routers_id(
    edge: Any,
) -> None:
    """A router issues the id and sends both requests at once: the consumer is admitted and
    waits while the producer prefills in two chunks; it takes the chunks as they are published
    and, after the producer's finish, writes the producer's tokens."""
    from omnikv.connectors.local import LocalConnector
    from omnikv.integrations.vllm import early_handoff_params

    pair = _early_edge(edge)
    tid = _router_id(pair.conn)
    to_producer, to_consumer = early_handoff_params(tid, len(PROMPT))
    _start_early_load(pair.consumer, to_consumer, "c1", [6, 2, 7])
    producer = pair.producer
    for t in producer.caches.values():
        t.copy_(torch.randn_like(t))
    request = _request("s1", to_producer)
    producer.sched.update_state_after_alloc(request, _blocks([3, 5, 1]), 0)
    new = SimpleNamespace(req_id="s1", block_ids=([3, 5, 1],), num_computed_tokens=0)
    _step_with(producer, _output([new], [], {"s1": 4}), set())
    probe = LocalConnector(pair.conn)
    try:  # the waiting consumer takes the first chunk before the producer goes on
        deadline = time.monotonic() + 10
        while any("#c0" in k for k in probe.pending_keys()) and time.monotonic() < deadline:
            time.sleep(0.005)
        assert not any("#c0" in k for k in probe.pending_keys())
    finally:
        probe.close()
    worker = pair.consumer.worker
    # ... checks it (its own MAC) and writes it into the request's first block at once
    deadline = time.monotonic() + 10
    while worker.stats().get("chunks_loaded", 0) < 1 and time.monotonic() < deadline:
        time.sleep(0.005)
    first = [k for k, _ in worker.layer_tokens([6], BS)]
    assert all(
        torch.equal(a, b)
        for a, b in zip(first, [k for k, _ in producer.worker.layer_tokens([3], BS)], strict=True)
    )
    _step_with(producer, _output([], [("s1", 4, None)], {"s1": 6}), set())
    assert producer.worker.stats()["chunks_streamed"] == 2
    _finish_early_hand_off(producer, request, tid, pair.consumer)
    assert producer.sched.stats().get("router_ids_refused", 0) == 0
    assert worker.stats()["chunks_loaded"] == 2  # at the finish only the tail was checked


def test_a_forged_chunk_ends_an_early_load_at_once(edge: Any) -> None:
    """Someone who can publish into the namespace but lacks the secret puts a chunk under the
    key an early consumer waits on: the consumer checks it as it arrives, refuses it (its MAC),
    fails the load at once instead of at its deadline, and writes nothing."""
    from omnikv.integrations.vllm import early_handoff_params
    from omnikv.integrations.vllm.binding import request_binding

    pair = _early_edge(edge, recv_timeout=30.0)
    tid = _router_id(pair.conn)
    _, to_consumer = early_handoff_params(tid, len(PROMPT))
    t0 = time.monotonic()
    _start_early_load(pair.consumer, to_consumer, "c1", [6, 2, 7])
    fingerprint = pair.consumer.sched._scheduler.fingerprint
    binding = request_binding(fingerprint, _request("c1", to_consumer), len(PROMPT))
    with _attacker(pair.conn, stream_kv=True) as attacker:
        progress = attacker.stream_kv_blocks(
            f"{tid}.{binding}",
            {"block_ids": [0, 1], "seq_len": 2 * BS},
            _forged_caches(),
            BS,
            "float32",
            seal=lambda start, stop, ids: {"omnikv_mac": "0" * 32},
        )
        assert progress.new == 2 * BS
        worker = pair.consumer.worker
        assert worker.wait_transfers(10.0)
    assert time.monotonic() - t0 < 10.0  # not recv_timeout (30 s)
    assert worker.get_transfer_results(set()).failed_recving == {"c1"}
    reason = worker.transfer_record(tid)["reason"]
    assert "chunk 0: the MAC does not match" in reason, reason
    assert worker.stats().get("chunks_loaded", 0) == 0
    assert not any(t.any() for t in pair.consumer.caches.values())


def _forge(spec: dict[str, Any]) -> Any:
    """Start :mod:`support.forger` (its own process) on ``spec``; returns it once its forged
    chunks are published."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "support" / "forger.py"
    proc = subprocess.Popen(
        [sys.executable, str(script), json.dumps(spec)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    assert line == "sent", line
    return proc


@pytest.mark.parametrize("stamp", ["huge epoch", "next sequence numbers"])
def test_a_forgery_refused_for_its_mac_leaves_no_mark(stamp: str, namespace: str) -> None:
    """Check, then remember: a forger in another process, on the engines' shared memory but
    without their secret, publishes chunks under an early consumer's key stamped with the
    producer's instance and a huge epoch, or with the producer's session and its next sequence
    numbers (both readable from any header). The consumer refuses them for their MAC, and the
    producer's next genuine early hand-off still loads: the refused stamps changed nothing."""
    from omnikv.integrations.vllm import early_handoff_params
    from omnikv.integrations.vllm.binding import request_binding

    conn = {"type": "SharedMemoryConnector", "namespace": namespace, "pool_size_bytes": 4 << 20}
    base = {"connector_config": conn, "stream_kv": True}
    producer_omni = {"omni_from_stage": 0, "omni_to_stage": 1, "instance_id": "prefill-0", **base}
    producer = _pair("kv_producer", producer_omni, auth_secret="r0uter")
    consumer = _pair(
        "kv_consumer", {"stage_id": 1, "recv_timeout": 30.0, **base}, auth_secret="r0uter"
    )
    proc = None
    try:
        tid = _router_id(conn)
        _, to_consumer = early_handoff_params(tid, len(PROMPT))
        _start_early_load(consumer, to_consumer, "c0", [0, 4, 1])
        fingerprint = consumer.sched._scheduler.fingerprint
        binding = request_binding(fingerprint, _request("c0", to_consumer), len(PROMPT))
        genuine = producer.worker._worker.manager._sender.stamps
        forged = {"session": "f" * 16, "epoch": genuine.epoch + 10**15}
        if stamp == "next sequence numbers":
            forged = {"session": genuine.session, "epoch": genuine.epoch}
        proc = _forge(
            {
                "conn": conn,
                "key": f"{tid}.{binding}",
                "instance": "prefill-0",
                "seq": 0,  # the producer has sent nothing yet
                **forged,
                **{"block": BS, "heads": HEADS, "dim": DIM, "blocks": BLOCKS, "layers": 2},
                "tokens": 2 * BS,
            }
        )
        worker = consumer.worker
        assert worker.wait_transfers(10.0)
        assert worker.get_transfer_results(set()).failed_recving == {"c0"}
        assert "MAC does not match" in worker.transfer_record(tid)["reason"]
        assert not any(t.any() for t in consumer.caches.values())
        # the producer's next genuine early hand-off, prefilled in two chunks
        tid = _router_id(conn)
        to_producer, to_consumer = early_handoff_params(tid, len(PROMPT))
        _start_early_load(consumer, to_consumer, "c1", [6, 2, 7])
        for t in producer.caches.values():
            t.copy_(torch.randn_like(t))
        request = _request("s1", to_producer)
        producer.sched.update_state_after_alloc(request, _blocks([3, 5, 1]), 0)
        new = SimpleNamespace(req_id="s1", block_ids=([3, 5, 1],), num_computed_tokens=0)
        _step_with(producer, _output([new], [], {"s1": 4}), set())
        _step_with(producer, _output([], [("s1", 4, None)], {"s1": 6}), set())
        _finish_early_hand_off(producer, request, tid, consumer)
        assert worker.stats()["chunks_loaded"] == 2
    finally:
        if proc is not None:
            assert proc.stdin is not None
            proc.stdin.close()
            try:
                proc.wait(timeout=20)
            finally:
                proc.kill()
        for side in (producer, consumer):
            side.worker.shutdown()


def test_a_producer_uses_only_its_own_fresh_router_ids(edge: Any) -> None:
    """Offered ids a producer must not use get a fresh id (counted): a producer-style id a
    client made up, a router id with a wrong MAC, one for another producer's tag, one another
    request used; consumers refuse the forged ones at admission."""
    from omnikv.integrations.vllm import early_handoff_params
    from omnikv.integrations.vllm.binding import new_router_transfer_id

    pair = _early_edge(edge)
    good = _router_id(pair.conn)
    forged = good[:-1] + ("0" if good[-1] != "0" else "1")
    offers = {
        "made-up": "okv1-" + good.split("-")[1] + "-" + "ab" * 16,
        "forged": forged,
        "other-secret": _router_id(pair.conn, b"not-the-secret"),
        "other-producer": new_router_transfer_id("0badc0de", b"r0uter"),
    }
    sched = pair.producer.sched
    for name, offered in offers.items():
        request = _request(f"p-{name}", {"do_remote_decode": True, "omnikv_transfer_id": offered})
        request.num_computed_tokens = len(PROMPT)
        _, params = sched.request_finished(request, [1])
        assert params is not None and params["omnikv_transfer_id"] != offered, name
    first = _request("p-first", {"do_remote_decode": True, "omnikv_transfer_id": good})
    first.num_computed_tokens = len(PROMPT)
    assert sched.request_finished(first, [2])[1]["omnikv_transfer_id"] == good
    again = _request("p-again", {"do_remote_decode": True, "omnikv_transfer_id": good})
    again.num_computed_tokens = len(PROMPT)
    assert sched.request_finished(again, [3])[1]["omnikv_transfer_id"] != good
    assert sched.stats()["router_ids_refused"] == len(offers) + 1
    consumer = pair.consumer.sched
    for name in ("forged", "other-secret"):
        _, to_consumer = early_handoff_params(offers[name], len(PROMPT))
        assert consumer.get_num_new_matched_tokens(_request(f"c-{name}", to_consumer), 0) == (
            0,
            False,
        ), name


def test_without_a_secret_there_are_no_router_ids(edge: Any) -> None:
    from omnikv.integrations.vllm import early_handoff_params

    pair = _early_edge(edge, secret=None)
    tid = _router_id(pair.conn)
    to_producer, to_consumer = early_handoff_params(tid, len(PROMPT))
    request = _request("p1", to_producer)
    request.num_computed_tokens = len(PROMPT)
    _, params = pair.producer.sched.request_finished(request, [1])
    assert params is not None and params["omnikv_transfer_id"] != tid
    assert pair.producer.sched.stats()["router_ids_refused"] == 1
    assert pair.consumer.sched.get_num_new_matched_tokens(_request("c1", to_consumer), 0) == (
        0,
        False,
    )


def test_an_early_consumer_whose_producer_aborts_mid_stream_fails_cleanly(edge: Any) -> None:
    """The producer ships a chunk (the waiting consumer takes it), then its request is aborted:
    the consumer's load fails at its deadline (vLLM recomputes), and no chunk is left behind in
    the connector, neither the one taken nor any other."""
    from omnikv.connectors.local import LocalConnector
    from omnikv.integrations.vllm import early_handoff_params

    pair = _early_edge(edge, recv_timeout=1.5)
    tid = _router_id(pair.conn)
    to_producer, to_consumer = early_handoff_params(tid, len(PROMPT))
    _start_early_load(pair.consumer, to_consumer, "c1", [6, 2, 7])
    producer = pair.producer
    request = _request("s1", to_producer)
    producer.sched.update_state_after_alloc(request, _blocks([3, 5, 1]), 0)
    new = SimpleNamespace(req_id="s1", block_ids=([3, 5, 1],), num_computed_tokens=0)
    _step_with(producer, _output([new], [], {"s1": 8}), set())
    assert producer.worker.stats()["chunks_streamed"] == 1
    request.status = SimpleNamespace(name="FINISHED_ABORTED")
    assert producer.sched.request_finished(request, [3, 5, 1]) == (False, None)
    _step_with(producer, _output([], [], {}), set())  # the abort reaches the worker
    worker = pair.consumer.worker
    assert worker.wait_transfers(10.0)
    results = worker.get_transfer_results(set())
    assert results.finished_recving == {"c1"} and results.failed_recving == {"c1"}
    assert worker.stats()["loads_failed"] == 1
    probe = LocalConnector(pair.conn)
    try:
        assert probe.pending_keys() == []
    finally:
        probe.close()


def test_every_count_is_exported_to_prometheus() -> None:
    from omnikv.integrations.vllm.stats import _COUNTER_DOCS, COUNTS

    assert set(_COUNTER_DOCS) == set(COUNTS)


def _sealed_kv(tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(tokens, 2, 4, generator=g), torch.randn(tokens, 2, 4, generator=g))]


def test_the_kv_mac_is_hmac_sha256_over_key_start_shapes_and_bytes() -> None:
    """``kv_mac``'s construction is pinned (producer and consumer of two omnikv builds must
    agree): HMAC-SHA256 under the derived key, its domain first, then length-prefixed key,
    start, first layer and each tensor's dtype and shape before its bytes, truncated to 32
    hex. Every input it covers changes it."""
    import hashlib
    import hmac
    import json

    from omnikv.integrations.vllm.binding import KV_MAC_DOMAIN, _secret_key, kv_mac

    secret, key = b"s3cret", "tid.binding"
    kv = _sealed_kv(6)

    def field(value: bytes) -> bytes:
        return len(value).to_bytes(8, "little") + value

    msg = KV_MAC_DOMAIN + field(key.encode()) + field(b"3") + field(b"0")
    for k, v in kv:
        for t in (k, v):
            msg += field(json.dumps([str(t.dtype), list(t.shape)]).encode())
            msg += t.contiguous().view(torch.uint8).numpy().tobytes()
    want = hmac.new(_secret_key(secret), msg, hashlib.sha256).hexdigest()[:32]
    assert kv_mac(secret, key, kv, 3) == want
    flipped = [(k.clone(), v.clone()) for k, v in kv]
    flipped[0][1].view(torch.uint8)[-1] ^= 1  # one bit of the last V byte
    others = {
        kv_mac(b"other", key, kv, 3),
        kv_mac(secret, "tid.other", kv, 3),
        kv_mac(secret, key, kv, 4),
        kv_mac(secret, key, kv, 3, first_layer=1),
        kv_mac(secret, key, flipped, 3),
        kv_mac(secret, key, [(k.reshape(6, 8), v.reshape(6, 8)) for k, v in kv], 3),
        kv_mac(secret, key, [(k.to(torch.float64), v.to(torch.float64)) for k, v in kv], 3),
    }
    assert want not in others and len(others) == 7


def test_sealed_ranges_check_each_piece_and_refuse_hostile_lists() -> None:
    """A streamed finish's ``[start, stop, mac]`` list: a whole payload is checked range by
    range; a tail (``offset``) only from its own range on; anything malformed is refused."""
    from omnikv.integrations.vllm.binding import MAX_SEALED_RANGES, check_sealed_ranges, kv_mac

    secret, key = b"s3cret", "tid.binding"
    kv = _sealed_kv(10)

    def seal(a: int, b: int) -> list[Any]:
        return [a, b, kv_mac(secret, key, [(k[a:b], v[a:b]) for k, v in kv], a)]

    good = [seal(0, 4), seal(4, 8), seal(8, 10)]
    assert check_sealed_ranges(secret, key, kv, good) is None
    tail = [(k[8:], v[8:]) for k, v in kv]
    assert check_sealed_ranges(secret, key, tail, good, offset=8) is None
    # the chunks' MACs are not looked at for a tail: they were checked as the chunks came
    assert check_sealed_ranges(secret, key, tail, [[0, 8, "x"], seal(8, 10)], offset=8) is None
    bad_mac = [seal(0, 4), [4, 8, "0" * 32], seal(8, 10)]
    assert "tokens [4, 8)" in (check_sealed_ranges(secret, key, kv, bad_mac) or "")
    assert "MAC" in (check_sealed_ranges(b"other", key, kv, good) or "")
    assert "MAC" in (check_sealed_ranges(secret, "tid.other", kv, good) or "")
    hostile: list[Any] = [
        None,
        [],
        "0,4,x",
        [seal(0, 4), seal(8, 10)],  # a gap
        [seal(0, 4), [4, 8.0, "x"], seal(8, 10)],  # not ints
        [[1, 4, "x"], seal(4, 8), seal(8, 10)],  # not from 0
        [seal(0, 4), seal(4, 8)],  # ends before the KV does
        [seal(0, 10)] * (MAX_SEALED_RANGES + 1),  # too many
        [[0, 4, "x", 1], seal(4, 8), seal(8, 10)],
    ]
    for sealed in hostile:
        assert check_sealed_ranges(secret, key, kv, sealed) is not None, sealed
    # a tail that does not start where a sealed range does
    off = [(k[6:], v[6:]) for k, v in kv]
    assert "no sealed range starts at" in (check_sealed_ranges(secret, key, off, good, 6) or "")


def test_sealed_layer_groups_are_checked_group_by_group() -> None:
    """A stream shipped layer by layer seals each group: ``[start, stop, mac, first, end]``,
    the MAC over those layers bound to the first; a whole payload is checked group by group,
    and a group list out of layer order or missing a range's last layers is refused."""
    from omnikv.integrations.vllm.binding import check_sealed_ranges, kv_mac

    secret, key = b"s3cret", "tid.binding"
    g = torch.Generator().manual_seed(5)
    kv = [(torch.randn(10, 2, 4, generator=g), torch.randn(10, 2, 4, generator=g)) for _ in "abc"]

    def group(a: int, b: int, first: int, end: int) -> list[Any]:
        tokens = [(k[a:b], v[a:b]) for k, v in kv[first:end]]
        return [a, b, kv_mac(secret, key, tokens, a, first), first, end]

    def whole(a: int, b: int) -> list[Any]:
        return [a, b, kv_mac(secret, key, [(k[a:b], v[a:b]) for k, v in kv], a)]

    good = [group(0, 4, 0, 1), group(0, 4, 1, 3), group(4, 8, 0, 2), group(4, 8, 2, 3)]
    good.append(whole(8, 10))
    assert check_sealed_ranges(secret, key, kv, good) is None
    tail = [(k[8:], v[8:]) for k, v in kv]
    assert check_sealed_ranges(secret, key, tail, good, offset=8) is None
    swapped = [[*good[0][:2], good[1][2], *good[0][3:]], [*good[1][:2], good[0][2], *good[1][3:]]]
    assert "MAC" in (check_sealed_ranges(secret, key, kv, swapped + good[2:]) or "")
    hostile: list[Any] = [
        [good[1], good[0], *good[2:]],  # layers out of order
        [good[0], *good[2:]],  # a range missing its last layers
        [good[0], group(0, 4, 1, 2), *good[2:]],  # one layer short
        [good[0], [*good[1][:3], 1, 4], *good[2:]],  # past the last layer
        [*good[:3], whole(8, 10)],  # the last group of [4, 8) missing
        [good[0], [0, 5, good[1][2], 1, 3], *good[2:]],  # a group of another range
    ]
    for sealed in hostile:
        assert check_sealed_ranges(secret, key, kv, sealed) is not None, sealed
    assert "not in order" in (check_sealed_ranges(secret, key, kv, hostile[0]) or "")


def test_the_layers_are_cut_into_even_runs(edge: Any) -> None:
    from omnikv.integrations.vllm.options import default_layer_groups
    from omnikv.integrations.vllm.worker import layer_groups

    # unset: 2 groups for a cache in host memory, 1 on a device
    assert default_layer_groups(torch.device("cpu")) == 2
    assert default_layer_groups(torch.device("meta")) == 1
    assert edge.producer.worker._worker._groups == [(0, 1), (1, 2)]
    assert layer_groups(8, 1) == [(0, 8)]
    assert layer_groups(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert layer_groups(7, 3) == [(0, 2), (2, 5), (5, 7)]
    assert layer_groups(3, 8) == [(0, 1), (1, 2), (2, 3)]  # at most one per layer


def test_a_chunk_of_a_stream_of_other_layers_is_refused_before_any_write(edge: Any) -> None:
    """A consumer refuses, before writing, a chunk whose stream has another layer count than
    its engine, even one whose own layers would fit (the first layers of a shorter model)."""
    from omnikv.integrations.vllm.metadata import LoadSpec
    from omnikv.transfer.received import ReceivedChunk

    worker = edge.consumer.worker._worker
    spec = LoadSpec("c1", "t", "t.b", "b", (6, 2, 7), 0, len(PROMPT), 10.0)
    k = torch.ones(BS, HEADS, DIM)
    before = _tokens(edge.consumer.worker, [6, 2, 7])
    written = [0]
    for layers, first, count in ((3, 0, 1), (1, 0, 1), (2, 1, 1)):
        chunk = ReceivedChunk("c1", 0, 0, BS, {}, [k] * count, [k] * count, first, layers)
        why = worker._write_chunk(spec, chunk, written)
        if layers == 2:  # the engine's two layers: the second one's group is written
            assert why is None and written[0] > 0
            continue
        assert why is not None and f"a stream of {layers} layers, the engine 2" in why
        assert written == [0] and all(
            torch.equal(a, b)
            for a, b in zip(_tokens(edge.consumer.worker, [6, 2, 7]), before, strict=True)
        )


@pytest.mark.parametrize("by_layer", [True, False], ids=["save_kv_layer", "no-save_kv_layer"])
def test_layer_groups_ship_from_save_kv_layer_and_the_consumer_writes_each_at_once(
    edge: Any, by_layer: bool
) -> None:
    """``stream_layer_groups: 2`` over 4 layers, early hand-off with ``auth_secret``: each
    prefill chunk's first two layers ship as soon as ``save_kv_layer`` saw layer 1, and the
    waiting consumer checks (own MAC) and writes them into its block before the producer's
    forward pass reaches layer 2. Without ``save_kv_layer`` calls (a model whose attention does
    not make them) each step ships one whole chunk at ``wait_for_save``. Either way the
    consumer ends with the producer's tokens."""
    from omnikv.integrations.vllm import early_handoff_params

    pair = _early_edge(edge, layers=4, stream_layer_groups=2)
    producer, consumer = pair.producer, pair.consumer
    tid = _router_id(pair.conn)
    to_producer, to_consumer = early_handoff_params(tid, len(PROMPT))
    _start_early_load(consumer, to_consumer, "c1", [6, 2, 7])
    for t in producer.caches.values():
        t.copy_(torch.randn_like(t))
    worker = consumer.worker
    written: list[bool] = []

    def first_layers_written(layer: int) -> None:
        if layer != 1:
            return
        deadline = time.monotonic() + 10
        while worker.stats().get("chunks_loaded", 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.005)
        got = [k for k, _ in worker.layer_tokens([6], BS)][:2]
        want = [k for k, _ in producer.worker.layer_tokens([3], BS)][:2]
        written.append(all(torch.equal(a, b) for a, b in zip(got, want, strict=True)))

    request = _request("s1", to_producer)
    producer.sched.update_state_after_alloc(request, _blocks([3, 5, 1]), 0)
    new = SimpleNamespace(req_id="s1", block_ids=([3, 5, 1],), num_computed_tokens=0)
    first = _output([new], [], {"s1": 4})
    second = _output([], [("s1", 4, None)], {"s1": 6})
    _step_with(producer, first, set(), by_layer=by_layer, between=first_layers_written)
    assert written == ([True] if by_layer else [])  # layers 0-1 there before layer 2 computed
    _step_with(producer, second, set(), by_layer=by_layer)
    chunks = 4 if by_layer else 2  # 2 steps x 2 groups, or a whole chunk per step
    assert producer.worker.stats()["chunks_streamed"] == chunks
    assert producer.worker.stats().get("layer_groups_streamed", 0) == (4 if by_layer else 0)
    _finish_early_hand_off(producer, request, tid, consumer)
    assert worker.stats()["chunks_loaded"] == chunks


def test_an_idle_step_waits_briefly_for_loads_in_flight(edge: Any) -> None:
    """vLLM steps without pause while requests wait for remote KV; a step that schedules no
    tokens while a load runs waits up to ``idle_step_wait_s`` (the load threads get the GIL),
    a step with work or without loads does not."""
    pair = _early_edge(edge)
    consumer = _pair(
        "kv_consumer",
        {"stage_id": 1, "recv_timeout": 10.0, "connector_config": pair.conn, "stream_kv": True},
        auth_secret="r0uter",
        idle_step_wait_s=0.1,
    )
    edge.made.append(consumer)
    worker = consumer.worker

    def step(scheduled: int) -> float:
        out = _output([], [], {})
        out.total_num_scheduled_tokens = scheduled
        worker.bind_connector_metadata(consumer.sched.build_connector_meta(out))
        worker.start_load_kv(None)
        worker.wait_for_save()
        t0 = time.monotonic()
        worker.get_transfer_results(set())
        worker.clear_connector_metadata()
        return time.monotonic() - t0

    assert step(0) < 0.09  # idle, but no load in flight
    from omnikv.integrations.vllm import early_handoff_params

    _, to_consumer = early_handoff_params(_router_id(pair.conn), len(PROMPT))
    _start_early_load(consumer, to_consumer, "c1", [6, 2, 7])  # its KV never comes
    assert step(0) >= 0.09  # idle while a load runs: paced
    assert step(64) < 0.09  # a step with work never waits
