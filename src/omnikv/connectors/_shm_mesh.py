"""The peer mesh of :mod:`omnikv.connectors.shm`: one connection per pair of connectors.

Every connector binds a listening socket in the Linux *abstract* Unix namespace under its
namespace prefix with a random suffix, and connects to the peers of its namespace that already
exist (listed from ``/proc/net/unix``) while holding the namespace lock, so every pair of peers
shares exactly one connection. Connects are non-blocking and bounded (a squatting listener with a
full backlog is skipped); the peer's uid is checked with ``SO_PEERCRED`` before anything is sent
or read, on both sides. One I/O thread serves accepts and reads and hands each decoded message
to the handler (the connector).

Per connection, at most :data:`MAX_FDS_PER_LINK` descriptors may ever be received (a pool is
one); a peer over that bound, or sending garbage, is disconnected and logged. The handler bounds
its own per-link state the same way (:meth:`Mesh.drop`).

The *local* link stands for this connector itself: messages "sent" on it are dispatched at once
in the sending thread, so a stage that puts and gets on one instance uses the same protocol.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import selectors
import socket
import threading
import time
from collections import deque
from typing import Any, Protocol

import msgpack

from omnikv.connectors._shm_pool import PeerPool
from omnikv.connectors._shm_wire import (
    FrameReader,
    NamespaceLock,
    abstract,
    connect_peer,
    discover,
    encode_frame,
    peer_uid,
)

__all__ = ["MAX_FDS_PER_LINK", "Link", "Mesh", "MeshHandler"]

logger = logging.getLogger(__name__)

MAX_FDS_PER_LINK = 4
_CONNECT_STEP_S = 0.2
_READ_CHUNK = 256 * 1024


class Link:
    """One connection to a peer connector (either direction), or the local pseudo-link."""

    def __init__(self, sock: socket.socket | None, pid: int, peer: str = "") -> None:
        self.sock = sock
        self.pid = pid
        self.peer = peer or f"pid {pid}"
        self.alive = True
        self.dropped = False
        self.local = sock is None
        self.send_lock = threading.RLock()
        self.reader = FrameReader()
        self.fds: deque[int] = deque()
        self.fds_received = 0
        self.pool: PeerPool | None = None  # the peer's pool, mapped here
        self.pool_sent = False  # our pool's descriptor was sent on this link

    def take_fd(self) -> int:
        if not self.fds:
            raise ValueError("pool message without a descriptor")
        return self.fds.popleft()

    def __repr__(self) -> str:
        return f"Link({self.peer})"


class MeshHandler(Protocol):
    def on_message(self, link: Link, msg: list[Any]) -> None: ...
    def on_link_up(self, link: Link) -> list[list[Any]]: ...
    def on_link_gone(self, link: Link) -> None: ...


def _close_fds(fds: deque[int]) -> None:
    while fds:
        with contextlib.suppress(OSError):
            os.close(fds.popleft())


class Mesh:
    """Listener, connections and the I/O thread of one connector (see module docstring)."""

    def __init__(self, prefix: str, instance: str, handler: MeshHandler) -> None:
        self.prefix = prefix
        self.instance = instance
        self.name = prefix + instance
        self._handler = handler
        self._lock = threading.Lock()
        self._links: set[Link] = set()
        self.local = Link(None, os.getpid(), "local")
        self.counters = {"peers_gone": 0, "peers_refused": 0, "peers_dropped": 0}
        self._stop = False
        self._sel = selectors.DefaultSelector()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._thread = threading.Thread(target=self._io_loop, name="omnikv-shm-io", daemon=True)

    # -- joining ------------------------------------------------------------------------------
    def join(self, timeout: float) -> None:
        """Bind, connect to the namespace's peers, start the I/O thread. ``OSError`` /
        ``TimeoutError`` if the namespace cannot be joined within ``timeout`` seconds."""
        end = time.monotonic() + timeout
        try:
            with NamespaceLock(self.prefix, timeout):
                self._listener.bind(abstract(self.name))
                self._listener.listen(128)
                for name in sorted(discover(self.prefix) - {self.name}):
                    self._connect(name, max(0.0, min(_CONNECT_STEP_S, end - time.monotonic())))
        except BaseException:
            self._teardown_sockets(list(self._links))
            raise
        self._sel.register(self._listener, selectors.EVENT_READ, "listen")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        for link in self._links:
            assert link.sock is not None
            self._sel.register(link.sock, selectors.EVENT_READ, link)
        self._thread.start()

    def _trusted(self, s: socket.socket, what: str) -> int | None:
        """The peer's pid if it runs as our uid; otherwise close ``s``, count, log, ``None``."""
        try:
            pid, uid = peer_uid(s)
        except OSError as exc:
            logger.debug("no credentials from %s: %s", what, exc)
            s.close()
            return None
        if uid != os.getuid():
            s.close()
            with self._lock:
                self.counters["peers_refused"] += 1
            logger.warning("refused shared-memory peer %s of uid %d (pid %d)", what, uid, pid)
            return None
        return pid

    def _connect(self, name: str, timeout: float) -> None:
        s = connect_peer(name, timeout)
        if s is None:
            logger.debug("peer %s not reachable in %.3fs; skipped", name, timeout)
            return
        pid = self._trusted(s, name)
        if pid is None:
            return
        link = Link(s, pid, name.rsplit("/", 1)[-1])
        self._links.add(link)
        self.send(link, [["hello", self.instance, os.getpid()]])

    def _accept(self) -> None:
        try:
            s, _ = self._listener.accept()
        except OSError as exc:
            logger.debug("accept failed: %s", exc)
            return
        pid = self._trusted(s, "connection")
        if pid is None:
            return
        link = Link(s, pid)
        with self._lock:
            self._links.add(link)
        self._sel.register(s, selectors.EVENT_READ, link)
        msgs = [["hello", self.instance, os.getpid()], *self._handler.on_link_up(link)]
        self.send(link, msgs)

    # -- sending ------------------------------------------------------------------------------
    def links(self, *, local: bool = True) -> list[Link]:
        with self._lock:
            out = [link for link in self._links if link.alive]
        return [self.local, *out] if local else out

    def send(
        self, link: Link, msgs: list[list[Any]], pool: tuple[int, int, int] | None = None
    ) -> bool:
        """Send ``msgs`` on ``link`` (``pool`` = (id, size, fd) first, once per link). False if
        the link is dead. Never called with the handler's locks held. A failure shuts the socket
        down, so the I/O thread sees EOF and does the peer-gone bookkeeping."""
        if link.local:
            for msg in msgs:
                self._handler.on_message(link, msg)
            return True
        data = b"".join(encode_frame(m) for m in msgs)
        with link.send_lock:
            if not link.alive or link.sock is None:
                return False
            try:
                if pool is not None and not link.pool_sent:
                    frame = encode_frame(["pool", pool[0], pool[1]])
                    sent = socket.send_fds(link.sock, [frame], [pool[2]])
                    if sent != len(frame):
                        link.sock.sendall(frame[sent:])
                    link.pool_sent = True
                link.sock.sendall(data)
                return True
            except OSError as exc:
                logger.debug("send to %s failed: %s", link, exc)
                with contextlib.suppress(OSError):
                    link.sock.shutdown(socket.SHUT_RDWR)
                return False

    def drop(self, link: Link, reason: str) -> None:
        """Disconnect a misbehaving peer (logged); the I/O thread then reclaims its state."""
        if link.local or link.sock is None:
            return
        with self._lock:
            if link.dropped:
                return
            link.dropped = True
            self.counters["peers_dropped"] += 1
        logger.warning("dropping shared-memory peer %s: %s", link, reason)
        with link.send_lock, contextlib.suppress(OSError):
            link.sock.shutdown(socket.SHUT_RDWR)

    # -- I/O thread ---------------------------------------------------------------------------
    def _io_loop(self) -> None:
        while not self._stop:
            try:
                events = self._sel.select()
            except (OSError, ValueError):
                if self._stop:
                    break
                raise
            for key, _mask in events:
                if key.data == "wake":
                    with contextlib.suppress(OSError):
                        while os.read(self._wake_r, 4096):
                            pass
                elif key.data == "listen":
                    self._accept()
                else:
                    self._read(key.data)

    def _read(self, link: Link) -> None:
        assert link.sock is not None
        try:
            data, fds, _flags, _addr = socket.recv_fds(link.sock, _READ_CHUNK, MAX_FDS_PER_LINK)
        except OSError as exc:
            logger.debug("read from %s failed: %s", link, exc)
            self._gone(link)
            return
        link.fds.extend(fds)
        link.fds_received += len(fds)
        if link.fds_received > MAX_FDS_PER_LINK:
            _close_fds(link.fds)
            self.drop(link, f"sent more than {MAX_FDS_PER_LINK} descriptors")
            return
        if not data:
            self._gone(link)
            return
        try:
            for msg in link.reader.feed(data):
                if link.alive and not link.dropped:
                    self._handler.on_message(link, msg)
        except (ValueError, TypeError, IndexError, KeyError, msgpack.ExtraData) as exc:
            self.drop(link, f"protocol error: {exc}")

    def _gone(self, link: Link) -> None:
        """A peer closed, died or was dropped: forget it and let the handler reclaim."""
        with link.send_lock:
            link.alive = False
        with self._lock:
            if link not in self._links:
                return
            self._links.discard(link)
            self.counters["peers_gone"] += 1
        self._handler.on_link_gone(link)
        logger.debug("shared-memory peer %s gone", link)
        assert link.sock is not None
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(link.sock)
        self._teardown_sockets([link])

    def _teardown_sockets(self, links: list[Link]) -> None:
        for link in links:
            with link.send_lock:
                link.alive = False
            if link.sock is not None:
                with contextlib.suppress(OSError):
                    link.sock.close()
            _close_fds(link.fds)
            if link.pool is not None:
                link.pool.close()

    # -- teardown -----------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the I/O thread, close every connection and the listener. Idempotent."""
        if self._stop:
            return
        self._stop = True
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"\0")
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5.0)
        with self._lock:
            links = list(self._links)
            self._links.clear()
        self._teardown_sockets(links)
        if self.local.pool is not None:
            self.local.pool.close()
        with contextlib.suppress(OSError):
            self._listener.close()
        with contextlib.suppress(OSError, ValueError):
            self._sel.close()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)


def random_instance() -> str:
    """A listener suffix another user cannot guess in advance."""
    return f"{os.getpid()}-{secrets.token_hex(6)}"
