"""Async prefetch through the manager: the reference's tests 1-14 and 22-24, adapted, plus the
guarantees omnikv adds (no lost payloads, bounded waits, prompt shutdown, consume errors).

Reference §9 tests 15-21 (the role table) belong to ``parallel.py``'s tests. Where the reference
dropped a superseded prefetch (tests 11, 12), omnikv keeps its result: those tests now assert it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from conftest import ManagerFactory
from omnikv import (
    KVPrefetchConsumeError,
    KVPrefetchJob,
    OmniKVCacheConfig,
    OmniKVTransferManager,
    ReceiveResult,
    ReceiveStatus,
)
from omnikv.connectors.base import GetResult, ManagedBuffer, OmniConnectorBase, PutResult
from omnikv.connectors.local import LocalConnector
from omnikv.ranks import distribution
from omnikv.ranks.distribution import StageRanks
from omnikv.transfer.prefetch import KVPrefetcher, PrefetchStart
from omnikv.transfer.received import ReceivedKV

SENDER = {"host": "127.0.0.1", "zmq_port": 50151}
KEY = "omni_stage1_to_stage2_kv_cache_{}"

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def new_sender(make_manager: ManagerFactory) -> Callable[[], OmniKVTransferManager]:
    """A sender manager over this test's LocalConnector namespace."""
    return lambda: make_manager("sender")


@pytest.fixture
def new_receiver(make_manager: ManagerFactory) -> Callable[..., OmniKVTransferManager]:
    """``new_receiver(timeout=5.0, prefetch=True, connector=None)``: a receiver manager with
    async prefetch (``connector``: injected instead of the LocalConnector)."""

    def make(
        *, timeout: float = 5.0, prefetch: bool = True, connector: OmniConnectorBase | None = None
    ) -> OmniKVTransferManager:
        return make_manager(
            "receiver",
            connector=connector,
            recv_timeout=timeout,
            enable_kv_async_prefetch=prefetch,
        )

    return make


def _send(sender: OmniKVTransferManager, rid: str, seq_len: int = 10, fill: float = 0.0) -> None:
    caches: list[Any] = [torch.full((2, 4, 8, 2, 4), fill + i) for i in range(2)]
    sender.handle_finished_requests_kv_transfer(
        {rid: {"block_ids": [0, 1], "seq_len": seq_len}}, caches, 8, "torch.float32"
    )
    res = sender.get_send_result(rid)
    assert res is not None and res.ok


def _job(rid: str) -> dict[str, Any]:
    return {"request_id": rid, "kv_sender_info": dict(SENDER)}


def _req(rid: str) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, sampling_params=SimpleNamespace())


def _wait_state(pf: KVPrefetcher, rid: str, state: str, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while pf.tracked().get(rid) != state:
        assert time.monotonic() < end, f"{rid} never reached {state}: {pf.tracked()}"
        time.sleep(0.002)


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "kv-prefetch"]


# -- enablement (reference tests 1-6) ---------------------------------------------------------
def test_default_manager_has_prefetch_disabled() -> None:
    assert not OmniKVTransferManager(OmniKVCacheConfig()).prefetch_enabled


@pytest.mark.parametrize(
    ("omni_kv", "expected"),
    [
        ({"need_recv_cache": True, "enable_kv_async_prefetch": True}, True),
        (None, False),
        ({"need_recv_cache": True, "enable_kv_async_prefetch": False}, False),
        (
            {
                "need_recv_cache": True,
                "enable_kv_async_prefetch": True,
                "connector_config": {"type": "LocalConnector", "memory_pool_device": "cpu"},
            },
            True,
        ),
        (
            {
                "need_recv_cache": True,
                "enable_kv_async_prefetch": True,
                "connector_config": {"type": "LocalConnector", "memory_pool_device": "cuda"},
            },
            False,
        ),
    ],
)
def test_from_od_config_flag(omni_kv: dict[str, Any] | None, expected: bool) -> None:
    mgr = OmniKVTransferManager.from_od_config(SimpleNamespace(omni_kv_config=omni_kv))
    assert mgr.prefetch_enabled is expected


