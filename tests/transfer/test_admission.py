"""Readiness without blocking (omnikv.transfer.admission) over a real cross-process shared memory.

Two sender processes (:mod:`support.stage_sender`) send some of the requests the receiving stage
(this process) offered; the others never come. The stage polls and takes what is ready, as a
step loop would. Senders are killed by PID at the end of each test.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from conftest import ManagerFactory
from omnikv import ReceiveStatus
from omnikv.connectors.local import LocalConnector
from omnikv.transfer.admission import KVAdmission, Readiness, receive_by_id
from omnikv.transfer.receive import ReceiveResult
from support.polling import until
from support.stage_sender import SenderProc, stage_receiver

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]


def _until(admission: KVAdmission, rid: str, state: Readiness, timeout: float = 10.0) -> None:
    """Poll as a step loop would (bounded) until ``rid`` reaches ``state``."""

    def reached() -> bool:
        got = admission.poll([rid]).get(rid)
        return got is not None and got.state is state

    until(reached, timeout, f"{rid} reaches {state.value}")


def _fill(result: ReceiveResult) -> float:
    assert result.ok and result.kv is not None
    first = result.kv.key_cache[0]
    assert torch.all(first == first.flatten()[0])
    return float(first.flatten()[0])


def test_ready_requests_are_taken_while_others_are_missing(
    senders: list[SenderProc], namespace: str
) -> None:
    """Offer four requests; two senders send two of them: those are ready and taken with their
    own KV while the others stay missing; a late one becomes ready; one never sent fails at its
    deadline, reported once."""
    senders += [SenderProc(namespace), SenderProc(namespace)]
    mgr = stage_receiver(namespace, timeout=2.0)
    try:
        adm = mgr.admission
        assert adm.offer(["r1", "r2", "r3", "r4"]) == ["r1", "r2", "r3", "r4"]
        assert adm.offer("r2") == []  # already tracked: left as it is
        states = adm.poll()
        assert {s.state for s in states.values()} == {Readiness.MISSING}
        senders[0].send_kv("r2", 20)
        senders[1].send_kv("r4", 40)
        _until(adm, "r2", Readiness.READY)
        _until(adm, "r4", Readiness.READY)
        assert sorted(adm.ready()) == ["r2", "r4"]
        missing = adm.poll(["r1", "r3", "unknown"])
        assert sorted(missing) == ["r1", "r3"]
        assert all(s.state is Readiness.MISSING and s.nbytes == 0 for s in missing.values())
        assert adm.take("r1") is None  # missing: nothing to hand out, nothing changes
        r4 = adm.take("r4")
        assert r4 is not None and _fill(r4) == 40
        assert adm.take("r4") is None  # exactly once
        senders[0].send_kv("r1", 10)
        _until(adm, "r1", Readiness.READY)
        r1, r2 = adm.take("r1"), adm.take("r2")
        assert r1 is not None and _fill(r1) == 10 and r2 is not None and _fill(r2) == 20
        _until(adm, "r3", Readiness.FAILED)
        failed = adm.poll(["r3"])["r3"]
        assert failed.status is ReceiveStatus.TIMEOUT and failed.reason
        r3 = adm.take("r3")
        assert r3 is not None and r3.status is ReceiveStatus.TIMEOUT
        assert adm.take("r3") is None and len(adm) == 0 and adm.ready() == []
    finally:
        mgr.close()


def test_poll_and_take_answer_at_once_with_many_requests_missing(
    senders: list[SenderProc], namespace: str
) -> None:
    """Forty requests whose KV never comes: every poll and take returns without waiting, and a
    request offered after them is ready as soon as its KV is sent (no head-of-line blocking)."""
    senders.append(SenderProc(namespace))
    mgr = stage_receiver(namespace, timeout=30.0)
    try:
        adm = mgr.admission
        adm.offer([f"never-{i}" for i in range(20)])
        adm.offer("late")
        adm.offer([f"never-{i}" for i in range(20, 40)])
        slowest = 0.0
        for _ in range(50):
            t0 = time.monotonic()
            states = adm.poll()
            assert adm.take("never-3") is None and adm.ready() == []
            slowest = max(slowest, time.monotonic() - t0)
            assert len(states) == 41
        assert slowest < 0.5, slowest  # a wait for KV would be seconds (recv_timeout 30 s)
        senders[0].send_kv("late", 7)
        _until(adm, "late", Readiness.READY, timeout=5.0)
        late = adm.take("late")
        assert late is not None and _fill(late) == 7
    finally:
        t0 = time.monotonic()
        mgr.close()  # aborts the 40 waits within a slice each
        assert time.monotonic() - t0 < 5.0


@pytest.mark.timing
def test_a_ready_request_is_not_held_behind_a_thousand_missing_ones(
    senders: list[SenderProc], namespace: str
) -> None:
    """One tenant offers 1,000 ids that are never sent (every receive thread would wait for
    them until ``recv_timeout``), then a request whose KV is already here: it is ready within
    50 ms; an id of the burst whose KV comes later is found too (looked at again), and a second
    ready request offered after it is as fast: missing ids hold no thread it needs."""
    senders.append(SenderProc(namespace))
    mgr = stage_receiver(namespace, timeout=30.0)
    try:
        senders[0].send_kv("here", 3)
        senders[0].send_kv("also-here", 4)
        assert mgr.probe_kv_cache("warm-up", timeout=5.0).state.value == "missing"  # joined
        adm = mgr.admission
        for i in range(1000):
            adm.offer(f"never-{i}")
        t0 = time.monotonic()
        adm.offer("here")
        _until(adm, "here", Readiness.READY, timeout=5.0)
        took = time.monotonic() - t0
        here = adm.take("here")
        assert here is not None and _fill(here) == 3
        assert took < 0.05, took
        senders[0].send_kv("never-500", 5)  # late after all: found by a look again
        _until(adm, "never-500", Readiness.READY, timeout=10.0)
        late = adm.take("never-500")
        assert late is not None and _fill(late) == 5
        t0 = time.monotonic()
        adm.offer("also-here")
        _until(adm, "also-here", Readiness.READY, timeout=5.0)
        assert time.monotonic() - t0 < 0.05
        assert sum(s.started for s in adm.poll().values()) <= 32  # the others hold no thread
    finally:
        t0 = time.monotonic()
        mgr.close()
        assert time.monotonic() - t0 < 5.0


def test_cancel_frees_the_receive_and_close_reports_what_was_not_taken(
    senders: list[SenderProc], namespace: str
) -> None:
    """With one receive thread, a cancelled wait gives its thread back (the next request is
    received); a ready payload not taken is dropped at close and named."""
    senders.append(SenderProc(namespace))
    mgr = stage_receiver(namespace, timeout=30.0)
    adm = KVAdmission(mgr.receive_kv_cache_result, recv_timeout=30.0, max_receives=1)
    try:
        adm.offer(["stuck", "next"])
        senders[0].send_kv("next", 3)
        assert adm.poll(["next"])["next"].state is Readiness.MISSING  # queued behind "stuck"
        assert adm.cancel("stuck") and not adm.cancel("stuck")
        _until(adm, "next", Readiness.READY)
        assert "stuck" not in adm.poll()
        assert sorted(adm.close()) == ["next"]
        with pytest.raises(RuntimeError, match="closed"):
            adm.offer("again")
    finally:
        adm.close()
        mgr.close()


def test_pending_shows_the_payload_size_between_arrival_and_ready() -> None:
    """Unit level (a scripted receive): ``pending`` with the payload's bytes once it has been
    taken from the connector, ``ready`` when the receive returns; a receive that raises ends
    as ``failed`` with the reason."""
    arrived, release = threading.Event(), threading.Event()

    def receive(rid: str, target_device: Any = None, **kw: Any) -> ReceiveResult:
        if rid == "boom":
            raise RuntimeError("decoder bug")
        kw["on_arrival"](123)
        arrived.set()
        assert release.wait(10)
        return ReceiveResult(rid, ReceiveStatus.OK, nbytes=123)

    adm = KVAdmission(receive, recv_timeout=10.0, max_receives=2)
    try:
        adm.offer(["a", "boom"])
        assert arrived.wait(10)
        a = adm.poll(["a"])["a"]
        assert a.state is Readiness.PENDING and a.nbytes == 123
        release.set()
        _until(adm, "a", Readiness.READY)
        _until(adm, "boom", Readiness.FAILED)
        boom = adm.take("boom")
        assert boom is not None and boom.reason is not None and "decoder bug" in boom.reason
    finally:
        release.set()
        adm.close()


def test_a_request_with_cfg_companions_is_ready_only_when_every_branch_is(
    senders: list[SenderProc], namespace: str
) -> None:
    """The request and its negative-prompt companion are one unit: one branch here is
    ``pending``, both here is ``ready``; the companion is taken after its request. A companion
    that never comes ends the unit at the deadline, handed out as a failure of its own."""
    senders.append(SenderProc(namespace))
    mgr = stage_receiver(namespace, timeout=1.5)
    try:
        adm = mgr.admission
        started = adm.offer(["p", "q"], companions={"p": ["p__neg"], "q": ["q__neg"]})
        assert sorted(started) == ["p", "p__neg", "q", "q__neg"]
        senders[0].send_kv("p", 1)
        end = time.monotonic() + 10
        while adm.poll(["p"])["p"].state is not Readiness.PENDING:
            assert time.monotonic() < end
            time.sleep(0.002)
        assert adm.take("p") is None and adm.ready() == []  # its companion is still missing
        senders[0].send_kv("p__neg", 2)
        _until(adm, "p", Readiness.READY)
        assert adm.ready() == ["p"] and adm.poll(["p"])["p"].nbytes > 0
        assert adm.take("p__neg") is None  # after its request, not before
        p, neg = adm.take("p"), adm.take("p__neg")
        assert p is not None and _fill(p) == 1 and neg is not None and _fill(neg) == 2
        senders[0].send_kv("q", 3)  # q's companion never comes
        _until(adm, "q", Readiness.READY)
        q, q_neg = adm.take("q"), adm.take("q__neg")
        assert q is not None and _fill(q) == 3
        assert q_neg is not None and q_neg.status is ReceiveStatus.TIMEOUT
        assert len(adm) == 0
    finally:
        mgr.close()


# -- what the prefetcher builds on (unit level, scripted receives) ------------------------------
def test_withdraw_takes_back_only_a_request_whose_receive_has_not_started() -> None:
    """One receive thread, busy with ``first``: ``queued`` (and a request with a companion) can
    be withdrawn and is never received; a started or ended request cannot be."""
    entered, release = threading.Event(), threading.Event()
    calls: list[str] = []

    def receive(rid: str, target_device: Any = None, **kw: Any) -> ReceiveResult:
        calls.append(rid)
        if rid == "first":
            entered.set()
            assert release.wait(10)
        return ReceiveResult(rid, ReceiveStatus.OK, nbytes=1)

    adm = KVAdmission(receive, recv_timeout=10.0, max_receives=1, name="kv-test")
    try:
        assert [t.name for t in adm.threads] == ["kv-test"]
        adm.offer(["first", "queued"])
        adm.offer("p", companions={"p": ["p__neg"]})
        assert entered.wait(10)
        states = adm.poll()
        assert states["first"].started and not states["queued"].started
        assert states["queued"].state is Readiness.MISSING
        assert not adm.withdraw("first")  # running: it may have taken its payload already
        assert not adm.withdraw("p__neg")  # a companion goes with its request
        assert adm.withdraw("queued") and not adm.withdraw("queued")
        assert adm.withdraw("p") and sorted(adm.poll()) == ["first"]
        release.set()
        assert adm.wait("first", time.monotonic() + 10)
        assert not adm.withdraw("first")  # ended: its outcome waits for take
        assert adm.take("first") is not None
    finally:
        release.set()
        adm.close()
    assert calls == ["first"]  # the withdrawn requests never reached the receive


def test_wait_blocks_until_outcomes_are_in_and_takes_nothing() -> None:
    release = threading.Event()

    def receive(rid: str, target_device: Any = None, **kw: Any) -> ReceiveResult:
        if rid == "slow":
            assert release.wait(10)
        return ReceiveResult(rid, ReceiveStatus.OK, nbytes=1)

    adm = KVAdmission(receive, recv_timeout=10.0, max_receives=2)
    try:
        assert [t.name for t in adm.threads] == ["kv-admission-0", "kv-admission-1"]
        assert adm.wait(deadline=time.monotonic())  # nothing tracked: at once
        adm.offer(["slow", "fast"])
        assert adm.wait("fast", time.monotonic() + 10)
        fast = adm.poll(["fast"])["fast"]
        assert fast.state is Readiness.READY and fast.started and fast.held_s >= 0.0
        assert not adm.wait("slow", time.monotonic() + 0.05)  # still running at the deadline
        assert not adm.wait(deadline=time.monotonic())
        assert adm.poll(["slow"])["slow"].held_s == 0.0  # no outcome yet
        assert adm.wait("unknown", time.monotonic())  # not tracked: nothing to wait for
        release.set()
        assert adm.wait(deadline=time.monotonic() + 10)
        assert sorted(adm.ready()) == ["fast", "slow"]  # wait took nothing
    finally:
        release.set()
        adm.close()


def test_offer_takes_a_deadline_made_by_its_caller() -> None:
    seen: dict[str, float] = {}

    def receive(rid: str, target_device: Any = None, *, deadline: float, **kw: Any) -> Any:
        seen[rid] = deadline
        return ReceiveResult(rid, ReceiveStatus.OK, nbytes=1)

    adm = KVAdmission(receive, recv_timeout=60.0, max_receives=1)
    try:
        end = time.monotonic() + 5.0
        with pytest.raises(ValueError, match="not both"):
            adm.offer("a", timeout=1.0, deadline=end)
        assert adm.offer("a", deadline=end) == ["a"]
        adm.offer("late", deadline=time.monotonic() - 1.0)  # passed before a thread was free
        assert adm.wait(deadline=time.monotonic() + 10)
        assert seen == {"a": end}
        late = adm.poll(["late"])["late"]
        assert late.state is Readiness.FAILED and not late.started
        assert late.status is ReceiveStatus.TIMEOUT
    finally:
        adm.close()


def test_close_from_a_receive_thread_does_not_join_itself() -> None:
    """A receive that closes its own tracker (a prefetch shut down from its callback) returns."""
    closed: list[list[str]] = []
    holder: list[KVAdmission] = []

    def receive(rid: str, target_device: Any = None, **kw: Any) -> ReceiveResult:
        closed.append(holder[0].close())
        return ReceiveResult(rid, ReceiveStatus.OK, nbytes=1)

    adm = KVAdmission(receive, recv_timeout=10.0, max_receives=1)
    holder.append(adm)
    adm.offer("a")
    adm.threads[0].join(10)
    assert not adm.threads[0].is_alive() and closed == [["a"]]


class _SlowPull(LocalConnector):
    """A LocalConnector that reports its incoming bytes, then holds each wait until released:
    the moment a cross-node pull is granted and its bytes move."""

    reports_incoming = True

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        self.granted, self.finish = threading.Event(), threading.Event()

    def wait(self, *args: Any, on_incoming: Any = None, **kw: Any) -> Any:
        buf = super().wait(*args, **kw)
        if buf is not None:
            on_incoming(buf.size)
            self.granted.set()
            assert self.finish.wait(10)
        return buf


def test_a_request_whose_bytes_are_on_their_way_is_pending_with_their_size(
    make_manager: ManagerFactory, namespace: str
) -> None:
    conn = _SlowPull({"namespace": namespace})
    sender = make_manager("sender")
    receiver = make_manager("receiver", connector=conn, recv_timeout=10.0)
    try:
        caches = [torch.full((2, 4, 8, 2, 4), float(i)) for i in range(2)]
        spec = {"r": {"block_ids": [0, 1], "seq_len": 10}}
        sender.handle_finished_requests_kv_transfer(spec, caches, 8, "torch.float32")
        receiver.admission.offer("r")
        assert conn.granted.wait(10)
        state = receiver.admission.poll()["r"]
        assert state.state is Readiness.PENDING and state.nbytes > 0, state
        conn.finish.set()
        assert receiver.admission.wait("r", deadline=time.monotonic() + 10)
        result = receiver.admission.take("r")
        assert result is not None and result.ok and result.nbytes == state.nbytes
    finally:
        conn.finish.set()


def test_a_receive_by_id_runs_the_callers_own_receive_with_the_id_only() -> None:
    """:func:`receive_by_id` (the vLLM worker's loads): the admission's thread hands the id, and
    nothing else, to the caller's function; what it returns is the request's outcome, what it
    raises fails the request."""
    calls: list[tuple[Any, ...]] = []

    def run(rid: str, *extra: Any) -> ReceiveResult:
        calls.append((rid, *extra))
        if rid == "boom":
            raise RuntimeError("load bug")
        return ReceiveResult(rid, ReceiveStatus.OK, nbytes=7)

    adm = KVAdmission(receive_by_id(run), recv_timeout=10.0, max_receives=2)
    try:
        adm.offer(["a", "boom"], sender_info={"host": "h"})
        _until(adm, "a", Readiness.READY)
        _until(adm, "boom", Readiness.FAILED)
        a, boom = adm.take("a"), adm.take("boom")
        assert a is not None and a.ok and a.nbytes == 7
        assert boom is not None and boom.reason is not None and "load bug" in boom.reason
        assert sorted(calls) == [("a",), ("boom",)]
    finally:
        adm.close()
