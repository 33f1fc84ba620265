"""Unconsumed shared-memory payloads expire, and a pool full of them fails a put at once.

* ``buffer_ttl_seconds`` (default 300, 0: never): a payload published and claimed by no reader
  for that long after its put is freed, reported once (a WARNING naming key, size and age) and
  counted (``ttl_reaped`` / ``ttl_reaped_bytes``); its space serves the next put and a reader
  that comes later misses. A payload a reader has claimed never expires under it.
* A put that finds no space fails at once (``put_pool_full``) when every slot in use holds a
  payload nobody claimed, none expires before its deadline, and even the youngest has waited
  longer than the put may; otherwise it waits as before (a reader coming for a fresh payload
  lets it proceed).

Across processes the senders and readers are peer processes (tests/connectors/shm/test_shm_peer.py)
over real
memfd pools and abstract sockets; every peer is killed by PID when its test ends.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from test_shm_peer import Peer, filler, peer_pool, start_peer

from omnikv.connectors.shm.config import DEFAULT_BUFFER_TTL_S, ShmConfig
from omnikv.connectors.shm.connector import SharedMemoryConnector
from omnikv.connectors.shm.store import Unconsumed
from omnikv.connectors.shm.wire import transport_key
from omnikv.errors import ConfigError, PoolExhaustedError

KIB = 1024
STORE_LOGGER = "omnikv.connectors.shm.store"


@pytest.fixture
def peers() -> Iterator[list[Peer]]:
    yield from peer_pool()


@pytest.fixture
def make_sender(namespace: str) -> Iterator[Callable[..., SharedMemoryConnector]]:
    """``make_sender(**config)``: a sending connector in this process (closed at the end)."""
    made: list[SharedMemoryConnector] = []

    def make(**config: Any) -> SharedMemoryConnector:
        c = SharedMemoryConnector({"namespace": namespace, "linger_s": 0, **config})
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def wait_for(what: str, check: Callable[[], bool], timeout: float = 10.0) -> None:
    """Poll ``check`` until it holds; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        threading.Event().wait(0.01)


def put(c: SharedMemoryConnector, key: str, nbytes: int, fill: int, timeout: float) -> float:
    """``put_packed`` of ``nbytes`` bytes of ``fill`` with a deadline ``timeout`` from now;
    the seconds it took."""
    t0 = time.monotonic()
    ok, size, _ = c.put_packed("0", "1", key, nbytes, filler(fill), deadline=t0 + timeout)
    assert ok and size == nbytes
    return time.monotonic() - t0


def expiry_reports(caplog: pytest.LogCaptureFixture, key: str) -> list[tuple[Any, ...]]:
    """``(level, message, args)`` of each expiry report of the payload under transport key
    ``key`` (args: key, size, age, TTL)."""
    return [
        (r.levelno, r.getMessage(), r.args)
        for r in caplog.records
        if r.name == STORE_LOGGER
        and "expired unconsumed" in r.getMessage()
        and isinstance(r.args, tuple)
        and r.args[0] == key
    ]


# -- config ----------------------------------------------------------------------------------
def test_buffer_ttl_seconds_defaults_to_300_and_0_turns_expiry_off() -> None:
    assert ShmConfig.parse({}).buffer_ttl_s == DEFAULT_BUFFER_TTL_S == 300.0
    assert ShmConfig.parse({"buffer_ttl_seconds": None}).buffer_ttl_s == 300.0
    assert ShmConfig.parse({"buffer_ttl_seconds": 0}).buffer_ttl_s == 0.0
    assert ShmConfig.parse({"buffer_ttl_seconds": "2.5"}).buffer_ttl_s == 2.5
    assert ShmConfig.parse({"buffer_ttl_seconds": 60}).buffer_ttl_s == 60.0


@pytest.mark.parametrize("bad", [-1, "soon", True, math.inf, math.nan, [1]])
def test_a_bad_buffer_ttl_seconds_is_a_config_error_naming_it(bad: Any) -> None:
    with pytest.raises(ConfigError, match="buffer_ttl_seconds"):
        ShmConfig.parse({"buffer_ttl_seconds": bad})


@pytest.mark.timeout(20)
def test_health_shows_the_ttl_and_what_is_unconsumed(
    make_sender: Callable[..., SharedMemoryConnector],
) -> None:
    c = make_sender(pool_size_bytes=64 * KIB, buffer_ttl_seconds=0)
    h = c.health()
    assert h["buffer_ttl_seconds"] == 0.0
    assert (h["ttl_reaped"], h["ttl_reaped_bytes"], h["put_pool_full"]) == (0, 0, 0)
    put(c, "a", 10 * KIB, 1, 5.0)
    put(c, "b", 20 * KIB, 2, 5.0)
    h = c.health()
    assert (h["published"], h["published_bytes"]) == (2, 30 * KIB)
    assert h["oldest_published_s"] >= h["youngest_published_s"] >= 0.0


