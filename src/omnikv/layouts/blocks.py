"""One layer's paged K and V, read and written by token range, whatever the physical layout.

The vLLM worker holds one :class:`LayerBlocks` per registered layer (:func:`vllm_layer_blocks`)
and does three things with it: hand a request's blocks to the sender (:meth:`LayerBlocks.
send_source`), read a request's tokens (:meth:`LayerBlocks.gather`, for the payload MAC and
diagnostics) and write received tokens (:meth:`LayerBlocks.scatter`). Two kinds exist:

* :class:`StridedLayerBlocks`: K and V are strided views ``[num_blocks, block_size, heads,
  head_size]`` of the cache (:func:`omnikv.layouts.specs.vllm_layer_kv_views`); the sender
  gathers from the cache itself.
* :class:`AmxPackedLayerBlocks`: vLLM's CPU attention with AMX tiles (``bfloat16``, block size a
  multiple of 32, on CPUs with AMX) stores each block and head in tile order, where a token's
  elements are not one strided row: K as ``[block_size / 16, head_size / 2, 16 tokens, 2]`` and V
  as ``[head_size / 16, block_size / 2, 16 channels, 2 tokens]``. No view can read it; blocks are
  unpacked into a fresh ``[n, block_size, heads, head_size]`` copy to be read and packed back to
  be written.

Both raise :class:`~omnikv.errors.KVMismatchError` or :class:`~omnikv.errors.ExtractionError`
before writing anything when the tokens do not fit.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from omnikv.errors import ExtractionError, KVMismatchError
from omnikv.layouts.gather import BlockGather
from omnikv.layouts.scatter import scatter_tokens
from omnikv.layouts.specs import VLLM_LAYOUTS, vllm_layer_kv_views

__all__ = [
    "VLLM_BLOCK_LAYOUTS",
    "VLLM_CPU_AMX_LAYOUT",
    "AmxPackedLayerBlocks",
    "LayerBlocks",
    "StridedLayerBlocks",
    "vllm_layer_blocks",
]

logger = logging.getLogger(__name__)

#: vLLM's CPU attention backend with the AMX ISA (tile-ordered blocks).
VLLM_CPU_AMX_LAYOUT = "vllm_cpu_amx"
#: Every layout :func:`vllm_layer_blocks` reads: the strided ones, then the packed one.
VLLM_BLOCK_LAYOUTS: tuple[str, ...] = (*VLLM_LAYOUTS, VLLM_CPU_AMX_LAYOUT)

#: Tokens per K tile group and channels per V tile group of the AMX layout (64-byte tile rows
#: of 32-bit pairs).
_AMX_GROUP = 16
_AMX_PAIR = 2


class LayerBlocks(ABC):
    """One layer's K and V blocks; safe to use from several threads for disjoint blocks."""

    #: The cache's dtype (received KV must have it: omnikv never casts).
    dtype: torch.dtype
    #: ``(heads, head_size)``: the shape of one token of K or V.
    token_shape: tuple[int, ...]
    #: Whether :meth:`send_source` copies (the sender then reads the copy, not the cache).
    copies_to_send: bool = False
    #: Whether the attention kernel that writes this layout uses AMX tile instructions (the
    #: process then asks Linux for the AMX tile state before the kernel runs).
    uses_amx_tiles: bool = False

    @abstractmethod
    def send_source(
        self, block_ids: Sequence[int]
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[int, ...]]:
        """``((K, V), ids)`` for the sender: ``[blocks, block_size, heads, head_size]`` tensors
        and the ids of the request's blocks in them, in token order."""

    @abstractmethod
    def gather(
        self, block_ids: Sequence[int], num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Fresh ``[num_tokens, heads, head_size]`` K and V: tokens ``[0, num_tokens)`` of the
        request whose blocks are ``block_ids``. Raises :class:`ExtractionError` for too few
        blocks or an id outside the cache."""

    @abstractmethod
    def scatter(
        self, block_ids: Sequence[int], k: torch.Tensor, v: torch.Tensor, start: int
    ) -> None:
        """Write ``k`` and ``v`` (``[n, heads, head_size]``, the cache's dtype) as tokens
        ``[start, start + n)`` of the request whose blocks are ``block_ids``; nothing is written
        when it raises (as :func:`omnikv.layouts.scatter.scatter_tokens`)."""


class StridedLayerBlocks(LayerBlocks):
    """K and V as strided block views of the cache (every layout but AMX's)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k = k
        self.v = v
        self.dtype = k.dtype
        self.token_shape = tuple(int(d) for d in k.shape[2:])

    def send_source(
        self, block_ids: Sequence[int]
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[int, ...]]:
        return (self.k, self.v), tuple(int(b) for b in block_ids)

    def gather(
        self, block_ids: Sequence[int], num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ids = tuple(int(b) for b in block_ids)
        return (
            BlockGather(self.k, ids, num_tokens).materialize(),
            BlockGather(self.v, ids, num_tokens).materialize(),
        )

    def scatter(
        self, block_ids: Sequence[int], k: torch.Tensor, v: torch.Tensor, start: int
    ) -> None:
        if tuple(v.shape) != tuple(k.shape) or v.dtype != k.dtype:
            raise KVMismatchError(
                f"scatter: K {tuple(k.shape)} {k.dtype} and V {tuple(v.shape)} {v.dtype} differ"
            )
        scatter_tokens(self.k, block_ids, k, start)  # checks everything before writing
        scatter_tokens(self.v, block_ids, v, start)


class AmxPackedLayerBlocks(LayerBlocks):
    """One vLLM CPU layer ``[num_blocks, heads, block_size, 2 * head_size]`` in the AMX layout.

    Per block and head the first ``block_size * head_size`` elements are K, token ``t`` channel
    ``d`` at ``[t // 16][d // 2][t % 16][d % 2]``; the next are V, at
    ``[d // 16][t // 2][d % 16][t % 2]`` (what vLLM's ``cpu_attn_reshape_and_cache`` writes with
    ``isa="amx"``). Reads unpack the request's blocks (one copy); writes of part of a block unpack
    it, change the tokens and pack it back.
    """

    copies_to_send = True
    uses_amx_tiles = True

    def __init__(self, layer: torch.Tensor) -> None:
        shape = tuple(int(d) for d in layer.shape)
        if layer.dim() != 4 or not layer.is_contiguous() or layer.element_size() != 2:
            raise ExtractionError(
                "vLLM AMX cache: expected a contiguous [num_blocks, kv_heads, block_size, "
                f"2 * head_size] tensor of a 2-byte dtype, got {shape} {layer.dtype}"
            )
        blocks, heads, block_size, two_d = shape
        head_size = two_d // 2
        if two_d % 2 or block_size % _AMX_GROUP or head_size % _AMX_GROUP:
            raise ExtractionError(
                "vLLM AMX cache: block_size and head_size must be multiples of 16, got "
                f"block_size {block_size}, head_size {head_size} (shape {shape})"
            )
        self.layer = layer
        self.dtype = layer.dtype
        self.num_blocks, self.heads, self.block_size, self.head_size = (
            blocks,
            heads,
            block_size,
            head_size,
        )
        self.token_shape = (heads, head_size)
        halves = layer.view(blocks, heads, 2, block_size * head_size)
        g, p = _AMX_GROUP, _AMX_PAIR
        # Tile-ordered views: K [blocks, heads, bs/16, hd/2, 16, 2], V [blocks, heads, hd/16,
        # bs/2, 16, 2].
        self._k6 = halves[:, :, 0].view(blocks, heads, block_size // g, head_size // p, g, p)
        self._v6 = halves[:, :, 1].view(blocks, heads, head_size // g, block_size // p, g, p)

    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        ids = [int(b) for b in block_ids]
        bad = [b for b in ids if b < 0 or b >= self.num_blocks]
        if bad:
            raise ExtractionError(f"block ids {bad[:8]} outside a cache of {self.num_blocks}")
        return torch.tensor(ids, dtype=torch.long, device=self.layer.device)

    def _unpack(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Fresh ``[n, block_size, heads, head_size]`` K and V of the blocks in ``index``."""
        n, bs, h, d = int(index.numel()), self.block_size, self.heads, self.head_size
        # K: (blk, head, group, pair, tok16, elem) -> (blk, group, tok16, head, pair, elem)
        k = self._k6.index_select(0, index).permute(0, 2, 4, 1, 3, 5).reshape(n, bs, h, d)
        # V: (blk, head, chan_group, tok_pair, chan16, tok2) -> (blk, tok_pair, tok2, head,
        # chan_group, chan16)
        v = self._v6.index_select(0, index).permute(0, 3, 5, 1, 2, 4).reshape(n, bs, h, d)
        return k, v

    def _pack(self, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write whole blocks: ``k`` and ``v`` are ``[n, block_size, heads, head_size]``."""
        n, g, p = int(index.numel()), _AMX_GROUP, _AMX_PAIR
        bs, h, d = self.block_size, self.heads, self.head_size
        k6 = k.reshape(n, bs // g, g, h, d // p, p).permute(0, 3, 1, 4, 2, 5)
        v6 = v.reshape(n, bs // p, p, h, d // g, g).permute(0, 3, 4, 1, 5, 2)
        self._k6.index_copy_(0, index, k6.contiguous())
        self._v6.index_copy_(0, index, v6.contiguous())

    def _needed(self, block_ids: Sequence[int], start: int, n: int) -> list[int]:
        bs = self.block_size
        if start < 0 or n < 0 or start + n > len(block_ids) * bs:
            raise ExtractionError(
                f"tokens [{start}, {start + n}) do not fit {len(block_ids)} blocks of {bs}"
            )
        return [int(b) for b in block_ids[start // bs : -(-(start + n) // bs)]]

    def send_source(
        self, block_ids: Sequence[int]
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[int, ...]]:
        index = self._index(block_ids)
        return self._unpack(index), tuple(range(int(index.numel())))

    def gather(
        self, block_ids: Sequence[int], num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ids = self._needed(block_ids, 0, num_tokens)
        k, v = self._unpack(self._index(ids))
        shape = (-1, *self.token_shape)
        return k.reshape(shape)[:num_tokens].clone(), v.reshape(shape)[:num_tokens].clone()

    def scatter(
        self, block_ids: Sequence[int], k: torch.Tensor, v: torch.Tensor, start: int
    ) -> None:
        for name, t in (("K", k), ("V", v)):
            if t.dim() != 3 or tuple(t.shape[1:]) != self.token_shape:
                raise KVMismatchError(
                    f"scatter: expected {name} tokens of shape [n, {self.heads}, "
                    f"{self.head_size}] for the cache, got {tuple(t.shape)}"
                )
            if t.dtype != self.dtype:
                raise KVMismatchError(
                    f"scatter: expected KV of the cache's dtype {self.dtype}, got {t.dtype}; "
                    "omnikv does not cast received KV"
                )
        n = int(k.shape[0])
        if int(v.shape[0]) != n:
            raise KVMismatchError(f"scatter: {n} K tokens but {int(v.shape[0])} V tokens")
        ids = self._needed(block_ids, start, n)
        if not ids:
            return
        index = self._index(ids)
        lo = start % self.block_size
        if lo == 0 and n % self.block_size == 0:
            kb = k.new_empty((len(ids), self.block_size, *self.token_shape))
            vb = v.new_empty(kb.shape)
        else:  # part of a block changes: keep the rest of it
            kb, vb = self._unpack(index)
        shape = (-1, *self.token_shape)
        kb.view(shape)[lo : lo + n].copy_(k)
        vb.view(shape)[lo : lo + n].copy_(v)
        self._pack(index, kb, vb)


def vllm_layer_blocks(layer: torch.Tensor, layout: str) -> LayerBlocks:
    """One vLLM layer's blocks in ``layout`` (a name of :data:`VLLM_BLOCK_LAYOUTS`, never guessed
    from the shape: vLLM's CPU layouts with and without AMX have the same shape). Called by the
    vLLM worker once per registered layer; raises :class:`ExtractionError`."""
    if layout == VLLM_CPU_AMX_LAYOUT:
        return AmxPackedLayerBlocks(layer)
    k, v = vllm_layer_kv_views(layer, layout)
    return StridedLayerBlocks(k, v)
