"""Hand a Hugging Face transformers KV cache from one process to another.

The prefill stage runs the prompt through the model and sends the KV cache; the decode stage, a
separate process, receives it as a ``DynamicCache`` and continues generating without running
the prompt again. The two talk over shared memory (``SharedMemoryConnector``), so both must run
on the same host.

    python examples/hf_handoff.py

A tiny random-weight Llama stands in for a real model so that the example runs offline; with a
real one, load it in both stages with ``AutoModelForCausalLM.from_pretrained(name)``.
"""

from __future__ import annotations

import multiprocessing as mp
import uuid
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from omnikv import OmniKVTransferManager
from omnikv.integrations.transformers import receive_hf_cache, send_hf_cache

PROMPT = [5, 17, 42, 8, 99, 23, 4, 61, 7, 30, 2, 88]  # token ids
NEW_TOKENS = 8


def load_model() -> Any:
    """Both stages need the same weights: a seeded tiny Llama (4 query heads over 2 KV heads)."""
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        eos_token_id=None,  # never stop early
    )
    torch.manual_seed(0)
    model: Any = LlamaForCausalLM(config)
    return model.eval()


def generate(model: Any, ids: torch.Tensor, n: int, cache: Any = None) -> list[int]:
    """``n`` greedy tokens after ``ids``, continuing ``cache`` when one is given."""
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        cache=cache,
        max_new_tokens=n,
        do_sample=False,
        pad_token_id=0,
    )
    return [int(t) for t in out[0, ids.shape[1] :]]


def stage_config(namespace: str, role: str) -> dict[str, object]:
    """The ``omni_kv_config`` of each stage: stage 0 sends to stage 1 over shared memory."""
    connector = {"type": "SharedMemoryConnector", "namespace": namespace}
    if role == "prefill":
        return {
            "need_send_cache": True,
            "omni_from_stage": 0,
            "omni_to_stage": 1,
            "connector_config": connector,
        }
    return {
        "need_recv_cache": True,
        "stage_id": 1,
        "engine_input_source": [0],  # the stage it receives from
        "recv_timeout": 60,  # seconds to wait for the KV
        "connector_config": connector,
    }


def decode_stage(namespace: str, results: mp.Queue[dict[str, Any]]) -> None:
    """Stage 1 (its own process): receive the KV of "req-0" and continue generating."""
    model = load_model()
    with OmniKVTransferManager.from_config(stage_config(namespace, "decode")) as manager:
        # config and dtype let omnikv check the KV against the model before transformers sees it
        cache, result = receive_hf_cache(manager, "req-0", model=model)
    if cache is None:  # result says why: timeout, corrupt, peer_gone, ...
        results.put({"error": f"{result.status.value}: {result.reason}"})
        return
    received = cache.get_seq_length()  # tokens whose KV arrived: the whole prompt
    first = result.metadata["first_token"]  # custom metadata travels with the KV
    ids = torch.tensor([[*PROMPT, first]])
    with torch.no_grad():
        tokens = [first, *generate(model, ids, NEW_TOKENS - 1, cache)]
    results.put({"tokens": tokens, "cached_tokens": received, "bytes": result.nbytes})


def main() -> int:
    namespace = f"hf-handoff-{uuid.uuid4().hex[:8]}"  # a private channel for this run
    ctx = mp.get_context("spawn")
    results: mp.Queue[dict[str, Any]] = ctx.Queue()
    decoder = ctx.Process(target=decode_stage, args=(namespace, results))
    decoder.start()

    # Stage 0 (this process): prefill the prompt and send its KV cache.
    model = load_model()
    with OmniKVTransferManager.from_config(stage_config(namespace, "prefill")) as manager:
        with torch.no_grad():
            out = model(torch.tensor([PROMPT]), use_cache=True)
        first = int(out.logits[0, -1].argmax())
        sent = send_hf_cache(manager, "req-0", out.cache, custom_metadata={"first_token": first})
        print(f"prefill: sent the KV of {len(PROMPT)} tokens ({sent.status.value})")
        got = results.get(timeout=120)  # the payload lives in this process until it is taken
    decoder.join(timeout=30)
    if "error" in got:
        print(f"decode: no KV ({got['error']})")
        return 1
    print(f"decode: received {got['bytes']} bytes, {got['cached_tokens']} cached tokens")
    print(f"decode: generated {got['tokens']}")

    # The same generation in one process, for comparison.
    with torch.no_grad():
        expected = generate(model, torch.tensor([PROMPT]), NEW_TOKENS)
    same = got["tokens"] == expected
    print(f"same tokens as a single-process generate: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
