"""Diagnosable waits on shared memory, with real sender processes.

* A receive that times out says whether any sender was seen in its namespace (alive, gone) and
  which keys wait there unconsumed (a bounded list), or that its key arrived after the deadline.
* A sender whose process is gone makes the receive ``peer_gone`` (``PeerGoneError``), not a
  plain timeout: SIGKILLed while a receiver waits, and SIGKILLed before the receiver started
  (the namespace's sender records, ``registry``). One that closes leaves no record.
* A sender that lingers at exit for unconsumed payloads logs one INFO line when it starts.

Senders are peer processes (tests/connectors/shm/test_shm_peer.py) or a script run with
``python -c``; every one is stopped by PID. "The receiver waits" is established from the
sender's own view (its ``waiting_receivers``), polled with a bound, never by sleeping.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_shm_peer import Peer, peer_pool, start_peer

from omnikv import OmniKVCacheConfig, OmniKVTransferManager, ReceiveStatus
from omnikv.connectors.base import MissReport
from omnikv.connectors.shm import registry
from omnikv.connectors.shm.connector import SharedMemoryConnector
from omnikv.connectors.shm.diag import MAX_KEYS_SHOWN
from omnikv.connectors.shm.wire import namespace_prefix
from omnikv.errors import PeerGoneError
from omnikv.transfer.receive import ReceiveResult
from support import paths
from support.polling import until

pytestmark = pytest.mark.slow

KIB = 1024
_SRC = str(paths.SRC)
_LINGERING_SENDER = """
import logging, sys
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
from omnikv.connectors.shm.connector import SharedMemoryConnector
c = SharedMemoryConnector({"namespace": sys.argv[1], "linger_s": 0.5, "pool_size_bytes": 1 << 20})
for key in ("first", "second"):
    assert c.put("0", "1", key, key.encode() * 1000)[0]
print("sent", flush=True)
"""


@pytest.fixture
def peers() -> Iterator[list[Peer]]:
    yield from peer_pool()


def _receiver(namespace: str, recv_timeout: float) -> OmniKVTransferManager:
    """A receiving stage (stage 1 of the edge 0 -> 1) on shared memory."""
    return OmniKVTransferManager(
        OmniKVCacheConfig(
            connector_config={"type": "SharedMemoryConnector", "namespace": namespace},
            from_stage="0",
            stage_id="1",
            need_recv_cache=True,
            recv_timeout=recv_timeout,
        )
    )


def _wire_key(request_id: str) -> str:
    """The key a sender puts a request's KV under for the edge 0 -> 1 (the reference's)."""
    return f"omni_0_to_1_kv_cache_{request_id}"


def _until(what: str, check: Any, timeout: float = 10.0) -> None:
    """Poll a public view until ``check()`` holds (bounded; a condition, not a sleep)."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.005)


def _waiting_at(sender: Peer, n: int = 1) -> None:
    """Until ``n`` receives wait at ``sender`` (its own count of registered wants)."""
    _until(f"{n} receiver(s) wait", lambda: sender.call("health")[1]["waiting_receivers"] >= n)


def _records(namespace: str) -> list[registry.SenderSeen]:
    return registry.scan(namespace_prefix(namespace))


# -- a sender gone ---------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_a_sender_killed_while_the_receiver_waits_is_peer_gone(
    peers: list[Peer], namespace: str
) -> None:
    sender = start_peer(peers, namespace, role="sender", linger_s=0)  # it never puts
    mgr = _receiver(namespace, recv_timeout=3.0)
    out: list[ReceiveResult] = []
    try:
        waiter = threading.Thread(target=lambda: out.append(mgr.receive_kv_cache_result("r1")))
        waiter.start()
        _waiting_at(sender)
        sender.kill()  # SIGKILL by PID
        waiter.join(30)
        assert not waiter.is_alive() and out
        result = out[0]
        assert result.status is ReceiveStatus.PEER_GONE, result.reason
        assert f"sender(s) pid {sender.pid} ({sender.pid}-" in (result.reason or "")  # names it
        assert result.waited_s < 3.0 + 1.0  # within its timeout plus a small constant
        assert mgr.receive_kv_cache_for_request("r1") == (None, 0)  # and again afterwards
        again = mgr.get_receive_result("r1")
        assert again is not None and again.status is ReceiveStatus.PEER_GONE
    finally:
        mgr.close()


