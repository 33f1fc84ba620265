"""omnikv.integrations.transformers: a transformers cache sent by one stage, used by the next.

Tiny seeded Llama models with GQA built from a config (no hub access). The KV the receiver gets
must be bit-identical to the sender's, and greedy tokens continued from it must equal a
single-process ``generate`` on the prompt.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from omnikv import OmniKVCacheConfig, OmniKVTransferManager  # noqa: E402
from omnikv.demo.hf import DTYPES, greedy, tiny_llama  # noqa: E402
from omnikv.integrations.transformers import (  # noqa: E402
    HFCacheError,
    receive_hf_cache,
    send_hf_cache,
)
from support import paths  # noqa: E402

SRC = paths.SRC
NEW_TOKENS = 3


def _tiny(dtype: torch.dtype) -> Any:
    """The demo's model shrunk: 2 layers, vocabulary 96 (4 query heads over 2 KV heads)."""
    return tiny_llama(dtype, vocab_size=96, hidden_size=32, num_layers=2, max_positions=256, seed=0)


@pytest.fixture(scope="module")
def models() -> dict[str, Any]:
    torch.set_num_threads(1)
    return {name: _tiny(dtype) for name, dtype in DTYPES.items()}


def _pair(namespace: str) -> tuple[OmniKVTransferManager, OmniKVTransferManager]:
    def make(send: bool) -> OmniKVTransferManager:
        return OmniKVTransferManager(
            OmniKVCacheConfig(
                connector_config={"type": "LocalConnector", "namespace": namespace},
                from_stage="0",
                to_stage="1",
                stage_id="0" if send else "1",
                need_send_cache=send,
                need_recv_cache=not send,
                recv_timeout=5.0,
            )
        )

    return make(True), make(False)


def _prompt(n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(n)
    return torch.randint(0, 96, (1, n), generator=g)


@pytest.mark.parametrize("length", [1, 15, 16, 17, 100])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_local_roundtrip_is_bit_identical_and_continues_like_generate(
    models: dict[str, Any], namespace: str, dtype: str, length: int
) -> None:
    model = models[dtype]
    prompt = _prompt(length)
    with torch.no_grad():
        out = model(prompt, use_cache=True)
    first = int(out.logits[0, -1].argmax())
    sender, receiver = _pair(namespace)
    with sender, receiver:
        sent = send_hf_cache(sender, "r1", out.cache, custom_metadata={"first": first})
        assert sent.ok, sent.reason
        cache, got = receive_hf_cache(receiver, "r1", config=model.config)
        assert got.ok, got.reason
        assert got.metadata["first"] == first
        assert got.metadata["seq_len"] == length
        for want, have in zip(out.cache.layers, cache.layers, strict=True):
            assert have.keys.dtype == DTYPES[dtype]
            assert torch.equal(want.keys, have.keys) and torch.equal(want.values, have.values)
        ids = torch.cat([prompt, torch.tensor([[first]])], dim=1)
        with torch.no_grad():
            tokens = [first, *greedy(model, ids, NEW_TOKENS, cache)]
            assert tokens == greedy(model, prompt, NEW_TOKENS + 1)


def test_legacy_tuple_of_pairs_and_kv_that_requires_grad_are_sent(
    models: dict[str, Any], namespace: str
) -> None:
    model = models["fp32"]
    out = model(_prompt(9), use_cache=True)  # no torch.no_grad(): the KV requires grad
    legacy = tuple((layer.keys, layer.values) for layer in out.cache.layers)
    assert legacy[0][0].requires_grad
    sender, receiver = _pair(namespace)
    with sender, receiver:
        assert send_hf_cache(sender, "legacy", legacy).ok
        cache, got = receive_hf_cache(receiver, "legacy", device="cpu")
        assert got.ok, got.reason
        assert cache.layers[0].keys.device == torch.device("cpu")
        assert isinstance(cache, transformers.DynamicCache)
        assert cache.get_seq_length() == 9
        assert torch.equal(cache.layers[1].values, legacy[1][1].detach())


def test_batch_larger_than_one_is_refused_with_a_clear_error(
    models: dict[str, Any], namespace: str
) -> None:
    with torch.no_grad():
        out = models["fp32"](torch.zeros(2, 4, dtype=torch.long), use_cache=True)
    sender, _ = _pair(namespace)
    with sender, pytest.raises(HFCacheError, match="batch size 2"):
        send_hf_cache(sender, "batch", out.cache)


@pytest.mark.parametrize(
    ("cache", "match"),
    [
        (torch.zeros(2, 1, 2, 4, 8), "unsupported cache type Tensor"),
        (((torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 5, 8)),), "layer 0: K"),
        ((), "no layers"),
    ],
)
def test_unreadable_caches_name_what_is_accepted(namespace: str, cache: Any, match: str) -> None:
    sender, _ = _pair(namespace)
    with sender, pytest.raises(HFCacheError, match=match):
        send_hf_cache(sender, "bad", cache)


