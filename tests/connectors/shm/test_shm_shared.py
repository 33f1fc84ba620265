"""One payload read by several readers of the node (``put_shared``): written once, each reader
maps the same slot, and the slot goes back to the pool when the last reader is done or at the
TTL, whatever the readers do.

The sender is a real connector in this process (its counters and pool are asserted on); the
readers are real connector processes of the same namespace (``test_shm_peer``'s peers), reading
over real shared memory.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from test_shm_peer import Peer, filler, peer_pool, start_peer

from omnikv.connectors.delivery import DeliveryReport, Verdict
from omnikv.connectors.shm.connector import SharedMemoryConnector
from omnikv.connectors.shm.shared import MAX_SHARED_READERS
from omnikv.errors import ConfigError

pytestmark = pytest.mark.timeout(60)

MIB = 1 << 20


@pytest.fixture
def peers() -> Iterator[list[Peer]]:
    yield from peer_pool()


def _until(cond: Callable[[], bool], timeout: float = 10.0) -> float:
    """Poll ``cond`` (the sender's state, which the test cannot be notified of) until true or
    fail; the seconds it took."""
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "condition not reached"
        time.sleep(0.005)
    return time.monotonic() - t0


def _sender(namespace: str, **config: Any) -> SharedMemoryConnector:
    return SharedMemoryConnector(
        {"namespace": namespace, "linger_s": 0, "pool_size_bytes": 16 * MIB, **config}
    )


def _pool_empty(tx: SharedMemoryConnector) -> bool:
    h = tx.health()
    return bool(h["pool_free_bytes"] == h["pool_size_bytes"])


@pytest.mark.slow
def test_four_readers_map_one_write(peers: list[Peer], namespace: str) -> None:
    """Two readers wait before the put, two come after it: all four get the whole payload,
    the bytes went into the pool once (``put_bytes``), each reader took its own claim, a fifth
    reader finds nothing, and the slot is free once the four released."""
    tx = _sender(namespace)
    try:
        readers = [start_peer(peers, namespace) for _ in range(5)]
        nbytes = 3 * MIB + 17
        for r in readers[:2]:
            r.send("wait_hold", "kv", 20.0, 7)
            assert r.recv()[0] == "waiting"
        _until(lambda: tx.health()["waiting_receivers"] >= 2)
        ok, size, _ = tx.put_shared("0", "1", "kv", nbytes, filler(7), readers=4)
        assert ok and size == nbytes
        for r in readers[2:4]:
            r.send("wait_hold", "kv", 20.0, 7)
            assert r.recv()[0] == "waiting"
        for r in readers[:4]:
            assert r.recv(20.0)[:3] == ("got", nbytes, True)
        h = tx.health()
        assert (h["puts"], h["put_bytes"]) == (1, nbytes)  # written once for four readers
        assert (h["shared_puts"], h["shared_claims"]) == (1, 4)
        assert h["published"] == 0 and h["held_by_readers"] == 4
        assert not _pool_empty(tx)  # every reader still maps it
        assert readers[4].call("wait", "kv", 0.3, 7, timeout=20.0) == ("waiting",)
        assert readers[4].recv(20.0)[0] == "miss"  # no fifth claim
        for r in readers[:3]:
            assert r.call("release") == ("released",)
        _until(lambda: tx.health()["held_by_readers"] == 1)
        assert not _pool_empty(tx)  # the last holder keeps the slot
        assert readers[3].call("release") == ("released",)
        _until(lambda: _pool_empty(tx))
        assert tx.health()["releases"] == 4
    finally:
        tx.close(linger=False)


@pytest.mark.slow
def test_a_reader_that_dies_and_one_that_never_comes_free_the_slot_at_the_ttl(
    peers: list[Peer], namespace: str
) -> None:
    """Three claims: one reader releases, one is SIGKILLed while it holds the payload, one never
    comes. The slot stays while its last claim may still come, and goes back to the pool at
    the TTL (``ttl_reaped``), not later."""
    ttl = 4.0
    tx = _sender(namespace, buffer_ttl_seconds=ttl)
    try:
        done, dies = start_peer(peers, namespace), start_peer(peers, namespace)
        t_put = time.monotonic()
        assert tx.put_shared("0", "1", "kv", MIB, filler(3), readers=3)[0]
        for r in (done, dies):
            assert r.call("wait_hold", "kv", 20.0, 3) == ("waiting",)
            assert r.recv(20.0)[:3] == ("got", MIB, True)
        assert done.call("release") == ("released",)
        dies.kill()
        _until(lambda: tx.health()["reclaimed_from_dead_readers"] == 1)
        t_look = time.monotonic()
        h = tx.health()
        assert h["held_by_readers"] == 0
        if t_look - t_put < ttl - 0.2:  # (a host slow enough to reach the TTL first skips this)
            assert h["published"] == 1
            assert not _pool_empty(tx)  # the third claim may still come
        _until(lambda: _pool_empty(tx), timeout=ttl + 5.0)
        assert time.monotonic() - t_put < ttl + 5.0
        h = tx.health()
        assert (h["ttl_reaped"], h["published"], h["puts"]) == (1, 0, 1)
    finally:
        tx.close(linger=False)


@pytest.mark.slow
def test_readers_holding_past_the_ttl_keep_their_view(peers: list[Peer], namespace: str) -> None:
    """The TTL drops only the claims nobody took: a reader that holds the payload past it keeps
    intact bytes, and the slot is freed by its release."""
    tx = _sender(namespace, buffer_ttl_seconds=0.5)
    try:
        reader = start_peer(peers, namespace)
        assert tx.put_shared("0", "1", "kv", MIB, filler(9), readers=2)[0]
        assert reader.call("wait_hold", "kv", 20.0, 9) == ("waiting",)
        assert reader.recv(20.0)[:3] == ("got", MIB, True)
        _until(lambda: tx.health()["ttl_reaped"] == 1)
        assert not _pool_empty(tx)
        # a new payload may take free space, never the held slot
        assert tx.put_packed("0", "1", "other", 8 * MIB, filler(1))[0]
        assert reader.call("held") == ("held", [(MIB, 9, 9)])
        assert reader.call("release") == ("released",)
        tx.withdraw("0", "1", "other")
        _until(lambda: _pool_empty(tx))
    finally:
        tx.close(linger=False)


def test_in_process_readers_see_the_same_pages(namespace: str) -> None:
    """Readers of the put's own connector get views of one slot (the same bytes, no copy),
    each its own claim; the slot is freed when both are released."""
    tx = _sender(namespace)
    try:
        pattern = torch.arange(MIB, dtype=torch.int64).remainder_(251).to(torch.uint8)

        def write(t: torch.Tensor) -> None:
            t.copy_(pattern)

        assert tx.put_shared("0", "1", "kv", MIB, write, readers=2)[0]
        bufs = [tx.wait("0", "1", "kv", deadline=time.monotonic() + 10.0) for _ in range(2)]
        assert all(b is not None for b in bufs)
        a, b = (x for x in bufs if x is not None)
        assert torch.equal(a.tensor, pattern) and torch.equal(b.tensor, pattern)
        assert a.tensor.data_ptr() == b.tensor.data_ptr()  # one mapping, one slot
        assert tx.get("0", "1", "kv") is None  # both claims taken
        a.release()
        assert not _pool_empty(tx)
        b.release()
        _until(lambda: _pool_empty(tx))
    finally:
        tx.close(linger=False)


@pytest.mark.parametrize("readers", [0, -1, MAX_SHARED_READERS + 1, True, 2.0, "4"])
def test_reader_counts_are_bounded(namespace: str, readers: Any) -> None:
    """A reader count outside 1..MAX_SHARED_READERS (or not an int) is refused before anything
    is written."""
    tx = _sender(namespace)
    try:
        with pytest.raises(ValueError, match="readers"):
            tx.put_shared("0", "1", "kv", 16, filler(1), readers=readers, deadline=math.inf)
        assert tx.health()["puts"] == 0
    finally:
        tx.close(linger=False)


def test_the_last_claims_reader_gives_the_one_verdict(namespace: str) -> None:
    """A shared payload is reported once: the first reader's offer asks for no verdict (its
    acknowledge is not sent), the reader of the last claim's is the one reported."""
    tx = _sender(namespace)
    rx = SharedMemoryConnector({"namespace": namespace})
    reports: list[DeliveryReport] = []
    tx.set_delivery_listener(reports.append)
    try:
        assert tx.put_shared("0", "1", "kv", MIB, filler(5), readers=2)[0]
        first = rx.wait("0", "1", "kv", deadline=time.monotonic() + 10.0)
        assert first is not None
        rx.acknowledge("0", "1", "kv", Verdict.DELIVERED)
        assert rx.health()["acks_sent"] == 0  # the first claim's offer asked for none
        last = rx.wait("0", "1", "kv", deadline=time.monotonic() + 10.0)
        assert last is not None
        rx.acknowledge("0", "1", "kv", Verdict.REFUSED, "bad data")
        _until(lambda: len(reports) == 1)
        assert (reports[0].key, reports[0].verdict) == ("kv", Verdict.REFUSED)
        first.release()
        last.release()
        _until(lambda: _pool_empty(tx))
        assert len(reports) == 1
    finally:
        rx.close(linger=False)
        tx.close(linger=False)