# -- expiry ----------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(40)
def test_an_unconsumed_payload_expires_and_a_late_reader_misses_cleanly(
    make_sender: Callable[..., SharedMemoryConnector],
    peers: list[Peer],
    namespace: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Freed after its TTL (not before), reported once, counted; its space serves a put that
    needs it; a reader asking for it afterwards misses, never reads the bytes now there."""
    caplog.set_level(logging.WARNING, logger=STORE_LOGGER)
    ttl = 1.0  # "fresh" must not expire before the reader, late for "stale", takes it
    tx = make_sender(pool_size_bytes=64 * KIB, buffer_ttl_seconds=ttl)
    reader = start_peer(peers, namespace)
    t_put = time.monotonic()
    put(tx, "stale", 40 * KIB, 1, 5.0)
    wait_for("the expiry", lambda: tx.health()["ttl_reaped"] == 1)
    assert time.monotonic() - t_put >= ttl
    h = tx.health()
    assert h["ttl_reaped_bytes"] == 40 * KIB
    assert (h["published"], h["published_bytes"]) == (0, 0)
    assert h["pool_free_bytes"] == 64 * KIB

    # 40 KiB more fits a 64 KiB pool only in the space the expired payload gave back
    assert put(tx, "fresh", 40 * KIB, 2, 0.0) < 1.0  # deadline now: try once
    assert reader.call("wait", "stale", 0.2, 1) == ("waiting",)
    assert reader.recv(10.0)[0] == "miss"
    assert reader.call("wait", "fresh", 5.0, 2) == ("waiting",)
    assert reader.recv(10.0)[:3] == ("got", 40 * KIB, True)

    ((level, message, args),) = expiry_reports(caplog, transport_key("stale", "0", "1"))  # once
    _key, nbytes, age, logged_ttl = args
    assert level == logging.WARNING and "stale@0_1 (40960 bytes) expired" in message
    assert nbytes == 40 * KIB and age >= ttl and logged_ttl == ttl
    assert tx.health()["ttl_reaped"] == 1


@pytest.mark.slow
@pytest.mark.timeout(40)
def test_a_put_that_needs_the_space_of_an_expiring_payload_waits_for_it(
    peers: list[Peer], namespace: str
) -> None:
    """Both in a sender process: the second put waits (no fail-fast: space comes back before
    its deadline) and proceeds once the first payload expires."""
    sender = start_peer(peers, namespace, pool_size_bytes=64 * KIB, buffer_ttl_seconds=0.5)
    reader = start_peer(peers, namespace)
    assert sender.call("put", "a", 40 * KIB, 1, 5.0)[:3] == ("put", True, 40 * KIB)
    t0 = time.monotonic()
    assert sender.call("put", "b", 40 * KIB, 2, 20.0, timeout=30.0)[:3] == ("put", True, 40 * KIB)
    assert time.monotonic() - t0 < 10.0
    h = sender.call("health")[1]
    assert (h["ttl_reaped"], h["put_waits"], h["put_pool_full"], h["put_timeouts"]) == (1, 1, 0, 0)
    assert reader.call("wait", "b", 5.0, 2) == ("waiting",)
    assert reader.recv(10.0)[:3] == ("got", 40 * KIB, True)
    assert reader.call("wait", "a", 0.3, 1) == ("waiting",)
    assert reader.recv(10.0)[0] == "miss"


@pytest.mark.slow
@pytest.mark.timeout(40)
def test_expiry_does_not_wait_for_the_timer_thread(
    make_sender: Callable[..., SharedMemoryConnector],
    peers: list[Peer],
    namespace: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the timer stopped, a want after the TTL still misses and a put still reclaims."""
    monkeypatch.setattr(Unconsumed, "_run", lambda self: None)
    tx = make_sender(pool_size_bytes=64 * KIB, buffer_ttl_seconds=0.2)
    reader = start_peer(peers, namespace)
    put(tx, "late", 40 * KIB, 1, 5.0)
    put(tx, "later", 8 * KIB, 3, 5.0)
    wait_for("the TTL to pass", lambda: tx.health()["youngest_published_s"] >= 0.2)
    assert tx.health()["ttl_reaped"] == 0  # nobody has looked yet
    assert reader.call("wait", "late", 0.3, 1) == ("waiting",)
    assert reader.recv(10.0)[0] == "miss"
    h = tx.health()
    assert (h["ttl_reaped"], h["published"]) == (2, 0)  # the want reaped both
    put(tx, "again", 40 * KIB, 2, 0.0)
    put(tx, "again2", 20 * KIB, 4, 5.0)
    wait_for("the TTL to pass", lambda: tx.health()["youngest_published_s"] >= 0.2)
    put(tx, "third", 40 * KIB, 5, 0.0)  # the put reaps what it needs, try once
    assert tx.health()["ttl_reaped"] == 4


@pytest.mark.timing
@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_reader_holding_a_payload_past_its_ttl_keeps_its_bytes(
    make_sender: Callable[..., SharedMemoryConnector], peers: list[Peer], namespace: str
) -> None:
    """A claimed payload never expires: the reader keeps it past the TTL while the pool is
    reused around it (its span migrates to the reader's memory under pressure)."""
    tx = make_sender(pool_size_bytes=256 * KIB, buffer_ttl_seconds=0.3)
    reader = start_peer(peers, namespace)
    assert reader.call("wait_hold", "kept", 10.0, 5) == ("waiting",)
    put(tx, "kept", 64 * KIB, 5, 5.0)
    assert reader.recv(10.0)[:3] == ("got", 64 * KIB, True)
    put(tx, "other", 64 * KIB, 6, 5.0)  # published after "kept", claimed by nobody
    wait_for("the other payload's expiry", lambda: tx.health()["ttl_reaped"] == 1)
    h = tx.health()
    assert (h["held_by_readers"], h["ttl_reaped"], h["ttl_reaped_bytes"]) == (1, 1, 64 * KIB)
    for i in range(4):  # the whole pool: "kept"'s slot is needed, the reader gives it back
        put(tx, f"fill{i}", 64 * KIB, 7 + i, 10.0)
    assert reader.call("held") == ("held", [(64 * KIB, 5, 5)])
    h = tx.health()
    assert (h["held_by_readers"], h["ttl_reaped"], h["put_pool_full"]) == (0, 1, 0)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_readers_racing_expiry_get_their_bytes_or_a_clean_miss(
    make_sender: Callable[..., SharedMemoryConnector], peers: list[Peer], namespace: str
) -> None:
    """A sender cycles 60 payloads through a pool of four slots with a 100 ms TTL; a slow
    reader asks for two in three of them 0, 50, 100 or 150 ms after their put (around their
    expiry) and keeps some of what it gets. Every payload it gets holds its own bytes, now and
    at the end (while expired slots were reused around it); every other ask is a clean miss."""
    n, skip_every, ttl = 60, 3, 0.1
    tx = make_sender(pool_size_bytes=64 * KIB, buffer_ttl_seconds=ttl)
    reader = start_peer(peers, namespace)
    reader.send("race", n, skip_every, 4, 0.05, ttl / 2)
    for i in range(n):
        put(tx, f"r{i}", 16 * KIB, i % 251, 10.0)
        assert reader.recv(30.0) == ("raced", i)  # the next put comes once it was asked for
    kind, got, missed, wrong = reader.recv(30.0)
    asked = n - len(range(0, n, skip_every))
    assert kind == "race" and wrong == 0, (got, missed, wrong)
    assert got + missed == asked and missed > 0, (got, missed)  # 150 ms late: always expired
    wait_for("every payload consumed or expired", lambda: tx.health()["published"] == 0)
    h = tx.health()
    assert h["puts"] == n and h["put_failures"] == 0 and h["put_pool_full"] == 0
    assert h["ttl_reaped"] + got == n  # each payload was taken once or expired once


# -- a full pool -----------------------------------------------------------------------------
@pytest.mark.timing  # a bound of 0.5 s or less past a deadline: run alone, after the lanes
@pytest.mark.slow
@pytest.mark.timeout(40)
@pytest.mark.parametrize("ttl", [300, 0])
def test_a_pool_full_of_payloads_nobody_came_for_fails_a_put_at_once(
    peers: list[Peer], namespace: str, ttl: float
) -> None:
    sender = start_peer(peers, namespace, pool_size_bytes=1 << 20, buffer_ttl_seconds=ttl)
    for i in range(4):
        assert sender.call("put", f"k{i}", 256 * KIB, i, 5.0)[1] is True
    # nobody came for any of them for longer than the next put may wait (1 s)
    wait_for("the payloads to age", lambda: sender.call("health")[1]["youngest_published_s"] > 1.0)
    t0 = time.monotonic()
    answer = sender.call("put", "more", 256 * KIB, 9, 1.0)
    assert time.monotonic() - t0 < 0.5  # well under its 1 s deadline
    assert answer[0] == "error" and answer[1].startswith("PoolExhaustedError"), answer
    msg = answer[1]
    assert "4 published payload(s) of 1048576 bytes that no receiver has claimed" in msg
    assert "the oldest (k0)" in msg and "failing at once" in msg
    if ttl:
        assert "they expire 300s after their put (buffer_ttl_seconds), the first in 29" in msg
    else:
        assert "buffer_ttl_seconds is 0, so they never expire" in msg
    h = sender.call("health")[1]
    assert (h["put_pool_full"], h["put_timeouts"], h["put_waits"]) == (1, 0, 0)
    assert h["published"] == 4

    # a reader that does come frees a slot: the next put gets it (waiting for the release)
    reader = start_peer(peers, namespace)
    assert reader.call("wait", "k2", 5.0, 2) == ("waiting",)
    assert reader.recv(10.0)[:3] == ("got", 256 * KIB, True)
    assert sender.call("put", "more", 256 * KIB, 9, 10.0, timeout=20.0)[1] is True


@pytest.mark.slow
@pytest.mark.timeout(40)
def test_a_pool_full_of_fresh_payloads_makes_a_put_wait_for_a_reader(
    make_sender: Callable[..., SharedMemoryConnector], peers: list[Peer], namespace: str
) -> None:
    """Back-pressure is kept: payloads put moments ago may well be taken soon, so a put waits
    for a reader (here one that comes while it waits) instead of failing."""
    tx = make_sender(pool_size_bytes=1 << 20)
    for i in range(4):
        put(tx, f"k{i}", 256 * KIB, i, 5.0)
    result: list[Any] = []

    def more() -> None:
        try:
            result.append(put(tx, "more", 256 * KIB, 9, 20.0))
        except PoolExhaustedError as exc:  # recorded for the assertion below
            result.append(exc)

    waiter = threading.Thread(target=more)
    waiter.start()
    try:
        wait_for("the put to wait", lambda: tx.health()["put_waits"] == 1)
        reader = start_peer(peers, namespace)
        assert reader.call("wait", "k0", 5.0, 0) == ("waiting",)
        assert reader.recv(10.0)[:3] == ("got", 256 * KIB, True)
    finally:
        waiter.join(30.0)
    assert not waiter.is_alive() and len(result) == 1 and isinstance(result[0], float), result
    h = tx.health()
    assert (h["put_pool_full"], h["put_timeouts"]) == (0, 0)


@pytest.mark.timing  # a bound of 0.5 s or less past a deadline: run alone, after the lanes
@pytest.mark.timeout(40)
def test_a_full_pool_serves_the_newest_hand_off(
    make_sender: Callable[..., SharedMemoryConnector], caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 39 item 9: eight hand-offs nobody comes for (``do_remote_decode`` requests whose
    parameters are never used) fill the pool; past ``unclaimed_grace_seconds`` a genuine put
    gets their space at once, the oldest first and no more than it needs, counted, logged with
    their keys and reported ``expired``. Before, every put failed at once until the 300 s TTL
    ("the first in 29x s")."""
    from omnikv.connectors.delivery import DeliveryReport

    tx = make_sender(pool_size_bytes=1 << 20, unclaimed_grace_seconds=0.5)
    reports: list[DeliveryReport] = []
    tx.set_delivery_listener(reports.append)
    for i in range(8):
        put(tx, f"unused{i}", 128 * KIB, i, 5.0)
    wait_for("the grace to pass", lambda: tx.health()["oldest_published_s"] > 0.6)
    caplog.set_level(logging.WARNING, logger=STORE_LOGGER)
    took = put(tx, "genuine", 200 * KIB, 9, 1.0)
    assert took < 0.5
    h = tx.health()
    assert (h["grace_evicted"], h["grace_evicted_bytes"]) == (2, 256 * KIB), h
    assert (h["put_pool_full"], h["ttl_reaped"], h["published"]) == (0, 0, 7), h
    lines = [r.getMessage() for r in caplog.records if "unclaimed_grace_seconds" in r.getMessage()]
    assert len(lines) == 1 and "unused0, unused1" in lines[0] and "unused2" not in lines[0]
    expired = sorted(r.key for r in reports if r.verdict.value == "expired")
    assert expired == ["unused0", "unused1"], reports


@pytest.mark.timeout(40)
def test_within_the_grace_a_put_waits_for_it_instead_of_failing(
    make_sender: Callable[..., SharedMemoryConnector],
) -> None:
    tx = make_sender(pool_size_bytes=1 << 20, unclaimed_grace_seconds=1.0)
    for i in range(4):
        put(tx, f"k{i}", 256 * KIB, i, 5.0)
    took = put(tx, "next", 256 * KIB, 9, 5.0)  # fits once k0 passes its grace
    h = tx.health()
    assert 0.5 < took < 3.0 and h["grace_evicted"] == 1 and h["put_waits"] == 1, (took, h)


def test_the_grace_is_a_config_key() -> None:
    assert ShmConfig.parse({}).unclaimed_grace_s == 10.0
    assert ShmConfig.parse({"unclaimed_grace_seconds": 2}).unclaimed_grace_s == 2.0
    with pytest.raises(ConfigError, match="unclaimed_grace_seconds"):
        ShmConfig.parse({"unclaimed_grace_seconds": -1})
