"""The sender's per-layer preparation of a stage's KV cache, kept from one request to the next."""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple

import numpy as np
import torch

from omnikv.wire.encode import host_bits

__all__ = ["LayerCache", "PreparedBlocks", "PreparedLayer", "flat_bits"]


def flat_bits(bits: np.ndarray | None) -> np.ndarray | None:
    """``bits`` as one flat view when it is C-contiguous, else ``None`` (never a copy)."""
    return bits.reshape(-1) if bits is not None and bits.flags.c_contiguous else None


def _tail(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(map(int, t.shape[2:]))


class PreparedBlocks(NamedTuple):
    """What the gathers of one side (K or V) of a layer read besides the blocks themselves,
    derived once per layer (see :class:`omnikv.layouts.gather.BlockGather`)."""

    bits: np.ndarray | None  # the blocks as same-size integers (host only)
    tail: tuple[int, ...]  # the blocks' shape after [blocks, block_size], as ints
    flat: np.ndarray | None  # bits as one flat array (C-contiguous blocks only)

    @classmethod
    def of(cls, blocks: torch.Tensor, bits: np.ndarray | None) -> PreparedBlocks:
        """The preparation of ``blocks`` (``[num_blocks, block_size, ...]``), given their
        integer view ``bits`` (or ``None``)."""
        return cls(bits, _tail(blocks), flat_bits(bits))


class PreparedLayer(NamedTuple):
    """One layer's cache as every request reads it: K and V block views
    ``[num_blocks, block_size, ...]`` checked against the stage's ``block_size``, with their
    preparations."""

    k: torch.Tensor
    v: torch.Tensor
    k_prepared: PreparedBlocks
    v_prepared: PreparedBlocks
    nblocks: int  # blocks in the smaller of K and V


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
    on every use). Per request only the block ids' range is checked (by
    :func:`omnikv.layouts.gather.plan_request_kv`). Owned by
    :class:`omnikv.transfer.send.KVSender`; thread-safe (dict operations).
    """

    MAX_ENTRIES = 4096

    def __init__(self) -> None:
        self._entries: dict[tuple[Any, ...], tuple[tuple[Any, ...], PreparedLayer]] = {}
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

    def get(self, layer_kv: Any, layout: str | None, block_size: int) -> PreparedLayer | None:
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
        prepared = PreparedLayer(
            k_own,
            v_own,
            PreparedBlocks.of(k_own, k_bits),
            PreparedBlocks.of(v_own, v_bits),
            min(int(k.shape[0]), int(v.shape[0])),
        )
        self._entries[key] = (self._fingerprint(parts), prepared)
