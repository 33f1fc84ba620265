"""``OmniKVTransferManager``: the seed API as a translation onto one
:class:`~omnikv.transfer.edge.TransferEdge` per stage edge (which owns the sender, receiver,
streams, delivery book, session guard, result log, admission and prefetch), plus the stage's
connector (:class:`~omnikv.connectors.factory.LazyConnector`) and its ranks (the leader ->
followers hand-off). Here only: the seed's names, its dicts and ``(None, 0)``, its hook slots,
its config factories and request objects. Nothing is handed down as a callback, and no
attribute of another object is set from here."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from threading import Event
from typing import Any

import torch

from omnikv import config as _config
from omnikv._logging import RateLimitedLog
from omnikv.config import OmniKVCacheConfig, TransferOptions
from omnikv.connectors.base import KeyProbe, OmniConnectorBase
from omnikv.connectors.factory import LazyConnector
from omnikv.deadline import deadline_after
from omnikv.errors import ConnectorError, KVPrefetchConsumeError
from omnikv.metrics import TransferMetrics
from omnikv.ranks.context import TopoConfig
from omnikv.ranks.discovery import discover_tp
from omnikv.ranks.distribution import StageRanks
from omnikv.topology.keys import TransferHooks
from omnikv.topology.placement import (
    RankInfo,
    SenderEndpoint,
    StagePlacement,
    rank_port,
    resolve_endpoint,
)
from omnikv.transfer import requests as _requests
from omnikv.transfer.admission import KVAdmission
from omnikv.transfer.edge import DEFAULT_PROBE_TIMEOUT_S, KVCaches, TransferEdge
from omnikv.transfer.prefetch import KVPrefetcher, KVPrefetchJob, PrefetchConsume
from omnikv.transfer.receive import DUMMY_REQUEST_ID
from omnikv.transfer.received import ReceivedChunk, ReceivedKV
from omnikv.transfer.requests import apply_received_kv, request_id_of
from omnikv.transfer.results import ReceiveResult, ReceiveStatus, SendResult, StreamProgress
from omnikv.transfer.stream.sending import Seal, ShippedChunk

__all__ = ["DEFAULT_SEND_TIMEOUT", "DUMMY_REQUEST_ID", "LayerKV", "OmniKVTransferManager"]

logger = logging.getLogger(__name__)
_outsider = RateLimitedLog(logger)  # lines a peer, client or forger can cause

LayerKV = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
DEFAULT_SEND_TIMEOUT = 30.0
_INERT = "omni_kv_config needs need_send_cache or need_recv_cache and a connector_config type"
_HOOKS = ("kv_send_key_builder", "kv_recv_key_builder", "kv_payload_merger", "kv_payload_slicer")


class _HookSlot:
    """One of the reference's hook slots on the manager (``kv_send_key_builder``, ...): a plain
    attribute to the worker that sets it (``None`` until set); setting one hands the edge the
    four slots as one :class:`TransferHooks` (:meth:`OmniKVTransferManager._hooks_changed`)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot = f"_{name}"

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        return self if obj is None else obj.__dict__.get(self.slot)

    def __set__(self, obj: OmniKVTransferManager, value: Any) -> None:
        obj.__dict__[self.slot] = value
        obj._hooks_changed()


