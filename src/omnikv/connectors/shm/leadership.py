"""Who serves the sockets of one :class:`~omnikv.connectors.shm.mesh.Mesh`, and when.

Two kinds of thread read a mesh's listener and links, each on a ``select`` of its own with its
own wake pipe (a wake-up meant for one must not be drained by the other):

* the **I/O thread** (one per mesh), which serves them whenever nobody leads;
* the **leader**: a thread about to block for a message (a receiver's blocking wait) serves the
  sockets itself (:meth:`Leadership.wait`), so the offer it waits for is read and dispatched in
  the thread that needs it, not handed over by the I/O thread. It starts serving at once and
  asks the I/O thread to *park* (leave its ``select``) meanwhile; it does not wait for that,
  since the I/O thread may not get a CPU for a while on a loaded host (until it parks, both may
  wake for the same data, and each link's read lock sorts them out). One leader at a time; the
  other waiters sleep on their events and are woken by the leader's dispatch as by the I/O
  thread.

When the leader leaves, the I/O thread resumes at once if it is needed (the connector sends,
so peers' wants and releases come any time; or other threads wait); otherwise it stays parked
for :data:`LINGER_S` more (checking every :data:`PARK_CHECK_S`), so a stage that receives
request after request does not wake it twice per request, on the critical path, for nothing.
A thread that waits without leading lets a parked I/O thread serve again first
(:meth:`Leadership.resume`): someone must read its answer.

The leader serves in bounded rounds (:data:`ROUND_S`), so a wake-up that went astray costs at
most one round. With ``poll_s`` (the ``poll_us`` config key) its first rounds do not sleep: for
that long it polls (``select`` with no timeout, which releases the interpreter lock, then
``sched_yield``, which hands the CPU to any other runnable thread or process on it, e.g. the
sender on a one-core machine), so an offer that comes soon is seen without a wake-up; on a
virtual machine a sleeping thread's CPU halts, and waking it is slow.

The mesh's third reader, a put that first reads what its peers sent (``Mesh.pump``), never
selects and needs no leadership.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from omnikv.deadline import remaining

if TYPE_CHECKING:
    from omnikv.connectors.shm.mesh import Link, Mesh

__all__ = ["LINGER_S", "PARK_CHECK_S", "ROUND_S", "Leadership"]

logger = logging.getLogger(__name__)

#: How long the I/O thread stays parked after a leader left without waking it.
LINGER_S = 0.05
#: A parked I/O thread checks this often whether a leader left without waking it.
PARK_CHECK_S = 0.05
#: Longest single ``select`` of a leader (its wake-ups never depend on it).
ROUND_S = 0.25
#: How long closing waits for a leader to step down, and for the I/O thread to end.
_STOP_S = 5.0
_LISTEN = "listen"
_WAKE = "wake"


class Leadership:
    """The I/O thread of one mesh, its leader and its waiters (see the module docstring).

    Made and driven by its :class:`~omnikv.connectors.shm.mesh.Mesh`: :meth:`start` once
    joined, :meth:`watch` / :meth:`unwatch` as links come and go, :meth:`stop` then
    :meth:`close` when it closes; the serving threads call back only ``Mesh.accept`` and
    ``Mesh.read``. Receivers call :meth:`wait` and :meth:`wake`; any thread may call
    :meth:`resume`. Thread-safe.

    Test hooks (read-only, never needed to use a connector): :attr:`parked`,
    :attr:`has_leader`, :attr:`waiters`, :attr:`io_running`, :attr:`io_rounds`.
    """

    def __init__(self, mesh: Mesh, *, poll_s: float = 0.0) -> None:
        self._mesh = mesh
        #: ``poll_us`` (config): how long a leader polls before its rounds sleep in ``select``.
        self.poll_s = poll_s
        self._sel = selectors.DefaultSelector()  # the I/O thread's
        self._lsel = selectors.DefaultSelector()  # the leader's
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._lwake_r, self._lwake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._wake_lock = threading.Lock()
        self._thread = threading.Thread(target=self._io_loop, name="omnikv-shm-io", daemon=True)
        self._cond = threading.Condition(threading.Lock())
        # guarded by ``_cond``
        self._leader: int | None = None  # the leading thread's ident
        self._leader_event: threading.Event | None = None  # what wakes it (see wake)
        self._parked = False  # the I/O thread is out of ``select`` for a leader
        self._lead_end = 0.0  # when the last leader left without waking the I/O thread
        self._waiters = 0  # threads in wait() that do not lead
        self._sending = False
        self._stopped = False
        self._io_rounds = 0  # written by the I/O thread only

    # -- the mesh's side ----------------------------------------------------------------------
    def start(self, listener: socket.socket, links: Iterable[Link]) -> None:
        """Serve ``listener`` and ``links`` from now on: start the I/O thread."""
        for sel, wake_r in ((self._sel, self._wake_r), (self._lsel, self._lwake_r)):
            sel.register(listener, selectors.EVENT_READ, _LISTEN)
            sel.register(wake_r, selectors.EVENT_READ, _WAKE)
        for link in links:
            self.watch(link)
        self._thread.start()

    def watch(self, link: Link) -> None:
        """Serve ``link``'s socket (both selectors)."""
        assert link.sock is not None
        for sel in (self._sel, self._lsel):
            sel.register(link.sock, selectors.EVENT_READ, link)

    def unwatch(self, link: Link) -> None:
        """Stop serving ``link``'s socket (where it still is)."""
        assert link.sock is not None
        for sel in (self._sel, self._lsel):
            with contextlib.suppress(KeyError, ValueError):
                sel.unregister(link.sock)

    def note_sending(self) -> None:
        """The connector sends from now on (it made its pool): peers' wants and releases come at
        any time, so the I/O thread resumes as soon as a leader leaves."""
        with self._cond:
            self._sending = True

    def stop(self) -> None:
        """Stop serving (the first step of closing the mesh): wake both ``select`` calls, wait
        for a leader to step down (it returns from its round at once) and for the I/O thread to
        end, each at most 5 s (an ERROR names a leader that did not). Idempotent."""
        self._stopped = True
        self._poke(io=True)
        self._poke(io=False)
        with self._cond:
            self._cond.notify_all()
            end = time.monotonic() + _STOP_S
            while self._leader not in (None, threading.get_ident()):
                left = end - time.monotonic()
                if left <= 0:
                    logger.error("a thread waiting on the shared-memory mesh did not stop")
                    break
                self._cond.wait(left)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=_STOP_S)

    def close(self) -> None:
        """After :meth:`stop` and the links' teardown: close the selectors and wake pipes."""
        for sel in (self._sel, self._lsel):
            with contextlib.suppress(OSError, ValueError):
                sel.close()
        with self._wake_lock:
            fds = (self._wake_r, self._wake_w, self._lwake_r, self._lwake_w)
            self._wake_r = self._wake_w = self._lwake_r = self._lwake_w = -1
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)

    # -- the I/O thread -----------------------------------------------------------------------
    def _io_loop(self) -> None:
        while not self._stopped:
            with self._cond:
                self._park()
            if self._stopped:
                break
            try:
                self._io_rounds += 1
                self._serve(self._sel, self._wake_r, None)
            except (OSError, ValueError):
                if self._stopped:
                    break
                raise

    def _park(self) -> None:
        """(``_cond`` held, I/O thread) Stay out of ``select`` while a thread leads, and for
        :data:`LINGER_S` after a leader left without waking us."""
        while not self._stopped:
            if self._leader is not None:
                wait = PARK_CHECK_S  # the leader may leave without waking us
            else:
                wait = self._lead_end + LINGER_S - time.monotonic()
                if wait <= 0:
                    break
            self._parked = True
            self._cond.notify_all()
            self._cond.wait(wait)
        self._parked = False

    def resume(self) -> None:
        """Let a parked I/O thread serve again now, unless a thread leads (called by a thread
        about to wait without leading: someone must read its answer)."""
        with self._cond:
            if self._leader is None and self._parked:
                self._lead_end = 0.0
                self._cond.notify_all()

    def resumes_io_at_once(self) -> bool:
        """Whether the I/O thread serves again as soon as a leader leaves (the connector sends,
        or other threads wait), rather than lingering parked for :data:`LINGER_S`."""
        with self._cond:
            return self._sending or self._waiters > 0

    # -- serving ------------------------------------------------------------------------------
    def _serve(self, sel: selectors.BaseSelector, wake_r: int, timeout: float | None) -> None:
        """One ``select`` on ``sel`` (up to ``timeout``) and the dispatch of what it found. A
        link another thread is reading is waited for at most ``timeout``."""
        if self._stopped:
            return
        for key, _mask in sel.select(timeout):
            if key.data == _WAKE:
                with contextlib.suppress(OSError):
                    while os.read(wake_r, 4096):
                        pass
            elif key.data == _LISTEN:
                self._mesh.accept()
            else:
                self._mesh.read(key.data, timeout)

    def serve(self, timeout: float) -> None:
        """One round of the leader: a ``select`` on its own selector (up to ``timeout``
        seconds) and the dispatch of what it found. Called by :meth:`wait` for the thread that
        leads; returns at once once stopping."""
        self._serve(self._lsel, self._lwake_r, timeout)

    def _poke(self, *, io: bool) -> None:
        """Write the wake pipe of the I/O thread (``io``) or of the leader."""
        with self._wake_lock, contextlib.suppress(OSError):
            fd = self._wake_w if io else self._lwake_w
            if fd >= 0:  # -1 once closed: never a descriptor reused meanwhile
                os.write(fd, b"\0")

    # -- leading and waiting ------------------------------------------------------------------
    @contextlib.contextmanager
    def lead(self, event: threading.Event | None = None) -> Iterator[bool]:
        """Serve the sockets in this thread for the duration (yields True: call :meth:`serve`
        until done), or yield False when another thread leads, the mesh is stopping or the I/O
        thread is not running (the caller then waits to be woken as usual). ``event`` is what
        :meth:`wake` is given for this thread. Entering asks the I/O thread to park (it leaves
        its ``select`` when it next runs; nobody waits for that); leaving lets it resume, at
        once or after :data:`LINGER_S` (see :meth:`resumes_io_at_once`).

        :meth:`wait` leads for a blocking receive; a test may lead without serving, to keep
        the sockets unread."""
        with self._cond:
            ok = self._leader is None and not self._stopped and self._thread.is_alive()
            if ok:
                self._leader = threading.get_ident()
                self._leader_event = event
                poke = not self._parked  # a parked I/O thread is not in select: no wake needed
        if not ok:
            yield False
            return
        try:
            if poke:
                self._poke(io=True)
            yield not self._stopped
        finally:
            with self._cond:
                at_once = self._stopped or self._sending or self._waiters > 0
                self._leader = None
                self._leader_event = None
                self._lead_end = 0.0 if at_once else time.monotonic()
                if at_once:
                    self._cond.notify_all()

    def leading(self) -> bool:
        """Whether the calling thread is the leader."""
        return self._leader == threading.get_ident()

    def wait(
        self,
        answered: Callable[[], bool],
        event: threading.Event,
        deadline: float,
        *,
        lead: bool,
        check_every_s: float | None = None,
    ) -> None:
        """Block the calling thread until ``answered()`` or ``deadline`` (or the mesh stops).

        Called by a receiver for every message it waits for (an offer, peers' answers), after
        its request went out; whoever dispatches the answer calls :meth:`wake` with ``event``.
        With ``lead`` (a blocking receive) the thread leads when it can and serves the sockets
        in rounds until answered; otherwise, or when another thread leads, it counts among
        :attr:`waiters`, lets the I/O thread serve (:meth:`resume`) and sleeps on ``event``.
        ``check_every_s``: call ``answered()`` at least that often even when nothing wakes the
        thread (an abortable receive: nobody wakes it when its abort event is set).
        Raises what a leader's ``select`` raises, unless answered or stopping meanwhile.
        """
        if lead and not answered():
            with self.lead(event) as leading:
                if leading:
                    self._serve_until(answered, deadline, check_every_s or ROUND_S)
                    return
        with self._cond:
            self._waiters += 1
        try:
            self.resume()
            while not answered():
                left = remaining(deadline)
                if left <= 0:
                    return
                event.wait(min(left, check_every_s or 3600.0))
                event.clear()
        finally:
            with self._cond:
                self._waiters -= 1

    def _serve_until(self, answered: Callable[[], bool], deadline: float, round_s: float) -> None:
        """The leader's rounds until ``answered()`` or ``deadline``: polling for ``poll_s``,
        then sleeping in ``select`` at most ``round_s`` (:data:`ROUND_S` at most) per round
        (module docstring)."""
        poll_until = time.monotonic() + self.poll_s if self.poll_s else 0.0
        round_s = min(round_s, ROUND_S)
        while not answered() and not self._stopped:
            left = remaining(deadline)
            if left <= 0:
                return
            polling = poll_until and time.monotonic() < poll_until
            try:
                self.serve(0.0 if polling else min(left, round_s))
                if polling:
                    os.sched_yield()
            except (OSError, ValueError):
                if self._stopped or answered():
                    return
                raise

    def wake(self, event: threading.Event) -> None:
        """Wake the thread waiting on ``event`` (its answer came): set it, and when that thread
        leads and sits in ``select`` (this is not that thread, dispatching its own answer),
        write the leader's wake pipe. Any thread; never blocks."""
        event.set()
        if event is self._leader_event and self._leader != threading.get_ident():
            self._poke(io=False)

    # -- test hooks ---------------------------------------------------------------------------
    @property
    def parked(self) -> bool:
        """Whether the I/O thread is parked (out of ``select``) for a leader or lingering."""
        return self._parked

    @property
    def has_leader(self) -> bool:
        """Whether a thread leads now."""
        return self._leader is not None

    @property
    def waiters(self) -> int:
        """Threads in :meth:`wait` that do not lead."""
        return self._waiters

    @property
    def io_running(self) -> bool:
        """Whether the I/O thread runs (from :meth:`start` until :meth:`stop`)."""
        return self._thread.is_alive()

    @property
    def io_rounds(self) -> int:
        """How many ``select`` rounds the I/O thread has begun (a parked one begins none)."""
        return self._io_rounds
