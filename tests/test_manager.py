"""Seed API through the manager: send/receive flows, outcomes, sender info, config chain.

Adapted from the reference's test catalogue (reference-behaviour §9, tests 25-40), with the
behaviour changes omnikv makes on purpose (failures are recorded; out-of-range ids fail).
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from omnikv import (
    KVCacheTransferData,
    KVPrefetchConsumeError,
    OmniKVCacheConfig,
    OmniKVTransferManager,
    ReceiveStatus,
    SendStatus,
)
from omnikv.connectors.base import ManagedBuffer, OmniConnectorBase, PutResult
from omnikv.connectors.local import LocalConnector


def _pair(
    namespace: str, timeout: float = 1.0, **recv: Any
) -> tuple[OmniKVTransferManager, OmniKVTransferManager]:
    conn = {"type": "LocalConnector", "namespace": namespace}
    sender = OmniKVTransferManager(
        OmniKVCacheConfig(
            connector_config=dict(conn),
            from_stage="stage1",
            to_stage="stage2",
            need_send_cache=True,
        )
    )
    receiver = OmniKVTransferManager(
        OmniKVCacheConfig(
            connector_config=dict(conn),
            from_stage="stage1",
            stage_id="stage2",
            need_recv_cache=True,
            recv_timeout=timeout,
            **recv,
        )
    )
    return sender, receiver


def _caches(
    layers: int = 2, blocks: int = 8, bs: int = 8, heads: int = 4, dim: int = 16
) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(2, blocks, bs, heads, dim, generator=g) for _ in range(layers)]


def test_send_receive_round_trip_legacy_key(namespace: str) -> None:
    sender, receiver = _pair(namespace)
    caches = _caches()
    ids = sender.handle_finished_requests_kv_transfer(
        {
            "req_test_1": {
                "block_ids": [1, 3, 5],
                "seq_len": 20,
                "custom_metadata": {"rope": [1, 2]},
            }
        },
        caches,
        8,
        "torch.float32",
    )
    assert ids == ["req_test_1"]
    res = sender.get_send_result("req_test_1")
    assert res is not None and res.ok and res.keys == ["omni_stage1_to_stage2_kv_cache_req_test_1"]
    data, size = receiver.receive_kv_cache_for_request("req_test_1")
    assert data is not None and size == res.nbytes > 0
    k = data["layer_blocks"]["key_cache"]
    assert len(k) == 2 and k[0].shape == (20, 4, 16)
    want = torch.cat([caches[1][0][i] for i in (1, 3, 5)])[:20]
    assert torch.equal(k[1], want)
    assert data["metadata"] == {
        "block_size": 8,
        "num_layers": 2,
        "dtype": "torch.float32",
        "seq_len": 20,
        "rope": [1, 2],
    }
    assert receiver.get_receive_result("req_test_1").status is ReceiveStatus.OK


def test_failed_send_is_recorded_not_silent(namespace: str) -> None:
    sender, _ = _pair(namespace)
    ids = sender.handle_finished_requests_kv_transfer(
        {
            "ok": {"block_ids": [0], "seq_len": 4},
            "no_blocks": {"block_ids": [], "seq_len": 4},
            "bad_block": {"block_ids": [0, 99], "seq_len": 10},
            "no_seq_len": {"block_ids": [0]},
        },
        _caches(),
        8,
        "float32",
    )
    assert ids == ["ok", "no_blocks", "bad_block", "no_seq_len"]
    status = {r.request_id: r.status for r in sender.last_send_results}
    assert status == {
        "ok": SendStatus.SENT,
        "no_blocks": SendStatus.SKIPPED,
        "bad_block": SendStatus.FAILED,
        "no_seq_len": SendStatus.FAILED,
    }
    assert "outside" in (sender.get_send_result("bad_block").reason or "")
    assert "seq_len" in (sender.get_send_result("no_seq_len").reason or "")


class _FlakyConnector(LocalConnector):
    def __init__(self, fails: int, namespace: str) -> None:
        super().__init__({"namespace": namespace})
        self.fails = fails
        self.calls = 0

    def put_packed(self, *args: Any, **kwargs: Any) -> PutResult:
        self.calls += 1
        if self.calls <= self.fails:
            return False, 0, None
        return super().put_packed(*args, **kwargs)


@pytest.mark.parametrize(("fails", "status"), [(2, SendStatus.SENT), (3, SendStatus.FAILED)])
def test_put_retries_with_backoff(namespace: str, fails: int, status: SendStatus) -> None:
    conn = _FlakyConnector(fails, namespace)
    sender = OmniKVTransferManager(
        OmniKVCacheConfig(from_stage="0", to_stage="1", need_send_cache=True), connector=conn
    )
    slept: list[float] = []
    sender._sender._sleep = slept.append
    sender.handle_finished_requests_kv_transfer(
        {"r": {"block_ids": [0], "seq_len": 3}}, _caches(), 8, "f"
    )
    assert sender.get_send_result("r").status is status
    assert conn.calls == 3
    assert slept == pytest.approx([0.1, 0.2][: min(fails, 2)])


def test_no_connector_returns_ids_and_records_failure() -> None:
    mgr = OmniKVTransferManager(
        OmniKVCacheConfig(from_stage="0", to_stage="1", need_send_cache=True)
    )
    ids = mgr.handle_finished_requests_kv_transfer(
        {"a": {"block_ids": [0], "seq_len": 1}}, _caches(), 8, "f"
    )
    assert ids == ["a"]
    assert mgr.get_send_result("a").status is SendStatus.FAILED
    assert OmniKVTransferManager(OmniKVCacheConfig()).handle_finished_requests_kv_transfer(
        {"b": {}}, [], 8, "f"
    ) == ["b"]


def test_request_id_resolver_changes_transfer_key(namespace: str) -> None:
    sender, receiver = _pair(namespace)
    sender.handle_finished_requests_kv_transfer(
        {"internal-7": {"block_ids": [2], "seq_len": 5}},
        _caches(),
        8,
        "f",
        request_id_resolver=lambda r: "global-7",
    )
    data, _ = receiver.receive_kv_cache_for_request("global-7")
    assert data is not None and data["request_id"] == "global-7"


def test_miss_returns_within_timeout_plus_50ms(namespace: str) -> None:
    _, receiver = _pair(namespace, timeout=0.3)
    t0 = time.monotonic()
    assert receiver.receive_kv_cache_for_request("never") == (None, 0)
    elapsed = time.monotonic() - t0
    assert 0.3 <= elapsed < 0.35
    res = receiver.get_receive_result("never")
    assert (
        res is not None and res.status is ReceiveStatus.TIMEOUT and "missing" in (res.reason or "")
    )


def test_waiting_receiver_wakes_on_put(namespace: str) -> None:
    sender, receiver = _pair(namespace, timeout=5.0)
    import threading

    out: dict[str, Any] = {}

    def recv() -> None:
        out["t0"] = time.monotonic()
        out["data"] = receiver.receive_kv_cache_for_request("late")
        out["t1"] = time.monotonic()

    th = threading.Thread(target=recv)
    th.start()
    sender.handle_finished_requests_kv_transfer(
        {"late": {"block_ids": [0], "seq_len": 2}}, _caches(), 8, "f"
    )
    th.join(5)
    assert out["data"][0] is not None
    assert out["t1"] - out["t0"] < 2.0


def test_dummy_request_and_guards(namespace: str) -> None:
    _, receiver = _pair(namespace, timeout=5.0)
    t0 = time.monotonic()
    assert receiver.receive_kv_cache_for_request("dummy_req_id") == (None, 0)
    assert time.monotonic() - t0 < 0.1
    not_receiver = OmniKVTransferManager(OmniKVCacheConfig())
    assert not_receiver.receive_kv_cache_for_request("x") == (None, 0)


def test_corrupt_payload_is_reported_as_corrupt(namespace: str) -> None:
    _, receiver = _pair(namespace)
    LocalConnector({"namespace": namespace}).put(
        "stage1", "stage2", "omni_stage1_to_stage2_kv_cache_bad", b"\x00\x00\x00\x09{garbage}"
    )
    assert receiver.receive_kv_cache_for_request("bad") == (None, 0)
    res = receiver.get_receive_result("bad")
    assert res is not None and res.status is ReceiveStatus.CORRUPT


def test_dict_payload_and_receive_kv_cache_applies(namespace: str) -> None:
    _, receiver = _pair(namespace)
    kv = {"key_cache": [torch.ones(2, 1, 2)], "value_cache": [torch.zeros(2, 1, 2)]}
    payload = {"request_id": "d1", "layer_blocks": kv, "block_ids": [], "metadata": {"seq_len": 2}}
    LocalConnector({"namespace": namespace}).put(
        "stage1", "stage2", "omni_stage1_to_stage2_kv_cache_d1", payload
    )
    req = SimpleNamespace(request_id="d1", sampling_params=SimpleNamespace())
    assert receiver.receive_kv_cache(req) is True
    assert torch.equal(req.past_key_values.key_cache[0], torch.ones(2, 1, 2))
    assert req.sampling_params.kv_metadata == {"seq_len": 2} == req.kv_metadata


def test_pool_buffer_release_does_not_corrupt_received(namespace: str) -> None:
    """A pool buffer whose release zeroes memory: received tensors stay intact.

    ``receive_copy="copy"`` copies out and releases at once; ``"auto"`` keeps zero-copy views and
    releases the buffer only when the last view dies.
    """
    import gc

    from omnikv import TransferOptions

    data = KVCacheTransferData(
        "p1", {"key_cache": [torch.full((4, 2, 2), 7.0)], "value_cache": [None]}
    )
    released: list[str] = []

    def make() -> torch.Tensor:
        return torch.frombuffer(bytearray(data.to_bytes()), dtype=torch.uint8)

    for mode in ("copy", "auto"):
        raw = make()

        def release(raw: torch.Tensor = raw, mode: str = mode) -> None:
            raw.zero_()
            released.append(mode)

        class _PoolConnector(LocalConnector):
            def wait(self, *a: Any, raw: torch.Tensor = raw, rel: Any = release, **kw: Any) -> Any:
                return ManagedBuffer(raw, release=rel), raw.numel()

        mgr = OmniKVTransferManager(
            OmniKVCacheConfig(from_stage="0", stage_id="1", need_recv_cache=True),
            connector=_PoolConnector({"namespace": namespace}),
            options=TransferOptions(receive_copy=mode),
        )
        got, _ = mgr.receive_kv_cache_for_request("p1")
        assert got is not None
        k = got["layer_blocks"]["key_cache"][0]
        inside = raw.data_ptr() <= k.data_ptr() < raw.data_ptr() + raw.numel()
        if mode == "copy":
            assert released == ["copy"] and not inside
        else:
            assert released == ["copy"] and inside  # still held by the views
        assert k.eq(7.0).all()
        del got, k
        gc.collect()
    assert released == ["copy", "auto"]


def test_device_copy_failure_is_consume_error(
    namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import omnikv.receiver

    def oom(*_: Any) -> None:
        raise RuntimeError("CUDA out of memory (simulated)")

    monkeypatch.setattr(omnikv.receiver, "_map_tensors", oom)
    sender, receiver = _pair(namespace)
    sender.handle_finished_requests_kv_transfer(
        {"dev": {"block_ids": [0], "seq_len": 2}}, _caches(), 8, "f"
    )
    with pytest.raises(KVPrefetchConsumeError, match="payload already consumed"):
        receiver.receive_kv_cache_for_request("dev", target_device=torch.device("cpu"))


def test_receive_multi_kv_cache_fetches_companions_concurrently(namespace: str) -> None:
    sender, receiver = _pair(namespace, timeout=0.5)
    caches = _caches()
    sender.handle_finished_requests_kv_transfer(
        {rid: {"block_ids": [0], "seq_len": 3} for rid in ("p", "p__cfg_text")}, caches, 8, "f"
    )
    calls: list[tuple[Any, ...]] = []

    def collect(request_id: str, cfg_ids: dict, mgr: OmniKVTransferManager, device: Any) -> dict:
        calls.append((request_id, dict(cfg_ids), mgr, device))
        out: dict[str, Any] = {}
        for role, rid in cfg_ids.items():
            data, _ = mgr.receive_kv_cache_for_request(rid, device)
            if data is not None:
                out[f"{role}_past_key_values"] = SimpleNamespace(**data["layer_blocks"])
                out[f"{role}_kv_metadata"] = data["metadata"]
        return out

    sp = SimpleNamespace(cfg_kv_request_ids={"cfg_text": "p__cfg_text", "cfg_img": "p__cfg_img"})
    req = SimpleNamespace(request_id="p", sampling_params=sp)
    t0 = time.monotonic()
    assert receiver.receive_multi_kv_cache(req, collect, None) is True
    elapsed = time.monotonic() - t0
    # cfg_img never arrives: one shared deadline, not one per companion
    assert 0.5 <= elapsed < 0.8
    assert calls[0][0] == "p" and calls[0][2] is receiver
    assert sp.cfg_text_past_key_values.key_cache[0].shape == (3, 4, 16)
    assert not hasattr(sp, "cfg_img_past_key_values")
    assert req.past_key_values.key_cache[0].shape == (3, 4, 16)


def test_update_sender_info_nested_and_flat() -> None:
    conn: dict[str, Any] = {"type": "LocalConnector"}
    mgr = OmniKVTransferManager(
        OmniKVCacheConfig(
            connector_config=conn, stage_id=2, engine_input_source=[1], need_recv_cache=True
        )
    )
    mgr.update_sender_info(
        {1: {"host": "10.0.0.1", "zmq_port": 5000}, 0: {"host": "x", "zmq_port": 1}}
    )
    assert conn["sender_host"] == "10.0.0.1" and conn["sender_zmq_port"] == 5000
    assert (mgr._sender_base_host, mgr._sender_base_zmq_port) == ("10.0.0.1", 5000)
    mgr.update_sender_info({"host": "h", "zmq_port": "6000"})
    assert conn["sender_zmq_port"] == 6000
    mgr.update_sender_info({"0": {"host": "a"}, "5": {"host": "b"}})  # ambiguous: ignored
    assert conn["sender_host"] == "h"


def test_update_sender_info_rank_offset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    conn: dict[str, Any] = {"type": "LocalConnector"}
    mgr = OmniKVTransferManager(
        OmniKVCacheConfig(
            connector_config=conn,
            from_stage="0",
            stage_id="1",
            need_recv_cache=True,
            from_tp=2,
            to_tp=2,
        )
    )
    mgr.update_sender_info({"host": "h", "zmq_port": 7000})
    assert conn["sender_zmq_port"] == 7016 and mgr._sender_base_zmq_port == 7000


def test_per_call_sender_info_does_not_touch_instance(namespace: str) -> None:
    _, receiver = _pair(namespace, timeout=0.05)
    receiver.receive_kv_cache_for_request("zz", sender_info={"host": "h", "zmq_port": 1})
    assert receiver._sender_base_host is None
    assert receiver.receive_kv_cache_for_request("zz", sender_info={"nohost": 1}) == (None, 0)
    assert receiver.get_receive_result("zz").reason == "bad sender_info"


def test_stages() -> None:
    m = OmniKVTransferManager(OmniKVCacheConfig(from_stage=0, to_stage=1, stage_id=3))
    assert m.send_stages == ("0", "1")  # integer stage 0 counts as configured
    assert m.recv_stages == ("2", "3")  # int stage id: its predecessor (reference rule)
    m = OmniKVTransferManager(OmniKVCacheConfig(stage_id=3))
    assert m.recv_stages == ("2", "3") and m.send_stages == (None, None)
    m = OmniKVTransferManager(OmniKVCacheConfig(stage_id=3, engine_input_source=[1]))
    assert m.recv_stages == ("1", "3")
    assert OmniKVTransferManager(OmniKVCacheConfig()).recv_stages == (None, None)


class _Broken(OmniConnectorBase):
    created = 0

    def __init__(self, config: dict) -> None:
        type(self).created += 1
        if type(self).created == 1:
            raise RuntimeError("engine not up yet")
        super().__init__()

    def put(self, *a: Any) -> PutResult:
        return True, 0, None

    def get(self, *a: Any, **kw: Any) -> None:
        return None

    def close(self) -> None:
        self._closed = True


def test_failed_connector_creation_is_reported_and_retried() -> None:
    from omnikv import OmniConnectorFactory, TransferOptions

    OmniConnectorFactory.register_connector("TestBroken", _Broken)
    mgr = OmniKVTransferManager(
        OmniKVCacheConfig(connector_config={"type": "TestBroken"}, need_recv_cache=True),
        options=TransferOptions(connector_retry_interval=0.0),
    )
    assert mgr.connector is None
    assert "engine not up yet" in (mgr.connector_error or "")
    assert mgr.connector is not None and mgr.get_connector is mgr.connector
    assert mgr.connector_error is None


def test_metrics_count_outcomes_and_export(namespace: str) -> None:
    sender, receiver = _pair(namespace, timeout=0.05)
    sender.handle_finished_requests_kv_transfer(
        {"m1": {"block_ids": [0], "seq_len": 3}, "m2": {"block_ids": [99], "seq_len": 3}},
        _caches(),
        8,
        "f",
    )
    receiver.receive_kv_cache_for_request("m1")
    receiver.receive_kv_cache_for_request("m2")
    snap = sender.metrics.snapshot()
    assert snap["outcomes"] == {"send.failed": 1, "send.sent": 1}
    assert receiver.metrics.snapshot()["outcomes"] == {"recv.ok": 1, "recv.timeout": 1}
    text = receiver.metrics.prometheus()
    assert 'omnikv_requests_total{direction="recv",status="ok"} 1' in text
    assert 'omnikv_phase_ms_count{direction="recv",phase="wait"} 1' in text
