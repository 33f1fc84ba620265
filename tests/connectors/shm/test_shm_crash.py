"""SIGKILL of real sender / receiver processes at chosen moments leaves nothing behind.

After each kill: no new name in /dev/shm, no abstract socket of the dead process, the pool space
a dead reader held is reclaimed (proved by a put that only fits once it is), the surviving side
maps no pool after it closes, and a restarted process on the same namespace works.
"""

from __future__ import annotations

import gc
import random
import time
from collections.abc import Iterator

import pytest
from test_shm_peer import (
    Peer,
    abstract_names,
    filler,
    own_memfd_maps,
    peer_pool,
    shm_listing,
    start_peer,
)

from omnikv.connectors.shm.connector import SharedMemoryConnector
from omnikv.errors import PeerGoneError

KIB = 1024
pytestmark = pytest.mark.slow


@pytest.fixture
def peers() -> Iterator[list[Peer]]:
    yield from peer_pool()


def _assert_nothing_left(before: set[str], namespace: str) -> None:
    assert shm_listing() == before
    assert abstract_names(namespace) == set()
    gc.collect()
    assert own_memfd_maps() == []


@pytest.mark.timeout(40)
def test_sender_killed_mid_put(peers: list[Peer], namespace: str) -> None:
    before = shm_listing()
    rx = SharedMemoryConnector({"namespace": namespace})
    try:
        sender = start_peer(peers, namespace, pool_size_bytes=1 << 20)
        sender.send("put_stall", "k", 512 * KIB)
        assert sender.recv() == ("writing",)  # inside write(), half the slot filled
        sender.kill()
        try:
            got = rx.wait("0", "1", "k", deadline=time.monotonic() + 0.3)
        except PeerGoneError:
            got = None
        assert got is None  # a half-written payload is never published
        # a restarted sender on the same namespace works
        sender2 = start_peer(peers, namespace, pool_size_bytes=1 << 20)
        assert sender2.call("put", "k", 512 * KIB, 4, 5.0)[:2] == ("put", True)
        got = rx.wait("0", "1", "k", deadline=time.monotonic() + 5)
        assert got is not None
        buf, size = got, got.size
        assert size == 512 * KIB and bool((buf.tensor == 4).all())
        buf.release()
        sender2.stop()
    finally:
        rx.close()
    _assert_nothing_left(before, namespace)


@pytest.mark.timeout(40)
def test_receiver_killed_holding_a_view_gives_its_space_back(
    peers: list[Peer], namespace: str
) -> None:
    before = shm_listing()
    tx = SharedMemoryConnector(
        {"namespace": namespace, "pool_size_bytes": 1 << 20, "put_timeout_s": 10}
    )
    try:
        reader = start_peer(peers, namespace)
        assert reader.call("wait_hold", "k1", 10.0, 1) == ("waiting",)
        assert tx.put_packed("0", "1", "k1", 768 * KIB, lambda t: t.fill_(1))[0]
        assert reader.recv()[:3] == ("got", 768 * KIB, True)  # holding the view
        assert tx.health()["held_by_readers"] == 1
        reader.kill()
        # 768 KiB more fits a 1 MiB pool only once the dead reader's slot is reclaimed;
        # the put waits on the pool's condition, woken by the reclaim (no polling).
        t0 = time.monotonic()
        ok, _, _ = tx.put_packed(
            "0", "1", "k2", 768 * KIB, lambda t: t.fill_(2), deadline=time.monotonic() + 10
        )
        assert ok and time.monotonic() - t0 < 5
        h = tx.health()
        assert h["reclaimed_from_dead_readers"] == 1 and h["held_by_readers"] == 0
        reader2 = start_peer(peers, namespace)
        assert reader2.call("wait", "k2", 10.0, 2) == ("waiting",)
        assert reader2.recv()[:3] == ("got", 768 * KIB, True)
        reader2.stop()
    finally:
        tx.close()
    _assert_nothing_left(before, namespace)


@pytest.mark.timeout(40)
def test_receiver_killed_mid_get_loses_nothing(peers: list[Peer], namespace: str) -> None:
    before = shm_listing()
    tx = SharedMemoryConnector({"namespace": namespace, "pool_size_bytes": 1 << 20})
    try:
        reader = start_peer(peers, namespace)
        assert reader.call("wait", "k", 30.0, 6) == ("waiting",)
        reader.kill()  # blocked in wait (its want may or may not have reached us)
        assert tx.put_packed("0", "1", "k", 100 * KIB, lambda t: t.fill_(6))[0]
        reader2 = start_peer(peers, namespace)
        assert reader2.call("wait", "k", 10.0, 6) == ("waiting",)
        assert reader2.recv()[:3] == ("got", 100 * KIB, True)
        reader2.stop()
        assert tx.health()["published"] == 0
    finally:
        tx.close()
    _assert_nothing_left(before, namespace)


