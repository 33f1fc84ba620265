"""Tensor parallelism 2 -> 4: two sender ranks hand one request's KV to four receiver ranks.

Each sender rank holds half of the KV heads (TP 2); each receiver rank needs a quarter (TP 4).
With ``rank_mapping: {from_tp: 2, to_tp: 4}`` every sender rank cuts its heads in two and sends
each half to the receiver rank that owns it; every receiver rank takes exactly its own heads.
The four receiver ranks form one torch.distributed (gloo) group and agree on the outcome, so
either all of them have the KV or none of them uses it.

    python examples/tp2_to_tp4_gloo.py

Six processes on this host: two sender ranks and four receiver ranks, over shared memory
(``SharedMemoryConnector``) and a gloo group on loopback. In vLLM (or vllm-omni) the ranks and
their process group come from the engine; here ``ParallelContext`` says which rank is which.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import uuid
from types import SimpleNamespace
from typing import Any

import torch

from omnikv import OmniKVTransferManager, ParallelContext

SENDER_TP, RECEIVER_TP = 2, 4
LAYERS, HEADS, HEAD_DIM, BLOCK_SIZE, SEQ_LEN = 2, 8, 32, 16, 40
BLOCK_IDS = [1, 0, 3]  # the request's blocks, in token order


def full_cache() -> list[torch.Tensor]:
    """All 8 KV heads of every layer, ``[2, blocks, block_size, heads, dim]`` (seeded)."""
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, 4, BLOCK_SIZE, HEADS, HEAD_DIM, generator=g) for _ in range(LAYERS)]


def expected(cache: torch.Tensor, which: int, heads: list[int]) -> torch.Tensor:
    """K (``which`` 0) or V (1) of one layer as a receiver rank should get it: the request's
    tokens, only ``heads``."""
    tokens = torch.cat([cache[which, b] for b in BLOCK_IDS])[:SEQ_LEN]
    return tokens[:, heads[0] : heads[-1] + 1]


def stage_config(namespace: str, role: str) -> dict[str, Any]:
    mapping = {"from_tp": SENDER_TP, "to_tp": RECEIVER_TP}
    connector = {"type": "SharedMemoryConnector", "namespace": namespace}
    edge: dict[str, Any]
    if role == "sender":
        edge = {"need_send_cache": True, "omni_from_stage": 0, "omni_to_stage": 1}
    else:
        edge = {"need_recv_cache": True, "stage_id": 1, "engine_input_source": [0]}
    return {**edge, "rank_mapping": mapping, "connector_config": connector, "recv_timeout": 60}


def sender_rank(rank: int, namespace: str, done: Any) -> None:
    """Sender rank ``rank`` holds heads [4 * rank, 4 * rank + 4) of every layer."""
    per_rank = HEADS // SENDER_TP
    shard = [c[..., rank * per_rank : (rank + 1) * per_rank, :].contiguous() for c in full_cache()]
    ctx = ParallelContext(local_rank=rank, tp_size=SENDER_TP)
    config = stage_config(namespace, "sender")
    with OmniKVTransferManager.from_config(config, parallel_context=ctx) as manager:
        finished = {"req-0": {"block_ids": BLOCK_IDS, "seq_len": SEQ_LEN}}
        manager.handle_finished_requests_kv_transfer(finished, shard, BLOCK_SIZE, "float32")
        result = manager.get_send_result("req-0")
        print(f"sender rank {rank}: {result.status.value if result else 'not sent'}", flush=True)
        done.wait(timeout=120)  # keep the payloads until every receiver rank has its share


def receiver_rank(rank: int, namespace: str, rendezvous: str, results: Any) -> None:
    """Receiver rank ``rank`` of 4: joins the gloo group, receives, checks its 2 heads."""
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # keep gloo on loopback
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=RECEIVER_TP)
    try:
        world = dist.group.WORLD
        ctx = ParallelContext(
            world_group=world, tp_group=world, local_rank=rank, tp_size=RECEIVER_TP
        )
        config = stage_config(namespace, "receiver")
        with OmniKVTransferManager.from_config(config, parallel_context=ctx) as manager:
            request = SimpleNamespace(request_id="req-0", sampling_params=SimpleNamespace())
            # Every rank calls it; True on all ranks or on none (the group agrees).
            ok = manager.receive_multi_kv_cache_distributed(request)
            heads = list(range(2 * rank, 2 * rank + 2))  # this rank's quarter of the heads
            same = ok and all(
                torch.equal(request.past_key_values.key_cache[i], expected(c, 0, heads))
                and torch.equal(request.past_key_values.value_cache[i], expected(c, 1, heads))
                for i, c in enumerate(full_cache())
            )
            results.put((rank, ok, heads, same))
    finally:
        dist.destroy_process_group()


def main() -> int:
    namespace = f"tp-{uuid.uuid4().hex[:8]}"
    ctx = mp.get_context("spawn")
    done, results = ctx.Event(), ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        rendezvous = f"file://{tmp}/rendezvous"  # a file the receiver ranks meet at
        procs = [ctx.Process(target=sender_rank, args=(r, namespace, done)) for r in range(2)]
        procs += [
            ctx.Process(target=receiver_rank, args=(r, namespace, rendezvous, results))
            for r in range(RECEIVER_TP)
        ]
        for p in procs:
            p.start()
        got = sorted(results.get(timeout=180) for _ in range(RECEIVER_TP))
        done.set()
        for p in procs:
            p.join(timeout=60)
    for rank, ok, heads, same in got:
        print(f"receiver rank {rank}: received {ok}, heads {heads}, equal to the sender's: {same}")
    return 0 if all(same for *_, same in got) else 1


if __name__ == "__main__":
    raise SystemExit(main())
