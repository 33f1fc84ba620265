"""The NIXL connector's control protocol, settings and counters (no NIXL import here).

Messages (on :mod:`omnikv.connectors.pull.control`, which adds the envelope, ``hello`` /
``welcome``, ``ping`` / ``pong`` and ``error``, the MAC and the replay protection):

* ``hello`` peer: ``agent`` (the receiver's NIXL agent name; notifications are accepted only
  from the agent that claimed the entry).
* ``meta`` -> ``agentmd`` {``md``: the sender agent's metadata, ``agent``: its name}: once per
  receiver and sender (again when the sender's agent name changes: it restarted).
* ``claim`` {``key``, ``wait_ms``, ``xid``, ``budget_ms``} -> ``grant`` {``found``, ``size``,
  ``addr``, ``agent``}: long-polls until the key is there (at most ``wait_ms``), then leases it
  to the transfer ``xid`` for ``budget_ms`` plus a grace: nobody else can claim it meanwhile.
  An entry is leased at most ``max_leases_per_entry`` times and never past its
  ``buffer_ttl_seconds`` (counted from the put); then it is dropped, freed once no lease is
  out, and reported.
* ``abort`` {``xid``}: the receiver will not read (no receive slot): the lease ends now.
* ``peek`` {``key``} -> ``held`` {``found``, ``size``}: whether ``key`` could be leased now
  (a receiver's probe); leases nothing.
* ``verdict`` {``key``, ``verdict``, ``reason``}: the receiver's verdict on a payload it READ,
  unanswered (see :mod:`omnikv.connectors.pull.verdicts`).

The receiver then READs ``size`` bytes at ``addr`` from the sender's registered pool with the
notification ``xid``; the sender frees the entry when that notification arrives (consume-once).
"""

from __future__ import annotations

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
from omnikv.errors import ConfigError
from omnikv.values import parse_int

__all__ = [
    "COUNTER_NAMES",
    "LONG_POLL_CAP_S",
    "MAX_MESSAGE_BYTES",
    "SCHEMA",
    "NixlSettings",
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
        **VERDICT_REQUESTS,
        **PEEK_REQUESTS,
    },
    replies={
        "agentmd": {"md": bytes, "agent": str},
        "grant": {"found": bool, "size": int, "addr": int, "agent": str},
        **PEEK_REPLIES,
    },
    hello={"agent": str},
    checks=VERDICT_CHECKS,
)


#: The events the two sides count (:class:`~omnikv.connectors.counters.Counters`).
COUNTER_NAMES = (
    *PULL_COUNTER_NAMES,
    "grants",
    "consumed",
    "lease_expired",
    "lease_limit_reaped",
    "aborted",
    "foreign_notifications",
)


def _backends(value: Any) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list | tuple) or not items or len(items) > MAX_BACKENDS:
        raise ConfigError(f"backends must be a non-empty list of NIXL backend names, got {value!r}")
    if not all(isinstance(b, str) and b.isalnum() for b in items):
        raise ConfigError(f"backends must be NIXL backend names such as 'UCX', got {value!r}")
    return tuple(items)


@dataclass(frozen=True)
class NixlSettings(PullSettings):
    """The NIXL connector's configuration, checked once (``ConfigError`` names the key): the
    pull connectors' keys (:class:`~omnikv.connectors.pull.connector.PullSettings`), ``backends``
    (``["UCX"]``) and ``max_leases_per_entry`` (8: how often a sender leases one entry before
    it drops it unconsumed)."""

    backends: tuple[str, ...]
    max_leases: int

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> NixlSettings:
        return cls(
            **PullSettings.common(cfg),
            backends=_backends(cfg.get("backends", ["UCX"])),
            max_leases=parse_int("max_leases_per_entry", cfg.get("max_leases_per_entry"), 8),
        )
