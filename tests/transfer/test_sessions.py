"""Sessions, epochs and exactly-once: every payload carries its sender's stamp; a receiver refuses
a duplicate and, for a named sender instance, a payload from an epoch older than one it took.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
import torch

from conftest import ManagerFactory, make_paged_caches
from omnikv import ReceiveStatus
from omnikv.errors import ConfigError
from omnikv.transfer.send import SendStatus
from omnikv.transfer.sessions import DuplicatePayload, SenderStamps, SessionGuard, StalePayload
from omnikv.wire.decode import decode_kv
from omnikv.wire.format import HEADER_LENGTH, Stamp
from omnikv.wire.transfer_data import KVCacheTransferData

pytestmark = pytest.mark.timeout(30)


def _send(mgr: Any, rid: str, **extra: Any) -> None:
    spec = {rid: {"block_ids": [0, 1], "seq_len": 12, **extra}}
    mgr.handle_finished_requests_kv_transfer(spec, make_paged_caches(), 8, "float32")
    assert mgr.get_send_result(rid).status is SendStatus.SENT


def _take_bytes(mgr: Any, rid: str) -> tuple[str, bytes]:
    """Take the published payload of ``rid`` off the connector (as a transport would)."""
    key = mgr.get_send_result(rid).keys[0]
    buf = mgr.connector.wait("stage1", "stage2", key, deadline=time.monotonic() + 2)
    assert buf is not None
    try:
        return key, buf.to_bytes()
    finally:
        buf.release()


def _put_bytes(mgr: Any, key: str, raw: bytes) -> None:
    def write(dst: torch.Tensor) -> None:
        dst.copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))

    deadline = time.monotonic() + 2
    mgr.connector.put_packed("stage1", "stage2", key, len(raw), write, deadline=deadline)


def test_every_payload_carries_its_senders_stamp(make_manager: ManagerFactory) -> None:
    sender = make_manager("sender", instance_id="prefill-0")
    _send(sender, "a")
    _send(sender, "b")
    stamps = [decode_kv(_take_bytes(sender, rid)[1]).stamp for rid in ("a", "b")]
    assert all(isinstance(s, Stamp) for s in stamps)
    a, b = stamps
    assert a is not None and b is not None
    assert a.s == b.s and a.e == b.e and (a.q, b.q) == (0, 1) and a.i == b.i == "prefill-0"


def test_a_payload_arriving_twice_is_refused_the_second_time(make_manager: ManagerFactory) -> None:
    sender, receiver = make_manager("sender"), make_manager("receiver")
    _send(sender, "r1")
    key, raw = _take_bytes(sender, "r1")
    _put_bytes(sender, key, raw)  # the payload arrives ...
    assert receiver.receive_kv_cache_result("r1").ok
    _put_bytes(sender, key, raw)  # ... and again (a replay, or a retried put that had landed)
    again = receiver.receive_kv_cache_result("r1")
    assert again.status is ReceiveStatus.REFUSED and "duplicate" in (again.reason or "")
    assert receiver.metrics.snapshot()["outcomes"]["guard.duplicates"] == 1
    # a new send of the same request is a new payload: taken
    _send(sender, "r1")
    assert receiver.receive_kv_cache_result("r1").ok


def test_a_restarted_instance_supersedes_its_old_epoch(make_manager: ManagerFactory) -> None:
    """Two incarnations of instance ``prefill-0``: once the new one's payload was taken, a
    payload the old one left behind is refused; an unnamed sender is never ordered."""
    old = make_manager("sender", instance_id="prefill-0")
    _send(old, "early")
    key, stale = _take_bytes(old, "early")
    new = make_manager("sender", instance_id="prefill-0")  # the restart: a later epoch
    receiver = make_manager("receiver")
    _send(new, "fresh")
    assert receiver.receive_kv_cache_result("fresh").ok
    _put_bytes(new, key, stale)
    got = receiver.receive_kv_cache_result("early")
    assert got.status is ReceiveStatus.REFUSED and "old epoch" in (got.reason or "")
    assert receiver.metrics.snapshot()["outcomes"]["guard.stale_epoch"] == 1
    # unnamed senders (data-parallel producers of one stage and rank) are not ordered
    first, second = make_manager("sender"), make_manager("sender")
    _send(first, "dp0")
    key, raw = _take_bytes(first, "dp0")
    _send(second, "dp1")
    assert receiver.receive_kv_cache_result("dp1").ok
    _put_bytes(first, key, raw)
    assert receiver.receive_kv_cache_result("dp0").ok


def test_a_payload_without_a_stamp_is_taken(make_manager: ManagerFactory) -> None:
    """The reference's encoder writes no stamp: such payloads are admitted unchecked."""
    sender, receiver = make_manager("sender"), make_manager("receiver")
    raw = KVCacheTransferData(
        request_id="plain",
        layer_blocks={"key_cache": [torch.ones(4, 2, 8)], "value_cache": [torch.ones(4, 2, 8)]},
        block_ids=[0],
        metadata={},
    ).to_bytes()
    assert decode_kv(raw).stamp is None
    _put_bytes(sender, "omni_stage1_to_stage2_kv_cache_plain", raw)
    assert receiver.receive_kv_cache_result("plain").ok


