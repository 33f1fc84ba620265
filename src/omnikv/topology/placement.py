"""Where a stage's ranks sit and how peers reach them: stage placement, sender endpoints and
the connector ports (the only place that does port math).

Ports: ``kv_zmq_port(base, from_stage, local_rank, replica_id)`` =
``base + 100 + replica_id * 1024 + local_rank * 16 + from_stage``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from omnikv.topology.keys import recv_stages_of, send_stages_of, stage_key, stage_number
from omnikv.topology.tp import KVTPTopology

__all__ = [
    "KV_RANK_PORT_STRIDE",
    "KV_REPLICA_PORT_STRIDE",
    "KV_TRANSFER_PORT_OFFSET",
    "REPLICA_ENV",
    "TRANSFER_ENGINE_DEFAULT_PORT",
    "RankInfo",
    "SenderEndpoint",
    "StagePlacement",
    "engine_connector_config",
    "get_omni_replica_id",
    "kv_zmq_port",
    "rank_port",
    "resolve_endpoint",
    "resolve_sender_entry",
    "sender_endpoint",
    "source_metadata",
]

logger = logging.getLogger(__name__)

KV_TRANSFER_PORT_OFFSET = 100
KV_RANK_PORT_STRIDE = 16
KV_REPLICA_PORT_STRIDE = 1024
REPLICA_ENV = "VLLM_OMNI_REPLICA_ID"


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
# Stage placement
# --------------------------------------------------------------------------------------------
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
# Sender endpoints and connector ports
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
        stage = stage_number(out["from_stage"]) or 0
        out["role"] = "sender"
        out["zmq_port"] = kv_zmq_port(base, stage, local_rank)
    elif receives:
        out["role"] = "receiver"
    return out
