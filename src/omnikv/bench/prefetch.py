"""``omnikv bench prefetch``: a request loop with a simulated forward, prefetch on vs off.

Same run, same sender, same bytes. A sender *process* (its own ``OmniKVTransferManager`` on a
``SharedMemoryConnector``) sends every request's KV (``--mib`` MiB, crc32 on) before each loop
starts, so the loop measures the receive, not the sender's pace on a 2-core machine. The
receiving stage (this process) loops over the requests:

* **off**: ``consume_and_distribute_kv_cache`` (a synchronous receive: wait, crc32 check, copy
  out of the pool: R ms), then a simulated forward of ``--forward-ms`` (T ms, a sleep: a GPU
  forward leaves the CPU to the prefetch thread);
* **on**: the same, with ``start_prefetch`` of request ``i + 1`` right after request ``i``'s
  KV was consumed, as the model runner does, so the receive of ``i + 1`` overlaps forward ``i``.

Reported per request (printed) and as medians / p99 / spread: the KV wait (time spent in
``consume_and_distribute_kv_cache``) and the whole step. The ceiling is a step of exactly T
(R fully hidden); the reference path is the loop without prefetch (T + R). Target: with R <= T
at least 80% of R hidden, i.e. ``1 - wait_on / wait_off >= 0.8`` (medians). Every received
payload is checked against the value the sender wrote. Modes alternate over ``--rounds``, after
one discarded warm-up round of both (first touch of the pools) and ``--warmup`` discarded
leading requests per loop.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import signal
import statistics
import time
import uuid
from collections.abc import Sequence
from multiprocessing.connection import Connection
from types import SimpleNamespace
from typing import Any

import torch

from omnikv.bench.common import Stats, print_table, shm_stage_config, write_json

__all__ = ["main"]

SENDER_INFO = {"host": "127.0.0.1", "zmq_port": 0}
LAYERS, HEADS, DIM, BLOCK = 8, 8, 128, 16
_BYTES_PER_TOKEN = LAYERS * 2 * HEADS * DIM * 2  # fp16, key + value


def _tokens_for(mib: float) -> int:
    tokens = int(mib * (1 << 20) / _BYTES_PER_TOKEN)
    return max(BLOCK, tokens // BLOCK * BLOCK)


def _sender_main(conn: Connection, namespace: str, tokens: int, pool: int) -> None:
    """Child process: on ``("send", prefix, n)`` send ``n`` requests' KV, pool-bounded."""
    from omnikv import OmniKVTransferManager, TransferOptions
    from omnikv.transfer.edge import KVCaches

    mgr = OmniKVTransferManager(
        shm_stage_config(namespace, pool, to_stage="stage2", need_send_cache=True),
        options=TransferOptions(payload_checksum=True),
    )
    blocks = tokens // BLOCK
    caches: list[Any] = [
        torch.zeros(2, blocks, BLOCK, HEADS, DIM, dtype=torch.float16) for _ in range(LAYERS)
    ]
    conn.send(("ready", os.getpid()))
    while True:
        try:
            cmd = conn.recv()
        except EOFError:
            break
        if cmd[0] != "send":
            break
        _, prefix, n = cmd
        ok = True
        for i in range(n):
            for c in caches:
                c.fill_(float(i % 100))
            meta = {"block_ids": list(range(blocks)), "seq_len": tokens}
            rid = f"{prefix}-{i}"
            res = mgr.edge.send(rid, meta, KVCaches(caches, BLOCK, "torch.float16"))
            ok = ok and res.ok
        conn.send(("sent", ok))  # every payload is at the source before the loop starts
    mgr.close()


def _req(prefix: str, i: int) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=f"{prefix}-{i}", kv_sender_info=dict(SENDER_INFO), sampling_params=None
    )


def _check(req: SimpleNamespace, i: int, tokens: int) -> None:
    kv = req.past_key_values
    first = kv.key_cache[0]
    if first.shape[0] != tokens or float(first.flatten()[0]) != float(i % 100):
        raise SystemExit(f"verification failed for {req.request_id}")
    last = kv.value_cache[-1]
    if float(last.flatten()[-1]) != float(i % 100):
        raise SystemExit(f"verification failed for {req.request_id}")


def _loop(
    mgr: Any, prefix: str, n: int, forward_s: float, prefetch: bool, tokens: int
) -> tuple[list[float], list[float]]:
    """The receiving stage's loop; returns per-request (kv wait, step) in seconds."""
    waits, steps = [], []
    if prefetch:
        mgr.start_prefetch({"request_id": f"{prefix}-0", "kv_sender_info": dict(SENDER_INFO)})
    for i in range(n):
        req = _req(prefix, i)
        t0 = time.perf_counter()
        if not mgr.consume_and_distribute_kv_cache(req):
            raise SystemExit(
                f"no KV for {req.request_id}: {mgr.get_receive_result(req.request_id)}"
            )
        t1 = time.perf_counter()
        if prefetch and i + 1 < n:
            mgr.start_prefetch(
                {"request_id": f"{prefix}-{i + 1}", "kv_sender_info": dict(SENDER_INFO)}
            )
        _check(req, i, tokens)
        req.past_key_values = None
        time.sleep(max(0.0, forward_s - (time.perf_counter() - t1)))  # the simulated forward
        t2 = time.perf_counter()
        waits.append(t1 - t0)
        steps.append(t2 - t0)
    return waits, steps


