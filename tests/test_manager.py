"""Seed API through the manager: send/receive flows, outcomes, sender info, config chain.

Adapted from the reference's test catalogue (reference-behaviour §9, tests 25-40), with the
behaviour changes omnikv makes on purpose (failures are recorded; out-of-range ids fail).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from conftest import ManagerFactory, PairFactory, build_manager, make_paged_caches
from omnikv import (
    OmniKVCacheConfig,
    OmniKVTransferManager,
    ReceiveStatus,
    SendStatus,
)
from omnikv.connectors.local import LocalConnector
from omnikv.ranks.context import ParallelContext


def test_send_receive_round_trip_legacy_key(manager_pair: PairFactory) -> None:
    sender, receiver = manager_pair()
    caches = make_paged_caches()
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
    kept = receiver.get_receive_result("req_test_1")
    assert kept is not None and kept.status is ReceiveStatus.OK and kept.kv is None  # no tensors
    assert (kept.nbytes, kept.keys) == (size, res.keys) and kept.timings_ms.get("wait_ms", -1) >= 0


def test_failed_send_is_recorded_not_silent(manager_pair: PairFactory) -> None:
    sender, _ = manager_pair()
    ids = sender.handle_finished_requests_kv_transfer(
        {
            "ok": {"block_ids": [0], "seq_len": 4},
            "no_blocks": {"block_ids": [], "seq_len": 4},
            "bad_block": {"block_ids": [0, 99], "seq_len": 10},
            "no_seq_len": {"block_ids": [0]},
        },
        make_paged_caches(),
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


def test_no_connector_returns_ids_and_records_failure(make_manager: ManagerFactory) -> None:
    mgr = make_manager("sender", connector_config=None)
    ids = mgr.handle_finished_requests_kv_transfer(
        {"a": {"block_ids": [0], "seq_len": 1}}, make_paged_caches(), 8, "f"
    )
    assert ids == ["a"]
    assert mgr.get_send_result("a").status is SendStatus.NOT_CONFIGURED
    assert OmniKVTransferManager(OmniKVCacheConfig()).handle_finished_requests_kv_transfer(
        {"b": {}}, [], 8, "f"
    ) == ["b"]


def test_request_id_resolver_changes_transfer_key(manager_pair: PairFactory) -> None:
    sender, receiver = manager_pair()
    sender.handle_finished_requests_kv_transfer(
        {"internal-7": {"block_ids": [2], "seq_len": 5}},
        make_paged_caches(),
        8,
        "f",
        request_id_resolver=lambda r: "global-7",
    )
    data, _ = receiver.receive_kv_cache_for_request("global-7")
    assert data is not None and data["request_id"] == "global-7"


def test_a_header_over_max_header_bytes_is_corrupt(manager_pair: PairFactory) -> None:
    sender, receiver = manager_pair(max_header_bytes=4096)
    sender.handle_finished_requests_kv_transfer(
        {
            "small": {"block_ids": [0], "seq_len": 2},
            "big": {"block_ids": [0], "seq_len": 2, "custom_metadata": {"note": "x" * 8192}},
        },
        make_paged_caches(),
        8,
        "f",
    )
    assert receiver.receive_kv_cache_for_request("small")[0] is not None
    assert receiver.receive_kv_cache_for_request("big") == (None, 0)
    res = receiver.get_receive_result("big")
    assert res is not None and res.status is ReceiveStatus.CORRUPT
    assert "exceeds the limit of 4096" in (res.reason or "")


@pytest.mark.parametrize("mode", ["copy", "auto"])
def test_receive_copy_gives_each_tensor_its_own_memory_of_its_size(
    manager_pair: PairFactory, mode: str
) -> None:
    """``copy``: every tensor in fresh memory of exactly its bytes (tensor-sized allocations are
    recycled request after request; nothing aliases the pool); ``auto``: zero-copy views of the
    received payload (where the packed layout put them)."""
    sender, receiver = manager_pair(receive_copy=mode)
    caches = make_paged_caches()
    sender.handle_finished_requests_kv_transfer(
        {"c1": {"block_ids": [1, 2], "seq_len": 16}}, caches, 8, "f"
    )
    data, size = receiver.receive_kv_cache_for_request("c1")
    assert data is not None
    tensors = [*data["layer_blocks"]["key_cache"], *data["layer_blocks"]["value_cache"]]
    storages = {t.untyped_storage().data_ptr() for t in tensors}
    tensor_bytes = sum(t.numel() * t.element_size() for t in tensors)
    if mode == "copy":
        assert len(storages) == len(tensors)
        assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in tensors)
    else:  # views of the payload's data section: laid out exactly as packed (64-byte slots)
        ptrs = [t.data_ptr() for t in tensors]
        steps = [-(-t.numel() * t.element_size() // 64) * 64 for t in tensors[:-1]]
        assert [b - a for a, b in itertools.pairwise(ptrs)] == steps
        assert ptrs[-1] + tensors[-1].numel() * tensors[-1].element_size() - ptrs[0] <= size
    assert tensor_bytes < size
    want = torch.cat([caches[1][1][i] for i in (1, 2)])
    assert torch.equal(data["layer_blocks"]["value_cache"][1], want)


@pytest.mark.timing
def test_miss_returns_within_timeout_plus_50ms(manager_pair: PairFactory) -> None:
    _, receiver = manager_pair(recv_timeout=0.3)
    t0 = time.monotonic()
    assert receiver.receive_kv_cache_for_request("never") == (None, 0)
    elapsed = time.monotonic() - t0
    assert 0.3 <= elapsed < 0.35
    res = receiver.get_receive_result("never")
    assert (
        res is not None and res.status is ReceiveStatus.TIMEOUT and "missing" in (res.reason or "")
    )


def test_waiting_receiver_wakes_on_put(manager_pair: PairFactory) -> None:
    sender, receiver = manager_pair(recv_timeout=5.0)
    import threading

    out: dict[str, Any] = {}

    def recv() -> None:
        out["t0"] = time.monotonic()
        out["data"] = receiver.receive_kv_cache_for_request("late")
        out["t1"] = time.monotonic()

    th = threading.Thread(target=recv)
    th.start()
    sender.handle_finished_requests_kv_transfer(
        {"late": {"block_ids": [0], "seq_len": 2}}, make_paged_caches(), 8, "f"
    )
    th.join(5)
    assert out["data"][0] is not None
    assert out["t1"] - out["t0"] < 2.0


@pytest.mark.timing  # a bound of 0.1 s on a dummy request's answer: run alone, after the lanes
def test_dummy_request_and_guards(manager_pair: PairFactory) -> None:
    _, receiver = manager_pair(recv_timeout=5.0)
    t0 = time.monotonic()
    assert receiver.receive_kv_cache_for_request("dummy_req_id") == (None, 0)
    assert time.monotonic() - t0 < 0.1
    not_receiver = OmniKVTransferManager(OmniKVCacheConfig())
    assert not_receiver.receive_kv_cache_for_request("x") == (None, 0)


def test_dict_payload_and_receive_kv_cache_applies(
    manager_pair: PairFactory, namespace: str
) -> None:
    _, receiver = manager_pair()
    kv = {"key_cache": [torch.ones(2, 1, 2)], "value_cache": [torch.zeros(2, 1, 2)]}
    payload = {"request_id": "d1", "layer_blocks": kv, "block_ids": [], "metadata": {"seq_len": 2}}
    LocalConnector({"namespace": namespace}).put(
        "stage1", "stage2", "omni_stage1_to_stage2_kv_cache_d1", payload
    )
    req = SimpleNamespace(request_id="d1", sampling_params=SimpleNamespace())
    assert receiver.receive_kv_cache(req) is True
    assert torch.equal(req.past_key_values.key_cache[0], torch.ones(2, 1, 2))
    assert req.sampling_params.kv_metadata == {"seq_len": 2} == req.kv_metadata


@pytest.mark.timing
def test_receive_multi_kv_cache_fetches_companions_concurrently(
    manager_pair: PairFactory,
) -> None:
    sender, receiver = manager_pair(recv_timeout=0.5)
    caches = make_paged_caches()
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


def test_update_sender_info_nested_and_flat(omni_kv: Callable[..., dict]) -> None:
    kv_config = omni_kv("receiver", stage_id=2, engine_input_source=[1])
    conn = kv_config["connector_config"]
    mgr = build_manager(kv_config)
    mgr.update_sender_info(
        {1: {"host": "10.0.0.1", "zmq_port": 5000}, 0: {"host": "x", "zmq_port": 1}}
    )
    assert conn["sender_host"] == "10.0.0.1" and conn["sender_zmq_port"] == 5000
    assert mgr.sender_endpoint == ("10.0.0.1", 5000)
    mgr.update_sender_info({"host": "h", "zmq_port": "6000"})
    assert conn["sender_zmq_port"] == 6000
    mgr.update_sender_info({"0": {"host": "a"}, "5": {"host": "b"}})  # ambiguous: ignored
    assert conn["sender_host"] == "h"


def test_update_sender_info_rank_offset(
    omni_kv: Callable[..., dict], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    kv_config = omni_kv("receiver", rank_mapping={"from_tp": 2, "to_tp": 2})
    conn = kv_config["connector_config"]
    mgr = build_manager(kv_config)
    mgr.update_sender_info({"host": "h", "zmq_port": 7000})
    assert conn["sender_zmq_port"] == 7016 and mgr.sender_endpoint == ("h", 7000)


def test_per_call_sender_info_does_not_touch_instance(
    manager_pair: PairFactory,
) -> None:
    _, receiver = manager_pair(recv_timeout=0.05)
    receiver.receive_kv_cache_for_request("zz", sender_info={"host": "h", "zmq_port": 1})
    assert receiver.sender_endpoint is None
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


def test_metrics_count_outcomes_and_export(manager_pair: PairFactory) -> None:
    sender, receiver = manager_pair(recv_timeout=0.05)
    sender.handle_finished_requests_kv_transfer(
        {"m1": {"block_ids": [0], "seq_len": 3}, "m2": {"block_ids": [99], "seq_len": 3}},
        make_paged_caches(),
        8,
        "f",
    )
    receiver.receive_kv_cache_for_request("m1")
    receiver.receive_kv_cache_for_request("m2")
    snap = sender.metrics.snapshot()
    # the receiver accepted m1: its sender counts the delivery as well (the ack is synchronous
    # in process)
    assert snap["outcomes"] == {"send.failed": 1, "send.sent": 1, "delivery.delivered": 1}
    assert receiver.metrics.snapshot()["outcomes"] == {"recv.ok": 1, "recv.timeout": 1}
    assert receiver.metrics.snapshot()["phases_ms"]["recv.wait"]["count"] == 1


# -- a manager that will do nothing says so (issue 14.5) ------------------------------------------
def test_an_inert_manager_warns_once_and_reports_not_configured(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model_config = SimpleNamespace()  # no omni_kv_config, no kv_transfer_config fallback
    with caplog.at_level("WARNING", logger="omnikv.manager"):
        mgr = OmniKVTransferManager.from_vllm_config(None, model_config)
    warnings = [r for r in caplog.records if "neither send nor receive" in r.getMessage()]
    assert len(warnings) == 1
    assert mgr.handle_finished_requests_kv_transfer({"a": {"block_ids": [0]}}, [], 8, "f") == ["a"]
    assert mgr.get_send_result("a").status is SendStatus.NOT_CONFIGURED
    assert mgr.receive_kv_cache_for_request("b") == (None, 0)
    assert mgr.get_receive_result("b").status is ReceiveStatus.NOT_CONFIGURED


def test_a_distribution_only_manager_says_so_at_info(caplog: pytest.LogCaptureFixture) -> None:
    """A rank built with a parallel context but no connector (a follower that only gets KV from
    its leader, ``omnikv bench dist``) has work: one INFO line, no warning."""
    with caplog.at_level("INFO", logger="omnikv.manager"):
        mgr = OmniKVTransferManager(
            OmniKVCacheConfig(need_recv_cache=True), parallel_context=ParallelContext(local_rank=0)
        )
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    assert [r for r in caplog.records if "only distributes" in r.getMessage()]
    assert mgr.receive_kv_cache_for_request("b") == (None, 0)
    res = mgr.get_receive_result("b")
    assert res is not None and res.status is ReceiveStatus.SKIPPED
    assert res.reason == "recv stages unset"


def test_a_configured_manager_does_not_warn(
    omni_kv: Callable[..., dict], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("WARNING", logger="omnikv.manager"):
        OmniKVTransferManager.from_od_config(SimpleNamespace(omni_kv_config=omni_kv("sender")))
    assert not [r for r in caplog.records if "neither" in r.getMessage()]


def test_flush_returns_what_the_connector_still_holds(
    make_manager: ManagerFactory, namespace: str
) -> None:
    class _Lingering(LocalConnector):
        def flush(self, timeout: float | None = None) -> list[str]:
            return [f"k@{timeout}"]

    mgr = make_manager("sender", connector=_Lingering({"namespace": namespace}))
    assert mgr.flush(0.5) == ["k@0.5"]
    assert OmniKVTransferManager(OmniKVCacheConfig()).flush() == []


# -- code written for the reference (issue 12) ----------------------------------------------------
def test_a_diffusion_request_with_request_ids_receives_under_its_first_id(
    manager_pair: PairFactory,
) -> None:
    sender, receiver = manager_pair()
    send = {"diff-1": {"block_ids": [0], "seq_len": 3}}
    sender.handle_finished_requests_kv_transfer(send, make_paged_caches(), 8, "float32")
    req = SimpleNamespace(request_ids=["diff-1", "diff-1-extra"], sampling_params=SimpleNamespace())
    assert receiver.receive_kv_cache(req) is True
    assert req.past_key_values.key_cache[0].shape == (3, 4, 16)
    sender.handle_finished_requests_kv_transfer(send, make_paged_caches(), 8, "float32")
    again = SimpleNamespace(request_ids=["diff-1"], sampling_params=SimpleNamespace())
    assert receiver.consume_and_distribute_kv_cache(again) is True


def test_reference_style_hooks_are_called_as_the_reference_calls_them(
    manager_pair: PairFactory,
) -> None:
    sender, receiver = manager_pair()
    calls: list[str] = []

    def send_keys(request_id: str, from_stage: str, to_stage: str) -> list[str]:
        return [f"custom-{request_id}-{from_stage}-{to_stage}"]

    def slicer(payload: dict) -> dict:  # one argument, as the reference calls it
        calls.append("slicer")
        payload["metadata"]["sliced_by"] = "hook"
        return payload

    def merger(payloads: list) -> dict:
        calls.append("merger")
        return payloads[0]

    sender.kv_send_key_builder = send_keys
    receiver.kv_recv_key_builder = send_keys
    receiver.kv_payload_slicer = slicer
    receiver.kv_payload_merger = merger
    sender.handle_finished_requests_kv_transfer(
        {"h1": {"block_ids": [0], "seq_len": 3}}, make_paged_caches(), 8, "float32"
    )
    assert sender.get_send_result("h1").keys == ["custom-h1-stage1-stage2"]
    data, _ = receiver.receive_kv_cache_for_request("h1")
    assert data is not None and data["metadata"]["sliced_by"] == "hook"
    assert calls == ["slicer"]  # one shard: nothing to merge


def test_int_and_string_stage_ids_name_the_same_stage(make_manager: ManagerFactory) -> None:
    sender = make_manager("sender", omni_from_stage=1, omni_to_stage=2)
    # the receiver names only its own stage, as a string: its predecessor is stage 1
    receiver = make_manager("receiver", omni_from_stage=None, stage_id="2")
    assert receiver.recv_stages == sender.send_stages == ("1", "2")
    sender.handle_finished_requests_kv_transfer(
        {"s": {"block_ids": [0], "seq_len": 2}}, make_paged_caches(), 8, "float32"
    )
    assert receiver.receive_kv_cache_for_request("s")[0] is not None


def test_recv_timeout_is_read_at_each_receive(manager_pair: PairFactory) -> None:
    _, receiver = manager_pair(recv_timeout=5.0)
    receiver.config.recv_timeout = 0.1  # a runner may shorten it after construction
    t0 = time.monotonic()
    assert receiver.receive_kv_cache_for_request("never") == (None, 0)
    assert time.monotonic() - t0 < 1.0


def test_a_reference_merger_gets_the_shards_of_every_sender_rank(
    make_manager: ManagerFactory,
) -> None:
    """TP 2 -> 1 in one process: the one-argument merger gets both ranks' payload dicts."""
    tp = {"rank_mapping": {"from_tp": 2, "to_tp": 1}}
    senders = [
        make_manager("sender", parallel_context=ParallelContext(local_rank=r), **tp) for r in (0, 1)
    ]
    receiver = make_manager("receiver", **tp)
    merged: list[list[dict]] = []

    def merger(payloads: list[dict]) -> dict:  # as the reference calls kv_payload_merger
        merged.append(payloads)
        return payloads[1]

    receiver.kv_payload_merger = merger
    caches = make_paged_caches()
    for rank, sender in enumerate(senders):
        sender.handle_finished_requests_kv_transfer(
            {"m": {"block_ids": [rank], "seq_len": 4}}, caches, 8, "float32"
        )
    data, _ = receiver.receive_kv_cache_for_request("m")
    assert data is not None and len(merged) == 1 and len(merged[0]) == 2
    assert [p["block_ids"] for p in merged[0]] == [[0], [1]] and data["block_ids"] == [1]


def test_a_quiet_receive_logs_its_miss_at_debug_only(
    make_manager: ManagerFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """Callers that count misses themselves (the vLLM consumer) keep clients from flooding logs."""
    import logging

    receiver = make_manager("receiver")
    with caplog.at_level(logging.DEBUG, logger="omnikv.transfer.receive"):
        quiet = receiver.receive_kv_cache_result(
            "never-sent", deadline=time.monotonic() + 0.05, quiet=True
        )
        assert quiet.status.value == "timeout"
        assert [r.levelno for r in caplog.records if r.name == "omnikv.transfer.receive"] == [
            logging.DEBUG
        ]
        caplog.clear()
        loud = receiver.receive_kv_cache_result("never-sent", deadline=time.monotonic() + 0.05)
        assert loud.status.value == "timeout"
        assert [r.levelno for r in caplog.records if r.name == "omnikv.transfer.receive"] == [
            logging.WARNING
        ]
