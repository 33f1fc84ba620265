"""A consumer stage's step loop that never waits for KV: admit what is ready, keep the rest queued.

A stage after an LLM (a diffusion transformer, a talker) computes in steps with a few slots. Its
requests' KV comes from the previous stage in whatever order that stage finishes them, and some
never come (aborted upstream). Blocking on the next request in queue order (the seed API's
``receive_kv_cache``) stalls every step behind a late one. Instead, the stage offers its queued
requests once (``manager.admission.offer``); each step it asks which are ready
(``ready()``, ``poll()``: never wait) and takes those (``take``, exactly once).

Here stage 0 (another process) sends requests 5, 3, 1, 4, 2 in that order with a pause between
them and never sends request 6; stage 1 offers all six at once and runs 2-slot steps. Request 6
fails at its deadline, or as soon as stage 0 has left (``peer_gone``), whichever is first.

    python examples/admission_step_loop.py
"""

from __future__ import annotations

import multiprocessing as mp
import time
import uuid

import torch

from omnikv import OmniKVCacheConfig, OmniKVTransferManager

LAYERS, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 2, 8, 16, 2, 64
SEND_ORDER = ["req-5", "req-3", "req-1", "req-4", "req-2"]  # req-6 never comes
QUEUE = [f"req-{i}" for i in range(1, 7)]
SLOTS, STEP_S = 2, 0.05


def stage0(namespace: str) -> None:
    """The previous stage (another process): finishes requests out of order, one by one."""
    config = OmniKVCacheConfig(
        connector_config={"type": "SharedMemoryConnector", "namespace": namespace},
        from_stage="0",
        to_stage="1",
        need_send_cache=True,
    )
    with OmniKVTransferManager(config) as manager:
        for rid in SEND_ORDER:
            n = int(rid.split("-")[1])
            caches = [
                torch.full((2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM), float(n))
                for _ in range(LAYERS)
            ]
            manager.handle_finished_requests_kv_transfer(
                {rid: {"block_ids": [0, 1, 2, 3], "seq_len": 10 * n}}, caches, BLOCK_SIZE, "float32"
            )
            time.sleep(0.1)  # the previous stage's own work between two requests
        manager.flush(timeout=30)  # stay until stage 1 has taken what was sent


def main() -> int:
    namespace = f"admission-{uuid.uuid4().hex[:8]}"
    sender = mp.get_context("spawn").Process(target=stage0, args=(namespace,))
    sender.start()
    config = OmniKVCacheConfig(
        connector_config={"type": "SharedMemoryConnector", "namespace": namespace},
        from_stage="0",
        stage_id="1",
        need_recv_cache=True,
        # each request's deadline from its offer: room for stage 0's start on a busy host;
        # request 6 ends when stage 0 has left (peer_gone), well before
        recv_timeout=30.0,
    )
    with OmniKVTransferManager(config) as manager:
        admission = manager.admission
        admission.offer(QUEUE)  # every queued request, once; nothing waits
        running: dict[str, int] = {}  # request -> steps left
        done: list[str] = []
        failed: list[str] = []
        step = 0
        while len(done) + len(failed) < len(QUEUE):
            for rid in admission.ready():  # ended, in arrival order
                if len(running) == SLOTS:
                    break
                result = admission.take(rid)
                if result is None:
                    continue
                if not result.ok:
                    failed.append(f"{rid} ({result.status.value})")
                    continue
                tokens = result.kv.key_cache[0].shape[0] if result.kv is not None else 0
                print(f"step {step}: admitted {rid} ({tokens} tokens of KV)")
                running[rid] = 2  # two steps of compute per request
            if running:
                time.sleep(STEP_S)  # the step's compute on the admitted requests
                step += 1
                for rid in list(running):
                    running[rid] -= 1
                    if running[rid] == 0:
                        del running[rid]
                        done.append(rid)
            else:
                time.sleep(0.005)  # nothing ready: idle, and no step waited on a receive
    sender.join(60)
    print(f"completed in arrival order: {done}")
    print(f"failed: {failed}")
    return 0 if len(done) == len(SEND_ORDER) and len(failed) == 1 else 1


if __name__ == "__main__":
    raise SystemExit(main())
