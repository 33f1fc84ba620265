"""The data check between two real processes over real shared memory: a bit flipped in the
shared pool after the sender wrote its payload (first, middle or last byte of the data
section) makes the receive ``corrupt``, never a delivery; the same send intact is delivered
bit for bit. The sender is a child process (:mod:`support.damaging_sender`), killed by PID."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from omnikv import ReceiveStatus
from support.damaging_sender import DamagingSender, caches
from support.stage_sender import stage_receiver

pytestmark = pytest.mark.slow


@pytest.fixture
def sender(namespace: str) -> Iterator[DamagingSender]:
    proc = DamagingSender(namespace)
    try:
        yield proc
    finally:
        proc.kill()


@pytest.mark.timeout(90)
def test_a_flipped_bit_in_shared_memory_is_corrupt(sender: DamagingSender, namespace: str) -> None:
    receiver = stage_receiver(namespace, 10.0)
    try:
        for rid, where in (("first", 0), ("middle", 640), ("last", -1)):
            sender.send_kv(rid, where)
            got = receiver.receive_kv_cache_result(rid)
            assert got.status is ReceiveStatus.CORRUPT, (rid, got.status, got.reason)
            assert "data check mismatch" in (got.reason or ""), got.reason
        sender.send_kv("intact", None)
        got = receiver.receive_kv_cache_result("intact")
        assert got.ok, got.reason
        data = got.data
        assert data is not None
        want = caches()
        for layer in range(2):
            k = data["layer_blocks"]["key_cache"][layer]
            assert torch.equal(k, want[layer][0].reshape(-1, 2, 4)[:10])
    finally:
        receiver.close()
