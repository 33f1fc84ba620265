"""Streaming a request's KV while it decodes, the sender's side: full blocks ship as they
fill, the tail at the finish.

With ``stream_kv: true`` the model runner ships, once per step for each request still decoding,
the request's *full* blocks not shipped yet as one **chunk** (its ``entry`` has the shape of a
``finished_reqs`` entry: ``block_ids`` and ``seq_len``, the tokens whose KV is written): a
normal packed payload (stamped, sliced per target rank as a whole send is) under a chunk key
for each of the request's keys (:func:`~omnikv.transfer.stream.manifest.chunk_key`, minted
here in a space no request key reaches). The finish then publishes, under the request's own
keys, only the **tail**: the tokens after the last chunk, the request's block ids and metadata,
and the manifest (header ``sm``: the stream id, the chunk count, each chunk's token range).
Every piece is format version 3, which a reader that predates streaming refuses (a clean
``corrupt``), so a tail is never taken for a whole request's KV.

* a step costs its caller almost nothing: :meth:`KVStreams.ship` checks the arguments,
  copies the entry's block list, and hands the step to the edge's **stream worker** (one
  thread, steps in the order they came), which gathers only the newly full blocks (work the
  finish would otherwise do), seals, codes and puts them with one attempt and a deadline of at
  most :data:`STEP_PUT_S` (``send_timeout`` if shorter), and never raises for a request's
  failure. Nothing is copied on the caller's thread: the worker reads the blocks from the
  cache itself, which is sound because a full block of a paged cache is never written again
  while its request runs. The caller must therefore not change a full block, nor free or
  reuse a request's blocks until its finish (:meth:`KVStreams.tail`, i.e. the send),
  :meth:`KVStreams.abort` or :meth:`KVStreams.close` returned: each drops the request's steps
  still queued and waits for one running, so after it nothing of the request is read or
  published (for caches on a GPU the worker first waits for an event the step recorded on
  the caller's stream). What a step published, or why not, reaches the request's next
  progress (and ``on_step``): never lost;
* back-pressure: a request's whole step still queued is replaced by its newer one (which
  covers every block the older would have shipped), and at most ``max_queued``
  (:data:`DEFAULT_MAX_QUEUED`) steps wait at once, every request's together. A new step
  beyond that is refused at once (never blocking the caller; the progress says
  ``back-pressure``) and its blocks go with a later step or the tail; a refused first layer
  group refuses the step's later groups too. A queued step holds no copy (only the block
  list and references to the cache), so the bound is on the work behind the step, not memory;
  the connector's pool bounds the bytes published;
* the finish supersedes a request's queued steps: its tail takes their blocks (and waits for
  one running), so the manifest lists exactly what was published, in order;
* a chunk that could not be published (no room in the pool within the step's deadline, a
  transport error) is dropped and its blocks go with a later chunk or the tail; after
  :data:`MAX_FAILED_STEPS` such steps in a row the stream ships no more (the tail takes the
  rest). A changed block list, block size, dtype or transfer id drops what the stream shipped
  and starts it again (at the finish: the request is sent whole). At most
  :data:`~omnikv.wire.format.MAX_STREAM_CHUNKS` chunks; later blocks go with the tail;
* each chunk's keys are watched by the delivery book from the moment they are published, so a
  verdict a receiver sends before the finish (an early hand-off's consumer that refuses) is
  kept: such a finish publishes no tail and its send is ``refused`` at once;
* :meth:`KVStreams.abort` (a request aborted mid-stream) drops every chunk it published
  (``connector.cleanup`` of each chunk key, which matches that key alone); so does a finish
  that failed, and closing the edge. At most ``capacity`` streams are open (the oldest is
  aborted first). A full block must not change once shipped (true of vLLM's paged cache).

Used by :class:`~omnikv.transfer.edge.TransferEdge` only; calls down into
:class:`~omnikv.transfer.send.KVSender` (checks, plans, puts) and the
:class:`~omnikv.transfer.delivery.DeliveryBook`.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch

from omnikv._logging import RateLimitedLog
from omnikv.config import RetryPolicy
from omnikv.connectors.base import OmniConnectorBase
from omnikv.errors import OmniKVError
from omnikv.topology.keys import build_send_keys
from omnikv.transfer.delivery import DeliveryBook
from omnikv.transfer.results import SendResult, SendStatus, StreamProgress
from omnikv.transfer.send import KVSender, SendBatch, SendRefused, TailPlan
from omnikv.transfer.stream.manifest import chunk_key, chunk_parts, reserved_key
from omnikv.wire.format import MAX_STREAM_CHUNKS

__all__ = [
    "DEFAULT_MAX_QUEUED",
    "MAX_FAILED_STEPS",
    "STEP_PUT_S",
    "KVStreams",
    "Seal",
    "ShippedChunk",
    "StepListener",
]

logger = logging.getLogger(__name__)
_outsider = RateLimitedLog(logger)  # lines a peer, client or forger can cause

#: Longest a streaming step waits for room to put a chunk (seconds; ``send_timeout`` if less).
STEP_PUT_S = 0.25
#: Failed chunk puts in a row after which a stream ships no more (the tail takes the rest).
MAX_FAILED_STEPS = 3
#: Streams open at once per sender (the oldest is aborted beyond it).
DEFAULT_CAPACITY = 4096
#: Steps waiting for the stream worker at once, every request's together (a new step beyond
#: it is refused: its blocks go with a later step or the tail).
DEFAULT_MAX_QUEUED = 64
_ONE_ATTEMPT = RetryPolicy(attempts=1)


class ShippedChunk(NamedTuple):
    """One chunk a stream published: its tokens ``[start, stop)``, the metadata its seal put in
    its header (``{}`` without a seal) and, for a layer group, its layers ``[first, stop)``
    (``None``: every layer)."""

    start: int
    stop: int
    seal: dict[str, Any]
    layers: tuple[int, int] | None = None


@dataclass
class _Pending:
    """The layer groups of one token range published so far (the range counts as shipped once
    its last layer is)."""

    start: int
    stop: int
    block_ids: list[int]
    next_layer: int = 0
    chunks: list[ShippedChunk] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)


@dataclass
class _Stream:
    """One request's stream on the sender: what it shipped, under which keys."""

    transfer_id: str
    stream_id: str
    block_size: int
    cache_dtype: str
    num_layers: int
    keys: list[str]
    block_ids: list[int] = field(default_factory=list)
    #: the chunks of the ranges shipped whole (every layer), in order
    chunks: list[ShippedChunk] = field(default_factory=list)
    chunk_keys: list[str] = field(default_factory=list)
    #: a range whose layer groups are still being shipped
    pending: _Pending | None = None
    #: why no more chunks are shipped (the finish still uses those shipped)
    stopped: str | None = None
    #: chunk puts that failed in a row
    failures: int = 0

    @property
    def shipped(self) -> int:
        return self.chunks[-1].stop if self.chunks else 0

    @property
    def published(self) -> int:
        """Chunks published, a pending range's groups included (the next chunk's index)."""
        return len(self.chunks) + (0 if self.pending is None else len(self.pending.chunks))

    @property
    def layered(self) -> bool:
        """Whether any chunk shipped holds a layer group (the manifest then lists spans)."""
        return any(c.layers is not None for c in self.chunks)