def test_cfg_companion_collector_forces_prefetch_off() -> None:
    cfg = SimpleNamespace(
        omni_kv_config={"need_recv_cache": True, "enable_kv_async_prefetch": True},
        cfg_kv_collect_func=lambda *a: {},
    )
    assert not OmniKVTransferManager.from_od_config(cfg).prefetch_enabled


def test_from_vllm_config_never_enables_prefetch() -> None:
    model = SimpleNamespace(
        omni_kv_config={"need_recv_cache": True, "enable_kv_async_prefetch": True}
    )
    assert not OmniKVTransferManager.from_vllm_config(SimpleNamespace(), model).prefetch_enabled


def test_start_prefetch_noop_when_disabled(
    new_receiver: Callable[..., OmniKVTransferManager],
) -> None:
    mgr = new_receiver(prefetch=False)
    mgr.start_prefetch(_job("r1"))
    assert mgr.prefetcher is None


def test_start_prefetch_noop_without_recv_cache(namespace: str) -> None:
    mgr = OmniKVTransferManager(
        OmniKVCacheConfig(enable_kv_async_prefetch=True), async_prefetch=True
    )
    mgr.start_prefetch(_job("r1"))
    assert mgr.prefetcher is None


# -- round trip and table (reference tests 7-13) ----------------------------------------------
def test_round_trip_and_consume_once(
    new_sender: Callable[[], OmniKVTransferManager],
    new_receiver: Callable[..., OmniKVTransferManager],
) -> None:
    sender, mgr = new_sender(), new_receiver()
    _send(sender, "r1")
    mgr.start_prefetch(_job("r1"))
    assert mgr.prefetcher is not None and "r1" in mgr.prefetcher.tracked()
    data, size = mgr.consume_prefetched_kv(_req("r1"))
    assert data is not None and size > 0
    assert len(data["layer_blocks"]["key_cache"]) == 2
    assert data["metadata"]["seq_len"] == 10
    assert mgr.prefetcher.tracked() == {}
    assert mgr.consume_loaded_kv("r1") == (None, 0)  # consume-once; alias
    mgr.close()


def test_consume_without_prefetch_is_a_miss(
    new_receiver: Callable[..., OmniKVTransferManager],
) -> None:
    mgr = new_receiver()
    assert mgr.consume_prefetched_kv(_req("nothing")) == (None, 0)


def test_start_same_request_twice_keeps_one_entry(
    new_receiver: Callable[..., OmniKVTransferManager],
) -> None:
    mgr = new_receiver()
    mgr.start_prefetch(_job("r1"))
    pf = mgr.prefetcher
    assert pf is not None
    mgr.start_prefetch(KVPrefetchJob("r1", dict(SENDER)))
    assert pf.start("r1", dict(SENDER)) is PrefetchStart.TRACKED and len(pf.tracked()) == 1
    mgr.close()


@pytest.mark.parametrize("job", [{"request_id": "r1"}, {"kv_sender_info": SENDER}, {}, None])
def test_job_without_sender_info_or_id_submits_nothing(
    new_receiver: Callable[..., OmniKVTransferManager], job: Any
) -> None:
    mgr = new_receiver()
    mgr.start_prefetch(job)
    assert mgr.prefetcher is None or mgr.prefetcher.tracked() == {}
    assert _prefetch_threads() == [] or mgr.prefetcher is not None


def test_consuming_another_request_keeps_finished_prefetch(
    new_sender: Callable[[], OmniKVTransferManager],
    new_receiver: Callable[..., OmniKVTransferManager],
) -> None:
    """Reference test 11 swept (and lost) A here; omnikv keeps A's result for A's consume."""
    sender, mgr = new_sender(), new_receiver()
    _send(sender, "A", seq_len=10)
    mgr.start_prefetch(_job("A"))
    assert mgr.prefetcher is not None
    _wait_state(mgr.prefetcher, "A", "done")
    assert mgr.consume_prefetched_kv(_req("other")) == (None, 0)
    data, _ = mgr.consume_prefetched_kv(_req("A"))
    assert data is not None and data["metadata"]["seq_len"] == 10
    mgr.close()


