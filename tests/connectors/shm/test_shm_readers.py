"""Who reads the shared-memory mesh: the leader (a waiting thread serves the sockets itself), the
pump (a put reads wants that arrived while it wrote) and the non-blocking read under both.

Real connectors over real abstract sockets, in this process and across processes; nothing is
mocked except what a test observes (which thread ran a handler).
"""

from __future__ import annotations

import fcntl
import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from test_shm_peer import Peer, peer_pool, start_peer

from omnikv.connectors.shm import leadership
from omnikv.connectors.shm.connector import SharedMemoryConnector
from omnikv.connectors.shm.leadership import Leadership
from omnikv.connectors.shm.mesh import Link, Mesh
from omnikv.connectors.shm.recv import RecvSide
from omnikv.connectors.shm.store import SendStore
from omnikv.connectors.shm.wire import DescriptorFlood, FrameReader, encode_frame, recv_nowait
from omnikv.polling import wait_readable

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def peers() -> Iterator[list[Peer]]:
    yield from peer_pool()


@pytest.fixture
def pair(namespace: str) -> Iterator[tuple[SharedMemoryConnector, SharedMemoryConnector]]:
    """A receiving and a sending connector of one namespace (one socket between them)."""
    rx = SharedMemoryConnector({"namespace": namespace})
    tx = SharedMemoryConnector({"namespace": namespace, "linger_s": 0, "prefault": False})
    try:
        # one exchange first: both ends have accepted, greeted and served each other, so
        # nothing from the set-up is left unread when a test starts
        assert tx.put_packed("0", "1", "warm-up", 10, _fill(1))[0]
        got = rx.wait("0", "1", "warm-up", deadline=time.monotonic() + 10.0)
        assert got is not None
        got.release()
        _until(lambda: tx.health()["releases"] == 1)
        yield rx, tx
    finally:
        tx.close(linger=False)
        rx.close(linger=False)


def _fill(value: int) -> Any:
    def write(t: torch.Tensor) -> None:
        t.fill_(value)

    return write


def _record_threads(monkeypatch: pytest.MonkeyPatch, cls: type, name: str, mesh: Mesh) -> list[str]:
    """Wrap the message handler ``cls.name`` (its first argument is the link the message came
    on) so that each call for a message that came on a link of ``mesh`` records the name of the
    thread that ran it."""
    seen: list[str] = []
    orig = getattr(cls, name)

    def wrapped(self: Any, link: Link, *args: Any) -> Any:
        if link in mesh.links():
            seen.append(threading.current_thread().name)
        return orig(self, link, *args)

    monkeypatch.setattr(cls, name, wrapped)
    return seen


class _Waiter(threading.Thread):
    """A thread blocked in ``connector.wait`` for one key; keeps what it got."""

    def __init__(self, conn: SharedMemoryConnector, key: str, timeout: float) -> None:
        super().__init__(daemon=True)
        self.conn, self.key, self.timeout = conn, key, timeout
        self.got: tuple[int, int] | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            buf = self.conn.wait("0", "1", self.key, deadline=time.monotonic() + self.timeout)
            if buf is not None:
                t = buf.tensor
                same = bool((t == t[0]).all())
                self.got = (buf.size, int(t[0]) if same else -1)
                buf.release()
        except BaseException as exc:  # reported by the test
            self.error = exc


def _until(cond: Any, timeout: float = 10.0) -> None:
    """Poll ``cond`` (a state the test cannot be notified of) until true or fail."""
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.001)


