"""A stream's keys and manifest, shared by both directions: the chunk keys the sender mints
(:func:`chunk_key`, in a space no request key reaches) and the checks a receiver makes of a
manifest and of each chunk against it, as hostile input (:func:`pieces_out_of_order` also
serves the vLLM finish's sealed ranges). Pure functions and plain values; imports nothing of
the sending or receiving side."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from omnikv.errors import DecodeError
from omnikv.wire.decode import DecodedKV
from omnikv.wire.format import MAX_STREAM_CHUNKS, StreamMark

__all__ = [
    "CHUNK_MARK",
    "Piece",
    "check_chunk",
    "chunk_key",
    "chunk_parts",
    "chunk_span",
    "corrupt",
    "manifest_pieces",
    "of_another_stream",
    "pieces_out_of_order",
    "reserved_key",
    "tail_tokens",
]

#: Opens and closes every chunk key (ASCII unit separator). No request key may hold it (the
#: sender refuses to publish, and the receiver to take, a request under such a key), so no
#: request id or key hook can spell a chunk key, and the reference's cleanup rule (the key is
#: the id, starts with ``id_`` or ends with ``_id``) applied to a chunk key matches that key
#: alone: a ``_`` never sits next to this mark in a key anyone can publish.
CHUNK_MARK = "\x1f"


def chunk_key(key: str, index: int) -> str:
    """The key of chunk ``index`` of a stream whose request is published under ``key``:
    ``<mark><key>#c<index><mark>`` (:data:`CHUNK_MARK`), minted by the sender's stream and
    by the receiver's assembly alike."""
    return f"{CHUNK_MARK}{key}#c{index}{CHUNK_MARK}"


def chunk_parts(key: str) -> tuple[str, int] | None:
    """The request key and chunk index of a :func:`chunk_key`; ``None`` for any other key."""
    if len(key) < 2 or key[0] != CHUNK_MARK or key[-1] != CHUNK_MARK:
        return None
    base, sep, index = key[1:-1].rpartition("#c")
    if not sep or not index.isascii() or not index.isdigit() or CHUNK_MARK in base:
        return None
    return base, int(index)


def reserved_key(key: str) -> str | None:
    """Why ``key`` cannot be a request's key (it holds :data:`CHUNK_MARK`, the mark of the
    chunk key space), or ``None``. Called by the sender and the receiver for every request
    key they build, before anything is published or waited for."""
    if CHUNK_MARK in key:
        return f"request key {key!r:.80} holds the chunk key mark (\\x1f); refused"
    return None


def corrupt(key: str, msg: str) -> DecodeError:
    return DecodeError(f"corrupt KV stream under {key}: {msg}")


class Piece(NamedTuple):
    """One chunk as the manifest lists it: tokens ``[start, stop)`` of layers
    ``[first, end)``."""

    start: int
    stop: int
    first: int
    end: int


def manifest_pieces(key: str, mark: StreamMark, layers: int) -> list[Piece]:
    """The manifest's chunks, checked: ``n`` of them (1 to the maximum), their ranges
    contiguous from token 0 and none empty; with layer spans (``l``, ``lc`` = the tail's
    ``layers``), each range's groups in layer order from 0 to the last layer."""
    count, ranges = mark.n, mark.r
    if not 1 <= count <= MAX_STREAM_CHUNKS or len(ranges) != count:
        raise corrupt(key, f"manifest claims {count} chunks with {len(ranges)} ranges")
    if mark.l is None:
        if mark.lc is not None:
            raise corrupt(key, "manifest names a layer count without layer spans")
        spans: list[tuple[int, int]] = [(0, layers)] * count
    elif mark.lc != layers or len(mark.l) != count:
        raise corrupt(
            key,
            f"manifest's {len(mark.l)} layer spans of {mark.lc} layers do not fit its {count} "
            f"chunks of {layers} layers",
        )
    else:
        spans = list(mark.l)
    pieces = [Piece(a, b, f, e) for (a, b), (f, e) in zip(ranges, spans, strict=True)]
    why = pieces_out_of_order(pieces, layers)
    if why is not None:
        raise corrupt(key, why)
    return pieces


def pieces_out_of_order(
    pieces: Sequence[tuple[int, int, int, int]], num_layers: int, noun: str = "chunk"
) -> str | None:
    """Why ``pieces`` (``(start, stop, first layer, layer stop)`` each, in order) do not tile a
    stream, or ``None``: token ranges contiguous from 0 and none empty, each range's layer
    groups consecutive from layer 0 to ``num_layers`` (a whole piece: ``(0, num_layers)``).
    The one check of a stream's layout, for a manifest
    (:class:`~omnikv.transfer.stream.receiving.StreamAssembly`) and for the vLLM finish's
    sealed ranges (``noun`` names a piece in the reason)."""
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


def chunk_span(mark: StreamMark, num_layers: int) -> tuple[int, int, int] | str:
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


def tail_tokens(key: str, tail: DecodedKV) -> int:
    """The tail's token count: every tensor's first dimension, the same for all."""
    tensors = [t for t in (*tail.key_cache, *tail.value_cache) if t is not None]
    counts = {int(t.shape[0]) if t.dim() else -1 for t in tensors}
    if len(counts) != 1 or -1 in counts:
        raise corrupt(key, f"tail tensors disagree on their token count ({sorted(counts)[:4]})")
    return counts.pop()


def of_another_stream(chunk: DecodedKV, stream_id: str) -> bool:
    """Whether ``chunk`` is a chunk of a stream other than ``stream_id`` (one its sender
    restarted after a receiver took it ahead)."""
    mark = chunk.stream
    return mark is not None and mark.k == "chunk" and mark.id != stream_id


def check_chunk(
    key: str,
    chunk: DecodedKV,
    tail: DecodedKV,
    stream_id: str,
    index: int,
    piece: Piece,
) -> None:
    """Raise unless ``chunk`` is piece ``index`` of the stream and fits the tail's layers."""
    mark = chunk.stream
    if mark is None or mark.k != "chunk" or mark.id != stream_id or mark.n != index:
        raise corrupt(key, f"not chunk {index} of stream {stream_id} ({mark!r:.80})")
    if [tuple(r) for r in mark.r] != [(piece.start, piece.stop)]:
        raise corrupt(
            key, f"chunk covers {mark.r!r:.60}, the manifest says {[piece.start, piece.stop]}"
        )
    if chunk.request_id != tail.request_id:
        raise corrupt(key, f"chunk of request {chunk.request_id!r:.60}")
    span = chunk_span(mark, chunk.num_layers)
    if isinstance(span, str):
        raise corrupt(key, f"chunk {index}: {span}")
    if span[2] != tail.num_layers:
        raise corrupt(key, f"chunk has {span[2]} layers, the tail {tail.num_layers}")
    if span[:2] != (piece.first, piece.end):
        want = [piece.first, piece.end]
        raise corrupt(key, f"chunk holds layers {list(span[:2])}, the manifest says {want}")
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
                raise corrupt(key, f"{name}_{layer} is present in only one of chunk and tail")
            if (
                c.dtype != t.dtype
                or c.device != t.device
                or c.dim() != t.dim()
                or c.shape[1:] != t.shape[1:]
                or c.shape[0] != tokens
            ):
                raise corrupt(
                    key,
                    f"{name}_{layer} is {c.dtype} {tuple(c.shape)}, expected {t.dtype} "
                    f"[{tokens}, *{tuple(t.shape[1:])}]",
                )
