"""Node-shared reads through the seed API: a sender stage and a 4-rank receiving stage (real gloo
world, spawned processes, real shared memory) with ``shared_readers: 4`` in both stages'
``connector_config``. The sender writes each payload once; every rank's
``receive_multi_kv_cache_distributed`` takes it from the connector itself and all agree.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from typing import Any

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.timeout(120)]

WORLD = 4
BLOCK = 16
LAYERS, HEADS, DIM, TOKENS = 2, 2, 32, 40
RECV_TIMEOUT = 3.0


def _caches() -> list[Any]:
    import torch

    g = torch.Generator().manual_seed(7)
    blocks = (TOKENS + BLOCK - 1) // BLOCK + 2
    return [
        torch.randn(2, blocks, BLOCK, HEADS, DIM, generator=g).to(torch.float16)
        for _ in range(LAYERS)
    ]


def _block_ids() -> list[int]:
    return [2, 0, 1][: (TOKENS + BLOCK - 1) // BLOCK]


def _expected_sum() -> float:
    total = 0.0
    ids = _block_ids()
    for kv in _caches():
        for side in (0, 1):
            total += float(kv[side][ids].reshape(-1, HEADS, DIM)[:TOKENS].double().sum())
    return total


def _conn(namespace: str) -> dict[str, Any]:
    return {
        "type": "SharedMemoryConnector",
        "namespace": namespace,
        "shared_readers": WORLD,
        "pool_size_bytes": 8 << 20,
        "linger_s": 0,
    }


def _rank(rank: int, init: str, namespace: str, out: Any) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    from types import SimpleNamespace

    import torch.distributed as dist

    from omnikv import OmniKVCacheConfig, OmniKVTransferManager
    from omnikv.ranks.context import ParallelContext

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    mgr = None
    try:
        cfg = OmniKVCacheConfig(
            connector_config=_conn(namespace),
            from_stage="0",
            stage_id="1",
            need_recv_cache=True,
            recv_timeout=RECV_TIMEOUT,
            enable_kv_async_prefetch=True,
        )
        ctx = ParallelContext(world_group=dist.group.WORLD, grace_s=1.0)
        mgr = OmniKVTransferManager(cfg, parallel_context=ctx, async_prefetch=True)
        res: dict[str, Any] = {"rank": rank, "role": mgr.topo_config.role.value}
        req = SimpleNamespace(request_id="r1", sampling_params=SimpleNamespace())
        res["has_kv"] = mgr.receive_multi_kv_cache_distributed(req)
        kv = getattr(req, "past_key_values", None)
        res["sum"] = (
            None
            if kv is None
            else float(sum(float(t.double().sum()) for t in kv.key_cache + kv.value_cache))
        )
        # every rank prefetches r2 itself (no follower waits for a leader), then consumes it
        mgr.start_prefetch({"request_id": "r2", "kv_sender_info": {0: {"host": "127.0.0.1"}}})
        req2 = SimpleNamespace(request_id="r2", sampling_params=SimpleNamespace())
        res["prefetched"] = mgr.wait_prefetch(RECV_TIMEOUT + 5.0)
        res["tracked"] = mgr.edge.prefetcher.tracked().get("r2")
        res["has_kv2"] = mgr.consume_and_distribute_kv_cache(req2)
        kv2 = getattr(req2, "past_key_values", None)
        res["sum2"] = (
            None
            if kv2 is None
            else float(sum(float(t.double().sum()) for t in kv2.key_cache + kv2.value_cache))
        )
        missing = SimpleNamespace(request_id="never-sent", sampling_params=SimpleNamespace())
        t0 = time.monotonic()
        res["missing"] = mgr.receive_multi_kv_cache_distributed(missing)
        res["missing_s"] = time.monotonic() - t0
        dist.barrier()
        out.put(res)
    except Exception as exc:  # reported, never a hang of the parent
        out.put({"rank": rank, "error": f"{type(exc).__name__}: {exc}"})
    finally:
        if mgr is not None:
            mgr.close()
        dist.destroy_process_group()


def test_four_ranks_read_one_write(tmp_path: Any, namespace: str) -> None:
    from omnikv import OmniKVCacheConfig, OmniKVTransferManager
    from omnikv.bench.common import run_ranks

    sender = OmniKVTransferManager(
        OmniKVCacheConfig(
            connector_config=_conn(namespace),
            from_stage="0",
            to_stage="1",
            need_send_cache=True,
        )
    )
    try:
        entry = {"block_ids": _block_ids(), "seq_len": TOKENS}
        sent = sender.handle_finished_requests_kv_transfer(
            {"r1": entry, "r2": entry}, _caches(), BLOCK, "torch.float16"
        )
        assert sorted(sent) == ["r1", "r2"]
        result = sender.get_send_result("r1")
        assert result is not None and result.ok
        conn = sender.connector
        assert conn is not None
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        init = f"file://{tmp_path}/rdv"
        procs = [ctx.Process(target=_rank, args=(r, init, namespace, out)) for r in range(WORLD)]
        res = sorted(run_ranks(procs, out, WORLD, 100), key=lambda r: r["rank"])
        assert len(res) == WORLD, res
        for r in res:
            assert "error" not in r, r
        # no follower waits for a leader: every rank read the one copy itself
        assert [r["role"] for r in res] == ["leader", "follower", "follower", "follower"]
        assert all(r["has_kv"] for r in res), res
        want = _expected_sum()
        assert all(r["sum"] == pytest.approx(want) for r in res), (want, res)
        assert all(r["prefetched"] and r["tracked"] == "done" and r["has_kv2"] for r in res), [
            (r["prefetched"], r["tracked"], r["has_kv2"]) for r in res
        ]
        assert all(r["sum2"] == pytest.approx(want) for r in res), (want, res)
        h = conn.health()
        # each request written once for the 4 ranks
        assert (h["puts"], h["put_bytes"]) == (2, 2 * result.nbytes)
        assert h["shared_puts"] == 2
        # one claim per rank and request, none returned: the prefetch's abortable wait is one
        # wait with its want open throughout (shared memory ``takes_abort``); cut into 50 ms
        # slices, an offer that reached a rank after its slice ended came back as a return
        assert h["shared_claims"] == 2 * WORLD and h["returns"] == 0, h
        assert all(r["missing"] is False for r in res), res
        assert all(r["missing_s"] < RECV_TIMEOUT + 3.0 for r in res), res
        end = time.monotonic() + 10
        while h["pool_free_bytes"] != h["pool_size_bytes"] and time.monotonic() < end:
            time.sleep(0.01)  # the ranks' releases are messages nobody is told of
            h = conn.health()
        assert h["pool_free_bytes"] == h["pool_size_bytes"]
    finally:
        sender.close()
