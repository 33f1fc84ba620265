"""TP topology: keys, ports, hooks, configuration errors, head slicing/merging and GQA."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from omnikv import ConfigError, KVTPTopology, OmniKVCacheConfig, OmniKVTransferManager
from omnikv.parallel import ParallelContext
from omnikv.topology import (
    TransferHooks,
    build_recv_keys,
    build_send_keys,
    engine_connector_config,
    head_range,
    head_slice_tag,
    kv_zmq_port,
    merge_received_rank_shards,
    recv_stages_of,
    resolve_endpoint,
    send_stages_of,
    slice_kv_tensor_heads,
    slice_received_rank_shard,
    source_metadata,
    stage_key,
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


def test_a_non_divisible_topology_raises_where_the_reference_does() -> None:
    topo = KVTPTopology(3, 2)  # constructing it is fine, as in the reference
    assert topo.is_heterogeneous
    with pytest.raises(ValueError, match="divisible"):
        topo.source_ranks()
    with pytest.raises(ValueError, match="divisible"):
        topo.target_ranks()


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


# -- stage ids: "1" and 1 are the same stage (issue 12.7) ----------------------------------------
@pytest.mark.parametrize(
    ("value", "key"),
    [(1, "1"), ("1", "1"), (" 1 ", "1"), (0, "0"), ("stage2", "stage2"), ("", None), (None, None)],
)
def test_stage_key_spells_each_stage_once(value: Any, key: str | None) -> None:
    assert stage_key(value) == key


def test_recv_stages_from_a_string_stage_id_without_input_source() -> None:
    assert recv_stages_of(None, "1", []) == recv_stages_of(None, 1, None) == ("0", "1")
    assert recv_stages_of("0", "stage2", None) == ("0", "stage2")
    assert recv_stages_of("0", 3, ["1"]) == ("1", "3")
    assert send_stages_of(0, "1") == ("0", "1") and send_stages_of("0", None) == (None, None)


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
        {"zmq_port": "${KV_BASE}"}, from_stage=1, to_stage=2, sends=True, receives=False,
        local_rank=2,
    )  # fmt: skip
    assert send == {"zmq_port": 40000 + 100 + 32 + 1, "from_stage": "1", "to_stage": "2",
                    "role": "sender"}  # fmt: skip
    recv = engine_connector_config({}, from_stage=None, to_stage=None, sends=False,
                                   receives=True, local_rank=0)  # fmt: skip
    assert recv == {"from_stage": "0", "to_stage": "1", "role": "receiver"}


def test_source_metadata_names_the_sender_ranks_port() -> None:
    assert source_metadata(None, 1, True) is None
    assert source_metadata(("h", 5000), None, False) is None
    assert source_metadata(("h", 5000), 2, False) == {"source_host": "h", "source_port": 5032}
    assert source_metadata(("h", 5000), None, True) == {"source_host": "h", "source_port": 5000}


# -- hooks: the reference's calling conventions (issue 12.3) -------------------------------------
def test_hooks_accept_the_reference_signatures() -> None:
    seen: list[Any] = []

    def slicer(payload: dict) -> dict:  # the reference calls kv_payload_slicer(payload)
        seen.append(payload)
        return payload

    hooks = TransferHooks.of(slicer=slicer, merger=lambda payloads: payloads[0])
    assert hooks.slicer is not None and hooks.merger is not None
    assert hooks.slicer({"p": 1}, KVTPTopology(1, 2)) == {"p": 1} and seen == [{"p": 1}]
    rich = TransferHooks.of(slicer=lambda payload, topo: topo)
    assert rich.slicer is not None and rich.slicer({}, KVTPTopology(1, 1)) == KVTPTopology(1, 1)


def test_head_slice_tag_is_built_once_for_both_sides() -> None:
    topo = KVTPTopology(2, 4, 1)
    assert head_slice_tag(topo, 3, side="sender") == {
        "applied": True, "side": "sender", "target_rank": 3, "source_rank": 1,
        "from_tp": 2, "to_tp": 4, "offset_in_shard": 1, "num_slices": 2,
    }  # fmt: skip
    assert "source_rank" not in head_slice_tag(topo, 3, side="receiver")
