"""OmniKVConnector's halves driven as vLLM's scheduler and model runner drive them, without an
engine: a producer and a consumer over LocalConnector (both in this process), on CPU_ATTN-layout
caches (tests/integrations/vllm_connector/).

A *side* is one engine's connectors: ``sched`` (the scheduler's), ``worker`` (a worker's, its
caches registered) and ``caches``. :func:`step` is one engine step as vLLM runs it (bind,
start_load_kv, wait_for_save, get_transfer_results, update_connector_output).
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

BLOCKS, HEADS, BS, DIM = 8, 4, 4, 8


PROMPT = list(range(10, 20))  # 10 tokens: 2 full blocks and a partial one


def vllm_config(
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


def pair(
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

    cfg = vllm_config(role, omni, extra, model)
    sched = OmniKVConnector(cfg, KVConnectorRole.SCHEDULER, SimpleNamespace(kv_cache_groups=[0]))
    worker = OmniKVConnector(cfg, KVConnectorRole.WORKER, None)
    caches = {
        f"model.layers.{i}.attn": torch.zeros(BLOCKS, HEADS, BS, 2 * DIM, dtype=dtype)
        for i in range(layers)
    }
    worker.register_kv_caches(caches)
    return SimpleNamespace(sched=sched, worker=worker, caches=caches)


def scheduler_half(omni: dict[str, Any], clock: Callable[[], float], **extra: Any) -> Any:
    """A consumer's scheduler half on its own, as the facade builds it from ``omni`` and
    ``extra`` but reading admission deadlines from ``clock``; it has the facade's scheduler
    hooks, so it stands in for ``sched`` in a side."""
    from omnikv.config import config_from_dict
    from omnikv.integrations.vllm.binding import model_fingerprint
    from omnikv.integrations.vllm.options import parse_options
    from omnikv.integrations.vllm.scheduler import SchedulerSide

    cfg = vllm_config("kv_consumer", omni, extra)
    raw = dict(cfg.kv_transfer_config.kv_connector_extra_config)
    options = parse_options(raw, producer=False, consumer=True)
    return SchedulerSide(
        options,
        producer=False,
        consumer=True,
        fingerprint=model_fingerprint(cfg, options.model_id),
        recv_timeout=config_from_dict(options.omni_kv_config).recv_timeout,
        prefix_caching=True,
        block_size=BS,
        clock=clock,
    )


def make_request(
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


def allocated(ids: list[int]) -> Any:
    return SimpleNamespace(get_block_ids=lambda: (list(ids),))


def step(side: Any, finished: set[str], *, spec_order: bool = False) -> Any:
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


def send(
    producer: Any, blocks: list[int], rid: str = "p1", *, spec_order: bool = False, **req: Any
) -> dict[str, Any]:
    for t in producer.caches.values():
        t.copy_(torch.randn_like(t))
    request = make_request(rid, {"do_remote_decode": True}, computed=len(PROMPT))
    for name, value in req.items():
        setattr(request, name, value)
    delay, params = producer.sched.request_finished(request, blocks)
    assert delay and params is not None
    assert producer.sched.has_pending_push_work()
    results = step(producer, {rid}, spec_order=spec_order)
    assert results.finished_sending == {rid}
    assert not producer.sched.has_pending_push_work()
    return dict(params)


def load(consumer: Any, params: dict[str, Any], rid: str, blocks: list[int], **req: Any) -> Any:
    request = make_request(rid, params)
    for name, value in req.items():
        setattr(request, name, value)
    assert consumer.sched.get_num_new_matched_tokens(request, 0) == (len(PROMPT), True)
    consumer.sched.update_state_after_alloc(request, allocated(blocks), len(PROMPT))
    return step(consumer, set())


def tokens(worker: Any, blocks: list[int]) -> list[torch.Tensor]:
    out = []
    for k, v in worker.layer_tokens(blocks, len(PROMPT)):
        out += [k, v]
    return out


def same_tokens(edge: Any, consumer_blocks: list[int], producer_blocks: list[int]) -> bool:
    got = tokens(edge.consumer.worker, consumer_blocks)
    want = tokens(edge.producer.worker, producer_blocks)
    return all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def attacker(conn: dict[str, Any], **options: Any) -> Any:
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


def forged_caches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """An attacker's KV cache (every value 1), shaped like the engines'."""
    return [
        (torch.ones(BLOCKS, BS, HEADS, DIM), torch.ones(BLOCKS, BS, HEADS, DIM)) for _ in range(2)
    ]


def step_with(
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


def output(new: list[Any], cached: list[tuple[str, int, list[int] | None]], sched: dict) -> Any:
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


def early_edge(
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
    producer = pair("kv_producer", producer_omni, layers, **extra, **producer_options)
    consumer_omni = {"stage_id": 1, "recv_timeout": recv_timeout, **base}
    consumer = pair("kv_consumer", consumer_omni, layers, **extra)
    edge.made += [producer, consumer]
    return SimpleNamespace(producer=producer, consumer=consumer, conn=conn)


def payload_key_for(tid: str, params: dict[str, Any]) -> str:
    """The key a consumer of these engines loads ``tid`` from for a request of :data:`PROMPT`
    with ``params`` (what someone who knows the request's binding can publish under)."""
    from omnikv.integrations.vllm.binding import model_fingerprint, payload_key, request_binding

    fingerprint = model_fingerprint(vllm_config("kv_consumer", {}))
    binding = request_binding(fingerprint, make_request("c", params), len(PROMPT))
    assert binding is not None
    return payload_key(tid, binding)


def router_id(conn: dict[str, Any], secret: bytes = b"r0uter") -> str:
    from omnikv.integrations.vllm.binding import new_router_transfer_id, producer_tag

    return new_router_transfer_id(producer_tag(conn["namespace"]), secret)


def finish_early_hand_off(producer: Any, request: Any, tid: str, consumer: Any) -> None:
    """The producer finishes ``request`` (prompt blocks 3, 5, 1) under the router's id
    ``tid``; the consumer's load (blocks 6, 2, 7) then ends with the producer's tokens."""
    request.num_computed_tokens = len(PROMPT)
    delay, params = producer.sched.request_finished(request, [3, 5, 1])
    assert delay and params is not None and params["omnikv_transfer_id"] == tid
    assert step_with(producer, output([], [], {}), {"s1"}).finished_sending == {"s1"}
    worker = consumer.worker
    assert worker.wait_transfers(10.0)
    results = worker.get_transfer_results(set())
    assert results.finished_recving == {"c1"} and not results.failed_recving
    got = tokens(worker, [6, 2, 7])
    want = tokens(producer.worker, [3, 5, 1])
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def start_early_load(consumer: Any, params: dict[str, Any], rid: str, blocks: list[int]) -> None:
    """Admit and start a consumer's load without waiting for it (its KV does not exist yet)."""
    request = make_request(rid, params)
    assert consumer.sched.get_num_new_matched_tokens(request, 0) == (len(PROMPT), True)
    consumer.sched.update_state_after_alloc(request, allocated(blocks), len(PROMPT))
    worker = consumer.worker
    worker.bind_connector_metadata(consumer.sched.build_connector_meta(None))
    worker.start_load_kv(None)
    worker.wait_for_save()
    assert worker.get_transfer_results(set()).finished_recving == set()  # still waiting
    worker.clear_connector_metadata()
