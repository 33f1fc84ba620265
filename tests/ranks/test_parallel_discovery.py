"""Parallel state discovered from the host framework (omnikv.ranks.discovery).

Precedence: injected ParallelContext > host framework (vLLM's TP group, vllm-omni's diffusion
groups) > initialised torch.distributed world > single rank. The multi-process tests put stand-in
modules with the host's names on ``sys.path`` (``vllm.distributed.parallel_state``,
``vllm_omni.diffusion.distributed.parallel_state``), back them with real gloo groups in 4 ranks,
and check that the distributed receive with no context behaves exactly as with an injected one.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import sys
import textwrap
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from omnikv import OmniKVCacheConfig, OmniKVTransferManager
from omnikv.ranks.context import ParallelContext, ReceiveRole
from omnikv.ranks.discovery import OMNI_STATE, VLLM_STATE, discover_groups, discover_tp


def _module(name: str, **functions: Any) -> ModuleType:
    mod = ModuleType(name)
    for key, fn in functions.items():
        setattr(mod, key, fn)
    return mod


def _raise(message: str) -> Any:
    def fn() -> Any:
        raise AssertionError(message)

    return fn


@pytest.fixture
def no_host(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No host framework loaded and no LOCAL_RANK, whatever the test process has."""
    for name in (VLLM_STATE, OMNI_STATE):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    return monkeypatch


def test_without_a_host_it_is_a_single_rank(no_host: pytest.MonkeyPatch) -> None:
    tp, groups = discover_tp(), discover_groups()
    assert (tp.local_rank, tp.tp_size, tp.source) == (0, 1, "default")
    assert (groups.world, groups.cfg, groups.sp, groups.source) == (None, None, None, "single rank")
    assert ParallelContext.default().source == "groups: single rank; tp: default"


def test_local_rank_is_the_fallback_for_the_tp_rank(no_host: pytest.MonkeyPatch) -> None:
    no_host.setenv("LOCAL_RANK", "3")
    tp = discover_tp()
    assert (tp.local_rank, tp.tp_size, tp.source) == (3, 1, "LOCAL_RANK")


def test_an_uninitialised_vllm_falls_back_to_local_rank(no_host: pytest.MonkeyPatch) -> None:
    no_host.setitem(sys.modules, VLLM_STATE, _module(VLLM_STATE, get_tp_group=_raise("no TP")))
    no_host.setenv("LOCAL_RANK", "1")
    assert discover_tp().source == "LOCAL_RANK"


