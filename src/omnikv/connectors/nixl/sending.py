"""The sender side of the NIXL connector: a registered pool of entries, leases and notifications.

A put reserves a slot in the registered pool (waiting for space until its deadline), lets the
caller encode into it and publishes it under its transport key. Receivers ``claim`` a key (a
long-poll: held until the key is there), which leases the entry to one transfer id; the receiver
READs the bytes and NIXL delivers the transfer id to this agent as a notification, which frees
the entry (consume-once). A lease that sees no notification within its budget plus
``peer_timeout_seconds`` ends (the entry can be claimed again).

An entry is never held forever by claims that do not complete: it is leased at most
``max_leases_per_entry`` times, and ``buffer_ttl_seconds`` counts from the put across every
re-lease. Past either, the entry is dropped (no claim is granted any more), its slot is freed
at once or, if a lease is out, when that lease ends (at most one lease budget plus
``peer_timeout_seconds`` later), and it is reported: a WARNING naming the key and a counter
(``ttl_reaped`` / ``lease_limit_reaped``).

Verdicts (:mod:`omnikv.connectors.pull.verdicts`): an entry is taken by the agent whose READ
notification freed it, and only the verdict of the receiver that said hello as that agent is
reported (``delivered`` / ``refused``). The verdict travels on TCP and the notification on
NIXL, so a verdict may come first: from the lease holder it is kept until the notification
arrives. An entry dropped by its TTL or the lease cap is reported ``expired`` (a leased one when
its lease ends unconsumed), and so is one taken without a verdict for ``ack_timeout_s``.

Everything that touches the entries runs under one lock; the control listener thread also polls
NIXL's notifications (finely while leases are out) and sweeps leases and the TTL.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from omnikv._logging import RateLimitedLog
from omnikv.connectors.base import matches_request
from omnikv.connectors.counters import Counters
from omnikv.connectors.nixl.agent import NixlAgent
from omnikv.connectors.nixl.config import NixlSettings
from omnikv.connectors.nixl.protocol import LONG_POLL_CAP_S
from omnikv.connectors.pool import HostPool
from omnikv.connectors.pull.connector import PEEK_OP, peek_answer, published, transfer_budget_s
from omnikv.connectors.pull.control import Request
from omnikv.connectors.pull.room import PoolRoom
from omnikv.connectors.pull.server import ControlServer
from omnikv.connectors.pull.verdicts import VERDICT_OP, SentVerdicts, peer_identity

__all__ = ["NixlSenderSide"]

logger = logging.getLogger(__name__)
_outsider = RateLimitedLog(logger)  # lines a peer, client or forger can cause

#: How often the listener polls NIXL notifications while a lease is out (seconds).
NOTIFY_POLL_S = 0.002
MAX_WAITERS = 4096
MAX_XIDS = 8192
#: The reason an entry dropped unconsumed is reported ``expired`` with, by why it was dropped.
_EXPIRED = {
    "ttl": "unconsumed within its TTL (buffer_ttl_seconds)",
    "leases": "leased max_leases_per_entry times without a completed READ",
}


@dataclass
class _Entry:
    key: str
    offset: int
    size: int
    created: float
    lease: str | None = None
    lease_agent: str = ""
    lease_until: float = 0.0
    consumed: bool = False
    leases: int = 0
    pub: int = 0  # its publication's number in the verdict watch
    lease_peer: bytes = b""  # the lease holder's hello (peer_identity)
    dropped: str = ""  # why it was dropped while leased (TTL): reported when the lease ends


@dataclass
class _Waiter:
    req: Request
    expires: float


class NixlSenderSide:
    """Entries in a registered pool, served to claiming receivers. Owned by ``NixlConnector``.

    ``grant_hook`` (test hook, set through
    :meth:`~omnikv.connectors.nixl.connector.NixlConnector.set_grant_hook`) runs on the control
    thread right after each grant is answered.
    """

    grant_hook: Callable[[], object] | None = None

    def __init__(
        self,
        settings: NixlSettings,
        agent: NixlAgent,
        pool: HostPool,
        counters: Counters,
        lock: Any,
        verdicts: SentVerdicts,
    ) -> None:
        self._s = settings
        self._verdicts = verdicts
        self._agent = agent
        self._pool = pool
        self._counters = counters
        self._lock = lock
        self._entries: dict[str, _Entry] = {}
        #: Where a put's slot is reserved and filled (its pool under the grace rule).
        self.room = PoolRoom(
            pool,
            entries=self._entries,
            lock=lock,
            unclaimed=lambda e: e.lease is None,
            drop_locked=self._evict_locked,
            grace_s=settings.unclaimed_grace_s,
            counters=counters,
            verdicts=verdicts,
        )
        self._by_xid: dict[str, _Entry] = {}
        self._waiters: list[_Waiter] = []
        self._consumed_cond = threading.Condition(lock)
        self._md = agent.metadata()
        self._next_sweep = time.monotonic()
        self.server: ControlServer | None = None

    def attach(self, server: ControlServer) -> None:
        """Set the control server this side answers through (built by the connector)."""
        self.server = server

    # -- puts (caller's thread) --------------------------------------------------------------
    def _evict_locked(self, entry: _Entry) -> None:
        """(lock held) Drop ``entry`` (no lease out) and free its slot."""
        self._drop_locked(entry)
        self._pool.allocator.free(entry.offset)

    def publish(self, key: str, offset: int, size: int, put_key: str) -> dict[str, Any]:
        """Publish the slot at ``offset`` (filled through :attr:`room`) under ``key``, its
        verdict watched as ``put_key``; an entry it replaces is retired (freed once unleased)."""
        pub = self._verdicts.published(key, put_key)  # watched before anyone can claim it
        entry = _Entry(key, offset, size, time.monotonic(), pub=pub)
        with self._lock:
            old = self._entries.get(key)
            self._entries[key] = entry
            free_old = old is not None and self._drop_locked(old)
        if free_old and old is not None:
            self._pool.allocator.free(old.offset)
        if self.server is not None:
            self.server.wake()
        return published(self._s, self._counters, key, size)

    def _drop_locked(self, entry: _Entry) -> bool:
        """Retire ``entry`` (no more claims); True when its slot can be freed now."""
        entry.consumed = True
        if self._entries.get(entry.key) is entry:
            del self._entries[entry.key]
            self._consumed_cond.notify_all()
        return entry.lease is None

    # -- control requests (listener thread) --------------------------------------------------
    def handle(self, req: Request) -> None:
        """The control server's handler: ``meta``, ``claim``, ``abort``, ``peek``, ``verdict``."""
        assert self.server is not None
        if req.op == "meta":
            self.server.answer(req, {"op": "agentmd", "md": self._md, "agent": self._agent.name})
        elif req.op == "claim":
            self._claim(req)
        elif req.op == "abort":
            self._end_lease(req.msg["xid"], "aborted")
        elif req.op == PEEK_OP:
            size = self._claimable(req.msg["key"])
            if size is not None:  # told a published key's size: a genuine peer's channel
                self.server.vouch(req.ident)
            self.server.answer(req, peek_answer(size))
        elif req.op == VERDICT_OP:
            self._verdict(req)

    def _claimable(self, key: str) -> int | None:
        """The size of ``key``'s entry when a claim would be granted now (no lease out, not
        spent), else ``None``; changes nothing (a spent entry goes at its next claim or sweep)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.lease is not None or self._spent(entry, time.monotonic()):
                return None
            return entry.size

    def _verdict(self, req: Request) -> None:
        """A receiver's verdict: counted for the key's current publication when this peer took
        it, or kept until its notification arrives when this peer holds its lease."""
        self.poll_notifications()  # a completed READ is usually noted already
        msg, peer = req.msg, peer_identity(req.peer)
        with self._lock:
            entry = self._entries.get(msg["key"])
            leased = entry is not None and entry.lease is not None and entry.lease_peer == peer
        self._verdicts.receive(msg["key"], peer, msg["verdict"], msg["reason"], early_ok=leased)

    def _claim(self, req: Request) -> None:
        if self._try_grant(req):
            return
        wait_s = min(req.msg["wait_ms"] / 1000.0, LONG_POLL_CAP_S)
        with self._lock:
            if wait_s > 0 and len(self._waiters) < MAX_WAITERS:
                self._waiters.append(_Waiter(req, time.monotonic() + wait_s))
                return
        self._answer_miss(req)

    def _try_grant(self, req: Request) -> bool:
        msg = req.msg
        now = time.monotonic()
        with self._lock:
            entry = self._entries.get(msg["key"])
            if entry is None or entry.lease is not None or msg["xid"] in self._by_xid:
                return False
            if len(self._by_xid) >= MAX_XIDS:
                return False
            why = self._spent(entry, now)
            if why:
                self._drop_locked(entry)  # no lease is out: its slot goes now
            else:
                entry.lease = msg["xid"]
                entry.leases += 1
                entry.lease_agent = str(req.peer.get("agent", ""))
                entry.lease_peer = peer_identity(req.peer)
                budget = min(msg["budget_ms"] / 1000.0, transfer_budget_s(entry.size))
                entry.lease_until = now + budget + self._s.peer_timeout_s
                self._by_xid[entry.lease] = entry
        if why:
            self._pool.allocator.free(entry.offset)
            self._report(entry, why, now)
            self._verdicts.expired(entry.key, entry.pub, _EXPIRED[why])
            return False
        assert self.server is not None
        addr = self._pool.address + entry.offset
        grant = {"found": True, "size": entry.size, "addr": addr, "agent": self._agent.name}
        self.server.vouch(req.ident)  # leased a published key: a genuine peer's channel
        self.server.answer(req, {"op": "grant", **grant})
        self._counters.add("grants")
        logger.debug("leased %s to transfer %s", entry.key, entry.lease)
        hook = self.grant_hook
        if hook is not None:
            hook()
        return True

    def _spent(self, entry: _Entry, now: float) -> str:
        """Why ``entry`` may not be leased again (``"ttl"``, ``"leases"``), or ``""``."""
        if now - entry.created >= self._s.ttl_s:
            return "ttl"
        if entry.leases >= self._s.max_leases:
            return "leases"
        return ""

    def _report(self, entry: _Entry, why: str, now: float) -> None:
        """Count and log an entry dropped unconsumed (by the TTL or the lease cap)."""
        if why == "ttl":
            self._counters.add("ttl_reaped")
            _outsider.warning(
                "dropped %s after %.1f s unconsumed (TTL %.0f s; leased %d times)",
                entry.key,
                now - entry.created,
                self._s.ttl_s,
                entry.leases,
            )
        else:
            self._counters.add("lease_limit_reaped")
            _outsider.warning(
                "dropped %s unconsumed after %d leases without a completed READ "
                "(max_leases_per_entry)",
                entry.key,
                entry.leases,
            )

    def _answer_miss(self, req: Request) -> None:
        assert self.server is not None
        miss = {"found": False, "size": 0, "addr": 0, "agent": self._agent.name}
        self.server.answer(req, {"op": "grant", **miss})

    def _end_lease(self, xid: str, why: str) -> None:
        with self._lock:
            entry = self._by_xid.pop(xid, None)
            if entry is None or entry.lease != xid:
                return
            entry.lease = None
            free = entry.consumed
        if free:
            self._pool.allocator.free(entry.offset)
            if entry.dropped:  # its TTL passed while leased: nobody took it
                self._verdicts.expired(entry.key, entry.pub, _EXPIRED[entry.dropped])
        self._counters.add("lease_expired" if why == "expired" else "aborted")
        logger.debug("lease of %s to %s ended: %s", entry.key, xid, why)
        if self.server is not None:
            self.server.wake()

    # -- the listener's tick -----------------------------------------------------------------
    def tick(self) -> float:
        """Serve long-polls, take notifications, end stale leases, sweep the TTL.

        Returns the seconds until the next tick (fine while leases are out).
        """
        self.poll_notifications()
        now = time.monotonic()
        self._serve_waiters(now)
        self._expire_leases(now)
        if now >= self._next_sweep:
            self._reap_ttl(now)
            self._next_sweep = now + max(0.05, min(10.0, self._s.ttl_s / 2))
        verdict_due = self._verdicts.sweep(now)
        with self._lock:
            if self._by_xid:
                return NOTIFY_POLL_S
            nxt = min(self._next_sweep - now, verdict_due)
            if self._waiters:
                nxt = min(nxt, min(w.expires for w in self._waiters) - now)
        return max(0.0, min(nxt, 1.0))

    def poll_notifications(self) -> None:
        """Free the entries whose READ completed (their transfer id arrived as a notification)."""
        for agent_name, msgs in self._agent.notifications().items():
            for raw in msgs:
                self._consumed(agent_name, raw.decode("utf-8", "replace"))

    def _consumed(self, agent_name: str, xid: str) -> None:
        with self._lock:
            entry = self._by_xid.get(xid)
            if entry is None or entry.lease_agent != agent_name:
                entry = None
            else:
                del self._by_xid[xid]
                if entry.lease == xid:
                    entry.lease = None
                free = self._drop_locked(entry)
        if entry is None:
            self._counters.add("foreign_notifications")
            logger.debug("ignored notification %r from %s", xid[:64], agent_name)
            return
        if free:
            self._pool.allocator.free(entry.offset)
        # the publication this READ consumed (a newer put under the key is not affected)
        self._verdicts.taken(entry.key, entry.pub, entry.lease_peer)
        self._counters.add("consumed")
        logger.debug("%s consumed by %s (transfer %s)", entry.key, agent_name, xid)

    def _serve_waiters(self, now: float) -> None:
        with self._lock:
            if not self._waiters:
                return
            waiters, self._waiters = self._waiters, []
        keep: list[_Waiter] = []
        for w in waiters:
            if self._try_grant(w.req):
                continue
            if now >= w.expires:
                self._answer_miss(w.req)
            else:
                keep.append(w)
        with self._lock:
            self._waiters = keep + self._waiters

    def _expire_leases(self, now: float) -> None:
        with self._lock:
            stale = [x for x, e in self._by_xid.items() if e.lease == x and e.lease_until <= now]
        for xid in stale:
            _outsider.warning("transfer %s sent no completion within its budget; lease ended", xid)
            self._end_lease(xid, "expired")

    def _reap_ttl(self, now: float) -> None:
        """Drop the entries past their TTL, leased or not (a leased one's slot is freed when
        its lease ends: :meth:`_end_lease`, :meth:`_consumed`)."""
        cutoff = now - self._s.ttl_s
        with self._lock:
            old = [e for e in self._entries.values() if e.created <= cutoff]
            freeable = [e for e in old if self._drop_locked(e)]
            for e in old:
                e.dropped = "ttl"
        for e in freeable:
            self._pool.allocator.free(e.offset)
            self._verdicts.expired(e.key, e.pub, _EXPIRED["ttl"])
        for e in old:
            self._report(e, "ttl", now)

    # -- common ------------------------------------------------------------------------------
    def cleanup(self, request_id: str) -> None:
        """Drop the unconsumed entries of ``request_id`` (leased ones go when their lease ends)."""
        with self._lock:
            hits = [e for k, e in self._entries.items() if matches_request(k, request_id)]
            freeable = [e for e in hits if self._drop_locked(e)]
        for e in freeable:
            self._pool.allocator.free(e.offset)
        for e in hits:
            self._verdicts.forget(e.key, e.pub)

    def withdraw(self, key: str) -> bool:
        """Drop ``key``'s entry unless it is leased; whether it went (no verdict)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.lease is not None:
                return False
            self._drop_locked(entry)
        self._pool.allocator.free(entry.offset)
        self._verdicts.forget(entry.key, entry.pub)
        return True

    def pending_keys(self) -> list[str]:
        with self._lock:
            return list(self._entries)

    def flush(self, timeout_s: float) -> list[str]:
        """Block until no entry is left or ``timeout_s`` passes; the keys still unconsumed."""
        end = time.monotonic() + timeout_s
        with self._consumed_cond:
            while self._entries:
                left = end - time.monotonic()
                if left <= 0:
                    break
                self._consumed_cond.wait(timeout=left)
            return list(self._entries)

    def stats(self) -> dict[str, int]:
        with self._lock:
            mine = {"entries": len(self._entries), "leases": len(self._by_xid)}
        return {**mine, "awaiting_verdicts": len(self._verdicts)}

    def drain(self, timeout_s: float, sleep: Callable[[float], None] = time.sleep) -> bool:
        """At close: take notifications until no lease is out or ``timeout_s`` passes.

        Returns True when no READ can still be running against the pool.
        """
        end = time.monotonic() + timeout_s
        while True:
            self.poll_notifications()
            self._expire_leases(time.monotonic())
            with self._lock:
                if not self._by_xid:
                    return True
            if time.monotonic() >= end:
                return False
            sleep(NOTIFY_POLL_S)

    def forget_all(self) -> None:
        """At close, after :meth:`drain`: drop every entry and waiter (the pool goes next)."""
        with self._lock:
            self._entries.clear()
            self._by_xid.clear()
            self._waiters.clear()
