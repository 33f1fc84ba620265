"""Attacks on a stream's keys and verdicts, tried as an outsider would, over real shared memory.

A sending stage runs in its own process (:mod:`support.stage_sender`, ``stream_kv`` on, a
``SharedMemoryConnector`` on the test's namespace); the test process is the receiving stage.

* Keys cannot collide (issue 39 item 6): chunk keys live in a space no request id reaches, so
  a request named ``V#c0`` and the first chunk of request ``V``'s stream are two payloads,
  whichever is published first; aborting ``V``'s stream removes only ``V``'s chunks, not
  the payload of ``V#c0_x`` nor a chunk of a request whose key ends in ``V``'s.
* Every verdict is kept until its send settles (issue 39 item 4): a consumer that refuses a
  stream before its finish (an aborted early hand-off) makes the finish ``refused`` at once;
  nothing of the request stays published. A refusal that comes after the finish makes the send
  ``refused`` and takes the untaken tail back within a second (not at its TTL).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from omnikv import ReceiveStatus
from omnikv.transfer.received import ReceivedChunk
from support.polling import until
from support.stage_sender import SenderProc, stage_receiver

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

#: 26 tokens in blocks 0..3 of 8: a stream step at 16 tokens ships blocks 0 and 1.
IDS, SEQ_LEN, STEP = [0, 1, 2, 3], 26, 16


def _start(senders: list[SenderProc], namespace: str) -> SenderProc:
    sender = SenderProc(namespace, stream_kv=True)
    senders.append(sender)
    return sender


def _ship(sender: SenderProc, rid: str, fill: float) -> None:
    answer = sender.ask("ship", rid, IDS, STEP, fill)
    assert answer == ("shipped", 1, None), answer


def _finish(sender: SenderProc, rid: str, fill: float, seq_len: int = SEQ_LEN) -> tuple[Any, ...]:
    answer = sender.ask("finish", rid, IDS, seq_len, fill)
    assert answer[0] == "result", answer
    return tuple(answer[1:])


def _assert_kv(mgr: Any, rid: str, fill: float, tokens: int) -> None:
    """``rid`` arrives whole: ``tokens`` tokens, layer ``i`` filled with ``fill + i``."""
    result = mgr.receive_kv_cache_result(rid)
    assert result.ok, (rid, result.status, result.reason)
    for i, (k, v) in enumerate(zip(result.kv.key_cache, result.kv.value_cache, strict=True)):
        assert k.shape[0] == tokens and v.shape[0] == tokens, (rid, k.shape)
        assert torch.all(k == fill + i) and torch.all(v == fill + i), (rid, i)


@pytest.mark.parametrize("first", ["request", "stream"])
def test_a_request_named_like_a_chunk_and_the_stream_are_two_payloads(
    senders: list[SenderProc], namespace: str, first: str
) -> None:
    """Request ``V#c0`` (sent whole) and chunk 0 of ``V``'s stream: a whole send of ``V#c0``
    does not replace the chunk, the stream's chunk does not replace ``V#c0``'s payload, and a
    receive of ``V`` does not consume ``V#c0``'s. Before the chunk key space both had one key."""
    sender = _start(senders, namespace)
    if first == "request":
        assert sender.ask("finish", "V#c0", [0, 1], 10, 7.0) == ("result", "sent", None)
        _ship(sender, "V", 1.0)
    else:
        _ship(sender, "V", 1.0)
        assert sender.ask("finish", "V#c0", [0, 1], 10, 7.0) == ("result", "sent", None)
    assert _finish(sender, "V", 1.0) == ("sent", None)
    with stage_receiver(namespace, 10.0, stream_kv=True) as mgr:
        _assert_kv(mgr, "V", 1.0, SEQ_LEN)
        _assert_kv(mgr, "V#c0", 7.0, 10)


def test_aborting_a_stream_removes_only_its_own_chunks(
    senders: list[SenderProc], namespace: str
) -> None:
    """``abort_kv_stream("V")`` drops ``V``'s chunk and nothing else: not the payload of
    request ``V#c0_x`` (its key starts with ``V``'s chunk key and ``_``), not the chunk of a
    request whose key ends with ``_`` and ``V``'s key."""
    sender = _start(senders, namespace)
    assert sender.ask("finish", "V#c0_x", [0, 1], 10, 5.0) == ("result", "sent", None)
    suffixed = "Z_omni_stage1_to_stage2_kv_cache_V"
    _ship(sender, suffixed, 3.0)
    _ship(sender, "V", 1.0)
    assert sender.ask("abort", "V") == ("aborted", 1)
    assert _finish(sender, suffixed, 3.0) == ("sent", None)
    with stage_receiver(namespace, 10.0, stream_kv=True) as mgr:
        _assert_kv(mgr, "V#c0_x", 5.0, 10)
        _assert_kv(mgr, suffixed, 3.0, SEQ_LEN)
    # the receiver's verdicts reach the producer on its listener thread, after the receives
    until(lambda: sender.ask("pending") == ("pending", []), 5.0, "both payloads taken back")