def test_vllm_tp_group_sets_both_tp_sizes_when_the_config_leaves_them_at_one(
    no_host: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    coordinator = SimpleNamespace(rank_in_group=1, world_size=2)
    no_host.setitem(sys.modules, VLLM_STATE, _module(VLLM_STATE, get_tp_group=lambda: coordinator))
    with caplog.at_level(logging.DEBUG, logger="omnikv.ranks.discovery"):
        mgr = OmniKVTransferManager(OmniKVCacheConfig(from_tp=1, to_tp=1))
    assert "TP from vLLM: rank 1 of 2" in caplog.text
    assert mgr.local_rank == 1
    assert (mgr.tp_topo.source_tp_size, mgr.tp_topo.target_tp_size) == (2, 2)
    configured = OmniKVTransferManager(OmniKVCacheConfig(from_tp=2, to_tp=4))
    assert (configured.tp_topo.source_tp_size, configured.tp_topo.target_tp_size) == (2, 4)


def test_an_unavailable_vllm_omni_world_group_means_local(no_host: pytest.MonkeyPatch) -> None:
    state = _module(OMNI_STATE, get_world_group=_raise("world group is not initialized"))
    no_host.setitem(sys.modules, OMNI_STATE, state)
    groups = discover_groups()
    assert (groups.world, groups.source) == (None, "vllm-omni (world unavailable)")
    mgr = OmniKVTransferManager(OmniKVCacheConfig())
    assert mgr.topo_config.role is ReceiveRole.LOCAL


def test_doctor_says_where_the_parallel_state_came_from(
    no_host: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from omnikv.cli import main

    assert main(["doctor"]) == 0
    assert "parallel state: groups: single rank; tp: default" in capsys.readouterr().out


# -- four ranks over real gloo groups, with stand-in host modules --------------------------------

_VLLM = '''
"""Stand-in for vllm.distributed.parallel_state: the TP group, as a GroupCoordinator."""
import torch.distributed as dist

_TP = None


class GroupCoordinator:
    def __init__(self, groups):
        me = dist.get_rank()
        for ranks in groups:  # every rank creates every group, in the same order
            group = dist.new_group(ranks)
            if me in ranks:
                self.cpu_group = group
                self.rank_in_group = ranks.index(me)
                self.world_size = len(ranks)


def initialize(tp_groups):
    global _TP
    _TP = GroupCoordinator(tp_groups)


def get_tp_group():
    assert _TP is not None, "tensor model parallel group is not initialized"
    return _TP
'''

_OMNI = '''
"""Stand-in for vllm_omni.diffusion.distributed.parallel_state (world, CFG, SP groups)."""
import torch.distributed as dist
from vllm.distributed.parallel_state import GroupCoordinator

_WORLD = _CFG = _SP = None


def initialize(cfg_groups, sp_groups):
    global _WORLD, _CFG, _SP
    _WORLD = GroupCoordinator([list(range(dist.get_world_size()))])
    _CFG = GroupCoordinator(cfg_groups) if cfg_groups else None
    _SP = GroupCoordinator(sp_groups) if sp_groups else None


def get_world_group():
    assert _WORLD is not None, "world group is not initialized"
    return _WORLD


def get_cfg_group():
    assert _CFG is not None, "classifier_free_guidance parallel group is not initialized"
    return _CFG


def get_classifier_free_guidance_world_size():
    return get_cfg_group().world_size


def get_classifier_free_guidance_rank():
    return get_cfg_group().rank_in_group


def get_sp_group():
    assert _SP is not None, "sequence parallel group is not initialized"
    return _SP


def get_sequence_parallel_world_size():
    return get_sp_group().world_size


def get_sequence_parallel_rank():
    return get_sp_group().rank_in_group
'''


def _write_host(root: Path) -> None:
    for package, source in (
        ("vllm/distributed", _VLLM),
        ("vllm_omni/diffusion/distributed", _OMNI),
    ):
        path = root / package
        path.mkdir(parents=True)
        for level in range(len(Path(package).parts)):
            (root.joinpath(*Path(package).parts[: level + 1]) / "__init__.py").touch()
        (path / "parallel_state.py").write_text(textwrap.dedent(source))


def _shard(tp_rank: int) -> list[tuple[Any, Any]]:
    import torch

    g = torch.Generator().manual_seed(100 + tp_rank)
    return [(torch.randn(2, 16, 2, 8, generator=g), torch.randn(2, 16, 2, 8, generator=g))] * 2


def _expected_sum(tp_rank: int) -> float:
    """What ``_kv_sum`` gives for the first 20 tokens of blocks 0 and 1 of ``_shard``."""
    import torch

    layers = _shard(tp_rank)
    kv = SimpleNamespace(
        key_cache=[torch.cat([k[0], k[1, :4]]) for k, _ in layers],
        value_cache=[torch.cat([v[0], v[1, :4]]) for _, v in layers],
    )
    return _kv_sum(SimpleNamespace(past_key_values=kv)) or 0.0


def _kv_sum(req: Any) -> float | None:
    kv = getattr(req, "past_key_values", None)
    if kv is None:
        return None
    return float(sum(float(t.double().sum()) for t in kv.key_cache + kv.value_cache))


def _receive(mgr: OmniKVTransferManager, rid: str) -> dict[str, Any]:
    req = SimpleNamespace(request_id=rid, sampling_params=SimpleNamespace())
    ok = mgr.receive_multi_kv_cache_distributed(req)
    topo = mgr.topo_config
    return {
        "role": topo.role.value,
        "local_rank": mgr.local_rank,
        "tp": (mgr.tp_topo.source_tp_size, mgr.tp_topo.target_tp_size),
        "cfg": (topo.cfg_rank, topo.cfg_size),
        "sp": (topo.sp_rank, topo.sp_size),
        "ok": ok,
        "kv": _kv_sum(req),
    }


# world size, TP groups (None: no vLLM in the host), CFG groups, SP groups; "plain2" has no
# host framework at all (only an initialised torch.distributed world)
LAYOUTS: dict[str, tuple[int, Any, Any, Any]] = {
    "tp2xcfg2": (4, [[0, 1], [2, 3]], [[0, 2], [1, 3]], None),
    "tp2xsp2": (4, [[0, 1], [2, 3]], None, [[0, 2], [1, 3]]),
    "sp2": (2, None, None, [[0, 1]]),
    "plain2": (2, None, None, None),
}


def _send_shards(ns: str, tp_rank: int, tp: int) -> None:
    """Stage 0's rank ``tp_rank`` (of ``tp``) sends its shard for both requests."""
    from omnikv.connectors.local import LocalConnector

    sender = OmniKVTransferManager(
        OmniKVCacheConfig(from_stage="0", to_stage="1", need_send_cache=True, from_tp=tp, to_tp=tp),
        parallel_context=SimpleNamespace(local_rank=tp_rank, tp_size=tp),
        connector=LocalConnector({"namespace": ns}),
    )
    for rid in ("found", "given"):
        sender.handle_finished_requests_kv_transfer(
            {rid: {"block_ids": [0, 1], "seq_len": 20}}, _shard(tp_rank), 16, "float32"
        )


def _receiver(ns: str, ctx: ParallelContext | None, tp: int) -> OmniKVTransferManager:
    from omnikv.connectors.local import LocalConnector

    cfg = OmniKVCacheConfig(
        from_stage="0", stage_id="1", need_recv_cache=True, recv_timeout=1.0, from_tp=tp, to_tp=tp
    )
    return OmniKVTransferManager(
        cfg, parallel_context=ctx, connector=LocalConnector({"namespace": ns})
    )


def _injected(omni_state: Any, vllm_state: Any, tp_rank: int, tp: int) -> ParallelContext:
    """The context a launcher would inject for the same groups."""
    import torch.distributed as dist

    def group(coordinator: Any) -> Any:
        return coordinator.cpu_group if coordinator is not None else None

    if omni_state is None:
        return ParallelContext(world_group=dist.group.WORLD, local_rank=tp_rank, tp_size=tp)
    return ParallelContext(
        world_group=group(omni_state._WORLD),
        cfg_group=group(omni_state._CFG),
        sp_group=group(omni_state._SP),
        tp_group=group(vllm_state._TP) if vllm_state is not None else None,
        local_rank=tp_rank,
        tp_size=tp,
    )


def _worker(layout: str, rank: int, init: str, host: str, ns: str, out: Any) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    os.environ.pop("LOCAL_RANK", None)
    sys.path.insert(0, host)
    import importlib

    import torch.distributed as dist

    world, tp_groups, cfg_groups, sp_groups = LAYOUTS[layout]
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        vllm_state = None
        if tp_groups is not None:  # the host runs vLLM: its TP group exists
            vllm_state = importlib.import_module("vllm.distributed.parallel_state")
            vllm_state.initialize(tp_groups)
        omni_state = None
        if layout != "plain2":
            omni_state = importlib.import_module("vllm_omni.diffusion.distributed.parallel_state")
            omni_state.initialize(cfg_groups, sp_groups)
        tp = 2 if tp_groups is not None else 1
        tp_rank = rank % tp
        _send_shards(ns, tp_rank, tp)
        found = _receiver(ns, None, 1)  # from_tp = to_tp = 1: both become the detected TP size
        res: dict[str, Any] = {"rank": rank, "source": found.topo_config.context.source}
        res["found"] = _receive(found, "found")
        res["found_miss"] = _receive(found, "never-sent")["ok"]
        given = _receiver(ns, _injected(omni_state, vllm_state, tp_rank, tp), tp)
        res["given"] = _receive(given, "given")
        res["given_miss"] = _receive(given, "never-sent-either")["ok"]
        res["expected_kv"] = _expected_sum(tp_rank)
        out.put(res)
        dist.barrier()
    except Exception as exc:  # report, do not hang the parent
        out.put({"rank": rank, "error": f"{type(exc).__name__}: {exc}"})
    finally:
        dist.destroy_process_group()


def _run(layout: str, tmp_path: Path, namespace: str) -> list[dict[str, Any]]:
    from omnikv.bench.common import run_ranks

    world = LAYOUTS[layout][0]
    host = tmp_path / "host"
    _write_host(host)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    init = f"file://{tmp_path}/rdv"
    procs = [
        ctx.Process(target=_worker, args=(layout, r, init, str(host), namespace, out))
        for r in range(world)
    ]
    results: list[dict[str, Any]] = run_ranks(procs, out, world, 90)
    assert len(results) == world, f"only {len(results)} of {world} ranks reported: {results}"
    for r in results:
        assert "error" not in r, r
    return sorted(results, key=lambda r: r["rank"])


def _check(results: list[dict[str, Any]], roles: list[str], source: str, tp: int) -> None:
    for r in results:
        assert r["source"] == source, r
        assert r["found"] == r["given"], r  # discovered == injected, rank by rank
        assert r["found"]["local_rank"] == r["rank"] % tp and r["found"]["tp"] == (tp, tp), r
        assert r["found"]["ok"] and r["found"]["kv"] == r["expected_kv"], r
        assert r["found_miss"] is False and r["given_miss"] is False, r
    assert [r["found"]["role"] for r in results] == roles


@pytest.mark.slow
@pytest.mark.dist
def test_tp2_x_cfg2_discovered_receive_equals_injected(tmp_path: Path, namespace: str) -> None:
    results = _run("tp2xcfg2", tmp_path, namespace)
    _check(results, ["leader", "leader", "follower", "follower"], "groups: vllm-omni; tp: vllm", 2)
    assert [r["found"]["cfg"] for r in results] == [(0, 2), (0, 2), (1, 2), (1, 2)]


@pytest.mark.slow
@pytest.mark.dist
def test_tp2_x_sp2_discovered_receive_equals_injected(tmp_path: Path, namespace: str) -> None:
    results = _run("tp2xsp2", tmp_path, namespace)
    _check(results, ["leader", "leader", "follower", "follower"], "groups: vllm-omni; tp: vllm", 2)
    assert [r["found"]["sp"] for r in results] == [(0, 2), (0, 2), (1, 2), (1, 2)]


@pytest.mark.slow
@pytest.mark.dist
def test_sp2_without_vllm_discovered_receive_equals_injected(
    tmp_path: Path, namespace: str
) -> None:
    results = _run("sp2", tmp_path, namespace)
    _check(results, ["leader", "follower"], "groups: vllm-omni; tp: default", 1)
    assert [r["found"]["sp"] for r in results] == [(0, 2), (1, 2)]


@pytest.mark.slow
@pytest.mark.dist
def test_an_initialised_torch_distributed_world_without_a_host_framework(
    tmp_path: Path, namespace: str
) -> None:
    results = _run("plain2", tmp_path, namespace)
    _check(results, ["leader", "follower"], "groups: torch.distributed; tp: default", 1)
