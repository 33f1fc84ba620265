"""Delivery acknowledgements end to end over the in-process connector, and the pieces alone.

The sender's ``get_send_result`` moves from ``sent`` to ``delivered`` when the receiver accepted
the KV, to ``refused`` (with the receiver's reason) when a check rejected it, and to ``expired``
when nobody took it within the TTL or the receiver that took it never gave a verdict. The
cross-process transports have their own tests with real processes; this file pins the rules.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from conftest import ManagerFactory, make_paged_caches
from omnikv import ReceiveStatus
from omnikv.connectors.delivery import (
    MAX_REASON_CHARS,
    DeliveryNotices,
    DeliveryReport,
    Verdict,
    clip_reason,
)
from omnikv.connectors.local import LocalConnector
from omnikv.transfer.delivery import DeliveryBook
from omnikv.transfer.received import ReceivedKV
from omnikv.transfer.send import SendResult, SendStatus

pytestmark = pytest.mark.timeout(30)


def _send(mgr: Any, rid: str, **entry: Any) -> SendResult:
    spec = {"block_ids": [0, 1], "seq_len": 12, **entry}
    mgr.handle_finished_requests_kv_transfer({rid: spec}, make_paged_caches(), 8, "float32")
    res = mgr.get_send_result(rid)
    assert res is not None
    return res


def test_sent_then_delivered_when_the_receiver_accepts(make_manager: ManagerFactory) -> None:
    sender, receiver = make_manager("sender"), make_manager("receiver")
    assert _send(sender, "r1").status is SendStatus.SENT
    assert sender.wait_delivered("r1", timeout=0.05).status is SendStatus.SENT  # not taken yet
    got = receiver.receive_kv_cache_result("r1")
    assert got.ok
    res = sender.wait_delivered("r1", timeout=5)
    assert res is not None and res.status is SendStatus.DELIVERED and res.ok and res.reason is None
    assert sender.get_send_result("r1").status is SendStatus.DELIVERED
    outcomes = sender.metrics.snapshot()["outcomes"]
    assert outcomes["send.sent"] == 1 and outcomes["delivery.delivered"] == 1


def test_a_failed_check_refuses_and_the_sender_learns_why(make_manager: ManagerFactory) -> None:
    sender, receiver = make_manager("sender"), make_manager("receiver")
    _send(sender, "r1")

    def check(kv: ReceivedKV) -> str | None:
        return "binding mismatch" if kv.key_cache[0].shape[0] == 12 else None

    got = receiver.receive_kv_cache_result("r1", check=check)
    assert got.status is ReceiveStatus.REFUSED and got.kv is None
    assert "binding mismatch" in (got.reason or "")
    res = sender.wait_delivered("r1", timeout=5)
    assert res is not None and res.status is SendStatus.REFUSED and not res.ok
    assert "binding mismatch" in (res.reason or "")
    assert sender.metrics.snapshot()["outcomes"]["delivery.refused"] == 1


def test_a_corrupt_payload_is_refused(make_manager: ManagerFactory) -> None:
    """A payload that fails to decode is refused with the decoder's reason."""
    sender, receiver = make_manager("sender"), make_manager("receiver")
    res = _send(sender, "r1")
    conn = sender.connector
    assert isinstance(conn, LocalConnector)
    # overwrite the published payload with garbage under the same key (same publisher)
    key = res.keys[0]

    def garbage(dst: torch.Tensor) -> None:
        dst.fill_(0xAB)

    conn.put_packed("stage1", "stage2", key, 64, garbage, deadline=time.monotonic() + 1)
    got = receiver.receive_kv_cache_result("r1")
    assert got.status is ReceiveStatus.CORRUPT
    res = sender.wait_delivered("r1", timeout=5)
    assert res is not None and res.status is SendStatus.REFUSED
    assert "corrupt" in (res.reason or "").lower(), res.reason


def test_unconsumed_payload_expires_with_a_verdict(
    make_manager: ManagerFactory, namespace: str
) -> None:
    conn_cfg = {"type": "LocalConnector", "namespace": namespace, "buffer_ttl_seconds": 0.2}
    sender = make_manager("sender", connector_config=conn_cfg)
    _send(sender, "r1")
    end = time.monotonic() + 5
    while sender.get_send_result("r1").status is SendStatus.SENT:
        assert time.monotonic() < end, "the TTL never expired the payload"
        sender.connector.health()  # the namespace is swept on its next operation
        time.sleep(0.05)
    res = sender.get_send_result("r1")
    assert res.status is SendStatus.EXPIRED and "TTL" in (res.reason or "")


def test_taken_without_a_verdict_expires_after_the_ack_timeout(
    make_manager: ManagerFactory, namespace: str
) -> None:
    """A receiver that takes the payload and dies (here: never acknowledges) leaves the sender
    ``expired`` after ``ack_timeout_s``, not ``sent`` for ever."""
    conn_cfg = {"type": "LocalConnector", "namespace": namespace, "ack_timeout_s": 0.2}
    sender = make_manager("sender", connector_config=conn_cfg)
    res = _send(sender, "r1")
    conn = sender.connector
    buf = conn.wait("stage1", "stage2", res.keys[0], deadline=time.monotonic() + 1)
    assert buf is not None
    buf.release()
    end = time.monotonic() + 5
    while sender.get_send_result("r1").status is SendStatus.SENT:
        assert time.monotonic() < end
        conn.health()
        time.sleep(0.05)
    res = sender.get_send_result("r1")
    assert res.status is SendStatus.EXPIRED and "no verdict" in (res.reason or "")


