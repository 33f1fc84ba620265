"""The shared-memory data-lifetime contract, with real processes.

* A sender that exits normally (returns from main, or calls ``close()``) while it holds
  unconsumed payloads lingers up to ``linger_s`` until they are consumed; what is left then is
  dropped with a WARNING naming the keys. ``flush(timeout)`` waits explicitly.
* A receiver may keep everything it received for as long as it likes: the sender never blocks
  or fails because of it (held spans migrate to the receiver's private memory under pressure).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
from test_shm_peer import Peer, peer_pool, start_peer

from omnikv.connectors.shm.connector import SharedMemoryConnector
from support import paths

pytestmark = pytest.mark.slow

KIB = 1024
_SRC = str(paths.SRC)
_SENDER = """
import sys
from omnikv.connectors.shm.connector import SharedMemoryConnector
ns, linger, mode = sys.argv[1], float(sys.argv[2]), sys.argv[3]
c = SharedMemoryConnector({"namespace": ns, "linger_s": linger, "pool_size_bytes": 1 << 20})
for key in ("first", "second"):
    assert c.put("0", "1", key, key.encode() * 1000)[0]
print("sent", flush=True)
if mode == "close":
    c.close()
    print("closed", flush=True)
# mode "return": fall off the end of main, interpreter exit
"""


def _mp_sender(conn: Any, namespace: str) -> None:
    """A multiprocessing child stage: put, say so, return from its target (no close)."""
    c = SharedMemoryConnector({"namespace": namespace, "linger_s": 30, "pool_size_bytes": 1 << 20})
    assert c.put("0", "1", "from-child", b"kv" * 100)[0]
    conn.send("sent")


@pytest.fixture
def peers() -> Iterator[list[Peer]]:
    yield from peer_pool()


def _start_sender(namespace: str, linger: float, mode: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": _SRC}
    proc = subprocess.Popen(
        [sys.executable, "-c", _SENDER, namespace, str(linger), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "sent"
    return proc


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["return", "close"])
def test_an_exiting_sender_lingers_until_its_payloads_are_consumed(
    namespace: str, mode: str
) -> None:
    # A linger far longer than an exit takes on a loaded host: leaving once consumed and
    # leaving at the linger's end stay apart however slow the interpreter's exit is.
    proc = _start_sender(namespace, 60.0, mode)
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(1.0)  # done with main (or close() called), lingering for its reader
        rx = SharedMemoryConnector({"namespace": namespace})
        try:
            for key in ("first", "second"):
                got = rx.wait("0", "1", key, deadline=time.monotonic() + 20)
                assert got is not None and got.to_bytes() == key.encode() * 1000
                got.release()
            t0 = time.monotonic()
            assert proc.wait(50) == 0
            assert time.monotonic() - t0 < 30  # it left once consumed, not after 60 s
        finally:
            rx.close()
        assert proc.stderr is not None
        assert "dropped" not in proc.stderr.read()
    finally:
        _stop(proc)


@pytest.mark.timeout(90)
def test_a_sender_drops_after_linger_and_names_what_it_dropped(namespace: str) -> None:
    proc = _start_sender(namespace, 0.5, "return")
    try:
        assert proc.wait(30) == 0
        assert proc.stderr is not None
        err = proc.stderr.read()
        assert "dropped 2 unconsumed payload(s): first, second" in err, err
    finally:
        _stop(proc)


@pytest.mark.timeout(30)
def test_flush_waits_and_returns_what_is_still_unconsumed(namespace: str) -> None:
    tx = SharedMemoryConnector({"namespace": namespace, "linger_s": 0})
    rx = SharedMemoryConnector({"namespace": namespace})
    try:
        assert tx.put("0", "1", "a", b"1")[0] and tx.put("0", "1", "b", b"2")[0]
        t0 = time.monotonic()
        assert tx.flush(timeout=0.2) == ["a", "b"]
        assert 0.2 <= time.monotonic() - t0 < 1.0
        got = rx.wait("0", "1", "a", deadline=time.monotonic() + 5)
        assert got is not None
        assert tx.flush(timeout=0.1) == ["b"]  # taken by a reader = consumed, even if held
        got.release()
        assert rx.get("0", "1", "b") is not None
        assert tx.flush() == []  # no timeout: returns at once when nothing is left
    finally:
        tx.close()
        rx.close()


@pytest.mark.timeout(120)
def test_a_receiver_holding_everything_never_stalls_the_sender(
    peers: list[Peer], namespace: str
) -> None:
    """The sender's pool is 1 MiB; it sends 80 x 64 KiB (5x its pool) while we keep every view."""
    n = 80
    sender = start_peer(peers, namespace, pool_size_bytes=1 << 20, linger_s=0)
    rx = SharedMemoryConnector({"namespace": namespace})
    held = []
    try:
        sender.send("churn_put", n)
        for i in range(n):
            got = rx.wait("0", "1", f"c{i}", deadline=time.monotonic() + 30)
            assert got is not None, f"c{i} did not arrive"
            held.append(got)
            assert sender.recv(30.0) == ("progress", i)
        for i, buf in enumerate(held):  # every held view kept its own bytes
            assert buf.size == 64 * KIB and bool((buf.tensor == i % 251).all()), i
        health = sender.call("health")[1]
        assert health["put_timeouts"] == 0 and health["put_failures"] == 0
        assert health["evictions"] >= n - 16
        assert rx.health()["migrated"] >= n - 16  # zero-copy while it fit, then migrated
    finally:
        for buf in held:
            buf.release()
        rx.close()


@pytest.mark.timeout(90)
def test_a_multiprocessing_child_that_returns_lingers_too(namespace: str) -> None:
    ctx = mp.get_context("forkserver")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_mp_sender, args=(child, namespace))
    proc.start()
    rx = SharedMemoryConnector({"namespace": namespace})
    try:
        assert parent.poll(60) and parent.recv() == "sent"
        proc.join(1.0)
        assert proc.is_alive()  # returned from its target, lingering for its reader
        got = rx.wait("0", "1", "from-child", deadline=time.monotonic() + 20)
        assert got is not None and got.to_bytes() == b"kv" * 100
        got.release()
        proc.join(20)
        assert proc.exitcode == 0
    finally:
        rx.close()
        if proc.is_alive() and proc.pid is not None:
            os.kill(proc.pid, 9)
            proc.join(10)
