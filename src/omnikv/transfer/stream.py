"""Streaming a request's KV while it decodes: full blocks ship as they fill, the tail at finish.

With ``stream_kv: true`` the model runner calls the manager's ``stream_kv_blocks`` once per
step for each request still decoding (its ``entry`` has the shape of a ``finished_reqs`` entry:
``block_ids`` and ``seq_len``, the tokens whose KV is written). Each call ships the request's
*full* blocks not shipped yet as one **chunk**: a normal packed payload (stamped, sliced per
target rank as a whole send is) under ``<key>#c<n>`` for each of the request's keys.
``handle_finished_requests_kv_transfer`` then publishes, under the request's own keys, only the
**tail**: the tokens after the last chunk, the request's block ids and metadata, and the
manifest (header ``sm``: the stream id, the chunk count, each chunk's token range). Every piece
is format version 3, which a reader that predates streaming refuses (a clean ``corrupt``), so a
tail is never taken for a whole request's KV.

Sender (:class:`KVStreams`, owned by :class:`~omnikv.transfer.send.KVSender`):

* a step is synchronous and short: it gathers only the newly full blocks (work the finish would
  otherwise do), puts them with one attempt and a deadline of at most :data:`STEP_PUT_S`
  (``send_timeout`` if shorter), and never raises for a request's failure. Synchronous, not on
  a thread, because the chunks must be in the connector before the tail (the receiver trusts
  that order), the gather reads the engine's cache while the runner holds it, and a step's
  chunk is usually one block;
* a chunk that could not be published (no room in the pool within the step's deadline, a
  transport error) is dropped and its blocks go with a later chunk or the tail; after
  :data:`MAX_FAILED_STEPS` such steps in a row the stream ships no more (the tail takes the
  rest). A changed block list, block size, dtype or transfer id drops what the stream shipped
  and starts it again (at the finish: the request is sent whole). At most
  :data:`~omnikv.wire.format.MAX_STREAM_CHUNKS` chunks; later blocks go with the tail;
* :meth:`KVStreams.abort` (the manager's ``abort_kv_stream``: a request aborted mid-stream)
  drops every chunk it published (``connector.cleanup`` of each chunk key); so does a finish
  that failed, and closing the manager. At most ``capacity`` streams are open (the oldest is
  aborted first). A full block must not change once shipped (true of vLLM's paged cache).

Receiver (:class:`StreamAssembly`, one per receive, made by
:class:`~omnikv.transfer.receive.KVReceiver`): a payload under a request key that is a tail
makes it take the chunk keys of that key too (same metadata, same deadline), check every one
against the manifest as hostile input (count bounded before anything is waited for, ranges
contiguous from 0, stream id, request id, layers, dtypes, head shapes and token counts), and
concatenate along tokens: the result is exactly what a whole send of the request gives (ids,
block ids, metadata and bit-identical tensors). Every chunk taken gets the receive's verdict.
Per key, so receiving TP > sending TP (sender-side slices, receiver-side merge or slice) works
unchanged.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch

from omnikv._logging import RateLimitedLog
from omnikv.config import RetryPolicy
from omnikv.connectors.base import ManagedBuffer, OmniConnectorBase
from omnikv.errors import DecodeError, OmniKVError, PayloadRefused
from omnikv.topology.keys import build_send_keys
from omnikv.transfer.received import ReceivedChunk, ReceivedKV
from omnikv.transfer.send import KVSender, SendBatch, SendRefused, SendResult, SendStatus
from omnikv.transfer.sessions import PendingStamps, SessionGuard
from omnikv.wire.decode import DecodedKV, decode_kv
from omnikv.wire.format import MAX_STREAM_CHUNKS, StreamMark

__all__ = [
    "MAX_FAILED_STEPS",
    "STEP_PUT_S",
    "ChunkFeed",
    "ChunkSource",
    "EagerChunks",
    "EagerWait",
    "KVStreams",
    "Seal",
    "ShippedChunk",
    "StreamAssembly",
    "StreamProgress",
    "TailPlan",
    "chunk_key",
    "chunk_parts",
    "pieces_out_of_order",
]

logger = logging.getLogger(__name__)
_outsider = RateLimitedLog(logger)  # lines a peer, client or forger can cause

#: Longest a streaming step waits for room to put a chunk (seconds; ``send_timeout`` if less).
STEP_PUT_S = 0.25
#: Failed chunk puts in a row after which a stream ships no more (the tail takes the rest).
MAX_FAILED_STEPS = 3
#: Streams open at once per sender (the oldest is aborted beyond it).
DEFAULT_CAPACITY = 4096
_ONE_ATTEMPT = RetryPolicy(attempts=1)


def chunk_key(key: str, index: int) -> str:
    """The key of chunk ``index`` of a stream whose request is published under ``key``."""
    return f"{key}#c{index}"


def chunk_parts(key: str) -> tuple[str, int] | None:
    """The request key and chunk index of a :func:`chunk_key`; ``None`` for any other key."""
    base, sep, index = key.rpartition("#c")
    return (base, int(index)) if sep and index.isdigit() else None


def _decode_buffer(buf: ManagedBuffer, max_header_bytes: int) -> DecodedKV:
    """``buf``'s payload decoded (views of its host array, else of its tensor)."""
    host = buf.host_array
    payload: Any = host if host is not None else buf.tensor
    return decode_kv(payload, max_header_bytes=max_header_bytes)


@dataclass(frozen=True)
class StreamProgress:
    """What one ``stream_kv_blocks`` call did for a request: ``shipped`` tokens in
    ``chunks`` chunks so far, ``new`` of them by this call (``nbytes`` published for them);
    ``reason`` says why it shipped nothing or stopped the stream (``None``: nothing to say)."""

    request_id: str
    shipped: int = 0
    chunks: int = 0
    new: int = 0
    reason: str | None = None
    nbytes: int = 0


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


