"""Receive path: keys -> wait with a deadline -> decode -> merge/slice -> optional device copy.

Called by the transfer edge (its ``receive``, behind the manager's
``receive_kv_cache_for_request`` and everything built on it), possibly from several threads at
once (CFG companions, prefetch). Two forms:

* :meth:`KVReceiver.fetch` raises: :class:`~omnikv.errors.ReceiveTimeout` (nothing arrived by
  the deadline), :class:`~omnikv.errors.DecodeError` (corrupt payload),
  :class:`~omnikv.errors.ConnectorError` subclasses (transport), ``ReceiveCancelled`` (the
  caller's abort event), :class:`~omnikv.errors.KVPrefetchConsumeError` (consumed, unusable);
* :meth:`KVReceiver.receive` is built on it and never raises for a miss: it returns a
  :class:`ReceiveResult` whose status says why (ok, timeout, corrupt, unavailable, peer_gone,
  cancelled, skipped). ``KVPrefetchConsumeError`` still propagates: the payload was consumed,
  so retrying is pointless.

CFG companions: :meth:`KVReceiver.receive_companions` receives several request ids concurrently
under one deadline and keeps the results; a later :meth:`KVReceiver.receive` of one of those ids
(the collector calling back into the manager) takes its result at once, consume-once.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from omnikv._logging import RateLimitedLog
from omnikv.config import TransferOptions
from omnikv.connectors.base import (
    KeyProbe,
    KeyState,
    ManagedBuffer,
    OmniConnectorBase,
    get_result,
)
from omnikv.connectors.delivery import Verdict
from omnikv.connectors.factory import LazyConnector
from omnikv.errors import (
    ConnectorError,
    ConnectorUnavailableError,
    DecodeError,
    KVPrefetchConsumeError,
    OmniKVError,
    PayloadRefused,
    PeerGoneError,
    ReceiveCancelled,
    ReceiveTimeout,
)
from omnikv.topology.keys import TransferHooks, build_recv_keys
from omnikv.topology.placement import SenderEndpoint, source_metadata
from omnikv.topology.tp import KVTPTopology, merge_received_rank_shards, slice_received_rank_shard
from omnikv.transfer.received import ReceivedChunk, ReceivedKV, move_kv
from omnikv.transfer.results import ReceiveResult, ReceiveStatus
from omnikv.transfer.sessions import PendingStamps, SessionGuard
from omnikv.transfer.stream.manifest import reserved_key
from omnikv.transfer.stream.receiving import ChunkFeed, EagerChunks, StreamAssembly
from omnikv.wire.decode import decode_kv
from omnikv.wire.serializer import is_object

__all__ = [
    "ABORT_SLICE_S",
    "DUMMY_REQUEST_ID",
    "FetchTrace",
    "KVReceiver",
    "ReceiveCallbacks",
    "ReceiveFn",
    "ReceiveResult",
    "ReceiveStatus",
    "combine_probes",
]

logger = logging.getLogger(__name__)
_misses = RateLimitedLog(logger)  # misses a forger or a client can cause

#: The reference's warm-up request id: never received.
DUMMY_REQUEST_ID = "dummy_req_id"
#: Threads that receive a request's CFG companions beside it (one pool per receiver).
COMPANION_WORKERS = 4
#: Longest single connector wait when the caller passed an ``abort`` event (seconds).
ABORT_SLICE_S = 0.05


class ReceiveFn(Protocol):
    """The edge's typed receive (:meth:`TransferEdge.receive
    <omnikv.transfer.edge.TransferEdge.receive>`), as the background receivers (prefetch,
    admission) call it.

    Receives ``request_id`` from the endpoint in ``sender_info`` by ``deadline``, onto
    ``target_device`` (``None``: the host); honours ``abort`` between connector waits; logs a
    miss at DEBUG with ``quiet``; calls ``on_arrival`` with the payload's bytes once it is taken;
    refuses KV that ``check`` gives a reason for (see :class:`ReceiveCallbacks`).
    Raises only ``KVPrefetchConsumeError``.
    """

    def __call__(
        self,
        request_id: str,
        target_device: torch.device | None = None,
        *,
        sender_info: dict[str, Any] | None = None,
        deadline: float | None = None,
        abort: threading.Event | None = None,
        quiet: bool = False,
        on_arrival: Callable[[int], object] | None = None,
        check: Callable[[ReceivedKV], str | None] | None = None,
    ) -> ReceiveResult: ...


@dataclass(frozen=True)
class ReceiveCallbacks:
    """What a caller of :meth:`KVReceiver.receive` / :meth:`KVReceiver.fetch` is told, and
    asked, during one receive.

    ``on_arrival`` is called with the payload's bytes once every shard has been taken from the
    connector, before decoding (readiness tracking: the KV is no longer missing, not yet
    usable); with a connector that ``reports_incoming`` it is also called as each shard's
    transfer begins, with the bytes taken so far plus that shard's (the KV is on its way).
    ``check`` runs on the finished KV and returns why it must not be used, or ``None``
    (a vLLM consumer's binding, shape and MAC checks); its reason becomes the ``refused``
    verdict the sender gets.

    ``on_chunk`` takes a streamed send's chunks one by one, in order, as they arrive (on a
    chunk thread while the tail is still awaited, else on the receive's thread), each checked
    to continue the ones before it (:class:`~omnikv.transfer.received.ReceivedChunk`); a
    reason refuses the receive as ``check``'s does. When it took every chunk, the KV returned
    (and given to ``check``) holds only the tail: ``kv.token_offset`` is where it starts.
    Used only for a request received under one key whose shard is returned as it came (no
    merge of several sender ranks, no slice for this rank, no merger or slicer hook); otherwise
    the chunks are joined as without it and the KV returned starts at token 0. No call is in
    flight once the receive returns or raises (the caller may then reuse what the chunks were
    written into).
    """

    on_arrival: Callable[[int], object] | None = None
    check: Callable[[ReceivedKV], str | None] | None = None
    on_chunk: Callable[[ReceivedChunk], str | None] | None = None


@dataclass
class FetchTrace:
    """What :meth:`KVReceiver.fetch` did: the keys it waited for and its phase timings."""

    keys: list[str] = field(default_factory=list)
    timings_ms: dict[str, float] = field(default_factory=dict)

    def phases(self, t0: float, t_wait: float, t_decode: float, t_end: float) -> None:
        self.timings_ms["wait_ms"] = (t_wait - t0) * 1e3
        self.timings_ms["decode_ms"] = (t_decode - t_wait) * 1e3
        self.timings_ms["finish_ms"] = (t_end - t_decode) * 1e3


def _wait_sliced(
    connector: OmniConnectorBase,
    stages: tuple[str, str],
    key: str,
    deadline: float,
    metadata: dict[str, Any] | None,
    abort: threading.Event | None,
    *,
    on_incoming: Callable[[int], object] | None = None,
) -> ManagedBuffer | None:
    """``connector.wait`` until ``deadline``, cut into abortable slices when ``abort`` is given.

    A wait that returns ``None`` at its (slice) deadline consumes nothing (connector contract),
    so slicing never loses a payload. Raises :class:`ReceiveCancelled` once ``abort`` is set.
    ``on_incoming`` goes to a connector that ``reports_incoming`` (others are not given it);
    a connector that ``takes_abort`` gets ``abort`` and the whole deadline in one wait.
    """
    extra: dict[str, Any] = {}
    if on_incoming is not None and connector.reports_incoming:
        extra["on_incoming"] = on_incoming
    if abort is None:
        return connector.wait(*stages, key, deadline=deadline, metadata=metadata, **extra)
    if connector.takes_abort:  # one wait: a slice's deadline would cut a long transfer short
        extra["abort"] = abort
        got = connector.wait(*stages, key, deadline=deadline, metadata=metadata, **extra)
        if got is None and abort.is_set():
            raise ReceiveCancelled("receive aborted")
        return got
    while True:
        if abort.is_set():
            raise ReceiveCancelled("receive aborted")
        step = min(deadline, time.monotonic() + ABORT_SLICE_S)
        got = connector.wait(*stages, key, deadline=step, metadata=metadata, **extra)
        if got is not None or step >= deadline:
            return got


def _missing(
    connector: OmniConnectorBase,
    stages: tuple[str, str],
    key: str,
    *,
    metadata: dict[str, Any] | None,
    request_id: str,
    t0: float,
    taken: int,
) -> OmniKVError:
    """The error of a receive (started at ``t0``) whose wait for ``key`` found nothing by its
    deadline, after ``taken`` earlier shards: a :class:`ReceiveTimeout`, or
    :class:`PeerGoneError` when the connector knows the sender is gone; with what the connector
    can say about why (:meth:`OmniConnectorBase.explain_miss`: e.g. which senders were seen and
    which keys wait there)."""
    detail = f"key {key} missing"
    if taken:
        detail += f"; {taken} shard(s) already taken were dropped"
    report = connector.explain_miss(*stages, key, metadata=metadata)
    waited = time.monotonic() - t0
    if report is None:
        return ReceiveTimeout(request_id, waited, detail)
    if report.peer_gone:
        return PeerGoneError(
            f"KV for request {request_id!r} did not arrive within {waited:.3f}s and its sender"
            f" is gone ({detail}; {report.detail})"
        )
    return ReceiveTimeout(request_id, waited, f"{detail}; {report.detail}")


class _EndedBy(threading.Event):
    """The abort event of one receive's waits when chunks are handed to ``on_chunk``: set by
    the receive itself (a chunk was refused: the tail is no longer worth waiting for) or by
    the caller's ``abort``. The waits and connectors only ask :meth:`is_set`."""

    def __init__(self, outer: threading.Event | None) -> None:
        super().__init__()
        self._outer = outer

    def is_set(self) -> bool:
        return super().is_set() or (self._outer is not None and self._outer.is_set())


@dataclass
class _ChunkWaits:
    """The :class:`~omnikv.transfer.stream.receiving.ChunkSource` of one receive: its
    connector, stages, deadline and abort event; a chunk that is not there by the deadline
    raises the receive's typed miss (:func:`_missing`)."""

    connector: OmniConnectorBase
    stages: tuple[str, str]
    deadline: float
    abort: threading.Event | None
    request_id: str
    t0: float
    taken: int

    def wait_ahead(
        self, key: str, metadata: dict[str, Any] | None, stop: threading.Event
    ) -> ManagedBuffer | None:
        """An :class:`~omnikv.transfer.stream.receiving.EagerWait`: ``key`` until the receive's
        deadline, ended once ``stop`` is set."""
        return _wait_sliced(self.connector, self.stages, key, self.deadline, metadata, stop)

    def take(self, key: str, metadata: dict[str, Any] | None) -> ManagedBuffer:
        got = _wait_sliced(self.connector, self.stages, key, self.deadline, metadata, self.abort)
        if got is None:
            raise _missing(
                self.connector,
                self.stages,
                key,
                metadata=metadata,
                request_id=self.request_id,
                t0=self.t0,
                taken=self.taken,
            )
        self.taken += 1
        return got


def _refuse_unused(
    connector: OmniConnectorBase,
    stages: tuple[str, str],
    unused: list[tuple[str, dict[str, Any] | None, ManagedBuffer]],
) -> None:
    """Release the chunks a receive took ahead and did not use (a whole send's key, a
    restarted stream's first chunks), each refused to its sender."""
    if not unused:
        return
    for _key, _meta, buf in unused:
        buf.release()
    logger.debug("refused %d chunk(s) taken ahead and not used", len(unused))
    why = "a chunk taken ahead that its receive did not use"
    _acknowledge(connector, stages, [(k, m) for k, m, _ in unused], Verdict.REFUSED, why)


def _acknowledge(
    connector: OmniConnectorBase,
    stages: tuple[str, str],
    waits: list[tuple[str, dict[str, Any] | None]],
    verdict: Verdict,
    reason: str | None,
) -> None:
    """Give every payload of one receive its verdict (a connector without acknowledgements
    ignores it; one that fails to carry it logs that, and its sender sees ``expired``)."""
    if not connector.acknowledges:
        return
    for key, meta in waits:
        connector.acknowledge(*stages, key, verdict, reason, metadata=meta)


def _refuse_reserved(pairs: Iterable[tuple[str, Any]]) -> None:
    """Raise ``DecodeError`` for a request key in the chunk key space (a key hook spelled one):
    a receive never takes a stream's chunk as a request's payload."""
    for key, _ in pairs:
        why = reserved_key(key)
        if why is not None:
            raise DecodeError(why)


def combine_probes(probes: Iterable[KeyProbe]) -> KeyProbe:
    """One request's state from its keys' probes (see :meth:`KVReceiver.probe`): ``missing``
    when any key is, else ``unknown`` when any is, else ``offered`` when any is, else
    ``ready``; no keys is ``unknown``."""
    probes = list(probes)
    if not probes:
        return KeyProbe(KeyState.UNKNOWN, detail="no keys to receive")
    nbytes = sum(p.nbytes for p in probes)
    states = {p.state for p in probes}
    for state in (KeyState.MISSING, KeyState.UNKNOWN, KeyState.OFFERED):
        if state in states:
            detail = next((p.detail for p in probes if p.state is state and p.detail), None)
            return KeyProbe(state, 0 if state is KeyState.MISSING else nbytes, detail)
    return KeyProbe(KeyState.READY, nbytes)


def _names_device(target: torch.device | str | None, device: torch.device) -> bool:
    """Whether ``target`` is ``device`` (``None``: stay where it is). A name torch does not
    know is not: the device move then fails, after the consume, as a consume error."""
    if target is None:
        return True
    try:
        return torch.device(target) == device
    except (RuntimeError, TypeError, ValueError):
        return False


_STATUS = (
    (PeerGoneError, ReceiveStatus.PEER_GONE),
    (ConnectorUnavailableError, ReceiveStatus.UNAVAILABLE),
    (ConnectorError, ReceiveStatus.UNAVAILABLE),
    (PayloadRefused, ReceiveStatus.REFUSED),
    (DecodeError, ReceiveStatus.CORRUPT),
    (ReceiveCancelled, ReceiveStatus.CANCELLED),
    (ReceiveTimeout, ReceiveStatus.TIMEOUT),
)


class KVReceiver:
    """Receives one request's KV for the local rank of one stage edge.

    Made by the transfer edge, with its ``connector`` (a :class:`LazyConnector`) and its
    session ``guard`` (refuses duplicates and stale epochs; ``None``: unchecked);
    :meth:`set_hooks` replaces (never mutates) the hooks when the worker installs key builders,
    a merger or a slicer, :meth:`set_sender` the sender stage's endpoint.
    """

    def __init__(
        self,
        *,
        stages: tuple[str | None, str | None],
        topology: KVTPTopology,
        options: TransferOptions,
        connector: LazyConnector,
        hooks: TransferHooks | None = None,
        guard: SessionGuard | None = None,
        enabled: bool = True,
        configured: bool = True,
    ) -> None:
        self.stages = stages
        self.topology = topology
        self.options = options
        self.connector = connector
        self.hooks = hooks or TransferHooks()
        #: The sender stage's base endpoint (:meth:`set_sender`).
        self.sender: SenderEndpoint | None = None
        #: ``need_recv_cache``; ``configured``: the manager sends or receives at all.
        self.enabled, self.configured = enabled, configured
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._kept: dict[str, ReceiveResult] = {}
        #: Refuses duplicates and stale epochs (``None``: unchecked).
        self.guard = guard

    def set_hooks(self, hooks: TransferHooks) -> None:
        """Use ``hooks`` from the next receive on (the edge's, when the worker sets a slot)."""
        self.hooks = hooks

    def set_sender(self, endpoint: SenderEndpoint | None) -> None:
        """The sender stage's base endpoint for the receives without a per-call one."""
        self.sender = endpoint

    # -- the result form ----------------------------------------------------------------------
    def receive(
        self,
        request_id: str,
        *,
        deadline: float,
        sender: SenderEndpoint | None = None,
        per_call: bool = False,
        target_device: torch.device | str | None = None,
        abort: threading.Event | None = None,
        quiet: bool = False,
        callbacks: ReceiveCallbacks | None = None,
    ) -> ReceiveResult:
        """:meth:`fetch` as a :class:`ReceiveResult`; raises only ``KVPrefetchConsumeError``.

        A miss is logged at WARNING (timeout) or ERROR, or at DEBUG with ``quiet`` (for callers
        that count and report misses themselves, so that clients cannot flood the log).

        ``deadline``: the caller's absolute monotonic deadline (the manager makes it from
        ``recv_timeout``); ``sender``: this call's endpoint (``per_call``), else :attr:`sender`.
        A result kept by :meth:`receive_companions` is returned at once. Skipped without touching
        the connector: ``need_recv_cache`` false (``not_configured``), the warm-up request, unset
        stages, and a per-call sender that could not be resolved (``per_call`` with ``sender``
        ``None``).
        """
        kept = self._take_kept(request_id)
        if kept is not None:
            return kept
        guard = self._guard(request_id, sender, per_call)
        if guard is not None:
            return guard
        sender = sender if per_call else self.sender
        t0 = time.monotonic()
        trace = FetchTrace()
        try:
            kv = self.fetch(
                request_id,
                deadline=deadline,
                sender=sender,
                per_call=per_call,
                target_device=target_device,
                abort=abort,
                trace=trace,
                callbacks=callbacks,
            )
        except OmniKVError as exc:
            return self._miss(request_id, exc, t0, trace.keys, quiet)
        waited = trace.timings_ms.get("wait_ms", 0.0) / 1e3
        return ReceiveResult(
            request_id, ReceiveStatus.OK, kv, kv.nbytes, trace.keys, None, waited, trace.timings_ms
        )

    def _guard(
        self, request_id: str, sender: SenderEndpoint | None, per_call: bool
    ) -> ReceiveResult | None:
        status, reason = ReceiveStatus.SKIPPED, None
        if not self.enabled:
            status = ReceiveStatus.SKIPPED if self.configured else ReceiveStatus.NOT_CONFIGURED
            reason = "need_recv_cache is false"
        elif request_id == DUMMY_REQUEST_ID:
            reason = "warm-up request"
        elif self.stages[0] is None or self.stages[1] is None:
            reason = "recv stages unset"
        elif reserved_key(request_id) is not None:
            reason = reserved_key(request_id)
        elif per_call and sender is None:
            status, reason = ReceiveStatus.UNAVAILABLE, "bad sender_info"
        if reason is None:
            return None
        logger.debug("Not receiving KV for %s: %s", request_id, reason)
        return ReceiveResult(request_id, status, reason=reason)

    @staticmethod
    def _miss(
        request_id: str, exc: OmniKVError, t0: float, keys: list[str], quiet: bool
    ) -> ReceiveResult:
        status = next((s for kind, s in _STATUS if isinstance(exc, kind)), None)
        if status is None:
            raise exc
        level = logging.WARNING if status is ReceiveStatus.TIMEOUT else logging.ERROR
        # a refused or corrupt payload can be a forger's: rate-limited like any such line
        log = logger.debug if quiet else functools.partial(_misses.log, level)
        log(
            "KV receive for %s failed (%s): %s",
            request_id,
            status.value,
            exc,
        )
        return ReceiveResult(request_id, status, None, 0, keys, str(exc), time.monotonic() - t0)

    # -- where a request's KV stands, without receiving it -------------------------------------
    def probe(
        self,
        request_id: str,
        *,
        deadline: float,
        sender: SenderEndpoint | None = None,
        per_call: bool = False,
    ) -> KeyProbe:
        """Where ``request_id``'s KV stands, without taking or claiming any of it.

        Called by the edge's ``probe`` (a scheduler ordering its queue). Asks the
        connector's :meth:`~omnikv.connectors.base.OmniConnectorBase.probe` for every key this
        rank would wait for, with the metadata :meth:`fetch` would give, all by ``deadline``,
        and combines them: ``ready`` when each is ready (or a companion receive already holds
        the result), ``offered`` when each is offered or ready, ``missing`` when any is
        missing, else ``unknown`` (with the first reason); ``nbytes`` sums the sizes known.
        ``unknown`` also when this receiver would not receive (``need_recv_cache`` false,
        stages unset, no connector). Never raises."""
        with self._lock:
            kept = self._kept.get(request_id)
        if kept is not None:
            return KeyProbe(KeyState.READY, kept.nbytes)
        skipped = self._guard(request_id, sender, per_call)
        if skipped is not None:
            return KeyProbe(KeyState.UNKNOWN, detail=skipped.reason)
        from_stage, to_stage = self.stages
        connector = self.connector.get()
        if connector is None or from_stage is None or to_stage is None:
            return KeyProbe(KeyState.UNKNOWN, detail=self.connector.error or "no connector")
        sender = sender if per_call else self.sender
        try:
            pairs = build_recv_keys(
                self.topology, request_id, from_stage, to_stage, self.hooks.recv_keys
            )
            probes = [
                connector.probe(
                    from_stage,
                    to_stage,
                    key,
                    deadline=deadline,
                    metadata=source_metadata(sender, rank, per_call),
                )
                for key, rank in pairs
            ]
        except Exception as exc:  # a key hook or a connector that broke its contract
            return KeyProbe(KeyState.UNKNOWN, detail=f"{type(exc).__name__}: {exc}")
        return combine_probes(probes)

    # -- the raising form ---------------------------------------------------------------------
    def fetch(
        self,
        request_id: str,
        *,
        deadline: float,
        sender: SenderEndpoint | None = None,
        per_call: bool = False,
        target_device: torch.device | str | None = None,
        abort: threading.Event | None = None,
        trace: FetchTrace | None = None,
        callbacks: ReceiveCallbacks | None = None,
    ) -> ReceivedKV:
        """Wait for every shard of ``request_id`` until ``deadline`` and return its KV.

        ``sender`` is the sender stage's base endpoint; with ``per_call`` it was given for this
        call only and per-rank metadata is always sent. Shards already taken when a later shard
        times out are dropped (they were consumed; the error says so). ``abort``: a connector
        that ``takes_abort`` is given it in one wait; any other's waits are cut into slices of
        at most :data:`ABORT_SLICE_S` and the event is checked before every slice. ``trace``
        (optional) receives the keys and the phase timings. ``callbacks`` (optional): see
        :class:`ReceiveCallbacks`; a reason from its ``check`` raises
        :class:`~omnikv.errors.PayloadRefused`.

        Every payload taken gets its verdict through ``connector.acknowledge``: ``delivered``
        when the KV is returned, ``refused`` with the reason when decoding, a check, or a
        sibling shard failed after it was taken (the sender's ``get_send_result`` shows it).
        """
        from_stage, to_stage = self.stages
        if from_stage is None or to_stage is None:
            raise ConnectorUnavailableError("recv stages unset")
        connector = self.connector.get()
        if connector is None:
            raise ConnectorUnavailableError(
                f"no connector available ({self.connector.error or 'not configured'})"
            )
        t0 = time.monotonic()
        pairs = build_recv_keys(
            self.topology, request_id, from_stage, to_stage, self.hooks.recv_keys
        )
        if trace is not None:
            trace.keys = [k for k, _ in pairs]
        _refuse_reserved(pairs)
        waits = [(key, source_metadata(sender, rank, per_call)) for key, rank in pairs]
        stages = (from_stage, to_stage)
        on_chunk = None if callbacks is None else callbacks.on_chunk
        feed = None
        if on_chunk is not None and self._passes_through(len(waits)):
            ended = _EndedBy(abort)  # a refused chunk ends the wait for the tail at once
            feed, abort = ChunkFeed(on_chunk, on_refusal=ended.set, guard=self.guard), ended
        chunks = _ChunkWaits(connector, stages, deadline, abort, request_id, t0, 0)
        eager = None
        if self.options.stream_kv:  # take a stream's chunks while waiting for its tail
            eager = EagerChunks(
                chunks.wait_ahead,
                waits,
                chunks,
                max_header_bytes=self.options.max_header_bytes,
                name="omnikv-chunks",
                feed=feed,
            )
        try:
            try:
                raws = self._wait_all(
                    connector,
                    stages,
                    waits,
                    deadline=deadline,
                    abort=abort,
                    request_id=request_id,
                    t0=t0,
                    on_arrival=None if callbacks is None else callbacks.on_arrival,
                )
            except ReceiveCancelled:
                if feed is not None and feed.refusal is not None:
                    raise feed.error(waits[0][0]) from None
                raise
            t_wait = time.monotonic()
            chunks.taken = len(raws)
            streams = StreamAssembly(
                eager or chunks,
                max_header_bytes=self.options.max_header_bytes,
                guard=None if self.guard is None else self.guard.pending(),
                feed=feed,
            )
            kv, t_decode = self._use(
                request_id,
                raws,
                waits,
                connector=connector,
                stages=stages,
                streams=streams,
                target_device=target_device,
                callbacks=callbacks,
            )
        finally:
            if eager is not None:
                _refuse_unused(connector, stages, eager.stop())
            if feed is not None:  # no chunk is handed over after this returns
                feed.close()
        if trace is not None:
            trace.phases(t0, t_wait, t_decode, time.monotonic())
        logger.debug(
            "Received KV for %s: %d bytes across %d key(s), wait=%.3fs",
            request_id,
            kv.nbytes,
            len(pairs),
            t_wait - t0,
        )
        return kv

    def _use(
        self,
        request_id: str,
        raws: list[ManagedBuffer],
        waits: list[tuple[str, dict[str, Any] | None]],
        *,
        connector: OmniConnectorBase,
        stages: tuple[str, str],
        streams: StreamAssembly,
        target_device: torch.device | str | None,
        callbacks: ReceiveCallbacks | None,
    ) -> tuple[ReceivedKV, float]:
        """The KV of the shards ``raws`` (taken under ``waits``) and when decoding ended: each
        decoded (a streamed key joined with its chunks), combined, finished and checked; then
        every payload taken gets its verdict and every buffer is released, whatever happened."""
        verdict = Verdict.REFUSED
        reason: str | None = "the receiver failed while using it"
        try:
            on_arrival = None if callbacks is None else callbacks.on_arrival
            if on_arrival is not None:
                on_arrival(sum(int(buf.size) for buf in raws))
            shards = [
                self._decode(buf, target_device, streams, wait)
                for buf, wait in zip(raws, waits, strict=True)
            ]
            t_decode = time.monotonic()
            kv = self._combine(shards)
            aliased = any(not buf.released for buf in raws)
            kv = self._finish(request_id, kv, target_device, aliased)
            check = None if callbacks is None else callbacks.check
            refusal = None if check is None else check(kv)
            if refusal is not None:
                raise PayloadRefused(f"KV of {request_id} refused: {refusal}")
            if isinstance(streams.guard, PendingStamps):  # check, then remember
                streams.guard.commit()
            verdict, reason = Verdict.DELIVERED, None
        except (OmniKVError, KVPrefetchConsumeError) as exc:
            reason = str(exc)
            raise
        finally:
            for buf in raws:
                buf.release()
            streams.release()
            taken = [*waits, *streams.taken]  # a streamed key's chunks get the verdict too
            _acknowledge(connector, stages, taken, verdict, reason)
        return kv, t_decode

    def _wait_all(
        self,
        connector: OmniConnectorBase,
        stages: tuple[str, str],
        waits: list[tuple[str, dict[str, Any] | None]],
        *,
        deadline: float,
        abort: threading.Event | None,
        request_id: str,
        t0: float,
        on_arrival: Callable[[int], object] | None = None,
    ) -> list[ManagedBuffer]:
        """One wait per ``(key, metadata)`` of ``waits``, in order, all until ``deadline``; on
        any failure the shards taken so far are released and refused. ``on_arrival`` hears
        the bytes taken so far plus those of a shard whose transfer began."""
        raws: list[ManagedBuffer] = []

        def incoming(nbytes: int) -> None:
            if on_arrival is not None:
                on_arrival(sum(int(buf.size) for buf in raws) + nbytes)

        try:
            for key, meta in waits:
                got = _wait_sliced(
                    connector, stages, key, deadline, meta, abort, on_incoming=incoming
                )
                if got is None:
                    raise _missing(
                        connector,
                        stages,
                        key,
                        metadata=meta,
                        request_id=request_id,
                        t0=t0,
                        taken=len(raws),
                    )
                raws.append(got)
        except BaseException as exc:
            for buf in raws:
                buf.release()
            why = f"another shard of {request_id} was not received ({type(exc).__name__})"
            _acknowledge(connector, stages, waits[: len(raws)], Verdict.REFUSED, why)
            raise
        return raws

    def _decode(
        self,
        buf: ManagedBuffer,
        target_device: torch.device | str | None,
        streams: StreamAssembly | None = None,
        wait: tuple[str, dict[str, Any] | None] | None = None,
    ) -> ReceivedKV:
        """One shard as :class:`ReceivedKV`: views of ``buf`` where they may stay, else copied.

        A shard that is the tail of a streamed send (``wait``: the key and metadata it came
        under) is joined with its chunks by ``streams`` (into new memory; ``buf`` is released).

        Host memory with ``receive_copy="auto"`` and no target device is adopted (the views keep
        it); otherwise, when the tensors would alias ``buf`` past its release (no target device,
        or one on ``buf``'s device), they are decoded into fresh memory (at most the data
        section in all) and ``buf`` is released at once. A payload published as an object (the
        reference-shaped ``put``) is decoded from that object.
        """
        size, host = buf.size, buf.host_array
        if host is not None and is_object(host.data):
            return self._decode_object(get_result(buf)[0], size)
        own = _names_device(target_device, buf.device)
        payload: torch.Tensor | np.ndarray | None = None
        if own and host is not None and self.options.receive_copy == "auto":
            payload = buf.adopt_array()  # decoded in numpy, no torch slice (decode_kv)
            own = payload is None
        if payload is None:
            payload = buf.tensor
        limit = self.options.max_header_bytes
        decoded = decode_kv(payload, copy=own, max_header_bytes=limit)
        if streams is not None and streams.guard is not None:  # remembered once all passed
            streams.guard.admit(decoded.stamp, decoded.request_id)
        if decoded.stream is not None:
            if streams is None or wait is None:
                raise DecodeError("corrupt KV payload: a streamed piece outside a receive")
            kv = streams.assemble(wait[0], wait[1], decoded, size)
            buf.release()
            return kv
        if own:
            buf.release()
        return ReceivedKV.from_decoded(decoded, size)

    def _decode_object(self, obj: Any, size: int) -> ReceivedKV:
        """A payload that travelled as an encoded object: the seed's dict, or packed bytes."""
        if isinstance(obj, Mapping):
            return ReceivedKV.from_dict(obj, size)
        if isinstance(obj, bytes | bytearray | memoryview):
            limit = self.options.max_header_bytes
            return ReceivedKV.from_decoded(decode_kv(obj, max_header_bytes=limit), size)
        raise DecodeError(f"corrupt KV payload: unexpected payload type {type(obj).__name__}")

    def _passes_through(self, keys: int) -> bool:
        """Whether a receive of ``keys`` keys returns its one shard as decoded (no merge of
        sender ranks, no slice for this rank, no merger or slicer hook): :meth:`_combine` then
        returns it as is, and only then may its chunks be handed to ``on_chunk`` as they are
        (a shard that starts after token 0 never reaches the merger or the slicer)."""
        topo, hooks = self.topology, self.hooks
        return (
            keys == 1
            and hooks.merger is None
            and hooks.slicer is None
            and topo.target_tp_size <= topo.source_tp_size
        )

    def _combine(self, shards: list[ReceivedKV]) -> ReceivedKV:
        """Merge shards of several sender ranks and slice for this rank (hooks win)."""
        if self._passes_through(len(shards)):
            return shards[0]
        # The merger/slicer (and the reference's hooks) work on the seed's dict form.
        nbytes = sum(s.nbytes for s in shards)
        hooks = self.hooks
        dicts = [s.to_dict() for s in shards]
        merged = dicts[0] if len(dicts) == 1 else merge_received_rank_shards(dicts, hooks.merger)
        sliced = slice_received_rank_shard(merged, self.topology, hooks.slicer)
        return ReceivedKV.from_dict(sliced, nbytes)

    def _finish(
        self,
        request_id: str,
        kv: ReceivedKV,
        target_device: torch.device | str | None,
        aliased: bool,
    ) -> ReceivedKV:
        """Move to ``target_device`` or copy out of held connector memory; errors are fatal."""
        if target_device is None and not aliased:
            return kv
        try:
            return move_kv(kv, target_device, own=aliased)
        except Exception as exc:
            logger.exception("Post-get processing failed for %s", request_id)
            raise KVPrefetchConsumeError(
                f"Post-get processing failed for {request_id}: {exc}; payload already consumed"
            ) from exc

    # -- CFG companions -----------------------------------------------------------------------
    def receive_companions(
        self,
        request_ids: Iterable[str],
        *,
        deadline: float,
        sender: SenderEndpoint | None = None,
        target_device: torch.device | str | None = None,
    ) -> dict[str, ReceiveResult]:
        """Receive every id concurrently under one deadline; keep the results for :meth:`receive`.

        Called by the edge's ``companions`` before the CFG collector runs; the collector's own
        receives of these ids then return at once. Drop what nobody took with
        :meth:`drop_kept`.
        """
        ids = [str(r) for r in request_ids]
        if not ids:
            return {}
        pool = self._executor()
        futures = {
            rid: pool.submit(
                self.receive, rid, deadline=deadline, sender=sender, target_device=target_device
            )
            for rid in ids
        }
        results = {rid: f.result() for rid, f in futures.items()}
        with self._lock:
            self._kept.update(results)
        return results

    @contextlib.contextmanager
    def companions(
        self,
        request_ids: Iterable[str],
        *,
        deadline: float,
        sender: SenderEndpoint | None = None,
        target_device: torch.device | str | None = None,
    ) -> Iterator[None]:
        """:meth:`receive_companions` on entry (when receiving is on), :meth:`drop_kept` on exit."""
        ids = list(request_ids)
        if self.enabled and self.stages[0] is not None:
            self.receive_companions(
                ids, deadline=deadline, sender=sender or self.sender, target_device=target_device
            )
        try:
            yield
        finally:
            self.drop_kept(ids)

    def _take_kept(self, request_id: str) -> ReceiveResult | None:
        if not self._kept:
            return None
        with self._lock:
            return self._kept.pop(request_id, None)

    def drop_kept(self, request_ids: Iterable[str]) -> None:
        """Forget kept companion results (their tensors are freed with the last reference)."""
        with self._lock:
            for rid in request_ids:
                self._kept.pop(str(rid), None)

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    max_workers=COMPANION_WORKERS, thread_name_prefix="omnikv-recv"
                )
            return self._pool

    def close(self) -> None:
        """Stop the companion threads (idempotent)."""
        with self._lock:
            pool, self._pool = self._pool, None
            self._kept.clear()
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
