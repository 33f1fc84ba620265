"""The reference's newer API (vllm-omni 0.30 and 0.32.0rc1), called the way code written for it
calls it.

* connectors: ``get_with_deadline(from, to, key, metadata, *, deadline)``, ``abandon_get(key)``,
  ``reap_consumed()`` and 0.32's ``reap_consumed(*, max_keys=64)``, 0.32's
  ``update_sender_info(sender_host, sender_zmq_port, sender_rank=None)`` and
  ``get_connection_info()`` on every built-in connector that runs here (the Transfer Engine's
  are in tests/connectors/mooncake_te/test_te_reference_api.py, the shared-memory wakeups in
  tests/connectors/shm/test_shm_wakeup.py);
* the manager: 0.30's ``get_sender_connection_info()``;
* the manager: ``wait_prefetch(timeout)`` and an idempotent ``close()`` that creates nothing later;
* ``slice_received_rank_shard(payload, topo, slicer)`` with the reference's one-argument slicer;
* ``KVTPTopology`` refuses sizes that do not divide when ranks are computed;
* a leader's distributed receive without a device places the KV on the host.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from omnikv import OmniKVTransferManager
from omnikv.connectors.base import ManagedBuffer, OmniConnectorBase
from omnikv.connectors.local import LocalConnector
from omnikv.connectors.shm.connector import SharedMemoryConnector
from omnikv.ranks.context import ParallelContext
from omnikv.topology.tp import KVTPTopology, slice_received_rank_shard
from omnikv.wire.transfer_data import KVCacheTransferData

SENDER_INFO = {"host": "127.0.0.1", "zmq_port": 50051}


def _connectors(kind: str, namespace: str) -> tuple[OmniConnectorBase, OmniConnectorBase]:
    if kind == "local":
        return LocalConnector({"namespace": namespace}), LocalConnector({"namespace": namespace})
    sender = SharedMemoryConnector(
        {"namespace": namespace, "pool_size_bytes": 1 << 20, "linger_s": 0}
    )
    return sender, SharedMemoryConnector({"namespace": namespace})


@pytest.fixture(params=["local", "shm"])
def pair(request: pytest.FixtureRequest, namespace: str) -> Iterator[tuple[Any, Any]]:
    sender, receiver = _connectors(request.param, namespace)
    try:
        yield sender, receiver
    finally:
        receiver.close()
        sender.close()


def _payload_bytes(rid: str) -> bytes:
    kv = KVCacheTransferData(
        request_id=rid,
        layer_blocks={"key_cache": [torch.ones(4, 2, 8)], "value_cache": [torch.zeros(4, 2, 8)]},
        block_ids=[0],
        metadata={"seq_len": 4},
    )
    return kv.to_bytes()


@pytest.mark.timeout(30)
def test_get_with_deadline_returns_the_payload_in_gets_shape(pair: tuple[Any, Any]) -> None:
    sender, receiver = pair
    raw = _payload_bytes("r1")
    ok, size, _ = sender.put("0", "1", "r1_key", raw)
    assert ok and size == len(raw)
    got = receiver.get_with_deadline("0", "1", "r1_key", None, deadline=time.monotonic() + 5)
    assert got is not None
    obj, nbytes = got
    assert nbytes == len(raw)
    data = obj.to_bytes() if isinstance(obj, ManagedBuffer) else bytes(obj)
    assert data == raw
    if isinstance(obj, ManagedBuffer):
        obj.release()
    # consumed: a second receive finds nothing
    assert receiver.get_with_deadline("0", "1", "r1_key", deadline=time.monotonic()) is None
    receiver.abandon_get("r1_key")  # the reference calls it after its retry loop: harmless
    sender.reap_consumed()
    sender.reap_consumed(max_keys=4)  # 0.32: a bounded sweep (what its put calls)


def test_the_032_sender_info_forms_are_accepted_by_every_connector(pair: tuple[Any, Any]) -> None:
    """Connectors without a sender endpoint take 0.32's ``update_sender_info`` forms and share
    no endpoint (``get_connection_info()`` is ``None``), so reference code runs unchanged."""
    for connector in pair:
        connector.update_sender_info("127.0.0.1", 50051)
        connector.update_sender_info("127.0.0.1", 50052, sender_rank=1)
        connector.update_sender_info(
            sender_host="127.0.0.1", sender_zmq_port=50053, sender_rank=None
        )
        assert connector.get_connection_info() is None


class _EndpointConnector(LocalConnector):
    """A LocalConnector that shares an endpoint, as the pull transports do."""

    def get_connection_info(self) -> dict[str, Any] | None:
        return {"host": "10.0.0.7", "zmq_port": 50151}


def test_get_sender_connection_info_as_in_030(
    make_manager: Callable[..., OmniKVTransferManager], namespace: str
) -> None:
    """0.30's ``get_sender_connection_info()``: the sending stage's connector's
    ``get_connection_info()``; ``None`` for a stage that does not send or whose transport
    shares no endpoint."""
    sending = make_manager("sender", connector=_EndpointConnector({"namespace": namespace}))
    assert sending.get_sender_connection_info() == {"host": "10.0.0.7", "zmq_port": 50151}
    receiving = make_manager("receiver", connector=_EndpointConnector({"namespace": namespace}))
    assert receiving.get_sender_connection_info() is None
    assert make_manager("sender").get_sender_connection_info() is None  # LocalConnector


@pytest.mark.timeout(30)
def test_get_with_deadline_keeps_its_deadline_and_consumes_nothing(pair: tuple[Any, Any]) -> None:
    sender, receiver = pair
    t0 = time.monotonic()
    assert receiver.get_with_deadline("0", "1", "late", deadline=t0 + 0.3) is None
    waited = time.monotonic() - t0
    assert 0.25 <= waited < 1.5
    receiver.abandon_get("late")
    raw = _payload_bytes("late")
    assert sender.put("0", "1", "late", raw)[0]
    got = receiver.get_with_deadline("0", "1", "late", deadline=time.monotonic() + 5)
    assert got is not None and got[1] == len(raw)  # the earlier timeout consumed nothing
    if isinstance(got[0], ManagedBuffer):
        got[0].release()


def test_the_optional_hooks_have_defaults_on_a_minimal_connector() -> None:
    class Minimal(OmniConnectorBase):
        def __init__(self) -> None:
            super().__init__()
            self.store: dict[str, bytes] = {}

        def put(self, from_stage: str, to_stage: str, put_key: str, data: Any) -> Any:
            self.store[put_key] = bytes(data)
            return True, len(self.store[put_key]), None

        def get(self, from_stage: str, to_stage: str, get_key: str, metadata: Any = None) -> Any:
            data = self.store.pop(get_key, None)
            return None if data is None else (data, len(data))

        def close(self) -> None:
            self._closed = True

    c = Minimal()
    c.put("0", "1", "k", b"abc")
    got = c.get_with_deadline("0", "1", "k", deadline=time.monotonic() + 1)
    assert got is not None and got[1] == 3 and got[0].to_bytes() == b"abc"
    assert c.get_with_deadline("0", "1", "k", deadline=time.monotonic() + 0.01) is None
    assert c.abandon_get("k") is None and c.reap_consumed() is None


def _send(sender: OmniKVTransferManager, rid: str) -> None:
    caches = [torch.full((2, 4, 8, 2, 4), float(i)) for i in range(2)]
    sender.handle_finished_requests_kv_transfer(
        {rid: {"block_ids": [0, 1], "seq_len": 10}}, caches, 8, "torch.float32"
    )


@pytest.mark.timeout(30)
def test_wait_prefetch_then_consume(make_manager: Callable[..., OmniKVTransferManager]) -> None:
    sender = make_manager("sender")
    receiver = make_manager("receiver", recv_timeout=3.0, enable_kv_async_prefetch=True)
    assert receiver.wait_prefetch(timeout=0.0)  # nothing started: idle at once
    _send(sender, "rid-1")
    receiver.start_prefetch({"request_id": "rid-1", "kv_sender_info": SENDER_INFO})
    assert receiver.wait_prefetch(timeout=5.0) is True
    data, size = receiver.consume_prefetched_kv(SimpleNamespace(request_id="rid-1"))
    assert data is not None and size > 0 and data["metadata"]["seq_len"] == 10


@pytest.mark.timing  # a bound of 0.5 s or less past a deadline: run alone, after the lanes
@pytest.mark.timeout(30)
def test_wait_prefetch_times_out_while_a_receive_runs(
    make_manager: Callable[..., OmniKVTransferManager],
) -> None:
    receiver = make_manager("receiver", recv_timeout=1.0, enable_kv_async_prefetch=True)
    receiver.start_prefetch([{"request_id": "never-sent", "kv_sender_info": SENDER_INFO}])
    t0 = time.monotonic()
    assert receiver.wait_prefetch(timeout=0.1) is False
    assert time.monotonic() - t0 < 0.9
    assert receiver.wait_prefetch(timeout=5.0) is True  # the receive ends at its recv_timeout
    assert receiver.consume_prefetched_kv(SimpleNamespace(request_id="never-sent")) == (None, 0)
    with pytest.raises(ValueError, match="timeout"):
        receiver.wait_prefetch(timeout=-1)


def test_close_is_idempotent_and_creates_no_connector_later(
    make_manager: Callable[..., OmniKVTransferManager],
) -> None:
    unused = make_manager("receiver")
    unused.close()
    unused.close()
    assert unused.connector is None  # never created, and not created after close either

    sender = make_manager("sender")
    conn = sender.connector
    assert conn is not None
    assert sender.get_connector is conn  # the reference's name, read as an attribute
    sender.close()
    assert conn.closed and sender.connector is None
    sender.close()


def test_the_reference_one_argument_slicer_is_accepted() -> None:
    t = torch.randn(5, 4, 8)
    payload = {"request_id": "r", "layer_blocks": {"key_cache": [t], "value_cache": [t]}}
    seen: list[Any] = []

    def slicer(p: dict[str, Any]) -> dict[str, Any]:
        seen.append(p)
        return {"sliced": True}

    assert slice_received_rank_shard(payload, KVTPTopology(1, 2, 1), slicer) == {"sliced": True}
    assert seen == [payload]
    two = slice_received_rank_shard(payload, KVTPTopology(1, 2, 1), lambda p, topo: topo)
    assert two == KVTPTopology(1, 2, 1)


def test_an_invalid_topology_raises_when_ranks_are_computed() -> None:
    topo = KVTPTopology(3, 2, 0)
    with pytest.raises(ValueError, match="divisible"):
        topo.source_ranks()
    with pytest.raises(ValueError, match="divisible"):
        topo.target_ranks()
    with pytest.raises(ValueError):
        KVTPTopology(0, 2)


class _Group:
    """A world group as ``build_topo_config`` sees it (rank 0 of 2): this rank leads."""

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 2


def test_a_leaders_receive_without_a_device_lands_on_the_host(
    make_manager: Callable[..., OmniKVTransferManager], monkeypatch: pytest.MonkeyPatch
) -> None:
    from omnikv.ranks import distribution

    ctx = ParallelContext(world_group=_Group())  # type: ignore[arg-type]
    receiver = make_manager("receiver", parallel_context=ctx)
    assert receiver.topo_config.is_leader
    seen: dict[str, Any] = {}

    def fake_distribute(topo: Any, req: Any, **kwargs: Any) -> dict[str, Any]:
        seen["distribute"] = kwargs["target_device"]
        return {"past_key_values": SimpleNamespace(key_cache=[], value_cache=[])}

    def fake_apply(req: Any, payload: Any, target_device: Any = None) -> None:
        seen["apply"] = target_device

    monkeypatch.setattr(distribution, "distribute", fake_distribute)
    monkeypatch.setattr(distribution, "apply_request_kv_payload", fake_apply)
    req = SimpleNamespace(request_id="r", sampling_params=SimpleNamespace())
    receiver.receive_multi_kv_cache_distributed(req)  # no target_device, as a runner calls it
    assert seen == {"distribute": torch.device("cpu"), "apply": torch.device("cpu")}
    assert receiver.distribute_kv_cache(req, received=False) is not None
    assert seen["distribute"] == torch.device("cpu")
