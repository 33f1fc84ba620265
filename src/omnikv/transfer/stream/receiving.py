"""Receiving a streamed request: its chunks taken (ahead of the tail when the stage streams),
checked against the tail's manifest as hostile input and joined, or handed to the caller's
``on_chunk`` one by one.

A payload under a request key that is a tail makes the receive take the chunk keys of that key
too (:func:`~omnikv.transfer.stream.manifest.chunk_key`; same metadata, same deadline), check
every one against the manifest (count bounded before anything is waited for, ranges
contiguous from 0, stream id, request id, layers, dtypes, head shapes and token counts), and
concatenate along tokens: the result is exactly what a whole send of the request gives (ids,
block ids, metadata and bit-identical tensors). Every chunk taken gets the receive's verdict.
Per key, so receiving TP > sending TP (sender-side slices, receiver-side merge or slice) works
unchanged. Used by :class:`~omnikv.transfer.receive.KVReceiver` only.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from omnikv.connectors.base import ManagedBuffer
from omnikv.errors import OmniKVError, PayloadRefused
from omnikv.transfer.received import ReceivedChunk, ReceivedKV
from omnikv.transfer.sessions import SessionGuard
from omnikv.transfer.stream.manifest import (
    Piece,
    check_chunk,
    chunk_key,
    chunk_parts,
    chunk_span,
    corrupt,
    manifest_pieces,
    of_another_stream,
    tail_tokens,
)
from omnikv.wire.decode import DecodedKV, decode_kv
from omnikv.wire.format import MAX_STREAM_CHUNKS

__all__ = ["ChunkFeed", "ChunkSource", "EagerChunks", "EagerWait", "StreamAssembly"]

logger = logging.getLogger(__name__)


def _decode_buffer(buf: ManagedBuffer, max_header_bytes: int) -> DecodedKV:
    """``buf``'s payload decoded (views of its host array, else of its tensor)."""
    host = buf.host_array
    payload: Any = host if host is not None else buf.tensor
    return decode_kv(payload, max_header_bytes=max_header_bytes)


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
    for any chunk the lane did not hand over. With ``guard`` a chunk's stamp is admitted
    (:meth:`SessionGuard.admit <omnikv.transfer.sessions.SessionGuard.admit>`) before it is
    handed over, so that a replayed chunk (a copy of one this receiver already took) never
    reaches ``on_chunk``. After the first refusal nothing more is handed
    over (:attr:`refusal`; :attr:`corrupt` says whether the chunk itself was inconsistent, as
    opposed to refused by ``on_chunk`` or the guard), and ``on_refusal`` is called (the receive
    stops waiting for the tail). :meth:`close` waits for a call in flight and refuses
    every later one, so that a receive that returned never writes again. Thread-safe.
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
            why = self._admitted(chunk) or self._call(chunk, index, start, stop, span)
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
        span = chunk_span(mark, chunk.num_layers)
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

    def _admitted(self, chunk: DecodedKV) -> str | None:
        """Why the guard refuses the chunk's stamp (a duplicate, a stale epoch); ``None`` when
        it takes it, or without a guard."""
        if self._guard is None:
            return None
        try:
            self._guard.admit(chunk.stamp, chunk.request_id)
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
            logger.exception("on_chunk raised for chunk %d of %s", index, chunk.request_id)
            return f"on_chunk raised {type(exc).__name__}: {exc}"

    def error(self, key: str) -> OmniKVError:
        """The refusal as the receive's error for request key ``key``: the stream is corrupt,
        or ``on_chunk`` refused a chunk (the sender is told either way)."""
        why = self.refusal or "no chunk was refused"
        if self.corrupt:
            return corrupt(key, why)
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
        n = tail_tokens("chunk", chunk)
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
                logger.warning("dropped chunk %s, taken after its receive ended", ckey)
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
            at, n = joined.ends[count], tail_tokens(key, tail)
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
        guard: SessionGuard | None = None,
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
            raise corrupt(key, "a stream chunk was published under a request's key")
        pieces = manifest_pieces(key, mark, tail.num_layers)
        tail_count = tail_tokens(key, tail)
        seq_len = tail.metadata.get("seq_len")
        shipped = pieces[-1].stop
        total = shipped + tail_count
        if isinstance(seq_len, int) and not isinstance(seq_len, bool) and seq_len != total:
            raise corrupt(key, f"chunks and tail hold {total} tokens, metadata seq_len={seq_len}")
        chunks: list[DecodedKV] = []
        held = len(self._held)
        for index, piece in enumerate(pieces):
            ckey = chunk_key(key, index)
            buf = self.source.take(ckey, metadata)
            self.taken.append((ckey, metadata))
            self._held.append(buf)
            known = self.source.decoded(ckey) if isinstance(self.source, EagerChunks) else None
            chunk = known if known is not None else self._decode(buf)
            if isinstance(self.source, EagerChunks) and of_another_stream(chunk, mark.id):
                if self.feed is not None and self.feed.has(ckey):
                    raise corrupt(key, "its stream restarted after chunks were handed over")
                buf = self.source.retake(ckey, metadata, self._held.pop())
                self._held.append(buf)
                chunk = self._decode(buf)
            if self.guard is not None and self.feed is None:  # the feed admits what it hands
                self.guard.admit(chunk.stamp, tail.request_id)
            check_chunk(ckey, chunk, tail, mark.id, index, piece)
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


def _joined(
    pieces: list[Piece], chunks: list[DecodedKV], tail: DecodedKV
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