@pytest.mark.timeout(40)
def test_sender_killed_while_receiver_holds_a_view(peers: list[Peer], namespace: str) -> None:
    before = shm_listing()
    rx = SharedMemoryConnector({"namespace": namespace})
    try:
        sender = start_peer(peers, namespace, pool_size_bytes=1 << 20)
        assert sender.call("put", "k", 256 * KIB, 8, 5.0)[:2] == ("put", True)
        got = rx.wait("0", "1", "k", deadline=time.monotonic() + 5)
        assert got is not None
        buf = got
        sender.kill()
        assert bool((buf.tensor == 8).all())  # the mapping pins the memory after the owner died
        buf.release()
        # waiting for a key when the only sender is gone ends at the deadline
        try:
            again = rx.wait("0", "1", "k", deadline=time.monotonic() + 0.2)
        except PeerGoneError:
            again = None
        assert again is None
    finally:
        rx.close()
    del buf, got
    _assert_nothing_left(before, namespace)


@pytest.mark.timeout(40)
def test_both_killed_then_a_fresh_pair_works(peers: list[Peer], namespace: str) -> None:
    before = shm_listing()
    sender = start_peer(peers, namespace, pool_size_bytes=1 << 20)
    reader = start_peer(peers, namespace)
    assert sender.call("put", "unconsumed", 64 * KIB, 1, 5.0)[:2] == ("put", True)
    assert reader.call("wait_hold", "held", 10.0, 2) == ("waiting",)
    assert sender.call("put", "held", 64 * KIB, 2, 5.0)[:2] == ("put", True)
    assert reader.recv()[:3] == ("got", 64 * KIB, True)
    sender.kill()
    reader.kill()
    _assert_nothing_left(before, namespace)
    sender = start_peer(peers, namespace, pool_size_bytes=1 << 20)
    reader = start_peer(peers, namespace)
    assert reader.call("get_nothing", timeout=5)[0] == "error"  # unknown op: the peer lives
    assert reader.call("wait", "unconsumed", 0.1, 1)[0] == "waiting"
    assert reader.recv()[0] == "miss"  # the old payload died with its sender
    assert reader.call("wait", "new", 10.0, 3) == ("waiting",)
    assert sender.call("put", "new", 64 * KIB, 3, 5.0)[:2] == ("put", True)
    assert reader.recv()[:3] == ("got", 64 * KIB, True)
    sender.stop()
    reader.stop()
    _assert_nothing_left(before, namespace)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", [1, 2])
def test_reader_killed_at_a_random_moment_of_a_busy_stream(
    peers: list[Peer], namespace: str, seed: int
) -> None:
    """The reader is killed somewhere in a loop of wait / hold / release; the sender gets every
    byte back (a put of the whole pool fits) and a restarted reader works."""
    n = 20
    before = shm_listing()
    tx = SharedMemoryConnector(
        {"namespace": namespace, "pool_size_bytes": 2 << 20, "put_timeout_s": 10}
    )
    try:
        reader = start_peer(peers, namespace)
        reader.send("churn", n, 10.0)
        for i in range(n):
            assert tx.put_packed("0", "1", f"c{i}", 64 * KIB, filler(i))[0]
        kill_after = random.Random(seed).randrange(1, n - 2)
        while True:
            msg = reader.recv()
            assert msg[0] == "progress", msg
            if msg[1] >= kill_after:
                break
        reader.kill()  # it was running on: mid-wait, mid-offer or holding a view
        for i in range(n):
            tx.cleanup(f"c{i}")
        whole = tx.health()["pool_size_bytes"]
        ok, _, _ = tx.put_packed(
            "0", "1", "all", whole, lambda t: t.fill_(9), deadline=time.monotonic() + 10
        )
        assert ok
        h = tx.health()
        assert h["held_by_readers"] == 0 and h["published"] == 1
        reader2 = start_peer(peers, namespace)
        assert reader2.call("wait", "all", 10.0, 9) == ("waiting",)
        assert reader2.recv()[:3] == ("got", whole, True)
        reader2.stop()
    finally:
        tx.close()
    _assert_nothing_left(before, namespace)


@pytest.mark.timeout(60)
def test_sender_killed_at_a_random_moment_of_a_busy_stream(
    peers: list[Peer], namespace: str
) -> None:
    """The sender dies somewhere in a loop of puts; every view the receiver took stays valid,
    later waits end (miss or PeerGoneError), nothing is left and a restarted sender works."""
    n = 40
    before = shm_listing()
    rx = SharedMemoryConnector({"namespace": namespace})
    views = []
    try:
        sender = start_peer(peers, namespace, pool_size_bytes=4 << 20)
        sender.send("churn_put", n)
        kill_after = random.Random(3).randrange(2, n // 2)
        i = 0
        while True:
            got = rx.wait("0", "1", f"c{i}", deadline=time.monotonic() + 10)
            assert got is not None
            views.append((i, got))
            i += 1
            msg = sender.recv()
            if msg[1] >= kill_after:
                break
        sender.kill()
        for j, buf in views:
            assert bool((buf.tensor == j % 251).all())
            buf.release()
        try:
            rest = rx.wait("0", "1", f"c{n + 1}", deadline=time.monotonic() + 0.3)
        except PeerGoneError:
            rest = None
        assert rest is None
        sender2 = start_peer(peers, namespace, pool_size_bytes=1 << 20)
        assert sender2.call("put", "again", 64 * KIB, 5, 5.0)[:2] == ("put", True)
        got = rx.wait("0", "1", "again", deadline=time.monotonic() + 5)
        assert got is not None and bool((got.tensor == 5).all())
        got.release()
        sender2.stop()
    finally:
        rx.close()
    del views, got
    _assert_nothing_left(before, namespace)
