"""omnikv inside a vLLM engine: :class:`OmniKVConnector`, a vLLM v1 KV connector.

Switch it on like vLLM's own connectors, in the ``LLM`` class or on ``vllm serve``::

    KVTransferConfig(
        kv_connector="OmniKVConnector",
        kv_connector_module_path="omnikv.integrations.vllm",
        kv_role="kv_producer",            # or "kv_consumer" / "kv_both"
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"omni_kv_config": {...}},  # a stage's omni_kv_config dict
    )

It follows vLLM's convention for disaggregated prefill, for many concurrent clients whose
``kv_transfer_params`` are untrusted input:

* **Producer.** A request submitted with ``kv_transfer_params={"do_remote_decode": True}`` has its
  prompt KV shipped when it finishes. ``request_finished`` keeps the blocks and returns the
  ``kv_transfer_params`` a consumer needs: a fresh unguessable ``omnikv_transfer_id``, the token
  count and the request's binding (model, tokens, LoRA adapter, ``cache_salt``, multimodal
  hashes). The worker extracts and puts the KV on a bounded pool of send threads (the reference
  wire format, so a Hugging Face or vllm-omni stage can consume it too); the engine loop never
  waits for a send, and vLLM frees the blocks once the put is done.
* **Consumer.** A request submitted with those params gets its prompt KV from omnikv.
  ``get_num_new_matched_tokens`` admits or refuses the params at once (form, producer tag,
  binding, MAC with ``auth_secret``); an admitted request is loaded asynchronously on the
  bounded receive threads of a ``KVAdmission``, each load bound by its own deadline
  (``recv_timeout`` from admission), looking up only the payload its own binding names, checking
  it whole before writing vLLM's blocks. Any miss, timeout or mismatch is logged, counted and
  reported as a failed receive: with ``kv_load_failure_policy="recompute"`` vLLM recomputes the
  prefill (never a wrong answer, and nothing unchecked enters the prefix cache).
* **Early hand-off.** With ``auth_secret`` on both engines and ``stream_kv`` in both
  ``omni_kv_config``, a router that holds the secret issues the transfer id itself
  (:func:`new_router_transfer_id`) and sends the request to the producer and the consumer at
  once (:func:`early_handoff_params`): the producer streams the prompt's blocks as its prefill
  computes them and the consumer, admitted at once, takes them meanwhile, so what is left at the
  producer's finish is its last step's blocks.

Counts reach vLLM's logs and ``/metrics`` (``vllm:omnikv_*``). Settings:
:mod:`omnikv.integrations.vllm.options`. Ids, bindings and MACs:
:mod:`omnikv.integrations.vllm.binding`. Layouts come from the attention backend (``CPU_ATTN``:
by the ISA it picks, :data:`omnikv.layouts.specs.VLLM_CPU_LAYOUT` for ``vec`` / ``vec16``,
:data:`omnikv.layouts.blocks.VLLM_CPU_AMX_LAYOUT` for ``amx``; ``FLASH_ATTN`` / ``TRITON_ATTN``:
:data:`omnikv.layouts.specs.VLLM_BHNC_LAYOUT`) or from
``kv_connector_extra_config["vllm_kv_layout"]``; never from tensor shapes.
"""

from omnikv.integrations.vllm.binding import (
    early_handoff_params,
    new_router_transfer_id,
    payload_key,
    request_binding,
    token_digest,
)
from omnikv.integrations.vllm.connector import BACKEND_LAYOUTS, OmniKVConnector
from omnikv.integrations.vllm.metadata import OmniKVConnectorMetadata
from omnikv.integrations.vllm.scheduler import PARAM_BINDING, PARAM_NUM_TOKENS, PARAM_TRANSFER_ID
from omnikv.integrations.vllm.stats import OmniKVConnectorStats

__all__ = [
    "BACKEND_LAYOUTS",
    "PARAM_BINDING",
    "PARAM_NUM_TOKENS",
    "PARAM_TRANSFER_ID",
    "OmniKVConnector",
    "OmniKVConnectorMetadata",
    "OmniKVConnectorStats",
    "early_handoff_params",
    "new_router_transfer_id",
    "payload_key",
    "request_binding",
    "token_digest",
]
