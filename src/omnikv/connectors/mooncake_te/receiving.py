"""The receiver side of the Transfer Engine connector: query, reserve, pull, deliver.

The wait loop, late arrivals and quarantine are the pull receivers' shared core
(:class:`~omnikv.connectors.pull.receiving.PullReceiver`); this module is the Transfer Engine's
backend to it. Asking for a key is a ``query`` long-poll to the sender (no sleep loop); the
transfer reserves a slot of the announced size in the receiver's registered pool and sends
``pull``; the sender writes into the slot and answers
``done``. While it waits for ``done`` the receiver pings; silence for ``peer_timeout_seconds``
raises :class:`~omnikv.errors.PeerGoneError`. If the receiver gives up (deadline, peer gone)
while the write may still be running, the slot is *quarantined*
(:mod:`omnikv.connectors.pull.quarantine`, shared with the NIXL receiver): its reaper asks the
sender about the transfer (``status``, :class:`_StatusQuery`) and frees the slot only once the
transfer is known finished or dead, so no later allocation is overwritten. A quarantined
transfer that did finish is kept as a late arrival and handed to the next ``get`` / ``wait`` of
that key.

Every channel to a sender starts with a ``hello`` that declares this receiver's engine session,
a random token of this connector (so a sender tells it from an earlier receiver that had the
same session name) and its pool range (see :mod:`omnikv.connectors.pull.control`); a channel whose
sender stays silent is dropped, so a restarted sender is greeted afresh.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, NoReturn

from omnikv.connectors.base import ManagedBuffer
from omnikv.connectors.counters import Counters
from omnikv.connectors.mooncake_te.config import TEConfig
from omnikv.connectors.mooncake_te.engine import TE_ERRORS
from omnikv.connectors.mooncake_te.protocol import INCARNATION_BYTES, LONG_POLL_CAP_S
from omnikv.connectors.pool import HostPool
from omnikv.connectors.pull.client import Channel, ControlClient
from omnikv.connectors.pull.connector import deliver, transfer_budget_s
from omnikv.connectors.pull.control import ControlCodec
from omnikv.connectors.pull.quarantine import Outcome
from omnikv.connectors.pull.receiving import PullReceiver
from omnikv.deadline import remaining
from omnikv.errors import ConnectorUnavailableError, PeerGoneError

__all__ = ["ReceiverSide"]

logger = logging.getLogger(__name__)

Endpoint = tuple[str, int]
_RETRYABLE = frozenset({"not_found", "busy", "expired"})


@dataclass(frozen=True)
class _Offer:
    """A key the sender said it holds (its ``info`` answer): what a pull of it asks for."""

    key: str
    endpoint: Endpoint
    size: int


@dataclass
class _Pull:
    """One pull in progress: the slot it writes and when the sender was last heard."""

    key: str
    endpoint: Endpoint
    xid: str
    offset: int
    size: int
    heard: float


class ReceiverSide:
    """Channels to senders and receive slots of one connector, and its
    :class:`~omnikv.connectors.pull.receiving.PullReceiver` (wait loop, quarantine, late
    arrivals), to which it is the backend (``claim``: ``query``; ``transfer``: ``pull``)."""

    def __init__(
        self,
        cfg: TEConfig,
        codec: ControlCodec,
        session_id: str,
        pool: HostPool,
        counters: Counters,
    ) -> None:
        self._cfg = cfg
        self._pool = pool
        self._counters = counters
        hello = {
            "sess": session_id,
            "inc": os.urandom(INCARNATION_BYTES),
            "base": pool.address,
            "len": pool.size,
        }
        self._client = ControlClient(codec, hello, heartbeat_s=cfg.limits.heartbeat_s)
        #: The wait loop, quarantine and late arrivals this side is the backend of (the
        #: connector receives through it).
        self.core = PullReceiver(
            self,
            pool,
            counters,
            peer_timeout_s=cfg.peer_timeout_s,
            quarantine_interval_s=max(0.05, min(0.5, cfg.peer_timeout_s / 5)),
            quarantine_name="omnikv-te-quarantine",
            engine="MooncakeTransferEngineConnector",
        )

    # -- the backend: ask with ``query``, transfer with ``pull`` -----------------------------------
    def claim(self, key: str, endpoint: Endpoint, deadline: float, hold_s: float) -> _Offer | None:
        """A ``query`` for ``key``, held at most ``hold_s`` (the core's ask)."""
        held = 0 < hold_s < math.inf
        hold_until = min(deadline, time.monotonic() + hold_s) if held else deadline
        size = self._query(endpoint, key, hold_until, hold=hold_s > 0)
        return _Offer(key, endpoint, size) if size > 0 else None

    def transfer(self, grant: _Offer, deadline: float) -> ManagedBuffer | None:
        """The ``pull`` of an offered key into a receive slot (the core's transfer)."""
        return self._pull(grant.endpoint, grant.key, grant.size, deadline)

    def _channel(self, endpoint: Endpoint, deadline: float) -> Channel | None:
        return self._client.channel(endpoint, max(0.0, remaining(deadline)))

    def _query(self, endpoint: Endpoint, key: str, deadline: float, hold: bool) -> int:
        """Size of ``key`` at the sender, ``0`` if absent (after a long-poll when ``hold``)."""
        chan = self._channel(endpoint, deadline)
        if chan is None:
            return 0
        left = remaining(deadline)
        wait_s = min(max(0.0, left - 0.02), LONG_POLL_CAP_S) if hold else 0.0
        msg = {"op": "query", "key": key, "wait_ms": int(wait_s * 1000)}
        patience = wait_s + self._cfg.peer_timeout_s
        reply = chan.request(msg, min(left, patience))
        if reply is None:
            if left >= patience:  # silent past its hold and the peer timeout: greet afresh
                self._client.discard(endpoint, chan)
            return 0
        if reply["op"] != "info" or not reply["found"]:
            return 0
        return int(reply["size"])

    def _pull(
        self, endpoint: Endpoint, key: str, size: int, deadline: float
    ) -> ManagedBuffer | None:
        """Reserve a slot, ask for the write, wait for ``done`` (pinging the sender)."""
        offset, _ = self._pool.allocator.alloc(size, deadline=deadline)
        budget = min(remaining(deadline), transfer_budget_s(size))
        chan = self._channel(endpoint, deadline)
        if chan is None:
            self._pool.allocator.free(offset)
            return None
        pull = _Pull(key, endpoint, uuid.uuid4().hex, offset, size, time.monotonic())
        msg = {
            "op": "pull",
            "key": key,
            "dst": self._pool.address + offset,
            "cap": size,
            "xid": pull.xid,
            "budget_ms": int(budget * 1000),
        }
        try:
            nonce = chan.send(msg)
        except BaseException:
            self._pool.allocator.free(offset)
            raise
        return self._await_done(chan, pull, {nonce}, time.monotonic() + budget)

    def _await_done(
        self, chan: Channel, pull: _Pull, nonces: set[bytes], end: float
    ) -> ManagedBuffer | None:
        try:
            return self._collect_done(chan, pull, nonces, end)
        finally:
            chan.forget(nonces)  # pongs nobody will collect now

    def _collect_done(
        self, chan: Channel, pull: _Pull, nonces: set[bytes], end: float
    ) -> ManagedBuffer | None:
        ping_every = max(0.05, self._cfg.peer_timeout_s / 5)
        while True:
            now = time.monotonic()
            if now >= end:
                self._quarantine_slot(pull)
                return None
            if now - pull.heard > self._cfg.peer_timeout_s:
                self._gone(pull, f"silent for {now - pull.heard:.1f}s")
            reply = chan.recv(nonces, min(ping_every, end - now))
            if reply is None and chan.closed:
                self._gone(pull, "closed the control connection")
            if reply is None:
                nonces.add(chan.send({"op": "ping"}))
                continue
            pull.heard = time.monotonic()
            if reply["op"] != "pong":
                return self._finish(pull, reply)

    def _gone(self, pull: _Pull, how: str) -> NoReturn:
        """The sender of ``pull`` went away mid-transfer: quarantine the slot (the write may
        still run), forget the channel, raise ``PeerGoneError``."""
        self._quarantine_slot(pull)
        self._client.discard(pull.endpoint)
        self._counters.add("peer_gone")
        raise PeerGoneError(
            f"sender {pull.endpoint[0]}:{pull.endpoint[1]} {how} while transferring {pull.key}"
        )

    def _finish(self, pull: _Pull, reply: dict[str, Any]) -> ManagedBuffer | None:
        if reply["op"] == "done":
            return self._deliver(pull.offset, int(reply["size"]))
        self._pool.allocator.free(pull.offset)  # the sender did not (and will not) write
        reason = str(reply.get("reason", ""))
        if reason in _RETRYABLE:
            return None
        raise ConnectorUnavailableError(f"sender failed to transfer {pull.key}: {reason}")

    def _deliver(self, offset: int, size: int) -> ManagedBuffer:
        return deliver(self._pool, self._counters, offset, size)

    # -- quarantine and late arrivals --------------------------------------------------------------
    def _quarantine_slot(self, pull: _Pull) -> None:
        """The receive of ``pull`` gave up while the sender may still write its slot."""
        status = _StatusQuery(self, pull.endpoint, pull.xid, pull.heard)
        self.core.park(pull.xid, pull.key, pull.offset, pull.size, status)

    def transfer_state(self, endpoint: Endpoint, xid: str) -> str:
        """What the sender says about transfer ``xid``: inflight / done / failed / unknown, or
        ``silent`` (called by the quarantine's reaper)."""
        timeout = min(1.0, self._cfg.peer_timeout_s)
        chan = None
        try:
            with TE_ERRORS.translate(f"status of {xid}"):
                chan = self._client.channel(endpoint, timeout)
                msg = {"op": "status", "xid": xid}
                reply = None if chan is None else chan.request(msg, timeout)
        except ConnectorUnavailableError as exc:
            logger.debug("status query for %s failed: %s", xid, exc)
            return "silent"
        if reply is None:
            self._client.discard(endpoint, chan)
            return "silent"
        return str(reply.get("state", "unknown")) if reply["op"] == "xstate" else "unknown"

    # -- state and shutdown ------------------------------------------------------------------------
    @property
    def quarantine_dead_s(self) -> float:
        """How long a silent sender's quarantined transfer is waited for."""
        return self._cfg.quarantine_dead_s

    @property
    def client(self) -> ControlClient:
        """The control client this side reaches senders through."""
        return self._client

    def stats(self) -> dict[str, Any]:
        return dict(self.core.stats())

    @property
    def rejected(self) -> int:
        return self._client.rejected

    @property
    def thread(self) -> threading.Thread | None:
        return self.core.reaper

    def close(self) -> None:
        """Stop the reaper, close every channel, forget quarantined slots (pool goes next)."""
        left = self.core.close(max(5.0, self._cfg.peer_timeout_s * 2))
        self._client.close()
        if left:
            # unregistering the pool makes the engine refuse any later write into it
            logger.warning("closing with %d quarantined receive slots", len(left))


@dataclass
class _StatusQuery:
    """A quarantined pull as the Transfer Engine receiver asks about it: the sender's
    ``status`` of the transfer; silence for ``quarantine_dead_seconds`` counts as gone."""

    side: ReceiverSide
    endpoint: Endpoint
    xid: str
    last_heard: float

    def outcome(self) -> Outcome:
        state = self.side.transfer_state(self.endpoint, self.xid)
        now = time.monotonic()
        if state == "inflight":
            self.last_heard = now
            return Outcome.RUNNING
        if state == "silent":
            dead = now - self.last_heard >= self.side.quarantine_dead_s
            return Outcome.GONE if dead else Outcome.RUNNING
        return Outcome.DONE if state == "done" else Outcome.GONE
