"""``omnikv bench reshard``: a request's KV resharded from one stage's placement onto another's.

Per placement pair (TP, TP x PP, Ulysses and Ring SP, CFG replicas; see ``PAIRS``) it reports
the bytes the plan moves (every piece's payload as put, headers included) against the minimum
(what the target ranks hold: the KV data of every target's box) and against "everything to
everyone" (every source rank sending all it holds to every target rank), and the wall time of
one request across processes over shared memory: every rank is its own process (a gloo group
over loopback times the rounds: a barrier, then each target's time from the barrier to its KV
assembled), next to a memcpy of the bytes the largest target needs, measured in the same run.
Data is verified on every target rank (bit for bit against its slice of the source KV).

The payload is Qwen2.5-7B-shaped (28 layers, 4 KV heads, dim 128, fp16; 4096 tokens: 224 MiB);
the pairs that need a head count divisible by 3 (TP 3 -> 2, 6 -> 4) use 12 KV heads of dim 128
and as many tokens as make the same size (1365). One warm-up round, then ``--rounds`` timed
rounds per pair; medians, min..max.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["PAIRS", "main"]

MIB = 1 << 20
LAYERS, DIM = 28, 128
#: (name, KV heads, tokens, source placement, target placement)
PAIRS: list[tuple[str, int, int, dict[str, Any], dict[str, Any]]] = [
    ("TP 2 -> TP 4", 4, 4096, {"tp": 2}, {"tp": 4}),
    ("TP 4 -> TP 2", 4, 4096, {"tp": 4}, {"tp": 2}),
    ("TP 3 -> TP 2", 12, 1365, {"tp": 3}, {"tp": 2}),
    ("TP 6 -> TP 4", 12, 1365, {"tp": 6}, {"tp": 4}),
    ("TP 2 x PP 2 -> TP 1", 4, 4096, {"tp": 2, "pp": 2}, {}),
    ("TP 2 x PP 2 -> TP 4", 4, 4096, {"tp": 2, "pp": 2}, {"tp": 4}),
    ("TP 2 -> SP 4 (Ulysses)", 4, 4096, {"tp": 2}, {"sp": 4, "sp_mode": "ulysses"}),
    ("TP 2 -> SP 4 (Ring)", 4, 4096, {"tp": 2}, {"sp": 4, "sp_mode": "ring"}),
    ("TP 2 -> CFG 2 x SP 2 (Ring)", 4, 4096, {"tp": 2}, {"cfg": 2, "sp": 2, "sp_mode": "ring"}),
]


def _ranks(mapping: dict[str, Any]) -> int:
    return math.prod(int(v) for k, v in mapping.items() if k in ("tp", "pp", "sp", "cfg"))


def _kv(heads: int, tokens: int, seed: int) -> tuple[list[Any], list[Any]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    base = torch.randn(tokens, heads, DIM, generator=g).half()
    return [base + i for i in range(LAYERS)], [base - i for i in range(LAYERS)]


def _worker(rank: int, world: int, init: str, namespace: str, args: dict[str, Any]) -> None:
    """One rank of every pair: a source rank, a target rank or idle; writes its figures."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch
    import torch.distributed as dist

    from omnikv.connectors.shm.connector import SharedMemoryConnector
    from omnikv.topology.reshard import Placement
    from omnikv.transfer.reshard import PieceReceiver, PieceSender, rank_kv_of

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    conn = SharedMemoryConnector(
        {"namespace": namespace, "pool_size_bytes": args["pool_mib"] * MIB, "linger_s": 0}
    )
    out: dict[str, Any] = {}
    try:
        for case, (name, heads, listed, src_map, dst_map) in enumerate(PAIRS):
            if name not in args["pairs"]:
                continue
            tokens = args["tokens"] or listed
            source = Placement.from_mapping(src_map, num_layers=LAYERS, num_kv_heads=heads)
            target = Placement.from_mapping(dst_map, num_layers=LAYERS, num_kv_heads=heads)
            keys, values = _kv(heads, tokens, seed=case)
            trank = rank - source.world_size
            sender = receiver = None
            mine = want = None
            if rank < source.world_size:
                sender = PieceSender(conn, source, target, rank, ("0", "1"))
                mine = rank_kv_of(keys, values, source.box(rank, tokens))
            elif trank < target.world_size:
                receiver = PieceReceiver(conn, source, target, trank, ("0", "1"))
                want = rank_kv_of(keys, values, target.box(trank, tokens))
            del keys, values
            times: list[float] = []
            put_bytes = 0
            ok = True
            for rnd in range(1 + args["rounds"]):
                dist.barrier()
                t0 = time.monotonic()
                deadline = t0 + 60.0
                rid = f"{case}-{rnd}"
                if sender is not None and mine is not None:
                    put_bytes = sender.send(rid, mine, tokens, deadline=deadline)
                elif receiver is not None and want is not None:
                    got = receiver.receive(
                        rid, tokens, head_dim=DIM, dtype=torch.float16, deadline=deadline
                    )
                    took = time.monotonic() - t0
                    ok = ok and all(
                        torch.equal(a, b)
                        for a, b in zip(
                            [*got.key_cache, *got.value_cache],
                            [*want.key_cache, *want.value_cache],
                            strict=True,
                        )
                    )
                    del got
                    if rnd:
                        times.append(took)
                dist.barrier()
            out[name] = {"times": times, "put_bytes": put_bytes, "ok": ok}
    finally:
        Path(args["out"], f"{rank}.json").write_text(json.dumps(out))
        conn.close(linger=False)
        dist.destroy_process_group()