@pytest.mark.parametrize(
    "stamp",
    [
        {"s": "x" * 65, "e": 1, "q": 0},
        {"s": "abc", "e": -1, "q": 0},
        {"s": "abc", "e": 1, "q": "0"},
        {"s": "abc", "e": 1, "q": 0, "i": "y" * 129},
        {"s": "", "e": 1, "q": 0},
        ["abc", 1, 0],
    ],
)
def test_a_hostile_stamp_is_a_corrupt_payload(make_manager: ManagerFactory, stamp: Any) -> None:
    sender, receiver = make_manager("sender"), make_manager("receiver")
    _send(sender, "r1", custom_metadata={"pad": "z" * 400})  # room for the forged stamp
    key, raw = _take_bytes(sender, "r1")
    n = HEADER_LENGTH.unpack_from(raw)[0]
    header = json.loads(raw[4 : 4 + n])
    del header["meta"]["pad"]
    header["ss"] = stamp
    body = json.dumps(header, separators=(",", ":")).encode()
    assert len(body) <= n, "test header outgrew the original"
    forged = raw[:4] + body + b" " * (n - len(body)) + raw[4 + n :]
    _put_bytes(sender, key, forged)
    got = receiver.receive_kv_cache_result("r1")
    assert got.status is ReceiveStatus.CORRUPT and "ss" in (got.reason or ""), got.reason


def test_instance_id_is_checked() -> None:
    from omnikv.config import TransferOptions

    for bad in ("", "has space", "x" * 129, 7):
        with pytest.raises(ConfigError, match="instance_id"):
            TransferOptions(instance_id=bad)  # type: ignore[arg-type]
    assert TransferOptions(instance_id="decode-3").instance_id == "decode-3"


def test_guard_memory_is_bounded() -> None:
    guard = SessionGuard(seen=3, instances=2)
    stamps = SenderStamps()
    made = [Stamp(**stamps.next()) for _ in range(5)]  # type: ignore[arg-type]
    for s in made:
        guard.admit(s, "r")
    with pytest.raises(DuplicatePayload):
        guard.admit(made[-1], "r")
    guard.admit(made[0], "r")  # forgotten: the transports' consume-once covers it
    for name in ("a", "b", "c"):
        guard.admit(Stamp("s" + name, 10, 0, name), "r")
    guard.admit(Stamp("old-a", 5, 0, "a"), "r")  # "a" was forgotten (2 instances kept)
    with pytest.raises(StalePayload):
        guard.admit(Stamp("old-c", 5, 0, "c"), "r")
    assert guard.counts == {"duplicates": 1, "stale_epoch": 1}


def test_a_checked_stamp_is_remembered_only_on_commit() -> None:
    """Check, then remember: checking changes nothing; what a pending set holds is judged
    against the memories only once committed (a refused payload never commits)."""
    guard = SessionGuard()
    huge = Stamp(s="f" * 16, e=10**30, q=0, i="prefill-0")
    guard.check(huge, "forged")
    refused = guard.pending()
    refused.admit(huge, "forged")  # ... and its payload is refused later: never committed
    genuine = Stamp(s="a" * 16, e=5, q=0, i="prefill-0")
    taken = guard.pending()
    taken.admit(genuine, "r1")
    taken.commit()
    with pytest.raises(DuplicatePayload):
        guard.check(genuine, "r1")
    copy = guard.pending()
    with pytest.raises(DuplicatePayload):
        copy.admit(genuine, "r1")
    # two copies checked at once: the second to commit is refused
    twin = Stamp(s="a" * 16, e=5, q=1, i="prefill-0")
    first, second = guard.pending(), guard.pending()
    first.admit(twin, "r2")
    second.admit(twin, "r2")
    first.commit()
    with pytest.raises(DuplicatePayload):
        second.commit()
    assert guard.counts == {"duplicates": 3, "stale_epoch": 0}
