"""Gathering a finished request's blocks out of a paged cache, straight into the send buffer.

The sender calls :func:`plan_request_kv`, which validates block ids and ``seq_len`` and returns
:class:`BlockGather` writers; the payload encoder calls ``write_into`` (or ``write_bits`` for
host blocks) with a view of the send buffer, so blocks are gathered straight into the memory
that travels (one copy).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar, NamedTuple

import numpy as np
import torch

from omnikv.errors import ExtractionError
from omnikv.layouts.cache import LayerCache, PreparedBlocks
from omnikv.layouts.specs import ACCEPTED, PackedLayout, layer_spec, read_layer_kv
from omnikv.wire.encode import host_bits

__all__ = ["BlockGather", "BlockIndex", "block_runs", "plan_request_kv"]


def block_runs(ids: Sequence[int], limit: int | None = None) -> list[tuple[int, int, int]] | None:
    """``ids`` as runs of consecutive ids, ``(position, first id, length)`` each, in order;
    ``None`` as soon as there are more than ``limit`` runs (never without a ``limit``). Used
    where a copy per run beats one indexed copy: :meth:`BlockIndex.runs` (the sender's numpy
    gather from a strided cache) and :func:`omnikv.layouts.scatter.scatter_tokens`."""
    runs: list[tuple[int, int, int]] = []
    for pos, block in enumerate(ids):
        if runs and runs[-1][1] + runs[-1][2] == block:
            at, first, n = runs[-1]
            runs[-1] = (at, first, n + 1)
        else:
            runs.append((pos, block, 1))
            if limit is not None and len(runs) > limit:
                return None
    return runs


class BlockIndex:
    """A request's full blocks, prepared once and shared by every layer's :class:`BlockGather`.

    A run of consecutive ids (the common case for a fresh cache) is read with one slice; any
    other order with ``index_select`` over an index tensor made once per device, or (numpy,
    from a strided cache) one slice per run of consecutive ids (:meth:`runs`).
    """

    __slots__ = ("_array", "_runs", "_tensors", "ids", "start")

    def __init__(self, ids: tuple[int, ...]) -> None:
        self.ids = ids
        first = ids[0] if ids else 0
        #: The first id when the ids are ``first, first + 1, ...``, else ``None``.
        self.start: int | None = first if ids == tuple(range(first, first + len(ids))) else None
        self._tensors: dict[torch.device, torch.Tensor] = {}
        self._array: np.ndarray | None = None
        self._runs: tuple[tuple[int, int, int], ...] | None = None

    def array(self) -> np.ndarray:
        """The ids as an ``int64`` numpy array (made on first use)."""
        if self._array is None:
            self._array = np.array(self.ids, dtype=np.int64)
        return self._array

    def runs(self) -> tuple[tuple[int, int, int], ...]:
        """The ids as runs of consecutive ids, ``(position, first id, length)`` each, in order
        (made on first use)."""
        if self._runs is None:
            self._runs = tuple(block_runs(self.ids) or ())
        return self._runs

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
    :func:`plan_request_kv`; without it one is made per call. ``prepared`` (optional) is what
    the planner derived from ``blocks`` once per layer
    (:class:`omnikv.layouts.cache.PreparedBlocks`), read as the attributes ``bits`` (``blocks``
    as same-size integers in numpy, host only), ``tail`` (``blocks.shape[2:]`` as ints:
    ``shape`` is then cheap) and ``flat`` (``bits`` as one flat array when the blocks are
    C-contiguous); without it they are ``None`` and computed where needed.
    A plain slotted class with positional parameters (two are built per layer and request; a
    frozen dataclass costs a ``object.__setattr__`` per field, keyword arguments a little more
    per call): treat it as read-only.
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
        prepared: PreparedBlocks | None = None,
    ) -> None:
        self.blocks = blocks
        self.block_ids = block_ids
        self.seq_len = seq_len
        self.index = index
        self.bits: np.ndarray | None
        self.tail: tuple[int, ...] | None
        self.flat: np.ndarray | None
        if prepared is None:
            self.bits = self.tail = self.flat = None
        else:
            self.bits, self.tail, self.flat = prepared

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
        same-size integers (:func:`omnikv.wire.encode.host_bits`), ``[seq_len, ...]`` or flat.
        ``False`` (nothing written) when the blocks are not on the host. Called by
        ``pack_into``. Reads only the request's blocks, whatever the cache's strides. When the
        tokens are one range of ``flat`` (:meth:`flat_range`; a fresh
        cache's common case), they go in with one copy, whatever the block count."""
        if self._write_range(dst):
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
            elif src.flags.c_contiguous:
                np.take(src, index.array(), axis=0, out=out)
            else:
                # numpy's take makes a contiguous copy of a strided source first: the whole
                # cache (e.g. K and V interleaved in vLLM's CPU layout), for a few blocks
                for at, first, n in index.runs():
                    np.copyto(out[at : at + n], src[first : first + n], casting="no")
        if rest:
            np.copyto(dst[full * bs :], src[self.block_ids[full], :rest], casting="no")
        return True

    def flat_range(self) -> tuple[int, int] | None:
        """The tokens' ``(start, stop)`` element offsets in ``flat`` when they are one range of
        it: the full blocks are consecutive (the shared :class:`BlockIndex` knows) and a partial
        last block follows them. ``None`` otherwise, and for a gather without ``flat``.
        :meth:`write_bits` copies such tokens with one slice of ``flat``."""
        flat, bits, tail, ids = self.flat, self.bits, self.tail, self.block_ids
        if flat is None or bits is None or tail is None or not ids:
            return None
        bs = bits.shape[1]
        full, rest = divmod(self.seq_len, bs)
        if full:
            first = self._full_index(full).start
            if first is None or (rest and ids[full] != first + full):
                return None
        else:
            first = ids[0]
        per_token = math.prod(tail)
        start = first * bs * per_token
        stop = start + self.seq_len * per_token
        return (start, stop) if stop <= flat.size else None

    def _write_range(self, dst: np.ndarray) -> bool:
        """Copy the tokens with one slice of ``flat`` (:meth:`flat_range`) when ``dst`` takes
        them as one range. ``False`` (nothing written) otherwise."""
        flat = self.flat
        if flat is None or flat.dtype != dst.dtype:
            return False
        span = self.flat_range()
        if span is None or dst.size != span[1] - span[0]:
            return False
        if dst.ndim != 1:
            if not dst.flags.c_contiguous:
                return False
            dst = dst.reshape(-1)
        dst[:] = flat[span[0] : span[1]]
        return True

    def materialize(self) -> torch.Tensor:
        """A fresh contiguous tensor with the gathered tokens (tests, non-packed transports)."""
        out = torch.empty(self.shape, dtype=self.dtype, device=self.blocks.device)
        self.write_into(out)
        return out


