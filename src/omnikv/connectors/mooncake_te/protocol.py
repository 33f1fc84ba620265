"""What both sides of the Transfer Engine connector agree on: messages, limits, configuration.

Control messages ride on :mod:`omnikv.connectors._control` (envelope, HMAC, nonces, replay
window, channels). A receiver's ``hello`` declares its engine session, a random token of the
connector and the address range of its registered receive pool; the sender writes only there.
Requests: ``query`` (long-poll for a key's size), ``pull`` (write the entry into
``[dst, dst + cap)`` of the requester's pool), ``status`` (what became of a transfer, for
quarantined slots), ``ping``. Replies: ``info``, ``done``, ``xstate``, ``pong``, ``error``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from omnikv.connectors._control import Schema
from omnikv.connectors._mooncake_common import config_count, config_flag
from omnikv.connectors._pull import (
    PULL_COUNTER_NAMES,
    PullSettings,
    transfer_budget_s,
)
from omnikv.errors import ConfigError, ConnectorError, ConnectorUnavailableError

__all__ = [
    "INCARNATION_BYTES",
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
#: Bytes of the random token a receiving connector sends in its hello (one per connector).
INCARNATION_BYTES = 16
XFER_HISTORY = 4096

SCHEMA = Schema(
    requests={
        "query": {"key": str, "wait_ms": int},
        "pull": {"key": str, "dst": int, "cap": int, "xid": str, "budget_ms": int},
        "status": {"xid": str},
    },
    replies={"info": {"found": bool, "size": int}, "done": {"size": int}, "xstate": {"state": str}},
    hello={"sess": str, "inc": bytes, "base": int, "len": int},
)


@contextlib.contextmanager
def te_errors(what: str) -> Iterator[None]:
    """Translate the engine's and the sockets' failures into omnikv errors (the TE boundary)."""
    try:
        yield
    except ConnectorError:
        raise
    except (RuntimeError, OSError) as exc:
        raise ConnectorUnavailableError(f"{what}: Transfer Engine failed: {exc}") from exc


@dataclass(frozen=True)
class TEConfig(PullSettings):
    """The connector's configuration, parsed and validated once (``ConfigError`` naming the key):
    the pull connectors' keys (:class:`~omnikv.connectors._pull.PullSettings`) and ``protocol``
    ("tcp"), ``device_name`` (""), ``workers`` (4), ``memory_pool_device`` ("cpu" only),
    ``tcp_connection_pool`` and ``metadata_cache`` (false: see
    :func:`~omnikv.connectors._mooncake_common.set_tcp_connection_pool` and
    :func:`~omnikv.connectors._mooncake_common.set_metadata_cache`)."""

    protocol: str
    device_name: str
    workers: int
    tcp_connection_pool: bool
    metadata_cache: bool

    @classmethod
    def parse(cls, config: Mapping[str, Any] | None) -> TEConfig:
        cfg = dict(config or {})
        if str(cfg.get("memory_pool_device", "cpu")) != "cpu":
            raise ConfigError(
                "memory_pool_device must be 'cpu' (device pools are not supported yet)"
            )
        return cls(
            **PullSettings.common(cfg),
            protocol=str(cfg.get("protocol", "tcp")),
            device_name=str(cfg.get("device_name", "") or ""),
            workers=config_count(cfg, "workers", 4),
            tcp_connection_pool=config_flag(cfg, "tcp_connection_pool", False),
            metadata_cache=config_flag(cfg, "metadata_cache", False),
        )


#: The events the two sides count (:class:`~omnikv.connectors._stats.Counters`).
COUNTER_NAMES = (
    *PULL_COUNTER_NAMES,
    "pulls_served",
    "pull_failures",
    "rejected_messages",
)
