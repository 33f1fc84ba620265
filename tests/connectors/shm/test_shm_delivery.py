"""Delivery verdicts over real shared memory: the receiver's verdict reaches a sender process.

The sending stage is a child process (its own ``OmniKVTransferManager`` on a
``SharedMemoryConnector``, driven over a pipe); the receiving stage is this process's manager or
a peer process (``test_shm_peer``). The sender's ``wait_delivered`` turns ``delivered`` when the
receive accepted the KV, ``refused`` with the receiver's reason when its ``check`` did not,
``expired`` when nobody took the payload within ``buffer_ttl_seconds`` or when the process that
took it was killed before its verdict (and the pool slot it held is free again). A verdict from
a process that did not take the payload changes nothing; a malformed one costs its sender the
connection. A payload taken and never acknowledged expires after ``ack_timeout_s`` (the TTL
timer watches it). Every process is killed by PID when its test ends.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import socket
import struct
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

import msgpack
import pytest
import torch
from test_shm_peer import Peer, peer_pool, start_peer

from omnikv import OmniKVCacheConfig, OmniKVTransferManager, ReceiveStatus
from omnikv.connectors.delivery import (
    DEFAULT_ACK_TIMEOUT_S,
    MAX_REASON_CHARS,
    DeliveryReport,
    Verdict,
)
from omnikv.connectors.shm.config import ShmConfig
from omnikv.connectors.shm.connector import SharedMemoryConnector
from omnikv.connectors.shm.wire import discover, namespace_prefix, transport_key
from omnikv.errors import ConfigError
from omnikv.transfer.received import ReceivedKV

pytestmark = pytest.mark.slow

_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(["omnikv.manager", "omnikv.connectors.shm.connector"])

POOL = 4 << 20
_LEN = struct.Struct("<I")


def sender_main(conn: Connection, namespace: str, extra: dict[str, Any]) -> None:
    """Child: the sending stage (``"0"`` -> ``"1"``). Commands (plain tuples): ``("send", rid)``
    answers ``("sent", status, keys)``; ``("wait", rid, timeout)`` answers ``("result", status,
    reason)`` from ``wait_delivered``; ``("health",)`` the connector's ``health()``."""
    mgr = OmniKVTransferManager(
        OmniKVCacheConfig(
            connector_config={
                "type": "SharedMemoryConnector",
                "namespace": namespace,
                "pool_size_bytes": POOL,
                "linger_s": 0,
                **extra,
            },
            from_stage="0",
            to_stage="1",
            need_send_cache=True,
        )
    )
    conn.send(("ready", os.getpid()))
    while True:
        try:
            cmd = conn.recv()
        except EOFError:
            break
        if cmd[0] == "send":
            caches: list[Any] = [torch.full((2, 4, 8, 2, 4), float(i)) for i in range(2)]
            mgr.handle_finished_requests_kv_transfer(
                {cmd[1]: {"block_ids": [0, 1], "seq_len": 10}}, caches, 8, "torch.float32"
            )
            res = mgr.get_send_result(cmd[1])
            assert res is not None
            conn.send(("sent", res.status.value, list(res.keys)))
        elif cmd[0] == "wait":
            res = mgr.wait_delivered(cmd[1], cmd[2])
            assert res is not None
            conn.send(("result", res.status.value, res.reason))
        elif cmd[0] == "health":
            connector = mgr.connector
            conn.send(("health", None if connector is None else connector.health()))
        elif cmd[0] == "withdraw":
            connector = mgr.connector
            conn.send(("withdrew", connector is not None and connector.withdraw("0", "1", cmd[1])))
    mgr.close()


class SenderStage:
    """Handle of one sending-stage process (ready when constructed); :meth:`kill` by PID."""

    def __init__(self, namespace: str, **extra: Any) -> None:
        self.conn, child = _CTX.Pipe()
        self.proc = _CTX.Process(target=sender_main, args=(child, namespace, extra), daemon=True)
        self.proc.start()
        child.close()
        assert self.call(timeout=30.0)[0] == "ready"

    def call(self, *cmd: Any, timeout: float = 10.0) -> Any:
        if cmd:
            self.conn.send(cmd)
        if not self.conn.poll(timeout):
            raise TimeoutError(f"sender {self.proc.pid} did not answer within {timeout}s")
        return self.conn.recv()

    def send_kv(self, rid: str) -> list[str]:
        """Send ``rid``'s KV; the keys it was put under (status ``sent``)."""
        _, status, keys = self.call("send", rid)
        assert status == "sent", status
        return list(keys)

    def wait_delivered(self, rid: str, timeout: float) -> tuple[str, str | None]:
        """``(status, reason)`` of ``wait_delivered(rid, timeout)`` in the sender."""
        _, status, reason = self.call("wait", rid, timeout, timeout=timeout + 10.0)
        return status, reason

    def health(self) -> dict[str, Any]:
        h = self.call("health")[1]
        assert isinstance(h, dict)
        return h

    def kill(self) -> None:
        if self.proc.pid is not None and self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)