class _Needed(NamedTuple):
    """The block ids a request's tokens occupy, with their range (checked once per tensor)."""

    ids: tuple[int, ...]
    low: int
    high: int


def _check_blocks(
    t: torch.Tensor, needed: _Needed, *, block_size: int, request_id: str, layer: int, name: str
) -> None:
    """Raise :class:`ExtractionError` unless ``t`` is ``[blocks, block_size, ...]`` holding
    the ``needed`` block ids; ``request_id``, ``layer`` and ``name`` (K or V) say where."""
    where = f"request {request_id} layer {layer}"
    shape = t.shape
    if len(shape) < 3:
        raise ExtractionError(
            f"{where}: {name} blocks need [blocks, block_size, ...], got {tuple(shape)}"
        )
    if shape[1] != block_size:
        raise ExtractionError(
            f"{where}: {name} blocks have shape {tuple(shape)}, "
            f"so block size {int(shape[1])} != block_size {block_size}; {ACCEPTED}"
        )
    count = int(shape[0])
    if needed.low < 0 or needed.high >= count:
        bad = [b for b in needed.ids if b < 0 or b >= count]
        raise ExtractionError(
            f"{where}: block ids {bad[:8]} outside {name} cache of {count} blocks"
        )


def _packed_gathers(
    spec: PackedLayout,
    layer: torch.Tensor,
    span: _Needed,
    seq_len: int,
    block_size: int,
    where: str,
) -> tuple[BlockGather, BlockGather]:
    """Gathers of a request's tokens from a packed layer: its blocks are unpacked into one
    fresh ``[n, block_size, heads, head_size]`` copy per side (only the blocks the tokens
    occupy), which the gathers read in order. Raises :class:`ExtractionError` naming
    ``where``."""
    try:
        count, _heads, bs, _d = spec.check(layer)
    except ExtractionError as exc:
        raise ExtractionError(f"{where}: {exc} (kv_cache_layout {spec.name!r})") from exc
    if bs != block_size:
        raise ExtractionError(
            f"{where}: cache of shape {tuple(layer.shape)} has block size {bs} != block_size "
            f"{block_size} (kv_cache_layout {spec.name!r})"
        )
    if span.low < 0 or span.high >= count:
        bad = [b for b in span.ids if b < 0 or b >= count]
        raise ExtractionError(f"{where}: block ids {bad[:8]} outside a cache of {count} blocks")
    index = torch.tensor(span.ids, dtype=torch.long, device=layer.device)
    k, v = spec.unpack(layer, index)
    own = tuple(range(len(span.ids)))
    shared = BlockIndex(own[: seq_len // bs])
    return BlockGather(k, own, seq_len, shared), BlockGather(v, own, seq_len, shared)


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

    Called by the sender once per request. ``layout`` is the stage's declared
    ``kv_cache_layout`` (see :func:`omnikv.layouts.specs.split_layer_kv`). ``None`` entries of
    ``kv_caches`` stay ``None`` layers. Raises :class:`ExtractionError` (the request fails,
    nothing is sent) for a missing or invalid ``seq_len``, an empty block list, a block id
    outside the cache, too few blocks for ``seq_len``, a block size that disagrees with the
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
            k, v, k_prepared, v_prepared = kept.k, kept.v, kept.k_prepared, kept.v_prepared
        else:
            where = f"request {rid} layer {idx}"
            spec = layer_spec(layer_kv, layout, where)
            if isinstance(spec, PackedLayout):
                keys_g, values_g = _packed_gathers(spec, layer_kv, span, seq_len, block_size, where)
                keys.append(keys_g)
                values.append(values_g)
                continue
            spec, k, v = read_layer_kv(layer_kv, layout, where)
            _check_blocks(k, span, block_size=block_size, request_id=rid, layer=idx, name="K")
            _check_blocks(v, span, block_size=block_size, request_id=rid, layer=idx, name="V")
            if cache is not None and kept is None:
                cache.put(layer_kv, layout, block_size, k, v)
            k_bits, v_bits = spec.host_kv_bits(layer_kv)
            k_prepared, v_prepared = PreparedBlocks.of(k, k_bits), PreparedBlocks.of(v, v_bits)
        keys.append(BlockGather(k, needed, seq_len, index, k_prepared))
        values.append(BlockGather(v, needed, seq_len, index, v_prepared))
    if not any(g is not None for g in keys):
        raise ExtractionError(f"request {rid}: no layer has a KV cache")
    return keys, values
