"""Disaggregated prefill with two offline vLLM engines: one prefills, the other decodes.

The producer engine runs the prompt (one output token) and its ``OmniKVConnector`` sends the
prompt's KV cache; the consumer engine is handed the producer's ``kv_transfer_params`` and
decodes from that KV instead of running the prompt again. Both engines run here, on one host,
over shared memory (``SharedMemoryConnector``). Needs vLLM (``pip install 'omnikv[vllm]'``).

    python examples/vllm_offline_pd.py                    # a tiny local model, built offline
    python examples/vllm_offline_pd.py --model Qwen/Qwen2.5-0.5B-Instruct

``kv_load_failure_policy="fail"`` makes a consumer request fail if its KV does not arrive, so
the tokens printed at the end were decoded from the transferred KV.

On vLLM's CPU build each engine reserves ``VLLM_CPU_KVCACHE_SPACE`` GiB for its KV cache; its
default asks for more than a small host has free ("Available memory ... is less than desired
CPU memory utilization"), so this example sets 1 GiB per engine unless the variable is set
already (GPU builds do not read it).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import uuid
from typing import Any

# Set before vLLM is imported, so that every engine it starts sees it (module docstring).
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from vllm import LLM, SamplingParams
from vllm.config import KVTransferConfig
from vllm.inputs import TokensPrompt

PROMPT = [11, 402, 37, 256, 91, 140, 7, 333, 58, 21, 480, 64, 9, 120, 77, 310, 45]  # token ids
NEW_TOKENS = 8


def engine(model: str, role: str, omni_kv_config: dict[str, Any]) -> LLM:
    """One vLLM engine whose KV connector is omnikv's (``kv_producer`` or ``kv_consumer``)."""
    transfer = KVTransferConfig(
        kv_connector="OmniKVConnector",
        kv_connector_module_path="omnikv.integrations.vllm",
        kv_role=role,
        kv_load_failure_policy="fail",
        kv_connector_extra_config={"omni_kv_config": omni_kv_config},
    )
    return LLM(
        model=model,
        enforce_eager=True,
        max_model_len=512,
        enable_prefix_caching=False,  # every prompt is computed (or loaded), nothing reused
        kv_transfer_config=transfer,
        seed=0,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description="Disaggregated prefill with two vLLM engines.")
    parser.add_argument("--model", help="a model name or path (default: a tiny local Llama)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:  # a random-weight Llama written to disk: no download needed
            from omnikv.bench.vllm import build_tiny_llama

            model = str(build_tiny_llama(os.path.join(tmp, "tiny-llama"), dtype="bfloat16"))
        connector = {"type": "SharedMemoryConnector", "namespace": f"pd-{uuid.uuid4().hex[:8]}"}
        producer = engine(
            model,
            "kv_producer",
            {"omni_from_stage": 0, "omni_to_stage": 1, "connector_config": connector},
        )
        consumer = engine(
            model,
            "kv_consumer",
            {
                "stage_id": 1,
                "omni_from_stage": 0,
                "recv_timeout": 60,
                "connector_config": connector,
            },
        )
        prompt = TokensPrompt(prompt_token_ids=PROMPT)

        # 1. Prefill on the producer: one token; ask it to keep the KV for a remote decode.
        prefill = SamplingParams(
            temperature=0.0,
            max_tokens=1,
            extra_args={"kv_transfer_params": {"do_remote_decode": True}},
        )
        (sent,) = producer.generate([prompt], prefill, use_tqdm=False)
        params = sent.kv_transfer_params  # opaque: hand it to the consumer unchanged
        print(f"producer: prefilled {len(PROMPT)} tokens, first token {sent.outputs[0].token_ids}")

        # 2. Decode on the consumer from the producer's KV.
        decode = SamplingParams(
            temperature=0.0,
            max_tokens=NEW_TOKENS,
            ignore_eos=True,
            extra_args={"kv_transfer_params": params},
        )
        (got,) = consumer.generate([prompt], decode, use_tqdm=False)
        tokens = list(got.outputs[0].token_ids)
        print(f"consumer: decoded {tokens} from the transferred KV")

        # 3. For comparison: the consumer computes the prompt itself.
        plain = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        (ref,) = consumer.generate([prompt], plain, use_tqdm=False)
        same = tokens == list(ref.outputs[0].token_ids)
        print(f"same tokens as computing the prompt on the consumer: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
