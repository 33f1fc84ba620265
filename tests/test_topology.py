"""TP topology: keys, ports, hooks, configuration errors, head slicing/merging and GQA."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from omnikv import ConfigError, KVTPTopology, OmniKVCacheConfig, OmniKVTransferManager
from omnikv.parallel import ParallelContext
from omnikv.topology import (
    build_recv_keys,
    build_send_keys,
    head_range,
    kv_zmq_port,
    merge_received_rank_shards,
    slice_kv_tensor_heads,
    slice_received_rank_shard,
)


def test_rank_maps_and_keys() -> None:
    up = KVTPTopology(2, 4, 1)
    assert up.target_ranks() == [2, 3] and KVTPTopology(2, 4, 3).source_ranks() == [1]
    down = KVTPTopology(4, 2, 1)
    assert down.source_ranks() == [2, 3] and KVTPTopology(4, 2, 3).target_ranks() == [1]
    assert build_send_keys(up, "r", "0", "1") == ["r_0_0_1_2", "r_0_0_1_3"]
    assert build_recv_keys(down, "r", "0", "1") == [("r_0_0_2_1", 2), ("r_0_0_3_1", 3)]
    assert build_send_keys(KVTPTopology(1, 1), "r", "a", "b") == ["omni_a_to_b_kv_cache_r"]
    assert build_recv_keys(KVTPTopology(1, 1), "r", "a", "b") == [("omni_a_to_b_kv_cache_r", None)]


def test_hooks_win_and_strings_pair_with_source_ranks() -> None:
    down = KVTPTopology(4, 2, 0)
    assert build_send_keys(down, "r", "0", "1", hook=lambda *a: ["x"]) == ["x"]
    assert build_send_keys(down, "r", "0", "1", hook=lambda *a: []) == ["r_0_0_0_0"]
    assert build_recv_keys(down, "r", "0", "1", hook=lambda *a: ["a", "b"]) == [("a", 0), ("b", 1)]
    assert build_recv_keys(down, "r", "0", "1", hook=lambda *a: ["a"]) == [("a", None)]
    assert build_recv_keys(down, "r", "0", "1", hook=lambda *a: [("k", 7)]) == [("k", 7)]


def test_ports(monkeypatch: pytest.MonkeyPatch) -> None:
    assert kv_zmq_port(50000, 1) == 50101
    assert kv_zmq_port(50000, 1, 2, 3) == 50000 + 100 + 3 * 1024 + 32 + 1
    monkeypatch.setenv("VLLM_OMNI_REPLICA_ID", "2")
    assert kv_zmq_port(50000, 0) == 50000 + 100 + 2048
    monkeypatch.setenv("VLLM_OMNI_REPLICA_ID", "junk")
    assert kv_zmq_port(50000, 0) == 50100
    monkeypatch.setenv("VLLM_OMNI_REPLICA_ID", "-4")
    assert kv_zmq_port(50000, 0) == 50100


def test_non_divisible_tp_fails_at_configuration_time() -> None:
    with pytest.raises(ConfigError, match="divisible"):
        OmniKVTransferManager(OmniKVCacheConfig(need_recv_cache=True, from_tp=3, to_tp=2))
    with pytest.raises(ConfigError):
        KVTPTopology(0, 2)


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


def test_gqa_heads_fewer_than_ranks_are_replicated() -> None:
    assert [head_range(2, i, 4) for i in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    t = torch.arange(3 * 2 * 4, dtype=torch.float32).reshape(3, 2, 4)
    assert torch.equal(slice_kv_tensor_heads(t, 3, 4), t[:, 1:2])
    # S=4 -> T=2 with 2 KV heads: sender ranks hold one replicated head each; merged once
    shards = [
        {
            "request_id": "r",
            "layer_blocks": {"key_cache": [t[:, h : h + 1].clone()], "value_cache": []},
        }
        for h in (0, 0)
    ]
    merged = merge_received_rank_shards(shards)
    assert torch.equal(merged["layer_blocks"]["key_cache"][0], t[:, 0:1])


def test_merge_in_source_order_and_receiver_slice_fallback() -> None:
    t = torch.randn(5, 4, 8)
    shards = [
        {
            "request_id": "r",
            "layer_blocks": {"key_cache": [t[:, i * 2 : i * 2 + 2].clone()]},
            "metadata": {"m": i},
        }
        for i in range(2)
    ]
    merged = merge_received_rank_shards(shards)
    assert torch.equal(merged["layer_blocks"]["key_cache"][0], t) and merged["metadata"] == {"m": 0}
    full = {
        "request_id": "r",
        "layer_blocks": {"key_cache": [t], "value_cache": [t]},
        "metadata": {},
    }
    out = slice_received_rank_shard(full, KVTPTopology(1, 2, 1))
    assert torch.equal(out["layer_blocks"]["key_cache"][0], t[:, 2:4])
    assert out["metadata"]["tp_head_slice"]["side"] == "receiver"
    assert slice_received_rank_shard(out, KVTPTopology(1, 2, 1)) is out  # already sliced
    assert slice_received_rank_shard(full, KVTPTopology(2, 2, 0)) is full
    assert slice_received_rank_shard(
        full, KVTPTopology(1, 2, 0), slicer=lambda p, tp: {"x": 1}
    ) == {"x": 1}
