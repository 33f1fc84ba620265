"""omnikv.topology.tp: rank maps, configuration errors, head slicing/merging and GQA."""

from __future__ import annotations

import pytest
import torch

from omnikv import ConfigError, KVTPTopology, OmniKVCacheConfig, OmniKVTransferManager
from omnikv.topology.tp import (
    head_range,
    head_slice_tag,
    merge_received_rank_shards,
    slice_kv_tensor_heads,
    slice_received_rank_shard,
)


def test_rank_maps() -> None:
    up = KVTPTopology(2, 4, 1)
    assert up.target_ranks() == [2, 3] and KVTPTopology(2, 4, 3).source_ranks() == [1]
    down = KVTPTopology(4, 2, 1)
    assert down.source_ranks() == [2, 3] and KVTPTopology(4, 2, 3).target_ranks() == [1]


def test_non_divisible_tp_fails_at_configuration_time() -> None:
    with pytest.raises(ConfigError, match="divisible"):
        OmniKVTransferManager(OmniKVCacheConfig(need_recv_cache=True, from_tp=3, to_tp=2))
    with pytest.raises(ConfigError):
        KVTPTopology(0, 2)


def test_a_non_divisible_topology_raises_where_the_reference_does() -> None:
    topo = KVTPTopology(3, 2)  # constructing it is fine, as in the reference
    assert topo.is_heterogeneous
    with pytest.raises(ValueError, match="divisible"):
        topo.source_ranks()
    with pytest.raises(ValueError, match="divisible"):
        topo.target_ranks()


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


def test_head_slice_tag_is_built_once_for_both_sides() -> None:
    topo = KVTPTopology(2, 4, 1)
    assert head_slice_tag(topo, 3, side="sender") == {
        "applied": True,
        "side": "sender",
        "target_rank": 3,
        "source_rank": 1,
        "from_tp": 2,
        "to_tp": 4,
        "offset_in_shard": 1,
        "num_slices": 2,
    }
    assert "source_rank" not in head_slice_tag(topo, 3, side="receiver")
