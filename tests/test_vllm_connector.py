"""OmniKVConnector's scheduler and worker halves without an engine (fast; needs vLLM installed).

The halves are driven the way vLLM's scheduler and model runner drive them, over LocalConnector
(producer and consumer in this process), on CPU_ATTN-layout caches.
"""

from __future__ import annotations

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


def _config(role: str, omni: dict[str, Any], extra: dict[str, Any] | None = None) -> Any:
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
    return SimpleNamespace(kv_transfer_config=ktc, cache_config=SimpleNamespace(block_size=BS))


def _pair(role: str, omni: dict[str, Any], layers: int = 2, **extra: Any) -> Any:
    """(scheduler half, worker half with registered caches, caches)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from omnikv.integrations.vllm import OmniKVConnector

    cfg = _config(role, omni, extra)
    sched = OmniKVConnector(cfg, KVConnectorRole.SCHEDULER, SimpleNamespace(kv_cache_groups=[0]))
    worker = OmniKVConnector(cfg, KVConnectorRole.WORKER, None)
    caches = {
        f"model.layers.{i}.attn": torch.zeros(BLOCKS, HEADS, BS, 2 * DIM) for i in range(layers)
    }
    worker.register_kv_caches(caches)
    return sched, worker, caches


def _request(rid: str, params: dict[str, Any] | None, computed: int = 0) -> Any:
    return SimpleNamespace(
        request_id=rid,
        prompt_token_ids=list(PROMPT),
        num_prompt_tokens=len(PROMPT),
        num_computed_tokens=computed,
        kv_transfer_params=params,
        status=SimpleNamespace(name="FINISHED_LENGTH_CAPPED"),
    )


def _step(sched: Any, worker: Any, finished: set[str]) -> Any:
    """One engine step: metadata to the worker, its hooks, its transfers, results back."""
    worker.bind_connector_metadata(sched.build_connector_meta(None))
    worker.start_load_kv(None)
    worker.wait_for_save()
    assert worker.wait_transfers(10.0)
    results = worker.get_transfer_results(finished)
    worker.clear_connector_metadata()
    sched.update_connector_output(results)
    return results


@pytest.fixture
def edge() -> Any:
    ns = f"vllm-{uuid.uuid4().hex[:8]}"
    conn = {"type": "LocalConnector", "namespace": ns}
    producer = _pair(
        "kv_producer", {"omni_from_stage": 0, "omni_to_stage": 1, "connector_config": conn}
    )
    consumer_omni = {"stage_id": 1, "recv_timeout": 0.3, "connector_config": conn}
    consumer = _pair("kv_consumer", consumer_omni)
    yield SimpleNamespace(producer=producer, consumer=consumer, consumer_omni=consumer_omni)
    for _, worker, _ in (producer, consumer):
        worker.shutdown()


def _send(edge: Any, blocks: list[int]) -> dict[str, Any]:
    sched, worker, caches = edge.producer
    for t in caches.values():
        t.copy_(torch.randn_like(t))
    req = _request("p1", {"do_remote_decode": True}, computed=len(PROMPT))
    delay, params = sched.request_finished(req, blocks)
    assert delay and params is not None
    assert sched.has_pending_push_work()
    results = _step(sched, worker, {"p1"})
    assert results.finished_sending == {"p1"}
    assert not sched.has_pending_push_work()
    assert worker.stats()["sends_ok"] == 1
    return dict(params)


def _tokens(worker: Any, blocks: list[int]) -> list[torch.Tensor]:
    from omnikv.layouts import BlockGather

    out = []
    for k, v in worker.layer_kv_views().values():
        out += [BlockGather(k, tuple(blocks), len(PROMPT)).materialize()]
        out += [BlockGather(v, tuple(blocks), len(PROMPT)).materialize()]
    return out


def test_send_then_load_writes_the_same_tokens(edge: Any) -> None:
    params = _send(edge, [3, 5, 1])
    assert params["do_remote_prefill"] and params["omnikv_num_tokens"] == len(PROMPT)
    sched, worker, _ = edge.consumer
    req = _request("c1", params)
    assert sched.get_num_new_matched_tokens(req, 0) == (len(PROMPT), True)
    sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([6, 2, 7],)), 10)
    results = _step(sched, worker, set())
    assert results.finished_recving == {"c1"} and not results.failed_recving
    assert worker.stats() == {"loads_ok": 1, "tokens_loaded": len(PROMPT)}
    for got, want in zip(
        _tokens(worker, [6, 2, 7]), _tokens(edge.producer[1], [3, 5, 1]), strict=True
    ):
        assert torch.equal(got, want)
    # Loaded once: the request is not offered for loading again (e.g. after a preemption).
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)


def test_partial_local_hit_loads_the_rest(edge: Any) -> None:
    params = _send(edge, [3, 5, 1])
    sched, worker, _ = edge.consumer
    req = _request("c2", params)
    assert sched.get_num_new_matched_tokens(req, 4) == (6, True)  # one block computed locally
    sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([0, 4, 6],)), 6)
    assert _step(sched, worker, set()).finished_recving == {"c2"}
    got, want = _tokens(worker, [0, 4, 6]), _tokens(edge.producer[1], [3, 5, 1])
    for g, w in zip(got, want, strict=True):
        assert not g[:4].any()  # tokens of the local hit are not written
        assert torch.equal(g[4:], w[4:])


def test_missing_kv_is_a_counted_failed_receive(edge: Any) -> None:
    from omnikv.integrations.vllm import token_digest

    sched, worker, caches = edge.consumer
    params = {
        "do_remote_prefill": True,
        "omnikv_transfer_id": "never-sent",
        "omnikv_num_tokens": len(PROMPT),
        "omnikv_token_digest": token_digest(PROMPT),
    }
    req = _request("c3", params)
    assert sched.get_num_new_matched_tokens(req, 0) == (len(PROMPT), True)
    sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([1, 2, 3],)), 10)
    results = _step(sched, worker, set())
    assert results.finished_recving == {"c3"} and results.failed_recving == {"c3"}
    assert worker.stats() == {"loads_fallback": 1}
    assert "timeout" in worker.transfer_record("never-sent")["reason"]
    assert not any(t.any() for t in caches.values())


def test_payload_that_does_not_fit_the_engine_is_refused(edge: Any) -> None:
    params = _send(edge, [3, 5, 1])
    conn = edge.consumer_omni["connector_config"]
    omni = {"stage_id": 1, "recv_timeout": 0.3, "connector_config": conn}
    sched, worker, _ = _pair("kv_consumer", omni, layers=3)
    try:
        req = _request("c4", params)
        assert sched.get_num_new_matched_tokens(req, 0) == (len(PROMPT), True)
        sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([1, 2, 3],)), 10)
        assert _step(sched, worker, set()).failed_recving == {"c4"}
        assert (
            "2 layers, the engine 3"
            in worker.transfer_record(params["omnikv_transfer_id"])["reason"]
        )
    finally:
        worker.shutdown()


@pytest.mark.parametrize(
    "change",
    [
        {"omnikv_token_digest": "0" * 32},  # another prompt
        {"omnikv_transfer_id": ""},
        {"omnikv_num_tokens": True},
        {"omnikv_num_tokens": 0},
        {"do_remote_prefill": False},
    ],
)
def test_params_that_do_not_match_are_not_loaded(edge: Any, change: dict[str, Any]) -> None:
    from omnikv.integrations.vllm import token_digest

    params = {
        "do_remote_prefill": True,
        "omnikv_transfer_id": "t",
        "omnikv_num_tokens": len(PROMPT),
        "omnikv_token_digest": token_digest(PROMPT),
    }
    sched = edge.consumer[0]
    assert sched.get_num_new_matched_tokens(_request("ok", params), 0) == (len(PROMPT), True)
    assert sched.get_num_new_matched_tokens(_request("x", params | change), 0) == (0, False)


def test_producer_keeps_blocks_only_for_remote_decode(edge: Any) -> None:
    sched = edge.producer[0]
    plain = _request("a", None, computed=10)
    assert sched.request_finished(plain, [1, 2, 3]) == (False, None)
    aborted = _request("b", {"do_remote_decode": True}, computed=10)
    aborted.status = SimpleNamespace(name="FINISHED_ABORTED")
    assert sched.request_finished(aborted, [1, 2, 3]) == (False, None)
    assert not sched.has_pending_push_work()
    # The consumer role never sends.
    consumer_sched = edge.consumer[0]
    assert consumer_sched.request_finished(_request("c", {"do_remote_decode": True}, 10), [1]) == (
        False,
        None,
    )
