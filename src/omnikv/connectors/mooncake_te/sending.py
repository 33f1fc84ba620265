"""The sender side of the Transfer Engine connector: publish, answer queries, serve pulls.

A put reserves a slot in the registered pool (:attr:`SenderSide.room`), lets the caller encode
straight into it and publishes it under its transport key. The control server (one listener thread)
answers ``query`` at once or holds it (long-poll) until the key is published or the requester's wait
ends; a ``pull`` is checked (entry present and idle, capacity, destination inside the pool the
requester declared in its hello) and handed to a worker, which writes the entry with
``transfer_sync_write`` into the requester's session and frees the slot on success (consume-once).
Entries older than ``buffer_ttl_seconds`` are dropped, never one in flight.

Verdicts (:mod:`omnikv.connectors.pull.verdicts`): a completed pull marks the entry taken by the
requester (its hello); that requester's ``verdict`` message, and only its, reports
``delivered`` / ``refused``; an entry dropped by the TTL is reported ``expired``, and so is one
taken without a verdict for ``ack_timeout_s`` (swept on the listener thread).

The engine keeps the segment it opened for a session name (``host:port``) for as long as it lives,
and a write whose transport connection fails does not drop it. A receiver that starts on the
port of an earlier one the engine wrote to (the engine picks its port among about 2,000) would
therefore have every write sent to the dead one's transport port. Each receiving connector says
hello with a random token; when a session name comes back with another token, the sender spells
the name anew (one more leading zero in the port, which the engine parses to the same port) so the
engine opens a fresh segment for it.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from omnikv._logging import RateLimitedLog
from omnikv.connectors.base import matches_request
from omnikv.connectors.counters import Counters
from omnikv.connectors.mooncake_te.config import TEConfig
from omnikv.connectors.mooncake_te.engine import TE_ERRORS
from omnikv.connectors.mooncake_te.protocol import LONG_POLL_CAP_S, XFER_HISTORY
from omnikv.connectors.pool import HostPool
from omnikv.connectors.pull.connector import PEEK_OP, peek_answer, published
from omnikv.connectors.pull.control import ControlCodec, Request
from omnikv.connectors.pull.room import PoolRoom
from omnikv.connectors.pull.server import ControlServer
from omnikv.connectors.pull.verdicts import VERDICT_OP, SentVerdicts, peer_identity

__all__ = ["SenderSide"]

logger = logging.getLogger(__name__)
_outsider = RateLimitedLog(logger)  # lines a peer, client or forger can cause


@dataclass
class _Entry:
    key: str
    offset: int
    size: int
    created: float
    inflight: bool = False
    pub: int = 0  # its publication's number in the verdict watch


@dataclass
class _Waiter:
    req: Request
    key: str
    expires: float


#: How often one session name may come back with a new receiver before writes to it are refused
#: (each time costs the name one leading zero in the port).
MAX_SESSION_RESPELLINGS = 64
#: How many session names the sender remembers (names its engine wrote to); past it the name
#: used least recently whose receiver holds no channel is forgotten.
MAX_SESSION_NAMES = 4096
#: How many (session, receiver) pairs whose last write failed are remembered (their next write
#: tries the next spelling).
MAX_FAILED_SPELLINGS = 1024


def respell_session(session: str, generation: int) -> str:
    """``session`` (``host:port``) with ``generation`` leading zeros in its port: the same peer
    to the engine, a name it has not opened yet."""
    host, _, port = session.rpartition(":")
    return f"{host}:{'0' * generation}{port}"


@dataclass
class _Name:
    """The receiver a session name was last written to: its token, its channel, the spelling."""

    token: bytes
    ident: bytes
    generation: int


class SessionNames:
    """The spelling under which the engine is to write to each receiver session (thread-safe).

    The engine keeps the segment of every name it opened for as long as it lives, so a receiver
    that comes back under a name (a restart on the same port) must be written to under a new
    spelling. Without ``auth_secret`` anyone can claim any name, so nothing here is spent by
    saying so (issue 39 item 2):

    * a spelling is remembered only after a write under it succeeded (:meth:`wrote`): a claim of
      a name where no engine answers, or a write that fails, changes nothing;
    * while the receiver a name was last written to holds its channel (``live``), the engine
      behind the name is that receiver's, so every other claimant of the name is written to
      under the same spelling: a live receiver's name cannot be respelt by others at all;
    * a claimant whose write under the current spelling failed tries the next one (a receiver
      that restarted before its old channel was noticed gone);
    * both tables are bounded (:data:`MAX_SESSION_NAMES` names written to,
      :data:`MAX_FAILED_SPELLINGS` failures), oldest first; a name is never forgotten while its
      receiver holds a channel.

    ``live(ident)`` says whether the control connection ``ident`` still holds a channel.
    """

    def __init__(
        self,
        live: Callable[[bytes], bool],
        *,
        max_names: int = MAX_SESSION_NAMES,
        max_failed: int = MAX_FAILED_SPELLINGS,
    ) -> None:
        self._live = live
        self._max_names = max_names
        self._max_failed = max_failed
        self._lock = threading.Lock()
        self._names: collections.OrderedDict[str, _Name] = collections.OrderedDict()
        self._failed: collections.OrderedDict[tuple[str, bytes], int] = collections.OrderedDict()

    def __len__(self) -> int:
        with self._lock:
            return len(self._names)

    def name_for(self, session: str, token: bytes) -> tuple[str, int]:
        """``(spelling, generation)`` under which to write to the receiver of ``token`` at
        ``session``; ``("", generation)`` past :data:`MAX_SESSION_RESPELLINGS`."""
        with self._lock:
            last = self._names.get(session)
            if last is None:
                generation = 0
            elif last.token == token or self._live(last.ident):
                generation = last.generation
            else:
                generation = last.generation + 1
            failed = self._failed.get((session, token))
            if failed is not None and failed >= generation:
                generation = failed + 1
        if generation > MAX_SESSION_RESPELLINGS:
            return "", generation
        return respell_session(session, generation), generation

    def wrote(self, session: str, token: bytes, ident: bytes, generation: int) -> None:
        """A write under ``generation``'s spelling reached the receiver of ``token`` (on the
        connection ``ident``): remember it (called after every successful write)."""
        with self._lock:
            self._failed.pop((session, token), None)
            last = self._names.get(session)
            if last is not None and generation < last.generation:
                return  # a write that started before a newer receiver came
            if (
                last is not None
                and generation == last.generation
                and last.token != token
                and self._live(last.ident)
            ):
                self._names.move_to_end(session)
                return  # the name's receiver is still there: it keeps the name
            self._names[session] = _Name(token, ident, generation)
            self._names.move_to_end(session)
            self._bound_names()
        if last is not None and generation > last.generation:
            _outsider.info(
                "session %s came back with a new receiver; writing to it afresh", session
            )

    def failed(self, session: str, token: bytes, generation: int) -> None:
        """A write under ``generation``'s spelling failed: that claimant tries the next
        spelling next time (remembered for at most :data:`MAX_FAILED_SPELLINGS` claimants)."""
        with self._lock:
            self._failed[(session, token)] = generation
            self._failed.move_to_end((session, token))
            while len(self._failed) > self._max_failed:
                self._failed.popitem(last=False)

    def _bound_names(self) -> None:
        """(lock held) Forget the least recently used names past the cap, sparing live ones."""
        excess = len(self._names) - self._max_names
        if excess <= 0:
            return
        gone = [n for n, e in self._names.items() if not self._live(e.ident)][:excess]
        for name in gone:
            del self._names[name]


def _pull_refusal(entry: _Entry | None, req: Request) -> str:
    """Why ``req`` (a pull) cannot be served now; ``""`` when it can."""
    if entry is None or entry.inflight:
        return "not_found" if entry is None else "busy"
    msg, peer = req.msg, req.peer
    if msg["cap"] < entry.size:
        return "too_small"
    if msg["dst"] < peer["base"] or msg["dst"] + entry.size > peer["base"] + peer["len"]:
        return "outside_pool"
    return ""


class SenderSide:
    """Entries, the control server and the pull workers of one sending connector.

    ``write_hook`` (test hook, set through
    :meth:`~omnikv.connectors.mooncake_te.connector.MooncakeTransferEngineConnector.set_write_hook`)
    runs on the pull worker just before each engine write.
    """

    write_hook: Callable[[], object] | None = None

    def __init__(
        self,
        cfg: TEConfig,
        codec: ControlCodec,
        engine: Any,
        pool: HostPool,
        counters: Counters,
        verdicts: SentVerdicts,
    ) -> None:
        self._cfg = cfg
        self._verdicts = verdicts
        self._engine = engine
        self._pool = pool
        self._counters = counters
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._waiters: list[_Waiter] = []
        self._xfers: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._inflight = 0
        self._idle = threading.Condition(self._lock)
        self._stopping = False
        self._sweep_every = max(0.05, min(10.0, cfg.ttl_s / 2))
        self._next_sweep = time.monotonic() + self._sweep_every
        assert cfg.zmq_port is not None
        self._server = ControlServer(
            codec,
            (cfg.host, cfg.zmq_port),
            self._handle,
            tick=self._tick,
            name="omnikv-te",
            limits=cfg.limits,
        )
        self._sessions = SessionNames(self._server.has_channel)
        try:
            self._executor = ThreadPoolExecutor(cfg.workers, thread_name_prefix="omnikv-te-pull")
        except BaseException:
            self._server.close()
            raise
        self._server.start()
        # Last: the room holds a bound method of this side, and a side whose construction
        # failed above must be freed at once (no cycle), closing what it had opened.
        #: Where a put's slot is reserved and filled (its pool under the grace rule).
        self.room = PoolRoom(
            pool,
            entries=self._entries,
            lock=self._lock,
            unclaimed=lambda e: not e.inflight,
            drop_locked=self._drop_locked,
            grace_s=cfg.unclaimed_grace_s,
            counters=counters,
            verdicts=verdicts,
        )

    # -- publishing (caller threads) --------------------------------------------------------------
    def _drop_locked(self, entry: _Entry) -> None:
        """(lock held) Unpublish ``entry`` (not in flight) and free its slot."""
        del self._entries[entry.key]
        self._pool.allocator.free(entry.offset)
        self._idle.notify_all()

    def publish(self, key: str, offset: int, size: int, put_key: str) -> dict[str, Any]:
        """Publish the slot at ``offset`` (filled through :attr:`room`) under ``key``, its
        verdict watched as ``put_key``; an idle entry it replaces is freed."""
        pub = self._verdicts.published(key, put_key)  # watched before anyone can pull it
        entry = _Entry(key, offset, size, time.monotonic(), pub=pub)
        with self._lock:
            old = self._entries.get(key)
            self._entries[key] = entry
        if old is not None and not old.inflight:
            self._pool.allocator.free(old.offset)
        self._server.wake()
        return published(self._cfg, self._counters, key, size)

    def cleanup(self, request_id: str) -> None:
        with self._lock:
            gone = [
                e
                for k, e in self._entries.items()
                if matches_request(k, request_id) and not e.inflight
            ]
            for e in gone:
                del self._entries[e.key]
        for e in gone:
            self._pool.allocator.free(e.offset)
            self._verdicts.forget(e.key, e.pub)

    def withdraw(self, key: str) -> bool:
        """Drop ``key``'s entry unless a pull of it is in flight; whether it went (no verdict)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.inflight:
                return False
            del self._entries[key]
            self._idle.notify_all()
        self._pool.allocator.free(entry.offset)
        self._verdicts.forget(entry.key, entry.pub)
        return True

    def pending_keys(self) -> list[str]:
        with self._lock:
            return list(self._entries)

    def flush(self, timeout_s: float) -> list[str]:
        """Wait up to ``timeout_s`` until every published entry was pulled; the keys left."""
        end = time.monotonic() + max(0.0, timeout_s)
        with self._idle:
            while self._entries and time.monotonic() < end:
                self._idle.wait(timeout=end - time.monotonic())
            return list(self._entries)

    # -- listener thread ---------------------------------------------------------------------------
    def _handle(self, req: Request) -> None:
        if req.op == "status":
            with self._lock:
                state = self._xfers.get(req.msg["xid"], "unknown")
            self._server.answer(req, {"op": "xstate", "state": state})
        elif req.op == "query":
            self._query(req)
        elif req.op == PEEK_OP:
            with self._lock:
                size = self._pullable_locked(req.msg["key"])
            self._answer_found(req, peek_answer(size), size is not None)
        elif req.op == VERDICT_OP:
            m, peer = req.msg, peer_identity(req.peer)
            self._verdicts.receive(m["key"], peer, m["verdict"], m["reason"])
        else:
            self._start_pull(req)

    def _pullable_locked(self, key: str) -> int | None:
        """(lock held) The size of ``key``'s entry when a pull of it could start now (published,
        no pull in flight), else ``None``. What ``query``, its waiters and ``peek`` answer."""
        entry = self._entries.get(key)
        return entry.size if entry is not None and not entry.inflight else None

    def _query(self, req: Request) -> None:
        key = req.msg["key"]
        with self._lock:
            size = self._pullable_locked(key)
            if size is None:
                wait_s = min(req.msg["wait_ms"] / 1000.0, LONG_POLL_CAP_S)
                if wait_s > 0:
                    self._waiters.append(_Waiter(req, key, time.monotonic() + wait_s))
                    return
        found = size is not None
        self._answer_found(req, {"op": "info", "found": found, "size": size or 0}, found)

    def _answer_found(self, req: Request, reply: dict[str, Any], found: bool) -> None:
        """Answer ``req``; a channel told a published key's size is a genuine peer's
        (:meth:`~omnikv.connectors.pull.server.ControlServer.vouch`: never evicted)."""
        if found:
            self._server.vouch(req.ident)
        self._server.answer(req, reply)

    def _tick(self) -> float:
        """Answer long-polls that can be answered, sweep by TTL, expire overdue verdicts;
        seconds until needed again."""
        self._serve_waiters()
        now = time.monotonic()
        if now >= self._next_sweep:
            self._reap_ttl()
            self._next_sweep = now + self._sweep_every
        verdict_due = now + self._verdicts.sweep(now)
        with self._lock:
            soonest = min((w.expires for w in self._waiters), default=self._next_sweep)
        return max(0.0, min(soonest, self._next_sweep, verdict_due) - time.monotonic())

    def _serve_waiters(self) -> None:
        now = time.monotonic()
        answers: list[tuple[Request, bool, int]] = []
        with self._lock:
            keep: list[_Waiter] = []
            for w in self._waiters:
                size = self._pullable_locked(w.key)
                if size is not None:
                    answers.append((w.req, True, size))
                elif now >= w.expires:
                    answers.append((w.req, False, 0))
                else:
                    keep.append(w)
            self._waiters = keep
        for req, found, size in answers:
            self._answer_found(req, {"op": "info", "found": found, "size": size}, found)

    def _start_pull(self, req: Request) -> None:
        with self._lock:
            entry = self._entries.get(req.msg["key"])
            reason = _pull_refusal(entry, req)
            if not reason:
                assert entry is not None
                entry.inflight = True
                self._inflight += 1
                self._note_xfer(req.msg["xid"], "inflight")
        if reason:
            if reason == "outside_pool":
                _outsider.warning(
                    "refused a pull of %s outside the requester's pool", req.msg["key"]
                )
            self._server.answer(req, {"op": "error", "reason": reason})
            return
        assert entry is not None
        self._server.vouch(req.ident)
        try:
            self._executor.submit(self._do_pull, req, entry, time.monotonic())
        except RuntimeError:  # executor shut down: closing
            self._finish_pull(entry, req.msg["xid"], ok=False)
            self._server.answer(req, {"op": "error", "reason": "closing"})

    def _note_xfer(self, xid: str, state: str) -> None:
        self._xfers[xid] = state
        while len(self._xfers) > XFER_HISTORY:
            self._xfers.popitem(last=False)

    # -- pull workers ------------------------------------------------------------------------------
    def _write(self, req: Request, entry: _Entry) -> str:
        """The engine write of ``entry`` into the requester's slot; ``""`` or why it failed.

        A write that fails under a spelling the requester inherited (another receiver's, or one
        from before a restart) is tried once more under the next spelling
        (:class:`SessionNames`)."""
        session, token = req.peer["sess"], req.peer["inc"]
        sess, generation = self._sessions.name_for(session, token)
        hook = self.write_hook
        if hook is not None:
            hook()
        reason = ""
        for _ in range(2):
            if not sess:
                return f"session {session} reused by too many receivers; restart the sender"
            reason = self._write_as(sess, req, entry)
            if not reason:
                self._sessions.wrote(session, token, req.ident, generation)
                return ""
            self._sessions.failed(session, token, generation)
            again, next_generation = self._sessions.name_for(session, token)
            if next_generation == generation:
                break
            sess, generation = again, next_generation
        return reason

    def _write_as(self, sess: str, req: Request, entry: _Entry) -> str:
        """One engine write of ``entry`` under the session spelling ``sess``."""
        t0 = time.perf_counter()
        try:
            rc = self._engine.transfer_sync_write(
                sess, self._pool.address + entry.offset, req.msg["dst"], entry.size
            )
        except TE_ERRORS.handled as exc:  # the reason goes to the receiver, which raises
            return f"transfer raised {type(exc).__name__}: {exc}"
        logger.debug(
            "pull %s -> %s: %d bytes in %.3f ms (rc %d)",
            entry.key,
            sess,
            entry.size,
            (time.perf_counter() - t0) * 1e3,
            rc,
        )
        return "" if rc == 0 else f"transfer_sync_write returned {rc}"

    def _do_pull(self, req: Request, entry: _Entry, started: float) -> None:
        reason = "expired"
        try:
            expired = time.monotonic() - started >= req.msg["budget_ms"] / 1000.0
            if not expired and not self._stopping:
                reason = self._write(req, entry)
        finally:
            consumed = self._finish_pull(entry, req.msg["xid"], ok=not reason)
        if consumed:  # before ``done``: the requester's verdict may follow at once
            self._verdicts.taken(entry.key, entry.pub, peer_identity(req.peer))
        if not reason:
            self._counters.add("pulls_served")
            self._server.answer(req, {"op": "done", "size": entry.size})
        else:
            self._counters.add("pull_failures")
            _outsider.warning("pull of %s failed: %s", entry.key, reason)
            self._server.answer(req, {"op": "error", "reason": reason})

    def _finish_pull(self, entry: _Entry, xid: str, *, ok: bool) -> bool:
        """End a pull: free the slot if consumed (or replaced meanwhile); True when this pull
        consumed the key's current entry."""
        with self._lock:
            self._note_xfer(xid, "done" if ok else "failed")
            entry.inflight = False
            current = self._entries.get(entry.key) is entry
            free = ok or not current  # consumed, or replaced by a newer put while in flight
            if ok and current:
                del self._entries[entry.key]
            self._inflight -= 1
            self._idle.notify_all()
        if free:
            self._pool.allocator.free(entry.offset)
        if not ok:
            self._server.wake()  # waiters may retry
        return ok and current

    def _reap_ttl(self) -> None:
        cutoff = time.monotonic() - self._cfg.ttl_s
        with self._lock:
            old = [e for e in self._entries.values() if e.created < cutoff and not e.inflight]
            for e in old:
                del self._entries[e.key]
            if old:
                self._idle.notify_all()
        why = f"unconsumed for {self._cfg.ttl_s:g} s (TTL, buffer_ttl_seconds)"
        for e in old:
            self._pool.allocator.free(e.offset)
            _outsider.warning("dropped %s after %.0f s unconsumed (TTL)", e.key, self._cfg.ttl_s)
            self._verdicts.expired(e.key, e.pub, why)
        if old:
            self._counters.add("ttl_reaped", len(old))

    # -- state and shutdown ------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        with self._lock:
            mine = {"entries": len(self._entries), "inflight": self._inflight}
        mine["awaiting_verdicts"] = len(self._verdicts)
        mine["session_names"] = len(self._sessions)
        return {**mine, **self._server.stats()}

    @property
    def rejected(self) -> int:
        return self._server.rejected

    @property
    def thread(self) -> threading.Thread | None:
        return self._server.thread

    def close(self) -> bool:
        """Stop the listener and workers; True when no write is running (the pool may go)."""
        self._stopping = True
        self._server.close(timeout=max(5.0, self._cfg.peer_timeout_s * 2))
        self._executor.shutdown(wait=False, cancel_futures=True)
        end = time.monotonic() + self._cfg.close_timeout_s
        with self._idle:
            while self._inflight > 0 and time.monotonic() < end:
                self._idle.wait(timeout=max(0.0, end - time.monotonic()))
            idle = self._inflight == 0
            self._entries.clear()
            self._waiters.clear()
        if idle:
            self._executor.shutdown(wait=True)
            self._engine = None  # the connector destroys the engine next
        return idle