@pytest.mark.slow
def test_a_blocked_waiter_reads_its_offer_itself(
    peers: list[Peer], namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Across processes: the thread blocked in ``wait`` leads the mesh, so the offer is
    dispatched in that thread (no hand-over from the I/O thread), and the data is intact."""
    rx = SharedMemoryConnector({"namespace": namespace})
    try:
        offers = _record_threads(monkeypatch, RecvSide, "on_offer", rx.mesh)
        sender = start_peer(peers, namespace, linger_s=0)
        waiter = _Waiter(rx, "k", 20.0)
        waiter.start()
        _until(lambda: rx.mesh.leadership.parked)  # the I/O thread stepped aside for the waiter
        assert sender.call("put", "k", 100_000, 42, 5.0)[:2] == ("put", True)
        waiter.join(20.0)
        assert not waiter.is_alive() and waiter.error is None
        assert waiter.got == (100_000, 42)
        assert offers == [waiter.name]
        _until(lambda: not rx.mesh.leadership.parked)  # and it serves again once the waiter left
    finally:
        rx.close(linger=False)


def test_one_leader_serves_every_waiter(
    pair: tuple[SharedMemoryConnector, SharedMemoryConnector],
) -> None:
    """Eight threads wait at once (one leads); puts in reverse order reach each its own key."""
    rx, tx = pair
    waiters = [_Waiter(rx, f"k{i}", 20.0) for i in range(8)]
    for w in waiters:
        w.start()
    lead = rx.mesh.leadership
    _until(lambda: lead.parked and lead.has_leader and lead.waiters == 7)
    for i in reversed(range(8)):
        assert tx.put_packed("0", "1", f"k{i}", 4096 + i, _fill(i + 1))[0]
    for i, w in enumerate(waiters):
        w.join(20.0)
        assert not w.is_alive() and w.error is None
        assert w.got == (4096 + i, i + 1)


def test_an_offer_from_this_process_wakes_the_leader(
    namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A put on the waiting connector itself (the local link, dispatched in the putting thread)
    wakes the leader out of ``select`` at once: with 30 s rounds it would otherwise sleep."""
    monkeypatch.setattr(leadership, "ROUND_S", 30.0)
    conn = SharedMemoryConnector({"namespace": namespace, "linger_s": 0, "prefault": False})
    try:
        waiter = _Waiter(conn, "k", 20.0)
        waiter.start()
        _until(lambda: conn.mesh.leadership.parked)
        assert conn.put_packed("0", "1", "k", 5000, _fill(9))[0]
        waiter.join(10.0)
        assert not waiter.is_alive() and waiter.got == (5000, 9)
    finally:
        conn.close(linger=False)


def test_close_wakes_a_leading_waiter(namespace: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``close()`` while a thread leads: the waiter returns ``None`` and nothing hangs."""
    monkeypatch.setattr(leadership, "ROUND_S", 30.0)
    conn = SharedMemoryConnector({"namespace": namespace})
    lead = conn.mesh.leadership
    waiter = _Waiter(conn, "never", 25.0)
    waiter.start()
    _until(lambda: lead.parked)
    conn.close(linger=False)
    assert not lead.has_leader  # close() waited for the leader to step down
    waiter.join(10.0)
    assert not waiter.is_alive()
    assert waiter.error is None and waiter.got is None
    assert not lead.io_running


def test_a_put_answers_a_want_its_io_thread_has_not_read(
    pair: tuple[SharedMemoryConnector, SharedMemoryConnector], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sender's I/O thread is parked (this thread leads without serving), so a want sits
    unread in its socket; the put reads it before publishing and offers in the putting thread.
    Without the pump the waiter would time out."""
    rx, tx = pair
    wants = _record_threads(monkeypatch, SendStore, "on_want", tx.mesh)
    with tx.mesh.leadership.lead() as leading:
        assert leading
        _until(lambda: tx.mesh.leadership.parked)
        waiter = _Waiter(rx, "k", 20.0)
        waiter.start()
        link = tx.mesh.links(local=False)[0]
        assert link.sock is not None
        _until(lambda: _readable(link.sock))  # the want has arrived, unread
        assert tx.put_packed("0", "1", "k", 70_000, _fill(5))[0]
    waiter.join(20.0)
    assert not waiter.is_alive() and waiter.got == (70_000, 5)
    assert wants == [threading.current_thread().name]


def _readable(sock: socket.socket) -> bool:
    return wait_readable(sock.fileno(), 0.0)


def test_recv_nowait_never_blocks_and_takes_descriptors() -> None:
    """``socket.recv_fds`` ignores its flags; ``recv_nowait`` does not block on an empty socket,
    reads into the caller's reused buffer, returns passed descriptors close-on-exec, and refuses
    a message with more than ``maxfds`` (the kernel closes those that did not fit,
    ``recv_nowait`` the others)."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    r, w = socket.socketpair()
    buf = memoryview(bytearray(1024))
    try:
        with pytest.raises(BlockingIOError):
            recv_nowait(b, buf, 4)
        socket.send_fds(a, [b"xy"], [r.fileno()])
        n, fds = recv_nowait(b, buf, 4)
        assert bytes(buf[:n]) == b"xy" and len(fds) == 1
        assert fcntl.fcntl(fds[0], fcntl.F_GETFD) & fcntl.FD_CLOEXEC  # never inherited
        os.close(fds[0])
        a.sendall(b"x" * 1500)  # more than the buffer: two reads, nothing lost
        got = b""
        while len(got) < 1500:
            n, fds = recv_nowait(b, buf, 4)
            assert not fds and 0 < n <= 1024
            got += bytes(buf[:n])
        assert got == b"x" * 1500
        before = len(os.listdir("/proc/self/fd"))
        socket.send_fds(a, [b"z"], [r.fileno(), w.fileno(), r.fileno()])
        with pytest.raises(DescriptorFlood):
            recv_nowait(b, buf, 1)
        assert len(os.listdir("/proc/self/fd")) == before  # none of the three is left open
    finally:
        for s in (a, b, r, w):
            s.close()


def test_frame_reader_splits_frames_across_reads_of_a_reused_buffer() -> None:
    """Frames that arrive split at any byte, several in one read, or read through one reused
    buffer (as the mesh does) come out whole and in order; garbage is a ``ValueError``."""
    frames = [encode_frame(["want", i, f"key-{i}" * (i + 1), True]) for i in range(6)]
    stream = b"".join(frames)
    for cut in range(1, 40, 3):
        reader, buf, got = FrameReader(), memoryview(bytearray(cut)), []
        for pos in range(0, len(stream), cut):
            chunk = stream[pos : pos + cut]
            buf[: len(chunk)] = chunk
            got += reader.feed(buf[: len(chunk)])
            buf[:] = b"\xff" * cut  # the buffer is reused: nothing may refer to it
        assert [m[1] for m in got] == list(range(6)) and got[5][2] == "key-5" * 6
    with pytest.raises(ValueError, match="typed msgpack array"):
        FrameReader().feed(encode_frame([1, 2]))
    with pytest.raises(ValueError, match="exceeds"):
        FrameReader().feed(b"\xff\xff\xff\xff")


def _hold_wants_for_ping(
    monkeypatch: pytest.MonkeyPatch, rx: SharedMemoryConnector
) -> tuple[threading.Event, threading.Event]:
    """Make ``rx``'s dispatch of a want for key ``ping`` block (in whichever thread reads it)
    until the returned ``proceed`` is set; ``entered`` is set once it blocks."""
    entered, proceed = threading.Event(), threading.Event()
    orig = SendStore.on_want

    def slow(self: SendStore, link: Link, wid: int, key: str, block: bool) -> None:
        if key.startswith("ping@") and link in rx.mesh.links():
            entered.set()
            proceed.wait(30.0)
        orig(self, link, wid, key, block)

    monkeypatch.setattr(SendStore, "on_want", slow)
    return entered, proceed


def test_a_waiter_keeps_its_deadline_while_its_link_is_being_read(
    pair: tuple[SharedMemoryConnector, SharedMemoryConnector], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The receiver's I/O thread is stuck in a slow dispatch from the sender's link (a handler
    this test holds) and keeps that link's read lock: the leader waits for the lock at most one
    round, and its wait still ends at its deadline with nothing."""
    rx, tx = pair
    entered, proceed = _hold_wants_for_ping(monkeypatch, rx)
    asker = _Waiter(tx, "ping", 20.0)  # its want is dispatched by rx's I/O thread
    asker.start()
    try:
        assert entered.wait(10.0)
        t0 = time.monotonic()
        assert rx.wait("0", "1", "never", deadline=t0 + 0.5) is None
        assert time.monotonic() - t0 < 5.0
    finally:
        proceed.set()
    tx.close(linger=False)
    asker.join(10.0)
    assert not asker.is_alive()


def test_a_waiter_reads_its_offer_while_the_io_thread_is_busy(
    pair: tuple[SharedMemoryConnector, SharedMemoryConnector],
    monkeypatch: pytest.MonkeyPatch,
    namespace: str,
) -> None:
    """The leader does not wait for the I/O thread to step aside: with the receiver's I/O
    thread stuck in a dispatch for a third peer (a handler this test holds), a waiter still
    reads its own offer from the sender, in its own thread, before that dispatch ends."""
    rx, tx = pair
    entered, proceed = _hold_wants_for_ping(monkeypatch, rx)
    offers = _record_threads(monkeypatch, RecvSide, "on_offer", rx.mesh)
    third = SharedMemoryConnector({"namespace": namespace})
    asker = _Waiter(third, "ping", 20.0)  # its want holds rx's I/O thread
    try:
        asker.start()
        assert entered.wait(10.0)
        waiter = _Waiter(rx, "k", 20.0)
        waiter.start()
        _until(lambda: rx.mesh.leadership.has_leader)  # its want went out; it serves
        assert tx.put_packed("0", "1", "k", 30_000, _fill(3))[0]
        waiter.join(20.0)
        assert not waiter.is_alive() and waiter.got == (30_000, 3)
        assert not proceed.is_set()  # read while the I/O thread was still stuck
        assert offers == [waiter.name]
    finally:
        proceed.set()
        third.close(linger=False)
        asker.join(10.0)
    assert not asker.is_alive()


def test_a_handler_that_fails_drops_only_that_link(
    pair: tuple[SharedMemoryConnector, SharedMemoryConnector],
    monkeypatch: pytest.MonkeyPatch,
    namespace: str,
) -> None:
    """A handler raising on a valid message (a bug, a failed remap) drops that peer and is
    logged; the I/O thread lives on, and a put whose pump meets such a failure still succeeds."""
    rx, tx = pair

    def boom(self: SendStore, link: Link, *args: Any) -> None:
        if link in tx.mesh.links():
            raise RuntimeError("handler bug")

    monkeypatch.setattr(SendStore, "on_want", boom)
    # this thread leads without serving, so the want stays unread until the put's pump
    with tx.mesh.leadership.lead() as leading:
        assert leading
        _until(lambda: tx.mesh.leadership.parked)
        waiter = _Waiter(rx, "k", 1.0)
        waiter.start()
        link = tx.mesh.links(local=False)[0]
        assert link.sock is not None
        _until(lambda: _readable(link.sock))
        assert tx.put_packed("0", "1", "k", 1000, _fill(1))[0]
    assert tx.health()["peers_dropped"] == 1
    waiter.join(10.0)
    assert not waiter.is_alive()
    assert tx.mesh.leadership.io_running
    # the dropped peer is gone; a new one is served
    late = SharedMemoryConnector({"namespace": namespace})
    try:
        monkeypatch.undo()
        got = late.wait("0", "1", "k", deadline=time.monotonic() + 10.0)
        assert got is not None and got.size == 1000
        got.release()
    finally:
        late.close(linger=False)


def test_a_polling_waiter_polls_then_sleeps_and_keeps_its_deadline(
    namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``poll_us``: the leading waiter's first rounds do not sleep (``select`` with a zero
    timeout) and it still gets its offer from another connector; once the poll time is over it
    sleeps in bounded rounds, and a wait for nothing ends at its deadline."""
    rounds: list[float] = []
    orig = Leadership.serve

    def serve(self: Leadership, timeout: float) -> None:
        rounds.append(timeout)
        orig(self, timeout)

    yields: list[int] = []
    monkeypatch.setattr(Leadership, "serve", serve)
    monkeypatch.setattr(os, "sched_yield", lambda: yields.append(1))
    rx = SharedMemoryConnector({"namespace": namespace, "poll_us": 20_000})
    tx = SharedMemoryConnector({"namespace": namespace, "linger_s": 0, "prefault": False})
    try:
        waiter = _Waiter(rx, "k", 20.0)
        waiter.start()
        _until(lambda: len(rounds) >= 3)  # polling: the waiter is in its zero-timeout rounds
        assert tx.put_packed("0", "1", "k", 9000, _fill(7))[0]
        waiter.join(20.0)
        assert not waiter.is_alive() and waiter.got == (9000, 7)
        assert rounds[0] == 0.0
        rounds.clear()
        yields.clear()
        t0 = time.monotonic()
        assert rx.wait("0", "1", "never", deadline=t0 + 0.3) is None
        assert 0.3 <= time.monotonic() - t0 < 5.0
        assert rounds[0] == 0.0 and rounds[-1] > 0.0  # polled first, then slept
        # every polling round hands the CPU to whatever else could run on it
        assert len(yields) == rounds.count(0.0) > 0
    finally:
        tx.close(linger=False)
        rx.close(linger=False)


def test_poll_us_zero_sleeps_at_once(namespace: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``poll_us: 0``: a blocking wait never polls; its first round already sleeps."""
    rounds: list[float] = []
    orig = Leadership.serve

    def serve(self: Leadership, timeout: float) -> None:
        rounds.append(timeout)
        orig(self, timeout)

    monkeypatch.setattr(Leadership, "serve", serve)
    rx = SharedMemoryConnector({"namespace": namespace, "poll_us": 0})
    try:
        t0 = time.monotonic()
        assert rx.wait("0", "1", "never", deadline=t0 + 0.2) is None
        assert rounds and 0.0 not in rounds
    finally:
        rx.close(linger=False)


# -- the I/O thread after a leader leaves ------------------------------------------------------
@pytest.mark.timing
def test_a_receiving_stage_does_not_wake_its_io_thread_per_request(
    pair: tuple[SharedMemoryConnector, SharedMemoryConnector],
) -> None:
    """A connector that only receives: each leading wait leaves the I/O thread parked (else it
    would be woken twice per request: once to park, once to resume, the second time on the
    request's critical path), and every payload still arrives. It serves again once nobody
    led for ``LINGER_S``. A sending connector resumes it at once."""
    rx, tx = pair
    lead = rx.mesh.leadership
    # only tx has a pool
    assert not lead.resumes_io_at_once() and tx.mesh.leadership.resumes_io_at_once()
    rounds = lead.io_rounds
    for i in range(8):
        waiter = _Waiter(rx, f"k{i}", 20.0)
        waiter.start()
        _until(lambda: lead.has_leader)
        assert tx.put_packed("0", "1", f"k{i}", 500 + i, _fill(i))[0]
        waiter.join(20.0)
        assert waiter.got == (500 + i, i)
        if i == 0:
            _until(lambda: lead.parked)  # parked for the first leader, never resumed
            rounds = lead.io_rounds
    assert lead.parked and lead.io_rounds == rounds
    _until(lambda: not lead.parked)  # LINGER_S after the last leader left


def test_a_lingering_io_thread_serves_other_waiters_and_close(
    pair: tuple[SharedMemoryConnector, SharedMemoryConnector], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the linger made long (30 s), what only the I/O thread can read still arrives at
    once: an offer for a second thread that waited while another led (the leader's exit wakes
    the I/O thread since others wait), a non-blocking ``get`` after a leader left (it resumes
    the I/O thread itself); and ``close`` returns at once."""
    monkeypatch.setattr(leadership, "LINGER_S", 30.0)
    monkeypatch.setattr(leadership, "PARK_CHECK_S", 30.0)
    rx, tx = pair
    lead = rx.mesh.leadership
    first = _Waiter(rx, "a", 20.0)
    first.start()
    _until(lambda: lead.has_leader)
    other = _Waiter(rx, "b", 20.0)
    other.start()
    _until(lambda: lead.waiters == 1)  # waits without leading
    assert tx.put_packed("0", "1", "a", 100, _fill(3))[0]
    first.join(20.0)
    assert first.got == (100, 3)
    t0 = time.monotonic()
    assert tx.put_packed("0", "1", "b", 200, _fill(4))[0]
    other.join(20.0)
    assert other.got == (200, 4) and time.monotonic() - t0 < 10.0
    # a lone leader leaves lazily now; a non-blocking get must still be answered
    lone = _Waiter(rx, "c", 20.0)
    lone.start()
    _until(lambda: lead.has_leader)
    assert tx.put_packed("0", "1", "c", 300, _fill(5))[0]
    lone.join(20.0)
    assert lone.got == (300, 5)
    # the leader asked the I/O thread to park without waiting for it; on a loaded host it may
    # get a CPU only after the leader left, and then lingers parked for LINGER_S (30 s here)
    _until(lambda: lead.parked)
    assert tx.put_packed("0", "1", "d", 400, _fill(6))[0]
    got = rx.get("0", "1", "d")
    assert got is not None and got[1] == 400
    t0 = time.monotonic()
    rx.close(linger=False)
    assert time.monotonic() - t0 < 5.0


@pytest.mark.parametrize(
    "msg",
    [
        ["release", True],  # bool is not an int here
        ["release", -1],
        ["release", 1.0],
        ["release"],
        ["want", "1", "k", True],
        ["offer", 1, 2, 3, "4", "raw"],
    ],
)
def test_control_messages_with_bad_integer_fields_are_refused(namespace: str, msg: list) -> None:
    """Every control message's leading integer fields must be non-negative ints (a peer sending
    anything else is dropped by the mesh: ``on_message`` raises ``ValueError``)."""
    c = SharedMemoryConnector({"namespace": namespace})
    try:
        with pytest.raises(ValueError, match="malformed"):
            c.on_message(c.mesh.local, msg)
        c.on_message(c.mesh.local, ["cancel", 7])  # well formed: nothing to cancel, no error
    finally:
        c.close(linger=False)
