"""Tensor-parallel topology between a sender stage (TP size S) and a receiver stage (TP size T),
and the head slicing and merging that heterogeneous TP needs.

Plain frozen values and pure functions: no process groups, no ``torch.distributed``. The sender
slices a payload per target rank when S < T (:func:`head_range`, :func:`head_slice_tag`); the
receiver merges shards of several sender ranks when S > T (:func:`merge_received_rank_shards`)
and slices a payload the sender did not slice (:func:`slice_received_rank_shard`). The
worker's merger and slicer hooks replace the default merge and slice; :func:`adapt_slicer`
accepts the reference's one-argument slicer.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from omnikv.errors import ConfigError

__all__ = [
    "KVTPTopology",
    "PayloadMerger",
    "PayloadSlicer",
    "adapt_slicer",
    "head_range",
    "head_slice_tag",
    "merge_received_rank_shards",
    "slice_kv_tensor_heads",
    "slice_layer_blocks",
    "slice_received_rank_shard",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVTPTopology:
    """Sender TP size, receiver TP size and this process's local rank.

    Construction rejects non-positive sizes and a negative rank
    (:class:`~omnikv.errors.ConfigError`, a ``ValueError``). Sizes where the larger is not a
    multiple of the smaller are accepted here and refused where the reference refuses them: by
    :meth:`target_ranks` and :meth:`source_ranks` (and :meth:`check_divisible`, which the manager
    calls while it is configured, so a stage never starts with such sizes).
    """

    source_tp_size: int
    target_tp_size: int
    local_rank: int = 0

    def __post_init__(self) -> None:
        if self.source_tp_size <= 0 or self.target_tp_size <= 0:
            raise ConfigError(
                f"TP sizes must be > 0, got from_tp={self.source_tp_size} "
                f"to_tp={self.target_tp_size}"
            )
        if self.local_rank < 0:
            raise ConfigError(f"local_rank must be >= 0, got {self.local_rank}")

    def check_divisible(self) -> None:
        """Raise :class:`ConfigError` ("divisible") unless one size is a multiple of the other."""
        big = max(self.source_tp_size, self.target_tp_size)
        small = min(self.source_tp_size, self.target_tp_size)
        if big % small:
            raise ConfigError(
                f"heterogeneous TP needs sizes where one is divisible by the other; "
                f"got from_tp={self.source_tp_size}, to_tp={self.target_tp_size}"
            )

    @classmethod
    def for_stage(
        cls, from_tp: int, to_tp: int, local_rank: int, detected_tp: int = 1
    ) -> KVTPTopology:
        """The reference's rule: configured ``1``/``1`` (or less) means both sides run the
        detected TP size (symmetric); anything else is used as configured."""
        if from_tp <= 1 and to_tp <= 1:
            from_tp = to_tp = max(1, detected_tp)
        return cls(from_tp, to_tp, local_rank)

    @property
    def is_heterogeneous(self) -> bool:
        return self.source_tp_size != self.target_tp_size

    @property
    def is_legacy(self) -> bool:
        """Both sides run TP 1: the legacy key is used."""
        return self.source_tp_size <= 1 and self.target_tp_size <= 1

    @property
    def ratio(self) -> int:
        return max(self.source_tp_size, self.target_tp_size) // min(
            self.source_tp_size, self.target_tp_size
        )

    def target_ranks(self, rank: int | None = None) -> list[int]:
        """Receiver ranks that sender rank ``rank`` (default: local) sends to."""
        self.check_divisible()
        r = self.local_rank if rank is None else rank
        s, t, k = self.source_tp_size, self.target_tp_size, self.ratio
        if s == t:
            return [r]
        if s > t:
            return [r // k]
        return [r * k + i for i in range(k)]

    def source_ranks(self, rank: int | None = None) -> list[int]:
        """Sender ranks that receiver rank ``rank`` (default: local) receives from, in order."""
        self.check_divisible()
        r = self.local_rank if rank is None else rank
        s, t, k = self.source_tp_size, self.target_tp_size, self.ratio
        if s == t:
            return [r]
        if s > t:
            return [r * k + i for i in range(k)]
        return [r // k]


# --------------------------------------------------------------------------------------------
# Head slicing and merging for heterogeneous TP (tensors are [seq_len, heads, head_dim])
# --------------------------------------------------------------------------------------------
def head_range(num_heads: int, offset: int, num_slices: int) -> tuple[int, int]:
    """Heads ``[start, stop)`` that slice ``offset`` of ``num_slices`` gets out of ``num_heads``.

    Divisible heads split evenly. When there are fewer KV heads than slices (GQA with a large
    TP), each head is replicated over ``num_slices // num_heads`` consecutive slices, the way
    tensor-parallel attention replicates KV heads, so slice ``offset`` gets one head.
    """
    if num_slices <= 0 or not 0 <= offset < num_slices:
        raise ValueError(f"slice offset {offset} outside [0, {num_slices})")
    if num_heads <= 0:
        raise ValueError(f"num_heads must be > 0, got {num_heads}")
    if num_heads % num_slices == 0:
        per = num_heads // num_slices
        return offset * per, (offset + 1) * per
    if num_slices % num_heads == 0:
        head = offset * num_heads // num_slices
        return head, head + 1
    raise ValueError(
        f"{num_heads} KV heads cannot be split over {num_slices} slices (neither divides the other)"
    )


def slice_kv_tensor_heads(tensor: Any, offset: int, num_slices: int) -> Any:
    """Slice ``offset`` of ``num_slices`` along the head dim (dim 1); non-tensors pass through."""
    if not isinstance(tensor, torch.Tensor):
        return tensor
    if tensor.dim() < 2:
        raise ValueError(f"head slicing needs >= 2 dims, got shape {tuple(tensor.shape)}")
    start, stop = head_range(int(tensor.shape[1]), offset, num_slices)
    return tensor[:, start:stop].contiguous()


def slice_layer_blocks(
    layer_blocks: dict[str, Any], offset: int, num_slices: int
) -> dict[str, Any]:
    """Apply :func:`slice_kv_tensor_heads` to every layer of both caches."""
    return {
        name: [slice_kv_tensor_heads(t, offset, num_slices) for t in (layers or [])]
        if name in ("key_cache", "value_cache")
        else layers
        for name, layers in layer_blocks.items()
    }


PayloadMerger = Callable[[list[dict[str, Any]]], "dict[str, Any] | None"]
"""``merger(payloads) -> payload`` hook: seed dicts of the sender ranks, in source-rank order."""
PayloadSlicer = Callable[[dict[str, Any], KVTPTopology], dict[str, Any]]
"""``slicer(payload, topo) -> payload`` hook (see :func:`adapt_slicer` for the reference's form)."""


def merge_received_rank_shards(payloads: Sequence[Any], merger: PayloadMerger | None = None) -> Any:
    """Merge shards from several sender ranks (S > T) along the head dim, in source-rank order.

    Request id, block ids and metadata come from the first payload. Shards that carry the same
    heads (KV heads replicated across sender ranks) are merged once.
    """
    if merger is not None:
        return merger(list(payloads))
    if not payloads:
        return None
    if len(payloads) == 1:
        return payloads[0]
    first = payloads[0]
    if not isinstance(first, dict) or "layer_blocks" not in first:
        return first
    merged: dict[str, list[Any]] = {}
    for cache in ("key_cache", "value_cache"):
        per_shard = [list((p.get("layer_blocks") or {}).get(cache) or []) for p in payloads]
        n = max(len(x) for x in per_shard)
        layers: list[Any] = []
        for i in range(n):
            parts = [x[i] for x in per_shard if i < len(x) and isinstance(x[i], torch.Tensor)]
            if not parts:
                layers.append(None)
            elif len(parts) == 1:
                layers.append(parts[0])
            else:
                layers.append(torch.cat(_dedupe_replicated(parts), dim=1))
        merged[cache] = layers
    return {
        "request_id": first.get("request_id"),
        "layer_blocks": merged,
        "block_ids": first.get("block_ids"),
        "metadata": first.get("metadata"),
    }


def _dedupe_replicated(parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Drop consecutive shards identical to the previous one (replicated single KV heads)."""
    out = [parts[0]]
    for p in parts[1:]:
        prev = out[-1]
        if p.shape == prev.shape and p.shape[1] == 1 and torch.equal(p, prev):
            continue
        out.append(p)
    return out


def slice_received_rank_shard(
    payload: Any, topo: KVTPTopology, slicer: Callable[..., Any] | None = None
) -> Any:
    """Receiver-side slice (S < T) when the sender did not slice; tags ``side: "receiver"``.

    ``slicer``, when given, always wins: the reference's one-argument ``slicer(payload)`` or
    omnikv's ``slicer(payload, topo)`` (see :func:`adapt_slicer`).
    """
    adapted = adapt_slicer(slicer)
    if adapted is not None:
        return adapted(payload, topo)
    if topo.target_tp_size <= topo.source_tp_size:
        return payload
    if not isinstance(payload, dict) or "layer_blocks" not in payload:
        return payload
    meta = payload.get("metadata") or {}
    tag = meta.get("tp_head_slice") if isinstance(meta, dict) else None
    if isinstance(tag, dict) and tag.get("applied"):
        if tag.get("target_rank") != topo.local_rank:
            logger.warning(
                "pre-sliced KV for target rank %s arrived at rank %d",
                tag.get("target_rank"),
                topo.local_rank,
            )
        return payload
    k = topo.ratio
    offset = topo.local_rank % k
    new_meta = dict(meta) if isinstance(meta, dict) else {}
    new_meta["tp_head_slice"] = head_slice_tag(topo, topo.local_rank, side="receiver")
    out = dict(payload)
    out["layer_blocks"] = slice_layer_blocks(payload["layer_blocks"], offset, k)
    out["metadata"] = new_meta
    return out


def head_slice_tag(topo: KVTPTopology, target_rank: int, *, side: str) -> dict[str, Any]:
    """The ``tp_head_slice`` metadata of a payload sliced for ``target_rank`` (S < T).

    ``side`` is ``"sender"`` (sliced before the put; also names ``source_rank``) or
    ``"receiver"`` (sliced after the get).
    """
    tag: dict[str, Any] = {"applied": True, "side": side, "target_rank": target_rank}
    if side == "sender":
        tag["source_rank"] = topo.local_rank
    tag.update(
        from_tp=topo.source_tp_size,
        to_tp=topo.target_tp_size,
        offset_in_shard=target_rank % topo.ratio,
        num_slices=topo.ratio,
    )
    return tag


# --------------------------------------------------------------------------------------------
# Slicer hooks: the reference's calling convention, and omnikv's richer one
# --------------------------------------------------------------------------------------------
def _positional_arity(fn: Callable[..., Any]) -> int | None:
    """How many positional arguments ``fn`` takes (``None``: any number, or unknown)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    n = 0
    for p in params:
        if p.kind is p.VAR_POSITIONAL:
            return None
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            n += 1
    return n


def adapt_slicer(fn: Callable[..., Any] | None) -> PayloadSlicer | None:
    """A payload slicer in omnikv's form ``slicer(payload, topo)``: the reference calls
    ``slicer(payload)``, omnikv accepts both. Used by :func:`slice_received_rank_shard` and
    :meth:`omnikv.topology.keys.TransferHooks.of`."""
    if fn is None:
        return None
    if _positional_arity(fn) == 1:
        return lambda payload, _topo: fn(payload)  # type: ignore[no-any-return]
    return fn
