"""The peer mesh of :mod:`omnikv.connectors.shm.connector`: one connection per pair of connectors.

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

Who reads. One I/O thread serves the listener and the links, except while a thread blocked
for a message serves them itself (the leader; the I/O thread parks meanwhile): that is the mesh's
:class:`~omnikv.connectors.shm.leadership.Leadership` (``leadership``), which calls back
:meth:`Mesh.accept` and :meth:`Mesh.read`. A thread about to publish (a put) first reads what
its peers already sent, without blocking (:meth:`Mesh.pump`), so a ``want`` that arrived while
it was busy is answered by the put itself instead of waiting for the I/O thread to get the
interpreter lock. Likewise a receiver about to ask its peers once (a non-blocking get, a probe)
first accepts the connections already waiting (:meth:`Mesh.accept_waiting`). Every read is
non-blocking and holds the link's ``read_lock``, so one link's frames are decoded and
dispatched in order by one thread at a time, whoever that is.

The *local* link stands for this connector itself: messages "sent" on it are dispatched at once
in the sending thread, so a stage that puts and gets on one instance uses the same protocol.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import threading
import time
from collections import deque
from typing import Any, Protocol

import msgpack

from omnikv._logging import RateLimitedLog
from omnikv.connectors.counters import Counters
from omnikv.connectors.shm.leadership import Leadership
from omnikv.connectors.shm.pool import PeerPool
from omnikv.connectors.shm.wire import (
    DescriptorFlood,
    FrameReader,
    NamespaceLock,
    abstract,
    connect_peer,
    discover,
    encode_frame,
    peer_uid,
    recv_nowait,
)

__all__ = ["COUNTER_NAMES", "MAX_FDS_PER_LINK", "Link", "Mesh", "MeshHandler", "random_instance"]

logger = logging.getLogger(__name__)
_outsider = RateLimitedLog(logger)  # lines a peer, client or forger can cause

MAX_FDS_PER_LINK = 4
#: The events a mesh counts (in its connector's :class:`Counters`).
COUNTER_NAMES = ("peers_gone", "peers_refused", "peers_dropped")
_CONNECT_STEP_S = 0.2
#: The most connections :meth:`Mesh.accept_waiting` takes in one call (the listener's backlog).
_ACCEPT_WAITING = 128
#: One read's buffer (per link, reused; control frames are at most MAX_FRAME = 64 KiB).
_READ_CHUNK = 64 * 1024


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
        self.read_lock = threading.Lock()
        self._rbuf: memoryview | None = None  # made on the first read (``read_lock`` held)
        self.fds: deque[int] = deque()
        self.fds_received = 0
        self.pool: PeerPool | None = None  # the peer's pool, mapped here
        self.sender = False  # the peer said it sends (hello) or passed its pool
        self.pool_sent = False  # our pool's descriptor was sent on this link

    def read_buffer(self) -> memoryview:
        """This link's read buffer (``read_lock`` held by the caller)."""
        if self._rbuf is None:
            self._rbuf = memoryview(bytearray(_READ_CHUNK))
        return self._rbuf

    def take_fd(self) -> int:
        if not self.fds:
            raise ValueError("pool message without a descriptor")
        return self.fds.popleft()

    def __repr__(self) -> str:
        return f"Link({self.peer})"


class MeshHandler(Protocol):
    """What a mesh hands its events to (the connector), in the thread that read them."""

    def on_message(self, link: Link, msg: list[Any]) -> None: ...
    def on_link_up(self, link: Link) -> list[list[Any]]: ...
    def on_link_gone(self, link: Link) -> None: ...


def _close_fds(fds: deque[int]) -> None:
    while fds:
        with contextlib.suppress(OSError):
            os.close(fds.popleft())


