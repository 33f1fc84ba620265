"""omnikv inside a vLLM engine: :class:`OmniKVConnector`, a vLLM v1 KV connector.

Switch it on like vLLM's own connectors::

    KVTransferConfig(
        kv_connector="OmniKVConnector",
        kv_connector_module_path="omnikv.integrations.vllm",
        kv_role="kv_producer",            # or "kv_consumer" / "kv_both"
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"omni_kv_config": {...}},  # a stage's omni_kv_config dict
    )

It follows vLLM's convention for disaggregated prefill:

* **Producer.** A request submitted with ``kv_transfer_params={"do_remote_decode": True}`` (in
  ``SamplingParams.extra_args``) has its prompt KV shipped when it finishes. ``request_finished``
  keeps the blocks and returns the ``kv_transfer_params`` a consumer needs (they appear on the
  ``RequestOutput``); the next engine step tells the worker, which extracts and puts the KV through
  :meth:`OmniKVTransferManager.handle_finished_requests_kv_transfer` on a background thread (the
  reference wire format: per layer ``[seq, heads, dim]``, so a Hugging Face or vllm-omni stage
  can consume it too). ``get_finished`` reports the request once the put is done and vLLM frees
  the blocks; ``has_pending_push_work`` keeps the engine stepping meanwhile. The engine loop never
  waits for a send.
* **Consumer.** A request submitted with those params (``do_remote_prefill: True`` and the
  ``omnikv_*`` keys) gets its prompt KV from omnikv: ``get_num_new_matched_tokens`` reports the
  tokens the producer sent (an asynchronous load), ``start_load_kv`` starts the receive on a
  background thread, which writes the tokens into the blocks vLLM allocated; the engine then
  decodes without recomputing the prefill (vLLM recomputes only the last prompt token, to sample).
  A miss, a timeout (``recv_timeout``), a payload that does not match the request (token digest,
  layer count, shapes) or any other failure is logged, counted (:meth:`OmniKVConnector.stats`) and
  reported as a failed receive: with ``kv_load_failure_policy="recompute"`` vLLM recomputes the
  prefill (never a wrong answer); with vLLM's default ``"fail"`` the request fails.

Layouts come from the attention backend (``CPU_ATTN``: :data:`omnikv.layouts.VLLM_CPU_LAYOUT`;
``FLASH_ATTN`` / ``TRITON_ATTN``: :data:`omnikv.layouts.VLLM_BHNC_LAYOUT`), or from
``kv_connector_extra_config["vllm_kv_layout"]``; never from tensor shapes.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
        KVConnectorTransferResults,
    )
except ImportError as exc:  # pragma: no cover - exercised only without vLLM
    raise ImportError(
        "omnikv.integrations.vllm needs vLLM (pip install 'omnikv[vllm]'); "
        f"importing it failed: {exc}"
    ) from exc

from omnikv.config import config_from_dict, options_from_dict
from omnikv.errors import OmniKVError
from omnikv.layouts import (
    VLLM_BHNC_LAYOUT,
    VLLM_CPU_LAYOUT,
    VLLM_LAYOUTS,
    scatter_tokens,
    vllm_layer_kv_views,
)
from omnikv.manager import OmniKVTransferManager

__all__ = [
    "BACKEND_LAYOUTS",
    "PARAM_NUM_TOKENS",
    "PARAM_TOKEN_DIGEST",
    "PARAM_TRANSFER_ID",
    "OmniKVConnector",
    "OmniKVConnectorMetadata",
    "token_digest",
]

logger = logging.getLogger(__name__)

#: ``kv_transfer_params`` keys the producer returns and the consumer reads.
PARAM_TRANSFER_ID = "omnikv_transfer_id"
PARAM_NUM_TOKENS = "omnikv_num_tokens"
PARAM_TOKEN_DIGEST = "omnikv_token_digest"
#: vLLM attention backend name -> the cache layout its layers use.
BACKEND_LAYOUTS: dict[str, str] = {
    "CPU_ATTN": VLLM_CPU_LAYOUT,
    "FLASH_ATTN": VLLM_BHNC_LAYOUT,
    "TRITON_ATTN": VLLM_BHNC_LAYOUT,
}
_RECORDS_KEPT = 1024


def token_digest(token_ids: Sequence[int]) -> str:
    """A short digest of a prompt prefix: the consumer loads KV only for the same tokens."""
    data = np.asarray(list(token_ids), dtype=np.int64).tobytes()
    return hashlib.blake2b(data, digest_size=16).hexdigest()


@dataclass(frozen=True)
class _SendSpec:
    req_id: str
    transfer_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    digest: str


@dataclass(frozen=True)
class _LoadSpec:
    req_id: str
    transfer_id: str
    block_ids: tuple[int, ...]
    start: int
    end: int
    digest: str


@dataclass
class OmniKVConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """Scheduler -> worker, once per engine step: the sends and loads to start."""

    sends: list[_SendSpec] = field(default_factory=list)
    loads: list[_LoadSpec] = field(default_factory=list)


@dataclass(frozen=True)
class _Remote:
    """What a consumer request's ``kv_transfer_params`` promise."""

    transfer_id: str
    num_tokens: int
    digest: str


