"""The receiver side of the Transfer Engine connector: query, reserve, pull, deliver.

``wait`` long-polls the sender with ``query`` (no sleep loop), reserves a slot of the announced
size in its own registered pool and sends ``pull``; the sender writes into the slot and answers
``done``. While it waits for ``done`` the receiver pings; silence for ``peer_timeout_seconds``
raises :class:`~omnikv.errors.PeerGoneError`. If the receiver gives up (deadline, peer gone)
while the write may still be running, the slot is *quarantined*: a reaper asks the sender about
the transfer (``status``) and frees the slot only once the transfer is known finished or dead,
so no later allocation is overwritten. A quarantined transfer that did finish is kept as a late
arrival and handed to the next ``get`` / ``wait`` of that key.

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

from omnikv._logging import RateLimitedLog
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
from omnikv.deadline import remaining
from omnikv.errors import ConnectorClosedError, ConnectorUnavailableError, PeerGoneError

__all__ = ["ReceiverSide"]

logger = logging.getLogger(__name__)
_outsider = RateLimitedLog(logger)  # lines a peer, client or forger can cause

Endpoint = tuple[str, int]
_RETRYABLE = frozenset({"not_found", "busy", "expired"})


@dataclass
class _Quarantined:
    key: str
    endpoint: Endpoint
    xid: str
    offset: int
    size: int
    last_heard: float


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
        self._lock = threading.Lock()
        self._quarantine: dict[str, _Quarantined] = {}
        self._late = LateArrivals(pool, counters)
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None

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
            with self._lock:
                pending = any(q.key == key for q in self._quarantine.values())
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
        reply = chan.request(msg, min(left, wait_s + self._cfg.peer_timeout_s))
        if reply is None:
            self._client.discard(endpoint)  # silent: greet afresh next time
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
        q = _Quarantined(pull.key, pull.endpoint, pull.xid, pull.offset, pull.size, pull.heard)
        with self._lock:
            self._quarantine[pull.xid] = q
            start = self._reaper is None and not self._stop.is_set()
            if start:
                self._reaper = threading.Thread(
                    target=self._reap_quarantine, name="omnikv-te-quarantine", daemon=True
                )
        self._counters.add("quarantine_events")
        _outsider.warning(
            "quarantined a %d-byte slot for %s (transfer %s may be running)",
            pull.size,
            pull.key,
            pull.xid,
        )
        if start and self._reaper is not None:
            self._reaper.start()

    def _reap_quarantine(self) -> None:
        """Reaper thread: frees quarantined slots once their transfer is finished or dead."""
        interval = max(0.05, min(0.5, self._cfg.peer_timeout_s / 5))
        while not self._stop.wait(interval):
            with self._lock:
                items = list(self._quarantine.values())
            for q in items:
                if self._stop.is_set():
                    return
                self._settle(q, self._transfer_state(q))

    def _transfer_state(self, q: _Quarantined) -> str:
        """What the sender says about the transfer: inflight / done / failed / unknown / silent."""
        timeout = min(1.0, self._cfg.peer_timeout_s)
        try:
            with TE_ERRORS.translate(f"status of {q.xid}"):
                chan = self._client.channel(q.endpoint, timeout)
                msg = {"op": "status", "xid": q.xid}
                reply = None if chan is None else chan.request(msg, timeout)
        except ConnectorUnavailableError as exc:
            logger.debug("status query for %s failed: %s", q.xid, exc)
            return "silent"
        if reply is None:
            self._client.discard(q.endpoint)
            return "silent"
        return str(reply.get("state", "unknown")) if reply["op"] == "xstate" else "unknown"

    def _settle(self, q: _Quarantined, state: str) -> None:
        now = time.monotonic()
        if state == "inflight":
            q.last_heard = now
            return
        if state == "silent" and now - q.last_heard < self._cfg.quarantine_dead_s:
            return
        with self._lock:
            if self._quarantine.pop(q.xid, None) is None:
                return
        late = state == "done" and not self._stop.is_set()
        if late and self._late.keep(q.key, q.offset, q.size):
            logger.info("transfer of %s finished after its receiver gave up; kept", q.key)
        else:
            self._pool.allocator.free(q.offset)
            self._counters.add("quarantine_freed")

    # -- state and shutdown ------------------------------------------------------------------------
    def cleanup(self, request_id: str) -> None:
        self._late.cleanup(request_id)

    @property
    def client(self) -> ControlClient:
        """The control client this side reaches senders through."""
        return self._client

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"quarantined": len(self._quarantine), "late_arrivals_held": len(self._late)}

    @property
    def rejected(self) -> int:
        return self._client.rejected

    @property
    def thread(self) -> threading.Thread | None:
        return self._reaper

    def close(self) -> None:
        """Stop the reaper, close every channel, forget quarantined slots (pool goes next)."""
        self._stop.set()
        reaper = self._reaper
        if reaper is not None and reaper is not threading.current_thread():
            reaper.join(timeout=max(5.0, self._cfg.peer_timeout_s * 2))
        self._client.close()
        with self._lock:
            if self._quarantine:
                # unregistering the pool makes the engine refuse any later write into it
                logger.warning("closing with %d quarantined receive slots", len(self._quarantine))
            self._quarantine.clear()
        self._late.clear()
