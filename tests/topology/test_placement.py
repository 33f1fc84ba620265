"""omnikv.topology.placement: ports, sender endpoints, engine connector config."""

from __future__ import annotations

from typing import Any

import pytest

from omnikv import OmniKVCacheConfig, OmniKVTransferManager
from omnikv.ranks.context import ParallelContext
from omnikv.topology.placement import (
    engine_connector_config,
    kv_zmq_port,
    resolve_endpoint,
    source_metadata,
)


def test_ports(monkeypatch: pytest.MonkeyPatch) -> None:
    assert kv_zmq_port(50000, 1) == 50101
    assert kv_zmq_port(50000, 1, 2, 3) == 50000 + 100 + 3 * 1024 + 32 + 1
    monkeypatch.setenv("VLLM_OMNI_REPLICA_ID", "2")
    assert kv_zmq_port(50000, 0) == 50000 + 100 + 2048
    monkeypatch.setenv("VLLM_OMNI_REPLICA_ID", "junk")
    assert kv_zmq_port(50000, 0) == 50100
    monkeypatch.setenv("VLLM_OMNI_REPLICA_ID", "-4")
    assert kv_zmq_port(50000, 0) == 50100


def test_update_sender_info_offsets_the_port_per_rank() -> None:
    conn: dict[str, Any] = {"type": "LocalConnector", "namespace": "t-topo"}
    mgr = OmniKVTransferManager(
        OmniKVCacheConfig(
            connector_config=conn, stage_id=1, need_recv_cache=True, from_tp=2, to_tp=2
        ),
        parallel_context=ParallelContext(local_rank=1),
    )
    mgr.update_sender_info({"0": {"host": "127.0.0.1", "zmq_port": 6000}})
    assert conn["sender_zmq_port"] == 6016 and conn["sender_host"] == "127.0.0.1"


def test_per_stage_sender_info_matches_string_and_int_stage_ids() -> None:
    info = {"1": {"host": "a", "zmq_port": 1}, 2: {"host": "b", "zmq_port": 2}}
    assert resolve_endpoint(info, 1) == ("a", 1)
    assert resolve_endpoint(info, "2") == ("b", 2)
    assert resolve_endpoint({"host": "h", "zmq_port": "7"}) == ("h", 7)
    assert resolve_endpoint({"host": "h", "zmq_port": 1.5}) is None
    assert resolve_endpoint({"host": "h", "zmq_port": 70000}) is None
    assert resolve_endpoint(info) is None  # ambiguous without a stage


def test_engine_connectors_get_role_stages_and_this_ranks_port(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("VLLM_OMNI_REPLICA_ID", raising=False)
    monkeypatch.setenv("KV_BASE", "40000")
    send = engine_connector_config(
        {"zmq_port": "${KV_BASE}"},
        from_stage=1,
        to_stage=2,
        sends=True,
        receives=False,
        local_rank=2,
    )
    assert send == {
        "zmq_port": 40000 + 100 + 32 + 1,
        "from_stage": "1",
        "to_stage": "2",
        "role": "sender",
    }
    recv = engine_connector_config(
        {}, from_stage=None, to_stage=None, sends=False, receives=True, local_rank=0
    )
    assert recv == {"from_stage": "0", "to_stage": "1", "role": "receiver"}


def test_source_metadata_names_the_sender_ranks_port() -> None:
    assert source_metadata(None, 1, True) is None
    assert source_metadata(("h", 5000), None, False) is None
    assert source_metadata(("h", 5000), 2, False) == {"source_host": "h", "source_port": 5032}
    assert source_metadata(("h", 5000), None, True) == {"source_host": "h", "source_port": 5000}