def test_a_request_id_in_the_chunk_key_space_is_refused_by_both_sides(
    senders: list[SenderProc], namespace: str
) -> None:
    """An id that holds the chunk key mark is neither published nor waited for."""
    sender = _start(senders, namespace)
    forged = "\x1fomni_stage1_to_stage2_kv_cache_V#c0\x1f"
    status, reason = sender.ask("finish", forged, [0, 1], 10, 1.0)[1:]
    assert status == "failed" and "chunk key mark" in (reason or ""), reason
    with stage_receiver(namespace, 10.0, stream_kv=True) as mgr:
        t0 = time.monotonic()
        result = mgr.receive_kv_cache_result(forged)
        assert result.status is ReceiveStatus.SKIPPED and time.monotonic() - t0 < 1.0
        assert "chunk key mark" in (result.reason or "")


def _until_step_says(sender: SenderProc, rid: str, words: str, timeout: float = 5.0) -> None:
    """Step ``rid``'s stream (no new blocks) until its progress gives a reason with ``words``."""
    until(lambda: words in (sender.ask("ship", rid, IDS, STEP, 2.0)[2] or ""), timeout, words)


class _RefuseSecond:
    """An ``on_chunk`` that takes chunk 0 and refuses chunk 1 (an aborted early hand-off)."""

    def __init__(self) -> None:
        self.seen: list[int] = []
        self.lock = threading.Lock()

    def __call__(self, chunk: ReceivedChunk) -> str | None:
        with self.lock:
            self.seen.append(chunk.index)
        return None if chunk.index == 0 else "consumer aborted"


def test_a_stream_refused_before_its_finish_settles_the_send_at_once(
    senders: list[SenderProc], namespace: str
) -> None:
    """The consumer refuses the stream while the request still decodes: the verdicts reach
    the producer before its finish. The finish is then ``refused`` at once (not ``sent`` until
    the TTL), publishes no tail, and nothing of the request stays in the producer's pool."""
    sender = _start(senders, namespace)
    sender.ask("ship", "r1", IDS, 8, 2.0)  # chunk 0: block 0
    sender.ask("ship", "r1", IDS, 16, 2.0)  # chunk 1: block 1
    taker = _RefuseSecond()
    with stage_receiver(namespace, 20.0, stream_kv=True) as mgr:
        result = mgr.receive_kv_cache_result("r1", on_chunk=taker)
        assert result.status is ReceiveStatus.REFUSED, result
        assert "consumer aborted" in (result.reason or "")
        # the verdicts travel on the mesh link: the producer's next step learns of them
        _until_step_says(sender, "r1", "refused by a receiver")
        t0 = time.monotonic()
        status, reason = _finish(sender, "r1", 2.0)
        assert status == "refused", (status, reason)
        assert time.monotonic() - t0 < 1.0
        assert "r1#c" in (reason or ""), reason
        assert sender.ask("wait", "r1", 0.0) == ("status", "refused")
        assert sender.ask("pending") == ("pending", [])


def test_a_stream_refused_after_its_finish_takes_its_tail_back_at_once(
    senders: list[SenderProc], namespace: str
) -> None:
    """A consumer took both chunks of ``r2`` while the request still decoded and refuses
    chunk 1 only after the producer's finish published the tail (an early hand-off aborted
    late; the consumer here is a bare connector, so the order is exact). Within a second the
    producer's send says ``refused`` and the tail, which nobody took, is gone from its pool.
    Before ``withdraw`` it stayed published until ``buffer_ttl_seconds``."""
    from omnikv.connectors.delivery import Verdict
    from omnikv.connectors.shm.connector import SharedMemoryConnector

    sender = _start(senders, namespace)
    sender.ask("ship", "r2", IDS, 8, 2.0)  # chunk 0: block 0
    sender.ask("ship", "r2", IDS, 16, 2.0)  # chunk 1: block 1
    chunks = sorted(sender.ask("pending")[1])
    assert len(chunks) == 2 and all("#c" in k for k in chunks), chunks
    with SharedMemoryConnector({"namespace": namespace}) as consumer:
        taken = [
            consumer.wait("stage1", "stage2", k, deadline=time.monotonic() + 10.0) for k in chunks
        ]
        assert all(buf is not None for buf in taken)
        assert _finish(sender, "r2", 2.0) == ("sent", None)
        (tail,) = sender.ask("pending")[1]
        assert "#c" not in tail, tail
        consumer.acknowledge("stage1", "stage2", chunks[0], Verdict.DELIVERED)
        t0 = time.monotonic()
        consumer.acknowledge("stage1", "stage2", chunks[1], Verdict.REFUSED, "consumer aborted")
        assert sender.ask("wait", "r2", 1.0) == ("status", "refused")
        until(lambda: sender.ask("pending") == ("pending", []), 1.0, "the tail taken back")
        assert time.monotonic() - t0 < 1.0
        for buf in taken:
            assert buf is not None
            buf.release()
