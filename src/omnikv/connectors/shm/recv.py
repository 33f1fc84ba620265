"""The receiving half of :mod:`omnikv.connectors.shm.connector`: wants, offers and the views handed
out.

A receiver sends ``want(key)`` to every peer (and to itself: the local link). The peer holding
the key answers ``offer(token, offset, size, kind)``; a blocking want stays registered at every
peer until it is answered or cancelled, so a put wakes the waiter with one message (no polling).
The caller gets a :class:`ManagedBuffer` over the mapped pool; its release (or the death of its
``adopt()`` tensors) sends ``release(token)``. An offer that arrives after the waiter gave up is
``return``-ed and the sender publishes it again. On ``evict(token)`` (the sender's pool is full)
a span still held here is moved to private memory at the same address and released at once.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omnikv.connectors.base import ABORT_POLL_S, ManagedBuffer
from omnikv.connectors.counters import Counters
from omnikv.connectors.shm.acks import ACK_FLAG
from omnikv.connectors.shm.codec import KINDS
from omnikv.connectors.shm.mesh import Link, Mesh
from omnikv.connectors.shm.pool import MappedRegion
from omnikv.errors import PeerGoneError

__all__ = ["COUNTER_NAMES", "Offer", "ProbeAnswers", "RecvSide"]

logger = logging.getLogger(__name__)

MAX_EARLY_EVICTS = 4096
#: The events a receiving side counts (in its connector's :class:`Counters`).
COUNTER_NAMES = ("gets", "get_bytes", "misses", "migrated")


@dataclass
class Offer:
    """An accepted offer; ``view`` is taken when it arrives, so it pins the mapping even if the
    sender goes away before the caller looks at it."""

    link: Link
    region: MappedRegion
    view: np.ndarray
    token: int
    offset: int
    nbytes: int
    kind: str
    acks: bool = False  # its sender takes a verdict on it (``acks``)


@dataclass
class _Want:
    """A receiver's outstanding request for a key (blocking: registered at every peer)."""

    wid: int
    key: str
    block: bool
    event: threading.Event = field(default_factory=threading.Event)
    offer: Offer | None = None
    pending: set[Link] = field(default_factory=set)  # non-blocking: peers yet to answer
    sent_to: set[Link] = field(default_factory=set)  # the links this want went out on
    senders_lost: list[str] = field(default_factory=list)
    probe: bool = False  # asks what peers hold (``probe``), never takes an offer
    answers: list[tuple[Link, Any]] = field(default_factory=list)  # a probe's answers
    gone: list[Link] = field(default_factory=list)  # a probe's peers that went away unanswered


@dataclass
class ProbeAnswers:
    """What :meth:`RecvSide.probe` gathered: each answering peer's (link, answer), and the asked
    peers whose connection ended before they answered (a process that is gone offers nothing,
    so it is not a peer that stayed silent)."""

    answers: list[tuple[Link, Any]]
    gone: list[Link]
    asked: int  # how many peers (the local link included) the probe went out to


def _answered_or_aborted(answered: Callable[[], bool], abort: threading.Event) -> bool:
    """An abortable blocking take's wait condition: its answer came, or ``abort`` is set."""
    return answered() or abort.is_set()