@pytest.fixture
def stages() -> Iterator[list[SenderStage]]:
    started: list[SenderStage] = []
    try:
        yield started
    finally:
        for s in started:
            s.kill()


@pytest.fixture
def peers() -> Iterator[list[Peer]]:
    yield from peer_pool()


@pytest.fixture
def receiver(namespace: str) -> Iterator[OmniKVTransferManager]:
    """The receiving stage (``"0"`` -> ``"1"``) in this process."""
    mgr = OmniKVTransferManager(
        OmniKVCacheConfig(
            connector_config={"type": "SharedMemoryConnector", "namespace": namespace},
            from_stage="0",
            stage_id="1",
            need_recv_cache=True,
            recv_timeout=10.0,
        )
    )
    yield mgr
    mgr.close()


def until(what: str, check: Callable[[], bool], timeout: float = 10.0) -> None:
    """Poll ``check`` until it holds; fail naming ``what`` after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.mark.timeout(90)
def test_a_received_payload_turns_the_senders_result_delivered(
    stages: list[SenderStage], receiver: OmniKVTransferManager, namespace: str
) -> None:
    sender = SenderStage(namespace)
    stages.append(sender)
    sender.send_kv("r1")
    assert sender.wait_delivered("r1", 0.05) == ("sent", None)  # nobody took it yet
    got = receiver.receive_kv_cache_result("r1")
    assert got.ok, got.reason
    assert sender.wait_delivered("r1", 10.0) == ("delivered", None)
    h = sender.health()
    assert (h["acks_delivered"], h["acks_ignored"], h["awaiting_verdicts"]) == (1, 0, 0)
    assert receiver.connector is not None and receiver.connector.health()["acks_sent"] == 1


@pytest.mark.timeout(90)
def test_a_check_that_refuses_reaches_the_sender_with_its_reason(
    stages: list[SenderStage], receiver: OmniKVTransferManager, namespace: str
) -> None:
    sender = SenderStage(namespace)
    stages.append(sender)
    sender.send_kv("r1")

    def check(kv: ReceivedKV) -> str | None:
        return "binding mismatch\nof layer 0" if kv.key_cache else None

    got = receiver.receive_kv_cache_result("r1", check=check)
    assert got.status is ReceiveStatus.REFUSED and "binding mismatch" in (got.reason or "")
    status, reason = sender.wait_delivered("r1", 10.0)
    assert status == "refused"
    assert reason is not None and "binding mismatch of layer 0" in reason  # one line
    h = sender.health()
    assert (h["acks_refused"], h["acks_delivered"], h["acks_ignored"]) == (1, 0, 0)


@pytest.mark.timeout(90)
def test_a_payload_nobody_takes_expires_by_its_ttl(
    stages: list[SenderStage], namespace: str
) -> None:
    sender = SenderStage(namespace, buffer_ttl_seconds=0.3)
    stages.append(sender)
    sender.send_kv("r1")
    t0 = time.monotonic()
    status, reason = sender.wait_delivered("r1", 10.0)
    assert (
        status == "expired" and "TTL" in (reason or "") and "buffer_ttl_seconds" in (reason or "")
    )
    assert time.monotonic() - t0 < 5.0
    h = sender.health()
    assert (h["ttl_reaped"], h["acks_expired"], h["pool_free_bytes"]) == (1, 1, POOL)


@pytest.mark.timeout(90)
def test_a_sender_withdraws_its_own_untaken_payload_and_no_other(
    stages: list[SenderStage], receiver: OmniKVTransferManager, namespace: str
) -> None:
    """``withdraw`` removes what this connector published and nobody took (once: then
    False), reports no verdict for it and frees its slot; another process's connector cannot
    withdraw it, and a payload a reader holds is not withdrawn."""
    sender = SenderStage(namespace)
    stages.append(sender)
    (kept,) = sender.send_kv("kept")
    (gone,) = sender.send_kv("gone")
    assert receiver.connector is not None
    assert receiver.connector.withdraw("0", "1", kept) is False  # not this process's
    assert sender.call("withdraw", gone) == ("withdrew", True)
    assert sender.call("withdraw", gone) == ("withdrew", False)
    assert sender.wait_delivered("gone", 0.05) == ("sent", None)  # no verdict reported
    miss = receiver.receive_kv_cache_result("gone", deadline=time.monotonic() + 0.5)
    assert miss.status is ReceiveStatus.TIMEOUT, miss
    reader = receiver.connector.wait("0", "1", kept, deadline=time.monotonic() + 10.0)
    assert reader is not None
    assert sender.call("withdraw", kept) == ("withdrew", False)  # a reader holds it
    reader.release()
    h = sender.health()
    assert (h["published"], h["acks_expired"], h["awaiting_verdicts"]) == (0, 0, 1), h


def _take_and_hold(peers: list[Peer], namespace: str, keys: list[str]) -> Peer:
    """A receiver process that takes every key at connector level and holds it, unacknowledged."""
    reader = start_peer(peers, namespace)
    for key in keys:
        assert reader.call("wait_hold", key, 10.0, 0) == ("waiting",)
        assert reader.recv()[0] == "got"
    return reader


@pytest.mark.timeout(90)
def test_a_receiver_killed_before_its_verdict_makes_it_expired_and_frees_the_slot(
    stages: list[SenderStage], peers: list[Peer], namespace: str
) -> None:
    sender = SenderStage(namespace)  # ack_timeout_s 60: only the reader's death can expire it
    stages.append(sender)
    keys = sender.send_kv("r1")
    reader = _take_and_hold(peers, namespace, keys)
    h = sender.health()
    assert (h["held_by_readers"], h["awaiting_verdicts"]) == (len(keys), len(keys))
    assert sender.wait_delivered("r1", 0.05)[0] == "sent"
    reader.kill()
    t0 = time.monotonic()
    status, reason = sender.wait_delivered("r1", 10.0)
    assert status == "expired" and "went away before its verdict" in (reason or ""), reason
    assert time.monotonic() - t0 < 5.0
    h = sender.health()
    assert (h["held_by_readers"], h["awaiting_verdicts"]) == (0, 0)
    assert h["pool_free_bytes"] == POOL and h["reclaimed_from_dead_readers"] == len(keys)
    assert h["acks_expired"] == len(keys)


# -- a hostile peer ------------------------------------------------------------------------------


def _frame(msg: list[Any]) -> bytes:
    body: bytes = msgpack.packb(msg, use_bin_type=True)
    return _LEN.pack(len(body)) + body


def _connect_to_sender(namespace: str, pid: int) -> socket.socket:
    """A raw connection to the listener of the connector in process ``pid`` (its instance name
    starts with the pid), introduced as a plain peer; it never takes anything."""
    names = [
        n
        for n in discover(namespace_prefix(namespace))
        if n.rsplit("/", 1)[-1].startswith(f"{pid}-")
    ]
    assert len(names) == 1, names
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5.0)
    s.connect(b"\0" + names[0].encode())
    s.sendall(_frame(["hello", "forger", os.getpid()]))
    return s


@pytest.mark.timeout(90)
def test_a_verdict_from_a_peer_that_did_not_take_the_payload_changes_nothing(
    stages: list[SenderStage], peers: list[Peer], namespace: str
) -> None:
    sender = SenderStage(namespace)
    stages.append(sender)
    assert sender.proc.pid is not None
    keys = sender.send_kv("r1")
    wire_keys = [transport_key(k, "0", "1") for k in keys]
    forged = 0
    with contextlib.closing(_connect_to_sender(namespace, sender.proc.pid)) as forger:
        # unclaimed: nobody was offered it, so no token is right
        for key in wire_keys:
            for token in range(8):
                forger.sendall(_frame(["verdict", token, key, "delivered"]))
                forged += 1
        until("the forged verdicts to be read", lambda: sender.health()["acks_ignored"] == forged)
        assert sender.wait_delivered("r1", 0.05)[0] == "sent"
        # taken by another process (which never acknowledges): still only that one may answer
        reader = _take_and_hold(peers, namespace, keys)
        for key in wire_keys:
            for token in range(64):  # every token the sender has handed out so far, and more
                forger.sendall(_frame(["verdict", token, key, "delivered", None]))
                forged += 1
        until("the forged verdicts to be read", lambda: sender.health()["acks_ignored"] == forged)
        h = sender.health()
        assert (h["acks_delivered"], h["awaiting_verdicts"], h["peers_dropped"]) == (
            0,
            len(keys),
            0,
        )
        assert sender.wait_delivered("r1", 0.05)[0] == "sent"
        # the one who took it goes away: expired, never delivered
        reader.kill()
        status, reason = sender.wait_delivered("r1", 10.0)
        assert status == "expired" and "went away" in (reason or "")
        forger.sendall(_frame(["verdict", 1, wire_keys[0], "delivered"]))  # too late, too
        forged += 1
        until("the late verdict to be read", lambda: sender.health()["acks_ignored"] == forged)
    assert sender.wait_delivered("r1", 0.05)[0] == "expired"


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "verdict",
    [
        ["verdict", 1, "k@0_1", "accepted"],  # not a verdict
        ["verdict", 1, "k@0_1", 1],
        ["verdict", 1, "k" * 1025, "delivered"],  # key over MAX_KEY_CHARS
        ["verdict", 1, "k@0_1", "refused", "x" * (MAX_REASON_CHARS + 1)],  # reason too long
        ["verdict", 1, "k@0_1", "refused", 7],
        ["verdict", -1, "k@0_1", "delivered"],
        ["verdict", 1, b"k@0_1", "delivered"],
        ["verdict", 1],
    ],
)
def test_a_malformed_verdict_drops_its_peer_and_changes_nothing(
    stages: list[SenderStage], namespace: str, verdict: list[Any]
) -> None:
    sender = SenderStage(namespace)
    stages.append(sender)
    assert sender.proc.pid is not None
    sender.send_kv("r1")
    with contextlib.closing(_connect_to_sender(namespace, sender.proc.pid)) as forger:
        until("the forger to be connected", lambda: sender.health()["peers"] == 1)
        forger.sendall(_frame(verdict))
        until("the forger to be dropped", lambda: sender.health()["peers_dropped"] == 1)
    h = sender.health()
    assert (h["acks_delivered"], h["acks_refused"], h["acks_ignored"]) == (0, 0, 0)
    assert sender.wait_delivered("r1", 0.05)[0] == "sent"


# -- the sender's own watch, in one process --------------------------------------------------


@pytest.mark.timeout(30)
def test_a_payload_taken_and_never_acknowledged_expires_after_ack_timeout_s(
    namespace: str,
) -> None:
    """The TTL timer also watches ``ack_timeout_s``: nobody has to call ``health()``."""
    reports: list[DeliveryReport] = []
    base = {"namespace": namespace, "linger_s": 0}
    tx = SharedMemoryConnector({**base, "pool_size_bytes": 1 << 20, "ack_timeout_s": 0.3})
    rx = SharedMemoryConnector(base)
    try:
        tx.set_delivery_listener(reports.append)
        assert tx.put_packed("0", "1", "k", 4096, lambda t: t.fill_(1))[0]
        buf = rx.wait("0", "1", "k", deadline=time.monotonic() + 5)
        assert buf is not None
        buf.release()
        until("the ack timeout", lambda: bool(reports), timeout=5.0)
        assert [(r.key, r.verdict) for r in reports] == [("k", Verdict.EXPIRED)]
        assert "0.3 s" in (reports[0].reason or "")
        rx.acknowledge("0", "1", "k", Verdict.DELIVERED)  # too late: ignored by the sender
        until("the late verdict", lambda: tx.health()["acks_ignored"] == 1)
        assert len(reports) == 1
    finally:
        rx.close()
        tx.close()


def test_ack_timeout_s_is_parsed_strictly() -> None:
    assert ShmConfig.parse({}).ack_timeout_s == DEFAULT_ACK_TIMEOUT_S
    assert ShmConfig.parse({"ack_timeout_s": "2.5"}).ack_timeout_s == 2.5
    for bad in (-1, "soon", float("nan"), True):
        with pytest.raises(ConfigError, match="ack_timeout_s"):
            ShmConfig.parse({"ack_timeout_s": bad})
