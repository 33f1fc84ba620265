"""``ReceivedKV``: one request's KV as the library hands it around after a receive.

The receiver builds it from the decoded payload; prefetch, distribution and the facade read it.
The seed's dict (``{"request_id", "layer_blocks": {"key_cache", "value_cache"}, "block_ids",
"metadata"}``) is made from it only at the facade (:meth:`ReceivedKV.to_dict`) and for the
reference-shaped merger/slicer hooks.

Lifetime: tensors may be zero-copy views of connector memory; such a view keeps that memory
until the last view dies (``ManagedBuffer.adopt``), or the receiver copies them out before the
buffer is released. Dropping the last reference to the tensors is what frees them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from omnikv.errors import DecodeError
from omnikv.wire.decode import DecodedKV

__all__ = ["CACHES", "ReceivedChunk", "ReceivedKV", "move_kv"]

#: The two per-layer lists of a KV payload, in wire order.
CACHES = ("key_cache", "value_cache")

TensorFn = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ReceivedKV:
    """A request's received KV: ids, metadata, per-layer K and V (``None`` for skipped layers).

    ``token_offset``: the request token the tensors' first row is. It is 0 except for a receive
    whose caller took a stream's chunks one by one as they arrived (``on_chunk``, see
    :class:`ReceivedChunk`): the KV then holds only the tokens after those chunks.
    """

    request_id: str
    block_ids: list[Any]
    metadata: dict[str, Any]
    key_cache: list[torch.Tensor | None]
    value_cache: list[torch.Tensor | None]
    nbytes: int = 0
    token_offset: int = 0

    # -- building ---------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Any, nbytes: int = 0) -> ReceivedKV:
        """From the seed's dict form (a decoded payload or a hook's result).

        Raises :class:`~omnikv.errors.DecodeError` when ``data`` is not such a dict.
        """
        if not isinstance(data, Mapping) or not isinstance(data.get("layer_blocks"), Mapping):
            raise DecodeError(f"payload is not a KV dict (got {type(data).__name__})")
        blocks = data["layer_blocks"]
        lists = []
        for cache in CACHES:
            layers = blocks.get(cache) or []
            if not isinstance(layers, list | tuple):
                raise DecodeError(
                    f"layer_blocks.{cache} must be a list, got {type(layers).__name__}"
                )
            lists.append([t if isinstance(t, torch.Tensor) else None for t in layers])
        meta = data.get("metadata")
        bids = data.get("block_ids")
        return cls(
            request_id=str(data.get("request_id", "")),
            block_ids=list(bids) if isinstance(bids, list | tuple) else [],
            metadata=dict(meta) if isinstance(meta, Mapping) else {},
            key_cache=lists[0],
            value_cache=lists[1],
            nbytes=nbytes,
        )

    @classmethod
    def from_decoded(cls, decoded: DecodedKV, nbytes: int) -> ReceivedKV:
        """From :func:`omnikv.wire.decode.decode_kv`'s result (the one place a receive builds
        it)."""
        return cls(
            decoded.request_id,
            decoded.block_ids,
            decoded.metadata,
            decoded.key_cache,
            decoded.value_cache,
            nbytes,
        )

    def to_dict(self) -> dict[str, Any]:
        """The seed's dict form (new containers, same tensors)."""
        return {
            "request_id": self.request_id,
            "layer_blocks": {
                "key_cache": list(self.key_cache),
                "value_cache": list(self.value_cache),
            },
            "block_ids": list(self.block_ids),
            "metadata": self.metadata,
        }

    # -- walking layers ---------------------------------------------------------------------
    def tensors(self) -> Iterator[torch.Tensor]:
        """Every K and V tensor, layer by layer (K list first)."""
        for layers in (self.key_cache, self.value_cache):
            for t in layers:
                if t is not None:
                    yield t

    def map_tensors(self, fn: TensorFn) -> ReceivedKV:
        """A copy with ``fn`` applied to every tensor (``None`` layers stay ``None``)."""
        return dataclasses.replace(
            self,
            key_cache=[None if t is None else fn(t) for t in self.key_cache],
            value_cache=[None if t is None else fn(t) for t in self.value_cache],
        )


@dataclass(frozen=True)
class ReceivedChunk:
    """One chunk of a streamed send, handed to a receive's ``on_chunk`` as it arrives.

    ``start`` / ``stop``: the request tokens it holds (``[start, stop)``; chunks come in order,
    each starting where the one before stopped, the first at 0). ``metadata``: the chunk's own
    (its sender's per-chunk ``custom_metadata``, e.g. a MAC, plus the payload's fields).
    ``key_cache`` / ``value_cache``: per layer ``[stop - start, heads, head_size]`` tensors that
    are views of connector memory, valid only during the call: copy what must outlive it. A
    stream shipped layer by layer hands each range over as layer groups, in layer order: the
    tensors are then layers ``first_layer`` on, and a range's tokens are all there once its
    last layer's group was handed over (the next range starts after it).
    Nothing here is checked against the request's finish yet (the tail arrives later); what
    is checked is that the chunk continues the chunks before it (index, range, stream, request
    id, layers, dtypes, shapes).
    """

    request_id: str
    index: int
    start: int
    stop: int
    metadata: dict[str, Any]
    key_cache: list[torch.Tensor | None]
    value_cache: list[torch.Tensor | None]
    #: the request layer ``key_cache[0]`` is: 0, except for a layer group (a stream shipped
    #: layer by layer hands each range over in groups of layers, in order)
    first_layer: int = 0
    #: the stream's layer count (a layer group's ``lc``; a whole chunk's own layer count)
    num_layers: int = 0


def move_kv(kv: ReceivedKV, device: torch.device | str | None, *, own: bool = False) -> ReceivedKV:
    """The one device move: every tensor on ``device`` (blocking), or owned host copies.

    ``device`` ``None`` with ``own``: clone (the tensors must stop aliasing connector memory).
    A tensor already on ``device`` is cloned only with ``own``. CUDA targets are synchronised
    before returning, so the result is usable on any stream.
    """
    if device is None:
        return kv.map_tensors(torch.Tensor.clone) if own else kv
    dev = torch.device(device)

    def move(t: torch.Tensor) -> torch.Tensor:
        if t.device == dev:
            return t.clone() if own else t
        return t.to(dev).contiguous()

    out = kv.map_tensors(move)
    if dev.type == "cuda" and torch.cuda.is_available():
        torch.cuda.current_stream(dev).synchronize()
    return out
