"""Per-layer KV-cache layouts: one spec class per layout, a registry, and the readers that split
one layer into K and V block views ``[num_blocks, block_size, ...]``.

Layouts (``block_size`` tokens per block):

* ``"kv_first"`` (aliases ``"flash_attn"``, ``"nhd"``): one tensor
  ``[2, num_blocks, block_size, heads, dim]`` (FlashAttention style);
* ``"blocks_first"`` (alias ``"flashinfer"``): one tensor ``[num_blocks, 2, block_size, heads,
  dim]`` (FlashInfer style);
* ``"pair"``: a ``(K, V)`` tuple or list of ``[num_blocks, block_size, heads, dim]`` tensors;
* ``"vllm_cpu"`` and ``"vllm_bhnc"``: the caches vLLM's attention backends register
  (:data:`VLLM_CPU_LAYOUT`, :data:`VLLM_BHNC_LAYOUT`).

Two readers choose the spec. :func:`split_layer_kv` reads a stage's cache (the sender, through
:func:`omnikv.layouts.gather.plan_request_kv`): a pair is a pair whatever the stage declares; a
tensor is read in the declared stacked layout, or, with ``"auto"`` (no declaration), in the one
stacked layout its shape fits. A 5-D tensor whose first two dims are both 2 fits both; then the
request fails with a clear reason instead of a silent guess. :func:`vllm_layer_kv_views` reads a
vLLM layer in the layout the attention backend names (never guessed from the shape: the CPU and
GPU layouts of vLLM 0.32 have the same shape).

Every view aliases the cache (no copy): gathers read a request's tokens out of them and
:func:`omnikv.layouts.scatter.scatter_tokens` writes tokens into them.
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
    "VLLM_BHNC_LAYOUT",
    "VLLM_CPU_LAYOUT",
    "VLLM_LAYOUTS",
    "BlocksFirstLayout",
    "KVFirstLayout",
    "KVPairLayout",
    "LayoutSpec",
    "StackedLayout",
    "VllmBhncLayout",
    "VllmCpuLayout",
    "layout_spec",
    "normalize_layer_kv",
    "read_layer_kv",
    "split_layer_kv",
    "stage_layout_spec",
    "vllm_layer_kv_views",
]

logger = logging.getLogger(__name__)

ACCEPTED = (
    "accepted per-layer layouts: [2, num_blocks, block_size, heads, head_dim] (kv_first), "
    "[num_blocks, 2, block_size, heads, head_dim] (blocks_first), or a (K, V) pair of "
    "[num_blocks, block_size, heads, head_dim] tensors"
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
    :func:`split_layer_kv`) and ``vllm_layout`` (:func:`vllm_layer_kv_views` reads it). Specs
    hold no state; every method may be called from any thread.
    """

    #: The canonical name (what :data:`LAYOUTS` and :data:`VLLM_LAYOUTS` list).
    name: ClassVar[str]
    #: Other spellings :func:`layout_spec` and a stage declaration accept.
    aliases: ClassVar[tuple[str, ...]] = ()
    stage_layout: ClassVar[bool] = False
    vllm_layout: ClassVar[bool] = False

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
    """vLLM >= 0.32 GPU backends (``FLASH_ATTN``, ``TRITON_ATTN``): logical per-layer shape
    ``[num_blocks, kv_heads, block_size, 2 * head_size]`` (any physical stride order; the views
    keep it), K in the first ``head_size`` channels, V in the last ``head_size``."""

    name = "vllm_bhnc"
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


