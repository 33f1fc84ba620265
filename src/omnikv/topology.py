"""Tensor-parallel topology between a sender stage (TP size S) and a receiver stage (TP size T).

Plain frozen values and pure functions: no process groups, no ``torch.distributed``.

Keys (shared with the reference and its worker connector mixin):

* legacy key, when both sides run TP 1: ``omni_{from_stage}_to_{to_stage}_kv_cache_{request_id}``;
* rank-aware key otherwise: ``{request_id}_{from_stage}_{chunk_id}_{from_rank}_{to_rank}``.

Ports: ``kv_zmq_port(base, from_stage, local_rank, replica_id)`` =
``base + 100 + replica_id * 1024 + local_rank * 16 + from_stage``.
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from omnikv.errors import ConfigError

__all__ = [
    "TRANSFER_ENGINE_DEFAULT_PORT",
    "KV_RANK_PORT_STRIDE",
    "RankInfo",
    "SenderEndpoint",
    "StagePlacement",
    "TransferHooks",
    "engine_connector_config",
    "head_slice_tag",
    "recv_stages_of",
    "resolve_endpoint",
    "resolve_sender_entry",
    "send_stages_of",
    "sender_endpoint",
    "source_metadata",
    "stage_key",
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
    payload: Any, topo: KVTPTopology, slicer: Callable[..., Any] | None = None
) -> Any:
    """Receiver-side slice (S < T) when the sender did not slice; tags ``side: "receiver"``.

    ``slicer``, when given, always wins: the reference's one-argument ``slicer(payload)`` or
    omnikv's ``slicer(payload, topo)`` (as :meth:`TransferHooks.of` accepts both).
    """
    adapted = _adapt_slicer(slicer)
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
# Stage ids: "1" and 1 are the same stage everywhere
# --------------------------------------------------------------------------------------------
def stage_key(value: Any) -> str | None:
    """The one spelling of a stage id: ``None``/``""`` -> ``None``; ``1``, ``"1"``, ``" 1"`` ->
    ``"1"``; other names (``"stage2"``) as given. Booleans are not stage ids (``None``)."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int):
        return str(value)
    text = str(value).strip()
    if not text:
        return None
    try:
        return str(int(text))
    except ValueError:
        return text


def _stage_number(value: Any) -> int | None:
    key = stage_key(value)
    try:
        return None if key is None else int(key)
    except ValueError:
        return None


def send_stages_of(from_stage: Any, to_stage: Any) -> tuple[str | None, str | None]:
    """``(from, to)`` when both are configured (stage 0 counts), else ``(None, None)``."""
    src, dst = stage_key(from_stage), stage_key(to_stage)
    return (src, dst) if src is not None and dst is not None else (None, None)


def recv_stages_of(
    from_stage: Any, stage_id: Any, engine_input_source: Sequence[Any] | None
) -> tuple[str | None, str | None]:
    """``(source, stage)`` a receiver reads from (reference rule, stage ids normalised).

    The source is ``engine_input_source[0]`` when given; else, for a numeric ``stage_id`` (``3``
    or ``"3"``), the stage before it; else ``from_stage``.
    """
    stage = stage_key(stage_id)
    number = _stage_number(stage_id)
    source: Any = from_stage
    if engine_input_source:
        source = engine_input_source[0]
    elif number is not None:
        source = number - 1
    src = stage_key(source)
    return (src, stage) if src is not None and stage is not None else (None, None)


class RankInfo(Protocol):
    """What a manager needs to know about its process's place in its stage."""

    @property
    def local_rank(self) -> int: ...

    @property
    def tp_size(self) -> int: ...


def _env_local_rank() -> int:
    try:
        return max(0, int(os.environ.get("LOCAL_RANK", "0")))
    except ValueError:
        return 0


@dataclass(frozen=True)
class StagePlacement:
    """Where one manager sits: the edge it sends on, the edge it receives on, its TP topology."""

    send_stages: tuple[str | None, str | None]
    recv_stages: tuple[str | None, str | None]
    topology: KVTPTopology

    @classmethod
    def of(cls, config: Any, rank_info: RankInfo | None = None) -> StagePlacement:
        """From an ``OmniKVCacheConfig`` and an optional ``RankInfo`` (``local_rank``,
        ``tp_size``); without one, ``LOCAL_RANK`` (default 0) and TP size 1 are assumed."""
        rank = _env_local_rank() if rank_info is None else int(rank_info.local_rank)
        detected = 1 if rank_info is None else int(rank_info.tp_size)
        topo = KVTPTopology.for_stage(int(config.from_tp), int(config.to_tp), rank, detected)
        topo.check_divisible()  # a stage is configured or refused now, never mid-request
        return cls(
            send_stages_of(config.from_stage, config.to_stage),
            recv_stages_of(config.from_stage, config.stage_id, config.engine_input_source),
            topo,
        )


# --------------------------------------------------------------------------------------------
# Sender endpoints and connector ports (the only place that does port math)
# --------------------------------------------------------------------------------------------
SenderEndpoint = tuple[str, int]
"""``(host, rank-0 port)`` of the sender stage, as the orchestrator reports it."""

TRANSFER_ENGINE_DEFAULT_PORT = 50051