def test_claims_left_at_the_ttl_report_expired(namespace: str) -> None:
    """A reader that never came: the payload is reported ``expired`` at its TTL, once."""
    tx = _sender(namespace, buffer_ttl_seconds=0.3)
    rx = SharedMemoryConnector({"namespace": namespace})
    reports: list[DeliveryReport] = []
    tx.set_delivery_listener(reports.append)
    try:
        assert tx.put_shared("0", "1", "kv", MIB, filler(5), readers=2)[0]
        got = rx.wait("0", "1", "kv", deadline=time.monotonic() + 10.0)
        assert got is not None
        _until(lambda: len(reports) == 1)
        assert (reports[0].key, reports[0].verdict) == ("kv", Verdict.EXPIRED)
        assert "TTL" in (reports[0].reason or "")
        got.release()
        _until(lambda: _pool_empty(tx))
    finally:
        rx.close(linger=False)
        tx.close(linger=False)


def test_shared_readers_in_the_config_shares_every_put(namespace: str) -> None:
    """``shared_readers: 3``: a plain ``put_packed`` is published for three readers (the
    managers' path, unchanged); a count outside 1..64 is refused when the connector is built."""
    tx = _sender(namespace, shared_readers=3)
    try:
        assert tx.put_packed("0", "1", "kv", MIB, filler(4))[0]
        bufs = [tx.wait("0", "1", "kv", deadline=time.monotonic() + 10.0) for _ in range(3)]
        assert all(b is not None and bool((b.tensor == 4).all()) for b in bufs)
        h = tx.health()
        assert (h["puts"], h["put_bytes"], h["shared_puts"], h["shared_claims"]) == (1, MIB, 1, 3)
        for b in bufs:
            assert b is not None
            b.release()
        _until(lambda: _pool_empty(tx))
    finally:
        tx.close(linger=False)
    for bad in (0, MAX_SHARED_READERS + 1, "many"):
        with pytest.raises(ConfigError, match="shared_readers"):
            SharedMemoryConnector({"namespace": namespace, "shared_readers": bad})


@pytest.mark.slow
def test_a_full_pool_moves_every_readers_view_out(peers: list[Peer], namespace: str) -> None:
    """Readers keep a shared payload as long as they like: a put that needs its space asks each
    holder to move its view to private memory; the slot is freed once both did, the put fits,
    and both views still hold the payload's bytes."""
    tx = _sender(namespace)
    try:
        readers = [start_peer(peers, namespace) for _ in range(2)]
        assert tx.put_shared("0", "1", "kv", 6 * MIB, filler(9), readers=2)[0]
        for r in readers:
            assert r.call("wait_hold", "kv", 20.0, 9) == ("waiting",)
            assert r.recv(20.0)[:3] == ("got", 6 * MIB, True)
        ok, _, _ = tx.put_packed(
            "0", "1", "big", 12 * MIB, filler(1), deadline=time.monotonic() + 20.0
        )
        assert ok
        h = tx.health()
        assert h["evictions"] >= 2 and h["releases"] == 2
        for r in readers:
            assert r.call("held") == ("held", [(6 * MIB, 9, 9)])
            assert r.call("release") == ("released",)
    finally:
        tx.close(linger=False)
