"""``omnikv bench admission``: a consumer stage's step loop, blocking FIFO receive vs admission.

A consumer stage with ``--slots`` slots (default 4) runs a step loop: each step computes the
requests in its slots for ``--step-ms`` (a sleep: a GPU step leaves the CPU free); a request
leaves its slot after ``--steps`` steps. ``--requests`` requests (default 64) are queued in
order of arrival at the stage; two sender *processes* (each its own ``OmniKVTransferManager`` on
a ``SharedMemoryConnector``) publish their KV at scheduled times spread over ``--span-s`` (mixed
sizes, Qwen2.5-7B shapes: 1 to 4096 tokens, 56 KiB to 224 MiB), each request reaching the
stage's queue up to ``--lead-s`` before its KV; ``--missing`` of them (default 10%) arrive at
the stage but are never sent. Two modes on the same schedule:

* **fifo**: the reference's way, ``receive_kv_cache_result`` of the next queued request whenever
  a slot is free (blocking until its KV arrives or ``recv_timeout`` passes);
* **admission**: every request is offered once when it reaches the queue
  (``manager.admission``; its deadline counts from then); each step takes the ready ones into
  free slots and never waits.

Reported per mode: stalled steps (steps whose start waited more than 5 ms inside the KV calls:
more than a scheduler quantum or a GIL switch interval, which any call on a two-core host shared
with two sender processes may lose to preemption; a wait for a transfer is hundreds of ms), the
longest such wait, throughput (requests completed with their KV per second, from the start to
the last completion), and per-request wait from its KV's publication to its admission into a slot
(p50, p99), with the spread over ``--rounds`` (modes alternate, after a discarded warm-up round
of both). Every received payload is checked against the value its sender wrote. Targets:
admission has zero stalled steps and at least 1.5 x FIFO's throughput.
"""

from __future__ import annotations

import argparse
import random
import socket
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from omnikv.bench.common import (
    MODELS,
    JsonChannel,
    Stats,
    reap,
    serve_commands,
    shm_stage_config,
    write_json,
)

__all__ = ["main"]

MODEL = "qwen2.5-7b"
BLOCK = 16
#: Request sizes in tokens, and how many of every 32 requests have each (56 KiB .. 224 MiB).
SIZE_MIX: tuple[tuple[int, int], ...] = ((1, 10), (16, 8), (256, 7), (1024, 5), (4096, 2))
STALL_S = 5e-3
MIB = 1 << 20


def _bytes_per_token() -> int:
    layers, heads, dim = MODELS[MODEL]
    return layers * 2 * heads * dim * 2  # fp16, K and V


@dataclass
class Planned:
    """One request: its size, its sender, when it reaches the stage's queue and when its KV is
    published (``None``: never), seconds from the start."""

    rid: str
    tokens: int
    sender: int
    queued_s: float
    at_s: float | None
    fill: float


def plan_requests(n: int, missing: float, span_s: float, lead_s: float, seed: int) -> list[Planned]:
    """The schedule both modes share, in queue order: sizes from :data:`SIZE_MIX`, publication
    times uniform in ``[0, span_s]``, each request queued up to ``lead_s`` before its KV;
    ``missing`` of them queued at a uniform time and never published."""
    rnd = random.Random(seed)
    sizes = [t for t, k in SIZE_MIX for _ in range(k)]
    never = set(rnd.sample(range(n), round(n * missing)))
    out = []
    for i in range(n):
        tokens = sizes[rnd.randrange(len(sizes))]
        if i in never:
            at, queued = None, rnd.uniform(0.0, span_s)
        else:
            at = rnd.uniform(0.0, span_s)
            queued = max(0.0, at - rnd.uniform(0.0, lead_s))
        out.append(Planned(f"q{i}", tokens, i % 2, queued, at, float(i + 1)))
    out.sort(key=lambda p: p.queued_s)
    return out


