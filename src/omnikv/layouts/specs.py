"""Per-layer KV-cache layouts: one spec class per layout, a registry, and the readers that split
one layer into K and V block views ``[num_blocks, block_size, ...]``.

Layouts (``block_size`` tokens per block):

* ``"kv_first"`` (aliases ``"flash_attn"``, ``"nhd"``): one tensor
  ``[2, num_blocks, block_size, heads, dim]`` (FlashAttention style);
* ``"blocks_first"`` (alias ``"flashinfer"``): one tensor ``[num_blocks, 2, block_size, heads,
  dim]`` (FlashInfer style);
* ``"pair"``: a ``(K, V)`` tuple or list of ``[num_blocks, block_size, heads, dim]`` tensors;
* ``"vllm_bhnc"``, ``"vllm_cpu"`` and ``"vllm_cpu_amx"``: the one-tensor-per-layer caches
  vLLM >= 0.32 hands a stage, all of logical shape ``[num_blocks, kv_heads, block_size,
  2 * head_size]`` (:data:`VLLM_BHNC_LAYOUT`: ``FLASH_ATTN``, ``FLASHINFER``, ``TRITON_ATTN``,
  ``FLEX_ATTENTION``, any physical stride order, which is also the 4-D layout the reference
  reads; :data:`VLLM_CPU_LAYOUT`: ``CPU_ATTN`` with the ``vec`` / ``vec16`` ISA;
  :data:`VLLM_CPU_AMX_LAYOUT`: ``CPU_ATTN`` with AMX tiles, a :class:`PackedLayout`).

Two readers choose the spec. :func:`layer_spec` reads a stage's cache (the sender, through
:func:`omnikv.layouts.gather.plan_request_kv`): a pair is a pair whatever the stage declares; a
tensor is read in the declared layout, or, with ``"auto"`` (no declaration), in the one
stacked layout its shape fits. Shapes that fit several layouts are refused with the names to
declare instead of a silent guess: a 5-D tensor whose first two dims are both 2, and any 4-D
tensor with an even last dim (vLLM 0.32's GPU and CPU layouts have the same shape).
``from_vllm_config`` declares the layout of the engine's attention backend itself
(:mod:`omnikv.layouts.vllm_backends`). :func:`vllm_layer_kv_views` reads a vLLM layer in the
layout the attention backend names (never guessed from the shape).

Every view aliases the cache (no copy): gathers read a request's tokens out of them and
:func:`omnikv.layouts.scatter.scatter_tokens` writes tokens into them. A :class:`PackedLayout`
has no views: its blocks are unpacked into copies to be read and packed back to be written.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import Any, ClassVar, TypeVar

import numpy as np
import torch

from omnikv.errors import ExtractionError
from omnikv.wire.encode import host_bits

__all__ = [
    "ACCEPTED",
    "HF_HINT",
    "LAYOUTS",
    "VLLM_4D_HINT",
    "VLLM_BHNC_LAYOUT",
    "VLLM_BLOCK_LAYOUTS",
    "VLLM_CPU_AMX_LAYOUT",
    "VLLM_CPU_LAYOUT",
    "VLLM_LAYOUTS",
    "BlocksFirstLayout",
    "KVFirstLayout",
    "KVPairLayout",
    "LayoutSpec",
    "PackedLayout",
    "StackedLayout",
    "VllmBhncLayout",
    "VllmCpuAmxLayout",
    "VllmCpuLayout",
    "layer_spec",
    "layout_spec",
    "normalize_layer_kv",
    "read_layer_kv",
    "split_layer_kv",
    "stage_layout_spec",
    "vllm_layer_kv_views",
    "vllm_layout_spec",
]

logger = logging.getLogger(__name__)

ACCEPTED = (
    "accepted per-layer layouts: [2, num_blocks, block_size, heads, head_dim] (kv_first), "
    "[num_blocks, 2, block_size, heads, head_dim] (blocks_first), a (K, V) pair of "
    "[num_blocks, block_size, heads, head_dim] tensors, or, declared, vLLM 0.32's "
    "[num_blocks, heads, block_size, 2 * head_dim] (vllm_bhnc, vllm_cpu, vllm_cpu_amx)"
)
#: What a stage declares for vLLM 0.32's 4-D caches (named when ``"auto"`` meets one).
VLLM_4D_HINT = (
    "vLLM >= 0.32 caches [num_blocks, heads, block_size, 2 * head_dim] place K and V by "
    "attention backend; declare kv_cache_layout 'vllm_bhnc' (FLASH_ATTN, FLASHINFER, "
    "TRITON_ATTN, FLEX_ATTENTION: K then V along the last dim), 'vllm_cpu' (CPU_ATTN, vec / "
    "vec16 ISA: K stored transposed) or 'vllm_cpu_amx' (CPU_ATTN, AMX tiles), or build the "
    "manager with from_vllm_config, which takes it from the engine"
)
HF_HINT = (
    "this looks like a transformers cache; send it with "
    "omnikv.integrations.transformers.send_hf_cache(manager, request_id, cache)"
)

_Array = TypeVar("_Array", torch.Tensor, np.ndarray)


class LayoutSpec(ABC):
    """How one per-layer cache layout holds K and V.

    One instance per layout lives in the registry (:func:`layout_spec`). Capabilities are class
    attributes: ``stage_layout`` (a stage may declare it as its ``kv_cache_layout``; read by
    :func:`layer_spec`), ``vllm_layout`` (a vLLM layer may be in it:
    :func:`vllm_layout_spec`) and ``shape_known`` (``"auto"`` may pick it from the shape).
    Specs hold no state; every method may be called from any thread.
    """

    #: The canonical name (what :data:`LAYOUTS` and :data:`VLLM_LAYOUTS` list).
    name: ClassVar[str]
    #: Other spellings :func:`layout_spec` and a stage declaration accept.
    aliases: ClassVar[tuple[str, ...]] = ()
    stage_layout: ClassVar[bool] = False
    vllm_layout: ClassVar[bool] = False
    shape_known: ClassVar[bool] = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    @abstractmethod
    def kv_views(self, layer_kv: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``(K, V)`` block views ``[num_blocks, block_size, ...]`` of one layer, aliasing it.

        The readers call it once they know ``layer_kv`` is in this layout: the stage layouts
        rely on :func:`split_layer_kv`'s checks; the vLLM layouts check their own shape and
        raise :class:`ExtractionError` for a tensor they cannot read.
        """

    def host_kv_bits(self, layer_kv: Any) -> tuple[np.ndarray | None, np.ndarray | None]:
        """K's and V's blocks as same-size integers (:func:`omnikv.wire.encode.host_bits`) when
        one conversion serves both (a host layer stored as one tensor); ``(None, None)`` otherwise
        (:meth:`omnikv.layouts.gather.BlockGather.write_bits` then converts each side itself)."""
        return None, None