_KV_FIRST = KVFirstLayout()
_BLOCKS_FIRST = BlocksFirstLayout()
_KV_PAIR = KVPairLayout()
#: Every layout, by canonical name, in the order the error messages list them.
_SPECS: dict[str, LayoutSpec] = {
    spec.name: spec
    for spec in (_KV_FIRST, _BLOCKS_FIRST, _KV_PAIR, VllmCpuLayout(), VllmBhncLayout())
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
#: Every layout :func:`vllm_layer_kv_views` reads: vLLM's own, then the stacked layouts of older
#: releases.
VLLM_LAYOUTS: tuple[str, ...] = (
    *(s.name for s in _SPECS.values() if s.vllm_layout and not s.stage_layout),
    *(s.name for s in _SPECS.values() if s.vllm_layout and s.stage_layout),
)


def layout_spec(name: str) -> LayoutSpec:
    """The spec of a layout name or alias; :class:`ExtractionError` listing the known names."""
    spec = _SPELLINGS.get(name)
    if spec is None:
        raise ExtractionError(f"unknown cache layout {name!r}; expected one of {tuple(_SPELLINGS)}")
    return spec


def stage_layout_spec(layout: str | None) -> StackedLayout | None:
    """The stacked layout a stage declares (a name of :data:`LAYOUTS` or an alias of one);
    ``None`` for ``None`` or ``"auto"`` (detect from the shape). Raises :class:`ExtractionError`
    for any other name."""
    if layout is None or layout == "auto":
        return None
    spec = _SPELLINGS.get(layout)
    if not isinstance(spec, StackedLayout):
        raise ExtractionError(f"unknown kv_cache_layout {layout!r}; expected one of {LAYOUTS}")
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
    one its shape fits. ``layout`` is the declaration as given (named in the messages)."""
    shape = tuple(layer_kv.shape)
    if layer_kv.dim() < 3:
        raise ExtractionError(f"{where}: stacked cache needs >= 3 dims, got shape {shape}")
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


def read_layer_kv(
    layer_kv: Any, layout: str | None, where: str
) -> tuple[LayoutSpec, torch.Tensor, torch.Tensor]:
    """:func:`split_layer_kv`, also returning the spec it read ``layer_kv`` with (the sender's
    planner asks it for :meth:`LayoutSpec.host_kv_bits`)."""
    declared = stage_layout_spec(layout)
    spec: LayoutSpec
    if isinstance(layer_kv, tuple | list):
        if len(layer_kv) != 2 or not all(isinstance(t, torch.Tensor) for t in layer_kv):
            raise ExtractionError(f"{where}: got {_described(layer_kv)}; {ACCEPTED}")
        spec = _KV_PAIR
    elif isinstance(layer_kv, torch.Tensor):
        spec = _stacked_spec(layer_kv, declared, layout, where)
    else:
        hint = f"; {HF_HINT}" if _looks_like_hf_cache(layer_kv) else ""
        raise ExtractionError(f"{where}: got {_described(layer_kv)}; {ACCEPTED}{hint}")
    k, v = spec.kv_views(layer_kv)
    if k.dim() < 2 or v.dim() < 2:
        raise ExtractionError(f"{where}: K and V need >= 2 dims, got {tuple(k.shape)}")
    return spec, k, v


def split_layer_kv(
    layer_kv: Any, *, layout: str | None = None, where: str = "layer"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split one layer of a stage's cache into ``(K, V)`` block views ``[num_blocks, bs, heads,
    dim]``, in the stage's declared ``layout`` (a name of :data:`LAYOUTS` or an alias; ``None``
    is ``"auto"``).

    Raises :class:`ExtractionError` naming ``where`` for anything it cannot read unambiguously.
    """
    _spec, k, v = read_layer_kv(layer_kv, layout, where)
    return k, v


def normalize_layer_kv(
    layer_kv: Any, *, req_id: str = "", layer_idx: int = -1, layout: str | None = None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Reference-compatible form of :func:`split_layer_kv`: ``None`` (and a warning) if invalid."""
    try:
        return split_layer_kv(layer_kv, layout=layout, where=f"layer {layer_idx}")
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
    spec = _SPECS.get(layout) if layout in VLLM_LAYOUTS else None
    if spec is None:
        raise ExtractionError(
            f"unknown vLLM cache layout {layout!r}; expected one of {VLLM_LAYOUTS}"
        )
    if not spec.stage_layout:
        return spec.kv_views(layer)
    k, v = split_layer_kv(layer, layout=layout, where="vLLM layer")
    if k.dim() != 4:
        raise ExtractionError(
            f"vLLM layer: expected K blocks [blocks, block_size, heads, dim], got {tuple(k.shape)}"
        )
    return k, v