def main(argv: Sequence[str] | None = None) -> int:
    """Run the prefetch benchmark; returns 0 when the hidden share of R meets the target."""
    parser = argparse.ArgumentParser(prog="omnikv bench prefetch", description=__doc__)
    parser.add_argument("--requests", type=int, default=16, help="requests per round and mode")
    parser.add_argument("--warmup", type=int, default=2, help="leading requests discarded")
    parser.add_argument("--rounds", type=int, default=2, help="off/on pairs, alternating")
    parser.add_argument("--forward-ms", type=float, default=40.0, help="simulated forward T")
    parser.add_argument("--mib", type=float, default=32.0, help="KV payload per request")
    parser.add_argument("--target", type=float, default=0.8, help="hidden share of R required")
    parser.add_argument("--quiet", action="store_true", help="no per-request lines")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    from omnikv import OmniKVTransferManager, TransferOptions

    tokens = _tokens_for(args.mib)
    nbytes = tokens * _BYTES_PER_TOKEN
    forward_s = args.forward_ms / 1e3
    n = args.requests + args.warmup
    pool = n * (nbytes + (1 << 20)) + (8 << 20)  # every request of a loop, put before it
    namespace = f"bench-prefetch-{uuid.uuid4().hex[:10]}"
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_sender_main, args=(child, namespace, tokens, pool), daemon=True)
    proc.start()
    child.close()
    samples: dict[str, tuple[list[float], list[float]]] = {"off": ([], []), "on": ([], [])}
    per_request: list[tuple[str, int, int, float, float]] = []
    try:
        if not parent.poll(60):
            raise SystemExit("sender process did not start")
        parent.recv()
        for rnd in range(-1, args.rounds):  # round -1: warm-up of both modes, discarded
            for mode in ("off", "on"):
                prefetch = mode == "on"
                prefix = f"r{rnd + 1}{mode}"
                mgr = OmniKVTransferManager(
                    shm_stage_config(
                        namespace,
                        pool,
                        stage_id="stage2",
                        need_recv_cache=True,
                        recv_timeout=30.0,
                        enable_kv_async_prefetch=prefetch,
                    ),
                    async_prefetch=prefetch,
                    options=TransferOptions(receive_copy="copy"),
                )
                parent.send(("send", prefix, n))
                if not parent.poll(120) or parent.recv() != ("sent", True):
                    raise SystemExit("sender reported a failed send")
                try:
                    waits, steps = _loop(mgr, prefix, n, forward_s, prefetch, tokens)
                finally:
                    mgr.close()
                if rnd < 0:
                    continue
                w, s = waits[args.warmup :], steps[args.warmup :]
                samples[mode][0].extend(w)
                samples[mode][1].extend(s)
                for i, (wi, si) in enumerate(zip(w, s, strict=True)):
                    per_request.append((mode, rnd, i, wi, si))
    finally:
        with contextlib.suppress(OSError):
            parent.send(("stop",))
        proc.join(5)
        if proc.is_alive() and proc.pid is not None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(5)

    if not args.quiet:
        print(f"\n{'mode':4} {'round':>5} {'req':>4} {'kv wait ms':>11} {'step ms':>9}")
        for mode, rnd, i, wi, si in per_request:
            print(f"{mode:4} {rnd:5d} {i:4d} {wi * 1e3:11.2f} {si * 1e3:9.2f}")
    off_w, off_s = (
        Stats("off: kv wait (R)", samples["off"][0], nbytes),
        Stats("off: step (T + R)", samples["off"][1]),
    )
    on_w, on_s = (
        Stats("on: kv wait", samples["on"][0], nbytes),
        Stats("on: step (~max(T, R))", samples["on"][1]),
    )
    ceiling = Stats("ceiling: step = T", [forward_s])
    mib = nbytes / (1 << 20)
    print_table(
        [off_w, on_w],
        title=f"KV wait per request ({mib:.1f} MiB, T = {args.forward_ms:.0f} ms, "
        f"{len(off_w.samples)} requests per mode)",
    )
    print_table([off_s, on_s, ceiling], baseline=off_s, title="Step per request")
    r = off_w.median
    hidden = 1.0 - on_w.median / r if r > 0 else 0.0
    saved = off_s.median - on_s.median
    print(
        f"\nR (median sync receive) = {r * 1e3:.2f} ms, T = {args.forward_ms:.1f} ms; "
        f"hidden share of R = {hidden:.1%} (target >= {args.target:.0%}); "
        f"step saved = {saved * 1e3:.2f} ms of R; on-step / T = {on_s.median / forward_s:.3f}; "
        f"mean kv wait on/off = {statistics.fmean(on_w.samples) * 1e3:.2f}/"
        f"{statistics.fmean(off_w.samples) * 1e3:.2f} ms"
    )
    ok = hidden >= args.target or r > forward_s
    if r > forward_s:
        print("R > T: the target applies only to R <= T (at most T of R can hide)")
    print("PASS" if ok else "FAIL")
    write_json(
        args.json,
        {
            "forward_ms": args.forward_ms,
            "payload_bytes": nbytes,
            "hidden_share": hidden,
            "rows": [st.as_dict() for st in (off_w, on_w, off_s, on_s)],
            "per_request": [
                {"mode": m, "round": rd, "i": i, "wait_s": w, "step_s": s}
                for m, rd, i, w, s in per_request
            ],
        },
    )
    return 0 if ok else 1
