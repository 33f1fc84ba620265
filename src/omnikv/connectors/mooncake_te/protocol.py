"""What both sides of the Transfer Engine connector agree on: messages, limits, counters.

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

import msgspec

from omnikv.connectors.pull.connector import PEEK_REPLIES, PEEK_REQUESTS, PULL_COUNTER_NAMES
from omnikv.connectors.pull.control import Schema, Str, UInt
from omnikv.connectors.pull.verdicts import VERDICT_CHECKS, VERDICT_REQUESTS

__all__ = [
    "COUNTER_NAMES",
    "INCARNATION_BYTES",
    "LONG_POLL_CAP_S",
    "SCHEMA",
    "XFER_HISTORY",
]

logger = logging.getLogger(__name__)

LONG_POLL_CAP_S = 5.0
#: Bytes of the random token a receiving connector sends in its hello (one per connector).
INCARNATION_BYTES = 16
XFER_HISTORY = 4096


class Query(msgspec.Struct):
    """``query``: the size of ``key``, held up to ``wait_ms`` until it is published."""

    key: Str
    wait_ms: UInt


class Pull(msgspec.Struct):
    """``pull``: write ``key``'s entry into ``[dst, dst + cap)`` of the requester's pool, as
    transfer ``xid``, within ``budget_ms``."""

    key: Str
    dst: UInt
    cap: UInt
    xid: Str
    budget_ms: UInt


class Status(msgspec.Struct):
    """``status``: what became of transfer ``xid`` (a quarantined slot's question)."""

    xid: Str


class Info(msgspec.Struct):
    """``info``: the answer to ``query``."""

    found: bool
    size: UInt


class Done(msgspec.Struct):
    """``done``: a ``pull`` wrote ``size`` bytes."""

    size: UInt


class XState(msgspec.Struct):
    """``xstate``: the answer to ``status`` (inflight / done / failed / unknown)."""

    state: Str


class Hello(msgspec.Struct):
    """A receiver's self-description: its engine session, its connector's random token and
    the address range of its registered receive pool."""

    sess: Str
    inc: bytes
    base: UInt
    len: UInt


SCHEMA = Schema(
    requests={
        "query": Query,
        "pull": Pull,
        "status": Status,
        **VERDICT_REQUESTS,
        **PEEK_REQUESTS,
    },
    replies={"info": Info, "done": Done, "xstate": XState, **PEEK_REPLIES},
    hello=Hello,
    checks=VERDICT_CHECKS,
)


#: The events the two sides count (:class:`~omnikv.connectors.counters.Counters`).
COUNTER_NAMES = (
    *PULL_COUNTER_NAMES,
    "pulls_served",
    "pull_failures",
    "rejected_messages",
)
