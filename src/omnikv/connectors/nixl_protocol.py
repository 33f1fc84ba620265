"""The NIXL connector's control protocol, settings and counters (no NIXL import here).

Messages (on :mod:`omnikv.connectors._control`, which adds the envelope, ``hello`` /
``welcome``, ``ping`` / ``pong`` and ``error``, the MAC and the replay protection):

* ``hello`` peer: ``agent`` (the receiver's NIXL agent name; notifications are accepted only
  from the agent that claimed the entry).
* ``meta`` -> ``agentmd`` {``md``: the sender agent's metadata, ``agent``: its name}: once per
  receiver and sender (again when the sender's agent name changes: it restarted).
* ``claim`` {``key``, ``wait_ms``, ``xid``, ``budget_ms``} -> ``grant`` {``found``, ``size``,
  ``addr``, ``agent``}: long-polls until the key is there (at most ``wait_ms``), then leases it
  to the transfer ``xid`` for ``budget_ms`` plus a grace: nobody else can claim it meanwhile.
* ``abort`` {``xid``}: the receiver will not read (no receive slot): the lease ends now.

The receiver then READs ``size`` bytes at ``addr`` from the sender's registered pool with the
notification ``xid``; the sender frees the entry when that notification arrives (consume-once).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omnikv.connectors._control import DEFAULT_WINDOW_S, Schema
from omnikv.connectors._mooncake_common import (
    config_port,
    config_seconds,
    parse_size,
    resolve_host,
)
from omnikv.errors import ConfigError

__all__ = [
    "LONG_POLL_CAP_S",
    "MAX_MESSAGE_BYTES",
    "SCHEMA",
    "COUNTER_NAMES",
    "NixlSettings",
    "transfer_budget_s",
]

#: Agent metadata grows with the NICs and backends of a host; 64 KiB bounds it generously.
MAX_MESSAGE_BYTES = 64 << 10
LONG_POLL_CAP_S = 5.0
MAX_BACKENDS = 8

SCHEMA = Schema(
    requests={
        "meta": {},
        "claim": {"key": str, "wait_ms": int, "xid": str, "budget_ms": int},
        "abort": {"xid": str},
    },
    replies={
        "agentmd": {"md": bytes, "agent": str},
        "grant": {"found": bool, "size": int, "addr": int, "agent": str},
    },
    hello={"agent": str},
)


def transfer_budget_s(nbytes: int) -> float:
    """How long one READ may take: 30 s + 5 s per full 100 MiB (the TE connector's rule)."""
    return 30.0 + 5.0 * (nbytes // (100 << 20))


#: The events the two sides count (:class:`~omnikv.connectors._stats.Counters`).
COUNTER_NAMES = (
    "puts",
    "put_bytes",
    "put_failures",
    "gets",
    "get_bytes",
    "misses",
    "grants",
    "consumed",
    "lease_expired",
    "aborted",
    "foreign_notifications",
    "ttl_reaped",
    "quarantine_events",
    "quarantine_freed",
    "late_arrivals",
    "peer_gone",
)


def _put_timeout(value: Any) -> float:
    """``put_timeout_s``: seconds >= 0 (0: the reference-shaped ``put`` tries once)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
        raise ConfigError(f"put_timeout_s must be a number of seconds >= 0, got {value!r}")
    return float(value)


def _backends(value: Any) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list | tuple) or not items or len(items) > MAX_BACKENDS:
        raise ConfigError(f"backends must be a non-empty list of NIXL backend names, got {value!r}")
    if not all(isinstance(b, str) and b.isalnum() for b in items):
        raise ConfigError(f"backends must be NIXL backend names such as 'UCX', got {value!r}")
    return tuple(items)


def _secret(value: Any) -> bytes | None:
    if value is None:
        return None
    if not isinstance(value, str | bytes) or not value:
        raise ConfigError("auth_secret must be a non-empty string or bytes (or unset)")
    return value.encode() if isinstance(value, str) else value


@dataclass(frozen=True)
class NixlSettings:
    """The NIXL connector's configuration, checked once (``ConfigError`` names the key)."""

    role: str
    host: str
    zmq_port: int | None
    backends: tuple[str, ...]
    pool_size: int
    ttl_s: float
    peer_timeout_s: float
    quarantine_dead_s: float
    close_timeout_s: float
    window_s: float
    put_timeout_s: float
    secret: bytes | None
    default_sender: tuple[str, int] | None

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> NixlSettings:
        role = cfg.get("role", "sender")
        if role not in {"sender", "receiver"}:
            raise ConfigError(f"role must be 'sender' or 'receiver', got {role!r}")
        zmq_port = None  # a receiver binds nothing: its zmq_port (if any) is not used
        if role == "sender":
            if cfg.get("zmq_port") is None:
                raise ConfigError("a sender needs zmq_port")
            zmq_port = config_port(cfg["zmq_port"], "zmq_port")
        default_sender = None
        if cfg.get("sender_host") and cfg.get("sender_zmq_port") is not None:
            sender_port = config_port(cfg["sender_zmq_port"], "sender_zmq_port")
            default_sender = (str(cfg["sender_host"]), sender_port)
        return cls(
            role=str(role),
            host=resolve_host(cfg.get("host")),
            zmq_port=zmq_port,
            backends=_backends(cfg.get("backends", ["UCX"])),
            pool_size=parse_size(cfg.get("memory_pool_size", 1 << 30), "memory_pool_size"),
            ttl_s=config_seconds(cfg, "buffer_ttl_seconds", 300.0),
            peer_timeout_s=config_seconds(cfg, "peer_timeout_seconds", 5.0),
            quarantine_dead_s=config_seconds(cfg, "quarantine_dead_seconds", 60.0),
            close_timeout_s=config_seconds(cfg, "close_timeout_seconds", 30.0),
            window_s=config_seconds(cfg, "auth_window_seconds", DEFAULT_WINDOW_S),
            put_timeout_s=_put_timeout(cfg.get("put_timeout_s", 0.0)),
            secret=_secret(cfg.get("auth_secret")),
            default_sender=default_sender,
        )
