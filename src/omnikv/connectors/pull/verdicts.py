"""Delivery verdicts of the pull connectors (Mooncake Transfer Engine, NIXL).

What the two pull connectors share to carry a receiver's verdict
(:mod:`omnikv.connectors.delivery`) back to the sender:

* the control message: ``verdict`` {``key`` (the transport key), ``verdict`` (``delivered``,
  ``refused`` or ``expired``), ``reason`` (``""`` for none)}, a request on the authenticated
  control channel (:mod:`omnikv.connectors.pull.control`: MAC, nonce and timestamp like every
  message). :data:`VERDICT_REQUESTS` and :data:`VERDICT_CHECKS` go into each engine's
  :class:`~omnikv.connectors.pull.control.Schema`; the check bounds the key
  (:data:`~omnikv.connectors.delivery.MAX_KEY_CHARS`), the reason
  (:data:`~omnikv.connectors.delivery.MAX_REASON_CHARS`) and the verdict's value before any
  handler sees the message. Nothing is answered to it: the receiver sends and goes on.
* :class:`SentVerdicts`: the sending connector's side of the verdict book
  (:class:`~omnikv.connectors.verdict_book.VerdictBook`). A publication is watched from the put;
  it is *taken* by one peer (the Transfer Engine: the pull that wrote it; NIXL: the agent whose
  READ completion freed it), and only that peer's verdict is accepted, once. A verdict from any
  other peer, for a key not taken, or a second one changes nothing and is counted
  (``acks_ignored``). An entry reaped by its TTL is reported ``expired``; one taken and not
  acknowledged within ``ack_timeout_s`` too (:meth:`SentVerdicts.sweep`, run by the sender's
  control thread).

A peer is known by its hello (:func:`peer_identity`): the Transfer Engine receiver's carries a
random token of its connector, NIXL's its agent name and a random token, so a peer that did not
take a key cannot speak for the one that did without having seen that one's hello.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Mapping
from typing import Any

import msgpack

from omnikv._logging import RateLimitedLog
from omnikv.connectors.counters import Counters
from omnikv.connectors.delivery import (
    MAX_KEY_CHARS,
    MAX_REASON_CHARS,
    DeliveryListener,
    Verdict,
    clip_reason,
)
from omnikv.connectors.pull.control import Check, Fields
from omnikv.connectors.verdict_book import VERDICT_COUNTERS, VerdictBook
from omnikv.errors import ProtocolError

__all__ = [
    "VERDICT_CHECKS",
    "VERDICT_COUNTER_NAMES",
    "VERDICT_OP",
    "VERDICT_REQUESTS",
    "SentVerdicts",
    "check_verdict",
    "peer_identity",
    "verdict_message",
]

logger = logging.getLogger(__name__)
_outsider = RateLimitedLog(logger)  # lines a peer, client or forger can cause

VERDICT_OP = "verdict"
_VALUES = frozenset(v.value for v in Verdict)

#: The counters a sending pull connector keeps for verdicts: reports by kind (``expired``
#: includes the TTL's and the ``ack_timeout_s`` watch's) and verdict messages that changed
#: nothing (not from the peer that took the key, for a key not taken, or a repeat).
VERDICT_COUNTER_NAMES = VERDICT_COUNTERS


def check_verdict(msg: Mapping[str, Any]) -> None:
    """The ``verdict`` message's bounds (the codec runs it after the field types): a key of 1 to
    ``MAX_KEY_CHARS`` characters, a reason of at most ``MAX_REASON_CHARS``, one of the three
    verdicts. Raises ``ProtocolError``."""
    key, reason, verdict = msg["key"], msg["reason"], msg["verdict"]
    if not 0 < len(key) <= MAX_KEY_CHARS:
        raise ProtocolError(f"verdict: key of {len(key)} characters")
    if len(reason) > MAX_REASON_CHARS:
        raise ProtocolError(f"verdict: reason longer than {MAX_REASON_CHARS}")
    if verdict not in _VALUES:
        raise ProtocolError(f"verdict: unknown verdict {verdict[:32]!r}")


#: The request every pull engine's schema adds, and its check.
VERDICT_REQUESTS: dict[str, Fields] = {VERDICT_OP: {"key": str, "verdict": str, "reason": str}}
VERDICT_CHECKS: dict[str, Check] = {VERDICT_OP: check_verdict}


def verdict_message(key: str, verdict: Verdict, reason: object) -> dict[str, Any] | None:
    """The ``verdict`` request for ``key`` (the reason clipped to one bounded line); ``None``
    when the key is too long to be accepted (the receiver then sends nothing)."""
    if not 0 < len(key) <= MAX_KEY_CHARS:
        return None
    text = clip_reason(reason) or ""
    return {"op": VERDICT_OP, "key": key, "verdict": Verdict(verdict).value, "reason": text}


def peer_identity(peer: Mapping[str, Any]) -> bytes:
    """A digest of a channel's hello (``Request.peer``): equal for every channel one receiving
    connector opens, different for every other connector (its hello holds a random token)."""
    packed = msgpack.packb(sorted(peer.items()), use_bin_type=True)
    return hashlib.sha256(packed).digest()


class SentVerdicts:
    """The sending pull connector's side of the verdict book
    (:class:`~omnikv.connectors.verdict_book.VerdictBook`, keyed by transport key; a taker is
    a peer's :func:`peer_identity`): what the sender sides call, in their own terms.

    Called by the sending side: :meth:`published` when an entry becomes visible (returns the
    publication's number, which the entry keeps), :meth:`taken` when a peer consumed it,
    :meth:`expired` when its TTL dropped it, :meth:`forget` when its owner did (``cleanup``,
    ``withdraw``); and by the control thread: :meth:`receive` for each ``verdict`` message,
    :meth:`sweep` from its timer. Events about an older publication of a key change nothing.
    """

    def __init__(self, ack_timeout_s: float, counters: Counters) -> None:
        self.book = VerdictBook(ack_timeout_s, counters)
        self.notices = self.book.notices

    def set_listener(self, listener: DeliveryListener | None) -> None:
        self.book.set_listener(listener)

    def __len__(self) -> int:
        return len(self.book)

    # -- the sending side ---------------------------------------------------------------------
    def published(self, key: str, put_key: str) -> int:
        """Watch ``key`` (published as ``put_key``) from now on; its publication number."""
        return self.book.published(key, put_key)

    def taken(self, key: str, pub: int, taker: bytes) -> None:
        """Publication ``pub`` of ``key`` was consumed by the peer ``taker``: its verdict is
        awaited (``ack_timeout_s``); one it sent early (:meth:`receive`) is reported now."""
        self.book.taken(key, taker, pub=pub)

    def expired(self, key: str, pub: int, why: str) -> None:
        """Publication ``pub`` of ``key`` was dropped unconsumed: report it ``expired``."""
        self.book.expired(key, why, pub=pub)

    def forget(self, key: str, pub: int) -> None:
        """Publication ``pub`` of ``key`` was dropped by its owner: no verdict is reported."""
        self.book.forget(key, pub=pub)

    # -- the control thread -------------------------------------------------------------------
    def receive(
        self, key: str, peer: bytes, verdict: str, reason: str, *, early_ok: bool = False
    ) -> bool:
        """A checked ``verdict`` message from ``peer`` (:func:`peer_identity`) about ``key``;
        whether it counted (:meth:`VerdictBook.settle
        <omnikv.connectors.verdict_book.VerdictBook.settle>`: from the key's taker, or kept
        with ``early_ok`` when the sending side vouches that ``peer`` holds the key's lease).
        Anything else is ignored, counted and logged (rate-limited)."""
        if self.book.settle(key, peer, Verdict(verdict), reason or None, early_ok=early_ok):
            return True
        _outsider.warning("ignored a %s verdict for %.200s: not from its taker", verdict, key)
        return False

    def sweep(self, now: float | None = None) -> float:
        """Expire the taken keys whose verdict is overdue (reported ``expired``, counted); the
        seconds until the next one falls due (``inf``: none). Cheap until then: the control
        thread calls it on every turn."""
        now = time.monotonic() if now is None else now
        self.book.sweep(now)
        return self.book.next_due() - now