def _memcpy_s(nbytes: int, repeat: int = 5) -> float:
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty(nbytes, dtype=torch.uint8)
    dst.copy_(src)
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        dst.copy_(src)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _report(args: argparse.Namespace, ranks: dict[int, dict[str, Any]]) -> dict[str, Any]:
    from omnikv.topology.reshard import Placement, plan_reshard

    rows: dict[str, Any] = {}
    head = (
        f"{'placement pair':<30} {'moved MiB':>10} {'minimum':>9} {'x min':>6} {'all->all':>9}"
        f" {'wall ms (min..max)':>22} {'memcpy ms':>10} {'x memcpy':>9} {'ok':>3}"
    )
    print(head + "\n" + "-" * len(head))
    for name, heads, listed, src_map, dst_map in PAIRS:
        if name not in args.pairs:
            continue
        tokens = args.tokens or listed
        source = Placement.from_mapping(src_map, num_layers=LAYERS, num_kv_heads=heads)
        target = Placement.from_mapping(dst_map, num_layers=LAYERS, num_kv_heads=heads)
        plan = plan_reshard(source, target, tokens)
        per_element = 2 * DIM * 2  # K and V, fp16
        minimum = plan.elements * per_element
        everything = plan.broadcast_elements() * per_element
        moved = sum(int(r.get(name, {}).get("put_bytes", 0)) for r in ranks.values())
        times = [t for r in ranks.values() for t in r.get(name, {}).get("times", [])]
        # a round ends when its slowest target is done: the max over targets, per round
        per_round = [
            max(r[name]["times"][i] for r in ranks.values() if r.get(name, {}).get("times"))
            for i in range(args.rounds)
        ]
        largest = max(target.box(t, tokens).volume for t in range(target.world_size))
        memcpy = _memcpy_s(largest * per_element)
        wall = statistics.median(per_round)
        ok = all(r.get(name, {}).get("ok", True) for r in ranks.values()) and bool(times)
        print(
            f"{name:<30} {moved / MIB:10.1f} {minimum / MIB:9.1f} {moved / minimum:6.3f}"
            f" {everything / MIB:9.1f} {wall * 1e3:8.1f} ({min(per_round) * 1e3:.1f}.."
            f"{max(per_round) * 1e3:.1f}) {memcpy * 1e3:10.1f} {wall / memcpy:9.2f}"
            f" {'yes' if ok else 'NO':>3}"
        )
        rows[name] = {
            "moved_bytes": moved,
            "minimum_bytes": minimum,
            "all_to_all_bytes": everything,
            "wall_s": per_round,
            "wall_median_s": wall,
            "memcpy_largest_target_s": memcpy,
            "verified": ok,
        }
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; 0 when every target rank's KV verified, 1 otherwise."""
    parser = argparse.ArgumentParser(
        prog="omnikv bench reshard",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per pair (3)")
    parser.add_argument(
        "--pairs",
        default=",".join(p[0] for p in PAIRS),
        type=lambda s: [x.strip() for x in s.split(",") if x.strip()],
        help="comma-separated pair names to run (default: all of them)",
    )
    parser.add_argument("--pool-mib", type=int, default=512, help="each rank's pool (512 MiB)")
    parser.add_argument(
        "--tokens",
        type=int,
        default=0,
        help="tokens of every pair's request instead of its own (smoke runs; 0: as listed)",
    )
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args(list(argv or []))
    unknown = [p for p in args.pairs if p not in {name for name, *_ in PAIRS}]
    if unknown or args.rounds < 1 or args.tokens < 0:
        parser.error(f"unknown pair(s) {unknown}" if unknown else "--rounds >= 1, --tokens >= 0")
    world = max(_ranks(s) + _ranks(t) for name, _, _, s, t in PAIRS if name in args.pairs)
    print(
        f"reshard: {LAYERS} layers x dim {DIM}, fp16, {world} processes (one per rank) over shared"
        f" memory on {os.cpu_count()} cores; {args.rounds} timed rounds per pair"
    )
    with tempfile.TemporaryDirectory(prefix="omnikv-reshard-") as tmp:
        ctx = mp.get_context("spawn")
        shared = {
            "rounds": args.rounds,
            "pairs": args.pairs,
            "pool_mib": args.pool_mib,
            "tokens": args.tokens,
            "out": tmp,
        }
        init = f"file://{tmp}/gloo"
        namespace = f"bench-reshard-{uuid.uuid4().hex[:8]}"
        procs = [
            ctx.Process(target=_worker, args=(r, world, init, namespace, shared), daemon=True)
            for r in range(world)
        ]
        for p in procs:
            p.start()
        try:
            for p in procs:
                p.join(timeout=1800)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(5)
        failed = [p.exitcode for p in procs if p.exitcode != 0]
        ranks = {int(f.stem): json.loads(f.read_text()) for f in Path(tmp).glob("*.json")}
    if failed or len(ranks) != world:
        print(
            f"reshard: {len(failed)} rank process(es) failed: exit codes {failed}", file=sys.stderr
        )
        return 1
    rows = _report(args, ranks)
    if args.json:
        Path(args.json).write_text(json.dumps({"bench": "reshard", "pairs": rows}, indent=2))
    return 0 if all(r["verified"] for r in rows.values()) else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
