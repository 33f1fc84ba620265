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

Who reads. The I/O thread normally blocks in ``select``; two shortcuts take a thread hop off the
latency of a request:

* :meth:`Mesh.lead`: a thread about to block for a message (a receiver's blocking wait) serves
  the sockets itself (:meth:`Mesh.serve`), so the offer it waits for is read and dispatched in
  the thread that needs it, not handed over by the I/O thread. It starts serving at once, on a
  selector of its own, and asks the I/O thread to park (leave its ``select``) meanwhile; it
  does not wait for that, since the I/O thread may not get a CPU for a while on a loaded host
  (until it parks, both may wake for the same data, and the read lock sorts them out). One
  leader at a time; other waiters are woken by the leader's dispatch as by the I/O thread.
  When the leader leaves, the I/O thread resumes at once if the handler needs it
  (``resume_io_at_once``: the connector sends, or other threads wait); otherwise it stays
  parked for :data:`LINGER_S` more (checking every :data:`PARK_CHECK_S`), so a stage that
  receives request after request does not wake it twice per request, on the critical path,
  for nothing. A thread that waits without leading calls :meth:`Mesh.resume` first.
* :meth:`Mesh.pump`: a thread about to publish (a put) first reads what its peers already sent
  (non-blocking), so a ``want`` that arrived while it was busy is answered by the put itself
  instead of waiting for the I/O thread to get the interpreter lock.

Every read is non-blocking and holds the link's ``read_lock``, so one link's frames are decoded
and dispatched in order by one thread at a time, whoever that is.

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
from collections.abc import Iterator
from typing import Any, Protocol

import msgpack

from omnikv.connectors._shm_pool import PeerPool
from omnikv.connectors._shm_wire import (
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

__all__ = ["MAX_FDS_PER_LINK", "Link", "Mesh", "MeshHandler"]

logger = logging.getLogger(__name__)

MAX_FDS_PER_LINK = 4
_CONNECT_STEP_S = 0.2
#: How long the I/O thread stays parked after a leader left without waking it.
LINGER_S = 0.05
#: A parked I/O thread checks this often whether a leader left without waking it.
PARK_CHECK_S = 0.05
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
    def on_message(self, link: Link, msg: list[Any]) -> None: ...
    def on_link_up(self, link: Link) -> list[list[Any]]: ...
    def on_link_gone(self, link: Link) -> None: ...
    def resume_io_at_once(self) -> bool: ...


def _resume_at_once(handler: MeshHandler) -> bool:
    """Whether the I/O thread must serve again as soon as a leader leaves (the handler says;
    if it cannot, yes)."""
    try:
        return bool(handler.resume_io_at_once())
    except Exception:  # a handler bug must not strand the sockets
        logger.exception("resume_io_at_once failed")
        return True


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
        # two selectors over the same sockets: the I/O thread's and the leader's, each with its
        # own wake pipe (a wake-up meant for one must not be drained by the other)
        self._sel = selectors.DefaultSelector()
        self._lsel = selectors.DefaultSelector()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._lwake_r, self._lwake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._wake_lock = threading.Lock()
        self._thread = threading.Thread(target=self._io_loop, name="omnikv-shm-io", daemon=True)
        # leadership (see module docstring): the leader's thread ident, and whether the I/O
        # thread is parked (out of ``select``) for it
        self._lead = threading.Condition(threading.Lock())
        self._leader: int | None = None
        self._parked = False
        self._lead_end = 0.0  # when the last leader left without waking the I/O thread

    # -- joining ------------------------------------------------------------------------------
    def join(self, timeout: float) -> None:
        """Bind, connect to the namespace's peers, start the I/O thread. ``OSError`` /
        ``TimeoutError`` if the namespace cannot be joined within ``timeout`` seconds."""
        end = time.monotonic() + timeout
        try:
            with NamespaceLock(self.prefix, timeout):
                self._listener.bind(abstract(self.name))
                self._listener.listen(128)
                self._listener.setblocking(False)  # two threads may race for one connection
                for name in sorted(discover(self.prefix) - {self.name}):
                    self._connect(name, max(0.0, min(_CONNECT_STEP_S, end - time.monotonic())))
        except BaseException:
            self._teardown_sockets(list(self._links))
            raise
        for sel, wake_r in ((self._sel, self._wake_r), (self._lsel, self._lwake_r)):
            sel.register(self._listener, selectors.EVENT_READ, "listen")
            sel.register(wake_r, selectors.EVENT_READ, "wake")
        for link in self._links:
            self._watch(link)
        self._thread.start()

    def _watch(self, link: Link) -> None:
        """Register a link's socket with both selectors."""
        assert link.sock is not None
        for sel in (self._sel, self._lsel):
            sel.register(link.sock, selectors.EVENT_READ, link)

    def _unwatch(self, link: Link) -> None:
        """Unregister a link's socket from both selectors (where it still is)."""
        assert link.sock is not None
        for sel in (self._sel, self._lsel):
            with contextlib.suppress(KeyError, ValueError):
                sel.unregister(link.sock)

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
        except BlockingIOError:  # the other serving thread took it
            return
        except OSError as exc:
            logger.debug("accept failed: %s", exc)
            return
        pid = self._trusted(s, "connection")
        if pid is None:
            return
        link = Link(s, pid)
        s.setblocking(True)  # accepted sockets inherit nothing, but be explicit
        with self._lock:
            self._links.add(link)
        self._watch(link)
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

    # -- I/O thread and leader -------------------------------------------------------------
    def _io_loop(self) -> None:
        while not self._stop:
            with self._lead:
                self._park()
            if self._stop:
                break
            try:
                self._serve(self._sel, self._wake_r, None)
            except (OSError, ValueError):
                if self._stop:
                    break
                raise

    def _park(self) -> None:
        """(``_lead`` held, I/O thread) Stay out of ``select`` while a thread leads, and for
        :data:`LINGER_S` after a leader left without waking us (see module docstring)."""
        while not self._stop:
            if self._leader is not None:
                wait = PARK_CHECK_S  # the leader may leave without waking us
            else:
                wait = self._lead_end + LINGER_S - time.monotonic()
                if wait <= 0:
                    break
            self._parked = True
            self._lead.notify_all()
            self._lead.wait(wait)
        self._parked = False

    def resume(self) -> None:
        """Let a parked I/O thread serve again now, unless a thread leads (called by a thread
        about to wait without leading: someone must read its answer)."""
        with self._lead:
            if self._leader is None and self._parked:
                self._lead_end = 0.0
                self._lead.notify_all()

    def serve(self, timeout: float) -> None:
        """The leader's round: one ``select`` on its own selector (up to ``timeout`` seconds)
        and the dispatch of what it found. Only the leader calls it (see :meth:`lead`); returns
        at once when the mesh is stopping. A link another thread is reading is waited for at
        most ``timeout``, so the leader's deadline holds."""
        self._serve(self._lsel, self._lwake_r, timeout)

    def _serve(self, sel: selectors.BaseSelector, wake_r: int, timeout: float | None) -> None:
        if self._stop:
            return
        for key, _mask in sel.select(timeout):
            if key.data == "wake":
                with contextlib.suppress(OSError):
                    while os.read(wake_r, 4096):
                        pass
            elif key.data == "listen":
                self._accept()
            else:
                self._read(key.data, timeout)

    def wake(self) -> None:
        """Make the leader's :meth:`serve` return (its wait ended elsewhere: an offer from
        this process, ``close``)."""
        self._poke(1)

    def _poke(self, which: int) -> None:
        """Write the wake pipe of the I/O thread (0) or of the leader (1)."""
        with self._wake_lock, contextlib.suppress(OSError):
            fd = self._wake_w if which == 0 else self._lwake_w
            if fd >= 0:  # -1 once closed: never a descriptor reused meanwhile
                os.write(fd, b"\0")

    @property
    def stopping(self) -> bool:
        """Whether :meth:`close` has begun (a leader then stops serving)."""
        return self._stop

    @contextlib.contextmanager
    def lead(self) -> Iterator[bool]:
        """Serve the sockets in this thread for the duration (yields True: call :meth:`serve`
        until done), or yield False when another thread leads, the mesh is closing or the I/O
        thread is not running (the caller then waits to be woken as usual). Entering asks the
        I/O thread to park (it leaves its ``select`` when it next runs; nobody waits for that);
        leaving lets it resume."""
        me = threading.get_ident()
        with self._lead:
            ok = self._leader is None and not self._stop and self._thread.is_alive()
            if ok:
                self._leader = me
                poke = not self._parked  # a parked I/O thread is not in select: no wake needed
        if not ok:
            yield False
            return
        try:
            if poke:
                self._poke(0)
            yield not self._stop
        finally:
            at_once = self._stop or _resume_at_once(self._handler)
            with self._lead:
                self._leader = None
                self._lead_end = 0.0 if at_once else time.monotonic()
                if at_once:
                    self._lead.notify_all()

    def leading(self) -> bool:
        """Whether the calling thread is the leader."""
        return self._leader == threading.get_ident()

    def pump(self) -> None:
        """Read and dispatch, in this thread, whatever the peers have sent already (never
        blocks; a link another thread is reading is skipped). See module docstring."""
        for link in self.links(local=False):
            if link.read_lock.acquire(blocking=False):
                try:  # one read per link: a peer that keeps sending cannot hold the put
                    self._read_once(link, pumping=True)
                finally:
                    link.read_lock.release()

    def _read(self, link: Link, timeout: float | None = None) -> None:
        """Read ``link`` once; waits for its read lock up to ``timeout`` (``None``: as long as
        another reader takes; then that reader has it, and the next round retries)."""
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
            logger.exception("handling a message from %s failed", link)
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
            self.counters["peers_gone"] += 1
        try:
            self._handler.on_link_gone(link)
            logger.debug("shared-memory peer %s gone", link)
        finally:  # whatever the handler did, the dead socket leaves the selectors
            self._unwatch(link)
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
        self._poke(0)
        self._poke(1)
        with self._lead:
            self._lead.notify_all()
            # a leader returns from serve() now; nothing below may run under its feet
            end = time.monotonic() + 5.0
            while self._leader not in (None, threading.get_ident()):
                left = end - time.monotonic()
                if left <= 0:
                    logger.error("a thread waiting on the shared-memory mesh did not stop")
                    break
                self._lead.wait(left)
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
        for sel in (self._sel, self._lsel):
            with contextlib.suppress(OSError, ValueError):
                sel.close()
        with self._wake_lock:
            fds = (self._wake_r, self._wake_w, self._lwake_r, self._lwake_w)
            self._wake_r = self._wake_w = self._lwake_r = self._lwake_w = -1
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)


def random_instance() -> str:
    """A listener suffix another user cannot guess in advance."""
    return f"{os.getpid()}-{secrets.token_hex(6)}"