@pytest.mark.timeout(60)
def test_a_sender_killed_before_the_receiver_starts_is_peer_gone(
    peers: list[Peer], namespace: str
) -> None:
    sender = start_peer(peers, namespace, role="sender", linger_s=0)
    assert [(r.pid, r.alive) for r in _records(namespace)] == [(sender.pid, True)]
    sender.kill()
    assert [(r.pid, r.alive) for r in _records(namespace)] == [(sender.pid, False)]
    mgr = _receiver(namespace, recv_timeout=0.3)  # a fresh process-level view: no link ever
    try:
        result = mgr.receive_kv_cache_result("r1")
        assert result.status is ReceiveStatus.PEER_GONE, result.reason
        reason = result.reason or ""
        assert f"no sender alive in namespace {namespace!r}" in reason
        assert f"pid {sender.pid} (died without closing; last alive" in reason
        # a sender that starts again makes it a plain wait: it delivers
        again = start_peer(peers, namespace, role="sender", pool_size_bytes=1 << 20)
        assert again.call("put", _wire_key("r2"), 4 * KIB, 0, 5.0)[:2] == ("put", True)
        mgr.config.recv_timeout = 10.0
        assert mgr.receive_kv_cache_result("r2").status is ReceiveStatus.CORRUPT  # not KV bytes
        mgr.config.recv_timeout = 0.3
        late = mgr.receive_kv_cache_result("r3")
        assert late.status is ReceiveStatus.TIMEOUT, late.reason  # a sender lives again
        assert f"1 sender(s) alive in namespace {namespace!r} (pid {again.pid})" in (
            late.reason or ""
        )
        assert f"pid {sender.pid} (died without closing" in (late.reason or "")
    finally:
        mgr.close()


@pytest.mark.timeout(60)
def test_a_sender_that_closed_while_the_receiver_waits_is_peer_gone_and_leaves_no_record(
    peers: list[Peer], namespace: str
) -> None:
    sender = start_peer(peers, namespace, role="sender", linger_s=0)
    rx = SharedMemoryConnector({"namespace": namespace})
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            rx.wait("0", "1", "k", deadline=time.monotonic() + 3.0)
        except PeerGoneError as exc:
            errors.append(exc)

    try:
        waiter = threading.Thread(target=wait)
        waiter.start()
        _waiting_at(sender)
        assert sender.call("close") == ("closed",)
        waiter.join(30)
        assert len(errors) == 1 and "went away while waiting for k@0_1" in str(errors[0])
        assert _records(namespace) == []  # a clean close removes its record
        report = rx.explain_miss("0", "1", "k")
        assert report is not None and report.peer_gone
        assert f"pid {sender.pid} (closed or disconnected" in report.detail
    finally:
        rx.close()


# -- a plain timeout, explained --------------------------------------------------------------------
@pytest.mark.timing  # a bound of 0.5 s or less past a deadline: run alone, after the lanes
@pytest.mark.timeout(60)
def test_a_timeout_names_the_live_senders_and_the_keys_waiting_there(
    peers: list[Peer], namespace: str
) -> None:
    sender = start_peer(peers, namespace, pool_size_bytes=1 << 20, linger_s=0)
    for rid in ("other-1", "other-2"):
        assert sender.call("put", _wire_key(rid), 4 * KIB, 1, 5.0)[:2] == ("put", True)
    mgr = _receiver(namespace, recv_timeout=0.3)
    try:
        result = mgr.receive_kv_cache_result("mine")
        assert result.status is ReceiveStatus.TIMEOUT
        reason = result.reason or ""
        assert f"1 sender(s) alive in namespace {namespace!r} (pid {sender.pid})" in reason
        waiting = f"{_wire_key('other-2')}@0_1, {_wire_key('other-1')}@0_1"  # newest first
        assert f"2 payload(s) wait there unconsumed, not {_wire_key('mine')}@0_1: {waiting}" in (
            reason
        )
        assert result.waited_s < 0.3 + 0.5
        assert sender.call("health")[1]["published"] == 2  # the probe consumed nothing
    finally:
        mgr.close()


@pytest.mark.timeout(60)
def test_the_list_of_waiting_keys_is_bounded(peers: list[Peer], namespace: str) -> None:
    sender = start_peer(peers, namespace, pool_size_bytes=4 << 20, linger_s=0)
    sender.send("churn_put", 20)  # c0 .. c19, 64 KiB each, unconsumed
    for i in range(20):
        assert sender.recv() == ("progress", i)
    rx = SharedMemoryConnector({"namespace": namespace})
    try:
        assert rx.wait("0", "1", "missing", deadline=time.monotonic() + 0.1) is None
        report = rx.explain_miss("0", "1", "missing")
        assert report is not None and not report.peer_gone
        newest = ", ".join(f"c{i}@0_1" for i in range(19, 19 - MAX_KEYS_SHOWN, -1))
        assert f"20 payload(s) wait there unconsumed, not missing@0_1: {newest} (+12 more)" in (
            report.detail
        )
    finally:
        rx.close()


@pytest.mark.timeout(60)
def test_a_key_that_arrives_after_the_deadline_is_named_and_not_consumed(
    peers: list[Peer], namespace: str
) -> None:
    sender = start_peer(peers, namespace, pool_size_bytes=1 << 20, linger_s=0)
    rx = SharedMemoryConnector({"namespace": namespace})
    try:
        assert rx.wait("0", "1", "late", deadline=time.monotonic() + 0.1) is None
        assert sender.call("put", "late", 4 * KIB, 3, 5.0)[:2] == ("put", True)
        # The sender answers the report's probe within 50 ms on a quiet host; a busy one may
        # take longer, and the report then says it did not answer (the test below): ask again.
        report = until(
            lambda: _explained(rx, "late", "arrived after the deadline"), 10.0, "the late key"
        )
        assert not report.peer_gone
        assert "late@0_1 arrived after the deadline (1 payload(s) unconsumed there)" in (
            report.detail
        )
        got = rx.wait("0", "1", "late", deadline=time.monotonic() + 5)  # still there
        assert got is not None and bool((got.tensor == 3).all())
        got.release()
    finally:
        rx.close()


