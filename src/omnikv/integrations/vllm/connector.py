""":class:`OmniKVConnector`, the vLLM v1 KV connector: a facade over its two halves.

vLLM builds one instance in the scheduler (``role=SCHEDULER``: :class:`.scheduler.SchedulerSide`)
and one per worker (``role=WORKER``: :class:`.worker.WorkerSide`). Each hook asserts it is
called on the half that owns it and delegates; see the package doc for the protocol.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from omnikv.config import config_from_dict
from omnikv.integrations.vllm._vllm import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from omnikv.integrations.vllm.binding import model_fingerprint
from omnikv.integrations.vllm.metadata import OmniKVConnectorMetadata
from omnikv.integrations.vllm.options import parse_options
from omnikv.integrations.vllm.scheduler import SchedulerSide
from omnikv.integrations.vllm.stats import OmniKVConnectorStats, OmniKVPromMetrics
from omnikv.integrations.vllm.worker import WorkerSide
from omnikv.layouts.vllm_backends import (
    BACKEND_LAYOUTS,
    CPU_ISA_LAYOUTS,
    attention_backend_layout,
    cpu_cache_layout,
)

__all__ = [
    "BACKEND_LAYOUTS",
    "CPU_ISA_LAYOUTS",
    "OmniKVConnector",
    "cpu_cache_layout",
    "declare_payload_size",
]

logger = logging.getLogger(__name__)


def _backend_layout(
    vllm_config: Any, declared: str | None, layer_names: Iterable[str]
) -> str | None:
    """The cache layout: ``vllm_kv_layout`` if given, else the attention backend's."""
    if declared is not None:
        return declared
    return attention_backend_layout(vllm_config, layer_names)


def declare_payload_size(omni_kv_config: dict[str, Any], vllm_config: Any) -> None:
    """Tell a shared-memory sender what one request's KV can weigh (``kv_bytes_per_token`` x
    ``max_model_len``), so that its start-up reserve fits this engine; keys already set stay.
    Called by the connector's constructor on the config it was given."""
    conn = omni_kv_config.get("connector_config")
    if not isinstance(conn, dict) or conn.get("type") != "SharedMemoryConnector":
        return
    if not omni_kv_config.get("need_send_cache"):
        return
    try:
        model, parallel = vllm_config.model_config, vllm_config.parallel_config
        item = torch.empty((), dtype=model.dtype).element_size()
        heads, layers = model.get_num_kv_heads(parallel), model.get_num_layers(parallel)
        per_token = 2 * layers * heads * model.get_head_size() * item
        max_len = int(model.max_model_len)
    except (AttributeError, TypeError, ValueError):  # a config that cannot say: the default
        return
    conn.setdefault("kv_bytes_per_token", int(per_token))
    conn.setdefault("max_model_len", max_len)


class OmniKVConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """vLLM v1 KV connector shipping finished requests' prompt KV through omnikv.

    A facade, as vLLM's own NIXL connector: each hook asserts it is called on the half that
    owns it and delegates to the hook of the same name on :class:`.scheduler.SchedulerSide`
    or :class:`.worker.WorkerSide`."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = self._kv_transfer_config
        producer, consumer = bool(ktc.is_kv_producer), bool(ktc.is_kv_consumer)
        options = parse_options(
            dict(ktc.kv_connector_extra_config or {}), producer=producer, consumer=consumer
        )
        self._options = options
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            groups = getattr(kv_cache_config, "kv_cache_groups", None) or [None]
            if consumer and len(groups) != 1:
                logger.error("OmniKVConnector loads need one KV cache group; loading is off")
                consumer = False
            if consumer and getattr(ktc, "kv_load_failure_policy", "fail") != "recompute":
                logger.warning(
                    "OmniKVConnector: kv_load_failure_policy=%r: a request whose KV does not "
                    "arrive fails; set 'recompute' to recompute its prefill instead",
                    getattr(ktc, "kv_load_failure_policy", None),
                )
            cache = getattr(vllm_config, "cache_config", None)
            self._scheduler = SchedulerSide(
                options,
                producer=producer,
                consumer=consumer,
                fingerprint=model_fingerprint(vllm_config, options.model_id),
                recv_timeout=config_from_dict(options.omni_kv_config).recv_timeout,
                prefix_caching=bool(getattr(cache, "enable_prefix_caching", False)),
                block_size=int(getattr(cache, "block_size", 0) or 0),
            )
        else:
            declare_payload_size(options.omni_kv_config, vllm_config)
            self._worker = WorkerSide(options, int(vllm_config.cache_config.block_size))

    def _worker_side(self) -> WorkerSide:
        assert self._worker is not None, "a worker hook was called on the scheduler's connector"
        return self._worker

    def _scheduler_side(self) -> SchedulerSide:
        assert self._scheduler is not None, "a scheduler hook was called on a worker's connector"
        return self._scheduler

    # -- worker side ----------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layout = _backend_layout(self._vllm_config, self._options.layout, kv_caches)
        self._worker_side().register_kv_caches(kv_caches, layout)

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        if isinstance(connector_metadata, OmniKVConnectorMetadata):
            self._worker_side().bind_connector_metadata(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._worker_side().start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker_side().wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        self._worker_side().save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        self._worker_side().wait_for_save()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self._worker_side().get_transfer_results(finished_req_ids)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker_side().get_finished(finished_req_ids)

    def get_kv_connector_stats(self) -> OmniKVConnectorStats | None:
        """The interval's stats: transfers on a worker, admission refusals on the scheduler."""
        if self._worker is not None:
            return self._worker.get_kv_connector_stats()
        return self._scheduler_side().get_kv_connector_stats()

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> OmniKVConnectorStats | None:
        return OmniKVConnectorStats(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> OmniKVPromMetrics:
        return OmniKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    # -- scheduler side -------------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._scheduler_side().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._scheduler_side().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> OmniKVConnectorMetadata:
        return self._scheduler_side().build_connector_meta(scheduler_output)

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler_side().request_finished(request, block_ids)

    def update_connector_output(self, connector_output: Any) -> None:
        self._scheduler_side().update_connector_output(connector_output)

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_push_work()

    # -- observability ----------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """Cumulative counts (see :mod:`.stats`): a worker's transfers, or the scheduler's
        admission refusals (``loads_refused``)."""
        if self._worker is not None:
            return self._worker.counters.counts()
        return self._scheduler_side().counters.counts()

    def transfer_record(self, transfer_id: str) -> dict[str, Any] | None:
        """What this worker did for a transfer: block ids, tokens, monotonic start/end, outcome,
        and for a send what became of it at the consumer (``delivery``)."""
        return self._worker.transfer_record(transfer_id) if self._worker is not None else None

    def wait_transfers(self, timeout: float) -> bool:
        """Block until no send or load of this worker is in flight; False at ``timeout``."""
        return self._worker.wait_idle(timeout) if self._worker is not None else True

    @property
    def kv_layout(self) -> str | None:
        """The layout this worker reads the engine's caches in (a name of
        :data:`omnikv.layouts.blocks.VLLM_BLOCK_LAYOUTS`); ``None`` on the scheduler, before
        ``register_kv_caches`` or when the layout is unknown (transfers are then off)."""
        return self._worker.layout if self._worker is not None else None

    def layer_tokens(
        self, block_ids: Sequence[int], num_tokens: int
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer fresh ``[num_tokens, heads, head_size]`` K and V: tokens
        ``[0, num_tokens)`` of the blocks ``block_ids`` (diagnostics and tests; any layout)."""
        if self._worker is None:
            return []
        return [layer.gather(block_ids, num_tokens) for layer in self._worker.layers.values()]
