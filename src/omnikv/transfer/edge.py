"""The transfer edge: one object per stage edge that owns everything that moves KV across it.

:class:`TransferEdge` builds, at construction and never later, the sender
(:class:`~omnikv.transfer.send.KVSender`), the receiver
(:class:`~omnikv.transfer.receive.KVReceiver`), the streams of requests still decoding
(:class:`~omnikv.transfer.stream.sending.KVStreams`, with ``stream_kv``), the delivery book
(:class:`~omnikv.transfer.delivery.DeliveryBook`), the session guard
(:class:`~omnikv.transfer.sessions.SessionGuard`), the per-request outcome log
(:class:`~omnikv.transfer.log.TransferLog`) and the background receives: one
:class:`~omnikv.transfer.admission.KVAdmission` for the scheduler's ``offer`` / ``poll`` /
``take`` and the prefetcher built on the same state machine
(:class:`~omnikv.transfer.prefetch.KVPrefetcher`). Each object gets its collaborators here;
the background receives call the edge's own :meth:`TransferEdge.receive`.

Its calls are typed: :meth:`~TransferEdge.send` / :meth:`~TransferEdge.send_many` give a
:class:`~omnikv.transfer.results.SendResult` per request, :meth:`~TransferEdge.ship` a
:class:`~omnikv.transfer.results.StreamProgress`, :meth:`~TransferEdge.receive` a
:class:`~omnikv.transfer.results.ReceiveResult`, :meth:`~TransferEdge.probe` a
:class:`~omnikv.connectors.base.KeyProbe`. Nothing here raises for one request's failure.

Callers: the seed facade (:class:`~omnikv.manager.OmniKVTransferManager`, which translates the
seed API's shapes onto this), the vLLM connector's worker half, the Hugging Face adapter, the
benchmarks and the tests. A manager exposes its edge as ``manager.edge``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from omnikv.config import OmniKVCacheConfig, TransferOptions
from omnikv.connectors.base import KeyProbe, KeyState
from omnikv.connectors.factory import LazyConnector
from omnikv.deadline import deadline_after
from omnikv.metrics import TransferMetrics
from omnikv.topology.keys import TransferHooks
from omnikv.topology.placement import SenderEndpoint, StagePlacement, resolve_endpoint
from omnikv.transfer.admission import KVAdmission, RequestReadiness
from omnikv.transfer.delivery import DeliveryBook
from omnikv.transfer.log import TransferLog
from omnikv.transfer.prefetch import KVPrefetcher
from omnikv.transfer.receive import KVReceiver, ReceiveCallbacks
from omnikv.transfer.received import ReceivedChunk, ReceivedKV
from omnikv.transfer.results import ReceiveResult, SendResult, StreamProgress
from omnikv.transfer.send import KVSender
from omnikv.transfer.sessions import SessionGuard
from omnikv.transfer.stream.sending import KVStreams, Seal, ShippedChunk, StepListener

__all__ = ["DEFAULT_PROBE_TIMEOUT_S", "KVCaches", "TransferEdge"]

logger = logging.getLogger(__name__)

#: How long :meth:`TransferEdge.probe` may wait for its peers' answers, by default (seconds).
DEFAULT_PROBE_TIMEOUT_S = 0.25


@dataclass(frozen=True)
class KVCaches:
    """What a send reads a request's KV from: the paged cache's per-layer tensors
    (``layers``: a ``[2, num_blocks, block_size, heads, dim]`` tensor or a ``(K, V)`` pair per
    layer, ``None`` for a layer without KV), its ``block_size`` and ``cache_dtype`` (as the
    seed's ``handle_finished_requests_kv_transfer`` takes them; checked by the send, never
    coerced), and the optional ``resolver`` that maps a request id to the id its KV travels
    under. One value serves every request of a step."""

    layers: Sequence[Any]
    block_size: int
    cache_dtype: str
    resolver: Callable[[str], str] | None = None


class TransferEdge:
    """The transfer layer of one stage edge for one rank (see the module docstring).

    ``config`` and ``options`` are the stage's; ``placement`` says which edge it sends and
    receives on and its TP topology; ``connector`` is the stage's
    :class:`~omnikv.connectors.factory.LazyConnector` (made on first use). ``configured``:
    the stage sends or receives at all (else every result is ``not_configured``).
    ``async_prefetch`` turns the prefetcher on (for a stage that receives). ``on_verdict`` is
    told each send's result once the receiver's verdict decides it (``delivered``,
    ``refused``, ``expired``); ``on_stream_step`` each stream step's outcome (on the stream
    worker's thread: it must only note it). Thread-safe as its parts are: sends and stream
    steps from the model runner's thread, receives from any.
    """

    def __init__(
        self,
        config: OmniKVCacheConfig,
        *,
        options: TransferOptions,
        placement: StagePlacement,
        connector: LazyConnector,
        configured: bool = True,
        async_prefetch: bool = False,
        on_verdict: Callable[[SendResult], object] | None = None,
        on_stream_step: StepListener | None = None,
    ) -> None:
        self.config, self.options, self.placement = config, options, placement
        self.connector = connector
        sends, receives = bool(config.need_send_cache), bool(config.need_recv_cache)
        #: Counters and phase histograms: ``snapshot()``; exported by ``omnikv.metrics``.
        self.metrics = TransferMetrics()
        self._log = TransferLog(self.metrics)
        self._on_verdict = on_verdict
        self._deliveries = DeliveryBook(self._delivered, withdraw=self._withdraw)
        self._hooks = TransferHooks()
        self._sender = KVSender(
            stages=placement.send_stages,
            topology=placement.topology,
            options=options,
            connector=connector,
            deliveries=self._deliveries,
            enabled=sends,
            configured=configured,
        )
        self._receiver = KVReceiver(
            stages=placement.recv_stages,
            topology=placement.topology,
            options=options,
            connector=connector,
            guard=SessionGuard(self.metrics),
            enabled=receives,
            configured=configured,
        )
        # (a stage that only receives assembles streams in its receiver: no stream worker)
        self._streams = (
            KVStreams(self._sender, deliveries=self._deliveries, on_step=on_stream_step)
            if options.stream_kv and sends
            else None
        )
        self._prefetch_on = bool(async_prefetch) and receives
        self._prefetch = KVPrefetcher(self.receive, config=config)
        self._admission: KVAdmission | None = None
        self._admission_lock = threading.Lock()

    def _delivered(self, result: SendResult) -> None:
        """The delivery book decided a send's verdict: logged, then pushed to ``on_verdict``
        (on the connector's listener thread, or the sending thread when the verdict came
        before the send ended: it must only note it)."""
        self._log.delivered(result)
        if self._on_verdict is not None:
            self._on_verdict(result)

    def _withdraw(self, key: str) -> bool:
        """The delivery book takes back a key nobody took of a refused or expired send: the
        sending connector's ``withdraw`` on this edge's stages (any thread; the book catches
        and logs a failure)."""
        conn = self.connector.current
        from_stage, to_stage = self._sender.stages
        if conn is None or from_stage is None or to_stage is None:
            return False
        return conn.withdraw(from_stage, to_stage, key)

    # -- settings -----------------------------------------------------------------------------
    @property
    def hooks(self) -> TransferHooks:
        """The key builders, merger and slicer in use (the worker's hook slots)."""
        return self._hooks

    def set_hooks(self, hooks: TransferHooks) -> None:
        """Use ``hooks`` for every later send and receive."""
        self._hooks = hooks
        self._sender.set_hooks(hooks)
        self._receiver.set_hooks(hooks)

    @property
    def sender_endpoint(self) -> SenderEndpoint | None:
        """The sender stage's base ``(host, port)`` the receives use (:meth:`set_sender`)."""
        return self._receiver.sender

    def set_sender(self, endpoint: SenderEndpoint | None) -> None:
        """The sender stage's base endpoint for every receive without a per-call one."""
        self._receiver.set_sender(endpoint)

    # -- sending ------------------------------------------------------------------------------
    def send(
        self,
        request_id: str,
        entry: Mapping[str, Any],
        caches: KVCaches,
        *,
        deadline: float | None = None,
    ) -> SendResult:
        """Send one finished request's KV (``entry``: ``block_ids``, ``seq_len``, optional
        ``custom_metadata``, as a ``finished_reqs`` entry); its :class:`SendResult`
        (``sent``, later ``delivered`` / ``refused`` / ``expired`` with a connector that
        acknowledges: see :meth:`wait_delivered`). A streamed request sends its tail only.
        Every put shares ``deadline`` (default: ``send_timeout`` from now). Never raises for
        the request's failure."""
        return self.send_many({str(request_id): entry}, caches, deadline=deadline)[0]

    def send_many(
        self,
        entries: Mapping[str, Any],
        caches: KVCaches,
        *,
        deadline: float | None = None,
    ) -> list[SendResult]:
        """:meth:`send` of every entry of ``entries`` (request id -> entry), in order, under
        one ``deadline``; one result each, in order (also for a malformed ``entries``)."""
        if self._streams is not None:
            self._streams.drop_orphans()
        end = deadline if deadline is not None else deadline_after(self.options.send_timeout)
        results = self._sender.send_batch(
            entries,
            caches.layers,
            caches.block_size,
            caches.cache_dtype,
            caches.resolver,
            deadline=end,
            tails=self._streams,
        )
        if self._streams is not None:  # a failed finish drops what its stream had shipped
            for result in results:
                self._streams.settle(result)
        return self._log.sent(results)

    def ship(
        self,
        request_id: str,
        entry: Mapping[str, Any],
        caches: KVCaches,
        *,
        seal: Seal | None = None,
        layers: tuple[int, int] | None = None,
    ) -> StreamProgress:
        """Ship the full blocks of a request still decoding as one chunk (``stream_kv``; see
        :mod:`omnikv.transfer.stream.sending`): the step is handed to the stream worker and
        this returns at once (the copy, seal and put run behind it); never raises for the
        request's failure. ``seal`` puts each chunk's own metadata in its header; ``layers``
        (``(first, stop)``) ships one layer group. The caller keeps the request's blocks until
        its :meth:`send` or :meth:`abort_stream` returned. Without ``stream_kv``, or on a stage
        that does not send: nothing, and the progress says so."""
        rid = str(request_id)
        if self._streams is None:
            return StreamProgress(rid, reason=self._no_streams())
        args = (entry, caches.layers, caches.block_size, caches.cache_dtype, caches.resolver)
        return self._streams.ship(rid, *args, seal=seal, layers=layers)

    def wait_stream(self, request_id: str, timeout: float | None = None) -> StreamProgress:
        """Wait up to ``timeout`` s (``None``: no limit) until the stream steps of
        ``request_id`` handed over so far ran; its progress then (what they published, why
        not; ``pending`` > 0 at the timeout). Without ``stream_kv`` (or sends): at once, saying
        so."""
        rid = str(request_id)
        if self._streams is None:
            return StreamProgress(rid, reason=self._no_streams())
        return self._streams.wait(rid, timeout)

    def _no_streams(self) -> str:
        """Why this edge has no streams (for a stream call's progress)."""
        return "stream_kv is off" if not self.options.stream_kv else "this stage sends no KV"

    def wait_streams(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` s (``None``: no limit) until no stream step of any request
        is queued or running (True at once without ``stream_kv``); False at the timeout."""
        return True if self._streams is None else self._streams.wait_all(timeout)

    def shipped_chunks(self, request_id: str) -> list[ShippedChunk]:
        """The chunks ``request_id``'s open stream shipped, in order (what its finish's tail
        manifest will list: its steps still queued are dropped, the tail takes their blocks);
        empty without ``stream_kv`` or an open stream."""
        return [] if self._streams is None else self._streams.shipped_chunks(str(request_id))

    def abort_stream(self, request_id: str) -> int:
        """Drop what ``request_id``'s stream shipped (a request aborted or preempted before
        its finish): its queued steps are dropped, a running one waited for, its chunks leave
        the connector, nothing else does; its blocks are free to reuse once this returns. How
        many chunk keys went (0 without a stream)."""
        return 0 if self._streams is None else self._streams.abort(str(request_id))

    def send_result(self, request_id: str) -> SendResult | None:
        """The outcome of the latest send of ``request_id`` with its verdict so far (``None``:
        never sent, or forgotten)."""
        rid = str(request_id)
        return self._deliveries.result(rid) or self._log.sends.get(rid)

    def wait_delivered(self, request_id: str, timeout: float | None = None) -> SendResult | None:
        """Wait up to ``timeout`` s (``None``: no limit) until the send of ``request_id`` has
        its verdict; the result then (still ``sent`` at the timeout; as it stands, at once,
        when the connector does not acknowledge or nothing was published; ``None``: never
        sent)."""
        rid = str(request_id)
        watched = self._deliveries.wait(rid, timeout)
        return watched if watched is not None else self._log.sends.get(rid)

    @property
    def last_sends(self) -> list[SendResult]:
        """The results of the latest :meth:`send_many` (or :meth:`send`), in order."""
        return self._log.last_sends

    # -- receiving ----------------------------------------------------------------------------
    def receive(  # noqa: PLR0913 - the receive's options, each a keyword
        self,
        request_id: str,
        target_device: torch.device | None = None,
        *,
        sender_info: Mapping[str, Any] | None = None,
        deadline: float | None = None,
        abort: threading.Event | None = None,
        quiet: bool = False,
        on_arrival: Callable[[int], object] | None = None,
        check: Callable[[ReceivedKV], str | None] | None = None,
        on_chunk: Callable[[ReceivedChunk], str | None] | None = None,
    ) -> ReceiveResult:
        """Receive ``request_id``'s KV by ``deadline`` (default: ``recv_timeout`` from now)
        onto ``target_device`` (``None``: the host); its :class:`ReceiveResult` says why it
        returned. ``sender_info`` names the sender for this call only (else the edge's
        :meth:`set_sender` endpoint). ``abort`` ends the wait between connector waits;
        ``quiet`` logs a miss at DEBUG; ``on_arrival`` is told the bytes taken; ``check``
        refuses KV with a reason (sent back as the verdict); ``on_chunk`` takes a streamed
        send's chunks as they arrive (:class:`~omnikv.transfer.receive.ReceiveCallbacks`).
        Raises only ``KVPrefetchConsumeError`` (the payload was consumed and is unusable)."""
        per_call = sender_info is not None
        sender = self._endpoint(sender_info) if per_call else None
        end = deadline or deadline_after(self.config.recv_timeout, "recv_timeout")
        callbacks = (
            ReceiveCallbacks(on_arrival, check, on_chunk)
            if on_arrival or check or on_chunk
            else None
        )
        result = self._receiver.receive(
            str(request_id),
            deadline=end,
            sender=sender,
            per_call=per_call,
            target_device=target_device,
            abort=abort,
            quiet=quiet,
            callbacks=callbacks,
        )
        return self._log.received(result)

    def probe(
        self,
        request_id: str,
        *,
        sender_info: Mapping[str, Any] | None = None,
        timeout: float = DEFAULT_PROBE_TIMEOUT_S,
    ) -> KeyProbe:
        """Where ``request_id``'s KV stands for this rank, without receiving or claiming it
        (``ready`` / ``offered`` / ``missing`` / ``unknown``); takes at most ``timeout`` s,
        never raises."""
        per_call = sender_info is not None
        try:
            sender = self._endpoint(sender_info) if per_call else None
        except Exception as exc:  # client input: an unusable sender_info is an answer
            return KeyProbe(KeyState.UNKNOWN, detail=f"bad sender_info: {exc}")
        return self._receiver.probe(
            str(request_id),
            deadline=time.monotonic() + max(0.0, float(timeout)),
            sender=sender,
            per_call=per_call,
        )

    def receive_result(self, request_id: str) -> ReceiveResult | None:
        """The latest receive outcome of ``request_id`` (status, reason, timings; no KV)."""
        return self._log.receive_result(str(request_id))

    @contextlib.contextmanager
    def companions(
        self,
        request_ids: Iterable[str],
        *,
        deadline: float,
        target_device: torch.device | None = None,
    ) -> Iterator[None]:
        """Receive ``request_ids`` concurrently under one ``deadline`` on entry; inside, a
        :meth:`receive` of one of them returns its kept result at once; on exit, what nobody
        took is released (a request and its CFG companions)."""
        with self._receiver.companions(request_ids, deadline=deadline, target_device=target_device):
            yield

    def _endpoint(self, sender_info: Mapping[str, Any] | None) -> SenderEndpoint | None:
        return resolve_endpoint(dict(sender_info or {}), None, self.placement.recv_stages[0])

    # -- background receives --------------------------------------------------------------------
    @property
    def admission(self) -> KVAdmission:
        """Readiness without blocking for this edge's receives: ``offer`` queued requests,
        ``poll`` their states, ``take`` the ready ones (:mod:`omnikv.transfer.admission`).
        Made on first use with ``recv_timeout`` as each request's deadline; closed by
        :meth:`close`."""
        with self._admission_lock:
            if self._admission is None:
                self._admission = KVAdmission(
                    self.receive, recv_timeout=self.config.recv_timeout, probe=self.probe
                )
            return self._admission

    def offer(
        self,
        request_ids: str | Iterable[str],
        *,
        target_device: torch.device | None = None,
        sender_info: dict[str, Any] | None = None,
        timeout: float | None = None,
        companions: Mapping[str, Iterable[str]] | None = None,
    ) -> list[str]:
        """:meth:`KVAdmission.offer <omnikv.transfer.admission.KVAdmission.offer>`: start
        receiving each request in the background; never waits; the ids it started."""
        return self.admission.offer(
            request_ids,
            target_device=target_device,
            sender_info=sender_info,
            timeout=timeout,
            companions=companions,
        )

    def poll(self, request_ids: Iterable[str] | None = None) -> dict[str, RequestReadiness]:
        """The readiness of each offered request (or of those listed); never waits."""
        return self.admission.poll(request_ids)

    def take(self, request_id: str) -> ReceiveResult | None:
        """The outcome of an offered request that is ``ready`` or ``failed``, exactly once
        (``None`` while it is still ``missing`` or ``pending``)."""
        return self.admission.take(request_id)

    @property
    def prefetch_enabled(self) -> bool:
        """Async prefetch is on and this edge receives."""
        return self._prefetch_on

    @property
    def prefetcher(self) -> KVPrefetcher:
        """The prefetcher (a one-thread admission and its results); used only while
        :attr:`prefetch_enabled`."""
        return self._prefetch

    # -- teardown -------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the prefetcher and the admission, release what companion receives kept, and
        drop every open stream's chunks. Idempotent; the connector is its owner's to close."""
        self._prefetch.shutdown()
        with self._admission_lock:
            admission, self._admission = self._admission, None
        if admission is not None:
            admission.close()
        self._receiver.close()
        if self._streams is not None:
            self._streams.close()