# -- sender (child process) ----------------------------------------------------------------------
def _sender(fd: int, namespace: str, pool: int) -> int:
    """Child: ``["run", prefix, t0, [[rid, tokens, at_s, fill], ...]]`` publishes each request's
    KV at ``t0 + at_s`` (``CLOCK_MONOTONIC``, one clock for the node) and answers
    ``["sent", {rid: t_published}]``."""
    from omnikv import OmniKVTransferManager
    from omnikv.transfer.edge import KVCaches

    layers, heads, dim = MODELS[MODEL]
    max_blocks = max(t for t, _ in SIZE_MIX) // BLOCK
    caches: list[Any] = [
        torch.zeros(2, max_blocks, BLOCK, heads, dim, dtype=torch.float16) for _ in range(layers)
    ]
    mgr = OmniKVTransferManager(
        shm_stage_config(namespace, pool, to_stage="stage2", need_send_cache=True)
    )
    chan = JsonChannel(socket.socket(fileno=fd))

    def run(prefix: str, t0: float, items: list[list[Any]]) -> list[Any]:
        published: dict[str, float] = {}
        for rid, tokens, at_s, fill in sorted(items, key=lambda x: float(x[2])):
            time.sleep(max(0.0, t0 + at_s - time.monotonic()))
            for c in caches:
                c[0, 0, 0, 0, 0] = fill  # token 0 of K: the receiver checks it
            blocks = -(-int(tokens) // BLOCK)
            meta = {"block_ids": list(range(blocks)), "seq_len": int(tokens)}
            key = f"{prefix}-{rid}"
            res = mgr.edge.send(key, meta, KVCaches(caches, BLOCK, "torch.float16"))
            if not res.ok:
                raise RuntimeError(f"send of {key} failed: {res}")
            published[rid] = time.monotonic()
        return ["sent", published]

    chan.send("ready")
    try:
        serve_commands(chan, {"run": run})
    finally:
        mgr.close()
        chan.close()
    return 0


# -- the consumer's step loop ----------------------------------------------------------------------
@dataclass
class LoopResult:
    mode: str
    completed: int = 0
    failed: int = 0
    steps: int = 0
    stalled: int = 0
    stalled_s: float = 0.0
    #: the longest time one turn of the loop spent inside the KV calls
    max_api_s: float = 0.0
    wall_s: float = 0.0
    #: rid -> when it entered a slot (monotonic)
    admitted: dict[str, float] = field(default_factory=dict)
    #: rid -> when its receive began: the fifo call, the admission offer (monotonic)
    asked: dict[str, float] = field(default_factory=dict)
    #: rid -> why it failed (status and reason, as the receive reported them)
    failures: dict[str, str] = field(default_factory=dict)
    waits_s: list[float] = field(default_factory=list)
    bad: list[str] = field(default_factory=list)

    @property
    def wait_p50_p99(self) -> tuple[float, float]:
        """Median and p99 of the waits (:class:`Stats`, as every bench); NaN without any."""
        if not self.waits_s:
            return float("nan"), float("nan")
        waits = Stats("wait", self.waits_s)
        return waits.median, waits.p99

    @property
    def throughput(self) -> float:
        return self.completed / self.wall_s if self.wall_s > 0 else 0.0


def _failed(result: Any, p: Planned, out: LoopResult) -> None:
    """Count ``p`` as failed with the receive's own account of why."""
    out.failed += 1
    out.failures[p.rid] = f"{result.status.value}: {result.reason} (waited {result.waited_s:.2f} s)"


def _check(result: Any, p: Planned, out: LoopResult) -> bool:
    kv = result.kv
    first = kv.key_cache[0] if kv is not None else None
    if first is None or first.shape[0] != p.tokens or float(first.flatten()[0]) != p.fill:
        out.bad.append(p.rid)
        return False
    return True


def run_loop(
    mgr: Any,
    mode: str,
    plan: list[Planned],
    prefix: str,
    *,
    start: float,
    slots: int,
    step_s: float,
    steps_per_request: int,
) -> LoopResult:
    """One mode's step loop over ``plan`` (requests named ``prefix-rid``) until every request
    has completed or failed."""
    out = LoopResult(mode)
    by_key = {f"{prefix}-{p.rid}": p for p in plan}
    arrivals = list(by_key)  # in queue order (plan is sorted by queued_s)
    queue: list[str] = []
    running: dict[str, int] = {}  # key -> steps left
    held: dict[str, Any] = {}
    adm = mgr.admission if mode == "admission" else None
    pending = len(arrivals)
    while pending:
        now = time.monotonic() - start
        in_api = 0.0  # this step's time inside the KV calls (bench checks not included)
        while arrivals and by_key[arrivals[0]].queued_s <= now:  # requests reach the queue
            key = arrivals.pop(0)
            if adm is not None:
                t_api = time.monotonic()
                out.asked[by_key[key].rid] = t_api
                adm.offer(key)
                in_api += time.monotonic() - t_api
            else:
                queue.append(key)
        if adm is None:
            while queue and len(running) < slots:
                key = queue.pop(0)
                t_api = time.monotonic()
                out.asked[by_key[key].rid] = t_api
                res = mgr.receive_kv_cache_result(key, quiet=True)
                in_api += time.monotonic() - t_api
                if res.ok and _check(res, by_key[key], out):
                    running[key] = steps_per_request
                    out.admitted[by_key[key].rid] = time.monotonic()
                    held[key] = res
                else:
                    _failed(res, by_key[key], out)
                    pending -= 1
        else:
            t_api = time.monotonic()
            ready = adm.ready()
            in_api += time.monotonic() - t_api
            for key in ready:
                if len(running) >= slots:
                    break
                t_api = time.monotonic()
                res = adm.take(key)
                in_api += time.monotonic() - t_api
                if res is not None and res.ok and _check(res, by_key[key], out):
                    running[key] = steps_per_request
                    out.admitted[by_key[key].rid] = time.monotonic()
                    held[key] = res
                elif res is not None:
                    _failed(res, by_key[key], out)
                    pending -= 1
        out.max_api_s = max(out.max_api_s, in_api)
        if running:
            out.steps += 1
            if in_api > STALL_S:
                out.stalled += 1
                out.stalled_s += in_api
            time.sleep(step_s)  # the step's compute
            for key in list(running):
                running[key] -= 1
                if running[key] == 0:
                    del running[key]
                    held.pop(key, None)  # the request is done with its KV
                    out.completed += 1
                    pending -= 1
        else:
            time.sleep(0.0005)  # nothing ready and nothing to compute: idle, not stalled
    out.wall_s = time.monotonic() - start
    return out


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="omnikv bench admission",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--requests", type=int, default=64, help="requests per round and mode")
    p.add_argument("--missing", type=float, default=0.1, help="share of requests never sent")
    p.add_argument("--slots", type=int, default=4, help="requests decoding at once")
    p.add_argument("--step-ms", type=float, default=20.0, help="simulated compute per step")
    p.add_argument("--steps", type=int, default=3, help="steps a request stays in its slot")
    p.add_argument("--span-s", type=float, default=2.0, help="publications spread over this")
    p.add_argument("--lead-s", type=float, default=0.25, help="queued at most this before KV")
    p.add_argument("--recv-timeout", type=float, default=1.0, help="receiver's recv_timeout (s)")
    p.add_argument("--rounds", type=int, default=2, help="fifo/admission pairs, alternating")
    p.add_argument("--max-tokens", type=int, default=4096, help="largest request (tokens)")
    p.add_argument("--seed", type=int, default=0, help="seed of the arrival order")
    p.add_argument("--no-targets", action="store_true", help="report missed targets, exit 0")
    p.add_argument("--json", default=None, help="write results to this file")
    p.add_argument("--role", default="main", help=argparse.SUPPRESS)
    p.add_argument("--fd", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--namespace", default="", help=argparse.SUPPRESS)
    p.add_argument("--pool", type=int, default=0, help=argparse.SUPPRESS)
    return p.parse_args(list(argv))


def main(argv: Sequence[str] | None = None) -> int:
    """Run both modes, print the table and the targets; 0 when the targets are met (or
    ``--no-targets``), 1 otherwise; a verification failure exits non-zero."""
    ns = _parse(sys.argv[1:] if argv is None else argv)
    if ns.role == "sender":
        return _sender(ns.fd, ns.namespace, ns.pool)
    from omnikv import OmniKVTransferManager

    plan = plan_requests(ns.requests, ns.missing, ns.span_s, ns.lead_s, ns.seed)
    for p in plan:
        p.tokens = min(p.tokens, ns.max_tokens)
    per_sender = [sum(p.tokens for p in plan if p.sender == s) for s in (0, 1)]
    pool = max(per_sender) * _bytes_per_token() + len(plan) * 2 * MIB + 64 * MIB
    namespace = f"bench-admission-{uuid.uuid4().hex[:10]}"
    chans: list[JsonChannel] = []
    procs: list[subprocess.Popen[bytes]] = []
    results: dict[str, list[LoopResult]] = {"fifo": [], "admission": []}
    try:
        for _ in (0, 1):
            parent, child = socket.socketpair()
            cmd = [sys.executable, "-m", "omnikv.cli", "bench", "admission", "--role", "sender"]
            cmd += ["--fd", str(child.fileno()), "--namespace", namespace, "--pool", str(pool)]
            procs.append(subprocess.Popen(cmd, pass_fds=[child.fileno()]))
            child.close()
            chans.append(JsonChannel(parent))
        for chan in chans:
            chan.expect("ready", 120)
        for rnd in range(-1, ns.rounds):  # round -1: warm-up of both modes, discarded
            for mode in ("fifo", "admission"):
                prefix = f"r{rnd + 1}{mode[0]}"
                mgr = OmniKVTransferManager(
                    shm_stage_config(
                        namespace,
                        pool,
                        stage_id="stage2",
                        need_recv_cache=True,
                        recv_timeout=ns.recv_timeout,
                    )
                )
                t0 = time.monotonic() + 0.2
                for s, chan in enumerate(chans):
                    items = [
                        [p.rid, p.tokens, p.at_s, p.fill]
                        for p in plan
                        if p.sender == s and p.at_s is not None
                    ]
                    chan.send("run", prefix, t0, items)
                try:
                    time.sleep(max(0.0, t0 - time.monotonic()))
                    got = run_loop(
                        mgr,
                        mode,
                        plan,
                        prefix,
                        start=t0,
                        slots=ns.slots,
                        step_s=ns.step_ms / 1e3,
                        steps_per_request=ns.steps,
                    )
                    published: dict[str, float] = {}
                    for chan in chans:
                        published.update(chan.expect("sent", 300)[1])
                finally:
                    mgr.close()
                if got.bad:
                    raise SystemExit(f"verification failed for {got.bad[:5]}")
                for rid in got.failures:  # a sent one that failed: when it came, seen from the ask
                    if rid in published and rid in got.asked:
                        late = published[rid] - got.asked[rid]
                        got.failures[rid] += f"; published {late:+.2f} s from the ask"
                got.waits_s = [
                    max(0.0, t - published[rid])
                    for rid, t in got.admitted.items()
                    if rid in published
                ]
                if rnd >= 0:
                    results[mode].append(got)
    finally:
        for proc, chan in zip(procs, chans, strict=False):
            reap(proc, chan)
    return _report(ns, plan, results)


def _report(
    ns: argparse.Namespace, plan: list[Planned], results: dict[str, list[LoopResult]]
) -> int:
    sent = sum(p.at_s is not None for p in plan)
    total = sum(p.tokens for p in plan if p.at_s is not None) * _bytes_per_token()
    print(
        f"{len(plan)} requests ({sent} sent, {len(plan) - sent} never), "
        f"{total / MIB:.0f} MiB in all, {ns.slots} slots, step {ns.step_ms:.0f} ms x "
        f"{ns.steps}, recv_timeout {ns.recv_timeout:.1f} s, {ns.rounds} round(s) per mode"
    )
    print(
        f"\n{'mode':10} {'round':>5} {'req/s':>7} {'steps':>6} {'stalled':>8} {'stall s':>8} "
        f"{'max in KV ms':>13} {'wait p50 ms':>12} {'wait p99 ms':>12} {'done':>5} {'failed':>7}"
    )
    for mode, rows in results.items():
        for i, r in enumerate(rows):
            print(
                f"{mode:10} {i:5d} {r.throughput:7.2f} {r.steps:6d} {r.stalled:8d} "
                f"{r.stalled_s:8.2f} {r.max_api_s * 1e3:13.2f} "
                f"{r.wait_p50_p99[0] * 1e3:12.1f} {r.wait_p50_p99[1] * 1e3:12.1f} "
                f"{r.completed:5d} {r.failed:7d}"
            )
    fifo_tp = statistics.median(r.throughput for r in results["fifo"])
    adm_tp = statistics.median(r.throughput for r in results["admission"])
    ratio = adm_tp / fifo_tp if fifo_tp > 0 else float("inf")
    stalled = max(r.stalled for r in results["admission"])
    ratios = [
        a.throughput / f.throughput
        for f, a in zip(results["fifo"], results["admission"], strict=True)
        if f.throughput > 0
    ]
    for mode, rows in results.items():
        for i, r in enumerate(rows):
            for rid, why in r.failures.items():
                print(f"{mode} round {i}: {rid} failed: {why}")
    print(
        f"\nthroughput admission / fifo = {ratio:.2f} x (median; per round "
        f"{', '.join(f'{x:.2f}' for x in ratios)}); stalled steps with admission = {stalled}"
    )
    targets = [
        ("admission: zero stalled steps", f"{stalled}", stalled == 0),
        ("admission throughput >= 1.5 x fifo", f"{ratio:.2f}", ratio >= 1.5),
    ]
    print("\nTargets")
    for name, value, ok in targets:
        print(f"  {'PASS' if ok else 'FAIL'}  {name}: {value}")
    write_json(
        ns.json,
        {
            "bench": "admission",
            "never_sent": [p.rid for p in plan if p.at_s is None],
            "ratio": ratio,
            "admission_stalled_steps": stalled,
            "rounds": {
                mode: [
                    {
                        "throughput": r.throughput,
                        "steps": r.steps,
                        "stalled": r.stalled,
                        "stalled_s": r.stalled_s,
                        "max_in_kv_calls_s": r.max_api_s,
                        "wait_p50_s": r.wait_p50_p99[0],
                        "wait_p99_s": r.wait_p50_p99[1],
                        "completed": r.completed,
                        "failed": r.failed,
                        "failures": r.failures,
                    }
                    for r in rows
                ]
                for mode, rows in results.items()
            },
        },
    )
    met = all(ok for _, _, ok in targets)
    return 0 if met or ns.no_targets else 1