def test_superseded_finished_prefetch_keeps_its_kv(
    new_sender: Callable[[], OmniKVTransferManager],
    new_receiver: Callable[..., OmniKVTransferManager],
) -> None:
    """Prefetch A, then B: consuming A later still gets A's KV (reference test 12 lost it)."""
    sender, mgr = new_sender(), new_receiver()
    _send(sender, "A", seq_len=10, fill=1.0)
    _send(sender, "B", seq_len=12, fill=2.0)
    mgr.start_prefetch(_job("A"))
    assert mgr.prefetcher is not None
    _wait_state(mgr.prefetcher, "A", "done")
    mgr.start_prefetch(_job("B"))
    _wait_state(mgr.prefetcher, "B", "done")
    req_a = _req("A")
    assert mgr.consume_and_distribute_kv_cache(req_a)
    assert req_a.kv_metadata["seq_len"] == 10
    assert float(req_a.past_key_values.key_cache[0].flatten()[0]) == 1.0
    data, _ = mgr.consume_prefetched_kv(_req("B"))
    assert data is not None and data["metadata"]["seq_len"] == 12
    mgr.close()


def test_superseded_running_prefetch_finishes_into_the_table(
    new_sender: Callable[[], OmniKVTransferManager],
    new_receiver: Callable[..., OmniKVTransferManager],
) -> None:
    sender, mgr = new_sender(), new_receiver()
    mgr.start_prefetch(_job("A"))  # A's KV is not there yet: the worker waits for it
    pf = mgr.prefetcher
    assert pf is not None
    _wait_state(pf, "A", "running")
    mgr.start_prefetch(_job("B"))
    _send(sender, "A", seq_len=7)
    _send(sender, "B", seq_len=9)
    _wait_state(pf, "B", "done")
    assert pf.tracked()["A"] == "done"
    data, _ = mgr.consume_prefetched_kv(_req("A"))
    assert data is not None and data["metadata"]["seq_len"] == 7
    mgr.close()


def test_superseded_queued_prefetch_leaves_payload_at_source(
    new_sender: Callable[[], OmniKVTransferManager],
    new_receiver: Callable[..., OmniKVTransferManager],
    namespace: str,
) -> None:
    """A queued prefetch that is superseded consumes nothing; the request, scheduled later,
    still gets its KV from the source."""
    sender, mgr = new_sender(), new_receiver()
    probe = LocalConnector({"namespace": namespace})
    mgr.start_prefetch(_job("A"))  # blocks the single worker (A not sent yet)
    pf = mgr.prefetcher
    assert pf is not None
    _wait_state(pf, "A", "running")
    _send(sender, "B", seq_len=5)
    mgr.start_prefetch(_job("B"))
    assert pf.tracked()["B"] == "queued"
    mgr.start_prefetch(_job("C"))  # supersedes the queued B
    assert "B" not in pf.tracked()
    assert any(k.startswith(KEY.format("B")) for k in probe.pending_keys())
    req_b = _req("B")
    assert mgr.consume_and_distribute_kv_cache(req_b)  # scheduled later: sync receive finds it
    assert req_b.kv_metadata["seq_len"] == 5
    mgr.close()


def test_consume_of_queued_prefetch_receives_synchronously(
    new_sender: Callable[[], OmniKVTransferManager],
    new_receiver: Callable[..., OmniKVTransferManager],
) -> None:
    sender, mgr = new_sender(), new_receiver()
    mgr.start_prefetch(_job("A"))
    pf = mgr.prefetcher
    assert pf is not None
    _wait_state(pf, "A", "running")
    _send(sender, "B", seq_len=6)
    mgr.start_prefetch(_job("B"))
    req_b = _req("B")
    assert mgr.consume_and_distribute_kv_cache(req_b)
    assert req_b.kv_metadata["seq_len"] == 6
    mgr.close()