class _Job(NamedTuple):
    """One step handed to the worker: the request, copies of its entry and cache list (the
    blocks are the caller's), the step's seal and layer group, and the caller's device work
    to wait for (a CUDA event; ``None`` on the host)."""

    rid: str
    entry: dict[str, Any]
    batch: SendBatch
    seal: Seal | None
    layers: tuple[int, int] | None
    ready: Any


@dataclass
class _Done:
    """What a request's completed steps published since its last progress (and the latest
    reason one of them gave)."""

    new: int = 0
    nbytes: int = 0
    reason: str | None = None


#: Told each step's outcome and layer group (``None``: every layer), on the worker's thread.
StepListener = Callable[[StreamProgress, tuple[int, int] | None], object]


def _check_entry(entry: Any) -> tuple[list[int] | tuple[int, ...], int]:
    """A step's ``entry``'s block ids and token count; raises :class:`SendRefused`."""
    if not isinstance(entry, Mapping):
        raise SendRefused(f"entry must be a dict, got {type(entry).__name__}")
    block_ids, seq_len = entry.get("block_ids"), entry.get("seq_len")
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 0:
        raise SendRefused(f"seq_len must be an int >= 0, got {seq_len!r:.40}")
    if not isinstance(block_ids, list | tuple) or not all(type(b) is int for b in block_ids):
        raise SendRefused("block_ids must be a list of ints")
    return block_ids, seq_len


def _entry_copy(entry: Mapping[str, Any]) -> dict[str, Any]:
    """``entry`` as the worker reads it: its own block list (the caller may reuse its list)."""
    return {**entry, "block_ids": list(entry["block_ids"])}


def _device_ready(layers: Sequence[Any]) -> Any:
    """A CUDA event recorded on the caller's current stream when the caches live on a GPU
    (the worker waits for it, so that it reads the blocks the caller's kernels wrote);
    ``None`` for caches in host memory."""
    for layer in layers:
        parts = layer if isinstance(layer, list | tuple) else (layer,)
        for t in parts:
            if isinstance(t, torch.Tensor):
                if not t.is_cuda:
                    return None
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(torch.cuda.current_stream(t.device))
                return event
    return None


