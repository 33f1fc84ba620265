"""``OmniKVTransferManager``: the seed API as a thin facade over sender, receiver and friends.

Each public method keeps the reference's name, signature and return shape; the work happens in
:mod:`omnikv.sender`, :mod:`omnikv.receiver`, :mod:`omnikv.requests`, :mod:`omnikv.parallel`
and :mod:`omnikv.prefetch`. Richer outcomes are kept per request and reachable through
:meth:`OmniKVTransferManager.get_send_result` / :meth:`OmniKVTransferManager.get_receive_result`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import torch

from omnikv.config import (
    OmniKVCacheConfig,
    TransferOptions,
    config_from_dict,
    options_from_dict,
    resolve_async_prefetch,
    vllm_omni_kv_dict,
)
from omnikv.connectors.base import OmniConnectorBase
from omnikv.connectors.factory import (
    TRANSFER_ENGINE_CONNECTOR_NAMES,
    ConnectorSpec,
    OmniConnectorFactory,
)
from omnikv.deadline import deadline_after
from omnikv.distribution import distribute, tp_agree
from omnikv.errors import KVPrefetchConsumeError
from omnikv.metrics import TransferMetrics
from omnikv.parallel import ParallelContext, TopoConfig, build_topo_config
from omnikv.parallel_discovery import discover_tp
from omnikv.prefetch import KVPrefetcher, KVPrefetchJob, PrefetchConsume, iter_prefetch_jobs
from omnikv.receiver import KVReceiver, ReceiveResult, ReceiveStatus, SenderEndpoint
from omnikv.requests import apply_kv_cache_to_request, apply_request_kv_payload, request_id_of
from omnikv.sender import KVSender, SendResult, SendStatus
from omnikv.topology import (
    KVTPTopology,
    PayloadMerger,
    PayloadSlicer,
    RecvKeyBuilder,
    SendKeyBuilder,
    kv_zmq_port,
    rank_port,
)

__all__ = ["LayerKV", "OmniKVTransferManager", "RankInfo"]

logger = logging.getLogger(__name__)

LayerKV = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
DUMMY_REQUEST_ID = "dummy_req_id"
_RESULTS_KEPT = 4096


class RankInfo(Protocol):
    """What the manager needs to know about the process's place in its stage."""

    @property
    def local_rank(self) -> int: ...

    @property
    def tp_size(self) -> int: ...


def _stage_str(value: Any) -> str | None:
    if value is None or value == "":
        return None
    return str(value)


def _resolve_sender_info(
    sender_info: Any, preferred: Any, fallback: str | None
) -> dict[str, Any] | None:
    """One ``{"host", "zmq_port"}`` entry out of flat or per-stage sender info (reference §2.6)."""
    if not sender_info or not isinstance(sender_info, Mapping):
        return None
    if "host" in sender_info:
        return dict(sender_info)
    candidates: list[Any] = []
    for key in (preferred, fallback):
        if key is None:
            continue
        for form in (key, str(key)):
            if form not in candidates:
                candidates.append(form)
        try:
            as_int = int(key)
        except (TypeError, ValueError):
            continue
        if as_int not in candidates:
            candidates.append(as_int)
    for key in candidates:
        entry = sender_info.get(key)
        if isinstance(entry, Mapping) and "host" in entry:
            return dict(entry)
    entries = [v for v in sender_info.values() if isinstance(v, Mapping) and "host" in v]
    if len(entries) == 1:
        return dict(entries[0])
    if len(entries) > 1:
        logger.warning("Ambiguous sender_info with %d stages and no match", len(entries))
    return None


class _BoundedResults(OrderedDict[str, Any]):
    def record(self, key: str, value: Any) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > _RESULTS_KEPT:
            self.popitem(last=False)


