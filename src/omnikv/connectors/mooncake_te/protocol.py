"""What both sides of the Transfer Engine connector agree on: messages, limits, configuration.

Control messages ride on :mod:`omnikv.connectors.pull.control` (envelope, HMAC, nonces, replay
window, channels). A receiver's ``hello`` declares its engine session, a random token of the
connector and the address range of its registered receive pool; the sender writes only there.
Requests: ``query`` (long-poll for a key's size), ``pull`` (write the entry into
``[dst, dst + cap)`` of the requester's pool), ``status`` (what became of a transfer, for
quarantined slots), ``peek`` (a probe: the size of a key that could be pulled now),
``verdict`` (the receiver's verdict on a payload it pulled, unanswered: see
:mod:`omnikv.connectors.pull.verdicts`), ``ping``. Replies: ``info``, ``done``, ``xstate``,
``held``, ``pong``, ``error``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omnikv.connectors.pull.connector import (
    PEEK_REPLIES,
    PEEK_REQUESTS,
    PULL_COUNTER_NAMES,
    PullSettings,
)
from omnikv.connectors.pull.control import Schema
from omnikv.connectors.pull.verdicts import VERDICT_CHECKS, VERDICT_REQUESTS
from omnikv.values import parse_bool, parse_choice, parse_int

__all__ = [
    "COUNTER_NAMES",
    "INCARNATION_BYTES",
    "LONG_POLL_CAP_S",
    "SCHEMA",
    "XFER_HISTORY",
    "TEConfig",
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
        **VERDICT_REQUESTS,
        **PEEK_REQUESTS,
    },
    replies={
        "info": {"found": bool, "size": int},
        "done": {"size": int},
        "xstate": {"state": str},
        **PEEK_REPLIES,
    },
    hello={"sess": str, "inc": bytes, "base": int, "len": int},
    checks=VERDICT_CHECKS,
)


@dataclass(frozen=True)
class TEConfig(PullSettings):
    """The connector's configuration, parsed and validated once (``ConfigError`` naming the key):
    the pull connectors' keys (:class:`~omnikv.connectors.pull.connector.PullSettings`) and
    ``protocol``
    ("tcp"), ``device_name`` (""), ``workers`` (4), ``memory_pool_device`` ("cpu" only),
    ``tcp_connection_pool`` and ``metadata_cache`` (false: see
    :func:`~omnikv.connectors.mooncake_te.engine.set_tcp_connection_pool` and
    :func:`~omnikv.connectors.mooncake_te.engine.set_metadata_cache`)."""

    protocol: str
    device_name: str
    workers: int
    tcp_connection_pool: bool
    metadata_cache: bool

    @classmethod
    def parse(cls, config: Mapping[str, Any] | None) -> TEConfig:
        cfg = dict(config or {})
        # device pools are not supported yet: "cpu" is the one choice
        parse_choice("memory_pool_device", cfg.get("memory_pool_device"), "cpu", ("cpu",))
        return cls(
            **PullSettings.common(cfg),
            protocol=str(cfg.get("protocol", "tcp")),
            device_name=str(cfg.get("device_name", "") or ""),
            workers=parse_int("workers", cfg.get("workers"), 4),
            tcp_connection_pool=parse_bool(
                "tcp_connection_pool", cfg.get("tcp_connection_pool"), False
            ),
            metadata_cache=parse_bool("metadata_cache", cfg.get("metadata_cache"), False),
        )


#: The events the two sides count (:class:`~omnikv.connectors.counters.Counters`).
COUNTER_NAMES = (
    *PULL_COUNTER_NAMES,
    "pulls_served",
    "pull_failures",
    "rejected_messages",
)