def _remote_of(params: Any) -> _Remote | None:
    if not isinstance(params, Mapping) or not params.get("do_remote_prefill"):
        return None
    tid, num, digest = (
        params.get(PARAM_TRANSFER_ID),
        params.get(PARAM_NUM_TOKENS),
        params.get(PARAM_TOKEN_DIGEST),
    )
    if not isinstance(tid, str) or not tid or not isinstance(digest, str):
        return None
    if isinstance(num, bool) or not isinstance(num, int) or num <= 0:
        return None
    return _Remote(tid, num, digest)


class _Counters:
    """Outcome counters and a bounded per-transfer record (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}
        self._records: OrderedDict[str, dict[str, Any]] = OrderedDict()

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] = self._counts.get(name, 0) + n

    def record(self, key: str, **values: Any) -> None:
        with self._lock:
            entry = self._records.setdefault(key, {})
            entry.update(values)
            self._records.move_to_end(key)
            while len(self._records) > _RECORDS_KEPT:
                self._records.popitem(last=False)

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def get(self, key: str) -> dict[str, Any] | None:
        with self._lock:
            entry = self._records.get(key)
            return dict(entry) if entry is not None else None


class _SchedulerSide:
    """The scheduler half: decides which requests send or load, and keeps their blocks."""

    def __init__(self, *, producer: bool, consumer: bool, single_group: bool) -> None:
        self.producer = producer
        self.consumer = consumer and single_group
        if consumer and not single_group:
            logger.error("OmniKVConnector loads need one KV cache group; loading is off")
        self._tag = secrets.token_hex(4)
        self._sends: list[_SendSpec] = []
        self._loads: list[_LoadSpec] = []
        self._inflight: set[str] = set()
        self._attempted: set[str] = set()

    def matched(self, request: Any, num_computed: int) -> tuple[int, bool]:
        remote = self._remote(request)
        if remote is None or request.request_id in self._attempted:
            return 0, False
        count = min(remote.num_tokens, int(request.num_prompt_tokens)) - num_computed
        return (count, True) if count > 0 else (0, False)

    def _remote(self, request: Any) -> _Remote | None:
        if not self.consumer:
            return None
        remote = _remote_of(getattr(request, "kv_transfer_params", None))
        if remote is None:
            return None
        prompt = list(request.prompt_token_ids or ())
        available = min(remote.num_tokens, len(prompt))
        if token_digest(prompt[:available]) != remote.digest:
            logger.debug("Request %s: prompt differs from the sent KV; recomputing", request)
            return None
        return _Remote(remote.transfer_id, available, remote.digest)

    def after_alloc(self, request: Any, blocks: Any, num_external: int) -> None:
        if num_external <= 0:
            return
        remote = self._remote(request)
        if remote is None or request.request_id in self._attempted:
            return
        self._attempted.add(request.request_id)
        block_ids = tuple(int(b) for b in blocks.get_block_ids()[0])
        start = remote.num_tokens - num_external
        self._loads.append(
            _LoadSpec(
                request.request_id,
                remote.transfer_id,
                block_ids,
                start,
                remote.num_tokens,
                remote.digest,
            )
        )

    def build(self) -> OmniKVConnectorMetadata:
        meta = OmniKVConnectorMetadata(self._sends, self._loads)
        self._sends, self._loads = [], []
        return meta

    def finished(
        self, request: Any, block_ids: Sequence[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._attempted.discard(request.request_id)
        params = getattr(request, "kv_transfer_params", None)
        if not self.producer or not isinstance(params, Mapping):
            return False, None
        if not params.get("do_remote_decode") or not block_ids:
            return False, None
        if getattr(getattr(request, "status", None), "name", "") == "FINISHED_ABORTED":
            return False, None
        prompt = list(request.prompt_token_ids or ())
        num = min(len(prompt), int(request.num_computed_tokens))
        if num <= 0:
            return False, None
        tid = f"{self._tag}-{request.request_id}"
        digest = token_digest(prompt[:num])
        self._sends.append(_SendSpec(request.request_id, tid, tuple(block_ids), num, digest))
        self._inflight.add(request.request_id)
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            PARAM_TRANSFER_ID: tid,
            PARAM_NUM_TOKENS: num,
            PARAM_TOKEN_DIGEST: digest,
        }

    def sent(self, req_ids: Iterable[str]) -> None:
        self._inflight.difference_update(req_ids)

    @property
    def pending(self) -> bool:
        return bool(self._inflight or self._sends)


class _WorkerSide:
    """The worker half: sends and loads on background threads, reports completions."""

    def __init__(self, omni_kv_config: Mapping[str, Any], block_size: int) -> None:
        self.manager = OmniKVTransferManager(
            config_from_dict(omni_kv_config), options=options_from_dict(omni_kv_config)
        )
        self.block_size = block_size
        self.counters = _Counters()
        self.views: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.layout_error: str | None = "register_kv_caches was not called"
        self._send_pool = ThreadPoolExecutor(1, thread_name_prefix="omnikv-vllm-send")
        self._load_pool = ThreadPoolExecutor(1, thread_name_prefix="omnikv-vllm-load")
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._running = 0
        self._sending: set[str] = set()
        self._released: set[str] = set()
        self._sent: set[str] = set()
        self._loaded: set[str] = set()
        self._failed: set[str] = set()

    def register(self, kv_caches: Mapping[str, torch.Tensor], layout: str | None) -> None:
        if layout is None:
            self.layout_error = "unknown attention backend layout (set vllm_kv_layout)"
            logger.error("OmniKVConnector: %s; transfers are off", self.layout_error)
            return
        try:
            self.views = {name: vllm_layer_kv_views(t, layout) for name, t in kv_caches.items()}
        except OmniKVError as exc:
            self.layout_error = f"layout {layout!r}: {exc}"
            logger.error("OmniKVConnector: %s; transfers are off", self.layout_error)
            return
        self.layout_error = None
        logger.info("OmniKVConnector: %d layers, layout %s", len(self.views), layout)

    def submit(self, meta: OmniKVConnectorMetadata) -> None:
        with self._lock:
            self._sending.update(send.req_id for send in meta.sends)
            self._running += len(meta.sends) + len(meta.loads)
        for send in meta.sends:
            self.counters.record(send.transfer_id, req_id=send.req_id, submitted=time.monotonic())
            self._send_pool.submit(self._send, send)
        for load in meta.loads:
            self.counters.record(load.transfer_id, req_id=load.req_id, submitted=time.monotonic())
            self._load_pool.submit(self._load, load)

    def _done(self) -> None:
        """One submitted transfer ended (called with the lock held)."""
        self._running -= 1
        if self._running == 0:
            self._idle.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        with self._idle:
            return self._idle.wait_for(lambda: self._running == 0, timeout=timeout)

    def results(self, finished_req_ids: Iterable[str]) -> KVConnectorTransferResults:
        with self._lock:
            self._released.update(r for r in finished_req_ids if r in self._sending)
            sent = self._sent & self._released
            self._sent -= sent
            self._released -= sent
            self._sending -= sent
            loaded, failed = self._loaded, self._failed
            self._loaded, self._failed = set(), set()
        return KVConnectorTransferResults(
            finished_sending=sent, finished_recving=loaded, failed_recving=failed
        )

    # -- producer -------------------------------------------------------------------------------
    def _send(self, spec: _SendSpec) -> None:
        t0 = time.monotonic()
        reason = self.layout_error
        try:
            if reason is None:
                reason = self._put(spec)
        except Exception as exc:  # the thread must always report, or the blocks stay held
            logger.exception("OmniKVConnector: send of %s raised", spec.transfer_id)
            reason = f"{type(exc).__name__}: {exc}"
        ok = reason is None
        self.counters.add("sends_ok" if ok else "sends_failed")
        self.counters.record(
            spec.transfer_id,
            block_ids=list(spec.block_ids),
            num_tokens=spec.num_tokens,
            start=t0,
            end=time.monotonic(),
            ok=ok,
            reason=reason,
        )
        with self._lock:
            self._sent.add(spec.req_id)
            self._done()
        if not ok:
            logger.error("OmniKVConnector: send of %s failed: %s", spec.transfer_id, reason)

    def _put(self, spec: _SendSpec) -> str | None:
        first = next(iter(self.views.values()))[0]
        entry = {
            "block_ids": list(spec.block_ids),
            "seq_len": spec.num_tokens,
            "custom_metadata": {PARAM_TOKEN_DIGEST: spec.digest, "source": "vllm"},
        }
        self.manager.handle_finished_requests_kv_transfer(
            {spec.transfer_id: entry},
            kv_caches=list(self.views.values()),
            block_size=self.block_size,
            cache_dtype=str(first.dtype),
        )
        result = self.manager.get_send_result(spec.transfer_id)
        if result is None:
            return "the manager recorded no send result"
        if result.ok:
            self.counters.add("bytes_sent", result.nbytes)
            return None
        return f"{result.status.value}: {result.reason}"

    # -- consumer -------------------------------------------------------------------------------
    def _load(self, spec: _LoadSpec) -> None:
        t0 = time.monotonic()
        reason = self.layout_error
        try:
            if reason is None:
                reason = self._receive_into_blocks(spec)
        except Exception as exc:  # any failure means: recompute, never use the blocks
            logger.exception("OmniKVConnector: load of %s raised", spec.transfer_id)
            reason = f"{type(exc).__name__}: {exc}"
        ok = reason is None
        self.counters.record(
            spec.transfer_id,
            block_ids=list(spec.block_ids),
            num_tokens=spec.end,
            loaded_from=spec.start,
            start=t0,
            end=time.monotonic(),
            ok=ok,
            reason=reason,
        )
        if ok:
            self.counters.add("loads_ok")
            self.counters.add("tokens_loaded", spec.end - spec.start)
        else:
            self.counters.add("loads_fallback")
        with self._lock:
            self._loaded.add(spec.req_id)
            if not ok:
                self._failed.add(spec.req_id)
            self._done()
        if not ok:
            logger.warning(
                "OmniKVConnector: KV of %s (request %s) not loaded, recomputing the prefill: %s",
                spec.transfer_id,
                spec.req_id,
                reason,
            )

    def _receive_into_blocks(self, spec: _LoadSpec) -> str | None:
        result = self.manager.receive_kv_cache_result(spec.transfer_id)
        if not result.ok or result.data is None:
            return f"receive {result.status.value}: {result.reason}"
        data = result.data
        meta = data.get("metadata") or {}
        if meta.get(PARAM_TOKEN_DIGEST) != spec.digest:
            return "token digest of the payload does not match the request"
        blocks = data.get("layer_blocks") or {}
        keys, values = blocks.get("key_cache") or [], blocks.get("value_cache") or []
        views = list(self.views.values())
        if len(keys) != len(views) or len(values) != len(views):
            return f"payload has {len(keys)} layers, the engine {len(views)}"
        for idx, ((k_blocks, v_blocks), k, v) in enumerate(zip(views, keys, values, strict=True)):
            if k is None or v is None or k.shape[0] < spec.end or v.shape[0] < spec.end:
                return f"layer {idx}: fewer than {spec.end} tokens in the payload"
            scatter_tokens(k_blocks, spec.block_ids, k[spec.start : spec.end], spec.start)
            scatter_tokens(v_blocks, spec.block_ids, v[spec.start : spec.end], spec.start)
        return None

    def close(self) -> None:
        self._send_pool.shutdown(wait=True)
        self._load_pool.shutdown(wait=True)
        self.manager.close()


def _omni_kv_config(extra: Mapping[str, Any], producer: bool, consumer: bool) -> dict[str, Any]:
    """The stage's ``omni_kv_config`` with ``need_send/recv_cache`` defaulted from the role."""
    raw = extra.get("omni_kv_config")
    if raw is not None and not isinstance(raw, Mapping):
        raise OmniKVError(f"omni_kv_config must be a dict, got {type(raw).__name__}")
    cfg = dict(raw or {})
    cfg.setdefault("need_send_cache", producer)
    cfg.setdefault("need_recv_cache", consumer)
    return cfg


