"""The control server of the pull connectors: one listener thread, admission, channels, timeouts.

Built by a pull connector's sending side (Mooncake Transfer Engine, NIXL) on its control port;
the wire rules, authentication and replay protection are :mod:`omnikv.connectors.pull.control`'s.
What happens to a connection:

1. accepted (always at once: the listen queue never holds a genuine peer hostage), then
   admitted against :class:`~omnikv.connectors.pull.control.ServerLimits`: past the per-peer or the
   total cap it evicts the oldest connection of that peer (or of anyone) that has no channel
   yet, else the oldest channel that was never vouched for (:meth:`ControlServer.vouch`: the
   engine granted it something only a genuine peer gets, such as a pull of a published key),
   or is closed when there is none: so strangers, who can say ``hello`` without a secret, cannot
   hold the slots genuine peers need;
2. it has ``handshake_timeout_s`` to send a valid ``hello``; a message that fails validation
   before that closes it (an unauthenticated peer gets one try);
3. after ``welcome`` it is a channel: its requests reach the engine's handler; invalid ones are
   dropped and counted, the connection stays;
4. it ends when the peer closes it, when TCP keepalive (the heartbeat) finds the peer gone,
   when it carried nothing for ``idle_timeout_s``, when the peer stops reading its replies, or at
   :meth:`ControlServer.close`; its channel ends with it.

At start the process's ``RLIMIT_NOFILE`` soft limit is raised to the hard limit where allowed,
and the total cap is lowered to half the descriptors left, so connections alone never exhaust
the descriptors the engine and the application need.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import hmac
import logging
import math
import os
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from omnikv._logging import RateLimitedLog
from omnikv.connectors.pull.control import (
    TOKEN_BYTES,
    ControlCodec,
    Endpoint,
    MessageReader,
    Request,
    ServerLimits,
    pack_message,
    set_keepalive,
)
from omnikv.errors import ConnectorUnavailableError, ProtocolError

__all__ = ["ControlServer", "Handler", "Tick", "effective_max_connections", "raise_nofile_limit"]

logger = logging.getLogger(__name__)
_outsider = RateLimitedLog(logger)  # lines a peer, client or forger can cause

Handler = Callable[[Request], None]
Tick = Callable[[], float]

#: connection refusals and rejected messages: a few WARNINGs per interval, then a summary
_refusals, _rejections = RateLimitedLog(logger), RateLimitedLog(logger)
_ACCEPT_BATCH = 64
_ACCEPT_PAUSE_S = 0.1  # accepting pauses this long when the process is out of descriptors
_RECV_BYTES = 65536
_FD_RESERVE = 64  # descriptors kept out of the connection budget (engine, logs, imports)
_MIN_CONNECTIONS = 8
_LISTENER, _WAKE = object(), object()

_nofile_lock = threading.Lock()
_nofile_raised = False


def raise_nofile_limit() -> tuple[int, int]:
    """Raise this process's ``RLIMIT_NOFILE`` soft limit to its hard limit (once per process,
    where the platform allows); the ``(soft, hard)`` limits in force afterwards."""
    global _nofile_raised
    try:
        import resource
    except ImportError:  # not a Unix: no limit to raise or read
        return (1 << 20, 1 << 20)
    with _nofile_lock:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if not _nofile_raised and hard != resource.RLIM_INFINITY and soft < hard:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
                logger.info("raised RLIMIT_NOFILE from %d to %d", soft, hard)
                soft = hard
            except (ValueError, OSError) as exc:
                logger.info("cannot raise RLIMIT_NOFILE from %d to %d: %s", soft, hard, exc)
        _nofile_raised = True
        return soft, hard


def _open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return _FD_RESERVE


def effective_max_connections(limits: ServerLimits) -> int:
    """``limits.max_connections``, lowered to half the descriptors left under the soft limit
    (after :func:`raise_nofile_limit`) but never below 8 on that account."""
    soft, _ = raise_nofile_limit()
    spare = (soft - _open_fds() - _FD_RESERVE) // 2
    return min(limits.max_connections, max(_MIN_CONNECTIONS, spare))


@dataclass
class _Channel:
    token: bytes
    peer: dict[str, Any]


@dataclass(eq=False)
class _Conn:
    """One accepted connection (listener thread only)."""

    ident: bytes
    sock: socket.socket
    addr: str
    since: float
    reader: MessageReader
    last: float = 0.0
    out: bytearray = field(default_factory=bytearray)
    channel: _Channel | None = None
    writing: bool = False
    vouched: bool = False  # the engine granted this channel something (never evicted)


class _Admission:
    """Connections by peer and by state, the caps, and who is evicted (listener thread only).

    ``pending`` holds connections without a channel in accept order (the handshake timer's and
    the evictions' order); ``channels`` holds the rest in order of last traffic (the idle
    timer's order). A new connection past a cap evicts the oldest pending connection, else the
    oldest channel not vouched for (of that peer for the per-peer cap), else is refused.
    """

    def __init__(self, limits: ServerLimits, max_total: int) -> None:
        self.limits = limits
        self.max_total = max_total
        self.pending: collections.OrderedDict[bytes, _Conn] = collections.OrderedDict()
        self.channels: collections.OrderedDict[bytes, _Conn] = collections.OrderedDict()
        self.by_peer: dict[str, collections.OrderedDict[bytes, _Conn]] = {}
        self.counts = dict.fromkeys(
            ("accepted", "refused", "evicted", "handshake_timeouts", "idle_closed", "dropped"), 0
        )

    def __len__(self) -> int:
        return len(self.pending) + len(self.channels)

    def get(self, ident: bytes) -> _Conn | None:
        return self.channels.get(ident) or self.pending.get(ident)

    def victim(self, addr: str) -> tuple[_Conn | None, bool]:
        """Whom a new connection from ``addr`` evicts: ``(connection or None, admit)``."""
        peer = self.by_peer.get(addr)
        if peer is not None and len(peer) >= self.limits.max_connections_per_peer:
            oldest = next((c for c in peer.values() if c.channel is None), None)
            if oldest is None:
                oldest = next((c for c in peer.values() if not c.vouched), None)
            return oldest, oldest is not None
        if len(self) >= self.max_total:
            oldest = next(iter(self.pending.values()), None)
            if oldest is None:
                oldest = next((c for c in self.channels.values() if not c.vouched), None)
            return oldest, oldest is not None
        return None, True

    def add(self, conn: _Conn) -> None:
        self.pending[conn.ident] = conn
        self.by_peer.setdefault(conn.addr, collections.OrderedDict())[conn.ident] = conn
        self.counts["accepted"] += 1

    def promote(self, conn: _Conn) -> None:
        """``conn`` completed its hello: a channel from now on."""
        if self.pending.pop(conn.ident, None) is not None:
            self.channels[conn.ident] = conn

    def touch(self, conn: _Conn, now: float) -> None:
        conn.last = now
        if conn.channel is not None and conn.ident in self.channels:
            self.channels.move_to_end(conn.ident)

    def remove(self, conn: _Conn) -> bool:
        found = self.pending.pop(conn.ident, None) or self.channels.pop(conn.ident, None)
        peer = self.by_peer.get(conn.addr)
        if peer is not None:
            peer.pop(conn.ident, None)
            if not peer:
                del self.by_peer[conn.addr]
        return found is not None

    def expired(self, now: float) -> list[tuple[_Conn, str]]:
        """Connections past the handshake or the idle timeout, with the counter to charge."""
        out: list[tuple[_Conn, str]] = []
        for conn in self.pending.values():
            if conn.since + self.limits.handshake_timeout_s > now:
                break
            out.append((conn, "handshake_timeouts"))
        for conn in self.channels.values():
            if conn.last + self.limits.idle_timeout_s > now:
                break
            out.append((conn, "idle_closed"))
        return out

    def next_expiry(self) -> float:
        first_pending = next(iter(self.pending.values()), None)
        first_channel = next(iter(self.channels.values()), None)
        when = math.inf
        if first_pending is not None:
            when = first_pending.since + self.limits.handshake_timeout_s
        if first_channel is not None:
            when = min(when, first_channel.last + self.limits.idle_timeout_s)
        return when


class ControlServer:
    """A TCP control port served by one listener thread.

    ``handler`` runs on the listener thread for every valid request on an established channel
    (except ``ping``, answered here) and must not block; it answers through :meth:`reply` /
    :meth:`answer` (any thread). ``tick`` (optional) runs after every loop turn and returns the
    seconds until it wants to run again (long-poll expiries, TTL sweeps). Construction binds the
    port or raises :class:`~omnikv.errors.ConnectorUnavailableError`, leaving nothing open.
    """

    def __init__(
        self,
        codec: ControlCodec,
        address: Endpoint,
        handler: Handler,
        *,
        tick: Tick | None = None,
        name: str = "omnikv-control",
        limits: ServerLimits | None = None,
    ) -> None:
        self._codec = codec
        self._handler = handler
        self._tick = tick
        self._name = name
        self.limits = limits or ServerLimits()
        self._admission = _Admission(self.limits, effective_max_connections(self.limits))
        self._outbox: collections.deque[tuple[bytes, bytes]] = collections.deque()
        self._stop = threading.Event()
        self._wake_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._next_id = 0
        self._accept_paused_until = 0.0
        self.rejected = 0
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        try:
            self._listener = self._bind(address)
        except BaseException:
            self._close_base()
            raise
        for sock in (self._wake_r, self._wake_w):
            sock.setblocking(False)
        self._sel.register(self._listener, selectors.EVENT_READ, _LISTENER)
        self._sel.register(self._wake_r, selectors.EVENT_READ, _WAKE)
        logger.debug(
            "%s on %s:%d: at most %d connections, %d per peer",
            name,
            address[0],
            address[1],
            self._admission.max_total,
            self.limits.max_connections_per_peer,
        )

    @staticmethod
    def _bind(address: Endpoint) -> socket.socket:
        host, port = address
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            sock = socket.create_server((host.strip("[]"), port), family=family, backlog=1024)
        except OSError as exc:
            raise ConnectorUnavailableError(
                f"cannot bind the control port {host}:{port}: {exc}"
            ) from exc
        sock.setblocking(False)
        return sock

    # -- any thread --------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._listen, name=f"{self._name}-listener", daemon=True
        )
        self._thread.start()

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    def wake(self) -> None:
        """Make the listener run a loop turn now (e.g. after a put, for long-polls)."""
        with self._wake_lock, contextlib.suppress(OSError):
            self._wake_w.send(b"\0")

    def reply(self, ident: bytes, request_nonce: bytes, msg: Mapping[str, Any]) -> None:
        """Queue the answer to a request (thread-safe; sent by the listener, dropped when the
        connection is gone by then)."""
        _, frames = self._codec.encode(msg, reply_to=request_nonce)
        self._outbox.append((ident, pack_message(frames)))
        self.wake()

    def answer(self, req: Request, msg: Mapping[str, Any]) -> None:
        self.reply(req.ident, req.nonce, msg)

    def vouch(self, ident: bytes) -> None:
        """The engine granted the channel ``ident`` (a :class:`Request`'s) something only a
        genuine peer gets (a pull or lease of a published key, the size of one): a new
        connection never evicts it from now on (any thread; a flag set on the connection)."""
        conn = self._admission.channels.get(ident)
        if conn is not None:
            conn.vouched = True

    def has_channel(self, ident: bytes) -> bool:
        """Whether the connection ``ident`` (a :class:`Request`'s) still holds its channel
        (any thread: one dictionary look-up)."""
        return ident in self._admission.channels

    def stats(self) -> dict[str, int]:
        """Connection counts for ``health()`` (read without a lock: a snapshot, maybe torn)."""
        adm = self._admission
        c = adm.counts
        return {
            "connections": len(adm),
            "channels": len(adm.channels),
            "max_connections": adm.max_total,
            "accepted_connections": c["accepted"],
            "refused_connections": c["refused"],
            "evicted_connections": c["evicted"],
            "handshake_timeouts": c["handshake_timeouts"],
            "idle_closed": c["idle_closed"],
            "dropped_connections": c["dropped"],
        }

    def close(self, timeout: float = 5.0) -> None:
        """Stop and join the listener, then close every socket. Idempotent."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            self.wake()
            thread.join(timeout=timeout)
            if thread.is_alive():
                logger.error("%s listener did not stop within %.1fs", self._name, timeout)
                return
        adm = self._admission
        for conn in [*adm.pending.values(), *adm.channels.values()]:
            self._drop(conn, None)
        self._close_base()

    def _close_base(self) -> None:
        with self._wake_lock:
            for sock in (getattr(self, "_listener", None), self._wake_r, self._wake_w):
                if sock is not None:
                    with contextlib.suppress(OSError, KeyError, ValueError):
                        self._sel.unregister(sock)
                    sock.close()
            self._sel.close()

    # -- listener thread ---------------------------------------------------------------------------
    def _listen(self) -> None:
        timeout = 1.0
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                wait = min(timeout, 1.0, self._admission.next_expiry() - now)
                for key, mask in self._sel.select(max(0.0, wait)):
                    self._dispatch(key, mask)
                self._expire()
                self._resume_accepting()
                timeout = self._tick() if self._tick is not None else 1.0
                self._flush_outbox()
        except Exception:
            logger.exception("%s listener failed", self._name)

    def _dispatch(self, key: selectors.SelectorKey, mask: int) -> None:
        if key.data is _LISTENER:
            self._accept_batch()
        elif key.data is _WAKE:
            with contextlib.suppress(OSError):
                while self._wake_r.recv(4096):
                    pass
        else:
            conn: _Conn = key.data
            if mask & selectors.EVENT_READ:
                self._read(conn)
            if mask & selectors.EVENT_WRITE and self._admission.get(conn.ident) is conn:
                self._send(conn)

    def _accept_batch(self) -> None:
        for _ in range(_ACCEPT_BATCH):
            try:
                sock, addr = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE):
                    self._out_of_descriptors(exc)
                    return
                continue  # ECONNABORTED and friends: that peer is gone already
            self._admit(sock, str(addr[0]))

    def _out_of_descriptors(self, exc: OSError) -> None:
        adm = self._admission
        oldest = next(iter(adm.pending.values()), None)
        if oldest is not None:
            self._drop(oldest, "evicted")
            return
        _outsider.warning("%s cannot accept: %s; pausing accepts", self._name, exc)
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(self._listener)
        self._accept_paused_until = time.monotonic() + _ACCEPT_PAUSE_S

    def _resume_accepting(self) -> None:
        if self._accept_paused_until and time.monotonic() >= self._accept_paused_until:
            self._accept_paused_until = 0.0
            self._sel.register(self._listener, selectors.EVENT_READ, _LISTENER)

    def _admit(self, sock: socket.socket, addr: str) -> None:
        adm = self._admission
        victim, admit = adm.victim(addr)
        if not admit:
            adm.counts["refused"] += 1
            self._count_loud("refused", "refused a connection from %s (at its cap)", addr)
            _reset(sock)
            return
        if victim is not None:
            self._drop(victim, "evicted")
        now = time.monotonic()
        self._next_id += 1
        conn = _Conn(
            self._next_id.to_bytes(8, "big"),
            sock,
            addr,
            now,
            MessageReader(self._codec.max_message_bytes),
            last=now,
        )
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            set_keepalive(sock, self.limits.heartbeat_s)
            self._sel.register(sock, selectors.EVENT_READ, conn)
        except (OSError, ValueError):
            sock.close()
            return
        adm.add(conn)

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(_RECV_BYTES)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._drop(conn, None)
            return
        self._admission.touch(conn, time.monotonic())
        conn.reader.feed(data)
        while self._admission.get(conn.ident) is conn:
            try:
                frames = conn.reader.next()
            except ProtocolError as exc:
                self._reject(str(exc))
                self._drop(conn, "dropped")
                return
            if frames is None:
                return
            self._handle(conn, frames)

    def _handle(self, conn: _Conn, frames: list[bytes]) -> None:
        try:
            msg = self._codec.decode_request(frames)
        except ProtocolError as exc:
            self._reject(str(exc))
            if conn.channel is None:  # an unauthenticated peer gets one try
                self._drop(conn, "dropped")
            return
        if msg["op"] == "hello":
            token = os.urandom(TOKEN_BYTES)
            conn.channel = _Channel(token, dict(msg["peer"]))
            self._admission.promote(conn)
            self.reply(conn.ident, msg["n"], {"op": "welcome", "tok": token})
            return
        chan, tok = conn.channel, msg.get("tok")
        if chan is None or not isinstance(tok, bytes) or not hmac.compare_digest(tok, chan.token):
            self._reject(f"{msg['op']} outside an established channel")
            if chan is None:
                self._drop(conn, "dropped")
            return
        if msg["op"] == "ping":
            self.reply(conn.ident, msg["n"], {"op": "pong"})
            return
        self._handler(Request(conn.ident, msg["op"], msg, chan.peer))

    def _flush_outbox(self) -> None:
        adm = self._admission
        while self._outbox:
            ident, data = self._outbox.popleft()
            conn = adm.get(ident)
            if conn is None:
                continue
            conn.out += data
            if not conn.writing:
                self._send(conn)

    def _send(self, conn: _Conn) -> None:
        try:
            sent = conn.sock.send(conn.out)
        except BlockingIOError:
            sent = 0
        except OSError:
            self._drop(conn, None)
            return
        del conn.out[:sent]
        if sent:
            self._admission.touch(conn, time.monotonic())
        backlog = len(conn.out)
        if backlog > 4 * (self._codec.max_message_bytes + 64) + (1 << 20):
            _outsider.warning("%s: %s does not read its replies; closing", self._name, conn.addr)
            self._drop(conn, "dropped")
            return
        want = selectors.EVENT_READ | (selectors.EVENT_WRITE if backlog else 0)
        if conn.writing != bool(backlog):
            conn.writing = bool(backlog)
            self._sel.modify(conn.sock, want, conn)

    def _expire(self) -> None:
        for conn, counter in self._admission.expired(time.monotonic()):
            logger.debug("%s: closing %s (%s)", self._name, conn.addr, counter)
            self._drop(conn, counter)

    def _drop(self, conn: _Conn, counter: str | None) -> None:
        """Forget ``conn`` and close its socket (reset when it never became a channel)."""
        adm = self._admission
        if not adm.remove(conn):
            return
        if counter is not None:
            adm.counts[counter] += 1
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(conn.sock)
        if conn.channel is None:
            _reset(conn.sock)
        else:
            conn.sock.close()

    def _count_loud(self, kind: str, fmt: str, *args: Any) -> None:
        n = self._admission.counts[kind]
        _refusals.warning("%s " + fmt + " (%d so far)", self._name, *args, n)

    def _reject(self, why: str) -> None:
        self.rejected += 1
        _rejections.warning(
            "%s rejected a control message (%d so far): %s", self._name, self.rejected, why
        )


def _reset(sock: socket.socket) -> None:
    """Close with a reset (no TIME_WAIT on this side, the peer learns at once)."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()