def test_shutdown_empties_table_and_stops_worker(
    new_sender: Callable[[], OmniKVTransferManager],
    new_receiver: Callable[..., OmniKVTransferManager],
) -> None:
    sender, mgr = new_sender(), new_receiver()
    _send(sender, "A")
    mgr.start_prefetch(_job("A"))
    mgr.start_prefetch(_job("B"))
    pf = mgr.prefetcher
    assert pf is not None and pf.thread is not None
    mgr.shutdown_prefetch()
    assert pf.tracked() == {} and not pf.thread.is_alive()
    mgr.start_prefetch(_job("C"))
    assert pf.tracked() == {}
    mgr.shutdown_prefetch()  # idempotent
    mgr.close()


def test_per_call_sender_info_keeps_base_endpoint(
    new_sender: Callable[[], OmniKVTransferManager],
    new_receiver: Callable[..., OmniKVTransferManager],
) -> None:
    sender, mgr = new_sender(), new_receiver()
    mgr.update_sender_info({"host": "10.0.0.1", "zmq_port": 6000})
    _send(sender, "A")
    mgr.start_prefetch({"request_id": "A", "kv_sender_info": {"host": "10.9.9.9", "zmq_port": 1}})
    assert mgr.consume_prefetched_kv("A")[0] is not None
    assert mgr.sender_endpoint == ("10.0.0.1", 6000)
    mgr.close()


# -- roles (reference tests 22-24) ------------------------------------------------------------
def _with_role(monkeypatch: pytest.MonkeyPatch, follower: bool) -> None:
    topo = SimpleNamespace(
        is_follower=follower, is_leader=not follower, is_local=False, tp_active=False, context=None
    )
    monkeypatch.setattr(StageRanks, "topo", property(lambda self: topo))


def test_follower_does_not_prefetch(
    new_receiver: Callable[..., OmniKVTransferManager], monkeypatch: pytest.MonkeyPatch
) -> None:
    _with_role(monkeypatch, follower=True)
    mgr = new_receiver()
    mgr.start_prefetch(_job("A"))
    pf = mgr.prefetcher
    assert pf is not None and pf.tracked() == {} and pf.thread is None


def test_leader_prefetches(
    new_receiver: Callable[..., OmniKVTransferManager], monkeypatch: pytest.MonkeyPatch
) -> None:
    _with_role(monkeypatch, follower=False)
    mgr = new_receiver()
    mgr.start_prefetch(_job("A"))
    assert mgr.prefetcher is not None and "A" in mgr.prefetcher.tracked()
    mgr.close()


def test_consume_and_distribute_applies_kv(
    new_sender: Callable[[], OmniKVTransferManager],
    new_receiver: Callable[..., OmniKVTransferManager],
) -> None:
    sender, mgr = new_sender(), new_receiver()
    _send(sender, "A")
    mgr.start_prefetch(_job("A"))
    req = _req("A")
    assert mgr.consume_and_distribute_kv_cache(req)
    assert len(req.past_key_values.key_cache) == 2
    assert req.sampling_params.past_key_values is req.past_key_values
    assert req.kv_metadata["seq_len"] == 10
    mgr.close()


def test_consume_and_distribute_sync_on_miss(
    new_sender: Callable[[], OmniKVTransferManager],
    new_receiver: Callable[..., OmniKVTransferManager],
) -> None:
    sender, mgr = new_sender(), new_receiver()
    _send(sender, "A")
    req = _req("A")
    assert mgr.consume_and_distribute_kv_cache(req)
    assert req.kv_metadata["seq_len"] == 10


# -- bounded waits ----------------------------------------------------------------------------
@pytest.mark.timing  # a bound of 0.5 s or less past a deadline: run alone, after the lanes
def test_prefetch_timeout_is_not_followed_by_a_second_full_wait(
    new_receiver: Callable[..., OmniKVTransferManager],
) -> None:
    mgr = new_receiver(timeout=0.3)
    mgr.start_prefetch(_job("never"))
    t0 = time.monotonic()
    assert not mgr.consume_and_distribute_kv_cache(_req("never"))
    waited = time.monotonic() - t0
    assert waited < 0.3 + 0.5  # one deadline (+ slice and grace), not two
    res = mgr.get_receive_result("never")
    assert res is not None and res.status is ReceiveStatus.TIMEOUT
    mgr.close()