class OmniKVTransferManager:
    """Unified management for OmniConnector and KV cache transfer.

    This class encapsulates all KV cache related operations: connector initialization and lazy
    creation, KV cache extraction from paged blocks, transfer with retry, and receiving with a
    deadline. One instance per worker process and stage.
    """

    def __init__(
        self,
        config: OmniKVCacheConfig,
        *,
        async_prefetch: bool = False,
        options: TransferOptions | None = None,
        parallel_context: RankInfo | None = None,
        connector: OmniConnectorBase | None = None,
    ) -> None:
        self.config = config
        self.options = options or TransferOptions()
        self.parallel_context = parallel_context
        from_s, to_s = _stage_str(config.from_stage), _stage_str(config.to_stage)
        self.send_stages: tuple[str | None, str | None] = (
            (from_s, to_s) if from_s is not None and to_s is not None else (None, None)
        )
        self.recv_stages = self._compute_recv_stages(config)
        if parallel_context is not None:
            self.local_rank = int(parallel_context.local_rank)
            detected_tp = int(parallel_context.tp_size)
        else:  # the host framework's TP group, else LOCAL_RANK (omnikv.parallel_discovery)
            host = discover_tp()
            self.local_rank, detected_tp = host.local_rank, host.tp_size
        from_tp, to_tp = int(config.from_tp), int(config.to_tp)
        if from_tp <= 1 and to_tp <= 1:
            from_tp = to_tp = max(1, detected_tp)
        self.tp_topo = KVTPTopology(from_tp, to_tp, self.local_rank)
        self.kv_send_key_builder: SendKeyBuilder | None = None
        self.kv_recv_key_builder: RecvKeyBuilder | None = None
        self.kv_payload_merger: PayloadMerger | None = None
        self.kv_payload_slicer: PayloadSlicer | None = None
        self._sender_base_host: str | None = None
        self._sender_base_zmq_port: int | None = None
        self._connector: OmniConnectorBase | None = connector
        self._connector_lock = threading.Lock()
        self._connector_error: str | None = None
        self._connector_retry_at = 0.0
        self._send_results: _BoundedResults = _BoundedResults()
        self._recv_results: _BoundedResults = _BoundedResults()
        self._results_lock = threading.Lock()
        #: The results of the latest ``handle_finished_requests_kv_transfer`` call, in order.
        self.last_send_results: list[SendResult] = []
        #: Outcome counters and phase histograms (``metrics.prometheus()`` for export).
        self.metrics = TransferMetrics()
        self._companions = threading.local()
        self._pool: ThreadPoolExecutor | None = None
        self._async_prefetch = bool(async_prefetch)
        self._prefetcher: KVPrefetcher | None = None
        self._prefetch_lock = threading.Lock()
        self._sender = KVSender(
            stages=self.send_stages,
            topology=self.tp_topo,
            options=self.options,
            connector=lambda: self.connector,
            send_key_builder=lambda: self.kv_send_key_builder,
        )
        self._receiver = KVReceiver(
            stages=self.recv_stages,
            topology=self.tp_topo,
            options=self.options,
            connector=lambda: self.connector,
            recv_key_builder=lambda: self.kv_recv_key_builder,
            merger=lambda: self.kv_payload_merger,
            slicer=lambda: self.kv_payload_slicer,
        )
        eager = config.need_send_cache and config.connector_config and connector is None
        if eager and self.connector is not None:
            logger.info("Sender connector eagerly initialized")

    # -- construction -------------------------------------------------------------------------
    @staticmethod
    def _compute_recv_stages(config: OmniKVCacheConfig) -> tuple[str | None, str | None]:
        source: Any = config.from_stage
        if config.engine_input_source:
            source = config.engine_input_source[0]
        elif isinstance(config.stage_id, int) and not isinstance(config.stage_id, bool):
            source = config.stage_id - 1
        src, stage = _stage_str(source), _stage_str(config.stage_id)
        return (src, stage) if src is not None and stage is not None else (None, None)

    @classmethod
    def _create(
        cls, cfg: Mapping[str, Any] | None, *, async_prefetch: bool = False
    ) -> OmniKVTransferManager:
        config = config_from_dict(cfg, async_prefetch=async_prefetch)
        return cls(config, async_prefetch=async_prefetch, options=options_from_dict(cfg))

    @classmethod
    def from_od_config(cls, config: Any) -> OmniKVTransferManager:
        """Create from model or OmniDiffusion config (reads ``config.omni_kv_config``)."""
        omni_kv = getattr(config, "omni_kv_config", None)
        if not isinstance(omni_kv, Mapping):
            omni_kv = None
        has_companion = getattr(config, "cfg_kv_collect_func", None) is not None
        flag = resolve_async_prefetch(omni_kv, has_companion=has_companion)
        return cls._create(omni_kv, async_prefetch=flag)

    from_model_config = from_od_config

    @classmethod
    def from_vllm_config(cls, vllm_config: Any, model_config: Any) -> OmniKVTransferManager:
        """Create from vllm config with fallback to kv_transfer_config."""
        if isinstance(getattr(model_config, "omni_kv_config", None), Mapping):
            manager = cls._create(model_config.omni_kv_config, async_prefetch=False)
            return manager
        fallback = vllm_omni_kv_dict(vllm_config)
        if fallback is not None:
            return cls._create(fallback)
        return cls._create(None)

    # -- connector ----------------------------------------------------------------------------
    def _connector_spec(self) -> ConnectorSpec | None:
        cfg = self.config.connector_config
        if not cfg or not cfg.get("type"):
            return None
        name = str(cfg["type"])
        extra = {k: v for k, v in cfg.items() if k != "type"}
        if name in TRANSFER_ENGINE_CONNECTOR_NAMES:
            extra.setdefault("from_stage", str(self.config.from_stage or "0"))
            extra.setdefault("to_stage", str(self.config.to_stage or "1"))
            if self.config.need_send_cache:
                base = int(os.path.expandvars(str(extra.get("zmq_port", 50051))))
                try:
                    stage_num = int(extra["from_stage"])
                except (TypeError, ValueError):
                    stage_num = 0
                extra["role"] = "sender"
                extra["zmq_port"] = kv_zmq_port(base, stage_num, self.local_rank)
            elif self.config.need_recv_cache:
                extra["role"] = "receiver"
        return ConnectorSpec(name, extra)

    @property
    def connector(self) -> OmniConnectorBase | None:
        """The connector, created on first use; a failed creation is retried after a back-off."""
        if self._connector is not None:
            return self._connector
        with self._connector_lock:
            if self._connector is not None:
                return self._connector
            now = time.monotonic()
            if now < self._connector_retry_at:
                return None
            try:
                spec = self._connector_spec()
            except (TypeError, ValueError) as exc:
                self._note_connector_failure(f"bad connector config: {exc}", now)
                return None
            if spec is None:
                return None
            logger.info(
                "Initializing OmniConnector type=%s role=%s",
                spec.name,
                spec.extra.get("role", "-"),
            )
            try:
                self._connector = OmniConnectorFactory.create_connector(spec)
            except Exception as exc:  # any backend failure: record the cause, retry later
                self._note_connector_failure(f"{type(exc).__name__}: {exc}", now)
                return None
            self._connector_error = None
            return self._connector

    def _note_connector_failure(self, reason: str, now: float) -> None:
        self._connector_error = reason
        self._connector_retry_at = now + self.options.connector_retry_interval
        logger.error(
            "Connector creation failed (%s); retrying in %.1fs",
            reason,
            self.options.connector_retry_interval,
        )

    get_connector = property(lambda self: self.connector)

    @property
    def connector_error(self) -> str | None:
        """Why the last connector creation failed (``None`` after a success)."""
        return self._connector_error

    # -- send ---------------------------------------------------------------------------------
    def handle_finished_requests_kv_transfer(
        self,
        finished_reqs: dict[str, dict[str, Any]],
        kv_caches: list[LayerKV],
        block_size: int,
        cache_dtype: str,
        request_id_resolver: Callable[[str], str] | None = None,
    ) -> list[str]:
        """Extract and send the KV of finished requests; return the ids that were processed.

        As in the reference, every id is returned (its blocks may be freed); whether each one was
        sent is recorded: :meth:`get_send_result` and :attr:`last_send_results`.
        """
        if not finished_reqs:
            return []
        ids = list(finished_reqs)
        if not self.config.need_send_cache:
            return ids
        if self.connector is None:
            logger.warning("No connector available, skipping KV transfer but freeing resources")
            reason = f"no connector available ({self._connector_error or 'not configured'})"
            self._record_sends(
                [SendResult(rid, SendStatus.FAILED, rid, reason=reason) for rid in ids]
            )
            return ids
        results = [
            self._sender.send(
                rid, finished_reqs[rid], kv_caches, block_size, cache_dtype, request_id_resolver
            )
            for rid in ids
        ]
        self._record_sends(results)
        return ids

    def _record_sends(self, results: list[SendResult]) -> None:
        with self._results_lock:
            for r in results:
                self._send_results.record(r.request_id, r)
        for r in results:
            self.metrics.record("send", r.status.value, r.nbytes, r.timings_ms)
        self.last_send_results = results

    def get_send_result(self, request_id: str) -> SendResult | None:
        """The outcome of the latest send of ``request_id`` (``None`` if never handled)."""
        with self._results_lock:
            return self._send_results.get(request_id)

    # -- receive ------------------------------------------------------------------------------
    def update_sender_info(
        self, sender_info: dict[str, Any], sender_stage_id: str | int | None = None
    ) -> None:
        """Update receiver-side sender info before loading remote KV cache.

        Stores the sender's base (rank-0) endpoint; this rank's default port is offset by
        ``local_rank * 16`` and written into the connector config and the live connector.
        """
        if not self.config.need_recv_cache:
            return
        entry = _resolve_sender_info(sender_info, sender_stage_id, self.recv_stages[0])
        if entry is None or entry.get("host") is None:
            logger.warning("Invalid sender_info format: %r", sender_info)
            return
        try:
            base_port = int(entry.get("zmq_port", 0))
        except (TypeError, ValueError):
            logger.warning("Invalid sender_info port: %r", entry.get("zmq_port"))
            return
        host = str(entry["host"])
        self._sender_base_host = host
        self._sender_base_zmq_port = base_port
        port = rank_port(base_port, self.local_rank)
        if self.config.connector_config is not None:
            self.config.connector_config["sender_host"] = host
            self.config.connector_config["sender_zmq_port"] = port
        if self._connector is not None:
            self._connector.update_sender_info(host, port)
        logger.info(
            "Sender info: host=%s base_port=%d port=%d local_rank=%d",
            host,
            base_port,
            port,
            self.local_rank,
        )

    def _sender_endpoint(self) -> SenderEndpoint | None:
        if self._sender_base_host is None or self._sender_base_zmq_port is None:
            return None
        return self._sender_base_host, self._sender_base_zmq_port

    def receive_kv_cache_result(
        self,
        request_id: str,
        target_device: torch.device | None = None,
        *,
        sender_info: dict[str, Any] | None = None,
        deadline: float | None = None,
        abort: threading.Event | None = None,
    ) -> ReceiveResult:
        """The typed form of :meth:`receive_kv_cache_for_request` (never ``(None, 0)``).

        ``abort`` (used by the prefetch worker): once set, the receive stops between two short
        connector wait slices and returns ``CANCELLED``.
        """
        rid = str(request_id)
        cached = getattr(self._companions, "results", None)
        if cached is not None and rid in cached:
            result: ReceiveResult = cached.pop(rid)
            return result
        if not self.config.need_recv_cache:
            return ReceiveResult(rid, ReceiveStatus.SKIPPED, reason="need_recv_cache is false")
        if rid == DUMMY_REQUEST_ID:
            logger.info("Skipping KV receive for the warm-up request %s", rid)
            return ReceiveResult(rid, ReceiveStatus.SKIPPED, reason="warm-up request")
        if self.recv_stages[0] is None:
            logger.warning("recv_stages unset; cannot receive KV for %s", rid)
            return ReceiveResult(rid, ReceiveStatus.SKIPPED, reason="recv stages unset")
        if self.connector is None:
            logger.warning("No connector available for receiving KV of %s", rid)
            return self._record_recv(
                ReceiveResult(
                    rid,
                    ReceiveStatus.UNAVAILABLE,
                    reason=f"no connector ({self._connector_error or 'not configured'})",
                )
            )
        per_call = sender_info is not None
        endpoint: SenderEndpoint | None
        if per_call:
            entry = _resolve_sender_info(sender_info, None, self.recv_stages[0])
            try:
                endpoint = (str(entry["host"]), int(entry.get("zmq_port", 0))) if entry else None
            except (TypeError, ValueError):
                endpoint = None
            if endpoint is None:
                logger.error("Unresolvable sender_info for %s: %r", rid, sender_info)
                return self._record_recv(
                    ReceiveResult(rid, ReceiveStatus.UNAVAILABLE, reason="bad sender_info")
                )
        else:
            endpoint = self._sender_endpoint()
        if deadline is None:
            deadline = deadline_after(self.config.recv_timeout, "recv_timeout")
        result = self._receiver.receive(
            rid,
            deadline=deadline,
            sender=endpoint,
            per_call=per_call,
            target_device=target_device,
            abort=abort,
        )
        return self._record_recv(result)

    def _record_recv(self, result: ReceiveResult) -> ReceiveResult:
        # The record keeps the outcome, not the tensors: holding them would pin pool memory.
        with self._results_lock:
            self._recv_results.record(result.request_id, dataclasses.replace(result, data=None))
        self.metrics.record("recv", result.status.value, result.nbytes, result.timings_ms)
        return result

    def get_receive_result(self, request_id: str) -> ReceiveResult | None:
        """The latest receive outcome of ``request_id`` (status, reason, timings; no data)."""
        with self._results_lock:
            return self._recv_results.get(str(request_id))

    def receive_kv_cache_for_request(
        self,
        request_id: str,
        target_device: torch.device | None = None,
        *,
        sender_info: dict[str, Any] | None = None,
    ) -> tuple[dict[str, Any] | None, int]:
        """Receive KV cache for request_id; returns (data dict, size) or (None, 0).

        sender_info overrides instance _sender_base_* (per-call endpoint). Returns within
        ``recv_timeout`` (plus a small constant); why a miss happened is in
        :meth:`get_receive_result`. Raises ``KVPrefetchConsumeError`` only when the payload was
        consumed but could not be made usable.
        """
        result = self.receive_kv_cache_result(request_id, target_device, sender_info=sender_info)
        if result.ok and result.data is not None:
            return result.data, result.nbytes
        return None, 0

    def apply_kv_cache_to_request(self, req: Any, data: dict[str, Any]) -> None:
        """Set ``past_key_values`` and ``kv_metadata`` on the request and its sampling params."""
        apply_kv_cache_to_request(req, data)

    def receive_kv_cache(self, req: Any, target_device: torch.device | None = None) -> bool:
        """Receive and apply the primary KV of ``req``; True on success."""
        sender_info = getattr(req, "kv_sender_info", None)
        if sender_info:
            self.update_sender_info(sender_info, sender_stage_id=self.recv_stages[0])
        rid = request_id_of(req)
        if rid is None:
            logger.warning("Request without request_id; cannot receive KV")
            return False
        data, _size = self.receive_kv_cache_for_request(rid, target_device)
        if data:
            self.apply_kv_cache_to_request(req, data)
            return True
        return False

    def receive_multi_kv_cache(
        self,
        req: Any,
        cfg_kv_collect_func: Callable[..., Any] | None = None,
        target_device: torch.device | None = None,
    ) -> bool:
        """Receive primary KV cache and optional CFG companion KV caches.

        The primary and every companion named in ``sampling_params.cfg_kv_request_ids`` are
        fetched concurrently under one ``recv_timeout``; ``cfg_kv_collect_func(request_id,
        cfg_request_ids, manager, target_device)`` then finds its companions already received.
        Returns whether the primary KV was received.
        """
        sp = getattr(req, "sampling_params", None)
        cfg_ids = getattr(sp, "cfg_kv_request_ids", None) if sp is not None else None
        if not (cfg_ids and cfg_kv_collect_func is not None):
            return self.receive_kv_cache(req, target_device)
        sender_info = getattr(req, "kv_sender_info", None)
        if sender_info:
            self.update_sender_info(sender_info, sender_stage_id=self.recv_stages[0])
        rid = request_id_of(req)
        deadline = deadline_after(self.config.recv_timeout, "recv_timeout")
        companion_ids = [str(v) for v in dict(cfg_ids).values() if v]
        pool = self._executor()
        futures = {
            cid: pool.submit(self.receive_kv_cache_result, cid, target_device, deadline=deadline)
            for cid in companion_ids
        }
        primary_ok = False
        try:
            if rid is None:
                logger.warning("Request without request_id; cannot receive KV")
            else:
                primary = self.receive_kv_cache_result(rid, target_device, deadline=deadline)
                if primary.ok and primary.data:
                    self.apply_kv_cache_to_request(req, primary.data)
                    primary_ok = True
        finally:
            self._companions.results = {cid: f.result() for cid, f in futures.items()}
        try:
            collected = cfg_kv_collect_func(rid, cfg_ids, self, target_device)
        except Exception:
            logger.exception("CFG KV collection failed for %s", rid)
            collected = None
        finally:
            self._companions.results = None
        if isinstance(collected, Mapping) and sp is not None:
            for key, value in collected.items():
                setattr(sp, key, value)
            logger.debug("Applied CFG KV caches for %s: %s", rid, sorted(collected))
        return primary_ok

    def _executor(self) -> ThreadPoolExecutor:
        with self._connector_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="omnikv-recv")
            return self._pool

    # -- distribution (parallel.py) ---
    @property
    def topo_config(self) -> TopoConfig:
        """This rank's receive role and groups, built on first use (:meth:`rebuild_topo_config`
        after the parallel state changed)."""
        topo: TopoConfig | None = getattr(self, "_topo_config", None)
        if topo is None:
            topo = self.rebuild_topo_config()
        return topo

    def rebuild_topo_config(self) -> TopoConfig:
        """Re-snapshot the parallel context (called by the runner once its groups exist)."""
        ctx = self.parallel_context
        if not isinstance(ctx, ParallelContext):
            ctx = ParallelContext.default(self.local_rank, self.tp_topo.source_tp_size)
        active = self.tp_topo.source_tp_size > 1 or self.tp_topo.target_tp_size > 1
        topo = build_topo_config(ctx, tp_active=active)
        self._topo_config = topo
        return topo

    def _distribution_deadline(self) -> float:
        ctx = self.topo_config.context
        grace = ctx.grace_s if ctx is not None else 2.0
        return deadline_after(self.config.recv_timeout + grace, "recv_timeout")

    def distribute_kv_cache(
        self, req: Any, target_device: torch.device | None = None, *, received: bool = False
    ) -> dict[str, Any] | None:
        """Distribute the leader's KV to its followers; the payload this rank should apply.

        Called on every rank of the stage after the leader's receive (``received``: it got the
        KV). LOCAL → ``None``. Returns by the receive timeout plus a grace; a leader without KV
        makes every rank get ``None``. See :mod:`omnikv.distribution`.
        """
        return distribute(
            self.topo_config,
            req,
            received=received,
            deadline=self._distribution_deadline(),
            target_device=target_device,
        )

    def receive_multi_kv_cache_distributed(
        self,
        req: Any,
        cfg_kv_collect_func: Callable[..., Any] | None = None,
        target_device: torch.device | None = None,
    ) -> bool:
        """Fetch → distribute → apply; FOLLOWER skips fetch. True if this rank has the KV.

        Called on every rank. A receive that raises on the leader still enters distribution
        (then re-raises), so followers never block. Pure-TP ranks agree: all True or all False.
        """
        topo = self.topo_config
        deadline = self._distribution_deadline()
        received = False
        failure: BaseException | None = None
        if not topo.is_follower:
            try:
                received = self.receive_multi_kv_cache(req, cfg_kv_collect_func, target_device)
            except Exception as exc:
                failure = exc
        return self._share_outcome(
            req, received, failure, target_device, deadline, received_counts=False
        )

    def _share_outcome(
        self,
        req: Any,
        received: bool,
        failure: BaseException | None,
        target_device: torch.device | None,
        deadline: float | None,
        *,
        received_counts: bool,
    ) -> bool:
        """Tell the stage's other ranks how this rank's receive went; whether it has the KV.

        Called by :meth:`receive_multi_kv_cache_distributed` and
        :meth:`consume_and_distribute_kv_cache` on every rank after the (leader's) receive.
        Pure-TP ranks agree (all True or all False); other ranks enter distribution (LOCAL:
        ``None`` at once) and apply what they get. ``received_counts``: a leader that received
        reports True even when its followers got nothing. ``deadline`` bounds the TP agreement
        (``None``: the distribution deadline from now). Re-raises ``failure`` afterwards, so an
        error on the leader never strands its followers.
        """
        topo = self.topo_config
        if topo.is_local and topo.tp_active:
            if deadline is None:
                deadline = self._distribution_deadline()
            ok = tp_agree(topo, req, received, deadline)
        else:
            payload = self.distribute_kv_cache(req, target_device, received=received)
            if payload is not None:
                apply_request_kv_payload(req, payload, target_device)
            ok = payload is not None or (received and (received_counts or topo.is_local))
        if failure is not None:
            raise failure
        return ok

    # -- prefetch (prefetch.py) ---
    @property
    def prefetch_enabled(self) -> bool:
        """Async prefetch is on (resolved flag) and this stage receives KV."""
        return self._async_prefetch and bool(self.config.need_recv_cache)

    @property
    def prefetcher(self) -> KVPrefetcher | None:
        """The background prefetcher, once ``start_prefetch`` made it (tests, diagnostics)."""
        return self._prefetcher

    def _is_follower(self) -> bool:
        topo = getattr(self, "topo_config", None)
        return bool(getattr(topo, "is_follower", False))

    def _get_prefetcher(self) -> KVPrefetcher | None:
        with self._prefetch_lock:
            if self._prefetcher is None:
                self._prefetcher = KVPrefetcher(
                    self._prefetch_receive,
                    recv_timeout=self.config.recv_timeout,
                    min_free_mem_ratio=self.config.kv_prefetch_min_free_mem_ratio,
                )
            return None if self._prefetcher.closed else self._prefetcher

    def _prefetch_receive(
        self,
        request_id: str,
        target_device: torch.device | None,
        sender_info: dict[str, Any] | None,
        deadline: float,
        abort: threading.Event,
    ) -> ReceiveResult:
        if abort.is_set():
            return ReceiveResult(request_id, ReceiveStatus.CANCELLED, reason="prefetch shut down")
        return self.receive_kv_cache_result(
            request_id, target_device, sender_info=sender_info, deadline=deadline, abort=abort
        )

    def start_prefetch(
        self,
        kv_prefetch_jobs: dict[str, Any] | KVPrefetchJob | list[Any] | None,
        target_device: torch.device | None = None,
    ) -> None:
        """Kick off a background KV load (non-blocking). No-op unless prefetch enabled.

        Called by the runner after the current request's KV was consumed, so the next
        request's receive (and device copy) overlaps this forward. Accepts the reference's
        ``{"request_id", "kv_sender_info"}`` dict, a :class:`KVPrefetchJob`, or a list of them.
        No-op on FOLLOWER ranks, for jobs without ``request_id`` or ``kv_sender_info``, below the
        free-memory ratio, and after ``shutdown_prefetch``.
        """
        if not self.prefetch_enabled or not kv_prefetch_jobs or self._is_follower():
            return
        jobs = iter_prefetch_jobs(kv_prefetch_jobs)
        prefetcher = self._get_prefetcher() if jobs else None
        if prefetcher is None:
            return
        for job in jobs:
            prefetcher.start(job.request_id, job.kv_sender_info, target_device)

    def _consume_prefetched(
        self, req: Any, target_device: torch.device | None = None
    ) -> PrefetchConsume:
        rid = str(req) if isinstance(req, str) else request_id_of(req)
        prefetcher = self._prefetcher
        if rid is None or prefetcher is None:
            return PrefetchConsume(None)
        return prefetcher.consume(rid, target_device=target_device)

    def consume_prefetched_kv(self, req: Any) -> tuple[dict[str, Any] | None, int]:
        """Consume a prefetched KV payload; (None, 0) on miss/recoverable failure.

        Raises KVPrefetchConsumeError when consumed but post-get failed (no fallback).
        ``req`` is the request (or its id). Consume-once; waits at most the prefetch's receive
        deadline; other requests' finished prefetches are kept for their own consume.
        """
        out = self._consume_prefetched(req)
        if out.result is not None and out.result.ok and out.result.data is not None:
            return out.result.data, out.result.nbytes
        return None, 0

    consume_loaded_kv = consume_prefetched_kv

    def consume_and_distribute_kv_cache(
        self, req: Any, target_device: torch.device | None = None
    ) -> bool:
        """Consume prefetched KV → apply → distribute; sync-receive on miss.

        No retry on consume-error.
        Called by the runner on every rank. Distribution is always entered, also after a consume
        error or a failed receive, so followers never block; a leader without KV distributes
        ``None`` and its followers return False. Returns whether this rank ended up with KV.
        """
        follower = self._is_follower()
        received = False
        failure: BaseException | None = None
        try:
            if not follower:
                received = self._consume_or_receive(req, target_device)
        except Exception as exc:  # distribute first, then re-raise (below)
            failure = exc
        return self._share_outcome(
            req, received, failure, target_device, None, received_counts=True
        )

    def _consume_or_receive(self, req: Any, target_device: torch.device | None) -> bool:
        rid = request_id_of(req)
        out = PrefetchConsume(None)
        if self.prefetch_enabled:
            try:
                out = self._consume_prefetched(req, target_device)
            except KVPrefetchConsumeError as exc:
                logger.error("Prefetched KV of %s unusable; request cannot recover: %s", rid, exc)
                return False
            res = out.result
            if res is not None and res.ok and res.data is not None:
                self.apply_kv_cache_to_request(req, res.data)
                return True
            if not out.sync_retry:
                return False
        if rid is None:
            logger.warning("Request without request_id; cannot receive KV")
            return False
        logger.debug("No prefetched KV for %s; receiving synchronously", rid)
        sender_info = getattr(req, "kv_sender_info", None)
        if sender_info:
            self.update_sender_info(sender_info, sender_stage_id=self.recv_stages[0])
        try:
            result = self.receive_kv_cache_result(rid, target_device, deadline=out.retry_deadline)
        except KVPrefetchConsumeError as exc:
            logger.error("KV of %s consumed but unusable; request cannot recover: %s", rid, exc)
            return False
        if result.ok and result.data:
            self.apply_kv_cache_to_request(req, result.data)
            return True
        return False

    def shutdown_prefetch(self) -> None:
        """Cancel pending prefetches and stop the executor (call on teardown).

        Returns within the prefetcher's join bound (2 s) even when a background receive is stuck
        on a dead sender; afterwards no prefetch thread calls the connector. Idempotent.
        """
        with self._prefetch_lock:
            prefetcher = self._prefetcher
            if prefetcher is None:
                # Closed for good: a later start_prefetch makes no new worker.
                self._prefetcher = prefetcher = KVPrefetcher(
                    self._prefetch_receive, recv_timeout=self.config.recv_timeout
                )
        prefetcher.shutdown()

    # -- teardown -----------------------------------------------------------------------------
    def close(self) -> None:
        """Stop helper threads and close the connector. Idempotent."""
        self.shutdown_prefetch()
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        conn, self._connector = self._connector, None
        if conn is not None:
            conn.close()

    def __enter__(self) -> OmniKVTransferManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
