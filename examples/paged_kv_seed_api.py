"""The seed API with a paged KV cache: one stage sends a finished request, another receives it.

The sending stage holds its KV cache in pages (blocks), as vLLM does: per layer one tensor
``[2, num_blocks, block_size, kv_heads, head_dim]`` (K and V). When a request finishes its
prefill, ``handle_finished_requests_kv_transfer`` gathers the request's blocks, cut to its
``seq_len`` tokens, and sends them. The receiving stage, another process, calls
``receive_kv_cache(request)``, which sets ``request.past_key_values`` (``key_cache`` /
``value_cache``: one ``[seq_len, kv_heads, head_dim]`` tensor per layer) and
``request.kv_metadata``. Shared memory carries the bytes, so both stages run on one host.

    python examples/paged_kv_seed_api.py
"""

from __future__ import annotations

import multiprocessing as mp
import uuid
from types import SimpleNamespace
from typing import Any

import torch

from omnikv import OmniKVCacheConfig, OmniKVTransferManager

LAYERS, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 4, 16, 16, 2, 64
BLOCK_IDS, SEQ_LEN = [7, 2, 11], 40  # the request's 40 tokens sit in these blocks, in order


def paged_cache() -> list[torch.Tensor]:
    """The sender's paged cache (seeded, so the receiver can rebuild it to check the result)."""
    g = torch.Generator().manual_seed(0)
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    return [torch.randn(shape, generator=g) for _ in range(LAYERS)]


def expected_tokens(cache: torch.Tensor, which: int) -> torch.Tensor:
    """One layer's K (``which`` 0) or V (1) as the receiver should get it: the request's
    blocks, in order, cut to its length."""
    return torch.cat([cache[which, b] for b in BLOCK_IDS])[:SEQ_LEN]


def receiver(namespace: str, results: mp.Queue[dict[str, Any]]) -> None:
    """Stage 1 (another process): receive the request's KV onto the request object."""
    config = OmniKVCacheConfig(
        connector_config={"type": "SharedMemoryConnector", "namespace": namespace},
        from_stage="0",  # receives from stage 0 ...
        stage_id="1",  # ... as stage 1
        need_recv_cache=True,
        recv_timeout=60.0,
    )
    with OmniKVTransferManager(config) as manager:
        request = SimpleNamespace(request_id="req-0", sampling_params=SimpleNamespace())
        ok = manager.receive_kv_cache(request)  # waits up to recv_timeout; False on a miss
        if not ok:
            results.put({"ok": False, "why": manager.get_receive_result("req-0")})
            return
        kv = request.past_key_values  # also at request.sampling_params.past_key_values
        same = all(
            torch.equal(kv.key_cache[i], expected_tokens(c, 0))
            and torch.equal(kv.value_cache[i], expected_tokens(c, 1))
            for i, c in enumerate(paged_cache())
        )
        results.put(
            {
                "ok": True,
                "shape": list(kv.key_cache[0].shape),
                "metadata": request.kv_metadata,
                "same": same,
            }
        )


def main() -> int:
    namespace = f"paged-{uuid.uuid4().hex[:8]}"
    ctx = mp.get_context("spawn")
    results: mp.Queue[dict[str, Any]] = ctx.Queue()
    stage1 = ctx.Process(target=receiver, args=(namespace, results))
    stage1.start()

    # Stage 0 (this process): the request finished its prefill; send its KV.
    config = OmniKVCacheConfig(
        connector_config={"type": "SharedMemoryConnector", "namespace": namespace},
        from_stage="0",
        to_stage="1",
        need_send_cache=True,
    )
    with OmniKVTransferManager(config) as manager:
        finished = {
            "req-0": {
                "block_ids": BLOCK_IDS,
                "seq_len": SEQ_LEN,
                "custom_metadata": {"prompt": "a cat"},  # travels with the KV
            }
        }
        done = manager.handle_finished_requests_kv_transfer(
            finished, paged_cache(), BLOCK_SIZE, "float32"
        )
        # ``done`` lists every request whose blocks may be freed now; did the send succeed?
        sent = manager.get_send_result("req-0")
        print(f"stage 0: {done} handled, send {sent.status.value if sent else 'not attempted'}")
        got = results.get(timeout=120)  # stay alive until stage 1 has taken the KV
    stage1.join(timeout=30)
    if not got["ok"]:
        print(f"stage 1: no KV: {got['why']}")
        return 1
    print(f"stage 1: per layer K and V of shape {got['shape']}, metadata {got['metadata']}")
    print(f"stage 1: KV equals the sender's blocks: {got['same']}")
    return 0 if got["same"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
