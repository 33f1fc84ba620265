"""What both sides of the Transfer Engine connector agree on: messages, limits, configuration.

Control messages ride on :mod:`omnikv.connectors._control` (envelope, HMAC, nonces, replay
window, channels). A receiver's ``hello`` declares its engine session and the address range of
its registered receive pool; the sender writes only there. Requests: ``query`` (long-poll for a
key's size), ``pull`` (write the entry into ``[dst, dst + cap)`` of the requester's pool),
``status`` (what became of a transfer, for quarantined slots), ``ping``. Replies: ``info``,
``done``, ``xstate``, ``pong``, ``error``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from omnikv.connectors._control import DEFAULT_WINDOW_S, Schema
from omnikv.connectors._mooncake_common import (
    config_count,
    config_port,
    config_seconds,
    parse_size,
    resolve_host,
)
from omnikv.errors import ConfigError, ConnectorError, ConnectorUnavailableError

__all__ = [
    "LONG_POLL_CAP_S",
    "SCHEMA",
    "XFER_HISTORY",
    "COUNTER_NAMES",
    "TEConfig",
    "te_errors",
    "transfer_budget_s",
]

logger = logging.getLogger(__name__)

LONG_POLL_CAP_S = 5.0
XFER_HISTORY = 4096

SCHEMA = Schema(
    requests={
        "query": {"key": str, "wait_ms": int},
        "pull": {"key": str, "dst": int, "cap": int, "xid": str, "budget_ms": int},
        "status": {"xid": str},
    },
    replies={"info": {"found": bool, "size": int}, "done": {"size": int}, "xstate": {"state": str}},
    hello={"sess": str, "base": int, "len": int},
)


def transfer_budget_s(nbytes: int) -> float:
    """The reference's pull timeout: 30 s + 5 s per full 100 MiB."""
    return 30.0 + 5.0 * (nbytes // (100 << 20))


@contextlib.contextmanager
def te_errors(what: str) -> Iterator[None]:
    """Translate the engine's and pyzmq's failures into omnikv errors (the TE boundary)."""
    import zmq

    try:
        yield
    except ConnectorError:
        raise
    except zmq.ZMQError as exc:
        raise ConnectorUnavailableError(f"{what}: control channel failed: {exc}") from exc
    except (RuntimeError, OSError) as exc:
        raise ConnectorUnavailableError(f"{what}: Transfer Engine failed: {exc}") from exc


def _secret(value: Any) -> bytes | None:
    if value is None:
        return None
    if not isinstance(value, str | bytes) or not value:
        raise ConfigError("auth_secret must be a non-empty string or bytes (or absent)")
    return value.encode() if isinstance(value, str) else value


@dataclass(frozen=True)
class TEConfig:
    """The connector's configuration, parsed and validated once (``ConfigError`` naming the key)."""

    host: str
    role: str
    protocol: str
    device_name: str
    pool_size: int
    ttl_s: float
    peer_timeout_s: float
    quarantine_dead_s: float
    close_timeout_s: float
    put_timeout_s: float
    window_s: float
    workers: int
    secret: bytes | None
    zmq_port: int | None
    default_sender: tuple[str, int] | None

    @classmethod
    def parse(cls, config: Mapping[str, Any] | None) -> TEConfig:
        cfg = dict(config or {})
        role = str(cfg.get("role", "sender"))
        if role not in {"sender", "receiver"}:
            raise ConfigError(f"role must be 'sender' or 'receiver', got {role!r}")
        if str(cfg.get("memory_pool_device", "cpu")) != "cpu":
            raise ConfigError(
                "memory_pool_device must be 'cpu' (device pools are not supported yet)"
            )
        zmq_port = None  # a receiver binds nothing; its configured port is not used
        if role == "sender":
            if cfg.get("zmq_port") is None:
                raise ConfigError("a sender needs zmq_port")
            zmq_port = config_port(cfg["zmq_port"], "zmq_port")
        sender: tuple[str, int] | None = None
        if cfg.get("sender_host") and cfg.get("sender_zmq_port") is not None:
            sender = (
                str(cfg["sender_host"]),
                config_port(cfg["sender_zmq_port"], "sender_zmq_port"),
            )
        return cls(
            host=resolve_host(cfg.get("host")),
            role=role,
            protocol=str(cfg.get("protocol", "tcp")),
            device_name=str(cfg.get("device_name", "") or ""),
            pool_size=parse_size(cfg.get("memory_pool_size", 1 << 30), "memory_pool_size"),
            ttl_s=config_seconds(cfg, "buffer_ttl_seconds", 300.0),
            peer_timeout_s=config_seconds(cfg, "peer_timeout_seconds", 5.0),
            quarantine_dead_s=config_seconds(cfg, "quarantine_dead_seconds", 60.0),
            close_timeout_s=config_seconds(cfg, "close_timeout_seconds", 30.0),
            put_timeout_s=float(cfg.get("put_timeout_s", 0.0)),
            window_s=config_seconds(cfg, "auth_window_seconds", DEFAULT_WINDOW_S),
            workers=config_count(cfg, "workers", 4),
            secret=_secret(cfg.get("auth_secret")),
            zmq_port=zmq_port,
            default_sender=sender,
        )


#: The events the two sides count (:class:`~omnikv.connectors._stats.Counters`).
COUNTER_NAMES = (
    "puts",
    "put_bytes",
    "put_failures",
    "gets",
    "get_bytes",
    "misses",
    "pulls_served",
    "pull_failures",
    "ttl_reaped",
    "quarantine_events",
    "quarantine_freed",
    "late_arrivals",
    "rejected_messages",
    "peer_gone",
)
