"""The demo on a Hugging Face transformers model: ``omnikv demo --model hf-llama``.

A tiny Llama with GQA (4 query heads over 2 KV heads) built from a config with seeded random
weights (no hub access; ``pip install omnikv[transformers]``). Stage 0 prefills each prompt and
sends ``out.cache`` with :func:`~omnikv.integrations.transformers.send_hf_cache`; stage 1 gets a
``DynamicCache`` from :func:`~omnikv.integrations.transformers.receive_hf_cache` and continues
with ``model.generate``. The reference is one ``generate`` on the prompt in one process.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import torch

from omnikv.integrations.transformers import receive_hf_cache, send_hf_cache
from omnikv.manager import OmniKVTransferManager

__all__ = ["HFWorkload", "greedy", "tiny_llama"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def tiny_llama(
    dtype: torch.dtype,
    *,
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 4,
    max_positions: int = 1024,
    seed: int = 1234,
) -> Any:
    """A small Llama with 4 query heads over 2 KV heads (GQA) and seeded random weights.

    No end-of-sequence token, so greedy runs never stop early. The defaults are the demo's
    model (4 layers); the transformers tests build a smaller one with the same shape of heads.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    model: Any = LlamaForCausalLM(config)
    return model.to(dtype).eval()


def greedy(model: Any, ids: torch.Tensor, n: int, cache: Any = None) -> list[int]:
    """``n`` greedy tokens after ``ids`` (batch of one), continuing ``cache`` when given."""
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        cache=cache,
        max_new_tokens=n,
        do_sample=False,
        pad_token_id=0,
    )
    return [int(t) for t in out[0, ids.shape[1] :]]


def _digest(cache: Any) -> str:
    h = hashlib.sha256()
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


class HFWorkload:
    """The hf-llama model behind the demo's stage functions (same shapes as the tiny model's)."""

    def __init__(self, dtype: str = "fp32") -> None:
        self.dtype = dtype
        self.model = tiny_llama(DTYPES[dtype])
        self.vocab = int(self.model.config.vocab_size)

    def describe(self) -> str:
        c = self.model.config
        return (
            f"hf-llama ({c.num_hidden_layers} layers, {c.num_attention_heads} heads over "
            f"{c.num_key_value_heads} kv heads), {self.dtype} KV"
        )

    @torch.no_grad()
    def reference(self, prompts: dict[str, list[int]], new_tokens: int) -> dict[str, list[int]]:
        return {
            rid: greedy(self.model, torch.tensor([p]), new_tokens) for rid, p in prompts.items()
        }

    @torch.no_grad()
    def send(
        self, prompts: dict[str, list[int]], mgr: OmniKVTransferManager
    ) -> tuple[dict[str, str], float, float, list[str]]:
        digests: dict[str, str] = {}
        prefill_s = send_s = 0.0
        failed: list[str] = []
        for rid, prompt in prompts.items():
            t0 = time.perf_counter()
            out = self.model(torch.tensor([prompt]), use_cache=True)
            first = int(out.logits[0, -1].argmax())
            digests[rid] = _digest(out.cache)
            t1 = time.perf_counter()
            res = send_hf_cache(mgr, rid, out.cache, custom_metadata={"first_token": first})
            prefill_s, send_s = prefill_s + t1 - t0, send_s + time.perf_counter() - t1
            if not res.ok:
                failed.append(f"{rid}: {res.reason}")
        return digests, prefill_s, send_s, failed

    @torch.no_grad()
    def receive(
        self,
        prompts: dict[str, list[int]],
        new_tokens: int,
        mgr: OmniKVTransferManager,
        *,
        inject_fault: bool = False,
    ) -> dict[str, Any]:
        out: dict[str, Any] = {"requests": {}, "recv_s": 0.0, "decode_s": 0.0, "bytes": 0}
        for rid, prompt in prompts.items():
            t0 = time.perf_counter()
            cache, res = receive_hf_cache(mgr, rid, config=self.model.config)
            out["recv_s"] += time.perf_counter() - t0
            if cache is None:
                out["requests"][rid] = {"error": res.reason or res.status.value}
                continue
            out["bytes"] += res.nbytes
            if inject_fault:
                cache.layers[0].keys.view(-1)[0] += 1.0
            digest = _digest(cache)
            t1 = time.perf_counter()
            first = int(res.metadata["first_token"])
            ids = torch.tensor([[*prompt, first]])
            tokens = (
                [first, *greedy(self.model, ids, new_tokens - 1, cache)]
                if new_tokens > 1
                else [first]
            )
            out["decode_s"] += time.perf_counter() - t1
            out["requests"][rid] = {"tokens": tokens, "kv": digest}
        return out
