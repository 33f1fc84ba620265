"""Paged KV-cache layouts and the gather of a request's blocks.

Supported per-layer layouts (``block_size`` tokens per block):

* ``"kv_first"``  ``[2, num_blocks, block_size, heads, dim]`` (FlashAttention style);
* ``"blocks_first"`` ``[num_blocks, 2, block_size, heads, dim]`` (FlashInfer style);
* a ``(K, V)`` tuple of ``[num_blocks, block_size, heads, dim]`` tensors.

A 5-D tensor whose first two dims are both 2 fits both stacked layouts; then the declared layout
(``kv_cache_layout`` in the stage's ``omni_kv_config``) decides and, without one, the request fails
with a clear reason instead of a silent guess.

The sender calls :func:`plan_request_kv`, which validates block ids and ``seq_len`` and returns
:class:`BlockGather` writers; the payload encoder calls ``write_into`` with a view of the send
buffer, so blocks are gathered straight into the memory that travels (one copy).
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Sequence
from typing import Any, ClassVar, Literal, NamedTuple

import numpy as np
import torch

from omnikv.errors import KVMismatchError, OmniKVError
from omnikv.payload import host_bits

__all__ = [
    "LAYOUTS",
    "VLLM_BHNC_LAYOUT",
    "VLLM_CPU_LAYOUT",
    "VLLM_LAYOUTS",
    "BlockGather",
    "BlockIndex",
    "ExtractionError",
    "KVLayout",
    "LayerCache",
    "normalize_layer_kv",
    "plan_request_kv",
    "scatter_tokens",
    "split_layer_kv",
    "vllm_bhnc_kv_views",
    "vllm_cpu_kv_views",
    "vllm_layer_kv_views",
]

logger = logging.getLogger(__name__)

KVLayout = Literal["kv_first", "blocks_first", "auto"]
LAYOUTS: tuple[str, ...] = ("kv_first", "blocks_first", "auto")
_ALIASES = {"flash_attn": "kv_first", "flashinfer": "blocks_first", "nhd": "kv_first"}


class ExtractionError(OmniKVError, ValueError):
    """A request's KV cannot be extracted (bad block ids, missing seq_len, unknown layout)."""


ACCEPTED = (
    "accepted per-layer layouts: [2, num_blocks, block_size, heads, head_dim] (kv_first), "
    "[num_blocks, 2, block_size, heads, head_dim] (blocks_first), or a (K, V) pair of "
    "[num_blocks, block_size, heads, head_dim] tensors"
)
HF_HINT = (
    "this looks like a transformers cache; send it with "
    "omnikv.integrations.transformers.send_hf_cache(manager, request_id, cache)"
)


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


def _canonical_layout(layout: str | None) -> str:
    if layout is None:
        return "auto"
    name = _ALIASES.get(layout, layout)
    if name not in LAYOUTS:
        raise ExtractionError(f"unknown kv_cache_layout {layout!r}; expected one of {LAYOUTS}")
    return name


