"""The receive path: fetch() raises, receive() reports, companions are received at once, and the
typed ``ReceivedKV`` only becomes the seed's dict at the facade."""

from __future__ import annotations

import gc
import threading
import time
from typing import Any

import pytest
import torch

from omnikv import KVCacheTransferData, ReceiveStatus, TransferOptions
from omnikv.connectors.base import ManagedBuffer
from omnikv.connectors.factory import LazyConnector
from omnikv.connectors.local import LocalConnector
from omnikv.deadline import deadline_after
from omnikv.errors import DecodeError, KVPrefetchConsumeError, ReceiveTimeout
from omnikv.topology.keys import legacy_kv_key
from omnikv.topology.tp import KVTPTopology
from omnikv.transfer.receive import KVReceiver
from omnikv.transfer.received import ReceivedKV, move_kv


def _receiver(conn: LocalConnector, **kw: Any) -> KVReceiver:
    options = kw.pop("options", TransferOptions())
    return KVReceiver(
        stages=("0", "1"),
        topology=KVTPTopology(1, 1),
        options=options,
        connector=LazyConnector(lambda: None, connector=conn),
        **kw,
    )


def _soon() -> float:
    """The deadline of a receive that finds its payload at once (or never looks for one)."""
    return deadline_after(5.0)


def _publish(conn: LocalConnector, rid: str, fill: float = 1.0) -> None:
    kv = KVCacheTransferData(
        rid, {"key_cache": [torch.full((4, 2, 2), fill)], "value_cache": [torch.zeros(4, 2, 2)]}
    )
    conn.put("0", "1", legacy_kv_key("0", "1", rid), kv.to_bytes())


@pytest.mark.timing  # bounds of 0.1 s past a deadline: run alone, after the lanes
def test_fetch_raises_receive_timeout_naming_request_and_wait(namespace: str) -> None:
    rx = _receiver(LocalConnector({"namespace": namespace}))
    t0 = time.monotonic()
    with pytest.raises(ReceiveTimeout) as info:
        rx.fetch("gone", deadline=deadline_after(0.2))
    assert info.value.request_id == "gone" and 0.2 <= info.value.waited_s < 0.3
    assert time.monotonic() - t0 < 0.3


def test_receive_reports_the_same_miss_as_a_result(namespace: str) -> None:
    rx = _receiver(LocalConnector({"namespace": namespace}))
    res = rx.receive("gone", deadline=deadline_after(0.05))
    assert res.status is ReceiveStatus.TIMEOUT and res.kv is None and res.data is None
    assert res.keys == [legacy_kv_key("0", "1", "gone")] and "missing" in (res.reason or "")


def test_received_kv_is_typed_and_the_dict_is_made_on_demand(namespace: str) -> None:
    conn = LocalConnector({"namespace": namespace})
    _publish(conn, "r", fill=3.0)
    res = _receiver(conn).receive("r", deadline=_soon())
    assert res.ok and isinstance(res.kv, ReceivedKV) and res.nbytes == res.kv.nbytes > 0
    assert res.kv.request_id == "r" and res.kv.key_cache[0] is not None
    assert res.kv.key_cache[0].eq(3.0).all() and res.timings_ms["wait_ms"] >= 0
    data = res.data
    assert data is not None and data["layer_blocks"]["key_cache"][0] is res.kv.key_cache[0]


@pytest.mark.parametrize(
    ("kw", "status"),
    [
        ({"enabled": False}, ReceiveStatus.SKIPPED),
        ({"enabled": False, "configured": False}, ReceiveStatus.NOT_CONFIGURED),
    ],
)
def test_a_receiver_that_is_off_says_so(namespace: str, kw: dict, status: ReceiveStatus) -> None:
    res = _receiver(LocalConnector({"namespace": namespace}), **kw).receive("r", deadline=_soon())
    assert res.status is status and res.reason == "need_recv_cache is false"


def test_warm_up_request_and_unresolvable_per_call_sender_touch_nothing(namespace: str) -> None:
    rx = _receiver(LocalConnector({"namespace": namespace}))
    assert rx.receive("dummy_req_id", deadline=_soon()).status is ReceiveStatus.SKIPPED
    res = rx.receive("r", deadline=_soon(), per_call=True, sender=None)
    assert res.status is ReceiveStatus.UNAVAILABLE and res.reason == "bad sender_info"


@pytest.mark.timing  # a bound of 0.2 s past a deadline: run alone, after the lanes
def test_companions_are_received_at_once_and_kept_for_one_receive(namespace: str) -> None:
    conn = LocalConnector({"namespace": namespace})
    for rid in ("a", "b"):
        _publish(conn, rid)
    rx = _receiver(conn)
    t0 = time.monotonic()
    got = rx.receive_companions(["a", "b", "never"], deadline=deadline_after(0.3))
    assert 0.3 <= time.monotonic() - t0 < 0.5  # one deadline for all three, not three
    assert {k: r.status for k, r in got.items()} == {
        "a": ReceiveStatus.OK,
        "b": ReceiveStatus.OK,
        "never": ReceiveStatus.TIMEOUT,
    }
    assert rx.receive("a", deadline=_soon()) is got["a"]  # kept: no second wait
    assert rx.receive("a", deadline=deadline_after(0.01)).status is ReceiveStatus.TIMEOUT
    rx.drop_kept(["b"])
    assert rx.receive("b", deadline=deadline_after(0.01)).status is ReceiveStatus.TIMEOUT
    rx.close()