class StuckConnector(OmniConnectorBase):
    """A dead sender's transport: ``wait`` blocks, ignoring its deadline, until ``unblock``."""

    supports_raw_data = True

    def __init__(self) -> None:
        super().__init__()
        self.unblock = threading.Event()
        self.entered = threading.Event()
        self.calls: list[tuple[str, str]] = []
        self._lock = threading.Lock()

    def _log(self, name: str) -> None:
        with self._lock:
            self.calls.append((name, threading.current_thread().name))

    def put_packed(self, *a: Any, **kw: Any) -> PutResult:
        self._log("put")
        return False, 0, None

    def get(
        self, from_stage: str, to_stage: str, get_key: str, metadata: dict[str, Any] | None = None
    ) -> GetResult | None:
        self._log("get")
        return None

    def wait(
        self,
        from_stage: str,
        to_stage: str,
        get_key: str,
        *,
        deadline: float,
        metadata: dict[str, Any] | None = None,
    ) -> ManagedBuffer | None:
        self._log("wait")
        self.entered.set()
        self.unblock.wait(20)
        return None

    def close(self) -> None:
        self._closed = True


@pytest.mark.timing  # a bound of 0.5 s or less past a deadline: run alone, after the lanes
def test_consume_waits_at_most_the_deadline_with_a_stuck_connector(
    new_receiver: Callable[..., OmniKVTransferManager],
) -> None:
    conn = StuckConnector()
    mgr = new_receiver(timeout=0.3, connector=conn)
    mgr.start_prefetch(_job("A"))
    assert conn.entered.wait(5)
    t0 = time.monotonic()
    assert not mgr.consume_and_distribute_kv_cache(_req("A"))
    waited = time.monotonic() - t0
    assert waited < 0.3 + 0.5 + 0.3
    # no synchronous receive raced the still-running background one
    assert [c for c in conn.calls if c[1] != "kv-prefetch"] == []
    conn.unblock.set()
    mgr.close()


@pytest.mark.timing  # a bound of 0.5 s or less past a deadline: run alone, after the lanes
def test_shutdown_is_prompt_while_waiting_on_a_sender_that_never_puts(
    new_receiver: Callable[..., OmniKVTransferManager],
) -> None:
    mgr = new_receiver(timeout=60.0)
    mgr.start_prefetch(_job("never"))
    pf = mgr.prefetcher
    assert pf is not None
    _wait_state(pf, "never", "running")
    t0 = time.monotonic()
    mgr.shutdown_prefetch()
    assert time.monotonic() - t0 < 0.5
    assert _prefetch_threads() == []
    mgr.close()


@pytest.mark.timing  # a bound of 0.5 s or less past a deadline: run alone, after the lanes
def test_shutdown_with_uninterruptible_connector_is_bounded_and_worker_stops_touching_it(
    new_receiver: Callable[..., OmniKVTransferManager],
) -> None:
    conn = StuckConnector()
    mgr = new_receiver(timeout=60.0, connector=conn)
    mgr.start_prefetch(_job("A"))
    assert conn.entered.wait(5)
    pf = mgr.prefetcher
    assert pf is not None and pf.thread is not None
    pf.join_timeout_s = 0.2
    t0 = time.monotonic()
    mgr.shutdown_prefetch()
    assert time.monotonic() - t0 < 0.6
    assert pf.thread.is_alive()  # still inside the uninterruptible call
    conn.unblock.set()
    pf.thread.join(5)
    assert not pf.thread.is_alive() and _prefetch_threads() == []
    assert conn.calls == [("wait", "kv-prefetch")]
    mgr.close()


def test_close_calls_shutdown_prefetch(new_receiver: Callable[..., OmniKVTransferManager]) -> None:
    mgr = new_receiver(timeout=60.0)
    mgr.start_prefetch(_job("never"))
    pf = mgr.prefetcher
    assert pf is not None
    _wait_state(pf, "never", "running")
    t0 = time.monotonic()
    mgr.close()
    assert time.monotonic() - t0 < 1.0
    assert pf.closed and _prefetch_threads() == []


# -- consume errors ---------------------------------------------------------------------------
#: A device torch knows by name but cannot copy to in this build: the post-get device copy fails
#: after the payload was consumed, as an out-of-memory copy would.
UNUSABLE_DEVICE = torch.device("xla")


