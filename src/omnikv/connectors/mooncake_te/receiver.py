"""The receiver side of the Transfer Engine connector: query, reserve, pull, deliver.

``wait`` long-polls the sender with ``query`` (no sleep loop), reserves a slot of the announced
size in its own registered pool and sends ``pull``; the sender writes into the slot and answers
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
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from omnikv.connectors.base import ABORT_POLL_S, ManagedBuffer, notify_incoming
from omnikv.connectors.counters import Counters
from omnikv.connectors.mooncake_te.engine import TE_ERRORS
from omnikv.connectors.mooncake_te.protocol import (
    INCARNATION_BYTES,
    LONG_POLL_CAP_S,
    TEConfig,
)
from omnikv.connectors.pool import HostPool
from omnikv.connectors.pull.client import Channel, ControlClient
from omnikv.connectors.pull.connector import LateArrivals, deliver, transfer_budget_s
from omnikv.connectors.pull.control import ControlCodec
from omnikv.connectors.pull.quarantine import Outcome, Quarantine
from omnikv.deadline import remaining
from omnikv.errors import ConnectorClosedError, ConnectorUnavailableError, PeerGoneError

__all__ = ["ReceiverSide"]

logger = logging.getLogger(__name__)

Endpoint = tuple[str, int]
_RETRYABLE = frozenset({"not_found", "busy", "expired"})


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
    """Channels to senders, receive slots, quarantine and late arrivals of one connector."""

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
        self._late = LateArrivals(pool, counters)
        self._stop = threading.Event()
        self._quarantine = Quarantine(
            pool,
            self._late,
            counters,
            interval_s=max(0.05, min(0.5, cfg.peer_timeout_s / 5)),
            name="omnikv-te-quarantine",
            closed=self._stop.is_set,
        )

    # -- one receive -------------------------------------------------------------------------------
    def take(self, key: str, endpoint: Endpoint) -> ManagedBuffer | None:
        """One query without holding, then a pull if the key is there (``get``)."""
        late = self._late.take(key)
        if late is not None:
            return late
        size = self._query(endpoint, key, time.monotonic() + self._cfg.peer_timeout_s, hold=False)
        if size <= 0:
            self._counters.add("misses")
            return None
        return self._pull(endpoint, key, size, time.monotonic() + transfer_budget_s(size))

    def wait(
        self,
        key: str,
        endpoint: Endpoint,
        deadline: float,
        on_incoming: Callable[[int], object] | None = None,
        abort: threading.Event | None = None,
    ) -> ManagedBuffer | None:
        """Long-poll until the payload is delivered or ``deadline`` passes (``None``);
        ``on_incoming`` hears the size before each pull starts. With ``abort``, each
        long-poll lasts at most :data:`ABORT_POLL_S` and a set ``abort`` ends the wait with
        ``None``; a pull that started runs until ``deadline``."""
        late = self._late.take(key)
        while late is None:
            if self._stop.is_set():
                raise ConnectorClosedError("MooncakeTransferEngineConnector is closed")
            if remaining(deadline) <= 0:
                self._counters.add("misses")
                return None
            pending = self._quarantine.holds(key)
            if abort is not None and abort.is_set():
                return None
            hold_until = min(deadline, time.monotonic() + 0.25) if pending else deadline
            if abort is not None:
                hold_until = min(hold_until, time.monotonic() + ABORT_POLL_S)
            size = self._query(endpoint, key, hold_until, hold=True)
            if size > 0:
                notify_incoming(on_incoming, size)
                got = self._pull(endpoint, key, size, deadline)
                if got is not None:
                    return got
            late = self._late.take(key)
        return late

    def held(self, key: str) -> int | None:
        """The size of ``key`` when its transfer finished after its wait gave up (held here
        for the next take), else ``None``."""
        return self._late.size(key)

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
        self._quarantine.add(pull.xid, pull.key, pull.offset, pull.size, status)

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
    def cleanup(self, request_id: str) -> None:
        self._late.cleanup(request_id)

    @property
    def quarantine_dead_s(self) -> float:
        """How long a silent sender's quarantined transfer is waited for."""
        return self._cfg.quarantine_dead_s

    @property
    def client(self) -> ControlClient:
        """The control client this side reaches senders through."""
        return self._client

    def stats(self) -> dict[str, Any]:
        return {"quarantined": len(self._quarantine), "late_arrivals_held": len(self._late)}

    @property
    def rejected(self) -> int:
        return self._client.rejected

    @property
    def thread(self) -> threading.Thread | None:
        return self._quarantine.thread

    def close(self) -> None:
        """Stop the reaper, close every channel, forget quarantined slots (pool goes next)."""
        self._stop.set()
        left = self._quarantine.close(max(5.0, self._cfg.peer_timeout_s * 2))
        self._client.close()
        if left:
            # unregistering the pool makes the engine refuse any later write into it
            logger.warning("closing with %d quarantined receive slots", len(left))
        self._late.clear()


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
