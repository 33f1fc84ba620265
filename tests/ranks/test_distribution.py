"""Distribution across receiver ranks over real gloo process groups (spawned processes).

Each scenario starts its ranks once (file:// rendezvous, loopback) and runs several cases in
them: success, a leader without KV, a leader whose payload cannot be packed, a receive that
misses on the leader, and (world 2) a leader that never enters distribution.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from types import SimpleNamespace
from typing import Any

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.slow]

RECV_TIMEOUT = 1.0
GRACE = 0.5


def _kv(seed: int, layers: int = 2) -> SimpleNamespace:
    import torch

    g = torch.Generator().manual_seed(seed)
    return SimpleNamespace(
        key_cache=[torch.randn(8, 4, 16, generator=g) for _ in range(layers)],
        value_cache=[torch.randn(8, 4, 16, generator=g) for _ in range(layers)],
    )


def _sum(kv: Any) -> float | None:
    if kv is None:
        return None
    return float(sum(float(t.double().sum()) for t in kv.key_cache + kv.value_cache))


def _request(rid: str, with_cfg: bool) -> SimpleNamespace:
    sp = SimpleNamespace(past_key_values=_kv(1), kv_metadata={"seq_len": 8})
    req = SimpleNamespace(request_id=rid, sampling_params=sp, past_key_values=sp.past_key_values)
    req.kv_metadata = {"seq_len": 8}
    if with_cfg:
        sp.cfg_text_past_key_values = _kv(2)
        sp.cfg_img_past_key_values = _kv(3)
    return req


def _summary(req: Any) -> dict[str, Any]:
    sp = req.sampling_params
    return {
        "main": _sum(getattr(sp, "past_key_values", None)),
        "meta": getattr(req, "kv_metadata", None),
        "active": getattr(sp, "cfg_active_branch", "unset"),
        "text": _sum(getattr(sp, "cfg_text_past_key_values", None)),
        "img": _sum(getattr(sp, "cfg_img_past_key_values", None)),
    }


def _worker(scenario: str, rank: int, world: int, init: str, ns: str, out: Any) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch.distributed as dist

    from omnikv import OmniKVCacheConfig, OmniKVTransferManager
    from omnikv.connectors.local import LocalConnector
    from omnikv.ranks.context import ParallelContext

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        tp = 1
        cfg_group = sp_group = None
        if scenario == "cfg3":
            tp, cfg_group = 2, dist.group.WORLD
        elif scenario == "sp2":
            tp, sp_group = 2, dist.group.WORLD
        elif scenario == "cfg2sp2":
            tp = 2
            cfgs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
            sps = [dist.new_group([0, 1]), dist.new_group([2, 3])]
            cfg_group, sp_group = cfgs[rank % 2], sps[rank // 2]
        ctx = ParallelContext(
            world_group=dist.group.WORLD,
            cfg_group=cfg_group,
            sp_group=sp_group,
            tp_size=tp,
            grace_s=GRACE,
        )
        cfg = OmniKVCacheConfig(
            from_stage="0",
            stage_id="1",
            need_recv_cache=True,
            recv_timeout=RECV_TIMEOUT,
            from_tp=tp,
            to_tp=tp,
        )
        mgr = OmniKVTransferManager(
            cfg, parallel_context=ctx, connector=LocalConnector({"namespace": ns})
        )
        role = mgr.topo_config.role.value
        leader = mgr.topo_config.is_leader
        with_cfg = scenario != "sp2"
        res: dict[str, Any] = {"rank": rank, "role": role}

        # 1. the leader has the KV
        req = (
            _request("r1", with_cfg)
            if leader
            else SimpleNamespace(request_id="r1", sampling_params=SimpleNamespace())
        )
        got = mgr.distribute_kv_cache(req, received=leader)
        if got is not None:
            from omnikv.transfer.requests import apply_request_kv_payload

            apply_request_kv_payload(req, got)
        res["ok"] = got is not None
        res["ok_summary"] = _summary(req)

        # 2. the leader has nothing
        req2 = SimpleNamespace(request_id="r2", sampling_params=SimpleNamespace())
        t0 = time.monotonic()
        res["empty"] = mgr.distribute_kv_cache(req2, received=False) is None
        res["empty_s"] = time.monotonic() - t0

        # 3. the leader's payload cannot be packed (an object msgpack cannot write)
        req3 = (
            _request("r3", with_cfg)
            if leader
            else SimpleNamespace(request_id="r3", sampling_params=SimpleNamespace())
        )
        if leader:
            req3.kv_metadata = {"bad": object()}
            req3.sampling_params.kv_metadata = {"bad": object()}
        t0 = time.monotonic()
        res["badpack"] = mgr.distribute_kv_cache(req3, received=leader) is None
        res["badpack_s"] = time.monotonic() - t0

        # 4. the leader's receive misses (nothing was sent): everyone False
        req4 = SimpleNamespace(request_id="r4", sampling_params=SimpleNamespace())
        t0 = time.monotonic()
        res["miss"] = mgr.receive_multi_kv_cache_distributed(req4)
        res["miss_s"] = time.monotonic() - t0

        # 5. world 2 only: the leader never enters distribution; the follower gives up in time
        if scenario == "world2":
            if not leader:
                req5 = SimpleNamespace(request_id="r5", sampling_params=SimpleNamespace())
                t0 = time.monotonic()
                res["absent"] = mgr.distribute_kv_cache(req5, received=False) is None
                res["absent_s"] = time.monotonic() - t0
            out.put(res)
            return
        out.put(res)
        dist.barrier()
    except Exception as exc:  # report, do not hang the parent
        out.put({"rank": rank, "error": f"{type(exc).__name__}: {exc}"})
    finally:
        if scenario != "world2":
            dist.destroy_process_group()


def _run(scenario: str, world: int, tmp_path: Any, namespace: str) -> list[dict[str, Any]]:
    from omnikv.bench.common import run_ranks

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    init = f"file://{tmp_path}/rdv"
    procs = [
        ctx.Process(target=_worker, args=(scenario, r, world, init, namespace, out))
        for r in range(world)
    ]
    results: list[dict[str, Any]] = run_ranks(procs, out, world, 60)
    assert len(results) == world, f"only {len(results)} of {world} ranks reported: {results}"
    for r in results:
        assert "error" not in r, r
    return sorted(results, key=lambda r: r["rank"])


BOUND = RECV_TIMEOUT + GRACE + 1.0


def _common_failures(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["empty"] and r["badpack"], r
        assert r["miss"] is False, r
        assert r["empty_s"] < BOUND and r["badpack_s"] < BOUND and r["miss_s"] < 2 * BOUND, r


def test_world2_hsdp_broadcast(tmp_path: Any, namespace: str) -> None:
    res = _run("world2", 2, tmp_path, namespace)
    assert [r["role"] for r in res] == ["leader", "follower"]
    lead, fol = res
    assert fol["ok"] and fol["ok_summary"] == lead["ok_summary"]
    assert fol["ok_summary"]["main"] is not None and fol["ok_summary"]["text"] is not None
    _common_failures(res)
    assert fol["absent"] and fol["absent_s"] < BOUND


def test_cfg3_scatters_one_branch_per_rank(tmp_path: Any, namespace: str) -> None:
    res = _run("cfg3", 3, tmp_path, namespace)
    assert [r["role"] for r in res] == ["leader", "follower", "follower"]
    main = res[0]["ok_summary"]["main"]
    s1, s2 = res[1]["ok_summary"], res[2]["ok_summary"]
    assert s1["main"] == main and s2["main"] == main
    assert s1["active"] == "cfg_text" and s1["text"] is not None and s1["img"] is None
    assert s2["active"] == "cfg_img" and s2["img"] is not None and s2["text"] is None
    assert s1["text"] == res[0]["ok_summary"]["text"]
    assert s2["img"] == res[0]["ok_summary"]["img"]
    _common_failures(res)


def test_sp2_broadcasts_main_kv(tmp_path: Any, namespace: str) -> None:
    res = _run("sp2", 2, tmp_path, namespace)
    assert [r["role"] for r in res] == ["leader", "follower"]
    assert res[1]["ok"] and res[1]["ok_summary"]["main"] == res[0]["ok_summary"]["main"]
    assert res[1]["ok_summary"]["meta"] == {"seq_len": 8}
    _common_failures(res)


def test_cfg2_x_sp2_four_ranks(tmp_path: Any, namespace: str) -> None:
    res = _run("cfg2sp2", 4, tmp_path, namespace)
    # rank = cfg_rank * 2 + sp_rank; cfg groups {0,2}, {1,3}; sp groups {0,1}, {2,3}
    assert [r["role"] for r in res] == ["leader", "follower", "follower", "follower"]
    lead = res[0]["ok_summary"]
    s1 = res[1]["ok_summary"]  # SP peer of the leader: the main payload, no branch KV
    assert (s1["main"], s1["meta"], s1["text"], s1["img"]) == (
        lead["main"],
        lead["meta"],
        None,
        None,
    )
    assert s1["active"] is None
    assert res[2]["ok_summary"]["active"] == "cfg_text"
    assert res[3]["ok_summary"] == res[2]["ok_summary"]  # SP peer of CFG rank 1
    assert res[2]["ok_summary"]["text"] == lead["text"]
    _common_failures(res)
