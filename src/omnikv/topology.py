"""Tensor-parallel topology between a sender stage (TP size S) and a receiver stage (TP size T).

Plain frozen values and pure functions: no process groups, no ``torch.distributed``.

Keys (shared with the reference and its worker connector mixin):

* legacy key, when both sides run TP 1: ``omni_{from_stage}_to_{to_stage}_kv_cache_{request_id}``;
* rank-aware key otherwise: ``{request_id}_{from_stage}_{chunk_id}_{from_rank}_{to_rank}``.

Ports: ``kv_zmq_port(base, from_stage, local_rank, replica_id)`` =
``base + 100 + replica_id * 1024 + local_rank * 16 + from_stage``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from omnikv.errors import ConfigError

__all__ = [
    "KV_RANK_PORT_STRIDE",
    "KV_REPLICA_PORT_STRIDE",
    "KV_TRANSFER_PORT_OFFSET",
    "KVTPTopology",
    "RecvKeyBuilder",
    "SendKeyBuilder",
    "build_recv_keys",
    "build_send_keys",
    "get_omni_replica_id",
    "head_range",
    "merge_received_rank_shards",
    "rank_port",
    "slice_kv_tensor_heads",
    "slice_layer_blocks",
    "slice_received_rank_shard",
    "kv_zmq_port",
    "legacy_kv_key",
    "rank_aware_kv_key",
]

logger = logging.getLogger(__name__)

KV_TRANSFER_PORT_OFFSET = 100
KV_RANK_PORT_STRIDE = 16
KV_REPLICA_PORT_STRIDE = 1024
REPLICA_ENV = "VLLM_OMNI_REPLICA_ID"

SendKeyBuilder = Callable[[str, str, str], Sequence[str]]
"""``(request_id, from_stage, to_stage) -> keys`` hook for senders."""
RecvKeyBuilder = Callable[[str, str, str], Sequence["str | tuple[str, int | None]"]]
"""``(request_id, from_stage, to_stage) -> keys or (key, from_rank)`` hook for receivers."""


@dataclass(frozen=True)
class KVTPTopology:
    """Sender TP size, receiver TP size and this process's local rank.

    Raises :class:`~omnikv.errors.ConfigError` (a ``ValueError``) at construction for
    non-positive sizes, a negative rank or sizes where the larger is not a multiple of the smaller.
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
        big = max(self.source_tp_size, self.target_tp_size)
        small = min(self.source_tp_size, self.target_tp_size)
        if big % small:
            raise ConfigError(
                f"heterogeneous TP needs sizes where one is divisible by the other; "
                f"got from_tp={self.source_tp_size}, to_tp={self.target_tp_size}"
            )

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
        r = self.local_rank if rank is None else rank
        s, t, k = self.source_tp_size, self.target_tp_size, self.ratio
        if s == t:
            return [r]
        if s > t:
            return [r // k]
        return [r * k + i for i in range(k)]

    def source_ranks(self, rank: int | None = None) -> list[int]:
        """Sender ranks that receiver rank ``rank`` (default: local) receives from, in order."""
        r = self.local_rank if rank is None else rank
        s, t, k = self.source_tp_size, self.target_tp_size, self.ratio
        if s == t:
            return [r]
        if s > t:
            return [r * k + i for i in range(k)]
        return [r // k]


def legacy_kv_key(from_stage: str, to_stage: str, request_id: str) -> str:
    """``omni_{from}_to_{to}_kv_cache_{request_id}`` (TP 1 on both sides)."""
    return f"omni_{from_stage}_to_{to_stage}_kv_cache_{request_id}"


def rank_aware_kv_key(
    request_id: str, from_stage: str, chunk_id: int, from_rank: int, to_rank: int
) -> str:
    """``{request_id}_{from_stage}_{chunk_id}_{from_rank}_{to_rank}``."""
    return f"{request_id}_{from_stage}_{chunk_id}_{from_rank}_{to_rank}"


def build_send_keys(
    topo: KVTPTopology,
    request_id: str,
    from_stage: str,
    to_stage: str,
    hook: SendKeyBuilder | None = None,
) -> list[str]:
    """Keys the local sender rank puts ``request_id`` under, one per target rank.

    A hook that returns a non-empty list wins.
    """
    if hook is not None:
        keys = list(hook(request_id, from_stage, to_stage) or [])
        if keys:
            return [str(k) for k in keys]
    if topo.is_legacy:
        return [legacy_kv_key(from_stage, to_stage, request_id)]
    return [
        rank_aware_kv_key(request_id, from_stage, 0, topo.local_rank, to_rank)
        for to_rank in topo.target_ranks()
    ]


def build_recv_keys(
    topo: KVTPTopology,
    request_id: str,
    from_stage: str,
    to_stage: str,
    hook: RecvKeyBuilder | None = None,
) -> list[tuple[str, int | None]]:
    """``(key, from_rank)`` pairs the local receiver rank waits for, in source-rank order.

    A hook that returns a non-empty list wins: tuples are used as given; plain strings are
    paired with the computed source ranks when the counts match, else with ``None``.
    """
    if hook is not None:
        raw = list(hook(request_id, from_stage, to_stage) or [])
        if raw:
            sources = topo.source_ranks() if not topo.is_legacy else [None]
            strings = [k for k in raw if not isinstance(k, tuple)]
            pair_ranks = len(strings) == len(raw) and len(raw) == len(sources)
            out: list[tuple[str, int | None]] = []
            for i, item in enumerate(raw):
                if isinstance(item, tuple):
                    out.append((str(item[0]), item[1]))
                else:
                    out.append((str(item), sources[i] if pair_ranks else None))
            return out
    if topo.is_legacy:
        return [(legacy_kv_key(from_stage, to_stage, request_id), None)]
    return [
        (rank_aware_kv_key(request_id, from_stage, 0, src, topo.local_rank), src)
        for src in topo.source_ranks()
    ]


def get_omni_replica_id() -> int:
    """Replica id from ``VLLM_OMNI_REPLICA_ID``; invalid or negative values give 0."""
    raw = os.environ.get(REPLICA_ENV, "")
    try:
        value = int(raw)
    except ValueError:
        return 0
    return max(0, value)


def kv_zmq_port(
    base_port: int, from_stage: int, local_rank: int = 0, replica_id: int | None = None
) -> int:
    """The KV control port of sender ``local_rank`` of stage ``from_stage``.

    ``base + 100 + replica * 1024 + local_rank * 16 + from_stage``; ``replica_id`` ``None`` reads
    the environment (:func:`get_omni_replica_id`).
    """
    replica = get_omni_replica_id() if replica_id is None else max(0, int(replica_id))
    return (
        int(base_port)
        + KV_TRANSFER_PORT_OFFSET
        + replica * KV_REPLICA_PORT_STRIDE
        + int(local_rank) * KV_RANK_PORT_STRIDE
        + int(from_stage)
    )


def rank_port(base_port: int, rank: int | None) -> int:
    """The port of sender rank ``rank`` given rank 0's port (``base + rank * 16``)."""
    return int(base_port) + (rank or 0) * KV_RANK_PORT_STRIDE


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
PayloadSlicer = Callable[[dict[str, Any], KVTPTopology], dict[str, Any]]


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
    payload: Any, topo: KVTPTopology, slicer: PayloadSlicer | None = None
) -> Any:
    """Receiver-side slice (S < T) when the sender did not slice; tags ``side: "receiver"``."""
    if slicer is not None:
        return slicer(payload, topo)
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
    new_meta["tp_head_slice"] = {
        "applied": True,
        "side": "receiver",
        "target_rank": topo.local_rank,
        "from_tp": topo.source_tp_size,
        "to_tp": topo.target_tp_size,
        "offset_in_shard": offset,
        "num_slices": k,
    }
    out = dict(payload)
    out["layer_blocks"] = slice_layer_blocks(payload["layer_blocks"], offset, k)
    out["metadata"] = new_meta
    return out