def test_a_manager_that_does_not_send_says_so(namespace: str) -> None:
    _, receiver = _pair(namespace)  # need_send_cache is false
    pairs = ((torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8)),)
    with receiver:
        result = send_hf_cache(receiver, "nosend", pairs)
    assert not result.ok
    assert result.reason is not None and "need_send_cache" in result.reason


def test_a_missing_request_gives_no_cache_and_a_reason(namespace: str) -> None:
    _, receiver = _pair(namespace)
    receiver.config.recv_timeout = 0.05
    with receiver:
        cache, result = receive_hf_cache(receiver, "never-sent")
    assert cache is None
    assert result.status.value == "timeout"


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_shared_memory_across_two_processes(dtype: str) -> None:
    """``omnikv demo --model hf-llama``: stage 1 is another process; KV and tokens checked."""
    env = dict(os.environ, PYTHONPATH=str(SRC), OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "omnikv.cli",
        "demo",
        "--model",
        "hf-llama",
        "--dtype",
        dtype,
        "--prompt-lens",
        "1,15,16,17,100",
        "--new-tokens",
        str(NEW_TOKENS + 1),
        "--realistic-tokens",
        "0",
        "--timeout",
        "100",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=130, env=env, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "stage 1 running as pid" in out.stdout
    assert out.stdout.count("kv bit-identical") == 5
    assert "tokens match the single-process reference: yes" in out.stdout


def test_a_static_cache_sends_only_the_tokens_it_holds(
    models: dict[str, Any], namespace: str
) -> None:
    model = models["fp16"]
    static = transformers.StaticCache(config=model.config, max_cache_len=64)
    prompt = _prompt(12)
    with torch.no_grad():
        out = model(prompt, cache=static, use_cache=True)
    sender, receiver = _pair(namespace)
    with sender, receiver:
        assert send_hf_cache(sender, "static", out.cache).ok
        cache, got = receive_hf_cache(receiver, "static", config=model.config)
    assert got.ok and cache.get_seq_length() == 12
    assert torch.equal(cache.layers[0].keys, static.layers[0].keys[:, :, :12])
    assert got.kv is not None and got.kv.key_cache == got.kv.value_cache == []  # none pinned
    assert got.metadata["seq_len"] == 12


def test_a_config_with_fewer_layers_than_received_is_refused(
    models: dict[str, Any], namespace: str
) -> None:
    pairs = tuple((torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8)) for _ in range(3))
    sender, receiver = _pair(namespace)
    with sender, receiver:
        assert send_hf_cache(sender, "three", pairs).ok
        with pytest.raises(HFCacheError, match="received 3 layers"):
            receive_hf_cache(receiver, "three", config=models["fp32"].config)


def _pairs(layers: int = 2, heads: int = 2, dim: int = 8, dtype: Any = torch.float32) -> Any:
    return tuple(
        (torch.zeros(1, heads, 3, dim, dtype=dtype), torch.ones(1, heads, 3, dim, dtype=dtype))
        for _ in range(layers)
    )


@pytest.mark.parametrize(
    ("pairs", "change", "match"),
    [
        (
            _pairs(layers=1),
            {},
            r"received 1 layers, the model config has 2 \(num_hidden_layers\)",
        ),
        (
            _pairs(layers=3),
            {},
            r"received 3 layers, the model config has 2 \(num_hidden_layers\)",
        ),
        (
            _pairs(heads=4),
            {},
            r"received 4 KV heads, the model config has 2 \(num_key_value_heads\)",
        ),
        (_pairs(dim=16), {}, r"received head size 16, the model config has 8 \(head_dim\)"),
        (
            _pairs(),
            {"dtype": "bfloat16"},
            r"dtype torch.float32, the model expects torch.bfloat16 \(config.dtype\)",
        ),
    ],
)
def test_received_kv_is_checked_against_the_model_config(
    models: dict[str, Any],
    namespace: str,
    monkeypatch: pytest.MonkeyPatch,
    pairs: Any,
    change: dict[str, Any],
    match: str,
) -> None:
    """Both sides named, and raised before transformers builds anything from the KV."""
    config = models["fp32"].config.__class__(**models["fp32"].config.to_dict())
    for key, value in change.items():
        setattr(config, key, value)  # e.g. what from_pretrained records
    built: list[Any] = []
    monkeypatch.setattr(transformers, "DynamicCache", lambda *a, **k: built.append(a))
    sender, receiver = _pair(namespace)
    with sender, receiver:
        assert send_hf_cache(sender, "mismatch", pairs).ok
        with pytest.raises(HFCacheError, match=match):
            receive_hf_cache(receiver, "mismatch", config=config)
    assert built == []


