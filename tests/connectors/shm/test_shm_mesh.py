"""The shared-memory peer mesh (``mesh``, ``wire``) under attack, with real processes.

* Another uid holding the namespace's lock name, squatting a listener with a full backlog under
  our prefix and pre-creating our lock directory delays neither connector creation nor a
  receive beyond the caller's deadline.
* A same-uid peer over the per-connection bounds (outstanding wants, passed descriptors) is
  disconnected and logged; its state is reclaimed.
* A probe counts a peer whose connection ended before it answered as holding nothing, and one
  still connected that stays silent as unknown.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

from omnikv.connectors.base import KeyProbe, KeyState
from omnikv.connectors.shm.connector import SharedMemoryConnector
from omnikv.connectors.shm.mesh import MAX_FDS_PER_LINK
from omnikv.connectors.shm.store import MAX_WANTS_PER_LINK
from support.fds import FD_SETSIZE, descriptors_past
from support.polling import until
from support.shm_attack import Attacker


@pytest.fixture
def attackers() -> Iterator[list[Attacker]]:
    started: list[Attacker] = []
    yield started
    for a in started:
        a.stop()


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.timing
@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists("/usr/bin/python3"),
    reason="needs root and a system python3 to run an attacker as another uid",
)
def test_another_uid_cannot_stall_joining_or_receiving(
    namespace: str, attackers: list[Attacker]
) -> None:
    squatted = f"/tmp/omnikv-{os.getuid()}"
    existed = os.path.exists(squatted)
    attackers.append(Attacker(namespace, "squat", user=65534))
    try:
        assert attackers[0].ready() == "ready"
        t0 = time.monotonic()
        tx = SharedMemoryConnector({"namespace": namespace, "join_timeout_s": 2, "linger_s": 0})
        rx = SharedMemoryConnector({"namespace": namespace, "join_timeout_s": 2})
        joined = time.monotonic() - t0
        try:
            assert joined < 1.0, f"joining took {joined:.2f}s"
            t1 = time.monotonic()
            assert rx.wait("0", "1", "absent", deadline=t1 + 0.5) is None
            assert time.monotonic() - t1 < 0.8  # the caller's deadline, not the squatter's
            assert tx.put("0", "1", "k", b"data")[0]
            got = rx.wait("0", "1", "k", deadline=time.monotonic() + 5)
            assert got is not None and got.to_bytes() == b"data"
            got.release()
            assert rx.health()["peers"] == 1  # the squatter is no peer
        finally:
            tx.close()
            rx.close()
    finally:
        attackers[0].stop()
        st = os.lstat(squatted) if os.path.lexists(squatted) else None
        if not existed and st is not None and st.st_uid == 65534:
            os.rmdir(squatted)


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("scenario", "bound"), [("wants", MAX_WANTS_PER_LINK), ("fds", MAX_FDS_PER_LINK)]
)
def test_a_peer_over_its_bounds_is_disconnected_and_logged(
    namespace: str,
    attackers: list[Attacker],
    scenario: str,
    bound: int,
    caplog: pytest.LogCaptureFixture,
) -> None:
    c = SharedMemoryConnector({"namespace": namespace})
    try:
        fds_before = _open_fds()
        attackers.append(Attacker(namespace, scenario))
        assert attackers[0].ready() == "ready"
        result = attackers[0].result()
        assert result.startswith("disconnected after"), result
        sent = int(result.rsplit(" ", 1)[1])
        assert sent <= bound + 4096  # frames in flight when the bound tripped
        deadline = time.monotonic() + 5
        while c.health()["peers"] and time.monotonic() < deadline:
            time.sleep(0.01)  # bounded poll of a public view: the I/O thread reclaims
        health = c.health()
        assert health["peers"] == 0 and health["peers_dropped"] == 1
        assert health["waiting_receivers"] == 0
        while _open_fds() > fds_before + 2 and time.monotonic() < deadline:
            time.sleep(0.01)  # the socket closes right after the peer count drops
        assert _open_fds() <= fds_before + 2  # the attacker's pipes; every passed fd closed
        assert any("dropping shared-memory peer" in r.message for r in caplog.records)
    finally:
        c.close()


@pytest.mark.timeout(30)
def test_joins_at_once_meet_exactly_once_and_leave_no_lock_file(namespace: str) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from omnikv.connectors.shm.wire import namespace_prefix, private_dir

    with ThreadPoolExecutor(4) as pool:
        conns = list(pool.map(lambda _: SharedMemoryConnector({"namespace": namespace}), range(4)))
    try:
        deadline = time.monotonic() + 5
        while any(c.health()["peers"] != 3 for c in conns) and time.monotonic() < deadline:
            time.sleep(0.01)  # bounded poll of a public view: accepts land on the I/O threads
        assert [c.health()["peers"] for c in conns] == [3, 3, 3, 3]
    finally:
        for c in conns:
            c.close()
    digest = namespace_prefix(namespace).rstrip("/").rsplit("/", 1)[-1]
    assert not [n for n in os.listdir(private_dir()) if digest in n]


@pytest.mark.timeout(60)
def test_a_process_past_1024_descriptors_joins_and_receives(namespace: str) -> None:
    """A connector made in a process whose new descriptors are numbered past ``select``'s
    ``FD_SETSIZE`` (a stage holding many connections) joins its peer and receives: no wait of
    the mesh (joining, leading, wake-ups) may use ``select``, which refuses such numbers."""
    with descriptors_past() as first:
        assert first >= FD_SETSIZE
        tx = SharedMemoryConnector({"namespace": namespace, "join_timeout_s": 5})
        rx = SharedMemoryConnector({"namespace": namespace, "join_timeout_s": 5})
        try:
            until(lambda: rx.health()["peers"] == 1 and tx.health()["peers"] == 1, 10.0)
            assert tx.put("0", "1", "k", b"data")[0]
            got = rx.wait("0", "1", "k", deadline=time.monotonic() + 10)
            assert got is not None and got.to_bytes() == b"data"
            got.release()
        finally:
            rx.close()
            tx.close()


#: A probe's deadline where a peer goes away: far above a peer's answer on any host, so a probe
#: that ends before it did not wait it out.
PROBE_BOUND_S = 30.0


def _probe_with(
    namespace: str, attackers: list[Attacker], scenario: str, within_s: float
) -> KeyProbe:
    """``probe`` (deadline ``within_s``) of a never-put key by a receiver whose one peer is the
    attacker ``scenario``, connected before the probe asks."""
    rx = SharedMemoryConnector({"namespace": namespace})
    try:
        attackers.append(Attacker(namespace, scenario))
        assert attackers[-1].ready() == "ready"
        until(lambda: rx.health()["peers"] == 1, 20.0, "the attacker connected")
        return rx.probe("0", "1", "never", deadline=time.monotonic() + within_s)
    finally:
        rx.close()


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_probe_counts_a_peer_gone_before_it_answered_as_holding_nothing(
    namespace: str, attackers: list[Attacker]
) -> None:
    """A sender killed while a probe asks it (here: it exits on the question) offers nothing:
    the probe says ``missing`` as soon as the connection ends, not ``unknown`` at its deadline."""
    t0 = time.monotonic()
    got = _probe_with(namespace, attackers, "vanish", PROBE_BOUND_S)
    assert got.state is KeyState.MISSING, got
    assert time.monotonic() - t0 < PROBE_BOUND_S
    assert attackers[-1].proc.wait(10) == 0  # it exited on the question, unanswered


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_probe_names_a_connected_peer_that_does_not_answer(
    namespace: str, attackers: list[Attacker]
) -> None:
    """The other side of the rule above: a peer still connected that stays silent may hold the
    key, so the probe says ``unknown`` at its deadline and names how many were silent."""
    got = _probe_with(namespace, attackers, "mute", 0.5)
    assert got.state is KeyState.UNKNOWN, got
    assert got.detail == "1 of 2 peer(s) did not answer", got
    assert attackers[-1].ready() == "asked"  # the question reached it
