"""Role decision, topology snapshot, framing and CFG payload construction (single process)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from omnikv import OmniKVCacheConfig, OmniKVTransferManager, ParallelContext, ReceiveRole
from omnikv.errors import DecodeError, EncodeError
from omnikv.ranks.context import build_topo_config, decide_role
from omnikv.ranks.distribution import build_cfg_rank_payloads, discover_cfg_branch_roles
from omnikv.wire.frames import decode_frame, encode_frame


@pytest.mark.parametrize(
    ("kw", "role"),
    [
        ({"tp_active": True, "world_size": 1, "world_rank": 0}, ReceiveRole.LOCAL),
        ({"tp_active": True, "world_size": 4, "world_rank": 2}, ReceiveRole.LOCAL),
        ({"tp_active": True, "world_size": 4, "world_rank": 2, "cfg_size": 2}, ReceiveRole.LEADER),
        (
            {"tp_active": True, "world_size": 4, "world_rank": 3, "cfg_size": 2, "cfg_rank": 1},
            ReceiveRole.FOLLOWER,
        ),
        (
            {"tp_active": True, "world_size": 4, "world_rank": 1, "sp_size": 2, "sp_rank": 1},
            ReceiveRole.FOLLOWER,
        ),
        ({"tp_active": False, "world_size": 2, "world_rank": 0}, ReceiveRole.LEADER),
        ({"tp_active": False, "world_size": 2, "world_rank": 1}, ReceiveRole.FOLLOWER),
    ],
)
def test_role_table(kw: dict[str, int], role: ReceiveRole) -> None:
    assert decide_role(**kw) is role  # type: ignore[arg-type]


def test_single_rank_default_is_local_and_rebuildable() -> None:
    mgr = OmniKVTransferManager(OmniKVCacheConfig(need_recv_cache=True))
    assert mgr.topo_config.is_local
    assert mgr.topo_config is mgr.topo_config  # cached
    again = mgr.rebuild_topo_config()
    assert again is mgr.topo_config and again.is_local
    assert build_topo_config(ParallelContext(), tp_active=True).role is ReceiveRole.LOCAL


def _kv(n: float) -> SimpleNamespace:
    return SimpleNamespace(
        key_cache=[torch.full((4, 2, 8), n)], value_cache=[torch.full((4, 2, 8), -n)]
    )


def test_frame_round_trip_shares_tensors_and_validates() -> None:
    kv = _kv(3.0)
    payload = {"past_key_values": kv, "sp.past_key_values": kv, "kv_metadata": {"a": (1, "x")}}
    frame = encode_frame(payload)
    assert frame.num_tensors == 2  # the same tensors referenced twice are stored once
    buf = torch.empty(frame.nbytes, dtype=torch.uint8)
    frame.pack_into(buf)
    out = decode_frame(buf)
    assert torch.equal(out["past_key_values"].key_cache[0], kv.key_cache[0])
    assert out["kv_metadata"] == {"a": (1, "x")}
    assert out["sp.past_key_values"].value_cache[0].data_ptr() == (
        out["past_key_values"].value_cache[0].data_ptr()
    )
    bad = buf.clone()
    bad[0] = 0
    with pytest.raises(DecodeError):
        decode_frame(bad)
    with pytest.raises(DecodeError):
        decode_frame(buf[:10].clone())
    with pytest.raises(EncodeError):
        encode_frame({"x": object()})


def test_cfg_payloads_follow_the_reference_order() -> None:
    sp = SimpleNamespace(
        past_key_values=_kv(1.0),
        cfg_img_past_key_values=_kv(3.0),
        cfg_text_past_key_values=_kv(2.0),
        cfg_extra_past_key_values=_kv(4.0),
    )
    req = SimpleNamespace(request_id="r", sampling_params=sp, past_key_values=sp.past_key_values)
    assert discover_cfg_branch_roles(req) == ["cfg_text", "cfg_img", "cfg_extra"]
    out = build_cfg_rank_payloads(req, 3)
    assert len(out) == 3 and out[0] is not None and out[0]["sp.cfg_active_branch"] is None
    assert out[1] is not None and out[1]["sp.cfg_active_branch"] == "cfg_text"
    assert out[2] is not None and set(out[2]["sp.cfg_branch_past_key_values"]) == {"cfg_img"}
    # no roles, CFG 2: rank 1 reuses the main payload
    plain = SimpleNamespace(
        request_id="p", sampling_params=SimpleNamespace(past_key_values=_kv(1.0))
    )
    two = build_cfg_rank_payloads(plain, 2)
    assert two[1] is not None and two[0] is not None
    assert two[1]["sp.past_key_values"] is two[0]["sp.past_key_values"]
    assert build_cfg_rank_payloads(plain, 3)[2] is None


class _Group:
    """A process group's rank and size, nothing else (the role snapshot reads only these)."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


@pytest.mark.parametrize(
    ("readers", "world", "tp", "shared"),
    [(4, 4, 1, True), (None, 4, 1, False), (2, 4, 1, False), (4, 4, 2, False), ("x", 4, 1, False)],
)
def test_ranks_read_shared_only_when_the_count_is_the_stage(
    readers: object, world: int, tp: int, shared: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Every rank reads the payload itself only when ``shared_readers`` equals the world size of
    a stage without TP; otherwise the leader path stays, and a count that does not fit is
    logged once."""
    conn: dict[str, object] = {"type": "SharedMemoryConnector"}
    if readers is not None:
        conn["shared_readers"] = readers
    cfg = OmniKVCacheConfig(connector_config=conn, need_recv_cache=True, from_tp=tp, to_tp=tp)
    ctx = ParallelContext(world_group=_Group(1, world), tp_size=tp)  # type: ignore[arg-type]
    mgr = OmniKVTransferManager(cfg, parallel_context=ctx)
    ranks = mgr._ranks
    assert ranks.reads_shared() is shared
    assert ranks.reads_shared() is shared
    misfit = readers in (2, 4) and not shared
    assert sum("shared_readers" in r.getMessage() for r in caplog.records) == int(misfit)