def test_companions_from_several_threads_do_not_see_each_other(namespace: str) -> None:
    conn = LocalConnector({"namespace": namespace})
    rx = _receiver(conn)
    for rid in ("x1", "y1"):
        _publish(conn, rid)
    seen: dict[str, Any] = {}

    def run(rid: str) -> None:
        with rx.companions([rid], deadline=deadline_after(1.0)):
            seen[rid] = rx.receive(rid, deadline=_soon()).status

    threads = [threading.Thread(target=run, args=(r,)) for r in ("x1", "y1")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert seen == {"x1": ReceiveStatus.OK, "y1": ReceiveStatus.OK}
    rx.close()


@pytest.mark.parametrize("mode", ["copy", "auto"])
def test_pool_buffer_release_never_corrupts_what_was_received(namespace: str, mode: str) -> None:
    """``copy``: copied out, released at once; ``auto``: zero-copy views hold the buffer."""
    data = KVCacheTransferData("p1", {"key_cache": [torch.full((4, 2, 2), 7.0)]})
    raw = torch.frombuffer(bytearray(data.to_bytes()), dtype=torch.uint8)
    released: list[bool] = []

    def release() -> None:
        raw.zero_()
        released.append(True)

    class _Pool(LocalConnector):
        def wait(self, *a: Any, **kw: Any) -> ManagedBuffer:
            return ManagedBuffer(raw, release=release)

    rx = _receiver(_Pool({"namespace": namespace}), options=TransferOptions(receive_copy=mode))
    kv = rx.fetch("p1", deadline=deadline_after(1.0))
    k = kv.key_cache[0]
    assert k is not None
    inside = raw.data_ptr() <= k.data_ptr() < raw.data_ptr() + raw.numel()
    assert (released, inside) == (([True], False) if mode == "copy" else ([], True))
    assert k.eq(7.0).all()
    del kv, k
    gc.collect()
    assert released == [True]


def test_a_failed_device_copy_is_a_consume_error(
    namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import omnikv.transfer.receive

    def oom(*_: Any, **__: Any) -> None:
        raise RuntimeError("CUDA out of memory (simulated)")

    conn = LocalConnector({"namespace": namespace})
    _publish(conn, "dev")
    monkeypatch.setattr(omnikv.transfer.receive, "move_kv", oom)
    with pytest.raises(KVPrefetchConsumeError, match="payload already consumed"):
        _receiver(conn).receive("dev", deadline=_soon(), target_device=torch.device("cpu"))


@pytest.mark.parametrize("device", [torch.device("xla"), "no-such-device"])
def test_a_device_that_cannot_be_reached_is_a_consume_error(namespace: str, device: Any) -> None:
    conn = LocalConnector({"namespace": namespace})
    _publish(conn, "far")
    with pytest.raises(KVPrefetchConsumeError, match="payload already consumed"):
        _receiver(conn).receive("far", deadline=_soon(), target_device=device)
    assert conn.get("0", "1", legacy_kv_key("0", "1", "far")) is None  # consumed


def test_corrupt_bytes_are_corrupt(namespace: str) -> None:
    conn = LocalConnector({"namespace": namespace})
    conn.put("0", "1", legacy_kv_key("0", "1", "bad"), b"\x00\x00\x00\x09{garbage}")
    res = _receiver(conn).receive("bad", deadline=_soon())
    assert res.status is ReceiveStatus.CORRUPT


# -- ReceivedKV ---------------------------------------------------------------------------------
def test_received_kv_round_trips_the_seed_dict_and_rejects_anything_else() -> None:
    t = torch.ones(2, 1, 1)
    seed = {
        "request_id": "r",
        "layer_blocks": {"key_cache": [t, None], "value_cache": [t]},
        "block_ids": [3],
        "metadata": {"seq_len": 2},
    }
    kv = ReceivedKV.from_dict(seed, nbytes=8)
    assert kv.to_dict() == {**seed, "layer_blocks": seed["layer_blocks"]}
    assert list(kv.tensors()) == [t, t] and kv.nbytes == 8
    for bad in (None, {"layer_blocks": 3}, {"layer_blocks": {"key_cache": 1}}):
        with pytest.raises(DecodeError):
            ReceivedKV.from_dict(bad)


def test_move_kv_is_the_one_device_move() -> None:
    t = torch.ones(2, 2)
    kv = ReceivedKV("r", [], {}, [t], [None])
    assert move_kv(kv, None) is kv
    owned = move_kv(kv, None, own=True)
    assert owned.key_cache[0] is not t and torch.equal(owned.key_cache[0], t)
    meta = move_kv(kv, "meta")
    assert meta.key_cache[0] is not None and meta.key_cache[0].device.type == "meta"
    assert meta.value_cache == [None] and kv.key_cache[0] is t