def _backend_layout(vllm_config: Any, extra: Mapping[str, Any]) -> str | None:
    """The cache layout: ``vllm_kv_layout`` if given, else the attention backend's."""
    declared = extra.get("vllm_kv_layout")
    if declared is not None:
        if declared not in VLLM_LAYOUTS:
            raise OmniKVError(f"vllm_kv_layout must be one of {VLLM_LAYOUTS}, got {declared!r}")
        return str(declared)
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

    names = sorted({b.get_name() for b in get_current_attn_backends(vllm_config)})
    layouts = {BACKEND_LAYOUTS.get(n) for n in names}
    if len(layouts) != 1 or None in layouts:
        logger.error("OmniKVConnector: no known layout for attention backend(s) %s", names)
        return None
    return layouts.pop()


class OmniKVConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """vLLM v1 KV connector shipping finished requests' KV through omnikv (see module doc).

    vLLM builds one instance in the scheduler (``role=SCHEDULER``) and one per worker
    (``role=WORKER``); each half only uses its side.
    """

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = self._kv_transfer_config
        producer, consumer = bool(ktc.is_kv_producer), bool(ktc.is_kv_consumer)
        extra = dict(ktc.kv_connector_extra_config or {})
        self._vllm_extra = extra
        self._scheduler: _SchedulerSide | None = None
        self._worker: _WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            groups = getattr(kv_cache_config, "kv_cache_groups", None) or [None]
            self._scheduler = _SchedulerSide(
                producer=producer, consumer=consumer, single_group=len(groups) == 1
            )
            if consumer and getattr(ktc, "kv_load_failure_policy", "fail") != "recompute":
                logger.warning(
                    "OmniKVConnector: kv_load_failure_policy=%r: a request whose KV does not "
                    "arrive fails; set 'recompute' to recompute its prefill instead",
                    getattr(ktc, "kv_load_failure_policy", None),
                )
        else:
            cfg = _omni_kv_config(extra, producer, consumer)
            self._worker = _WorkerSide(cfg, int(vllm_config.cache_config.block_size))

    # -- worker side ----------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self._worker is not None:
            layout = _backend_layout(self._vllm_config, self._vllm_extra)
            self._worker.register(kv_caches, layout)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if self._worker is not None and isinstance(meta, OmniKVConnectorMetadata) and meta.loads:
            self._worker.submit(OmniKVConnectorMetadata(loads=meta.loads))

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: loads are asynchronous, the request is not in the batch."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Nothing per layer: a request's KV is sent whole once it has finished."""

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if self._worker is not None and isinstance(meta, OmniKVConnectorMetadata) and meta.sends:
            self._worker.submit(OmniKVConnectorMetadata(sends=meta.sends))

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self._worker is None:
            return KVConnectorTransferResults()
        return self._worker.results(finished_req_ids)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()

    # -- scheduler side -------------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if self._scheduler is None:
            return 0, False
        return self._scheduler.matched(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if self._scheduler is not None:
            self._scheduler.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> OmniKVConnectorMetadata:
        if self._scheduler is None:
            return OmniKVConnectorMetadata()
        return self._scheduler.build()

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        if self._scheduler is None:
            return False, None
        return self._scheduler.finished(request, block_ids)

    def update_connector_output(self, connector_output: Any) -> None:
        if self._scheduler is not None:
            self._scheduler.sent(connector_output.finished_sending or ())

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.pending

    # -- observability ----------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """Worker counters: ``sends_ok``, ``sends_failed``, ``loads_ok``, ``loads_fallback``, ..."""
        return self._worker.counters.counts() if self._worker is not None else {}

    def transfer_record(self, transfer_id: str) -> dict[str, Any] | None:
        """What this worker did for a transfer: block ids, tokens, monotonic start/end, outcome."""
        return self._worker.counters.get(transfer_id) if self._worker is not None else None

    def wait_transfers(self, timeout: float) -> bool:
        """Block until no send or load of this worker is in flight; False at ``timeout``."""
        return self._worker.wait_idle(timeout) if self._worker is not None else True

    def layer_kv_views(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Per layer ``(K, V)`` block views ``[num_blocks, block_size, heads, dim]`` (aliases)."""
        return dict(self._worker.views) if self._worker is not None else {}