class Seal(Protocol):
    """A stream step's caller's per-chunk metadata: called with the chunk's token range
    ``[start, stop)`` and its block ids before the chunk is made, and with ``layers`` (its
    ``[first, stop)`` layers) when the chunk is a layer group; what it returns (a dict of plain
    values) goes into the chunk's header metadata (the vLLM connector puts a MAC over the
    chunk's tokens there, so that a receiver can check each chunk before it has the rest).
    Raising stops the stream (the finish then sends the rest with the tail)."""

    def __call__(
        self,
        start: int,
        stop: int,
        block_ids: Sequence[int],
        *,
        layers: tuple[int, int] | None = None,
    ) -> Mapping[str, Any]: ...


def _sealed(
    seal: Seal | None,
    start: int,
    stop: int,
    block_ids: Sequence[int],
    layers: tuple[int, int] | None,
) -> dict[str, Any] | None:
    """``seal``'s metadata for a chunk (``None`` without one); its failure as ``SendRefused``."""
    if seal is None:
        return None
    try:
        meta = (
            seal(start, stop, block_ids)
            if layers is None
            else seal(start, stop, block_ids, layers=layers)
        )
    except Exception as exc:
        raise SendRefused(f"the stream's seal raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(meta, Mapping):
        raise SendRefused(f"the stream's seal returned {type(meta).__name__}, not a dict")
    return dict(meta)


class KVStreams:
    """The sender's open streams, one per request shipping blocks while it decodes.

    Made and called by the transfer edge (:meth:`ship` per step, :meth:`tail` and
    :meth:`settle` at the finish, :meth:`abort`, :meth:`close`); calls down into ``sender``
    and ``deliveries`` (the edge's, given here), never back; ``on_step`` (optional) is told
    each step's outcome and layer group on the worker's thread. Thread-safe; steps of one
    request are expected from one thread at a time (the runner's). At most ``max_queued``
    (default :data:`DEFAULT_MAX_QUEUED`) steps wait for the worker (see the module
    docstring).
    """

    def __init__(
        self,
        sender: KVSender,
        *,
        deliveries: DeliveryBook | None = None,
        capacity: int = DEFAULT_CAPACITY,
        max_queued: int | None = None,
        on_step: StepListener | None = None,
    ) -> None:
        self.sender = sender
        self.deliveries = deliveries
        self.capacity = capacity
        self.max_queued = max(1, int(DEFAULT_MAX_QUEUED if max_queued is None else max_queued))
        self.on_step = on_step
        #: steps refused for back-pressure, and the most ever queued at once
        self.backpressured = self.queued_max = 0
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._streams: OrderedDict[str, _Stream] = OrderedDict()
        self._jobs: deque[_Job] = deque()
        self._running: str | None = None
        self._closed = False
        #: per request: what its completed steps published since its last progress
        self._done: OrderedDict[str, _Done] = OrderedDict()
        #: requests whose step's first layer group was refused (its later groups are too)
        self._skipped: set[str] = set()
        # Started here, not by the first step: that step's caller then only wakes it.
        self._worker = self._start_worker()

    def _start_worker(self) -> threading.Thread:
        worker = threading.Thread(target=self._work, name="omnikv-stream-send", daemon=True)
        worker.start()
        return worker

    # -- per step (the caller's thread) ----------------------------------------------------------
    def ship(
        self,
        request_id: str,
        entry: Any,
        kv_caches: Any,
        block_size: Any,
        cache_dtype: Any,
        resolver: Callable[[str], str] | None = None,
        *,
        seal: Seal | None = None,
        layers: tuple[int, int] | None = None,
    ) -> StreamProgress:
        """Hand ``request_id``'s step to the stream worker, which ships the full blocks not
        shipped yet as one chunk; returns at once (no copy, no put, no seal here) and never
        raises for the request's failure. The progress tells what the worker published for
        the request since the previous call (``new``, ``nbytes``; a background failure as
        ``reason``), the stream's state (``shipped``, ``chunks``) and the steps still
        ``pending``; arguments that cannot stream, a closed stream set and back-pressure are
        answered at once in ``reason``. ``seal`` (optional) is asked, on the worker, for the
        chunk's own metadata (see :class:`Seal`) before the chunk is made.

        ``entry``'s block list and ``kv_caches``' list are copied here; the blocks themselves
        are read by the worker later: the caller must not change a full block while the
        request streams, nor free or reuse the request's blocks before its finish
        (:meth:`tail`, i.e. the send), :meth:`abort` or :meth:`close` returned (each waits
        for a step of the request that is running and drops those still queued).

        With ``layers`` (``[first, stop)`` of ``kv_caches``, which still names every layer) the
        chunk holds only those layers: a *layer group*, shipped as soon as the caller's forward
        pass has written them. Groups of one range come in layer order, the first from layer
        0, each starting where the one before stopped; the range is shipped once its last
        layer is. The first group takes the newly full blocks (when there are none, the
        step's later groups ship nothing either); later ones keep that range. A group out of
        that order (or one that cannot be published) drops the range's groups and stops the
        stream: the finish sends the rest with the tail."""
        rid = str(request_id)
        sender = self.sender
        from_stage, to_stage = sender.stages
        if not sender.enabled or from_stage is None or to_stage is None:
            return StreamProgress(rid, reason="not sending (need_send_cache, stages, connector)")
        try:
            _check_entry(entry)
            batch = sender.prepare(kv_caches, block_size, cache_dtype, resolver, 0.0)
        except (SendRefused, OmniKVError) as exc:
            logger.debug("Not streaming KV of %s: %s", rid, exc)
            self.abort(rid)
            return StreamProgress(rid, reason=str(exc))
        span = _layer_span(layers, len(batch.kv_caches))
        if isinstance(span, str):
            return self._report(rid, span)
        job = _Job(rid, _entry_copy(entry), batch, seal, layers, _device_ready(batch.kv_caches))
        return self._queue(job, span)

    def _queue(self, job: _Job, span: tuple[int, int] | None) -> StreamProgress:
        """Queue ``job`` (a whole step replaces its request's whole step still queued: the
        newer one covers every block the older would have shipped) or refuse it when
        :attr:`max_queued` steps wait; the request's progress either way."""
        rid = job.rid
        first = span is None or span[0] == 0
        with self._cv:
            if self._closed:
                return self._progress_locked(rid, "the streams are closed")
            if not first and rid in self._skipped:
                return self._progress_locked(rid, "its step's first layer group was not queued")
            self._skipped.discard(rid)
            last = next((j for j in reversed(self._jobs) if j.rid == rid), None)
            if span is None and last is not None and last.layers is None:
                self._jobs[self._jobs.index(last)] = job  # (same place in the queue)
            elif first and len(self._jobs) >= self.max_queued:
                if span is not None:
                    self._skipped.add(rid)
                self.backpressured += 1
                why = (
                    f"back-pressure: {len(self._jobs)} stream steps queued; these blocks go"
                    " with a later step or the tail"
                )
                return self._progress_locked(rid, why)
            else:
                self._jobs.append(job)
                self.queued_max = max(self.queued_max, len(self._jobs))
            progress = self._progress_locked(rid, None)
            self._cv.notify_all()
            if not self._worker.is_alive():  # (a forked child inherits no thread)
                self._worker = self._start_worker()
            return progress

    def _report(self, rid: str, reason: str | None) -> StreamProgress:
        with self._cv:
            return self._progress_locked(rid, reason)

    def _progress_locked(self, rid: str, reason: str | None) -> StreamProgress:
        """``rid``'s progress (lock held): what its completed steps published since the last
        progress handed out (taken now), ``reason`` or else the latest completed step's, the
        stream's state and the steps still pending."""
        done = self._done.pop(rid, None) or _Done()
        stream = self._streams.get(rid)
        pending = sum(1 for j in self._jobs if j.rid == rid) + (self._running == rid)
        return StreamProgress(
            rid,
            0 if stream is None else stream.shipped,
            0 if stream is None else len(stream.chunks),
            done.new,
            reason if reason is not None else done.reason,
            done.nbytes,
            pending,
        )

    # -- the stream worker ------------------------------------------------------------------------
    def _work(self) -> None:
        """The worker's loop: each queued step in order (:meth:`_run_step`), its outcome kept
        for the request's next progress and told to ``on_step``; ends at :meth:`close`."""
        while True:
            with self._cv:
                while not self._jobs and not self._closed:
                    self._cv.wait()
                if not self._jobs:
                    return
                job = self._jobs.popleft()
                self._running = job.rid
            try:
                if job.ready is not None:
                    job.ready.synchronize()  # the caller's kernels that wrote the blocks
                progress = self._run_step(job)
            except Exception as exc:  # a bug: the stream stops, the finish sends it whole
                logger.debug("KV stream step of %s raised", job.rid, exc_info=True)
                self._forget(job.rid)
                progress = StreamProgress(
                    job.rid, reason=f"stream step raised {type(exc).__name__}: {exc}"
                )
            with self._cv:
                self._running = None
                done = self._done.setdefault(job.rid, _Done())
                self._done.move_to_end(job.rid)
                done.new += progress.new
                done.nbytes += progress.nbytes
                done.reason = progress.reason if progress.reason is not None else done.reason
                while len(self._done) > self.capacity:
                    self._done.popitem(last=False)
                self._cv.notify_all()
            if self.on_step is not None:
                try:
                    self.on_step(progress, job.layers)
                except Exception:
                    logger.debug("on_step raised for %s", job.rid, exc_info=True)

    def _settle_jobs(self, rid: str, *, cancel: bool, timeout: float | None = None) -> bool:
        """Wait until no step of ``rid`` is queued or running (``cancel``: its queued steps
        are dropped first, so only a running one is waited for); False at ``timeout``. On the
        worker's own thread (a step's callback) nothing is waited for."""
        if threading.current_thread() is self._worker:
            return self._running != rid
        end = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            if cancel:
                kept = [j for j in self._jobs if j.rid != rid]
                if len(kept) != len(self._jobs):
                    self._jobs.clear()
                    self._jobs.extend(kept)
                self._skipped.discard(rid)

            def idle() -> bool:
                return self._running != rid and all(j.rid != rid for j in self._jobs)

            left = None if end is None else max(0.0, end - time.monotonic())
            return self._cv.wait_for(idle, timeout=left)

    def wait(self, request_id: str, timeout: float | None = None) -> StreamProgress:
        """Wait up to ``timeout`` s (``None``: no limit) until every step of ``request_id``
        handed over so far ran; the request's progress then (``pending`` > 0 at the
        timeout)."""
        rid = str(request_id)
        self._settle_jobs(rid, cancel=False, timeout=timeout)
        return self._report(rid, None)

    def wait_all(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` s (``None``: no limit) until no step of any request is
        queued or running; False at the timeout."""
        with self._cv:
            return self._cv.wait_for(
                lambda: not self._jobs and self._running is None, timeout=timeout
            )

    def _run_step(self, job: _Job) -> StreamProgress:
        """One queued step, on the worker: ship ``job``'s request's full blocks not shipped
        yet (or one layer group of them) as one chunk; never raises for the request's
        failure (the progress says why nothing went)."""
        rid, sender, layers = job.rid, self.sender, job.layers
        self.drop_orphans()
        from_stage, to_stage = sender.stages
        connector = sender.connector.get() if sender.enabled else None
        if from_stage is None or to_stage is None or connector is None:
            return StreamProgress(rid, reason="not sending (need_send_cache, stages, connector)")
        deadline = time.monotonic() + min(STEP_PUT_S, sender.options.send_timeout)
        batch = job.batch._replace(deadline=deadline)
        try:
            step = self._step(rid, job.entry, batch)
        except (SendRefused, OmniKVError) as exc:
            logger.debug("Not streaming KV of %s: %s", rid, exc)
            self._forget(rid)
            return StreamProgress(rid, reason=str(exc))
        stream, ids, batch = step
        self._note_refusal(rid, stream)
        if stream.stopped is not None:  # (the chunk limit may stop it mid-range)
            self._drop_pending(stream, connector)
            return self._progress(rid, stream, 0, stream.stopped)
        span = _layer_span(layers, stream.num_layers)
        if isinstance(span, str):
            return self._progress(rid, stream, 0, span)
        piece = self._piece(stream, ids, span)
        if isinstance(piece, str):
            return self._stop(rid, stream, piece, connector)
        if piece is None:
            return self._progress(rid, stream, 0, None)
        start, stop, ids = piece
        index = stream.published
        keys = [chunk_key(k, index) for k in stream.keys]
        mark: dict[str, Any] = {
            "k": "chunk",
            "id": stream.stream_id,
            "n": index,
            "r": [[start, stop]],
        }
        if span is not None:
            mark.update(l=[list(span)], lc=stream.num_layers)
            batch = batch._replace(kv_caches=batch.kv_caches[span[0] : span[1]])
        try:
            meta = _sealed(job.seal, start, stop, ids, span)
            payloads = sender.plan_blocks(stream.transfer_id, keys, ids, batch, mark, meta)
        except (SendRefused, OmniKVError) as exc:
            return self._stop(rid, stream, f"chunk {index} cannot be made: {exc}", connector)
        sender.listen(connector)
        if self.deliveries is not None and connector.acknowledges:
            self.deliveries.expect_chunks(rid, keys)  # a verdict before the finish is kept
        nbytes, failed = sender.put_all(
            connector, (from_stage, to_stage), keys, payloads, batch.deadline, _ONE_ATTEMPT
        )
        if failed:  # none of it stays; the blocks go with a later chunk or the tail
            self._drop(connector, keys)
            why = f"chunk {index} not published: {'; '.join(failed)}"
            stream.failures += 1
            if stream.failures >= MAX_FAILED_STEPS or stream.pending is not None:
                return self._stop(rid, stream, why, connector)
            logger.debug("KV chunk %d of %s deferred: %s", index, rid, why)
            return self._progress(rid, stream, 0, why)
        stream.failures = 0
        new = self._record(rid, stream, ShippedChunk(start, stop, meta or {}, span), ids, keys)
        if new is None:  # the stream ended (a finish, an abort) or its range moved meanwhile
            self._drop(connector, keys)
            return self._stop(rid, stream, f"chunk {index} no longer fits its stream", connector)
        logger.debug(
            "KV chunk %d of %s shipped: tokens [%d, %d), layers %s, %d bytes",
            index,
            rid,
            start,
            stop,
            "all" if span is None else list(span),
            nbytes,
        )
        return self._progress(rid, stream, new, None, int(nbytes))

    def _note_refusal(self, rid: str, stream: _Stream) -> None:
        """Stop a stream still shipping when a receiver refused (or let expire) one of its
        chunks before the finish (the delivery book keeps that verdict): nobody takes what
        would come next, and the finish is refused at once."""
        early = None if self.deliveries is None else self.deliveries.early(rid)
        if early is not None and stream.stopped is None:
            stream.stopped = f"{early.status.value} by a receiver: {early.reason}"
            logger.debug("KV stream of %s stopped: %s", rid, stream.stopped)

    @staticmethod
    def _piece(
        stream: _Stream, ids: list[int], span: tuple[int, int] | None
    ) -> tuple[int, int, list[int]] | str | None:
        """The token range and blocks of the next chunk: a new range of the newly full blocks
        ``ids``, or (a later layer group) the pending range's; ``None``: nothing to ship; a
        string: why the stream must stop (a layer group out of order)."""
        pending = stream.pending
        if span is not None:
            first = span[0]
            if pending is not None and first == pending.next_layer:
                if ids[: len(pending.block_ids)] != pending.block_ids:
                    return "the blocks of a range changed between its layer groups"
                return pending.start, pending.stop, pending.block_ids
            if first != 0:
                if pending is None:
                    return None  # this step's first group had no full block to ship
                return f"layer group {list(span)} came where layer {pending.next_layer} was due"
        if pending is not None:
            return f"a range's layer groups stopped at layer {pending.next_layer}"
        if not ids:
            return None
        start = stream.shipped
        return start, start + len(ids) * stream.block_size, ids

    def _record(
        self, rid: str, stream: _Stream, chunk: ShippedChunk, ids: list[int], keys: list[str]
    ) -> int | None:
        """Note a published chunk; the tokens it completed (0: a layer group before the
        range's last); ``None`` when it no longer fits (the stream was ended, or its pending
        range changed, by another thread since the chunk was planned): not noted."""
        with self._lock:
            if self._streams.get(rid) is not stream:
                return None
            if chunk.layers is None:
                stream.chunks.append(chunk)
                stream.block_ids.extend(ids)
                stream.chunk_keys.extend(keys)
                return chunk.stop - chunk.start
            pending = stream.pending
            if chunk.layers[0] != (0 if pending is None else pending.next_layer):
                return None
            if pending is None:
                pending = stream.pending = _Pending(chunk.start, chunk.stop, list(ids))
            pending.chunks.append(chunk)
            pending.keys.extend(keys)
            pending.next_layer = chunk.layers[1]
            if pending.next_layer < stream.num_layers:
                return 0
            stream.chunks.extend(pending.chunks)
            stream.block_ids.extend(pending.block_ids)
            stream.chunk_keys.extend(pending.keys)
            stream.pending = None
            return chunk.stop - chunk.start

    @staticmethod
    def _progress(
        rid: str, stream: _Stream, new: int, reason: str | None, nbytes: int = 0
    ) -> StreamProgress:
        return StreamProgress(rid, stream.shipped, len(stream.chunks), new, reason, nbytes)

    def _step(
        self, rid: str, entry: Mapping[str, Any], batch: SendBatch
    ) -> tuple[_Stream, list[int], SendBatch]:
        """The request's stream (opened, or restarted when what it shipped no longer holds),
        the ids of its newly full blocks, and the step's batch; raises the reason it cannot
        stream."""
        sender, resolver = self.sender, batch.resolver
        block_ids, seq_len = _check_entry(entry)
        full = min(seq_len // batch.block_size, len(block_ids))
        transfer_id = sender.transfer_id(rid, resolver)
        with self._lock:
            stream = self._streams.get(rid)
        if stream is not None and not _still_holds(stream, transfer_id, batch, block_ids):
            logger.debug("KV stream of %s restarts: its blocks or caches changed", rid)
            self._forget(rid)
            stream = None
        if stream is None:
            from_stage, to_stage = sender.stages
            assert from_stage is not None and to_stage is not None
            keys = build_send_keys(
                sender.topology, transfer_id, from_stage, to_stage, sender.hooks.send_keys
            )
            for key in keys:
                why = reserved_key(key)
                if why is not None:
                    raise SendRefused(why)
            stream = _Stream(
                transfer_id,
                secrets.token_hex(8),
                batch.block_size,
                str(batch.cache_dtype),
                len(batch.kv_caches),
                keys,
            )
            self._open(rid, stream)
        done = len(stream.block_ids)
        if stream.published >= MAX_STREAM_CHUNKS and stream.stopped is None:
            stream.stopped = f"{MAX_STREAM_CHUNKS} chunks shipped; the rest goes with the tail"
        return stream, [int(b) for b in block_ids[done:full]], batch

    def _open(self, rid: str, stream: _Stream) -> None:
        with self._lock:
            self._streams[rid] = stream
            evicted = []
            while len(self._streams) > self.capacity:
                evicted.append(self._streams.popitem(last=False))
        for old_rid, old in evicted:
            _outsider.warning(
                "KV stream of %s dropped: more than %d streams open (abort_kv_stream missing?)",
                old_rid,
                self.capacity,
            )
            self._drop_stream(old)

    def _stop(
        self, rid: str, stream: _Stream, why: str, connector: OmniConnectorBase | None = None
    ) -> StreamProgress:
        """Ship no more for ``rid`` (the finish sends the rest); a pending range's layer groups
        are dropped."""
        logger.debug("KV stream of %s stopped: %s", rid, why)
        stream.stopped = why
        self._drop_pending(stream, connector)
        return self._progress(rid, stream, 0, why)

    def _drop_pending(self, stream: _Stream, connector: OmniConnectorBase | None) -> None:
        with self._lock:
            pending, stream.pending = stream.pending, None
        if pending is not None and pending.keys:
            target = connector if connector is not None else self.sender.connector.current
            if target is not None:
                self._drop(target, pending.keys)

    # -- at the finish --------------------------------------------------------------------------
    def tail(
        self,
        request_id: str,
        transfer_id: str,
        keys: list[str],
        block_ids: Sequence[int],
        seq_len: int,
        batch: SendBatch,
    ) -> TailPlan | None:
        """Called by the sender's finish once it has checked the request's blocks: the tail to
        send when the request's stream shipped chunks that are still the start of its KV,
        under these same ``keys`` (else the stream, if any, is dropped and ``None`` says: send
        it whole). Its steps still queued are dropped first (the tail takes their blocks)
        and one running is waited for, so the manifest lists exactly what was published."""
        self._settle_jobs(request_id, cancel=True)
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is not None:
            self._drop_pending(stream, None)  # a range whose last layers never came
        if stream is None or not stream.chunks:
            return None
        if (
            stream.keys != keys
            or stream.shipped > seq_len
            or not _still_holds(stream, transfer_id, batch, block_ids)
        ):
            logger.debug("KV stream of %s dropped: it no longer matches the finish", request_id)
            self._forget(request_id)
            return None
        manifest: dict[str, Any] = {
            "k": "tail",
            "id": stream.stream_id,
            "n": len(stream.chunks),
            "r": [[c.start, c.stop] for c in stream.chunks],
        }
        if stream.layered:
            every = (0, stream.num_layers)
            manifest["l"] = [list(c.layers or every) for c in stream.chunks]
            manifest["lc"] = stream.num_layers
        return TailPlan(len(stream.block_ids), manifest, list(stream.chunk_keys))

    def shipped_chunks(self, request_id: str) -> list[ShippedChunk]:
        """The chunks ``request_id``'s open stream has shipped, in order (those of whole
        ranges: a range still missing layer groups is not listed); empty without a stream.
        What a finish's tail manifest will list, unless the finish finds the stream no longer
        matches its blocks (it then sends the request whole): read by a finish, so the
        request's steps still queued are dropped (the tail takes their blocks) and one running
        is waited for first."""
        self._settle_jobs(str(request_id), cancel=True)
        with self._lock:
            stream = self._streams.get(str(request_id))
            return [] if stream is None else [c._replace(seal=dict(c.seal)) for c in stream.chunks]

    def settle(self, result: SendResult) -> None:
        """The finish of ``result.request_id`` ended: a sent stream's chunks are the
        receiver's now; those of a finish that failed or was skipped are dropped."""
        if result.status in (SendStatus.SENT, SendStatus.DELIVERED):
            with self._lock:
                self._streams.pop(result.request_id, None)
                self._done.pop(result.request_id, None)
        else:
            self.abort(result.request_id)

    # -- dropping -------------------------------------------------------------------------------
    def drop_orphans(self) -> int:
        """Drop the chunk keys of refused or expired sends that had no verdict (the delivery
        book lists them: nobody will take them); called on the sender's thread, by each stream
        step and finish, never on the connector's listener thread. How many keys went."""
        book = self.deliveries
        unsettled = [] if book is None else book.take_unsettled()
        orphans = [k for k in unsettled if chunk_parts(k) is not None]
        connector = self.sender.connector.current
        if orphans and connector is not None:
            logger.debug("dropping %d chunk(s) of refused or expired streams", len(orphans))
            self._drop(connector, orphans)
        return len(orphans)

    def abort(self, request_id: str) -> int:
        """Forget ``request_id``'s stream and drop every chunk it published (a request aborted
        mid-stream): its steps still queued are dropped and one running is waited for first,
        so nothing of the request is published after this returns and its blocks are no
        longer read. The number of chunk keys dropped (0: no stream)."""
        rid = str(request_id)
        self._settle_jobs(rid, cancel=True)
        with self._cv:
            self._done.pop(rid, None)
        return self._forget(rid)

    def _forget(self, rid: str) -> int:
        """:meth:`abort` without settling the request's steps (a step's own restart, a finish
        that already settled them)."""
        with self._lock:
            stream = self._streams.pop(rid, None)
        if stream is None:
            return 0
        if self.deliveries is not None:
            self.deliveries.forget_unsent(rid)
        return self._drop_stream(stream)

    def close(self) -> None:
        """Drop every queued step, wait for one running, stop the worker and abort every
        open stream (the edge's close). Idempotent."""
        with self._cv:
            self._closed = True
            self._jobs.clear()
            self._skipped.clear()
            self._cv.notify_all()
        if self._worker is not threading.current_thread():
            self._worker.join()
        with self._lock:
            streams = list(self._streams.values())
            self._streams.clear()
            self._done.clear()
        for stream in streams:
            self._drop_stream(stream)

    def _drop_stream(self, stream: _Stream) -> int:
        keys = list(stream.chunk_keys)
        if stream.pending is not None:
            keys += stream.pending.keys
        connector = self.sender.connector.current
        if connector is not None and keys:
            self._drop(connector, keys)
        return len(keys)

    @staticmethod
    def _drop(connector: OmniConnectorBase, keys: list[str]) -> None:
        """``cleanup`` of each chunk key this stream minted: the cleanup rule matches a chunk
        key alone (:data:`~omnikv.transfer.stream.manifest.CHUNK_MARK`), so nothing another
        request published goes with it. A key that is not a chunk key is never passed here."""
        for key in keys:
            if chunk_parts(key) is None:
                logger.error("not dropping %r: not a chunk key", key)
                continue
            try:
                connector.cleanup(key)
            except Exception as exc:  # a transport that cannot drop: the TTL still will
                logger.warning("Could not drop KV chunk %s: %s", key, exc)


def _layer_span(layers: Any, num_layers: int) -> tuple[int, int] | str | None:
    """A step's ``layers`` argument as ``(first, stop)`` of the stream's ``num_layers``
    (``None``: every layer), or why it is not one."""
    if layers is None:
        return None
    try:
        first, end = (int(v) for v in layers)
    except (TypeError, ValueError):
        return f"layers must be (first, stop), got {layers!r:.40}"
    if not 0 <= first < end <= num_layers:
        return f"layer group [{first}, {end}) is not within the {num_layers} layers"
    return None if (first, end) == (0, num_layers) else (first, end)


def _still_holds(
    stream: _Stream, transfer_id: str, batch: SendBatch, block_ids: Sequence[int]
) -> bool:
    """Whether what ``stream`` shipped is still the start of the request's KV (same transfer
    id, block size, cache dtype, layer count, and block ids)."""
    shipped = stream.block_ids
    return (
        stream.transfer_id == transfer_id
        and stream.block_size == batch.block_size
        and stream.cache_dtype == str(batch.cache_dtype)
        and stream.num_layers == len(batch.kv_caches)
        and [int(b) for b in block_ids[: len(shipped)]] == shipped
    )


# --------------------------------------------------------------------------------------------
