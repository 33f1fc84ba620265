"""``omnikv bench dist``: distributing a request's KV from a leader rank to its followers.

Same run, same bytes (Qwen2.5-7B, 4096 tokens, fp16 = 224 MiB by default), 3 spawned ranks on
one gloo world group (loopback):

* ``gloo broadcast`` of one pre-allocated buffer of the packed size (the ceiling);
* ``distribute_kv_cache`` (world broadcast role): agreement, one pack copy on the leader,
  broadcast of the packed buffer, zero-copy decode on the followers (target >= 0.5 x gloo).

Each run is timed on the leader from a barrier to a closing 8-byte ``all_reduce``, so it ends
when every follower has its payload. Followers verify every tensor of the last run.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import tempfile
import time
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import torch

from omnikv.bench.common import Stats, print_table, realistic_payload, run_ranks, write_json

__all__ = ["main"]


def _rank(rank: int, world: int, init: str, tokens: int, repeat: int, out: Any) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch.distributed as dist

    from omnikv import OmniKVCacheConfig, OmniKVTransferManager
    from omnikv.ranks.context import ParallelContext

    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        ctx = ParallelContext(world_group=dist.group.WORLD, max_message_bytes=1 << 34)
        mgr = OmniKVTransferManager(
            OmniKVCacheConfig(need_recv_cache=True, recv_timeout=60), parallel_context=ctx
        )
        src = realistic_payload("qwen2.5-7b", tokens)
        kv = SimpleNamespace(
            key_cache=src.layer_blocks["key_cache"], value_cache=src.layer_blocks["value_cache"]
        )
        nbytes = sum(t.numel() * t.element_size() for t in kv.key_cache + kv.value_cache)
        raw = torch.zeros(nbytes + 65536, dtype=torch.uint8)
        done = torch.zeros(1, dtype=torch.int64)

        def gloo() -> None:
            dist.broadcast(raw, 0)

        def ours() -> Any:
            if rank == 0:
                req = SimpleNamespace(request_id="b", past_key_values=kv, kv_metadata={"n": 1})
                return mgr.distribute_kv_cache(req, received=True)
            return mgr.distribute_kv_cache(SimpleNamespace(request_id="b"), received=False)

        samples: dict[str, list[float]] = {"gloo": [], "ours": []}
        last: Any = None
        for i in range(repeat + 2):
            for name, fn in (("gloo", gloo), ("ours", ours)):
                dist.barrier()
                t0 = time.perf_counter()
                got = fn()
                dist.all_reduce(done)
                dt = time.perf_counter() - t0
                if i >= 2:
                    samples[name].append(dt)
                if name == "ours":
                    last = got
        verified = last is not None
        if rank != 0 and last is not None:
            pkv = last["past_key_values"]
            for got_t, want in zip(
                pkv.key_cache + pkv.value_cache, kv.key_cache + kv.value_cache, strict=True
            ):
                verified = verified and torch.equal(got_t, want)
        out.put({"rank": rank, "samples": samples, "nbytes": nbytes, "verified": verified})
        dist.destroy_process_group()
    except Exception as exc:
        out.put({"rank": rank, "error": f"{type(exc).__name__}: {exc}"})


def main(argv: Sequence[str] | None = None) -> int:
    """Run the distribution benchmark; 0 when verified and >= 0.5 x gloo, else 1."""
    parser = argparse.ArgumentParser(
        prog="omnikv bench dist",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--tokens", type=int, default=4096, help="tokens in the payload")
    parser.add_argument("--repeat", type=int, default=8, help="samples per case")
    parser.add_argument(
        "--followers", type=int, default=2, help="receiving ranks besides the leader"
    )
    parser.add_argument("--json", default=None, help="write results to this file")
    args = parser.parse_args(list(argv) if argv is not None else None)
    world = args.followers + 1
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{tmp}/rdv"
        procs = [
            ctx.Process(target=_rank, args=(r, world, init, args.tokens, args.repeat, out))
            for r in range(world)
        ]
        results: list[dict[str, Any]] = run_ranks(procs, out, world, 300)
    errors = [r for r in results if "error" in r]
    if len(results) < world or errors:
        print(f"benchmark failed: {errors or 'ranks did not report'}")
        return 1
    lead = next(r for r in results if r["rank"] == 0)
    verified = all(r["verified"] for r in results)
    nbytes = int(lead["nbytes"])
    gloo = Stats(f"gloo broadcast ({args.followers} followers)", lead["samples"]["gloo"], nbytes)
    ours = Stats("distribute_kv_cache (world bcast)", lead["samples"]["ours"], nbytes)
    print_table(
        [gloo, ours],
        baseline=gloo,
        title=f"KV distribution, {nbytes / 2**20:.0f} MiB, 1 leader -> {args.followers} followers",
    )
    ratio = gloo.median / ours.median
    ok = verified and ratio >= 0.5
    print(f"\nours / gloo (speed) = {ratio:.2f} (target >= 0.5); verified: {verified}")
    write_json(
        args.json,
        {"gloo": gloo.as_dict(), "ours": ours.as_dict(), "ratio": ratio, "verified": verified},
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