class OmniKVTransferManager:
    """Unified management for OmniConnector and KV cache transfer, one per worker and stage.

    Hook slots (``kv_send_key_builder``, ``kv_recv_key_builder``, ``kv_payload_merger``,
    ``kv_payload_slicer``) take the reference's signatures (:class:`TransferHooks`).
    A manager that will neither send nor receive warns once (only an INFO line when it was given a
    ``parallel_context``: it distributes among ranks); its results are ``not_configured``.
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
        self.config, self.options = config, options or TransferOptions()
        self.parallel_context = parallel_context
        # Without an injected context: the host framework's TP group, else LOCAL_RANK.
        rank_info = parallel_context if parallel_context is not None else discover_tp()
        place = StagePlacement.of(config, rank_info)
        self.send_stages, self.recv_stages = place.send_stages, place.recv_stages
        self.tp_topo, self.local_rank = place.topology, place.topology.local_rank
        retry = self.options.connector_retry_interval
        lazy = self._lazy = LazyConnector.for_stage(
            config, self.local_rank, retry_interval=retry, connector=connector
        )
        has_conn = connector is not None or bool((config.connector_config or {}).get("type"))
        sends, receives = bool(config.need_send_cache), bool(config.need_recv_cache)
        ok = self.configured = has_conn and (sends or receives)
        #: The typed transfer layer of this stage edge (send / ship / receive / probe / offer,
        #: poll, take); every seed call below is a translation onto it.
        self.edge = TransferEdge(
            config,
            options=self.options,
            placement=place,
            connector=lazy,
            configured=ok,
            async_prefetch=async_prefetch,
        )
        #: Counters and phase histograms: `snapshot()`; exported by `omnikv.metrics.register()`.
        self.metrics: TransferMetrics = self.edge.metrics
        self._ranks = StageRanks(parallel_context, self.tp_topo, config)
        if not ok and parallel_context is not None:
            # a rank given a parallel context still distributes KV among its ranks
            logger.info("OmniKVTransferManager only distributes among ranks: %s", _INERT)
        elif not ok:
            logger.warning("OmniKVTransferManager will neither send nor receive: %s", _INERT)
        elif sends and connector is None and self.connector is not None:
            logger.info("Sender connector eagerly initialized")
        if ok:
            _warn_unset_stages(
                self.send_stages if sends else None, self.recv_stages if receives else None
            )

    kv_send_key_builder = _HookSlot()
    kv_recv_key_builder = _HookSlot()
    kv_payload_merger = _HookSlot()
    kv_payload_slicer = _HookSlot()

    def _hooks_changed(self) -> None:
        """A hook slot was set: the edge uses the four slots as one value from now on."""
        self.edge.set_hooks(TransferHooks.of(*(getattr(self, n) for n in _HOOKS)))

    @classmethod
    def _create(
        cls,
        kv_config: Mapping[str, Any] | None,
        *,
        async_prefetch: bool = False,
        connector: OmniConnectorBase | None = None,
        parallel_context: RankInfo | None = None,
        kv_cache_layout: str | None = None,
    ) -> OmniKVTransferManager:
        config = _config.config_from_dict(kv_config, async_prefetch=async_prefetch)
        options = _config.options_from_dict(kv_config)
        if kv_cache_layout is not None:  # the engine's, for a stage that declares none
            options = dataclasses.replace(options, kv_cache_layout=kv_cache_layout)
        return cls(
            config,
            async_prefetch=async_prefetch,
            options=options,
            connector=connector,
            parallel_context=parallel_context,
        )

    @classmethod
    def from_config(
        cls,
        omni_kv_config: Mapping[str, Any],
        *,
        connector: OmniConnectorBase | None = None,
        parallel_context: RankInfo | None = None,
    ) -> OmniKVTransferManager:
        """Create from the stage's ``omni_kv_config`` mapping itself, checked strictly: an unknown
        key or bad value is a ConfigError naming it (:func:`omnikv.config.check_omni_kv_config`).
        Prefetch follows ``enable_kv_async_prefetch`` (no CFG companion collector);
        ``connector`` / ``parallel_context`` go to the constructor."""
        kv = _config.check_omni_kv_config(omni_kv_config, where="from_config")
        flag = _config.resolve_async_prefetch(kv, has_companion=False)
        manager = cls._create(
            kv, async_prefetch=flag, connector=connector, parallel_context=parallel_context
        )
        manager._require_connector()
        return manager

    def _require_connector(self) -> None:
        """The strict factories' set-up check: a configured manager creates its connector now
        (a receiver too), and a failure closes it and raises the error naming the config key
        (:func:`omnikv.connectors.failures.setup_error`)."""
        if not self.configured or self.connector is not None:
            return
        failure = self._lazy.failure
        self.close()
        if failure is not None:
            raise failure
        raise ConnectorError(f"connector_config: no connector was created ({self._lazy.error})")

    def health(self) -> dict[str, Any]:
        """How this manager stands, for a readiness probe: ``status`` (``"ok"``: its connector
        exists; ``"pending"``: configured, connector not created yet (a lazy receiver);
        ``"unavailable"``: its creation failed, ``error`` says why, naming the config key;
        ``"not_configured"``: it neither sends nor receives), ``sends``, ``receives``, and
        ``connector`` (the connector's own ``health()``) when one exists. Never creates the
        connector, never raises."""
        conn = self._lazy.current
        error = self._lazy.error
        if not self.configured:
            status = "not_configured"
        elif conn is not None:
            status = "ok"
        else:
            status = "unavailable" if error else "pending"
        out: dict[str, Any] = {
            "status": status,
            "sends": bool(self.config.need_send_cache),
            "receives": bool(self.config.need_recv_cache),
            "error": None if conn is not None else error,
        }
        if conn is not None:
            try:
                out["connector"] = conn.health()
            except Exception as exc:  # a connector's report is diagnostics: never fatal here
                out["connector"] = {"status": "error", "error": f"{type(exc).__name__}: {exc}"}
        return out

    @classmethod
    def from_config_file(
        cls,
        path: str | os.PathLike[str],
        *,
        key: str | None = None,
        connector: OmniConnectorBase | None = None,
        parallel_context: RankInfo | None = None,
    ) -> OmniKVTransferManager:
        """:meth:`from_config` of the ``omni_kv_config`` in a JSON, YAML or TOML file.

        The keys sit at the file's top level or under ``omni_kv_config``; ``key`` (dotted) picks
        another place. Same strict checks, each error naming the file
        (:func:`omnikv.config.load_config_file`; YAML needs PyYAML and says so).
        """
        kv = _config.load_config_file(path, key=key)
        return cls.from_config(kv, connector=connector, parallel_context=parallel_context)

    @classmethod
    def from_od_config(cls, config: Any) -> OmniKVTransferManager:
        """Create from model or OmniDiffusion config (reads ``config.omni_kv_config``).

        ``config`` may also be a mapping: one with an ``omni_kv_config`` key is read like the
        object (``cfg_kv_collect_func`` too); any other mapping is the ``omni_kv_config`` itself
        and is checked as :meth:`from_config` checks it. An ``omni_kv_config`` that is neither a
        mapping nor ``None`` is a :class:`~omnikv.errors.ConfigError` saying what was expected.
        """
        if isinstance(config, Mapping) and "omni_kv_config" not in config:
            return cls.from_config(config)
        omni_kv, has_companion = _config.od_config_parts(config)
        flag = _config.resolve_async_prefetch(omni_kv, has_companion=has_companion)
        return cls._create(omni_kv, async_prefetch=flag)

    from_model_config = from_od_config

    @classmethod
    def from_vllm_config(cls, vllm_config: Any, model_config: Any) -> OmniKVTransferManager:
        """Create from vllm config with fallback to kv_transfer_config.

        Prefers ``model_config.omni_kv_config``, then the ``omni_connector_config`` of
        ``vllm_config.kv_transfer_config`` (its attribute, else its
        ``kv_connector_extra_config`` entry). Either argument may be a mapping with the same
        keys; an ``omni_kv_config`` that is neither a mapping nor ``None`` is a
        :class:`~omnikv.errors.ConfigError` saying what was expected. A stage that declares no
        ``kv_cache_layout`` reads its caches in the layout of the engine's attention backend
        (:func:`omnikv.config.vllm_cache_layout`).
        """
        kv = _config.vllm_config_parts(vllm_config, model_config)
        return cls._create(kv, kv_cache_layout=_config.vllm_cache_layout(vllm_config, kv))

    @property
    def connector(self) -> OmniConnectorBase | None:
        """The connector, created on first use; a failed creation is retried after a back-off."""
        return self._lazy.get()

    @property
    def get_connector(self) -> OmniConnectorBase | None:
        """:attr:`connector` under the reference's name (read as an attribute, not called)."""
        return self.connector

    @property
    def _connector(self) -> OmniConnectorBase | None:  # the reference's slot, kept assignable
        return self._lazy.current

    @_connector.setter
    def _connector(self, connector: OmniConnectorBase | None) -> None:
        self._lazy.set(connector)

    @property
    def connector_error(self) -> str | None:
        """Why the last connector creation failed (``None`` after a success)."""
        return self._lazy.error

    def flush(self, timeout: float | None = None) -> list[str]:
        """Wait up to ``timeout`` s for receivers to take what was sent; the keys left over."""
        connector = self._lazy.current
        return [] if connector is None else list(connector.flush(timeout))

    def handle_finished_requests_kv_transfer(
        self,
        finished_reqs: dict[str, dict[str, Any]],
        kv_caches: Sequence[LayerKV],
        block_size: int,
        cache_dtype: str,
        request_id_resolver: Callable[[str], str] | None = None,
    ) -> list[str]:
        """Send finished requests' KV, all puts under one ``send_timeout``; return every id."""
        if not finished_reqs:
            return []
        deadline = deadline_after(self.options.send_timeout, "send_timeout")
        caches = KVCaches(kv_caches, block_size, cache_dtype, request_id_resolver)
        self.edge.send_many(finished_reqs, caches, deadline=deadline)
        return list(finished_reqs)

    @property
    def last_send_results(self) -> list[SendResult]:
        """The results of the latest ``handle_finished_requests_kv_transfer`` call, in order."""
        return self.edge.last_sends

    def stream_kv_blocks(
        self,
        request_id: str,
        entry: Mapping[str, Any],
        kv_caches: Sequence[LayerKV],
        block_size: int,
        cache_dtype: str,
        request_id_resolver: Callable[[str], str] | None = None,
        *,
        seal: Seal | None = None,
        layers: tuple[int, int] | None = None,
    ) -> StreamProgress:
        """Ship the full blocks of a request still decoding (``stream_kv``); called by the model
        runner once per step per request, or from its per-step hook.

        ``entry`` is shaped like a ``finished_reqs`` entry (``block_ids``, ``seq_len``: the
        tokens whose KV is written). The blocks not shipped yet go as one chunk; the finish
        (:meth:`handle_finished_requests_kv_transfer`) then sends only the rest and the
        metadata. The step is handed to the stream's worker thread and this returns at once,
        whatever the prompt's size: the worker copies the blocks out of ``kv_caches``, seals,
        codes and puts them (one put attempt, at most
        :data:`omnikv.transfer.stream.STEP_PUT_S`), in order. Never raises for the request's
        failure: the returned progress says what earlier steps published, why not, and how
        many steps are still pending (:meth:`wait_kv_stream` waits for them). At most
        :data:`omnikv.transfer.stream.sending.DEFAULT_MAX_QUEUED` steps wait at once; a step beyond
        is refused (``reason`` says back-pressure) and its blocks go with a later step or
        the tail. A no-op without ``stream_kv``.

        What the caller may do after it returns: write new tokens into the request's blocks
        that are not full yet, and run further steps. What it may not do: change a full
        block (true of a paged cache: a full block is never written again while its request
        runs), or free or reuse the request's blocks before the finish
        (:meth:`handle_finished_requests_kv_transfer`) or :meth:`abort_kv_stream` returned
        (each drops the request's queued steps and waits for one running, so the blocks are
        no longer read).

        ``seal`` (optional): called, on the worker, with each chunk's token range and block
        ids; what it returns travels in that chunk's header metadata
        (:class:`~omnikv.transfer.stream.Seal`).

        ``layers`` (optional, ``(first, stop)``): ship only those layers of the newly full
        blocks, as soon as the forward pass has written them (``kv_caches`` still names every
        layer); call it for each layer group in order, the range counting as shipped once its
        last layer group is. A receiver assembles exactly what a whole send gives.
        """
        caches = KVCaches(kv_caches, block_size, cache_dtype, request_id_resolver)
        return self.edge.ship(request_id, entry, caches, seal=seal, layers=layers)

    def wait_kv_stream(self, request_id: str, timeout: float | None = None) -> StreamProgress:
        """Wait up to ``timeout`` s (``None``: no limit) until the :meth:`stream_kv_blocks`
        steps of ``request_id`` handed over so far ran; the request's progress then (what
        they published since the last progress, the latest reason nothing went, ``pending``
        > 0 at the timeout). Not needed before the finish or an abort, which settle the
        request's steps themselves."""
        return self.edge.wait_stream(request_id, timeout)

    def kv_stream_chunks(self, request_id: str) -> list[ShippedChunk]:
        """The chunks ``request_id``'s stream has shipped so far, in order: each one's token
        range ``[start, stop)``, the metadata its ``seal`` returned (``{}`` without one) and
        its layers (``None``: every layer); empty without ``stream_kv`` or an open stream. A
        finish that vouches for each chunk (the vLLM connector lists their MACs in the tail's
        metadata) reads them here, so that what it vouches for is what the tail's manifest
        lists."""
        return self.edge.shipped_chunks(request_id)

    def abort_kv_stream(self, request_id: str) -> int:
        """Drop what ``request_id``'s stream shipped (a request aborted or preempted before it
        finished; call it wherever the runner frees such a request): the chunks leave the
        connector. Returns how many chunk keys were dropped (0 without a stream)."""
        return self.edge.abort_stream(request_id)

    def get_send_result(self, request_id: str) -> SendResult | None:
        """The outcome of the latest send of ``request_id`` (``None`` if never handled); with a
        connector that acknowledges, ``sent`` turns into ``delivered`` / ``refused`` /
        ``expired`` when the receiver's verdict (or the TTL) says so."""
        return self.edge.send_result(request_id)

    def wait_delivered(self, request_id: str, timeout: float | None = None) -> SendResult | None:
        """Wait up to ``timeout`` s (``None``: no limit) until the send of ``request_id`` has its
        verdict: ``delivered``, ``refused`` (with the receiver's reason) or ``expired``.

        Returns the send result then; still ``sent`` when the timeout passed first; the result
        as it stands (never waiting) when the connector does not acknowledge or the send did
        not publish; ``None`` when ``request_id`` was never sent. Every published payload gets
        its verdict by the connector's TTL (``buffer_ttl_seconds``) at the latest.
        """
        return self.edge.wait_delivered(request_id, timeout)

    def update_sender_info(
        self, sender_info: dict[str, Any], sender_stage_id: str | int | None = None
    ) -> None:
        """Store the sender's base (rank-0) endpoint; this rank's port goes to the connector."""
        if not self.config.need_recv_cache:
            return
        endpoint = resolve_endpoint(sender_info, sender_stage_id, self.recv_stages[0])
        if endpoint is None or endpoint == self.edge.sender_endpoint:  # unchanged: nothing to do
            if endpoint is None:
                _outsider.warning("Invalid sender_info format: %r", sender_info)
            return
        (host, base), port = endpoint, rank_port(endpoint[1], self.local_rank)
        self.edge.set_sender(endpoint)
        if self.config.connector_config is not None:
            self.config.connector_config.update(sender_host=host, sender_zmq_port=port)
        if self._lazy.current is not None:
            self._lazy.current.update_sender_info(host, port)
        logger.info("Sender info: host=%s base_port=%d port=%d", host, base, port)

    def get_sender_connection_info(self) -> dict[str, Any] | None:
        """What a receiving stage passes to :meth:`update_sender_info` to reach this sender (the
        reference's 0.30 name, kept for its callers): the connector's ``get_connection_info()``
        (pull transports: ``host``, ``zmq_port``, ...); ``None`` for a stage that does not send,
        without a connector, or over a transport with no endpoint to share."""
        if not self.config.need_send_cache:
            return None
        connector = self.connector
        return None if connector is None else connector.get_connection_info()

    @property
    def sender_endpoint(self) -> SenderEndpoint | None:
        """The sender's base ``(host, port)`` set by :meth:`update_sender_info`, if any."""
        return self.edge.sender_endpoint

    def receive_kv_cache_result(  # noqa: PLR0913 - the receive's options, each a keyword
        self,
        request_id: str,
        target_device: torch.device | None = None,
        *,
        sender_info: dict[str, Any] | None = None,
        deadline: float | None = None,
        abort: Event | None = None,
        quiet: bool = False,
        on_arrival: Callable[[int], object] | None = None,
        check: Callable[[ReceivedKV], str | None] | None = None,
        on_chunk: Callable[[ReceivedChunk], str | None] | None = None,
    ) -> ReceiveResult:
        """:meth:`receive_kv_cache_for_request` as a ReceiveResult
        (:meth:`TransferEdge.receive <omnikv.transfer.edge.TransferEdge.receive>`).

        ``check`` (optional) is run on the received KV before it is accepted: a returned reason
        makes the result ``refused`` and is sent back to the sender as its verdict.
        ``on_chunk`` (optional, a request received under one key): each chunk of a streamed
        send is handed to it in order as it arrives (:class:`ReceivedChunk`); the KV returned
        then holds only the tokens after them (``kv.token_offset``). A reason refuses the
        receive as ``check``'s does."""
        return self.edge.receive(
            request_id,
            target_device,
            sender_info=sender_info,
            deadline=deadline,
            abort=abort,
            quiet=quiet,
            on_arrival=on_arrival,
            check=check,
            on_chunk=on_chunk,
        )

    def probe_kv_cache(
        self,
        request_id: str,
        *,
        sender_info: dict[str, Any] | None = None,
        timeout: float = DEFAULT_PROBE_TIMEOUT_S,
    ) -> KeyProbe:
        """Where ``request_id``'s KV stands for this rank, without receiving or claiming it:
        ``ready`` (in memory of this node: taking it is local), ``offered`` (a sender holds
        it: taking it moves ``nbytes`` over the link), ``missing`` (nobody offers it yet) or
        ``unknown`` (the transport cannot tell, or a peer did not answer within ``timeout``
        seconds). A scheduler asks it to order or bound its receives (offer to
        :attr:`admission` the requests whose KV is there); the answer is a snapshot. Takes at
        most ``timeout`` (transports that ask their peers), never raises."""
        return self.edge.probe(request_id, sender_info=sender_info, timeout=timeout)

    def get_receive_result(self, request_id: str) -> ReceiveResult | None:
        """The latest receive outcome of ``request_id`` (status, reason, timings; no data)."""
        return self.edge.receive_result(request_id)

    def receive_kv_cache_for_request(
        self,
        request_id: str,
        target_device: torch.device | None = None,
        *,
        sender_info: dict[str, Any] | None = None,
    ) -> tuple[dict[str, Any] | None, int]:
        """Receive KV cache for request_id; returns (data dict, size) or (None, 0)."""
        kv = self.receive_kv_cache_result(request_id, target_device, sender_info=sender_info).kv
        return (kv.to_dict(), kv.nbytes) if kv is not None else (None, 0)

    def apply_kv_cache_to_request(self, req: Any, data: dict[str, Any]) -> None:
        """Set ``past_key_values`` and ``kv_metadata`` on the request and its sampling params."""
        _requests.apply_kv_cache_to_request(req, data)

    def _take_sender_info(self, req: Any) -> None:
        info = getattr(req, "kv_sender_info", None)
        if info:
            self.update_sender_info(info, sender_stage_id=self.recv_stages[0])

    def _receive_result(self, req: Any, device: Any, deadline: float | None) -> ReceiveResult:
        self._take_sender_info(req)
        rid = request_id_of(req)
        if rid is None:
            logger.warning("Request without request_id; cannot receive KV")
            return ReceiveResult("", ReceiveStatus.SKIPPED, reason="request without request_id")
        return self.receive_kv_cache_result(rid, device, deadline=deadline)

    def _receive_into(self, req: Any, device: Any, deadline: float | None = None) -> bool:
        kv = self._receive_result(req, device, deadline).kv
        if kv is not None:
            apply_received_kv(req, kv)
        return kv is not None

    def receive_kv_cache(self, req: Any, target_device: torch.device | None = None) -> bool:
        """Receive and apply the primary KV of ``req``; True on success."""
        return self._receive_into(req, target_device)

    def receive_multi_kv_cache(
        self,
        req: Any,
        cfg_kv_collect_func: Callable[..., Any] | None = None,
        target_device: torch.device | None = None,
    ) -> bool:
        """Receive primary and CFG companion KV at once (one recv_timeout); True if primary came."""
        companions = list(_requests.cfg_companion_ids(req).values())
        if not companions or cfg_kv_collect_func is None:
            return self.receive_kv_cache(req, target_device)
        self._take_sender_info(req)  # the companions use it too
        ids = [i for i in (request_id_of(req), *companions) if i is not None]
        deadline = deadline_after(self.config.recv_timeout, "recv_timeout")
        with self.edge.companions(ids, deadline=deadline, target_device=target_device):
            ok = self._receive_into(req, target_device, deadline)
            _requests.collect_cfg_companions(req, cfg_kv_collect_func, self, target_device)
        return ok

    @property
    def topo_config(self) -> TopoConfig:
        """This rank's receive role and groups, built on first use."""
        return self._ranks.topo

    def rebuild_topo_config(self) -> TopoConfig:
        """Re-snapshot the parallel context (called by the runner once its groups exist)."""
        return self._ranks.rebuild()

    def distribute_kv_cache(
        self, req: Any, target_device: torch.device | str | None = None, *, received: bool = False
    ) -> dict[str, Any] | None:
        """Distribute KV LEADER -> FOLLOWER; the payload this rank should apply (LOCAL: None).

        Without ``target_device`` the payload is placed on the host, as in the reference.
        """
        return self._ranks.distribute(req, target_device, received=received)

    def receive_multi_kv_cache_distributed(
        self,
        req: Any,
        cfg_kv_collect_func: Callable[..., Any] | None = None,
        target_device: torch.device | None = None,
    ) -> bool:
        """Fetch -> distribute -> apply; FOLLOWER skips fetch. True if this rank has the KV."""
        with self._ranks.receiving(req, target_device, received_counts=False) as rank:
            if rank.fetches:
                rank.received = self.receive_multi_kv_cache(req, cfg_kv_collect_func, target_device)
        return rank.has_kv

    def consume_and_distribute_kv_cache(
        self, req: Any, target_device: torch.device | None = None
    ) -> bool:
        """Consume prefetched KV -> apply -> distribute; sync-receive on miss (not on an error)."""
        with self._ranks.receiving(req, target_device, received_counts=True) as rank:
            if rank.fetches:
                rank.received = self._consume_or_receive(req, target_device)
        return rank.has_kv

    def _consume_or_receive(self, req: Any, device: torch.device | None) -> bool:
        """Apply the prefetched KV of ``req``, else receive it now; whether KV was applied.

        The synchronous receive gets what is left of a timed-out prefetch's deadline (else a
        fresh ``recv_timeout``). A consume error (payload consumed, unusable) is final.
        """
        rid = request_id_of(req)
        found = PrefetchConsume(None)
        if self.prefetch_enabled and rid is not None:
            try:
                found = self.edge.prefetcher.consume(rid, target_device=device)
            except KVPrefetchConsumeError as exc:
                logger.error("Prefetched KV of %s unusable; request cannot recover: %s", rid, exc)
                return False
        result = found.result
        if (result is None or not result.ok) and found.sync_retry:
            logger.debug("No prefetched KV for %s; receiving synchronously", rid)
            try:
                result = self._receive_result(req, device, found.retry_deadline)
            except KVPrefetchConsumeError as exc:
                logger.error("KV of %s consumed but unusable; request cannot recover: %s", rid, exc)
                return False
        kv = result.kv if result is not None and result.ok else None
        if kv is not None:
            apply_received_kv(req, kv)
        return kv is not None

    @property
    def admission(self) -> KVAdmission:
        """Readiness without blocking for this stage's receives (:mod:`omnikv.transfer.admission`):
        ``offer`` queued requests, ``poll`` their states, ``take`` the ready ones. Made on first
        use, with ``recv_timeout`` as each request's deadline; closed by :meth:`close`."""
        return self.edge.admission

    @property
    def prefetch_enabled(self) -> bool:
        """Async prefetch is on (resolved flag) and this stage receives KV."""
        return self.edge.prefetch_enabled

    @property
    def prefetcher(self) -> KVPrefetcher | None:
        """The background prefetcher while prefetch is on (tests, diagnostics); ``None`` when off.

        Its worker thread starts with the first prefetch.
        """
        return self.edge.prefetcher if self.edge.prefetch_enabled else None

    def start_prefetch(
        self,
        kv_prefetch_jobs: dict[str, Any] | KVPrefetchJob | list[Any] | None,
        target_device: torch.device | None = None,
    ) -> None:
        """Kick off a background KV load (non-blocking). No-op unless enabled, or on FOLLOWERs
        (unless every rank reads the KV itself: ``shared_readers``)."""
        fetches = not self.topo_config.is_follower or self._ranks.reads_shared()
        if self.prefetch_enabled and kv_prefetch_jobs and fetches:
            self.edge.prefetcher.start_jobs(kv_prefetch_jobs, target_device)

    def consume_prefetched_kv(self, req: Any) -> tuple[dict[str, Any] | None, int]:
        """Consume a prefetched KV; (None, 0) on miss; KVPrefetchConsumeError when unusable."""
        rid = request_id_of(req)
        kv = self.edge.prefetcher.consume_kv(rid) if rid is not None else None
        return (kv.to_dict(), kv.nbytes) if kv is not None else (None, 0)

    consume_loaded_kv = consume_prefetched_kv

    def wait_prefetch(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` s (``None``: no limit) until no prefetch is queued or running.

        Called by the runner before it pauses the worker or frees device memory. True when idle
        (also when prefetch is off), False at the timeout; prefetched results stay for
        ``consume_*``. A negative or NaN ``timeout`` is a ``ValueError``.
        """
        return self.edge.prefetcher.wait_idle(deadline_after(timeout, "timeout"))

    def shutdown_prefetch(self) -> None:
        """Cancel pending prefetches and stop the executor (call on teardown). Idempotent."""
        self.edge.prefetcher.shutdown()

    def close(self) -> None:
        """Drain prefetch, close the connector if one was made, and make none later (teardown).

        Idempotent, also for a manager that never made a connector.
        """
        self.edge.close()
        self._lazy.close(final=True)

    def __enter__(self) -> OmniKVTransferManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _warn_unset_stages(
    send: tuple[str | None, str | None] | None, recv: tuple[str | None, str | None] | None
) -> None:
    """One WARNING at construction per direction whose edge is unknown (else every request of
    that direction would be skipped): it names the keys that set the edge."""
    if send is not None and None in send:
        logger.warning(
            "OmniKVTransferManager sends KV but its edge is unset: set omni_from_stage and "
            "omni_to_stage in omni_kv_config; until then every send is skipped"
        )
    if recv is not None and None in recv:
        logger.warning(
            "OmniKVTransferManager receives KV but its edge is unset: set stage_id and "
            "engine_input_source (or omni_from_stage) in omni_kv_config; until then every "
            "receive is skipped"
        )
