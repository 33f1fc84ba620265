"""OmniKVConnector, the facade: a send and a load end to end through vLLM's hook sequence (and
its speculative-decoding order), each hook on the half it belongs to, the cache layout taken
from the attention backend, the shared-memory payload size declared from the engine.

Without an engine (fast; needs vLLM installed); real engines: test_vllm_engine.py.
"""

from __future__ import annotations

import logging
from importlib.util import find_spec
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from support import vllm_halves as halves
from support.vllm_fixtures import edge_fixture  # noqa: F401 (fixtures)
from support.vllm_halves import PROMPT

pytestmark = pytest.mark.skipif(
    find_spec("vllm") is None, reason="vLLM not installed (make test-vllm builds .venv-vllm)"
)


def test_send_then_load_writes_the_same_tokens(edge: Any) -> None:
    params = halves.send(edge.producer, [3, 5, 1])
    assert params["do_remote_prefill"] and params["omnikv_num_tokens"] == len(PROMPT)
    assert len(params["omnikv_binding"]) == 32
    assert edge.producer.worker.stats()["sends_ok"] == 1
    results = halves.load(edge.consumer, params, "c1", [6, 2, 7])
    assert results.finished_recving == {"c1"} and not results.failed_recving
    stats = edge.consumer.worker.stats()
    assert stats["loads_ok"] == 1 and stats["tokens_loaded"] == len(PROMPT)
    assert halves.same_tokens(edge, [6, 2, 7], [3, 5, 1])
    # The producer learns that the consumer accepted the KV.
    record = edge.producer.worker.transfer_record(params["omnikv_transfer_id"])
    assert record is not None and record["delivery"] == "delivered"
    # ... and counts it as it comes (the edge pushes verdicts; no producer step polls them)
    assert edge.producer.worker.stats()["sends_delivered"] == 1
    # Loaded once: the request is not offered for loading again (e.g. after a preemption).
    assert edge.consumer.sched.get_num_new_matched_tokens(halves.make_request("c1", params), 0) == (
        0,
        False,
    )


def test_speculative_decoding_order_still_reports_the_send(edge: Any) -> None:
    """vLLM 0.32 with speculative_config asks for results before wait_for_save."""
    params = halves.send(edge.producer, [3, 5, 1], spec_order=True)
    results = halves.load(edge.consumer, params, "c-spec", [6, 2, 7])
    assert results.finished_recving == {"c-spec"} and not results.failed_recving


def test_the_cpu_layout_follows_the_isa_vllm_picks(caplog: pytest.LogCaptureFixture) -> None:
    """CPU_ATTN's caches have one shape and two layouts: the layout comes from the ISA vLLM's
    backend picks for the dtype, block size and head size (its own metadata builder marks the
    attention layers, as it does in an engine before the caches are registered); an ISA omnikv
    does not know, or layers without one, turn transfers off with the reason logged, never a
    guess."""
    from vllm.model_executor.layers.attention import Attention
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadataBuilder

    from omnikv.integrations.vllm.connector import cpu_cache_layout

    names = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]

    def config(dtype: torch.dtype, block_size: int, head_size: int) -> Any:
        layers = {}
        for name in names:
            layer = Attention.__new__(Attention)  # only what the builder reads of a layer
            layer.impl = SimpleNamespace(num_heads=8, sliding_window=None)
            layers[name] = layer
        cfg = SimpleNamespace(
            model_config=SimpleNamespace(dtype=dtype),
            cache_config=SimpleNamespace(block_size=block_size, cache_dtype="auto"),
            parallel_config=None,
            compilation_config=SimpleNamespace(static_forward_context=layers),
        )
        spec = SimpleNamespace(num_kv_heads=4, head_size=head_size, block_size=block_size)
        CPUAttentionMetadataBuilder(spec, names, cfg, torch.device("cpu"))
        return cfg

    assert cpu_cache_layout(config(torch.float32, 32, 64), names) == "vllm_cpu"
    assert cpu_cache_layout(config(torch.bfloat16, 16, 64), names) == "vllm_cpu"  # vec16
    packed = "vllm_cpu_amx" if torch.cpu._is_amx_tile_supported() else "vllm_cpu"
    assert cpu_cache_layout(config(torch.bfloat16, 32, 64), names) == packed
    cfg = config(torch.float32, 32, 64)
    for layer in cfg.compilation_config.static_forward_context.values():
        layer.isa = "neon"
    with caplog.at_level(logging.ERROR):
        assert cpu_cache_layout(cfg, names) is None
    assert "ISA 'neon'" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.ERROR):  # layers the backend did not mark
        assert cpu_cache_layout(config(torch.float32, 32, 64), ["another.attn"]) is None
    assert "none set on the attention layers" in caplog.text


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


def test_each_hook_is_delegated_to_the_half_that_owns_it_under_its_own_name(edge: Any) -> None:
    """As vLLM's NIXL connector: the facade asserts which half it is and calls the hook of the
    same name there, so a vLLM engineer finds each hook where the base class promises it."""
    from omnikv.integrations.vllm.scheduler import SchedulerSide
    from omnikv.integrations.vllm.worker import WorkerSide

    scheduler_hooks = [
        "get_num_new_matched_tokens",
        "update_state_after_alloc",
        "build_connector_meta",
        "request_finished",
        "update_connector_output",
        "has_pending_push_work",
        "get_kv_connector_stats",
    ]
    worker_hooks = [
        "register_kv_caches",
        "bind_connector_metadata",
        "start_load_kv",
        "wait_for_layer_load",
        "save_kv_layer",
        "wait_for_save",
        "get_transfer_results",
        "get_finished",
        "get_kv_connector_stats",
        "shutdown",
    ]
    assert all(callable(getattr(SchedulerSide, name, None)) for name in scheduler_hooks)
    assert all(callable(getattr(WorkerSide, name, None)) for name in worker_hooks)
    request = halves.make_request("r", {"do_remote_prefill": True})
    with pytest.raises(AssertionError, match="scheduler hook was called on a worker"):
        edge.consumer.worker.get_num_new_matched_tokens(request, 0)
    with pytest.raises(AssertionError, match="worker hook was called on the scheduler"):
        edge.consumer.sched.start_load_kv(None)
    with pytest.raises(AssertionError, match="worker hook was called on the scheduler"):
        edge.producer.sched.wait_for_save()