def _all_threads_stopped(pid: int) -> bool:
    """Whether every thread of process ``pid`` is stopped (state ``T`` in its ``stat``)."""
    states = []
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        with contextlib.suppress(OSError):  # a thread that just ended
            states.append(stat.read_text().rsplit(")", 1)[1].split()[0])
    return bool(states) and all(state == "T" for state in states)


def _explained(rx: SharedMemoryConnector, key: str, needle: str) -> MissReport | None:
    """``rx``'s report on a miss of ``key`` from stage 0 to 1 when it contains ``needle``."""
    report = rx.explain_miss("0", "1", key)
    return report if report is not None and needle in report.detail else None


@pytest.mark.timeout(60)
def test_a_sender_that_does_not_answer_in_time_is_named_not_taken_for_empty(
    peers: list[Peer], namespace: str
) -> None:
    """A sender that holds the key but cannot answer the probe (stopped here by SIGSTOP, as a
    starved or hung process would be) is named as silent: the report never says that nothing
    waits there. Once it runs again, the key is found."""
    sender = start_peer(peers, namespace, pool_size_bytes=1 << 20, linger_s=0)
    rx = SharedMemoryConnector({"namespace": namespace})
    try:
        assert sender.call("put", "held", 4 * KIB, 3, 5.0)[:2] == ("put", True)
        until(lambda: _explained(rx, "held", "arrived after"), 10.0, "the held key")
        os.kill(sender.proc.pid, signal.SIGSTOP)
        try:
            # the stop reaches each thread when the signalled one next runs: on a busy host the
            # sender's I/O thread answered a probe sent right after kill() returned
            until(lambda: _all_threads_stopped(sender.proc.pid), 10.0, "the sender stopped")
            report = rx.explain_miss("0", "1", "held")
        finally:
            os.kill(sender.proc.pid, signal.SIGCONT)
        assert report is not None and not report.peer_gone
        assert "no payload is waiting there" not in report.detail
        assert "no payload is waiting at the peers that answered" in report.detail
        assert f"1 of 1 peer(s) did not answer within 50 ms (pid {sender.pid})" in report.detail
        assert "what they hold is unknown" in report.detail
        until(lambda: _explained(rx, "held", "held@0_1 arrived after"), 10.0, "the key again")
    finally:
        rx.close()


@pytest.mark.timeout(30)
def test_a_namespace_without_any_sender_says_so(namespace: str) -> None:
    mgr = _receiver(namespace, recv_timeout=0.2)
    try:
        result = mgr.receive_kv_cache_result("r1")
        assert result.status is ReceiveStatus.TIMEOUT
        assert (
            f"no sender alive in namespace {namespace!r}; none was seen there;"
            " no payload is waiting there" in (result.reason or "")
        )
    finally:
        mgr.close()


# -- the namespace's records -----------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_records_of_dead_senders_go_after_the_keep_time(peers: list[Peer], namespace: str) -> None:
    sender = start_peer(peers, namespace, role="sender", linger_s=0)
    sender.kill()
    (record,) = _records(namespace)
    assert not record.alive and record.pid == sender.pid
    path = registry.record_path(namespace_prefix(namespace), record.instance)
    old = time.time() - registry.GONE_KEEP_S - 1
    os.utime(path, (old, old))  # last alive over an hour ago
    assert _records(namespace) == []
    assert not os.path.exists(path)  # removed by the scan that met it


# -- lingering at exit -----------------------------------------------------------------------------
@pytest.mark.timeout(150)  # a fresh interpreter importing torch: over a minute on a loaded host
def test_a_lingering_sender_says_once_at_warning_that_its_exit_waits(namespace: str) -> None:
    """At process exit the first lingering line is a WARNING (the default log level shows it):
    what the exit waits for, how long and how to skip; the drop is logged when the wait ends."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _LINGERING_SENDER, namespace],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": _SRC},
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "sent"
        assert proc.wait(30) == 0
        assert proc.stderr is not None
        lines = [line for line in proc.stderr.read().splitlines() if "omnikv" in line]
        waits = [line for line in lines if "(linger_s) for receivers" in line]
        assert len(waits) == 1 and waits[0].startswith("WARNING"), lines
        assert (
            "the process exit waits up to 0.5s (linger_s) for receivers to take 2 unconsumed"
            " payload(s)" in waits[0]
        )
        assert "set linger_s to 0" in waits[0] and "close(linger=False)" in waits[0]
        assert any("dropped 2 unconsumed payload(s): first, second" in line for line in lines)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
