"""Arrival wakeups of the shared-memory connector: vllm-omni 0.32.0rc1's
``get_wakeup_generation() -> int | None`` and ``wait_for_change(generation, *, timeout) -> bool``,
with ``VLLM_OMNI_SHM_WAKEUP`` and ``extra.wakeup_scope``, as the reference behaves:

* a receiving connector has wakeups when its ``stage_id`` is a number >= 0 (else ``None``: keep
  a timed poll); a put to its stage, from any process of its scope, changes its generation;
* ``wait_for_change`` returns ``True`` once the generation differs from the one given (at once
  when it already does), ``False`` at its timeout, without wakeups, or once closed;
* ``VLLM_OMNI_SHM_WAKEUP`` other than ``"1"`` turns wakeups off.

The sender of the cross-process test is a peer process (tests/connectors/shm/test_shm_peer.py),
stopped by PID.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from test_shm_peer import Peer, peer_pool, start_peer

from omnikv.connectors import ConnectorSpec, OmniConnectorFactory
from omnikv.connectors.shm.connector import SharedMemoryConnector
from omnikv.connectors.shm.wakeup import MAX_WAITERS, Wakeups
from support.polling import until

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def peers() -> Iterator[list[Peer]]:
    yield from peer_pool()


@pytest.fixture
def make(namespace: str) -> Iterator[Any]:
    """``make(**extra)``: a connector made as reference code makes it (the factory, a spec),
    in this test's namespace unless ``extra`` names one; every one is closed afterwards."""
    made: list[SharedMemoryConnector] = []

    def build(**extra: Any) -> SharedMemoryConnector:
        spec = {"namespace": namespace, "linger_s": 0, "pool_size_bytes": 1 << 20, **extra}
        c = OmniConnectorFactory.create_connector(ConnectorSpec("SharedMemoryConnector", spec))
        assert isinstance(c, SharedMemoryConnector)
        made.append(c)
        return c

    yield build
    for c in made:
        c.close()


def test_a_put_to_the_stage_changes_the_generation(make: Any) -> None:
    receiver, sender = make(stage_id=1), make()
    generation = receiver.get_wakeup_generation()
    assert isinstance(generation, int)
    t0 = time.monotonic()
    assert receiver.wait_for_change(generation, timeout=0.2) is False  # nothing was put
    assert 0.15 <= time.monotonic() - t0 < 2.0
    assert sender.put("0", "1", "r1", b"payload")[0]
    assert receiver.wait_for_change(generation, timeout=5.0) is True
    later = receiver.get_wakeup_generation()
    assert later is not None and later != generation
    assert receiver.wait_for_change(generation, timeout=0) is True  # already changed
    assert receiver.wait_for_change(later, timeout=0) is False


def test_only_puts_to_its_own_stage_wake_it(make: Any) -> None:
    receiver, other, sender = make(stage_id=1), make(stage_id=2), make()
    gen1, gen2 = receiver.get_wakeup_generation(), other.get_wakeup_generation()
    assert gen1 is not None and gen2 is not None
    assert sender.put("0", "2", "r1", b"x")[0]
    assert other.wait_for_change(gen2, timeout=5.0) is True
    assert receiver.wait_for_change(gen1, timeout=0.2) is False
    sender.put_packed("0", "1", "r2", 4, lambda t: t.fill_(1))  # the manager's put wakes too
    assert receiver.wait_for_change(gen1, timeout=5.0) is True


def test_a_waiter_is_woken_by_a_put_in_another_process(
    make: Any, peers: list[Peer], namespace: str
) -> None:
    receiver = make(stage_id=1)
    sender = start_peer(peers, namespace, pool_size_bytes=1 << 20, linger_s=0)
    generation = receiver.get_wakeup_generation()
    assert generation is not None
    woke: list[float] = []

    def wait() -> None:
        if receiver.wait_for_change(generation, timeout=20.0):
            woke.append(time.monotonic())

    waiter = threading.Thread(target=wait)
    waiter.start()
    sent_at = time.monotonic()
    assert sender.call("put", "r1", 1024, 1, 5.0)[:2] == ("put", True)  # a put to stage "1"
    waiter.join(25)
    assert not waiter.is_alive() and woke
    assert woke[0] - sent_at < 5.0  # woken by the put, not by the 20 s timeout
    got = receiver.get_with_deadline("0", "1", "r1", deadline=time.monotonic() + 5)
    assert got is not None and got[1] == 1024
    got[0].release()


def test_the_scope_limits_who_wakes_whom(make: Any) -> None:
    receiver = make(stage_id=3, extra={"wakeup_scope": "deploy-a"})
    same_ns_other_scope = make(extra={"wakeup_scope": "deploy-b"})
    other_ns_same_scope = make(namespace="elsewhere-ns", extra={"wakeup_scope": "deploy-a"})
    generation = receiver.get_wakeup_generation()
    assert generation is not None
    assert same_ns_other_scope.put("0", "3", "r1", b"x")[0]
    assert receiver.wait_for_change(generation, timeout=0.2) is False
    assert other_ns_same_scope.put("0", "3", "r2", b"x")[0]
    assert receiver.wait_for_change(generation, timeout=5.0) is True


@pytest.mark.parametrize("extra", [{}, {"stage_id": "talker"}, {"stage_id": -1}])
def test_a_connector_without_a_stage_number_has_no_wakeups(make: Any, extra: Any) -> None:
    c = make(**extra)
    assert c.get_wakeup_generation() is None
    t0 = time.monotonic()
    assert c.wait_for_change(0, timeout=5.0) is False
    assert time.monotonic() - t0 < 1.0
    assert c.put("0", "talker", "r1", b"x")[0]  # a stage that is not a number wakes nobody


