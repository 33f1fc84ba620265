"""Prefetch over a real cross-process SharedMemoryConnector: no lost payloads, dead senders.

A sender process (:mod:`support.stage_sender`) runs its own ``OmniKVTransferManager`` (sender
side, SharedMemoryConnector on the test's namespace) and sends a request's KV when told over a
pipe. The test process is the receiving stage with async prefetch on. Every sender is killed by
PID at the end of its test.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from omnikv import ReceiveStatus
from omnikv.transfer.prefetch import KVPrefetcher
from support.stage_sender import SenderProc, stage_receiver

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

SENDER_INFO = {"host": "127.0.0.1", "zmq_port": 50151}


def _job(rid: str) -> dict[str, Any]:
    return {"request_id": rid, "kv_sender_info": dict(SENDER_INFO)}


def _req(rid: str) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, sampling_params=SimpleNamespace())


def _wait_state(pf: KVPrefetcher, rid: str, state: str, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while pf.tracked().get(rid) != state:
        assert time.monotonic() < end, f"{rid} never reached {state}: {pf.tracked()}"
        time.sleep(0.002)


def _fill_of(req: SimpleNamespace) -> float:
    """The value the sender filled layer 0's key with (layer i holds fill + i)."""
    keys = req.past_key_values.key_cache
    first = keys[0]
    assert torch.all(first == first.flatten()[0])
    return float(first.flatten()[0])


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "kv-prefetch" and t.is_alive()]


def test_prefetched_dropped_and_later_scheduled_still_gets_its_kv(
    senders: list[SenderProc], namespace: str
) -> None:
    """The three states a superseded prefetch can be in, each over a real cross-process SHM.

    finished (A): kept in the table; running (C): finishes into the table; queued (Q): cancelled
    before touching the connector, so the payload stays at the source. All three requests are
    scheduled later and get their own KV.
    """
    sender = SenderProc(namespace)
    senders.append(sender)
    mgr = stage_receiver(namespace, prefetch=True, timeout=10.0)
    try:
        # finished, then superseded by B and B consumed first
        sender.send_kv("A", 10)
        sender.send_kv("B", 20)
        mgr.start_prefetch(_job("A"))
        pf = mgr.prefetcher
        assert pf is not None
        _wait_state(pf, "A", "done")
        mgr.start_prefetch(_job("B"))
        b = _req("B")
        assert mgr.consume_and_distribute_kv_cache(b) and _fill_of(b) == 20
        assert pf.tracked() == {"A": "done"}

        # running (waits for a payload not yet sent), superseded by D; Q queued behind it, then
        # superseded by E while still queued
        mgr.start_prefetch(_job("C"))
        _wait_state(pf, "C", "running")
        mgr.start_prefetch(_job("Q"))
        assert pf.tracked()["Q"] == "queued"
        mgr.start_prefetch(_job("E"))
        assert "Q" not in pf.tracked()  # cancelled: it never asked the connector
        sender.send_kv("C", 30)
        _wait_state(pf, "C", "done")
        sender.send_kv("E", 50)
        e = _req("E")
        assert mgr.consume_and_distribute_kv_cache(e) and _fill_of(e) == 50

        # scheduled later: every one gets its own KV
        a, c, q = _req("A"), _req("C"), _req("Q")
        assert mgr.consume_and_distribute_kv_cache(a) and _fill_of(a) == 10
        assert mgr.consume_and_distribute_kv_cache(c) and _fill_of(c) == 30
        sender.send_kv("Q", 40)
        assert mgr.consume_and_distribute_kv_cache(q) and _fill_of(q) == 40  # synchronous
        assert pf.tracked() == {}
        # consume-once: nothing is left at the source or in the table for any of them
        again = _req("A")
        mgr.config.recv_timeout = 0.2
        assert not mgr.consume_and_distribute_kv_cache(again)
        res = mgr.get_receive_result("A")
        assert res is not None and res.status is ReceiveStatus.TIMEOUT
    finally:
        mgr.close()


@pytest.mark.timing  # a bound of 0.5 s or less past a deadline: run alone, after the lanes
def test_shutdown_is_prompt_with_a_receive_stuck_on_a_killed_sender(
    senders: list[SenderProc], namespace: str
) -> None:
    sender = SenderProc(namespace)
    senders.append(sender)
    mgr = stage_receiver(namespace, prefetch=True, timeout=60.0)
    try:
        sender.send_kv("warm", 1)  # the mesh is up and a payload went through
        w = _req("warm")
        assert mgr.consume_and_distribute_kv_cache(w)
        mgr.start_prefetch(_job("never"))
        pf = mgr.prefetcher
        assert pf is not None and pf.thread is not None
        _wait_state(pf, "never", "running")
        sender.kill()
        # the receive keeps waiting (or ends as peer_gone); either way shutdown is prompt
        conn = mgr.connector
        assert conn is not None
        touched: list[tuple[str, float]] = []
        for name in ("get", "wait", "put", "put_packed"):
            original = getattr(conn, name)

            def spy(*a: Any, _o: Any = original, **k: Any) -> Any:
                touched.append((threading.current_thread().name, time.monotonic()))
                return _o(*a, **k)

            setattr(conn, name, spy)
        t0 = time.monotonic()
        mgr.shutdown_prefetch()
        done = time.monotonic()
        took = done - t0
        assert took < 0.5, took
        assert not pf.thread.is_alive() and _prefetch_threads() == []
        mgr.start_prefetch(_job("late"))  # closed for good: no new worker
        assert _prefetch_threads() == []
        assert [t for name, t in touched if name == "kv-prefetch" and t >= done] == []
    finally:
        mgr.close()