def resolve_sender_entry(
    sender_info: Any, preferred: Any = None, fallback: Any = None
) -> dict[str, Any] | None:
    """One ``{"host", "zmq_port"}`` entry out of flat or per-stage sender info (reference §2.6).

    Per-stage maps are looked up by ``preferred``, then ``fallback`` (stage ids compared
    normalised: ``1 == "1"``); else the only entry with a host; several -> ``None`` (warning).
    """
    if not sender_info or not isinstance(sender_info, Mapping):
        return None
    if "host" in sender_info:
        return dict(sender_info)
    entries = {stage_key(k): v for k, v in sender_info.items() if isinstance(v, Mapping)}
    for want in (stage_key(preferred), stage_key(fallback)):
        entry = entries.get(want) if want is not None else None
        if entry is not None and "host" in entry:
            return dict(entry)
    hosts = [v for v in entries.values() if "host" in v]
    if len(hosts) == 1:
        return dict(hosts[0])
    if len(hosts) > 1:
        logger.warning("Ambiguous sender_info with %d stages and no match", len(hosts))
    return None


def sender_endpoint(entry: Mapping[str, Any] | None) -> SenderEndpoint | None:
    """``(host, port)`` of a resolved entry; ``None`` without a host or with a bad port."""
    if entry is None or entry.get("host") is None:
        return None
    port = entry.get("zmq_port", 0)
    if isinstance(port, bool | float):
        return None
    try:
        value = int(port)
    except (TypeError, ValueError):
        return None
    return (str(entry["host"]), value) if 0 <= value <= 65535 else None


def resolve_endpoint(
    sender_info: Any, preferred: Any = None, fallback: Any = None
) -> SenderEndpoint | None:
    """:func:`sender_endpoint` of :func:`resolve_sender_entry`."""
    return sender_endpoint(resolve_sender_entry(sender_info, preferred, fallback))


def source_metadata(
    sender: SenderEndpoint | None, from_rank: int | None, per_call: bool
) -> dict[str, Any] | None:
    """Per-key connector metadata naming sender rank ``from_rank``'s endpoint, or ``None``.

    Built when the base endpoint is known and either the key has a source rank or the endpoint
    was given for this call only (reference §2.6).
    """
    if sender is None or (from_rank is None and not per_call):
        return None
    return {"source_host": sender[0], "source_port": rank_port(sender[1], from_rank)}


def engine_connector_config(
    extra: Mapping[str, Any],
    *,
    from_stage: Any,
    to_stage: Any,
    sends: bool,
    receives: bool,
    local_rank: int,
) -> dict[str, Any]:
    """The constructor config of a pull-model (transfer-engine) connector (reference §2.3).

    Stages default to ``"0"`` / ``"1"``; a sender binds :func:`kv_zmq_port` of the configured
    base port (``${VAR}`` expanded; default 50051), a receiver keeps its config. Raises
    ``ValueError`` for a base port that is not an integer.
    """
    out = dict(extra)
    out.setdefault("from_stage", stage_key(from_stage) or "0")
    out.setdefault("to_stage", stage_key(to_stage) or "1")
    if sends:
        raw = os.path.expandvars(str(out.get("zmq_port", TRANSFER_ENGINE_DEFAULT_PORT)))
        base = int(raw)
        stage = _stage_number(out["from_stage"]) or 0
        out["role"] = "sender"
        out["zmq_port"] = kv_zmq_port(base, stage, local_rank)
    elif receives:
        out["role"] = "receiver"
    return out


# --------------------------------------------------------------------------------------------
# Hooks: the reference's calling conventions, and omnikv's richer ones
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


def _adapt_slicer(fn: Callable[..., Any] | None) -> PayloadSlicer | None:
    """The reference calls ``slicer(payload)``; omnikv also accepts ``slicer(payload, topo)``."""
    if fn is None:
        return None
    if _positional_arity(fn) == 1:
        return lambda payload, _topo: fn(payload)  # type: ignore[no-any-return]
    return fn


@dataclass(frozen=True)
class TransferHooks:
    """The worker's optional hooks, as one frozen value the sender and receiver read.

    * ``send_keys(request_id, from_stage, to_stage) -> keys``;
    * ``recv_keys(request_id, from_stage, to_stage) -> keys or (key, from_rank) pairs``;
    * ``merger(payloads) -> payload`` (seed dicts, in source-rank order);
    * ``slicer(payload) -> payload`` as the reference calls it, or ``slicer(payload, topo)``.

    Build it with :meth:`of`, which adapts the reference's one-argument slicer.
    """

    send_keys: SendKeyBuilder | None = None
    recv_keys: RecvKeyBuilder | None = None
    merger: PayloadMerger | None = None
    slicer: PayloadSlicer | None = None

    @classmethod
    def of(
        cls,
        send_keys: Callable[..., Any] | None = None,
        recv_keys: Callable[..., Any] | None = None,
        merger: Callable[..., Any] | None = None,
        slicer: Callable[..., Any] | None = None,
    ) -> TransferHooks:
        return cls(send_keys, recv_keys, merger, _adapt_slicer(slicer))

    @property
    def reshapes_payloads(self) -> bool:
        """A merger or slicer is installed (they work on the seed's dict form)."""
        return self.merger is not None or self.slicer is not None
