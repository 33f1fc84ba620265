"""A receiver's want reaches every peer exactly once, however a peer's connection races it.

``RecvSide`` sends a new want on the links it lists, and a peer that connects later gets the
open blocking wants in its greeting (``blocking_wants``). A want must be registered before the
links are listed: listed first, a peer that connected in between, and whose greeting read the
wants before the registration, never got it (the receive then waited out its deadline while the
sender held the payload; seen as a flaky wake-up test). Unit level, with a mesh whose peer
connects while the receiver lists its links; the real mesh's behaviour is in the other modules.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from omnikv.connectors.counters import Counters
from omnikv.connectors.shm.recv import COUNTER_NAMES, RecvSide


class _Leadership:
    """Ends every wait at once (the wants' deadlines here are already past), after running
    ``during`` when set: what happens while a want is open."""

    def __init__(self) -> None:
        self.during: Callable[[], object] | None = None

    def wait(
        self,
        answered: Any,
        event: threading.Event,
        deadline: float,
        *,
        lead: bool,
        check_every_s: float | None = None,
    ) -> None:
        if self.during is not None:
            self.during()

    def wake(self, event: threading.Event) -> None:
        event.set()


class _RacingMesh:
    """A mesh with one peer that connects during the receiver's first look at its links: the
    greeting (``blocking_wants``) runs then, and that look does not list the peer yet."""

    def __init__(self) -> None:
        self.leadership = _Leadership()
        self.peer = object()
        self.recv: RecvSide | None = None
        self.listed = False
        self.sent: list[tuple[object, list[Any]]] = []

    def accept_waiting(self) -> None:
        """Nothing waits on this mesh's listener."""

    def links(self, *, local: bool = True) -> list[Any]:
        if not self.listed:
            self.listed = True
            assert self.recv is not None
            for msg in self.recv.blocking_wants(self.peer):  # type: ignore[arg-type]
                self.sent.append((self.peer, msg))
            return []
        return [self.peer]

    def send(self, link: object, msgs: list[list[Any]], pool: Any = None) -> bool:
        self.sent.extend((link, msg) for msg in msgs)
        return True


def _side() -> tuple[RecvSide, _RacingMesh]:
    mesh = _RacingMesh()
    side = RecvSide(mesh, Counters(COUNTER_NAMES))  # type: ignore[arg-type]
    mesh.recv = side
    return side, mesh


def test_a_peer_that_connects_while_a_want_goes_out_gets_it_once() -> None:
    side, mesh = _side()
    assert side.take("k@0_1", True, time.monotonic()) is None
    wants = [msg for link, msg in mesh.sent if link is mesh.peer and msg[0] == "want"]
    assert wants == [["want", 1, "k@0_1", True]]
    # the wait ended: the want is cancelled at that peer too
    assert [msg for _, msg in mesh.sent if msg[0] == "cancel"] == [["cancel", 1]]


def test_a_greeting_carries_the_open_blocking_wants_not_yet_sent_on_that_link() -> None:
    side, mesh = _side()
    mesh.listed = True  # the peer is listed from the start: the want goes out on it directly
    newcomer = object()
    greetings: dict[str, list[list[Any]]] = {}

    def greet() -> None:  # while the want is open: the same peer again, then a new one
        greetings["same"] = side.blocking_wants(mesh.peer)  # type: ignore[arg-type]
        greetings["new"] = side.blocking_wants(newcomer)  # type: ignore[arg-type]

    mesh.leadership.during = greet
    assert side.take("k@0_1", True, time.monotonic()) is None
    assert greetings == {"same": [], "new": [["want", 1, "k@0_1", True]]}
    assert [msg for link, msg in mesh.sent if msg[0] == "want"] == [["want", 1, "k@0_1", True]]


def test_a_probe_is_in_no_greeting_and_counts_the_peers_it_asked() -> None:
    side, mesh = _side()
    mesh.listed = True
    greeting: list[list[Any]] = []
    mesh.leadership.during = lambda: greeting.extend(side.blocking_wants(object()))  # type: ignore[arg-type]
    probed = side.probe("p@0_1", time.monotonic())
    assert probed.asked == 1 and greeting == []
