"""One layer's paged K and V, read and written by token range, whatever the physical layout.

The vLLM worker holds one :class:`LayerBlocks` per registered layer (:func:`vllm_layer_blocks`)
and does three things with it: hand a request's blocks to the sender (:meth:`LayerBlocks.
send_source`), read a request's tokens (:meth:`LayerBlocks.gather`, for the payload MAC and
diagnostics) and write received tokens (:meth:`LayerBlocks.scatter`). Two kinds exist:

* :class:`StridedLayerBlocks`: K and V are strided views ``[num_blocks, block_size, heads,
  head_size]`` of the cache (:func:`omnikv.layouts.specs.vllm_layer_kv_views`); the sender
  gathers from the cache itself.
* :class:`PackedLayerBlocks`: a :class:`~omnikv.layouts.specs.PackedLayout` (vLLM's CPU
  attention with AMX tiles stores each block and head in tile order, where a token's elements
  are not one strided row). No view can read it; blocks are unpacked into a fresh
  ``[n, block_size, heads, head_size]`` copy to be read and packed back to be written.

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
from omnikv.layouts.specs import (
    VLLM_BLOCK_LAYOUTS,
    VLLM_CPU_AMX_LAYOUT,
    PackedLayout,
    vllm_layer_kv_views,
    vllm_layout_spec,
)

__all__ = [
    "VLLM_BLOCK_LAYOUTS",
    "VLLM_CPU_AMX_LAYOUT",
    "AmxPackedLayerBlocks",
    "LayerBlocks",
    "PackedLayerBlocks",
    "StridedLayerBlocks",
    "vllm_layer_blocks",
]

logger = logging.getLogger(__name__)


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


class PackedLayerBlocks(LayerBlocks):
    """One vLLM layer ``[num_blocks, heads, block_size, 2 * head_size]`` in a
    :class:`~omnikv.layouts.specs.PackedLayout` (vLLM's CPU attention with AMX tiles: see
    :class:`~omnikv.layouts.specs.VllmCpuAmxLayout`). Reads unpack the request's blocks (one
    copy); writes of part of a block unpack it, change the tokens and pack it back.
    """

    copies_to_send = True
    uses_amx_tiles = True

    def __init__(self, layer: torch.Tensor, spec: PackedLayout) -> None:
        blocks, heads, block_size, head_size = spec.check(layer)
        self.layer = layer
        self.spec = spec
        self.dtype = layer.dtype
        self.num_blocks, self.heads, self.block_size, self.head_size = (
            blocks,
            heads,
            block_size,
            head_size,
        )
        self.token_shape = (heads, head_size)

    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        ids = [int(b) for b in block_ids]
        bad = [b for b in ids if b < 0 or b >= self.num_blocks]
        if bad:
            raise ExtractionError(f"block ids {bad[:8]} outside a cache of {self.num_blocks}")
        return torch.tensor(ids, dtype=torch.long, device=self.layer.device)

    def _unpack(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Fresh ``[n, block_size, heads, head_size]`` K and V of the blocks in ``index``."""
        return self.spec.unpack(self.layer, index)

    def _pack(self, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write whole blocks: ``k`` and ``v`` are ``[n, block_size, heads, head_size]``."""
        self.spec.pack(self.layer, index, k, v)

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


class AmxPackedLayerBlocks(PackedLayerBlocks):
    """A layer in vLLM's CPU AMX layout (:data:`VLLM_CPU_AMX_LAYOUT`); raises
    :class:`ExtractionError` for a tensor that layout cannot hold."""

    def __init__(self, layer: torch.Tensor) -> None:
        spec = vllm_layout_spec(VLLM_CPU_AMX_LAYOUT)
        assert isinstance(spec, PackedLayout)
        super().__init__(layer, spec)


def vllm_layer_blocks(layer: torch.Tensor, layout: str) -> LayerBlocks:
    """One vLLM layer's blocks in ``layout`` (a name of :data:`VLLM_BLOCK_LAYOUTS`, never guessed
    from the shape: vLLM's CPU layouts with and without AMX have the same shape). Called by the
    vLLM worker once per registered layer; raises :class:`ExtractionError`."""
    spec = vllm_layout_spec(layout)
    if isinstance(spec, PackedLayout):
        return PackedLayerBlocks(layer, spec)
    k, v = vllm_layer_kv_views(layer, layout)
    return StridedLayerBlocks(k, v)