class Mesh:
    """Listener and connections of one connector (see module docstring); who serves them is
    its :attr:`leadership`.

    ``counters`` is the connector's :class:`~omnikv.connectors.counters.Counters`; the mesh
    counts ``peers_gone``, ``peers_refused`` and ``peers_dropped`` (:data:`COUNTER_NAMES`).
    """

    def __init__(
        self,
        prefix: str,
        instance: str,
        handler: MeshHandler,
        counters: Counters,
        *,
        poll_s: float = 0.0,
    ) -> None:
        self.prefix = prefix
        self.instance = instance
        self.name = prefix + instance
        self._handler = handler
        self._counters = counters
        self._lock = threading.Lock()
        self._links: set[Link] = set()
        self.local = Link(None, os.getpid(), "local")
        self._closed = False
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        #: The I/O thread and the leader that serve the sockets (``poll_s``: see there).
        self.leadership = Leadership(self, poll_s=poll_s)

    # -- joining ------------------------------------------------------------------------------
    def join(self, timeout: float) -> None:
        """Bind, connect to the namespace's peers, start the I/O thread. ``OSError`` /
        ``TimeoutError`` if the namespace cannot be joined within ``timeout`` seconds."""
        end = time.monotonic() + timeout
        try:
            with NamespaceLock(self.prefix, timeout):
                self._listener.bind(abstract(self.name))
                self._listener.listen(_ACCEPT_WAITING)
                self._listener.setblocking(False)  # two threads may race for one connection
                for name in sorted(discover(self.prefix) - {self.name}):
                    self._connect(name, max(0.0, min(_CONNECT_STEP_S, end - time.monotonic())))
        except BaseException:
            self._teardown_sockets(list(self._links))
            raise
        self.leadership.start(self._listener, self._links)

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
            self._counters.add("peers_refused")
            _outsider.warning("refused shared-memory peer %s of uid %d (pid %d)", what, uid, pid)
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

    def accept(self) -> bool:
        """Accept a peer's connection (called by the thread serving the listener, and by
        :meth:`accept_waiting`; several may race for one, and the losers return). Whether one
        was taken off the listener (trusted or not)."""
        try:
            s, _ = self._listener.accept()
        except BlockingIOError:  # another thread took it, or none is waiting
            return False
        except OSError as exc:
            logger.debug("accept failed: %s", exc)
            return False
        pid = self._trusted(s, "connection")
        if pid is None:
            return True
        link = Link(s, pid)
        s.setblocking(True)  # accepted sockets inherit nothing, but be explicit
        with self._lock:
            self._links.add(link)
        self.leadership.watch(link)
        msgs = [["hello", self.instance, os.getpid()], *self._handler.on_link_up(link)]
        self.send(link, msgs)
        return True

    def accept_waiting(self) -> None:
        """Accept, in this thread, the connections already waiting on the listener (never
        blocks; at most :data:`_ACCEPT_WAITING` of them). Called by a receiver before it lists
        the peers to ask once (a non-blocking get, a probe): a peer that connected and
        published just before is then asked too, although the thread serving the listener has
        not had a CPU since. A blocking wait needs none of this: a peer accepted later gets the
        open blocking wants with its greeting."""
        for _ in range(_ACCEPT_WAITING):
            if not self.accept():
                return

    # -- sending ------------------------------------------------------------------------------
    def links(self, *, local: bool = True) -> list[Link]:
        """The live links (with ``local``: the local link first)."""
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
        self._counters.add("peers_dropped")
        _outsider.warning("dropping shared-memory peer %s: %s", link, reason)
        with link.send_lock, contextlib.suppress(OSError):
            link.sock.shutdown(socket.SHUT_RDWR)

    # -- reading ------------------------------------------------------------------------------
    def pump(self) -> None:
        """Read and dispatch, in this thread, whatever the peers have sent already (never
        blocks; a link another thread is reading is skipped). See module docstring."""
        for link in self.links(local=False):
            if link.read_lock.acquire(blocking=False):
                try:  # one read per link: a peer that keeps sending cannot hold the put
                    self._read_once(link, pumping=True)
                finally:
                    link.read_lock.release()

    def read(self, link: Link, timeout: float | None = None) -> None:
        """Read ``link`` once (called by the thread serving it); waits for its read lock up to
        ``timeout`` (``None``: as long as another reader takes; then that reader has it, and
        the next round retries)."""
        if not link.read_lock.acquire(timeout=-1 if timeout is None else timeout):
            return
        try:
            self._read_once(link, pumping=False)
        finally:
            link.read_lock.release()

    def _read_once(self, link: Link, *, pumping: bool) -> bool:
        """One non-blocking read of ``link`` (``read_lock`` held) and the dispatch of what it
        completed; True when data was read. A pump leaves a dead link to the select loop (it
        shuts the socket down, so the loop sees EOF) instead of unregistering it itself."""
        assert link.sock is not None
        if not link.alive:
            return False
        try:
            buf = link.read_buffer()
            nbytes, fds = recv_nowait(link.sock, buf, MAX_FDS_PER_LINK)
        except BlockingIOError:
            return False
        except DescriptorFlood as exc:
            self.drop(link, str(exc))
            return False
        except OSError as exc:
            logger.debug("read from %s failed: %s", link, exc)
            if pumping:
                with contextlib.suppress(OSError):
                    link.sock.shutdown(socket.SHUT_RDWR)
            else:
                self._gone(link)
            return False
        link.fds.extend(fds)
        link.fds_received += len(fds)
        if link.fds_received > MAX_FDS_PER_LINK:
            _close_fds(link.fds)
            self.drop(link, f"sent more than {MAX_FDS_PER_LINK} descriptors")
            return False
        if not nbytes:
            if not pumping:
                self._gone(link)
            return False
        return self._dispatch(link, buf[:nbytes])

    def _dispatch(self, link: Link, data: memoryview) -> bool:
        """Decode and hand on what ``data`` completed (``read_lock`` held); False when the link
        was dropped for it."""
        try:
            for msg in link.reader.feed(data):
                if link.alive and not link.dropped:
                    self._handler.on_message(link, msg)
        except (ValueError, TypeError, IndexError, KeyError, msgpack.ExtraData) as exc:
            self.drop(link, f"protocol error: {exc}")
            return False
        except Exception as exc:  # a handler failed on a valid message: this link only
            _outsider.exception("handling a message from %s failed", link)
            self.drop(link, f"handler error: {type(exc).__name__}: {exc}")
            return False
        return True

    def _gone(self, link: Link) -> None:
        """A peer closed, died or was dropped: forget it and let the handler reclaim."""
        with link.send_lock:
            link.alive = False
        with self._lock:
            if link not in self._links:
                return
            self._links.discard(link)
        self._counters.add("peers_gone")
        try:
            self._handler.on_link_gone(link)
            logger.debug("shared-memory peer %s gone", link)
        finally:  # whatever the handler did, the dead socket is no longer served
            self.leadership.unwatch(link)
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
        """Stop the I/O thread (and the leader's serving), close every connection and the
        listener. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.leadership.stop()
        with self._lock:
            links = list(self._links)
            self._links.clear()
        self._teardown_sockets(links)
        if self.local.pool is not None:
            self.local.pool.close()
        with contextlib.suppress(OSError):
            self._listener.close()
        self.leadership.close()


def random_instance() -> str:
    """A listener suffix another user cannot guess in advance."""
    return f"{os.getpid()}-{secrets.token_hex(6)}"