def test_dtype_argument_checks_the_models_real_dtype(
    models: dict[str, Any], namespace: str
) -> None:
    model = models["bf16"]  # built with .to(): config.dtype says nothing, model.dtype does
    sender, receiver = _pair(namespace)
    with sender, receiver:
        assert send_hf_cache(sender, "fp32-kv", _pairs()).ok
        with pytest.raises(
            HFCacheError, match=r"float32, the model expects torch.bfloat16 \(dtype=\)"
        ):
            receive_hf_cache(receiver, "fp32-kv", config=model.config, dtype=model.dtype)
        assert send_hf_cache(sender, "bf16-kv", _pairs(dtype=torch.bfloat16)).ok
        cache, result = receive_hf_cache(receiver, "bf16-kv", config=model.config, dtype="bfloat16")
        assert result.ok and cache.get_seq_length() == 3


def test_finiteness_is_checked_only_when_asked(models: dict[str, Any], namespace: str) -> None:
    bad = _pairs()
    bad[1][0][0, 1, 2, 3] = float("nan")
    sender, receiver = _pair(namespace)
    config = models["fp32"].config
    with sender, receiver:
        assert send_hf_cache(sender, "nan-1", bad).ok
        cache, result = receive_hf_cache(receiver, "nan-1", config=config)  # off by default
        assert result.ok and cache is not None
        assert send_hf_cache(sender, "nan-2", bad).ok
        with pytest.raises(HFCacheError, match="layer 1 holds NaN or infinite values"):
            receive_hf_cache(receiver, "nan-2", config=config, check_finite=True)


def test_a_sliding_window_cache_is_refused(namespace: str) -> None:
    config = transformers.MistralConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=4,
    )
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(config).eval()
    with torch.no_grad():
        out = model(_prompt(9), use_cache=True)
    sender, _ = _pair(namespace)
    with sender, pytest.raises(HFCacheError, match="sliding-window"):
        send_hf_cache(sender, "window", out.cache)


def test_model_gives_the_dtype_the_config_does_not_say(
    models: dict[str, Any], namespace: str
) -> None:
    """A bf16 model built with .to() has no config.dtype: model= checks its real dtype, and the
    sender is told ``refused`` with the reason."""
    model = models["bf16"]
    assert getattr(model.config, "dtype", None) is None
    sender, receiver = _pair(namespace)
    with sender, receiver:
        assert send_hf_cache(sender, "fp32-kv", _pairs()).ok
        with pytest.raises(HFCacheError, match=r"float32, the model expects torch.bfloat16"):
            receive_hf_cache(receiver, "fp32-kv", model=model)
        verdict = sender.wait_delivered("fp32-kv", timeout=10)
        assert verdict is not None and verdict.status.value == "refused"
        assert "the model expects torch.bfloat16" in (verdict.reason or "")
        assert send_hf_cache(sender, "bf16-kv", _pairs(dtype=torch.bfloat16)).ok
        cache, result = receive_hf_cache(receiver, "bf16-kv", model=model)
        assert result.ok and cache.get_seq_length() == 3
        delivered = sender.wait_delivered("bf16-kv", timeout=10)
        assert delivered is not None and delivered.status.value == "delivered"


def test_a_config_that_names_torch_dtype_is_checked(models: dict[str, Any], namespace: str) -> None:
    from types import SimpleNamespace

    base = models["fp32"].config
    older = SimpleNamespace(  # a config as releases before 4.56 load it: torch_dtype only
        num_hidden_layers=base.num_hidden_layers,
        num_attention_heads=base.num_attention_heads,
        num_key_value_heads=base.num_key_value_heads,
        hidden_size=base.hidden_size,
        torch_dtype="bfloat16",
    )
    sender, receiver = _pair(namespace)
    with sender, receiver:
        assert send_hf_cache(sender, "old", _pairs()).ok
        with pytest.raises(HFCacheError, match=r"expects torch.bfloat16 \(config.torch_dtype\)"):
            receive_hf_cache(receiver, "old", config=older)


def test_a_layer_mismatch_reaches_the_sender_as_refused(
    models: dict[str, Any], namespace: str
) -> None:
    sender, receiver = _pair(namespace)
    with sender, receiver:
        assert send_hf_cache(sender, "three", _pairs(layers=3)).ok
        with pytest.raises(HFCacheError, match="received 3 layers"):
            receive_hf_cache(receiver, "three", model=models["fp32"])
        verdict = sender.wait_delivered("three", timeout=10)
        assert verdict is not None and verdict.status.value == "refused"
        assert "received 3 layers, the model config has 2" in (verdict.reason or "")