class StackedLayout(LayoutSpec):
    """K and V stacked in one tensor along ``kv_axis`` (a dim of size 2).

    Stage layouts, and the layouts of vLLM releases before 0.32. :meth:`fits` tells whether a
    shape has a 2 on that axis; :func:`split_layer_kv` uses it to detect the layout.
    """

    kv_axis: ClassVar[int]
    stage_layout = True
    vllm_layout = True
    shape_known = True

    def fits(self, shape: tuple[int, ...]) -> bool:
        """Whether a tensor of ``shape`` (at least 3-D) stacks K and V on :attr:`kv_axis`."""
        return shape[self.kv_axis] == 2

    @abstractmethod
    def _halves(self, whole: _Array) -> tuple[_Array, _Array]:
        """K's and V's parts of ``whole`` (the layer, or its integer view)."""

    def kv_views(self, layer_kv: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self._halves(layer_kv)

    def host_kv_bits(self, layer_kv: Any) -> tuple[np.ndarray | None, np.ndarray | None]:
        if not layer_kv.is_cpu:
            return None, None
        bits = host_bits(layer_kv)
        if bits is None:
            return None, None
        return self._halves(bits)


class KVFirstLayout(StackedLayout):
    """``[2, num_blocks, block_size, heads, dim]`` (FlashAttention)."""

    name = "kv_first"
    aliases = ("flash_attn", "nhd")
    kv_axis = 0

    def _halves(self, whole: _Array) -> tuple[_Array, _Array]:
        return whole[0], whole[1]


class BlocksFirstLayout(StackedLayout):
    """``[num_blocks, 2, block_size, heads, dim]`` (FlashInfer)."""

    name = "blocks_first"
    aliases = ("flashinfer",)
    kv_axis = 1

    def _halves(self, whole: _Array) -> tuple[_Array, _Array]:
        return whole[:, 0], whole[:, 1]


class KVPairLayout(LayoutSpec):
    """A ``(K, V)`` tuple or list of ``[num_blocks, block_size, heads, dim]`` tensors.

    Read whatever layout the stage declares (the form says it all); never declared itself.
    """

    name = "pair"

    def kv_views(self, layer_kv: Any) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = layer_kv
        return k, v


class VllmCpuLayout(LayoutSpec):
    """vLLM's CPU attention backend (``CPU_ATTN``): one tensor per layer,
    ``[num_blocks, kv_heads, block_size, 2 * head_size]``; per block and head the first
    ``block_size * head_size`` elements are K stored transposed (``[head_size, block_size]``,
    token index fastest), the next ``block_size * head_size`` are V as
    ``[block_size, head_size]``."""

    name = "vllm_cpu"
    stage_layout = True
    vllm_layout = True

    def kv_views(self, layer_kv: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Raises :class:`ExtractionError` for a tensor that is not a contiguous
        ``[blocks, heads, block_size, 2 * head_size]`` cache."""
        shape = tuple(layer_kv.shape)
        if layer_kv.dim() != 4 or shape[3] % 2 or not layer_kv.is_contiguous():
            raise ExtractionError(
                "vLLM CPU cache: expected a contiguous [num_blocks, kv_heads, block_size, "
                f"2 * head_size] tensor, got shape {shape}"
            )
        blocks, heads, block_size, two_d = shape
        head_size = two_d // 2
        halves = layer_kv.view(blocks, heads, 2, block_size * head_size)
        k = halves[:, :, 0].view(blocks, heads, head_size, block_size).permute(0, 3, 1, 2)
        v = halves[:, :, 1].view(blocks, heads, block_size, head_size).permute(0, 2, 1, 3)
        return k, v


class VllmBhncLayout(LayoutSpec):
    """vLLM >= 0.32 GPU backends (``FLASH_ATTN``, ``FLASHINFER``, ``TRITON_ATTN``,
    ``FLEX_ATTENTION``): logical per-layer shape ``[num_blocks, kv_heads, block_size,
    2 * head_size]`` in any physical stride order (``NHD`` or ``HND`` block interiors, layer- or
    block-outermost; the views keep it), K in the first ``head_size`` channels, V in the last
    ``head_size``. The 4-D layout the reference (vllm-omni 0.32) reads."""

    name = "vllm_bhnc"
    stage_layout = True
    vllm_layout = True

    def kv_views(self, layer_kv: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Raises :class:`ExtractionError` for a tensor that is not 4-D with an even last dim."""
        shape = tuple(layer_kv.shape)
        if layer_kv.dim() != 4 or shape[3] % 2:
            raise ExtractionError(
                "vLLM GPU cache: expected [num_blocks, kv_heads, block_size, 2 * head_size], "
                f"got shape {shape}"
            )
        head_size = shape[3] // 2
        both = layer_kv.transpose(1, 2)
        return both[..., :head_size], both[..., head_size:]


class PackedLayout(LayoutSpec):
    """A layout no strided view can read: a token's elements are not one strided row.

    Read by :meth:`unpack` (a copy of the blocks asked for) and written by :meth:`pack`; the
    sender's planner copies only a request's blocks, :class:`omnikv.layouts.blocks.
    PackedLayerBlocks` reads and writes a vLLM layer through them.
    """

    @abstractmethod
    def check(self, layer: Any) -> tuple[int, int, int, int]:
        """``(num_blocks, heads, block_size, head_size)`` of a layer in this layout; raises
        :class:`ExtractionError` for one it cannot hold."""

    @abstractmethod
    def unpack(self, layer: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Fresh ``[n, block_size, heads, head_size]`` K and V of the blocks in ``index`` (a
        ``long`` tensor of checked ids on the layer's device)."""

    @abstractmethod
    def pack(
        self, layer: torch.Tensor, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Write whole blocks: ``k`` and ``v`` are ``[n, block_size, heads, head_size]``."""

    def kv_views(self, layer_kv: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of every block (a packed layout has no views): for the reference-compatible
        :func:`split_layer_kv`; the sender copies only a request's blocks."""
        blocks = self.check(layer_kv)[0]
        return self.unpack(layer_kv, torch.arange(blocks, device=layer_kv.device))


#: Tokens per K tile group and channels per V tile group of the AMX layout (64-byte tile rows
#: of 32-bit pairs).
_AMX_GROUP = 16
_AMX_PAIR = 2


class VllmCpuAmxLayout(PackedLayout):
    """vLLM's CPU attention with AMX tiles (``bfloat16`` / ``float16``, block and head size
    multiples of 16, on CPUs with AMX): ``[num_blocks, kv_heads, block_size, 2 * head_size]``,
    each block and head in tile order. Per block and head the first ``block_size * head_size``
    elements are K, token ``t`` channel ``d`` at ``[t // 16][d // 2][t % 16][d % 2]``; the next
    are V, at ``[d // 16][t // 2][d % 16][t % 2]`` (what vLLM's ``cpu_attn_reshape_and_cache``
    writes with ``isa="amx"``)."""

    name = "vllm_cpu_amx"
    stage_layout = True
    vllm_layout = True

    def check(self, layer: Any) -> tuple[int, int, int, int]:
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
        return blocks, heads, block_size, head_size

    def _tiles(self, layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Tile-ordered views: K ``[blocks, heads, bs/16, hd/2, 16, 2]``, V ``[blocks, heads,
        hd/16, bs/2, 16, 2]``."""
        blocks, heads, bs, d = self.check(layer)
        g, p = _AMX_GROUP, _AMX_PAIR
        halves = layer.view(blocks, heads, 2, bs * d)
        k6 = halves[:, :, 0].view(blocks, heads, bs // g, d // p, g, p)
        v6 = halves[:, :, 1].view(blocks, heads, d // g, bs // p, g, p)
        return k6, v6

    def unpack(self, layer: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        _blocks, h, bs, d = self.check(layer)
        k6, v6 = self._tiles(layer)
        n = int(index.numel())
        # K: (blk, head, group, pair, tok16, elem) -> (blk, group, tok16, head, pair, elem)
        k = k6.index_select(0, index).permute(0, 2, 4, 1, 3, 5).reshape(n, bs, h, d)
        # V: (blk, head, chan_group, tok_pair, chan16, tok2) -> (blk, tok_pair, tok2, head,
        # chan_group, chan16)
        v = v6.index_select(0, index).permute(0, 3, 5, 1, 2, 4).reshape(n, bs, h, d)
        return k, v

    def pack(
        self, layer: torch.Tensor, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        _blocks, h, bs, d = self.check(layer)
        k6, v6 = self._tiles(layer)
        n, g, p = int(index.numel()), _AMX_GROUP, _AMX_PAIR
        k6.index_copy_(0, index, k.reshape(n, bs // g, g, h, d // p, p).permute(0, 3, 1, 4, 2, 5))
        v6.index_copy_(0, index, v.reshape(n, bs // p, p, h, d // g, g).permute(0, 3, 4, 1, 5, 2))


_KV_FIRST = KVFirstLayout()
_BLOCKS_FIRST = BlocksFirstLayout()
_KV_PAIR = KVPairLayout()
#: Every layout, by canonical name, in the order the error messages list them.
_SPECS: dict[str, LayoutSpec] = {
    spec.name: spec
    for spec in (
        _KV_FIRST,
        _BLOCKS_FIRST,
        _KV_PAIR,
        VllmCpuLayout(),
        VllmBhncLayout(),
        VllmCpuAmxLayout(),
    )
}
#: Every accepted spelling: canonical names and aliases.
_SPELLINGS: dict[str, LayoutSpec] = {
    **_SPECS,
    **{alias: spec for spec in _SPECS.values() for alias in spec.aliases},
}
_STACKED: tuple[StackedLayout, ...] = tuple(
    spec for spec in _SPECS.values() if isinstance(spec, StackedLayout)
)

#: The names a stage may declare as ``kv_cache_layout`` (``"auto"``: detect from the shape).
LAYOUTS: tuple[str, ...] = (*(s.name for s in _SPECS.values() if s.stage_layout), "auto")
VLLM_CPU_LAYOUT = VllmCpuLayout.name
VLLM_BHNC_LAYOUT = VllmBhncLayout.name
VLLM_CPU_AMX_LAYOUT = VllmCpuAmxLayout.name
#: Every layout :func:`vllm_layer_kv_views` reads: vLLM's own, then the stacked layouts of older
#: releases.
VLLM_LAYOUTS: tuple[str, ...] = (
    *(
        s.name
        for s in _SPECS.values()
        if s.vllm_layout and not s.shape_known and not isinstance(s, PackedLayout)
    ),
    *(s.name for s in _SPECS.values() if s.vllm_layout and s.shape_known),
)
#: Every layout a vLLM layer may be in (:func:`omnikv.layouts.blocks.vllm_layer_blocks`): the
#: viewable ones, then the packed ones.
VLLM_BLOCK_LAYOUTS: tuple[str, ...] = (
    *VLLM_LAYOUTS,
    *(s.name for s in _SPECS.values() if isinstance(s, PackedLayout)),
)


def layout_spec(name: str) -> LayoutSpec:
    """The spec of a layout name or alias; :class:`ExtractionError` listing the known names."""
    spec = _SPELLINGS.get(name)
    if spec is None:
        raise ExtractionError(f"unknown cache layout {name!r}; expected one of {tuple(_SPELLINGS)}")
    return spec


def stage_layout_spec(layout: str | None) -> LayoutSpec | None:
    """The layout a stage declares (a name of :data:`LAYOUTS` or an alias of one); ``None`` for
    ``None`` or ``"auto"`` (detect from the shape). Raises :class:`ExtractionError` for any
    other name."""
    if layout is None or layout == "auto":
        return None
    spec = _SPELLINGS.get(layout)
    if spec is None or not spec.stage_layout:
        raise ExtractionError(f"unknown kv_cache_layout {layout!r}; expected one of {LAYOUTS}")
    return spec


def vllm_layout_spec(layout: str) -> LayoutSpec:
    """The spec of a vLLM layer layout (a name of :data:`VLLM_BLOCK_LAYOUTS`, no aliases: the
    attention backend names it); :class:`ExtractionError` listing the known names."""
    spec = _SPECS.get(layout) if layout in VLLM_BLOCK_LAYOUTS else None
    if spec is None:
        raise ExtractionError(
            f"unknown vLLM cache layout {layout!r}; expected one of {VLLM_BLOCK_LAYOUTS}"
        )
    return spec


def _looks_like_hf_cache(obj: Any) -> bool:
    return any(hasattr(obj, a) for a in ("layers", "key_cache", "keys"))


def _described(obj: Any) -> str:
    if isinstance(obj, torch.Tensor):
        return f"a tensor of shape {tuple(obj.shape)}"
    if isinstance(obj, tuple | list):
        inner = ", ".join(
            _described(x) if isinstance(x, torch.Tensor) else type(x).__name__ for x in obj[:4]
        )
        return f"a {type(obj).__name__} of {len(obj)} ({inner})"
    return f"a {type(obj).__name__}"


def _stacked_spec(
    layer_kv: torch.Tensor, declared: StackedLayout | None, layout: str | None, where: str
) -> StackedLayout:
    """The stacked layout ``layer_kv`` is read in: ``declared`` when its shape fits, else the
    one its shape fits. ``layout`` is the declaration as given (named in the messages). Without
    a declaration a 4-D tensor with an even last dim is refused: it may be any of vLLM 0.32's
    layouts (:data:`VLLM_4D_HINT`), and a 2 among its first dims proves nothing."""
    shape = tuple(layer_kv.shape)
    if layer_kv.dim() < 3:
        raise ExtractionError(f"{where}: stacked cache needs >= 3 dims, got shape {shape}")
    if declared is None and layer_kv.dim() == 4 and shape[3] % 2 == 0:
        raise ExtractionError(
            f"{where}: shape {shape} does not tell its layout under kv_cache_layout "
            f"{layout or 'auto'!r}; {VLLM_4D_HINT}; {ACCEPTED}"
        )
    candidates = _STACKED if declared is None else (declared,)
    fitting = [spec for spec in candidates if spec.fits(shape)]
    if len(fitting) > 1:
        raise ExtractionError(
            f"{where}: shape {shape} fits both [2, blocks, ...] and [blocks, 2, ...]; "
            "declare kv_cache_layout ('kv_first' or 'blocks_first')"
        )
    if not fitting:
        raise ExtractionError(
            f"{where}: shape {shape} does not match layout {layout or 'auto'!r}; {ACCEPTED}"
        )
    return fitting[0]


def layer_spec(layer_kv: Any, layout: str | None, where: str) -> LayoutSpec:
    """The layout one layer of a stage's cache is read in, given the stage's declared
    ``layout`` (a name of :data:`LAYOUTS` or an alias; ``None`` is ``"auto"``): a pair is a pair
    whatever is declared; a tensor is in the declared layout (a stacked one is checked against
    the shape here, the others check it when read), or, for ``"auto"``, in the one stacked
    layout its shape fits. Called by the sender's planner once per layer it has not prepared.
    Raises :class:`ExtractionError` naming ``where`` for anything it cannot read unambiguously.
    """
    declared = stage_layout_spec(layout)
    if isinstance(layer_kv, tuple | list):
        if len(layer_kv) != 2 or not all(isinstance(t, torch.Tensor) for t in layer_kv):
            raise ExtractionError(f"{where}: got {_described(layer_kv)}; {ACCEPTED}")
        return _KV_PAIR
    if isinstance(layer_kv, torch.Tensor):
        if declared is None or isinstance(declared, StackedLayout):
            return _stacked_spec(layer_kv, declared, layout, where)
        return declared
    hint = f"; {HF_HINT}" if _looks_like_hf_cache(layer_kv) else ""
    raise ExtractionError(f"{where}: got {_described(layer_kv)}; {ACCEPTED}{hint}")


def read_layer_kv(
    layer_kv: Any, layout: str | None, where: str
) -> tuple[LayoutSpec, torch.Tensor, torch.Tensor]:
    """:func:`split_layer_kv`, also returning the spec it read ``layer_kv`` with (the sender's
    planner asks it for :meth:`LayoutSpec.host_kv_bits`)."""
    spec = layer_spec(layer_kv, layout, where)
    try:
        k, v = spec.kv_views(layer_kv)
    except ExtractionError as exc:
        raise ExtractionError(f"{where}: {exc} (kv_cache_layout {layout!r})") from exc
    if k.dim() < 2 or v.dim() < 2:
        raise ExtractionError(f"{where}: K and V need >= 2 dims, got {tuple(k.shape)}")
    return spec, k, v


def split_layer_kv(
    layer_kv: Any, *, layout: str | None = None, where: str = "layer"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split one layer of a stage's cache into ``(K, V)`` block views ``[num_blocks, bs, heads,
    dim]``, in the stage's declared ``layout`` (a name of :data:`LAYOUTS` or an alias; ``None``
    is ``"auto"``; see :func:`layer_spec`). A :class:`PackedLayout` gives copies of every block.

    Raises :class:`ExtractionError` naming ``where`` for anything it cannot read unambiguously.
    """
    _spec, k, v = read_layer_kv(layer_kv, layout, where)
    return k, v


def normalize_layer_kv(
    layer_kv: Any,
    *,
    req_id: str = "",
    layer_idx: int = -1,
    block_size: int | None = None,
    layout: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Reference-compatible form of :func:`split_layer_kv`: ``None`` (and a warning) if invalid.

    ``block_size`` (the reference's 0.32 keyword) is checked against the blocks read: a layer
    whose blocks hold another number of tokens is invalid. It never selects a layout: a 4-D
    cache needs ``layout`` (see :data:`VLLM_4D_HINT`)."""
    try:
        k, v = split_layer_kv(layer_kv, layout=layout, where=f"layer {layer_idx}")
        if block_size is not None and k.dim() >= 2 and int(k.shape[1]) != block_size:
            raise ExtractionError(
                f"layer {layer_idx}: blocks of {int(k.shape[1])} tokens, not block_size "
                f"{block_size} (K blocks {tuple(k.shape)})"
            )
        return k, v
    except ExtractionError as exc:
        logger.warning("Invalid KV cache for request %s: %s", req_id, exc)
        return None


def vllm_layer_kv_views(layer: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(K, V)`` block views ``[num_blocks, block_size, heads, dim]`` of one vLLM layer.

    Called by the vLLM worker once per registered layer. ``layout`` comes from the attention
    backend, never from the shape: a name of :data:`VLLM_LAYOUTS` (no aliases), that is
    ``"vllm_cpu"``, ``"vllm_bhnc"``, or the stacked layouts of older vLLM releases, read as a
    stage's cache is and required to give 4-D K blocks. Raises :class:`ExtractionError`.
    """
    spec = vllm_layout_spec(layout)
    if isinstance(spec, PackedLayout):
        raise ExtractionError(f"vLLM cache layout {layout!r} has no views; it is packed")
    if not spec.shape_known:
        return spec.kv_views(layer)
    k, v = split_layer_kv(layer, layout=layout, where="vLLM layer")
    if k.dim() != 4:
        raise ExtractionError(
            f"vLLM layer: expected K blocks [blocks, block_size, heads, dim], got {tuple(k.shape)}"
        )
    return k, v
