"""OmniKVConnector in real vLLM engines (CPU): producer and consumer in separate processes.

Runs in ``.venv-vllm`` (``make test-vllm``); skipped where vLLM is not installed. Four engines
(producer and consumer, float32 and bfloat16) start once for the module, in parallel; they talk
over SharedMemoryConnector in a namespace of their own.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.engine,
    pytest.mark.skipif(
        find_spec("vllm") is None, reason="vLLM not installed (make test-vllm builds .venv-vllm)"
    ),
    pytest.mark.timeout(900),
]

DTYPES = ("float32", "bfloat16")
LENGTHS = (45, 77, 130)  # none a multiple of the block size (32)
NEW_TOKENS = 16


def _prompts(seed: int, lengths: tuple[int, ...] = LENGTHS) -> list[list[int]]:
    rnd = random.Random(seed)
    return [[rnd.randrange(4, 500) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from omnikv.bench.vllm import build_tiny_llama, shm_omni_kv_config
    from vllm_helpers import start_test_engines

    root = tmp_path_factory.mktemp("vllm")
    namespace = f"omnikv-vllm-test-{os.getpid()}"
    configs, logs, models = [], [], {}
    for dtype in DTYPES:
        models[dtype] = build_tiny_llama(root / f"model-{dtype}", dtype)
        ns = f"{namespace}-{dtype}"
        for role in ("kv_producer", "kv_consumer"):
            slow = "SlowSharedMemoryConnector" if role == "kv_producer" else "SharedMemoryConnector"
            omni = shm_omni_kv_config(ns, role, recv_timeout=4.0, connector=slow)
            configs.append(
                {"model": str(models[dtype]), "dtype": dtype, "role": role, "omni_kv_config": omni}
            )
            logs.append(root / f"{role}-{dtype}.log")
    engines = start_test_engines(configs, logs, timeout=600)
    pairs = {dtype: (engines[2 * i], engines[2 * i + 1]) for i, dtype in enumerate(DTYPES)}
    try:
        yield {"pairs": pairs, "models": models, "namespace": namespace, "root": root}
    finally:
        for e in engines:
            e.stop()


def _send(producer: Any, prompts: list[list[int]]) -> list[dict[str, Any]]:
    """Prefill on the producer (one token each) and wait until every send is done."""
    out = producer.call(
        "generate",
        prompts=prompts,
        max_tokens=1,
        kv_transfer_params=[{"do_remote_decode": True}] * len(prompts),
    )
    params = [o["kv_transfer_params"] for o in out["outputs"]]
    tids = [p["omnikv_transfer_id"] for p in params]
    records = producer.call("pump", transfer_ids=tids)["records"]
    assert all(r["ok"] for r in records), records
    return params


def _tokens(reply: dict[str, Any]) -> list[list[int]]:
    return [o["tokens"] for o in reply["outputs"]]


@pytest.mark.parametrize("dtype", DTYPES)
def test_consumer_decodes_from_the_producers_kv(setup: dict[str, Any], dtype: str) -> None:
    producer, consumer = setup["pairs"][dtype]
    root: Path = setup["root"]
    prompts = _prompts(1)
    before = consumer.call("stats")["stats"]
    params = _send(producer, prompts)
    for i, p in enumerate(params):
        assert p["do_remote_prefill"] and p["omnikv_num_tokens"] == LENGTHS[i]
        producer.call("dump", transfer_id=p["omnikv_transfer_id"], path=str(root / f"p{i}.npz"))
    got = consumer.call(
        "generate", prompts=prompts, max_tokens=NEW_TOKENS, kv_transfer_params=params
    )
    for i, p in enumerate(params):
        consumer.call("dump", transfer_id=p["omnikv_transfer_id"], path=str(root / f"c{i}.npz"))
    after = consumer.call("stats")["stats"]
    reference = consumer.call("generate", prompts=prompts, max_tokens=NEW_TOKENS)
    assert _tokens(got) == _tokens(reference)
    assert after.get("loads_ok", 0) - before.get("loads_ok", 0) == len(prompts)
    assert after.get("loads_fallback", 0) == before.get("loads_fallback", 0)
    assert after["tokens_loaded"] - before.get("tokens_loaded", 0) == sum(LENGTHS)
    for i, n in enumerate(LENGTHS):
        sent, loaded = np.load(root / f"p{i}.npz"), np.load(root / f"c{i}.npz")
        assert sorted(sent.files) == sorted(loaded.files) == ["k0", "k1", "v0", "v1"]
        for name in sent.files:
            assert sent[name].shape == (n, 4, 64)
            # Tokens [0, n-1) are exactly what the producer held; vLLM recomputes the last one.
            np.testing.assert_array_equal(loaded[name][: n - 1], sent[name][: n - 1])
            np.testing.assert_allclose(loaded[name], sent[name], rtol=0.05, atol=0.05)


def test_producer_keeps_serving_while_a_send_is_in_flight(setup: dict[str, Any]) -> None:
    producer, consumer = setup["pairs"]["float32"]
    prompt_a, prompt_b = _prompts(2, (61, 50))
    producer.call("set_delay", seconds=4.0)
    try:
        out = producer.call(
            "generate",
            prompts=[prompt_a, prompt_b],
            max_tokens=[1, 24],
            kv_transfer_params=[{"do_remote_decode": True}, None],
        )
    finally:
        producer.call("set_delay", seconds=0.0)
    params = out["outputs"][0]["kv_transfer_params"]
    assert len(out["outputs"][1]["tokens"]) == 24
    (record,) = producer.call("pump", transfer_ids=[params["omnikv_transfer_id"]])["records"]
    assert record["ok"]
    # B was served to the end while A's send (>= 4 s) was still in flight.
    assert record["start"] < out["t_end"] < record["end"]
    got = consumer.call("generate", prompts=[prompt_a], max_tokens=8, kv_transfer_params=[params])
    reference = consumer.call("generate", prompts=[prompt_a], max_tokens=8)
    assert _tokens(got) == _tokens(reference)


def test_miss_and_mismatch_fall_back_to_recomputation(setup: dict[str, Any]) -> None:
    from omnikv.integrations.vllm import token_digest

    _, consumer = setup["pairs"]["float32"]
    (prompt,) = _prompts(3, (70,))
    reference = _tokens(consumer.call("generate", prompts=[prompt], max_tokens=8))
    missing = {
        "do_remote_prefill": True,
        "omnikv_transfer_id": "never-sent",
        "omnikv_num_tokens": len(prompt),
        "omnikv_token_digest": token_digest(prompt),
    }
    other = dict(missing, omnikv_token_digest=token_digest(prompt[::-1]))
    before = consumer.call("stats")["stats"]
    got = consumer.call(
        "generate", prompts=[prompt, prompt], max_tokens=8, kv_transfer_params=[missing, other]
    )
    after = consumer.call("stats")["stats"]
    assert _tokens(got) == reference * 2
    # The miss was attempted, timed out and counted; the mismatching digest was never loaded.
    assert after.get("loads_fallback", 0) - before.get("loads_fallback", 0) == 1
    assert after.get("loads_ok", 0) == before.get("loads_ok", 0)
    record = consumer.call("record", transfer_id="never-sent")["record"]
    assert record["ok"] is False and "timeout" in record["reason"]


def test_vllm_producer_to_transformers_consumer(setup: dict[str, Any]) -> None:
    """The wire format is the reference's: a plain DynamicCache continues the vLLM prefill."""
    import torch
    from transformers import DynamicCache, LlamaForCausalLM

    from omnikv.bench.vllm import shm_omni_kv_config
    from omnikv.config import config_from_dict, options_from_dict
    from omnikv.manager import OmniKVTransferManager

    producer, _ = setup["pairs"]["float32"]
    (prompt,) = _prompts(4, (77,))
    (params,) = _send(producer, [prompt])
    cfg = shm_omni_kv_config(f"{setup['namespace']}-float32", "kv_consumer", recv_timeout=10.0)
    with OmniKVTransferManager(config_from_dict(cfg), options=options_from_dict(cfg)) as manager:
        result = manager.receive_kv_cache_result(params["omnikv_transfer_id"])
        assert result.ok, result.reason
        assert result.data is not None
        blocks = result.data["layer_blocks"]
        keys = [k.clone() for k in blocks["key_cache"]]
        values = [v.clone() for v in blocks["value_cache"]]
    model = LlamaForCausalLM.from_pretrained(setup["models"]["float32"], dtype=torch.float32)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        full = model(ids, use_cache=True)
        hf_cache = full.past_key_values
        cache = DynamicCache()
        for layer, (k, v) in enumerate(zip(keys, values, strict=True)):
            assert k.shape == (77, 4, 64)
            # HF keeps [batch, heads, seq, dim]; the wire carries [seq, heads, dim].
            hf_k, hf_v = hf_cache.layers[layer].keys[0], hf_cache.layers[layer].values[0]
            torch.testing.assert_close(k.transpose(0, 1), hf_k, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(v.transpose(0, 1), hf_v, rtol=1e-4, atol=1e-4)
            cache.update(k[:-1].transpose(0, 1)[None], v[:-1].transpose(0, 1)[None], layer)
        step = model(ids[:, -1:], past_key_values=cache, use_cache=True)
    torch.testing.assert_close(step.logits[0, -1], full.logits[0, -1], rtol=1e-4, atol=1e-4)