def test_tp_request_is_delivered_only_when_every_rank_took_its_key(
    make_manager: ManagerFactory,
) -> None:
    """Receiving TP 2: two keys per request; delivered after both ranks accepted."""
    from omnikv.ranks.context import ParallelContext

    tp = {"rank_mapping": {"from_tp": 1, "to_tp": 2}}
    sender = make_manager("sender", **tp)
    r0 = make_manager("receiver", parallel_context=ParallelContext(local_rank=0), **tp)
    r1 = make_manager("receiver", parallel_context=ParallelContext(local_rank=1), **tp)
    res = _send(sender, "r1")
    assert len(res.keys) == 2, res.keys
    assert r0.receive_kv_cache_result("r1").ok
    assert sender.wait_delivered("r1", timeout=0.1).status is SendStatus.SENT
    assert r1.receive_kv_cache_result("r1").ok
    assert sender.wait_delivered("r1", timeout=5).status is SendStatus.DELIVERED


def test_wait_delivered_answers_without_waiting_where_nothing_will_come(
    make_manager: ManagerFactory,
) -> None:
    sender = make_manager("sender")
    assert sender.wait_delivered("never-sent", timeout=5) is None
    t0 = time.monotonic()
    res = _send(sender, "bad", block_ids=[0, 99])
    assert res.status is SendStatus.FAILED
    assert sender.wait_delivered("bad", timeout=5).status is SendStatus.FAILED
    assert time.monotonic() - t0 < 2


def test_a_waiting_sender_wakes_on_the_verdict(make_manager: ManagerFactory) -> None:
    sender, receiver = make_manager("sender"), make_manager("receiver")
    _send(sender, "r1")
    seen: list[SendResult | None] = []
    waiter = threading.Thread(target=lambda: seen.append(sender.wait_delivered("r1", 10)))
    waiter.start()
    assert receiver.receive_kv_cache_result("r1").ok
    waiter.join(5)
    assert not waiter.is_alive() and seen[0] is not None
    assert seen[0].status is SendStatus.DELIVERED


# -- the pieces alone ----------------------------------------------------------------------------


def test_notices_report_each_publication_once_and_ignore_strangers() -> None:
    got: list[DeliveryReport] = []
    notices = DeliveryNotices(ack_timeout_s=10)
    notices.set_listener(got.append)
    assert not notices.report("unknown", Verdict.DELIVERED)  # a peer cannot invent deliveries
    notices.published("k")
    assert notices.report("k", Verdict.DELIVERED)
    assert not notices.report("k", Verdict.REFUSED, "late")  # nor overwrite one
    notices.published("k")  # published again: a new verdict is due
    notices.taken("k", now=0.0)
    assert notices.sweep(now=5.0) == 0 and notices.sweep(now=10.5) == 1
    assert [(r.key, r.verdict) for r in got] == [("k", Verdict.DELIVERED), ("k", Verdict.EXPIRED)]


def test_listener_errors_never_reach_the_connector() -> None:
    notices = DeliveryNotices()

    def boom(report: DeliveryReport) -> None:
        raise RuntimeError("listener bug")

    notices.set_listener(boom)
    notices.published("k")
    assert notices.report("k", Verdict.DELIVERED)


def test_reasons_are_one_bounded_line() -> None:
    assert clip_reason(None) is None
    assert clip_reason("a\nb\t c") == "a b c"
    assert len(clip_reason("x" * 10_000) or "") == MAX_REASON_CHARS


def test_book_takes_reports_that_arrive_before_the_send_ended() -> None:
    recorded: list[SendResult] = []
    book = DeliveryBook(recorded.append)
    book.expect("r", ["k1", "k2"])
    book.on_report(DeliveryReport("k1", Verdict.DELIVERED))
    book.on_report(DeliveryReport("k2", Verdict.DELIVERED))
    final = book.settle(SendResult("r", SendStatus.SENT, "r", ["k1", "k2"], 10))
    assert final.status is SendStatus.DELIVERED and recorded == [final]
    # a refusal after the verdict changes nothing
    book.on_report(DeliveryReport("k1", Verdict.REFUSED, "late"))
    assert book.result("r").status is SendStatus.DELIVERED


def test_book_refused_wins_over_expired_and_forgets_failed_sends() -> None:
    book = DeliveryBook()
    book.expect("r", ["k1", "k2"])
    book.settle(SendResult("r", SendStatus.SENT, "r", ["k1", "k2"], 10))
    book.on_report(DeliveryReport("k1", Verdict.REFUSED, "bad MAC"))
    res = book.result("r")
    assert res is not None and res.status is SendStatus.REFUSED and "bad MAC" in (res.reason or "")
    book.expect("f", ["k3"])
    book.settle(SendResult("f", SendStatus.FAILED, "f", ["k3"], 0, "pool full"))
    assert book.result("f") is None
    book.on_report(DeliveryReport("k3", Verdict.DELIVERED))  # ignored: nothing watched


def test_book_is_bounded() -> None:
    book = DeliveryBook(capacity=4)
    for i in range(10):
        book.expect(f"r{i}", [f"k{i}"])
        book.settle(SendResult(f"r{i}", SendStatus.SENT, f"r{i}", [f"k{i}"], 1))
    assert book.result("r0") is None and book.result("r9") is not None