class RecvSide:
    """Receiver-side state of one connector; thread-safe (one lock, never held while sending).

    Its threads wait for their answers through the mesh's leadership (``Leadership.wait``);
    it counts ``gets``, ``get_bytes``, ``misses`` and ``migrated`` in ``counters``.
    """

    def __init__(self, mesh: Mesh, counters: Counters) -> None:
        self._mesh = mesh
        self._leadership = mesh.leadership
        self._counters = counters
        self._lock = threading.Lock()
        self._wants: dict[int, _Want] = {}
        self._holding: dict[tuple[Link, int], tuple[Offer, MappedRegion]] = {}
        self._early_evicts: dict[tuple[Link, int], None] = {}
        self._next_wid = 1
        self.closed = False

    def blocking_wants(self, link: Link) -> list[list[Any]]:
        """``want`` messages for ``link``, a peer that just connected: every blocking want still
        open that has not gone out on it (:meth:`take` may have sent it already, or may still
        send it: each want goes out once per link, whichever comes first)."""
        with self._lock:
            out = []
            for w in self._wants.values():
                if w.block and w.offer is None and link not in w.sent_to:
                    w.sent_to.add(link)
                    out.append(["want", w.wid, w.key, True])
            return out

    def _register(self, want: _Want) -> list[Link]:
        """Register ``want`` (under the lock), then list the links to send it on: the live ones
        it has not gone out on. In that order, a peer that connects meanwhile is reached either
        here or by :meth:`blocking_wants` (listed before it, a want would miss a peer whose
        greeting read the wants just before it was registered). A want asked once (not
        blocking) first accepts the connections waiting on the listener: no greeting reaches
        a peer accepted after it."""
        with self._lock:
            self._wants[want.wid] = want
        if not want.block:
            self._mesh.accept_waiting()
        links = self._mesh.links()
        with self._lock:
            targets = [link for link in links if link not in want.sent_to]
            want.sent_to.update(targets)
            if not want.block:
                want.pending = set(targets)
            return targets

    # -- taking -------------------------------------------------------------------------------
    def take(
        self, key: str, block: bool, deadline: float, abort: threading.Event | None = None
    ) -> Offer | None:
        """Ask every peer (and ourselves) for ``key``; the accepted offer or ``None``.

        Blocking: until an offer or ``deadline``, or until ``abort`` is set (looked at at least
        every :data:`~omnikv.connectors.base.ABORT_POLL_S`; the want stays open meanwhile, so
        an offer never crosses a slice's end); non-blocking: until every peer answered or
        ``deadline``. Raises :class:`PeerGoneError` when a sender connected during a blocking
        wait went away and nothing arrived.
        """
        with self._lock:
            want = _Want(self._next_wid, key, block)
            self._next_wid += 1
        for link in self._register(want):
            if not self._mesh.send(link, [["want", want.wid, key, block]]) and not block:
                with self._lock:
                    want.pending.discard(link)
        answered = functools.partial(self._answered, want)
        if abort is not None:
            answered = functools.partial(_answered_or_aborted, answered, abort)
        try:
            self._leadership.wait(
                answered,
                want.event,
                deadline,
                lead=block,
                check_every_s=None if abort is None else ABORT_POLL_S,
            )
        finally:
            offer = self._finish(want)
        if offer is None and want.senders_lost and not self.closed:
            lost = ", ".join(want.senders_lost)
            raise PeerGoneError(f"sender(s) {lost} went away while waiting for {key}")
        return offer

    def probe(self, key: str, deadline: float) -> ProbeAnswers:
        """Ask every peer (and ourselves) what it holds unconsumed, for explaining a miss of
        ``key`` (``SharedMemoryConnector.explain_miss``) and for ``probe``: each answers
        ``miss`` with a summary (``diag.probe_answer``) and never offers. A peer of an older
        version answers a plain ``miss``, or offers the key, which is returned at once. Waits
        until every peer answered or went away, or ``deadline``. Never raises."""
        with self._lock:
            want = _Want(self._next_wid, key, False, probe=True)
            self._next_wid += 1
        targets = self._register(want)
        for link in targets:
            if not self._mesh.send(link, [["want", want.wid, key, False, "probe"]]):
                with self._lock:
                    if link in want.pending:
                        want.pending.discard(link)
                        want.gone.append(link)
        self._leadership.wait(
            functools.partial(self._answered, want), want.event, deadline, lead=False
        )
        with self._lock:
            self._wants.pop(want.wid, None)
            return ProbeAnswers(list(want.answers), list(want.gone), len(targets))

    def _answered(self, want: _Want) -> bool:
        with self._lock:
            return want.offer is not None or self.closed or not (want.block or want.pending)

    def _finish(self, want: _Want) -> Offer | None:
        with self._lock:
            self._wants.pop(want.wid, None)
            offer = want.offer
            if offer is not None and self.closed:
                # accepted just before close(): close() migrated it if it was held; either way
                # the caller of a closed connector gets nothing
                self._holding.pop((offer.link, offer.token), None)
                offer = None
        if offer is None:
            self._counters.add("misses")
        if want.block:
            for link in self._mesh.links():
                if offer is None or link is not offer.link:
                    self._mesh.send(link, [["cancel", want.wid]])
        return offer

    def materialize(self, offer: Offer) -> ManagedBuffer:
        """The caller's view of an accepted offer; the slot is released with the buffer."""
        release = functools.partial(self._release, offer.link, offer.token)
        self._counters.add("gets")
        self._counters.add("get_bytes", offer.nbytes)
        return ManagedBuffer.host(offer.view, release)

    def _release(self, link: Link, token: int) -> None:
        """Release callback of a handed-out view (any thread, also a GC finalizer)."""
        with self._lock:
            held = self._holding.pop((link, token), None)
        if held is not None and not self.closed:
            self._mesh.send(link, [["release", token]])

    # -- messages from senders ------------------------------------------------------------------
    def on_offer(self, link: Link, msg: list[Any]) -> None:
        wid, token, offset, nbytes, kind = msg[1:6]
        if link.pool is None or kind not in KINDS:
            raise ValueError(f"offer of kind {kind!r} before a usable pool")
        region = link.pool.region()
        view = region.array(offset, nbytes)  # ValueError (the peer is dropped) if out of bounds
        accepted = False
        with self._lock:
            early = self._early_evicts.pop((link, token), None) is not None
            want = self._wants.get(wid)
            if want is not None and want.offer is None and not self.closed and not want.probe:
                acks = len(msg) > 6 and msg[6] == ACK_FLAG
                want.offer = Offer(link, region, view, token, offset, nbytes, str(kind), acks)
                # held from now on, so an evict that overtakes the waiter's wake-up is served
                self._holding[(link, token)] = (want.offer, region)
                self._signal(want)
                accepted = True
        if not accepted:
            self._mesh.send(link, [["return", token]])
        elif early:
            self.on_evict(link, token)

    def _signal(self, want: _Want) -> None:
        """Wake ``want``'s thread, also out of ``select`` when it leads."""
        self._leadership.wake(want.event)

    def on_miss(self, link: Link, wid: int, answer: Any = None) -> None:
        """A peer does not hold what a non-blocking want asked for (for a probe: ``answer``
        says what it holds)."""
        with self._lock:
            want = self._wants.get(wid)
            if want is not None:
                if want.probe and link in want.pending:
                    want.answers.append((link, answer))
                want.pending.discard(link)
                want.event.set()

    def on_evict(self, link: Link, token: int, log: Callable[..., None] = logger.warning) -> None:
        """The sender needs the slot back: move our view to private memory, then release."""
        with self._lock:
            held = self._holding.pop((link, token), None)
            if held is None:
                # the sender's evict overtook its own offer (sent from another of its threads):
                # serve it when the offer arrives; bounded, oldest forgotten first
                self._early_evicts[(link, token)] = None
                while len(self._early_evicts) > MAX_EARLY_EVICTS:
                    del self._early_evicts[next(iter(self._early_evicts))]
                return
        try:
            held[1].migrate(held[0].offset, held[0].nbytes)
        except (OSError, ValueError) as exc:
            log("cannot migrate a held shared-memory payload (%s); the sender must wait", exc)
            with self._lock:
                self._holding[(link, token)] = held
            return
        self._counters.add("migrated")
        self._mesh.send(link, [["release", token]])

    def on_link_gone(self, link: Link) -> None:
        with self._lock:
            for k in [k for k in self._holding if k[0] is link]:
                del self._holding[k]  # the views stay valid: the mapping pins the memory
            for k in [k for k in self._early_evicts if k[0] is link]:
                del self._early_evicts[k]
            for want in self._wants.values():
                if link in want.pending:
                    want.pending.discard(link)
                    if want.probe:
                        want.gone.append(link)
                    self._signal(want)
                if want.block and link.sender and want.offer is None:
                    want.senders_lost.append(f"pid {link.pid} ({link.peer})")
                    self._signal(want)

    def snapshot(self) -> dict[str, Any]:
        """``held_here``: payloads of peers this side holds (for ``health()``)."""
        with self._lock:
            return {"held_here": len(self._holding)}

    def close(self) -> None:
        """Wake waiters; move every span still held here to private memory, since the senders
        reclaim the slots once our connections close (the views keep their bytes)."""
        with self._lock:
            self.closed = True
            for want in self._wants.values():
                self._signal(want)
            held = list(self._holding.values())
            self._holding.clear()
        for offer, region in held:
            if offer.link.local:
                continue  # our own pool: nobody writes to it after close
            try:
                region.migrate(offer.offset, offer.nbytes)
            except (OSError, ValueError) as exc:
                logger.warning("a view held at close could not be kept private: %s", exc)
