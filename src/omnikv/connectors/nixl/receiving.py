"""The receiver side of the NIXL connector: claim, READ into a registered slot, quarantine.

The wait loop, late arrivals and quarantine are the pull receivers' shared core
(:class:`~omnikv.connectors.pull.receiving.PullReceiver`); this module is NIXL's backend to it.
Asking for a key is a ``claim`` of it at the sender (a long-poll, no sleep loop); the transfer
reserves a slot of the granted size in the receiver's registered pool and READs the bytes with
NIXL, the transfer id as the completion notification (which frees the sender's entry). Agent
metadata is fetched once per sender (again if the sender's agent changed: it restarted).

While the READ runs the receiver polls it (finely, bounded) and pings the sender's control
port; a sender silent for ``peer_timeout_seconds``, or a READ failing while the sender does not
answer, is :class:`~omnikv.errors.PeerGoneError`. A READ given up while it may still write (the
deadline passed, the peer went silent) leaves its slot *quarantined*
(:mod:`omnikv.connectors.pull.quarantine`, shared with the Transfer Engine receiver; here
:class:`_ParkedRead` asks the READ itself): the reaper frees it once NIXL reports the transfer
finished or cancelled. A quarantined READ that did complete consumed the sender's entry, so its
bytes are kept as a late arrival for the next ``get`` / ``wait`` of that key.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, NoReturn

from omnikv.connectors.base import ManagedBuffer
from omnikv.connectors.counters import Counters
from omnikv.connectors.nixl.agent import NixlAgent, Transfer
from omnikv.connectors.nixl.config import NixlSettings
from omnikv.connectors.nixl.protocol import LONG_POLL_CAP_S
from omnikv.connectors.pool import HostPool
from omnikv.connectors.pull.client import Channel, ControlClient
from omnikv.connectors.pull.connector import deliver, transfer_budget_s
from omnikv.connectors.pull.control import Endpoint
from omnikv.connectors.pull.quarantine import Outcome
from omnikv.connectors.pull.receiving import PullReceiver
from omnikv.deadline import remaining
from omnikv.errors import (
    ConnectorError,
    ConnectorUnavailableError,
    PeerGoneError,
    PoolExhaustedError,
)

__all__ = ["POLL_CAP_S", "POLL_FIRST_S", "NixlReceiverSide"]

logger = logging.getLogger(__name__)

#: Polling of a running READ: 20 us doubling to 500 us per sleep (``omnikv bench nixl``'s raw
#: READ polls the same way, so the comparison isolates what the connector adds).
POLL_FIRST_S = 0.00002
POLL_CAP_S = 0.0005
_MAX_LATE = 1024
_MAX_BUDGET_S = 3600.0
#: How long a pong may take to be read once pinged (the socket poll's own granularity is 1 ms).
_PONG_POLL_S = 0.0001


@dataclass(frozen=True)
class _Grant:
    """A lease the sender granted (its ``grant`` answer) and where it came from."""

    key: str
    xid: str
    size: int
    addr: int
    agent: str
    endpoint: Endpoint
    chan: Channel = field(compare=False, repr=False)


@dataclass
class _ParkedRead:
    """A quarantined READ as the NIXL receiver asks about it: its own transfer's state; one
    still running past ``quarantine_dead_seconds`` is cancelled (released) and counts as gone.
    A slot is freed only once its READ is released."""

    xfer: Transfer
    since: float
    dead_s: float

    def outcome(self) -> Outcome:
        state = self.xfer.state()
        if state == "PROC":
            dead = time.monotonic() - self.since > self.dead_s
            return Outcome.GONE if dead and self.xfer.release() else Outcome.RUNNING
        if not self.xfer.release():
            return Outcome.RUNNING
        return Outcome.DONE if state == "DONE" else Outcome.GONE


class NixlReceiverSide:
    """Claims and READs payloads into its registered pool. Owned by ``NixlConnector``; the
    backend of its :class:`~omnikv.connectors.pull.receiving.PullReceiver` (``claim``:
    ``claim``; ``transfer``: the READ).

    ``read_hook`` (test hook, set through
    :meth:`~omnikv.connectors.nixl.connector.NixlConnector.set_read_hook`) runs before each
    READ of a granted payload; when it returns ``False`` the READ is skipped and the grant left
    to expire, as a receiver that died after its grant leaves it.
    """

    read_hook: Callable[[], object] | None = None

    def __init__(
        self,
        settings: NixlSettings,
        agent: NixlAgent,
        pool: HostPool,
        client: ControlClient,
        counters: Counters,
        lock: Any,
    ) -> None:
        self._s = settings
        self._agent = agent
        self._pool = pool
        self._client = client
        self._counters = counters
        self._lock = lock
        self._remotes: dict[Endpoint, str] = {}
        #: The wait loop, quarantine and late arrivals this side is the backend of (the
        #: connector receives through it).
        self.core = PullReceiver(
            self,
            pool,
            counters,
            peer_timeout_s=settings.peer_timeout_s,
            quarantine_interval_s=max(0.01, min(0.25, settings.peer_timeout_s / 10)),
            quarantine_name="omnikv-nixl-quarantine",
            engine="NixlConnector",
            max_late=_MAX_LATE,
        )

    # -- the backend: ask with ``claim``, transfer with a READ ---------------------------------
    def claim(self, key: str, endpoint: Endpoint, deadline: float, hold_s: float) -> _Grant | None:
        """One claim of ``key`` (held at most ``hold_s`` and the long-poll cap), after loading
        the sender's metadata on first contact: the lease, or ``None`` (the core's ask)."""
        chan = self._client.channel(endpoint, min(remaining(deadline), self._s.peer_timeout_s))
        if chan is None:  # the sender is not (yet) listening: retry until the deadline
            return None
        remote = self._remote(endpoint, chan, deadline)
        if remote is None:
            return None
        grant = self._claim(chan, endpoint, key, deadline, hold_s)
        if grant is None:
            return None
        if grant.agent != remote:  # the sender restarted since we loaded its metadata
            self._forget_remote(endpoint)
            chan.send({"op": "abort", "xid": grant.xid})
            return None
        hook = self.read_hook
        if hook is not None and hook() is False:
            return None  # as if this receiver died between its grant and its READ
        return grant

    def transfer(self, grant: _Grant, deadline: float) -> ManagedBuffer | None:
        """The READ of a granted lease into a receive slot (the core's transfer)."""
        return self._read(grant.chan, grant.endpoint, grant, deadline)

    # -- metadata ----------------------------------------------------------------------------
    def _remote(self, endpoint: Endpoint, chan: Channel, deadline: float) -> str | None:
        """The sender's NIXL agent name, loading its metadata on first contact (and forgetting
        the agents of senders no thread holds a channel to any more)."""
        with self._lock:
            name = self._remotes.get(endpoint)
            others = [ep for ep in self._remotes if ep != endpoint]
        if name is not None:
            return name
        for other in others:
            if not self._client.has_channel(other):
                self._forget_remote(other)
        reply = chan.request({"op": "meta"}, min(remaining(deadline), self._s.peer_timeout_s))
        if reply is None or reply["op"] != "agentmd":
            self._client.discard(endpoint, chan)
            return None
        name = self._agent.add_remote(reply["md"])
        if name != reply["agent"]:
            raise ConnectorUnavailableError(
                f"sender {endpoint} sent metadata of agent {name!r} as {reply['agent']!r}"
            )
        with self._lock:
            self._remotes[endpoint] = name
        logger.debug("loaded NIXL agent %s of sender %s:%d", name, *endpoint)
        return name

    def _forget_remote(self, endpoint: Endpoint) -> None:
        with self._lock:
            name = self._remotes.pop(endpoint, None)
            still_used = name in self._remotes.values()
        if name is not None and not still_used:
            self._agent.remove_remote(name)

    # -- claim -------------------------------------------------------------------------------
    def _claim(
        self, chan: Channel, endpoint: Endpoint, key: str, deadline: float, hold_s: float
    ) -> _Grant | None:
        left = remaining(deadline)
        wait_s = min(max(0.0, left - 0.02), LONG_POLL_CAP_S, hold_s)
        xid = uuid.uuid4().hex
        msg = {
            "op": "claim",
            "key": key,
            "wait_ms": int(wait_s * 1000),
            "xid": xid,
            "budget_ms": int(min(left, _MAX_BUDGET_S) * 1000),
        }
        reply = self._await(chan, endpoint, chan.send(msg), min(left, wait_s + 0.5), key)
        if reply is None:  # a grant may still come: end its lease now, nobody will read it
            chan.send({"op": "abort", "xid": xid})
            return None
        if reply["op"] == "error":
            raise ConnectorUnavailableError(f"sender refused the claim of {key}: {reply['reason']}")
        if reply["op"] != "grant" or not reply["found"]:
            return None
        return _Grant(key, xid, reply["size"], reply["addr"], reply["agent"], endpoint, chan)

    def _await(
        self, chan: Channel, endpoint: Endpoint, nonce: bytes, timeout_s: float, key: str
    ) -> dict[str, Any] | None:
        """The reply to ``nonce`` within ``timeout_s``, pinging the sender meanwhile.

        ``None`` when the time is up; ``PeerGoneError`` when the sender (which answered before:
        the channel exists) stays silent for ``peer_timeout_seconds``.
        """
        sent: set[bytes] = {nonce}
        try:
            return self._await_reply(chan, endpoint, nonce, timeout_s, key, sent)
        finally:
            chan.forget(sent)  # the pongs and the reply nobody will collect now

    def _await_reply(
        self,
        chan: Channel,
        endpoint: Endpoint,
        nonce: bytes,
        timeout_s: float,
        key: str,
        sent: set[bytes],
    ) -> dict[str, Any] | None:
        end = time.monotonic() + timeout_s
        heard = time.monotonic()
        ping_every = max(0.05, self._s.peer_timeout_s / 5)
        pings: set[bytes] = set()
        while True:
            now = time.monotonic()
            if now - heard > self._s.peer_timeout_s:
                self._gone(endpoint, f"claiming {key}")
            if now >= end:
                return None
            reply = chan.recv({nonce, *pings}, min(ping_every, end - now))
            if reply is None and chan.closed:
                self._gone(endpoint, f"claiming {key} (it closed the control connection)")
            if reply is not None and reply.get("re") == nonce:
                return reply
            if reply is not None:
                heard = time.monotonic()
                pings.clear()
            elif not pings or time.monotonic() - heard >= ping_every:
                ping = chan.send({"op": "ping"})
                pings.add(ping)
                sent.add(ping)

    def _gone(self, endpoint: Endpoint, doing: str) -> NoReturn:
        self._client.discard(endpoint)
        self._forget_remote(endpoint)
        self._counters.add("peer_gone")
        raise PeerGoneError(
            f"sender {endpoint[0]}:{endpoint[1]} silent for {self._s.peer_timeout_s:.1f}s "
            f"while {doing}"
        )

    def _check_alive(self, chan: Channel, endpoint: Endpoint, doing: str) -> None:
        """Ping once; a sender that answered before and is silent now is gone."""
        if chan.request({"op": "ping"}, self._s.peer_timeout_s) is None:
            self._gone(endpoint, doing)

    # -- read --------------------------------------------------------------------------------
    def _read(
        self, chan: Channel, endpoint: Endpoint, grant: _Grant, deadline: float
    ) -> ManagedBuffer | None:
        try:
            offset, _ = self._pool.allocator.alloc(grant.size, deadline=_finite(deadline))
        except PoolExhaustedError:
            chan.send({"op": "abort", "xid": grant.xid})
            raise
        try:
            xfer = self._agent.read(
                grant.agent,
                self._pool.address + offset,
                grant.addr,
                grant.size,
                grant.xid.encode(),
            )
        except ConnectorError:
            self._pool.allocator.free(offset)
            chan.send({"op": "abort", "xid": grant.xid})
            self._check_alive(chan, endpoint, f"posting the READ of {grant.key}")
            raise
        end = min(deadline, time.monotonic() + transfer_budget_s(grant.size))
        state = self._poll(chan, endpoint, grant, xfer, offset, end)
        if state == "DONE":
            xfer.release()
            return self._deliver(offset, grant.size)
        return None

    def _poll(
        self,
        chan: Channel,
        endpoint: Endpoint,
        grant: _Grant,
        xfer: Transfer,
        offset: int,
        end: float,
    ) -> str:
        """Poll the READ until DONE; ERR raises; the deadline or silence quarantines."""
        for state, silent in self._watch(chan, xfer, end):
            if state == "DONE":
                return state
            if state == "ERR":
                if xfer.release():
                    self._pool.allocator.free(offset)
                else:  # NIXL kept the handle: the slot waits for the reaper
                    self._quarantine_slot(grant.key, xfer, offset)
                self._check_alive(chan, endpoint, f"reading {grant.key}")
                raise ConnectorUnavailableError(f"the NIXL READ of {grant.key} failed")
            if silent:
                self._quarantine_slot(grant.key, xfer, offset)
                self._gone(endpoint, f"reading {grant.key}")
        self._quarantine_slot(grant.key, xfer, offset)
        return "PROC"

    def _watch(self, chan: Channel, xfer: Transfer, end: float) -> Iterator[tuple[str, bool]]:
        """Yield ``(state, sender_silent)`` until ``end``; pings the sender meanwhile."""
        step = POLL_FIRST_S
        heard = time.monotonic()
        ping_every = max(0.05, self._s.peer_timeout_s / 5)
        next_ping = heard + ping_every
        pings: set[bytes] = set()
        while True:
            state = xfer.state()
            now = time.monotonic()
            if pings and chan.recv(pings, _PONG_POLL_S) is not None:
                heard = now
                pings.clear()
            yield state, chan.closed or now - heard > self._s.peer_timeout_s
            if now >= end:
                return
            if now >= next_ping:
                pings.add(chan.send({"op": "ping"}))
                next_ping = now + ping_every
            time.sleep(min(step, max(0.0, end - now)))
            step = min(step * 2, POLL_CAP_S)

    def _deliver(self, offset: int, size: int) -> ManagedBuffer:
        return deliver(self._pool, self._counters, offset, size)

    # -- quarantine and late arrivals --------------------------------------------------------
    def _quarantine_slot(self, key: str, xfer: Transfer, offset: int) -> None:
        """The receive gave up while its READ may still write the slot at ``offset``."""
        parked = _ParkedRead(xfer, time.monotonic(), self._s.quarantine_dead_s)
        self.core.park(uuid.uuid4().hex, key, offset, xfer.nbytes, parked)

    @property
    def client(self) -> ControlClient:
        """The control client this side reaches senders through (the connector's)."""
        return self._client

    def stats(self) -> dict[str, int]:
        with self._lock:
            remotes = len(self._remotes)
        return {**self.core.stats(), "remote_agents": remotes}

    @property
    def reaper(self) -> threading.Thread | None:
        return self.core.reaper

    def close(self, timeout_s: float) -> bool:
        """Stop the reaper; cancel quarantined READs. True when none can still write."""
        parked = self.core.close(5.0)
        end = time.monotonic() + timeout_s
        with self._lock:
            self._remotes.clear()
        xfers = [p.xfer for p in parked if isinstance(p, _ParkedRead)]
        for xfer in xfers:
            while not xfer.release() and time.monotonic() < end:
                time.sleep(0.01)
        return all(x.state() != "PROC" or x.release() for x in xfers)


def _finite(deadline: float) -> float:
    """A pool wait never blocks forever: an infinite deadline waits 1 s for space."""
    return deadline if math.isfinite(deadline) else time.monotonic() + 1.0