def test_the_environment_turns_wakeups_off(make: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_OMNI_SHM_WAKEUP", "0")
    c = make(stage_id=1)
    assert c.get_wakeup_generation() is None
    assert c.wait_for_change(0, timeout=5.0) is False
    monkeypatch.setenv("VLLM_OMNI_SHM_WAKEUP", "1")
    assert isinstance(c.get_wakeup_generation(), int)


def test_closing_ends_wakeups_and_a_bad_timeout_is_refused(make: Any) -> None:
    c = make(stage_id=1)
    generation = c.get_wakeup_generation()
    assert generation is not None
    with pytest.raises(ValueError, match="timeout"):
        c.wait_for_change(generation, timeout=-1)
    with pytest.raises(ValueError, match="timeout"):
        c.wait_for_change(generation, timeout=float("nan"))
    c.close()
    assert c.get_wakeup_generation() is None
    assert c.wait_for_change(generation, timeout=5.0) is False


def test_a_wakeup_socket_numbered_past_select_s_limit_still_waits(make: Any) -> None:
    """A process with many files open (an engine) gets a socket numbered >= 1024, which
    ``select`` refuses: the wait must still last its timeout (a caller's poll loop would spin
    otherwise) and still wake on a put."""
    spare = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        receiver, sender = make(stage_id=1), make()
        generation = receiver.get_wakeup_generation()
        assert generation is not None
        t0 = time.monotonic()
        assert receiver.wait_for_change(generation, timeout=0.3) is False
        assert time.monotonic() - t0 >= 0.25
        assert sender.put("0", "1", "r1", b"x")[0]
        assert receiver.wait_for_change(generation, timeout=5.0) is True
    finally:
        for fd in spare:
            os.close(fd)


def test_names_bound_by_others_cannot_make_a_put_unbounded(namespace: str) -> None:
    """Anyone on the host may bind datagram sockets under a stage's wakeup prefix; a put sends
    to at most ``MAX_WAITERS`` of them."""
    receiver = Wakeups(namespace, 4)
    assert receiver.generation() is not None  # binds the receiver's socket: the prefix's form
    sock = receiver._sock
    assert sock is not None
    prefix = sock.getsockname()[1:].decode().rsplit("/", 1)[0]
    flood = []
    try:
        for i in range(MAX_WAITERS + 40):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            flood.append(s)
            s.bind(f"\0{prefix}/flood{i:04d}".encode())
            s.setblocking(False)
        sender = Wakeups(namespace, None)
        sender.notify(4)
        sender.close()
        woken = 0
        for s in [*flood, sock]:
            try:
                s.recv(16)
                woken += 1
            except BlockingIOError:
                pass
        assert 0 < woken <= MAX_WAITERS
    finally:
        for s in flood:
            s.close()
        receiver.close()


def test_closing_wakes_a_waiter(make: Any) -> None:
    """``close()`` ends a wait in progress (``False``) instead of leaving the waiting thread
    blocked for the rest of its timeout."""
    c = make(stage_id=1)
    generation = c.get_wakeup_generation()
    assert generation is not None
    got: list[tuple[bool, float]] = []
    entered = threading.Event()

    def wait() -> None:
        entered.set()
        t0 = time.monotonic()
        got.append((c.wait_for_change(generation, timeout=20.0), time.monotonic() - t0))

    waiter = threading.Thread(target=wait)
    waiter.start()
    assert entered.wait(5)
    # not synchronisation: the assertions hold whenever the close comes; the pause only makes
    # the close usually find the waiter inside its poll, the case that kept it blocked
    time.sleep(0.2)
    c.close()
    waiter.join(25)
    assert not waiter.is_alive()
    assert got and got[0][0] is False and got[0][1] < 5.0


@pytest.mark.parametrize("stage", [float("inf"), float("-inf"), float("nan"), "1e3", None])
def test_a_stage_that_is_no_number_has_no_wakeups_and_never_raises(stage: Any) -> None:
    """``notify`` never raises (a put calls it after publishing) and only stage numbers have
    wakeups, whatever a config or a caller passes as the stage."""
    w = Wakeups("scope-of-odd-stages", stage)
    try:
        assert w.generation() is None
        w.notify(stage)
    finally:
        w.close()


def test_a_put_taken_at_once_by_a_blocking_wait_wakes_nobody(make: Any) -> None:
    """A payload that a reader's blocking wait took as it was put leaves nothing for a look to
    find: the put sends no wakeup (one that a polling stage would answer with a look for
    nothing). A put that nobody took still wakes it."""
    receiver, sender = make(stage_id=1), make()
    generation = receiver.get_wakeup_generation()
    assert generation is not None
    got: list[Any] = []
    taker = threading.Thread(
        target=lambda: got.append(receiver.wait("0", "1", "r1", deadline=time.monotonic() + 10.0))
    )
    taker.start()
    until(lambda: sender.health()["waiting_receivers"] == 1, what="the reader's want")
    assert sender.put("0", "1", "r1", b"payload")[0]
    taker.join(timeout=10.0)
    assert got and got[0] is not None  # the blocking wait took it
    got[0].release()
    assert receiver.wait_for_change(generation, timeout=0.3) is False
    assert sender.put("0", "1", "r2", b"left for a look")[0]
    assert receiver.wait_for_change(generation, timeout=5.0) is True
