"""The NIXL connector's control protocol and counters (no NIXL import here).

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

import msgspec

from omnikv.connectors.pull.connector import PEEK_REPLIES, PEEK_REQUESTS, PULL_COUNTER_NAMES
from omnikv.connectors.pull.control import Schema, Str, UInt
from omnikv.connectors.pull.verdicts import VERDICT_CHECKS, VERDICT_REQUESTS

__all__ = [
    "COUNTER_NAMES",
    "LONG_POLL_CAP_S",
    "MAX_MESSAGE_BYTES",
    "SCHEMA",
]

#: Agent metadata grows with the NICs and backends of a host; 64 KiB bounds it generously.
MAX_MESSAGE_BYTES = 64 << 10
LONG_POLL_CAP_S = 5.0


class Meta(msgspec.Struct):
    """``meta``: the sender agent's metadata, please."""


class Claim(msgspec.Struct):
    """``claim``: lease ``key`` to transfer ``xid`` for ``budget_ms``, held up to ``wait_ms``
    until it is there."""

    key: Str
    wait_ms: UInt
    xid: Str
    budget_ms: UInt


class Abort(msgspec.Struct):
    """``abort``: the lease of ``xid`` ends now (the receiver will not read)."""

    xid: Str


class AgentMD(msgspec.Struct):
    """``agentmd``: the sender agent's metadata and name (the answer to ``meta``)."""

    md: bytes
    agent: Str


class Grant(msgspec.Struct):
    """``grant``: the answer to ``claim``: where to READ ``size`` bytes, from which agent."""

    found: bool
    size: UInt
    addr: UInt
    agent: Str


class Hello(msgspec.Struct):
    """A receiver's self-description: its NIXL agent's name."""

    agent: Str


SCHEMA = Schema(
    requests={
        "meta": Meta,
        "claim": Claim,
        "abort": Abort,
        **VERDICT_REQUESTS,
        **PEEK_REQUESTS,
    },
    replies={"agentmd": AgentMD, "grant": Grant, **PEEK_REPLIES},
    hello=Hello,
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
