"""Resharding across real processes: source ranks and target ranks in separate processes, each
with its own shared-memory connector in one namespace, a gloo group over all of them (file://
init, loopback) for the end-of-case agreement. Every target rank's KV must equal, bit for bit,
the slice of the source stage's KV that its placement says it holds.

One set of processes runs every placement pair in turn (a process is a source rank, a target
rank or idle in each), so the suite pays the start-up of its interpreters once.
"""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import uuid
from pathlib import Path
from typing import Any

import pytest

from omnikv.topology.reshard import Placement

LAYERS, HEADS, DIM, TOKENS = 4, 12, 8, 37
RECV_TIMEOUT = 30.0

#: (name, source placement, target placement): the pairs of the issue, as config mappings
PAIRS: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("tp3->tp2", {"tp": 3}, {"tp": 2}),
    ("tp6->tp4", {"tp": 6}, {"tp": 4}),
    ("tp2xpp2->1", {"tp": 2, "pp": 2}, {}),
    ("tp2xpp2->tp4", {"tp": 2, "pp": 2, "layer_split": [1, 3]}, {"tp": 4}),
    ("tp2->ulysses4", {"tp": 2}, {"sp": 4, "sp_mode": "ulysses"}),
    ("tp2->ring4", {"tp": 2}, {"sp": 4, "sp_mode": "ring"}),
    ("tp2->cfg2xring2", {"tp": 2}, {"sp": 2, "sp_mode": "ring", "cfg": 2}),
    ("tp2->tp4 (divides)", {"tp": 2}, {"tp": 4}),
    ("tp4->tp2 (divides)", {"tp": 4}, {"tp": 2}),
]


def _ranks(mapping: dict[str, Any]) -> int:
    return math.prod(int(v) for k, v in mapping.items() if k in ("tp", "pp", "sp", "cfg"))


#: one process per rank of the largest pair (sources + targets)
WORLD = max(_ranks(s) + _ranks(t) for _, s, t in PAIRS)


def _global_kv(seed: int) -> tuple[list[Any], list[Any]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    keys = [torch.randn(TOKENS, HEADS, DIM, generator=g).half() for _ in range(LAYERS)]
    values = [torch.randn(TOKENS, HEADS, DIM, generator=g).half() for _ in range(LAYERS)]
    return keys, values


def _worker(rank: int, init: str, namespace: str, out_dir: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import time

    import torch
    import torch.distributed as dist

    from omnikv.connectors.shm.connector import SharedMemoryConnector
    from omnikv.transfer.reshard import PieceReceiver, PieceSender, rank_kv_of

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    conn = SharedMemoryConnector({"namespace": namespace, "pool_size_bytes": 64 << 20})
    report: dict[str, Any] = {}
    try:
        for case, (name, src_map, dst_map) in enumerate(PAIRS):
            source = Placement.from_mapping(src_map, num_layers=LAYERS, num_kv_heads=HEADS)
            target = Placement.from_mapping(dst_map, num_layers=LAYERS, num_kv_heads=HEADS)
            keys, values = _global_kv(seed=case)
            rid = f"req-{case}"
            ok = True
            deadline = time.monotonic() + RECV_TIMEOUT
            stages = ("0", "1")
            if rank < source.world_size:
                sender = PieceSender(conn, source, target, rank, stages)
                mine = rank_kv_of(keys, values, source.box(rank, TOKENS))
                sender.send(rid, mine, TOKENS, deadline=deadline)
            elif rank - source.world_size < target.world_size:
                trank = rank - source.world_size
                receiver = PieceReceiver(conn, source, target, trank, stages)
                got = receiver.receive(
                    rid, TOKENS, head_dim=DIM, dtype=torch.float16, deadline=deadline
                )
                want = rank_kv_of(keys, values, target.box(trank, TOKENS))
                ok = got.box == want.box and all(
                    torch.equal(a, b)
                    for a, b in zip(
                        got.key_cache + got.value_cache,
                        want.key_cache + want.value_cache,
                        strict=True,
                    )
                )
                report[name] = {"rank": trank, "ok": ok, "box": str(got.box)}
            flag = torch.tensor([1 if ok else 0])
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # every rank agrees before the next pair
            report.setdefault("_agreed", []).append(int(flag.item()))
    except Exception as exc:  # reported to the test, which fails with it
        report["error"] = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        Path(out_dir, f"{rank}.json").write_text(json.dumps(report))
        conn.close(linger=False)
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(180)
def test_every_placement_pair_reaches_every_target_rank_bit_for_bit(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    init = f"file://{tmp_path / 'gloo'}"
    namespace = f"reshard-{uuid.uuid4().hex[:8]}"
    procs = [
        ctx.Process(target=_worker, args=(r, init, namespace, str(tmp_path)), daemon=True)
        for r in range(WORLD)
    ]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout=150)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    reports = {
        int(f.stem): json.loads(f.read_text()) for f in tmp_path.glob("*.json") if f.stem.isdigit()
    }
    assert sorted(reports) == list(range(WORLD)), reports
    errors = {r: rep["error"] for r, rep in reports.items() if "error" in rep}
    assert not errors, errors
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    for rank, rep in reports.items():
        assert rep["_agreed"] == [1] * len(PAIRS), (rank, rep)
    # every target rank of every pair checked its KV
    for name, _source, dst_map in PAIRS:
        target = Placement.from_mapping(dst_map, num_layers=LAYERS, num_kv_heads=HEADS)
        checked = sorted(rep[name]["rank"] for rep in reports.values() if name in rep)
        assert checked == list(range(target.world_size)), name
        assert all(rep[name]["ok"] for rep in reports.values() if name in rep), name