class TailPlan(NamedTuple):
    """What a streamed request's finish sends (:meth:`KVStreams.tail`): the tail's blocks
    (:meth:`blocks`), its manifest (the header's ``sm``) and the chunk keys it refers to."""

    first_block: int
    manifest: dict[str, Any]
    chunk_keys: list[str]

    def blocks(
        self, block_ids: Sequence[int], seq_len: int, block_size: int
    ) -> tuple[Sequence[int], int]:
        """The block ids and token count of the tail (tokens after the last chunk). An empty
        tail still names one block (the planner needs one; zero tokens are read from it)."""
        ids = block_ids[self.first_block :] or block_ids[self.first_block - 1 : self.first_block]
        return ids, seq_len - self.first_block * block_size


class KVStreams:
    """The sender's open streams, one per request shipping blocks while it decodes.

    Called by the manager (:meth:`ship` per step, :meth:`abort`, :meth:`close`) and by its
    :class:`~omnikv.transfer.send.KVSender` at the finish (:meth:`tail`, :meth:`settle`).
    Thread-safe; steps of one request are expected from one thread at a time (the runner's).
    """

    def __init__(self, sender: KVSender, *, capacity: int = DEFAULT_CAPACITY) -> None:
        self.sender = sender
        self.capacity = capacity
        self._lock = threading.Lock()
        self._streams: OrderedDict[str, _Stream] = OrderedDict()
        self._orphans: list[str] = []  # chunk keys of refused or expired streams, to drop

    # -- per step -----------------------------------------------------------------------------
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
        """Ship ``request_id``'s full blocks not shipped yet as one chunk; never raises for the
        request's failure (the progress says why nothing went). ``seal`` (optional) is asked
        for the chunk's own metadata (see :class:`Seal`) before the chunk is made.

        With ``layers`` (``[first, stop)`` of ``kv_caches``, which still names every layer) the
        chunk holds only those layers: a *layer group*, shipped as soon as the caller's forward
        pass has written them. Groups of one range come in layer order, the first from layer
        0, each starting where the one before stopped; the range is shipped once its last
        layer is. The first group takes the newly full blocks (when there are none, the
        step's later groups ship nothing either); later ones keep that range. A group out of
        that order (or one that cannot be published) drops the range's groups and stops the
        stream: the finish sends the rest with the tail."""
        rid = str(request_id)
        self.drop_orphans()
        sender = self.sender
        from_stage, to_stage = sender.stages
        connector = sender.connector.get() if sender.enabled else None
        if from_stage is None or to_stage is None or connector is None:
            return StreamProgress(rid, reason="not sending (need_send_cache, stages, connector)")
        try:
            step = self._step(rid, entry, kv_caches, block_size, cache_dtype, resolver)
        except (SendRefused, OmniKVError) as exc:
            logger.debug("Not streaming KV of %s: %s", rid, exc)
            self.abort(rid)
            return StreamProgress(rid, reason=str(exc))
        stream, ids, batch = step
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
            meta = _sealed(seal, start, stop, ids, span)
            payloads = sender.plan_blocks(stream.transfer_id, keys, ids, batch, mark, meta)
        except (SendRefused, OmniKVError) as exc:
            return self._stop(rid, stream, f"chunk {index} cannot be made: {exc}", connector)
        sender.listen(connector)
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
        self,
        rid: str,
        entry: Any,
        kv_caches: Any,
        block_size: Any,
        cache_dtype: Any,
        resolver: Callable[[str], str] | None,
    ) -> tuple[_Stream, list[int], SendBatch]:
        """The request's stream (opened, or restarted when what it shipped no longer holds),
        the ids of its newly full blocks, and the step's batch; raises the reason it cannot
        stream."""
        sender = self.sender
        deadline = time.monotonic() + min(STEP_PUT_S, sender.options.send_timeout)
        batch = sender.prepare(kv_caches, block_size, cache_dtype, resolver, deadline)
        if not isinstance(entry, Mapping):
            raise SendRefused(f"entry must be a dict, got {type(entry).__name__}")
        block_ids, seq_len = entry.get("block_ids"), entry.get("seq_len")
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 0:
            raise SendRefused(f"seq_len must be an int >= 0, got {seq_len!r:.40}")
        if not isinstance(block_ids, list | tuple) or not all(type(b) is int for b in block_ids):
            raise SendRefused("block_ids must be a list of ints")
        full = min(seq_len // batch.block_size, len(block_ids))
        transfer_id = sender.transfer_id(rid, resolver)
        with self._lock:
            stream = self._streams.get(rid)
        if stream is not None and not _still_holds(stream, transfer_id, batch, block_ids):
            logger.debug("KV stream of %s restarts: its blocks or caches changed", rid)
            self.abort(rid)
            stream = None
        if stream is None:
            from_stage, to_stage = sender.stages
            assert from_stage is not None and to_stage is not None
            keys = build_send_keys(
                sender.topology, transfer_id, from_stage, to_stage, sender.hooks.send_keys
            )
            stream = _Stream(
                transfer_id,
                secrets.token_hex(8),
                batch.block_size,
                str(cache_dtype),
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
        it whole)."""
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
            self.abort(request_id)
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
        matches its blocks (it then sends the request whole)."""
        with self._lock:
            stream = self._streams.get(str(request_id))
            return [] if stream is None else [c._replace(seal=dict(c.seal)) for c in stream.chunks]

    def settle(self, result: SendResult) -> None:
        """The finish of ``result.request_id`` ended: a sent stream's chunks are the
        receiver's now; those of a finish that failed or was skipped are dropped."""
        if result.status in (SendStatus.SENT, SendStatus.DELIVERED):
            with self._lock:
                self._streams.pop(result.request_id, None)
        else:
            self.abort(result.request_id)

    # -- dropping -------------------------------------------------------------------------------
    def note_unsettled(self, keys: list[str]) -> None:
        """The delivery book's hook: a refused or expired request's keys that had no verdict.
        Its chunks among them will never be taken; they are dropped at this sender's next
        stream step or finish (never here: this runs on the connector's listener thread)."""
        chunks = [k for k in keys if chunk_parts(k) is not None]
        if chunks:
            with self._lock:
                self._orphans.extend(chunks)

    def drop_orphans(self) -> int:
        """Drop the chunks :meth:`note_unsettled` noted (called on the sender's thread, by
        each stream step and finish); how many keys were dropped."""
        with self._lock:
            orphans, self._orphans = self._orphans, []
        connector = self.sender.connector.current
        if orphans and connector is not None:
            logger.debug("dropping %d chunk(s) of refused or expired streams", len(orphans))
            self._drop(connector, orphans)
        return len(orphans)

    def abort(self, request_id: str) -> int:
        """Forget ``request_id``'s stream and drop every chunk it published (a request aborted
        mid-stream); the number of chunk keys dropped (0: no stream)."""
        with self._lock:
            stream = self._streams.pop(str(request_id), None)
        return 0 if stream is None else self._drop_stream(stream)

    def close(self) -> None:
        """Abort every open stream (the manager's close). Idempotent."""
        with self._lock:
            streams = list(self._streams.values())
            self._streams.clear()
        for stream in streams:
            self._drop_stream(stream)

    def open_streams(self) -> list[str]:
        """The requests with an open stream (tests, diagnostics)."""
        with self._lock:
            return list(self._streams)

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
        """``cleanup`` of each key: the rule it matches by takes a key as its own id."""
        for key in keys:
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
# The receiver's side
# --------------------------------------------------------------------------------------------
class ChunkSource(Protocol):
    """Where one receive takes a stream's chunks from (the receiver's connector, deadline and
    abort event): ``take`` returns the payload under ``key`` or raises the receive's typed
    miss (timeout, peer gone, cancelled)."""

    def take(self, key: str, metadata: dict[str, Any] | None) -> ManagedBuffer: ...


class EagerWait(Protocol):
    """One connector wait of a chunk key until the receive's deadline, ended early (raising
    :class:`~omnikv.errors.ReceiveCancelled`) once ``stop`` is set; ``None`` at the deadline."""

    def __call__(
        self, key: str, metadata: dict[str, Any] | None, stop: threading.Event
    ) -> ManagedBuffer | None: ...


def _forms(chunk: DecodedKV, first: int) -> dict[int, tuple[Any, Any]]:
    """Per request layer (the chunk's from ``first`` on) the K and V forms a stream's chunks
    share: ``None`` for a skipped layer, else the dtype and the shape after the token
    dimension."""

    def form(t: torch.Tensor | None) -> tuple[torch.dtype, tuple[int, ...]] | None:
        return None if t is None else (t.dtype, tuple(t.shape[1:]))

    pairs = zip(chunk.key_cache, chunk.value_cache, strict=True)
    return {first + at: (form(k), form(v)) for at, (k, v) in enumerate(pairs)}


class ChunkFeed:
    """A receive's ``on_chunk`` and the chunks it has been handed (one request key's).

    :meth:`hand` gives it chunk after chunk, in order, each first checked to continue the ones
    before it as hostile input (its index, a range starting where the last one stopped, the
    same stream, request id, layers, dtypes and head shapes, the token count its range says).
    Called by :class:`EagerChunks`'s lane as chunks arrive, and by :class:`StreamAssembly`
    for any chunk the lane did not hand over. With ``guard`` a chunk's stamp is checked
    (:meth:`SessionGuard.check <omnikv.transfer.sessions.SessionGuard.check>`) before it is
    handed over, so that a replayed chunk (a copy of one this receiver already took) never
    reaches ``on_chunk``, and remembered only once ``on_chunk`` took it (a chunk it refuses,
    such as a forgery failing the consumer's MAC, leaves the guard as it was). After the first
    refusal nothing more is handed over (:attr:`refusal`; :attr:`corrupt` says whether the
    chunk itself was inconsistent, as opposed to refused by ``on_chunk`` or the guard), and
    ``on_refusal`` is called (the receive stops waiting for the tail). :meth:`close` waits for
    a call in flight and refuses every later one, so that a receive that returned never writes
    again. Thread-safe.
    """

    def __init__(
        self,
        on_chunk: Callable[[ReceivedChunk], str | None],
        *,
        on_refusal: Callable[[], object] | None = None,
        guard: SessionGuard | None = None,
    ) -> None:
        self._on_chunk = on_chunk
        self._on_refusal = on_refusal
        self._guard = guard
        self._lock = threading.Lock()
        self._closed = False
        self._fed: list[str] = []
        #: the stream id and request id of the chunks handed over
        self._ident: tuple[str, str] | None = None
        #: the stream's layer count, and per layer index its K and V forms
        self._layers: int | None = None
        self._forms: dict[int, tuple[Any, Any]] = {}
        #: the next layer due in the range being handed over by layer groups (0: a new range)
        self._next_layer = 0
        self._range = (0, 0)
        #: tokens handed over for every layer so far (the first token the tail must start at)
        self.end = 0
        self.refusal: str | None = None
        self.corrupt = False

    def has(self, ckey: str) -> bool:
        """Whether the chunk taken under ``ckey`` was handed over."""
        with self._lock:
            return ckey in self._fed

    def hand(self, ckey: str, index: int, chunk: DecodedKV) -> str | None:
        """Hand chunk ``index`` (taken under ``ckey``) to ``on_chunk``: ``None`` once it took
        it, else why not."""
        with self._lock:
            if self.refusal is not None:
                return self.refusal
            if self._closed:
                return "the receive ended"
            span = self._continues(chunk, index)
            self.corrupt = isinstance(span, str)
            if isinstance(span, str):
                self._refused(span)
                return span
            assert chunk.stream is not None  # checked by _continues
            start, stop = (int(v) for v in chunk.stream.r[0])
            pending = None if self._guard is None else self._guard.pending()
            why = (
                self._admitted(pending, chunk)
                or self._call(chunk, index, start, stop, span)
                or self._admitted(pending, None)
            )
            if why is not None:
                self._refused(why)
                return why
            self._took(ckey, chunk, span)
            return None

    def refuse(self, why: str, *, corrupt: bool) -> None:
        """Refuse the stream without handing a chunk over (one that does not even decode)."""
        with self._lock:
            if self.refusal is None:
                self.corrupt = corrupt
                self._refused(why)

    def _refused(self, why: str) -> None:
        self.refusal = why
        if self._on_refusal is not None:
            self._on_refusal()

    def _continues(self, chunk: DecodedKV, index: int) -> tuple[int, int, int] | str:
        """The chunk's layers ``(first, stop, stream's layer count)`` when it is the next one
        (the next range from layer 0, or the next layer group of the range being handed
        over), else why not."""
        mark = chunk.stream
        if mark is None or mark.k != "chunk" or mark.n != index or len(mark.r) != 1:
            return f"not chunk {index} of a stream ({mark!r:.80})"
        if index != len(self._fed):
            return f"chunk {index} came before chunk {len(self._fed)}"
        span = _span(mark, chunk.num_layers)
        if isinstance(span, str):
            return f"chunk {index}: {span}"
        first, end, layers = span
        if self._layers is not None and layers != self._layers:
            return f"chunk {index} is of a stream of {layers} layers, not {self._layers}"
        start, stop = (int(v) for v in mark.r[0])
        if self._next_layer == 0 and (start != self.end or stop <= start):
            return f"chunk {index} covers [{start}, {stop}), expected to start at {self.end}"
        if self._next_layer and (start, stop) != self._range:
            return f"chunk {index} covers [{start}, {stop}), expected {list(self._range)}"
        if first != self._next_layer:
            return f"chunk {index} holds layers [{first}, {end}), expected from {self._next_layer}"
        if self._ident is not None and (mark.id, chunk.request_id) != self._ident:
            return f"chunk {index} is not of the stream or request of the chunks before"
        for layer, form in _forms(chunk, first).items():
            if self._forms.get(layer, form) != form:
                return f"chunk {index}'s layer {layer} is not of the chunks before"
        tensors = [t for t in (*chunk.key_cache, *chunk.value_cache) if t is not None]
        if not tensors or any(t.dim() < 1 or t.shape[0] != stop - start for t in tensors):
            return f"chunk {index}'s tensors do not hold its {stop - start} tokens"
        return span

    def _took(self, ckey: str, chunk: DecodedKV, span: tuple[int, int, int]) -> None:
        """Note a chunk ``on_chunk`` took (called with the lock held)."""
        mark = chunk.stream
        assert mark is not None
        first, end, layers = span
        self._fed.append(ckey)
        self._ident = (mark.id, chunk.request_id)
        self._layers = layers
        self._forms.update(_forms(chunk, first))
        self._range = (int(mark.r[0][0]), int(mark.r[0][1]))
        self._next_layer = 0 if end == layers else end
        if self._next_layer == 0:
            self.end = self._range[1]

    def _admitted(self, pending: PendingStamps | None, chunk: DecodedKV | None) -> str | None:
        """Why the guard refuses the chunk's stamp (a duplicate, a stale epoch); ``None`` when
        it passes, or without a guard. With ``chunk`` ``None``: remembers the stamp checked
        (called once ``on_chunk`` took the chunk, so a chunk it refused leaves no mark)."""
        if pending is None:
            return None
        try:
            if chunk is None:
                pending.commit()
            else:
                pending.admit(chunk.stamp, chunk.request_id)
        except PayloadRefused as exc:
            return str(exc)
        return None

    def _call(
        self, chunk: DecodedKV, index: int, start: int, stop: int, span: tuple[int, int, int]
    ) -> str | None:
        piece = ReceivedChunk(
            chunk.request_id,
            index,
            start,
            stop,
            chunk.metadata,
            list(chunk.key_cache),
            list(chunk.value_cache),
            span[0],
            span[2],
        )
        try:
            return self._on_chunk(piece)
        except Exception as exc:  # the caller's bug refuses this receive, nothing else
            _outsider.exception("on_chunk raised for chunk %d of %s", index, chunk.request_id)
            return f"on_chunk raised {type(exc).__name__}: {exc}"

    def error(self, key: str) -> OmniKVError:
        """The refusal as the receive's error for request key ``key``: the stream is corrupt,
        or ``on_chunk`` refused a chunk (the sender is told either way)."""
        why = self.refusal or "no chunk was refused"
        if self.corrupt:
            return _corrupt(key, why)
        return PayloadRefused(f"KV chunk of {key} refused: {why}")

    def close(self) -> None:
        """No chunk is handed over after this returns (waits for a call in flight)."""
        with self._lock:
            self._closed = True


class _Joined:
    """Chunks 0, 1, ... of one key copied in order into growing per-layer tensors (the
    assembly's copy, done while the request still decodes): ``bufs[i]`` is the buffer chunk
    ``i`` came in, ``ends[i]`` the token count after it."""

    __slots__ = ("bufs", "ends", "keys", "values")

    def __init__(self) -> None:
        self.keys: list[torch.Tensor | None] = []
        self.values: list[torch.Tensor | None] = []
        self.bufs: list[ManagedBuffer] = []
        self.ends: list[int] = [0]

    def add(self, chunk: DecodedKV, buf: ManagedBuffer) -> bool:
        """Append ``chunk``'s tokens (growing the tensors by doubling); ``False``, changing
        nothing, when its layers do not match the chunks before it."""
        n = _tokens("chunk", chunk)
        if not self.bufs:
            self.keys = [_grown(None, t, 0, n) for t in chunk.key_cache]
            self.values = [_grown(None, t, 0, n) for t in chunk.value_cache]
        elif not (_fits(self.keys, chunk.key_cache) and _fits(self.values, chunk.value_cache)):
            return False
        at = self.ends[-1]
        for dests, parts in ((self.keys, chunk.key_cache), (self.values, chunk.value_cache)):
            for i, t in enumerate(parts):
                if t is not None:
                    dests[i] = _grown(dests[i], t, at, n)
                    dests[i][at : at + n].copy_(t)  # type: ignore[index]
        self.bufs.append(buf)
        self.ends.append(at + n)
        return True


def _fits(dests: list[torch.Tensor | None], parts: list[torch.Tensor | None]) -> bool:
    """Whether ``parts`` (one chunk's layers) have the layers, dtypes and shapes of ``dests``."""
    if len(dests) != len(parts):
        return False
    for d, t in zip(dests, parts, strict=True):
        if (d is None) != (t is None):
            return False
        if d is not None and t is not None and (d.dtype != t.dtype or d.shape[1:] != t.shape[1:]):
            return False
    return True


def _grown(
    dest: torch.Tensor | None, like: torch.Tensor | None, used: int, more: int
) -> torch.Tensor | None:
    """``dest`` with room for ``more`` tokens after its first ``used`` (twice what is needed
    when it must grow; the copy of the ``used`` tokens happens here, in the background)."""
    if like is None:
        return None
    if dest is not None and dest.shape[0] >= used + more:
        return dest
    bigger = torch.empty((2 * (used + more), *like.shape[1:]), dtype=like.dtype)
    if dest is not None and used:
        bigger[:used].copy_(dest[:used])
    return bigger


class _Lane:
    """One request key's chunks as :class:`EagerChunks` takes them: the next index it waits
    for, whether it stopped, and what of them is already joined."""

    __slots__ = ("done", "join_lock", "joined", "metadata", "next")

    def __init__(self, metadata: dict[str, Any] | None, *, join: bool) -> None:
        self.metadata = metadata
        self.next = 0
        self.done = False
        self.joined: _Joined | None = _Joined() if join else None
        self.join_lock = threading.Lock()


class EagerChunks:
    """A stream's chunks taken as they are published, while the receive still waits for the
    tail: what makes streaming pay on a link.

    Made by :meth:`KVReceiver.fetch <omnikv.transfer.receive.KVReceiver.fetch>` when the
    receiving stage has ``stream_kv``, before it waits for the request's keys: one thread per
    key takes ``<key>#c0``, ``#c1``, ... in order, each with ``wait`` (the receive's deadline,
    abortable), and holds them. It is the :class:`ChunkSource` of the receive's
    :class:`StreamAssembly`: a chunk already here is handed over at once, the one its thread
    waits for is waited for, and any other (its thread stopped: deadline, error) is taken from
    ``fallback`` as without this class. :meth:`stop` ends the threads (within one wait slice,
    without waiting for them) and returns the chunks taken and never used: a stream restarted
    after its first chunks leaves some (the caller refuses and releases them; the assembly of
    the new stream takes those keys afresh, see :meth:`retake`). With a ``feed`` (a receive
    with ``on_chunk``), each chunk is handed to it as it arrives instead of being joined.
    Thread-safe.
    """

    def __init__(
        self,
        wait: EagerWait,
        keys: Sequence[tuple[str, dict[str, Any] | None]],
        fallback: ChunkSource,
        *,
        max_header_bytes: int,
        name: str = "kv-chunks",
        feed: ChunkFeed | None = None,
    ) -> None:
        self._wait = wait
        self._fallback = fallback
        self._max_header_bytes = max_header_bytes
        self._feed = feed
        self._served: dict[str, ManagedBuffer] = {}
        self._decoded: dict[str, DecodedKV] = {}
        self._stale: list[tuple[str, ManagedBuffer]] = []  # chunks of an earlier stream
        self._stop = threading.Event()
        self._cond = threading.Condition()
        self._held: dict[str, ManagedBuffer] = {}
        self._closed = False
        self._lanes = {key: _Lane(meta, join=feed is None) for key, meta in keys}
        self._threads = [
            threading.Thread(target=self._run, args=(key,), name=f"{name}-{i}", daemon=True)
            for i, key in enumerate(self._lanes)
        ]
        for t in self._threads:
            t.start()

    def _run(self, key: str) -> None:
        lane = self._lanes[key]
        try:
            for index in range(MAX_STREAM_CHUNKS):
                ckey = chunk_key(key, index)
                buf = self._wait(ckey, lane.metadata, self._stop)
                if buf is None:
                    return
                refused = False
                if self._feed is None:
                    chunk = self._join(lane, buf)
                else:  # handed over now; a refusal ends the lane (the assembly raises it)
                    chunk, refused = self._hand(ckey, index, buf, self._feed)
                with self._cond:
                    if not self._closed:
                        self._held[ckey] = buf
                        if chunk is not None:
                            self._decoded[ckey] = chunk
                        lane.next = index + 1
                        self._cond.notify_all()
                        if refused:
                            return
                        continue
                # taken after stop() collected the rest (a wait that outlived its slice)
                _outsider.warning("dropped chunk %s, taken after its receive ended", ckey)
                buf.release()
                return
        except OmniKVError as exc:  # the assembly's own take reports a missing chunk
            logger.debug("taking the chunks of %s ahead ended: %s", key, exc)
        except Exception:  # a bug must not kill the receive: its fallback still works
            logger.exception("taking the chunks of %s ahead failed", key)
        finally:
            with self._cond:
                lane.done = True
                self._cond.notify_all()

    def _hand(
        self, ckey: str, index: int, buf: ManagedBuffer, feed: ChunkFeed
    ) -> tuple[DecodedKV | None, bool]:
        """Decode the chunk just taken and hand it to ``feed`` (on the lane's thread); the
        decoded chunk and whether it was refused. One that does not decode is refused as
        corrupt (the assembly decodes it again and raises the decoder's error)."""
        try:
            chunk = _decode_buffer(buf, self._max_header_bytes)
        except (OmniKVError, ValueError, RuntimeError) as exc:
            feed.refuse(f"chunk {index} does not decode: {exc}", corrupt=True)
            return None, True
        return chunk, feed.hand(ckey, index, chunk) is not None

    def _join(self, lane: _Lane, buf: ManagedBuffer) -> DecodedKV | None:
        """Decode the chunk just taken and append it to its lane's joined tensors (on the
        lane's thread, before the chunk is handed over); the decoded chunk, for the assembly
        to check without decoding it again. A chunk that does not decode or does not fit ends
        the joining of that key: the assembly then joins it as without this."""
        with lane.join_lock:
            joined = lane.joined
            if joined is None:
                return None
            chunk = None
            try:
                chunk = _decode_buffer(buf, self._max_header_bytes)
                grouped = chunk.stream is not None and chunk.stream.l is not None
                ok = not grouped and joined.add(chunk, buf)  # the assembly joins groups
            except (OmniKVError, ValueError, RuntimeError) as exc:
                logger.debug("chunk not joined ahead: %s", exc)
                ok = False
            if not ok:
                lane.joined = None
            return chunk

    def retake(
        self, key: str, metadata: dict[str, Any] | None, stale: ManagedBuffer
    ) -> ManagedBuffer:
        """The chunk under ``key`` taken afresh from ``fallback``: the one handed over
        (``stale``) belongs to an earlier stream of the request (its sender restarted the
        stream after this lane took it). ``stale`` goes back with :meth:`stop`'s unused chunks
        (refused, released) and the key's joined tensors are not used."""
        lane = self._lane_of(key)
        if lane is not None:
            with lane.join_lock:
                lane.joined = None
        with self._cond:
            self._served.pop(key, None)
            self._decoded.pop(key, None)
            self._stale.append((key, stale))
        return self._fallback.take(key, metadata)

    def decoded(self, key: str) -> DecodedKV | None:
        """The chunk handed over under ``key`` as its lane decoded it (``None``: decode it)."""
        with self._cond:
            return self._decoded.get(key)

    def joined(self, key: str, count: int, tail: DecodedKV) -> tuple[list[Any], list[Any]] | None:
        """The layers of ``key``'s first ``count`` chunks and ``tail``, joined: the tensors the
        lane grew while the chunks arrived, with ``tail`` copied after them (views of the first
        tokens of each). ``None`` when the lane did not join exactly the chunks the assembly
        took (and checked) from here, or the tail does not fit: the caller joins them itself.
        Called by :meth:`StreamAssembly.assemble` once every chunk passed its checks."""
        lane = self._lanes.get(key)
        if lane is None:
            return None
        with lane.join_lock:
            joined, lane.joined = lane.joined, None  # used once; a late chunk joins nothing
            if joined is None or len(joined.bufs) < count:
                return None
            with self._cond:
                served = [self._served.get(chunk_key(key, i)) for i in range(count)]
            if any(b is not joined.bufs[i] for i, b in enumerate(served)):
                return None
            at, n = joined.ends[count], _tokens(key, tail)
            out: list[list[Any]] = [[], []]
            for which, dests, parts in (
                (0, joined.keys, tail.key_cache),
                (1, joined.values, tail.value_cache),
            ):
                if not _fits(dests, parts):
                    return None
                for dest, t in zip(dests, parts, strict=True):
                    room = _grown(dest, t, at, n)
                    if room is None or t is None:
                        out[which].append(None)
                        continue
                    room[at : at + n].copy_(t)
                    out[which].append(room[: at + n])
            return out[0], out[1]

    def take(self, key: str, metadata: dict[str, Any] | None) -> ManagedBuffer:
        parts = chunk_parts(key)
        lane = self._lane_of(key)
        with self._cond:
            while True:
                buf = self._held.pop(key, None)
                if buf is not None:
                    self._served[key] = buf
                    return buf
                if parts is None or lane is None or lane.done or lane.next != parts[1]:
                    break  # this class will not take it: take it directly
                self._cond.wait()
        return self._fallback.take(key, metadata)

    def stop(self) -> list[tuple[str, dict[str, Any] | None, ManagedBuffer]]:
        """Tell the threads to end (each within one wait slice) and hand back what they took
        and nobody used (key, metadata, buffer). Never waits: a chunk a thread takes after
        this is released there, unused."""
        self._stop.set()
        with self._cond:
            self._closed = True
            held, self._held = self._held, {}
            unused = [*held.items(), *self._stale]
            self._stale = []
        return [(k, self._metadata_of(k), b) for k, b in unused]

    def _lane_of(self, key: str) -> _Lane | None:
        """The lane of chunk key ``key``'s request key (``None``: not a chunk of ours)."""
        parts = chunk_parts(key)
        return None if parts is None else self._lanes.get(parts[0])

    def _metadata_of(self, key: str) -> dict[str, Any] | None:
        """The wait metadata of chunk key ``key``'s request key."""
        lane = self._lane_of(key)
        return None if lane is None else lane.metadata


class StreamAssembly:
    """The streamed keys of one receive: their chunks taken, checked and joined to the tail.

    Made by :meth:`KVReceiver.fetch <omnikv.transfer.receive.KVReceiver.fetch>` per receive.
    :attr:`taken` lists every chunk wait that took a payload (each gets the receive's
    verdict); :meth:`release` frees any chunk memory still held (called in the receive's
    ``finally``). Raises :class:`~omnikv.errors.DecodeError` for anything inconsistent.
    """

    def __init__(
        self,
        source: ChunkSource,
        *,
        max_header_bytes: int,
        guard: SessionGuard | PendingStamps | None = None,
        feed: ChunkFeed | None = None,
    ) -> None:
        self.source = source
        self.max_header_bytes = max_header_bytes
        self.guard = guard
        self.feed = feed
        self.taken: list[tuple[str, dict[str, Any] | None]] = []
        self._held: list[ManagedBuffer] = []

    def assemble(
        self, key: str, metadata: dict[str, Any] | None, tail: DecodedKV, nbytes: int
    ) -> ReceivedKV:
        """The whole KV of the stream whose tail (decoded, ``nbytes`` on the wire) came under
        ``key``: exactly what a whole send would have given. Its tensors are new memory."""
        mark = tail.stream
        if mark is None or mark.k != "tail":
            raise _corrupt(key, "a stream chunk was published under a request's key")
        pieces = _pieces(key, mark, tail.num_layers)
        tail_tokens = _tokens(key, tail)
        seq_len = tail.metadata.get("seq_len")
        shipped = pieces[-1].stop
        total = shipped + tail_tokens
        if isinstance(seq_len, int) and not isinstance(seq_len, bool) and seq_len != total:
            raise _corrupt(key, f"chunks and tail hold {total} tokens, metadata seq_len={seq_len}")
        chunks: list[DecodedKV] = []
        held = len(self._held)
        for index, piece in enumerate(pieces):
            ckey = chunk_key(key, index)
            buf = self.source.take(ckey, metadata)
            self.taken.append((ckey, metadata))
            self._held.append(buf)
            known = self.source.decoded(ckey) if isinstance(self.source, EagerChunks) else None
            chunk = known if known is not None else self._decode(buf)
            if isinstance(self.source, EagerChunks) and _of_another_stream(chunk, mark.id):
                if self.feed is not None and self.feed.has(ckey):
                    raise _corrupt(key, "its stream restarted after chunks were handed over")
                buf = self.source.retake(ckey, metadata, self._held.pop())
                self._held.append(buf)
                chunk = self._decode(buf)
            if self.guard is not None and self.feed is None:  # the feed admits what it hands
                self.guard.admit(chunk.stamp, tail.request_id)
            _check_chunk(ckey, chunk, tail, mark.id, index, piece)
            if self.feed is not None:
                self._hand(key, ckey, index, chunk)
            else:
                chunks.append(chunk)
        if self.feed is not None:
            return self._tail_only(tail, shipped, nbytes, held)
        ahead = None
        if isinstance(self.source, EagerChunks):  # joined while the chunks arrived
            ahead = self.source.joined(key, len(pieces), tail)
        caches = list(ahead) if ahead is not None else _joined(pieces, chunks, tail)
        size = nbytes + self._release_from(held)
        return ReceivedKV(
            tail.request_id, tail.block_ids, tail.metadata, caches[0], caches[1], size
        )

    def _hand(self, key: str, ckey: str, index: int, chunk: DecodedKV) -> None:
        """Chunk ``index`` handed to the receive's ``on_chunk`` (now, unless its lane did as it
        arrived); raises the feed's refusal."""
        feed = self.feed
        assert feed is not None
        if not feed.has(ckey) and feed.hand(ckey, index, chunk) is not None:
            raise feed.error(key)

    def _tail_only(self, tail: DecodedKV, offset: int, nbytes: int, held: int) -> ReceivedKV:
        """The KV after the chunks handed to ``on_chunk`` (tokens from ``offset``): the tail's
        tensors, copied (they are small and their buffer is released after this)."""
        size = nbytes + self._release_from(held)
        return ReceivedKV(
            tail.request_id,
            tail.block_ids,
            tail.metadata,
            [None if t is None else t.clone() for t in tail.key_cache],
            [None if t is None else t.clone() for t in tail.value_cache],
            size,
            token_offset=offset,
        )

    def _release_from(self, held: int) -> int:
        """Release the chunks held from index ``held`` on (this assembly's, once their
        tokens are copied out or handed over); their bytes on the wire."""
        bufs = self._held[held:]
        del self._held[held:]
        size = sum(b.size for b in bufs)
        for buf in bufs:
            buf.release()
        return size

    def _decode(self, buf: ManagedBuffer) -> DecodedKV:
        return _decode_buffer(buf, self.max_header_bytes)

    def release(self) -> None:
        """Release every chunk still held (after a failure); idempotent."""
        held, self._held = self._held, []
        for buf in held:
            buf.release()


def _corrupt(key: str, msg: str) -> DecodeError:
    return DecodeError(f"corrupt KV stream under {key}: {msg}")


class _Piece(NamedTuple):
    """One chunk as the manifest lists it: tokens ``[start, stop)`` of layers
    ``[first, end)``."""

    start: int
    stop: int
    first: int
    end: int


def _pieces(key: str, mark: StreamMark, layers: int) -> list[_Piece]:
    """The manifest's chunks, checked: ``n`` of them (1 to the maximum), their ranges
    contiguous from token 0 and none empty; with layer spans (``l``, ``lc`` = the tail's
    ``layers``), each range's groups in layer order from 0 to the last layer."""
    count, ranges = mark.n, mark.r
    if not 1 <= count <= MAX_STREAM_CHUNKS or len(ranges) != count:
        raise _corrupt(key, f"manifest claims {count} chunks with {len(ranges)} ranges")
    if mark.l is None:
        if mark.lc is not None:
            raise _corrupt(key, "manifest names a layer count without layer spans")
        spans: list[tuple[int, int]] = [(0, layers)] * count
    elif mark.lc != layers or len(mark.l) != count:
        raise _corrupt(
            key,
            f"manifest's {len(mark.l)} layer spans of {mark.lc} layers do not fit its {count} "
            f"chunks of {layers} layers",
        )
    else:
        spans = list(mark.l)
    pieces = [_Piece(a, b, f, e) for (a, b), (f, e) in zip(ranges, spans, strict=True)]
    why = pieces_out_of_order(pieces, layers)
    if why is not None:
        raise _corrupt(key, why)
    return pieces


def pieces_out_of_order(
    pieces: Sequence[tuple[int, int, int, int]], num_layers: int, noun: str = "chunk"
) -> str | None:
    """Why ``pieces`` (``(start, stop, first layer, layer stop)`` each, in order) do not tile a
    stream, or ``None``: token ranges contiguous from 0 and none empty, each range's layer
    groups consecutive from layer 0 to ``num_layers`` (a whole piece: ``(0, num_layers)``).
    The one check of a stream's layout, for a manifest (:class:`StreamAssembly`) and for the
    vLLM finish's sealed ranges (``noun`` names a piece in the reason)."""
    at, layer = 0, 0
    for i, (start, stop, first, end) in enumerate(pieces):
        if layer == 0 and (start != at or stop <= start):
            return f"{noun} {i} covers [{start}, {stop}), expected to start at {at}"
        if layer and (start, stop) != tuple(pieces[i - 1][:2]):
            return f"{noun} {i} covers [{start}, {stop}), not its range's layers"
        if first != layer or not first < end <= num_layers:
            return (
                f"{noun} {i} holds layers [{first}, {end}), expected from {layer} of {num_layers}"
            )
        layer = 0 if end == num_layers else end
        at = stop if layer == 0 else at
    if layer:
        return f"the last {noun}'s range lacks its layers from {layer}"
    return None


def _span(mark: StreamMark, num_layers: int) -> tuple[int, int, int] | str:
    """A chunk's layers ``(first, stop, stream's layer count)``: its own span when it is a
    layer group, else all ``num_layers`` of them; a string says why its mark is inconsistent."""
    if mark.l is None:
        if mark.lc is not None:
            return "it names a layer count without a layer span"
        return 0, num_layers, num_layers
    if len(mark.l) != 1 or mark.lc is None:
        return f"its layer spans {mark.l!r:.60} (of {mark.lc} layers) are not one span"
    first, end = mark.l[0]
    if not first < end <= mark.lc or end - first != num_layers:
        return f"it holds {num_layers} layers, its span says [{first}, {end}) of {mark.lc}"
    return first, end, mark.lc


def _tokens(key: str, tail: DecodedKV) -> int:
    """The tail's token count: every tensor's first dimension, the same for all."""
    tensors = [t for t in (*tail.key_cache, *tail.value_cache) if t is not None]
    counts = {int(t.shape[0]) if t.dim() else -1 for t in tensors}
    if len(counts) != 1 or -1 in counts:
        raise _corrupt(key, f"tail tensors disagree on their token count ({sorted(counts)[:4]})")
    return counts.pop()


def _of_another_stream(chunk: DecodedKV, stream_id: str) -> bool:
    """Whether ``chunk`` is a chunk of a stream other than ``stream_id`` (one its sender
    restarted after a receiver took it ahead)."""
    mark = chunk.stream
    return mark is not None and mark.k == "chunk" and mark.id != stream_id


def _check_chunk(
    key: str,
    chunk: DecodedKV,
    tail: DecodedKV,
    stream_id: str,
    index: int,
    piece: _Piece,
) -> None:
    """Raise unless ``chunk`` is piece ``index`` of the stream and fits the tail's layers."""
    mark = chunk.stream
    if mark is None or mark.k != "chunk" or mark.id != stream_id or mark.n != index:
        raise _corrupt(key, f"not chunk {index} of stream {stream_id} ({mark!r:.80})")
    if [tuple(r) for r in mark.r] != [(piece.start, piece.stop)]:
        raise _corrupt(
            key, f"chunk covers {mark.r!r:.60}, the manifest says {[piece.start, piece.stop]}"
        )
    if chunk.request_id != tail.request_id:
        raise _corrupt(key, f"chunk of request {chunk.request_id!r:.60}")
    span = _span(mark, chunk.num_layers)
    if isinstance(span, str):
        raise _corrupt(key, f"chunk {index}: {span}")
    if span[2] != tail.num_layers:
        raise _corrupt(key, f"chunk has {span[2]} layers, the tail {tail.num_layers}")
    if span[:2] != (piece.first, piece.end):
        want = [piece.first, piece.end]
        raise _corrupt(key, f"chunk holds layers {list(span[:2])}, the manifest says {want}")
    tokens = piece.stop - piece.start
    for name, mine, theirs in (
        ("key_cache", chunk.key_cache, tail.key_cache[piece.first : piece.end]),
        ("value_cache", chunk.value_cache, tail.value_cache[piece.first : piece.end]),
    ):
        for at, (c, t) in enumerate(zip(mine, theirs, strict=True)):
            layer = piece.first + at
            if c is None and t is None:
                continue
            if c is None or t is None:
                raise _corrupt(key, f"{name}_{layer} is present in only one of chunk and tail")
            if (
                c.dtype != t.dtype
                or c.device != t.device
                or c.dim() != t.dim()
                or c.shape[1:] != t.shape[1:]
                or c.shape[0] != tokens
            ):
                raise _corrupt(
                    key,
                    f"{name}_{layer} is {c.dtype} {tuple(c.shape)}, expected {t.dtype} "
                    f"[{tokens}, *{tuple(t.shape[1:])}]",
                )


def _joined(
    pieces: list[_Piece], chunks: list[DecodedKV], tail: DecodedKV
) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
    """Every layer's tokens in order (new memory): for layer ``i`` the part of each chunk that
    holds it (one per range), then the tail's."""
    out: tuple[list[torch.Tensor | None], list[torch.Tensor | None]] = ([], [])
    for which, tails in ((0, tail.key_cache), (1, tail.value_cache)):
        for i, t in enumerate(tails):
            parts = [
                (c.key_cache, c.value_cache)[which][i - p.first]
                for p, c in zip(pieces, chunks, strict=True)
                if p.first <= i < p.end
            ]
            out[which].append(_join(parts, t))
    return out


def _join(chunks: list[torch.Tensor | None], tail: torch.Tensor | None) -> torch.Tensor | None:
    """One layer's tokens in order: the chunks', then the tail's (new memory)."""
    if tail is None:
        return None
    parts = [c for c in chunks if c is not None]
    return torch.cat([*parts, tail], dim=0)