def test_consume_error_raised_and_no_sync_retry(
    new_sender: Callable[[], OmniKVTransferManager],
    new_receiver: Callable[..., OmniKVTransferManager],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    sender, mgr = new_sender(), new_receiver(timeout=5.0)
    _send(sender, "A")
    _send(sender, "B")
    mgr.start_prefetch(_job("A"), target_device=UNUSABLE_DEVICE)
    with pytest.raises(KVPrefetchConsumeError):
        mgr.consume_prefetched_kv("A")
    mgr.start_prefetch(_job("B"), target_device=UNUSABLE_DEVICE)
    calls: list[bool] = []

    def distribute(topo: Any, req: Any, *, received: bool, **kw: Any) -> None:
        calls.append(received)

    monkeypatch.setattr(distribution, "distribute", distribute)
    t0 = time.monotonic()
    with caplog.at_level(logging.ERROR):
        assert not mgr.consume_and_distribute_kv_cache(_req("B"))
    assert time.monotonic() - t0 < 2.0  # no sync receive waiting out recv_timeout
    assert calls == [False]  # distribution entered (followers are told "nothing")
    assert "cannot recover" in caplog.text
    mgr.close()


def test_unexpected_error_still_distributes_then_raises(
    new_receiver: Callable[..., OmniKVTransferManager], monkeypatch: pytest.MonkeyPatch
) -> None:
    mgr = new_receiver()
    calls: list[bool] = []

    def boom(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("bug")

    def distribute(topo: Any, req: Any, *, received: bool, **kw: Any) -> None:
        calls.append(received)

    monkeypatch.setattr(mgr, "receive_kv_cache_result", boom)
    monkeypatch.setattr(distribution, "distribute", distribute)
    with pytest.raises(RuntimeError, match="bug"):
        mgr.consume_and_distribute_kv_cache(_req("A"))
    assert calls == [False]


def test_follower_skips_receive_and_takes_distributed_payload(
    new_receiver: Callable[..., OmniKVTransferManager], monkeypatch: pytest.MonkeyPatch
) -> None:
    _with_role(monkeypatch, follower=True)
    mgr = new_receiver()
    kv = SimpleNamespace(key_cache=[torch.ones(2)], value_cache=[torch.ones(2)])

    def distribute(topo: Any, req: Any, *, received: bool, **kw: Any) -> Any:
        assert received is False
        return {"past_key_values": kv, "kv_metadata": {"seq_len": 3}}

    monkeypatch.setattr(distribution, "distribute", distribute)
    req = _req("A")
    assert mgr.consume_and_distribute_kv_cache(req)
    assert req.past_key_values is kv and req.kv_metadata == {"seq_len": 3}
    assert mgr.get_receive_result("A") is None  # never touched the connector


def test_a_job_with_request_ids_prefetches_its_first_id() -> None:
    job = KVPrefetchJob.from_value({"request_ids": ["d1", "d2"], "kv_sender_info": SENDER})
    assert job is not None and job.request_id == "d1"
    assert KVPrefetchJob.from_value({"request_ids": [], "kv_sender_info": SENDER}) is None


def test_a_prefetch_takes_the_recv_timeout_the_config_has_when_it_starts() -> None:
    """A runner may shorten ``recv_timeout`` after construction: the next prefetch follows it."""
    config = OmniKVCacheConfig(recv_timeout=60.0)
    waits: list[float] = []

    def receive(request_id: str, target_device: Any, *, deadline: float, **_: Any) -> Any:
        waits.append(deadline - time.monotonic())
        return ReceiveResult(request_id, ReceiveStatus.TIMEOUT)

    pf = KVPrefetcher(receive, config=config)
    config.recv_timeout = 0.5
    assert pf.start("A", dict(SENDER)) is PrefetchStart.STARTED
    assert pf.wait_idle(time.monotonic() + 5.0)
    assert len(waits) == 1 and 0.0 < waits[0] <= 0.5
    pf.shutdown()


def _scripted(outcomes: dict[str, ReceiveStatus]) -> Any:
    """A receive that ends each request at once with its scripted status (OK: a tiny KV)."""

    def receive(request_id: str, target_device: Any, **_: Any) -> ReceiveResult:
        status = outcomes[request_id]
        if status is not ReceiveStatus.OK:
            return ReceiveResult(request_id, status)
        kv = ReceivedKV(request_id, [], {"seq_len": 1}, [torch.ones(1)], [torch.ones(1)], nbytes=8)
        return ReceiveResult(request_id, status, kv=kv, nbytes=8)

    return receive


def test_the_table_keeps_results_evicts_failures_and_declines_when_full() -> None:
    """capacity 1: a failed prefetch makes room for the next one; a finished one with KV does
    not (the new request's payload stays at its source)."""
    outcomes = {"fails": ReceiveStatus.TIMEOUT, "A": ReceiveStatus.OK, "B": ReceiveStatus.OK}
    pf = KVPrefetcher(_scripted(outcomes), config=OmniKVCacheConfig(recv_timeout=5.0), capacity=1)
    try:
        assert pf.start("fails", dict(SENDER)) is PrefetchStart.STARTED
        assert pf.wait_idle(time.monotonic() + 5.0) and pf.tracked() == {"fails": "done"}
        assert pf.start("A", dict(SENDER)) is PrefetchStart.STARTED  # the failure was evicted
        assert pf.wait_idle(time.monotonic() + 5.0) and pf.tracked() == {"A": "done"}
        assert pf.start("B", dict(SENDER)) is PrefetchStart.FULL
        found = pf.consume("A")
        assert found.result is not None and found.result.ok and not found.sync_retry
        assert pf.consume("fails").result is None  # evicted: a synchronous receive may find it
    finally:
        pf.shutdown()


def test_an_unconsumed_result_past_its_ttl_is_released_and_its_consume_raises(
    caplog: pytest.LogCaptureFixture,
) -> None:
    outcomes = {"A": ReceiveStatus.OK, "B": ReceiveStatus.OK}
    config = OmniKVCacheConfig(recv_timeout=5.0)
    pf = KVPrefetcher(_scripted(outcomes), config=config, result_ttl_s=0.0)
    try:
        assert pf.start("A", dict(SENDER)) is PrefetchStart.STARTED
        assert pf.wait_idle(time.monotonic() + 5.0)
        with caplog.at_level(logging.ERROR):
            assert pf.start("B", dict(SENDER)) is PrefetchStart.STARTED  # A's TTL has passed
        assert "A" not in pf.tracked() and "never consumed" in caplog.text
        with pytest.raises(KVPrefetchConsumeError, match="dropped"):
            pf.consume("A")
        assert pf.consume("A").result is None  # raised once; the request is forgotten
    finally:
        pf.shutdown()


def test_prefetch_readiness_shows_pending_with_its_bytes_once_the_payload_is_taken() -> None:
    """Prefetch is an admission entry: between taking its payload and finishing the decode it
    is ``pending`` with the payload's bytes (the receive below stands for the manager's: it
    reports the arrival, then holds until the test lets it finish)."""
    taken, finish = threading.Event(), threading.Event()

    def receive(rid: str, target_device: Any = None, **kw: Any) -> ReceiveResult:
        assert kw["on_arrival"] is not None
        kw["on_arrival"](4096)
        taken.set()
        assert finish.wait(10)
        return ReceiveResult(rid, ReceiveStatus.TIMEOUT, reason="stands in for a receive")

    config = OmniKVCacheConfig(need_recv_cache=True, enable_kv_async_prefetch=True)
    pf = KVPrefetcher(receive, config=config)
    try:
        assert pf.readiness() == {}
        assert pf.start("r1", dict(SENDER)) is PrefetchStart.STARTED
        assert taken.wait(10)
        state = pf.readiness()["r1"]
        assert (state.state.value, state.nbytes) == ("pending", 4096)
        assert pf.tracked()["r1"] == "running"
        finish.set()
        _wait_state(pf, "r1", "done")
        assert pf.readiness()["r1"].state.value == "failed"
    finally:
        finish.set()
        pf.shutdown()