def split_layer_kv(
    layer_kv: Any, *, layout: str | None = None, where: str = "layer"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split one layer's cache into ``(K, V)`` block tensors ``[num_blocks, bs, heads, dim]``.

    Raises :class:`ExtractionError` naming ``where`` for anything it cannot read unambiguously.
    """
    k, v, _kind = _split(layer_kv, layout, where)
    return k, v


def _split(layer_kv: Any, layout: str | None, where: str) -> tuple[torch.Tensor, torch.Tensor, str]:
    """:func:`split_layer_kv`, also saying how: ``"pair"``, ``"kv_first"`` or ``"blocks_first"``."""
    kind = _canonical_layout(layout)
    if isinstance(layer_kv, tuple | list):
        if len(layer_kv) != 2 or not all(isinstance(t, torch.Tensor) for t in layer_kv):
            raise ExtractionError(f"{where}: got {_described(layer_kv)}; {ACCEPTED}")
        k, v = layer_kv
        kind = "pair"
    elif isinstance(layer_kv, torch.Tensor):
        shape = tuple(layer_kv.shape)
        if layer_kv.dim() < 3:
            raise ExtractionError(f"{where}: stacked cache needs >= 3 dims, got shape {shape}")
        first, second = shape[0] == 2, shape[1] == 2
        if kind == "auto":
            if first and second:
                raise ExtractionError(
                    f"{where}: shape {shape} fits both [2, blocks, ...] and [blocks, 2, ...]; "
                    "declare kv_cache_layout ('kv_first' or 'blocks_first')"
                )
            kind = "kv_first" if first else "blocks_first" if second else ""
        if kind == "kv_first" and first:
            k, v = layer_kv[0], layer_kv[1]
        elif kind == "blocks_first" and second:
            k, v = layer_kv[:, 0], layer_kv[:, 1]
        else:
            raise ExtractionError(
                f"{where}: shape {shape} does not match layout {layout or 'auto'!r}; {ACCEPTED}"
            )
    else:
        hint = f"; {HF_HINT}" if _looks_like_hf_cache(layer_kv) else ""
        raise ExtractionError(f"{where}: got {_described(layer_kv)}; {ACCEPTED}{hint}")
    if k.dim() < 2 or v.dim() < 2:
        raise ExtractionError(f"{where}: K and V need >= 2 dims, got {tuple(k.shape)}")
    return k, v, kind


def _host_bits_kv(layer_kv: Any, kind: str) -> tuple[np.ndarray | None, np.ndarray | None]:
    """K's and V's blocks as same-size integers (:func:`omnikv.payload.host_bits`) for a host
    layer stored as one tensor: one conversion for both, split in numpy. ``(None, None)``
    otherwise (:meth:`BlockGather.write_bits` then converts each side itself)."""
    if kind == "pair" or not layer_kv.is_cpu:
        return None, None
    bits = host_bits(layer_kv)
    if bits is None:
        return None, None
    return (bits[0], bits[1]) if kind == "kv_first" else (bits[:, 0], bits[:, 1])


def normalize_layer_kv(
    layer_kv: Any, *, req_id: str = "", layer_idx: int = -1, layout: str | None = None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Reference-compatible form of :func:`split_layer_kv`: ``None`` (and a warning) if invalid."""
    try:
        return split_layer_kv(layer_kv, layout=layout, where=f"layer {layer_idx}")
    except ExtractionError as exc:
        logger.warning("Invalid KV cache for request %s: %s", req_id, exc)
        return None


class BlockIndex:
    """A request's full blocks, prepared once and shared by every layer's :class:`BlockGather`.

    A run of consecutive ids (the common case for a fresh cache) is read with one slice; any
    other order with ``index_select`` over an index tensor made once per device.
    """

    __slots__ = ("_array", "_tensors", "ids", "start")

    def __init__(self, ids: tuple[int, ...]) -> None:
        self.ids = ids
        first = ids[0] if ids else 0
        #: The first id when the ids are ``first, first + 1, ...``, else ``None``.
        self.start: int | None = first if ids == tuple(range(first, first + len(ids))) else None
        self._tensors: dict[torch.device, torch.Tensor] = {}
        self._array: np.ndarray | None = None

    def array(self) -> np.ndarray:
        """The ids as an ``int64`` numpy array (made on first use)."""
        if self._array is None:
            self._array = np.array(self.ids, dtype=np.int64)
        return self._array

    def tensor(self, device: torch.device) -> torch.Tensor:
        """The ids as a ``long`` tensor on ``device`` (made on first use)."""
        t = self._tensors.get(device)
        if t is None:
            t = self._tensors[device] = torch.tensor(self.ids, dtype=torch.long, device=device)
        return t


class BlockGather:
    """Writes tokens ``[0, seq_len)`` of a request's blocks into a ``[seq_len, ...]`` view.

    ``blocks`` is ``[num_blocks, block_size, *tail]`` (any strides); ``block_ids`` lists the
    request's blocks in token order. Full blocks go in with one slice copy (consecutive ids) or
    one ``index_select`` into the destination, the partial last block with one slice copy.
    ``index`` (optional) is the full blocks' :class:`BlockIndex`, shared across layers by
    :func:`plan_request_kv`; without it one is made per call. The planner fills the optional
    rest from its per-layer preparation: ``bits`` (``blocks`` as same-size integers in numpy,
    host only), ``tail`` (``blocks.shape[2:]`` as ints: ``shape`` is then cheap) and ``flat``
    (``bits`` as one flat array when the blocks are C-contiguous, see :func:`flat_bits`).
    A plain slotted class (several are built per request; a frozen dataclass costs a
    ``object.__setattr__`` per field): treat it as read-only.
    """

    __slots__ = ("bits", "block_ids", "blocks", "flat", "index", "seq_len", "tail")

    #: ``shape`` is a tuple of plain ints (the encoder need not convert it).
    shape_is_ints: ClassVar[bool] = True

    def __init__(
        self,
        blocks: torch.Tensor,
        block_ids: tuple[int, ...],
        seq_len: int,
        index: BlockIndex | None = None,
        bits: np.ndarray | None = None,
        tail: tuple[int, ...] | None = None,
        flat: np.ndarray | None = None,
    ) -> None:
        self.blocks = blocks
        self.block_ids = block_ids
        self.seq_len = seq_len
        self.index = index
        self.bits = bits
        self.tail = tail
        self.flat = flat

    def __repr__(self) -> str:
        return (
            f"BlockGather(blocks={tuple(self.blocks.shape)}, block_ids={self.block_ids!r:.80},"
            f" seq_len={self.seq_len})"
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.blocks.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        tail = self.tail if self.tail is not None else tuple(map(int, self.blocks.shape[2:]))
        return (self.seq_len, *tail)

    def write_into(self, dst: torch.Tensor) -> None:
        src = self.blocks
        bs = int(src.shape[1])
        full, rest = divmod(self.seq_len, bs)
        if full:
            index = self._full_index(full)
            out = dst if not rest else dst[: full * bs]
            out = out.view(full, bs, *src.shape[2:])
            if index.start is not None:
                out.copy_(src[index.start : index.start + full])
            elif out.device == src.device:
                torch.index_select(src, 0, index.tensor(src.device), out=out)
            else:
                out.copy_(torch.index_select(src, 0, index.tensor(src.device)))
        if rest:
            dst[full * bs :].copy_(src[self.block_ids[full], :rest])

    def _full_index(self, full: int) -> BlockIndex:
        """The :class:`BlockIndex` of the first ``full`` blocks: the shared one when it fits."""
        index = self.index
        if index is None or len(index.ids) != full:
            index = BlockIndex(self.block_ids[:full])
        return index

    def write_bits(self, dst: np.ndarray) -> bool:
        """:meth:`write_into` through numpy for host blocks: ``dst`` is the destination viewed as
        same-size integers (:func:`omnikv.payload.host_bits`), ``[seq_len, ...]`` or flat.
        ``False`` (nothing written) when the blocks are not on the host. Called by
        ``pack_into``. When the request's blocks are consecutive in a contiguous cache (a fresh
        cache's common case), its tokens are one range of it: one copy, whatever the block
        count."""
        flat = self.flat
        if flat is not None and flat.dtype == dst.dtype and self._one_range(dst, flat):
            return True
        src = self.bits if self.bits is not None else host_bits(self.blocks)
        if src is None or src.dtype != dst.dtype:
            return False
        if dst.ndim == 1:
            dst = dst.reshape(self.shape)
        bs = src.shape[1]
        full, rest = divmod(self.seq_len, bs)
        if full:
            index = self._full_index(full)
            out = (dst if not rest else dst[: full * bs]).reshape(full, bs, *src.shape[2:])
            if index.start is not None:
                np.copyto(out, src[index.start : index.start + full], casting="no")
            else:
                np.take(src, index.array(), axis=0, out=out)
        if rest:
            np.copyto(dst[full * bs :], src[self.block_ids[full], :rest], casting="no")
        return True

    def _one_range(self, dst: np.ndarray, flat: np.ndarray) -> bool:
        """Copy the tokens with one slice of ``flat`` when they are one range of it: the full
        blocks are consecutive (the shared :class:`BlockIndex` knows) and a partial last block
        follows them. ``False`` (nothing written) otherwise."""
        bits, tail, ids = self.bits, self.tail, self.block_ids
        if bits is None or tail is None or not ids:
            return False
        bs = bits.shape[1]
        full, rest = divmod(self.seq_len, bs)
        if full:
            first = self._full_index(full).start
            if first is None or (rest and ids[full] != first + full):
                return False
        else:
            first = ids[0]
        per_token = math.prod(tail)
        start, count = first * bs * per_token, self.seq_len * per_token
        if dst.size != count or start + count > flat.size:
            return False
        if dst.ndim != 1:
            if not dst.flags.c_contiguous:
                return False
            dst = dst.reshape(-1)
        dst[:] = flat[start : start + count]
        return True

    def materialize(self) -> torch.Tensor:
        """A fresh contiguous tensor with the gathered tokens (tests, non-packed transports)."""
        out = torch.empty(self.shape, dtype=self.dtype, device=self.blocks.device)
        self.write_into(out)
        return out


def _check_blocks(
    t: torch.Tensor, needed: _Needed, block_size: int, where: tuple[str, int], name: str
) -> None:
    """Raise :class:`ExtractionError` unless ``t`` is ``[blocks, block_size, ...]`` holding
    the ``needed`` block ids; ``where`` is ``(request id, layer)`` for the message."""
    shape = t.shape
    if len(shape) < 3:
        raise ExtractionError(
            f"request {where[0]} layer {where[1]}: {name} blocks need [blocks, block_size, ...], "
            f"got {tuple(shape)}"
        )
    if shape[1] != block_size:
        raise ExtractionError(
            f"request {where[0]} layer {where[1]}: {name} blocks have shape {tuple(shape)}, "
            f"so block size {int(shape[1])} != block_size {block_size}; {ACCEPTED}"
        )
    count = int(shape[0])
    if needed.low < 0 or needed.high >= count:
        bad = [b for b in needed.ids if b < 0 or b >= count]
        raise ExtractionError(
            f"request {where[0]} layer {where[1]}: block ids {bad[:8]} outside {name} cache of "
            f"{count} blocks"
        )


class _Needed(NamedTuple):
    """The block ids a request's tokens occupy, with their range (checked once per tensor)."""

    ids: tuple[int, ...]
    low: int
    high: int


class _Prepared(NamedTuple):
    """One layer's cache as every request reads it (see :class:`LayerCache`)."""

    k: torch.Tensor
    v: torch.Tensor
    k_bits: np.ndarray | None
    v_bits: np.ndarray | None
    nblocks: int  # blocks in the smaller of K and V
    k_tail: tuple[int, ...]  # K's shape after [blocks, block_size]
    v_tail: tuple[int, ...]
    k_flat: np.ndarray | None  # k_bits as one flat array (C-contiguous blocks only)
    v_flat: np.ndarray | None


def flat_bits(bits: np.ndarray | None) -> np.ndarray | None:
    """``bits`` as one flat view when it is C-contiguous, else ``None`` (never a copy)."""
    return bits.reshape(-1) if bits is not None and bits.flags.c_contiguous else None


def _same_memory(t: torch.Tensor) -> torch.Tensor:
    """A tensor over ``t``'s memory with its dtype, shape and strides that is *not* a view of
    ``t``: it keeps the storage alive, not ``t`` (a view would keep ``t``'s Python object alive,
    and with it the weak reference :class:`LayerCache` watches)."""
    out = torch.empty(0, dtype=t.dtype, device=t.device)
    return out.set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())


#: A layer given as (K, V) (a tuple built once: ``tuple | list`` builds a union per test).
_PAIR = (tuple, list)


class LayerCache:
    """Per-layer preparation of a stage's KV cache, kept from one request to the next.

    A stage passes the same cache tensors with every batch (vLLM allocates them once), so
    splitting each layer into K and V, checking its shape against ``block_size`` and viewing
    host blocks as integers is done once per layer instead of once per request and layer. An
    entry is keyed by the identity of the layer's tensor(s), its layout and ``block_size``, and
    is used only while the tensor is alive (a weak reference drops the entry when it dies: the
    cache never keeps a user's KV alive) and unchanged (pointer, shape and strides are compared
    on every use). Per request only the block ids' range is checked. Owned by
    :class:`omnikv.sender.KVSender`; thread-safe (dict operations).
    """

    MAX_ENTRIES = 4096

    def __init__(self) -> None:
        self._entries: dict[tuple[Any, ...], tuple[tuple[Any, ...], _Prepared]] = {}
        self._watched: set[tuple[Any, ...]] = set()  # keys whose tensors have a finalizer

    def _forget(self, key: tuple[Any, ...]) -> None:
        """A watched tensor died: its entry goes (called by ``weakref.finalize``)."""
        self._entries.pop(key, None)
        self._watched.discard(key)

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def _parts(layer_kv: Any) -> tuple[torch.Tensor, ...] | None:
        if isinstance(layer_kv, torch.Tensor):
            parts: tuple[Any, ...] = (layer_kv,)
        elif isinstance(layer_kv, _PAIR) and len(layer_kv) == 2:
            parts = tuple(layer_kv)
        else:
            return None
        if not all(type(t) is torch.Tensor and t.layout == torch.strided for t in parts):
            return None  # subclasses, sparse or nested tensors: prepared per request
        return parts

    @staticmethod
    def _fingerprint(parts: tuple[torch.Tensor, ...]) -> tuple[Any, ...]:
        return tuple((t.data_ptr(), t.shape, t.stride()) for t in parts)

    def get(self, layer_kv: Any, layout: str | None, block_size: int) -> _Prepared | None:
        """The kept preparation of ``layer_kv``, or ``None`` (prepare it, then :meth:`put`)."""
        parts = self._parts(layer_kv)
        if parts is None:
            return None
        entry = self._entries.get((*map(id, parts), layout, block_size))
        if entry is None or entry[0] != self._fingerprint(parts):
            return None
        return entry[1]

    def put(
        self, layer_kv: Any, layout: str | None, block_size: int, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Keep a validated layer: ``k`` and ``v`` are its block views, checked against
        ``block_size``. Layers that cannot be watched (no weak reference) are not kept."""
        parts = self._parts(layer_kv)
        if parts is None:
            return
        key = (*map(id, parts), layout, block_size)
        try:
            k_own, v_own = _same_memory(k), _same_memory(v)
            if key not in self._watched:
                for t in parts:
                    weakref.finalize(t, self._forget, key)
                self._watched.add(key)
        except (RuntimeError, TypeError):
            return
        if len(self._entries) >= self.MAX_ENTRIES:
            self._entries.clear()
        k_bits = host_bits(k_own) if k_own.is_cpu else None
        v_bits = host_bits(v_own) if v_own.is_cpu else None
        count = min(int(k.shape[0]), int(v.shape[0]))
        prepared = _Prepared(
            k_own, v_own, k_bits, v_bits, count, _tail(k), _tail(v), flat_bits(k_bits),
            flat_bits(v_bits),
        )  # fmt: skip
        self._entries[key] = (self._fingerprint(parts), prepared)


def _tail(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(map(int, t.shape[2:]))


def plan_request_kv(
    kv_caches: Sequence[Any],
    block_ids: Sequence[int],
    seq_len: Any,
    block_size: int,
    *,
    layout: str | None = None,
    request_id: str = "",
    cache: LayerCache | None = None,
) -> tuple[list[BlockGather | None], list[BlockGather | None]]:
    """Validate a finished request's blocks and return per-layer gathers for K and V.

    ``None`` entries of ``kv_caches`` stay ``None`` layers. Raises :class:`ExtractionError` (the
    request fails, nothing is sent) for a missing or invalid ``seq_len``, an empty block list, a
    block id outside the cache, too few blocks for ``seq_len``, a block size that disagrees with the
    cache, or a layer the layouts cannot read. ``cache`` (the sender's) keeps each layer's
    preparation across requests; the outcome is the same with or without it.
    """
    rid = request_id or "?"
    if isinstance(seq_len, bool) or not isinstance(seq_len, int):
        raise ExtractionError(f"request {rid}: seq_len must be an int, got {seq_len!r}")
    if seq_len < 0:
        raise ExtractionError(f"request {rid}: seq_len must be >= 0, got {seq_len}")
    ids = tuple(int(b) for b in block_ids)
    if not ids:
        raise ExtractionError(f"request {rid}: no block_ids")
    if block_size <= 0:
        raise ExtractionError(f"request {rid}: block_size must be > 0, got {block_size}")
    if seq_len > len(ids) * block_size:
        raise ExtractionError(
            f"request {rid}: seq_len {seq_len} exceeds {len(ids)} blocks x {block_size} tokens"
        )
    needed = ids[: -(-seq_len // block_size)] if seq_len else ()
    index = BlockIndex(needed[: seq_len // block_size])
    span = _Needed(needed, min(needed), max(needed)) if needed else _Needed((), 0, -1)
    keys: list[BlockGather | None] = []
    values: list[BlockGather | None] = []
    for idx, layer_kv in enumerate(kv_caches):
        if layer_kv is None:
            keys.append(None)
            values.append(None)
            continue
        kept = cache.get(layer_kv, layout, block_size) if cache is not None else None
        if kept is not None and span.low >= 0 and span.high < kept.nblocks:
            k, v, k_bits, v_bits = kept.k, kept.v, kept.k_bits, kept.v_bits
            k_tail, v_tail, k_flat, v_flat = kept.k_tail, kept.v_tail, kept.k_flat, kept.v_flat
        else:
            k, v, kind = _split(layer_kv, layout, f"request {rid} layer {idx}")
            _check_blocks(k, span, block_size, (rid, idx), "K")
            _check_blocks(v, span, block_size, (rid, idx), "V")
            k_bits, v_bits = _host_bits_kv(layer_kv, kind)
            if cache is not None and kept is None:
                cache.put(layer_kv, layout, block_size, k, v)
            k_tail, v_tail = _tail(k), _tail(v)
            k_flat, v_flat = flat_bits(k_bits), flat_bits(v_bits)
        keys.append(BlockGather(k, needed, seq_len, index, k_bits, k_tail, k_flat))
        values.append(BlockGather(v, needed, seq_len, index, v_bits, v_tail, v_flat))
    if not any(g is not None for g in keys):
        raise ExtractionError(f"request {rid}: no layer has a KV cache")
    return keys, values


# -- vLLM paged caches (omnikv.integrations.vllm) --------------------------------------------------
#: vLLM's CPU attention backend (``CPU_ATTN``): one tensor per layer,
#: ``[num_blocks, kv_heads, block_size, 2 * head_size]``; per block and head the first
#: ``block_size * head_size`` elements are K stored transposed (``[head_size, block_size]``, token
#: index fastest), the next ``block_size * head_size`` are V as ``[block_size, head_size]``.
VLLM_CPU_LAYOUT = "vllm_cpu"
#: vLLM >= 0.32 GPU backends (``FLASH_ATTN``, ``TRITON_ATTN``): logical per-layer shape
#: ``[num_blocks, kv_heads, block_size, 2 * head_size]`` (any physical stride order), K in the
#: first ``head_size`` channels, V in the last ``head_size``.
VLLM_BHNC_LAYOUT = "vllm_bhnc"
#: Every layout :func:`vllm_layer_kv_views` reads.
VLLM_LAYOUTS: tuple[str, ...] = (VLLM_CPU_LAYOUT, VLLM_BHNC_LAYOUT, "kv_first", "blocks_first")


def vllm_cpu_kv_views(layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(K, V)`` views ``[num_blocks, block_size, heads, head_size]`` of a CPU_ATTN layer.

    The views alias ``layer`` (no copy): :class:`BlockGather` reads a request's tokens out of them
    and :func:`scatter_tokens` writes tokens into them. Raises :class:`ExtractionError` for a
    tensor that is not a contiguous ``[blocks, heads, block_size, 2 * head_size]`` cache.
    """
    shape = tuple(layer.shape)
    if layer.dim() != 4 or shape[3] % 2 or not layer.is_contiguous():
        raise ExtractionError(
            "vLLM CPU cache: expected a contiguous [num_blocks, kv_heads, block_size, "
            f"2 * head_size] tensor, got shape {shape}"
        )
    blocks, heads, block_size, two_d = shape
    head_size = two_d // 2
    halves = layer.view(blocks, heads, 2, block_size * head_size)
    k = halves[:, :, 0].view(blocks, heads, head_size, block_size).permute(0, 3, 1, 2)
    v = halves[:, :, 1].view(blocks, heads, block_size, head_size).permute(0, 2, 1, 3)
    return k, v


def vllm_bhnc_kv_views(layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(K, V)`` views ``[num_blocks, block_size, heads, head_size]`` of a vLLM >= 0.32 GPU layer.

    ``layer`` is the logical ``[num_blocks, kv_heads, block_size, 2 * head_size]`` tensor vLLM
    registers (strides follow its physical layout; the views keep them).
    """
    shape = tuple(layer.shape)
    if layer.dim() != 4 or shape[3] % 2:
        raise ExtractionError(
            "vLLM GPU cache: expected [num_blocks, kv_heads, block_size, 2 * head_size], "
            f"got shape {shape}"
        )
    head_size = shape[3] // 2
    both = layer.transpose(1, 2)
    return both[..., :head_size], both[..., head_size:]


def vllm_layer_kv_views(layer: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(K, V)`` block views ``[num_blocks, block_size, heads, dim]`` of one vLLM layer.

    ``layout`` comes from the attention backend, never from the shape (the CPU and the GPU
    layouts of vLLM 0.32 have the same shape): ``"vllm_cpu"`` (:data:`VLLM_CPU_LAYOUT`),
    ``"vllm_bhnc"`` (:data:`VLLM_BHNC_LAYOUT`), or the stacked layouts of older vLLM releases,
    ``"kv_first"`` (FlashAttention, ``[2, blocks, bs, heads, dim]``) and ``"blocks_first"``
    (FlashInfer, ``[blocks, 2, bs, heads, dim]``).
    """
    if layout == VLLM_CPU_LAYOUT:
        return vllm_cpu_kv_views(layer)
    if layout == VLLM_BHNC_LAYOUT:
        return vllm_bhnc_kv_views(layer)
    if layout not in VLLM_LAYOUTS:
        raise ExtractionError(
            f"unknown vLLM cache layout {layout!r}; expected one of {VLLM_LAYOUTS}"
        )
    k, v = split_layer_kv(layer, layout=layout, where="vLLM layer")
    if k.dim() != 4:
        raise ExtractionError(
            f"vLLM layer: expected K blocks [blocks, block_size, heads, dim], got {tuple(k.shape)}"
        )
    return k, v


def _check_scatter_fit(blocks: torch.Tensor, src: torch.Tensor) -> None:
    """``KVMismatchError`` unless ``src`` is ``[n, *tail]`` tokens of ``blocks``' dtype."""
    if blocks.dim() < 2:
        shape = tuple(blocks.shape)
        raise KVMismatchError(
            f"scatter: cache blocks must be [num_blocks, block_size, ...], got {shape}"
        )
    tail = tuple(blocks.shape[2:])
    if src.dim() != len(tail) + 1 or tuple(src.shape[1:]) != tail:
        raise KVMismatchError(
            f"scatter: expected tokens of shape [n, {', '.join(map(str, tail))}] for the cache, "
            f"got token shape {tuple(src.shape[1:]) if src.dim() else ()} "
            f"(received {tuple(src.shape)})"
        )
    if src.dtype != blocks.dtype:
        raise KVMismatchError(
            f"scatter: expected KV of the cache's dtype {blocks.dtype}, got {src.dtype} "
            f"(tokens of shape {tuple(src.shape)}); omnikv does not cast received KV"
        )


def scatter_tokens(
    blocks: torch.Tensor, block_ids: Sequence[int], src: torch.Tensor, start: int = 0
) -> None:
    """Write ``src`` (``[n, *tail]``) as tokens ``[start, start + n)`` of a request's blocks.

    The inverse of :meth:`BlockGather.write_into`, called by the vLLM worker once per layer and
    K or V of a received request: ``blocks`` is ``[num_blocks, block_size, *tail]`` (any strides;
    a view such as :func:`vllm_cpu_kv_views` is written through), ``block_ids`` lists the
    request's blocks in token order. ``src`` must have the cache's dtype and token shape (it is
    copied to the cache's device, never cast). Nothing is written when it raises:
    :class:`~omnikv.errors.KVMismatchError` naming the dtype or shape that does not fit, or
    :class:`ExtractionError` for too few blocks or a block id outside the cache.
    """
    _check_scatter_fit(blocks, src)
    bs = int(blocks.shape[1])
    n = int(src.shape[0])
    if start < 0 or start + n > len(block_ids) * bs:
        raise ExtractionError(
            f"scatter: tokens [{start}, {start + n}) do not fit {len(block_ids)} blocks of {bs}"
        )
    first, last = start // bs, -(-(start + n) // bs)
    ids = [int(b) for b in block_ids[first:last]]
    bad = [b for b in ids if b < 0 or b >= int(blocks.shape[0])]
    if bad:
        raise ExtractionError(f"scatter: block ids {bad[:8]} outside a cache of {blocks.shape[0]}")
    pos = 0
    for i, block in enumerate(ids):
        lo = (start + pos) % bs if i == 0 else 0
        take = min(bs - lo, n - pos)
        blocks[block, lo : lo + take].copy_(src[pos : pos + take])
        pos += take
