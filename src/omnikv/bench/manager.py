"""``omnikv bench manager``: paged KV through two managers in two processes over shared memory.

The sender stage (this process) calls ``handle_finished_requests_kv_transfer`` on a paged KV
cache; the receiver stage (a child process started here, killed by PID at the end) is already
blocked in ``receive_kv_cache_for_request`` for that request. A sample is the time from the send
call to the moment the receiver holds the decoded KV, on ``CLOCK_MONOTONIC`` (one clock per node).
The sender calls as soon as the receiver said it is waiting, as ``bench shm`` does (``--gap-ms``
idles first); both processes freeze their start-up heap once set up, as vLLM's engine core does
(``--no-gc-freeze`` does not); ``--poll-us N`` sets the receiver connector's ``poll_us``;
``--torch-threads N`` torch's intra-op threads in both processes (1 by default). Per
case it also prints the medians of the phases (the sender's call: extract, encode + put; the
receiver's call after its wait) and each process's CPU time per steady-state request (every
thread, from each one's CPU clock; the receiver's data checks excluded), with its ratio to the
CPU time of one memcpy of the payload (target for 224 MiB: at most 1.3 x on each side).

Cases, each on a *fresh* pair of managers (new namespace, new connectors), so the first request
is a real first request (pool creation, connection, mapping):

* **224 MiB**: Qwen2.5-7B shape (28 layers, 4 KV heads, dim 128, fp16), 4096 tokens, block 16;
* **64 KiB**: 2 layers, 2 KV heads, dim 64, fp16, 64 tokens (targets: p50 <= 0.5 ms, p99 <= 2 ms);
* **memcpy** of each payload's size in the same run (aligned, pre-faulted: the ceiling);
* **the receiver already waiting** (64 KiB; ``--wait-iters`` samples per gap, 200): the put comes
  ``--wait-gaps-ms`` (2 and 20) after the receiver entered its receive call, past any spin, as
  in a stage whose receiver waits for the previous stage. Each sample alternates with the floor:
  a bare eventfd wake-up between the same two processes at the same gap. Printed with the
  steady case and the medians of the phases of one receive (send call to put done; put done to
  the receiver's wait end, i.e. the wake-up; decode; finish: checks and the verdict; the seed's
  dict), and the host's idle penalty: two fixed pieces of pure Python (a tight loop, and
  scattered reads over a few MiB of objects) timed back to back and after idling the same gap,
  alternated, once every gap's requests are done. Then an idle receiver's CPU over
  ``--idle-s`` seconds (10) of waiting for KV that never comes (targets: p50 <= 0.4 ms,
  p99 <= 1 ms at each gap).

The sender stage declares the case's payload size (``expected_payload_bytes``), so its pool's
start-up reserve (``prefault: "auto"``) is sized for it (``--prefault-mib`` sets it instead in
the 224 MiB case). Before the first request the sender waits (polling ``health()``, bounded)
until that reserve is populated, as it would be in a stage that loads a model first; how long
that took in the background is printed. Reported
per case: the first request, then steady state (median, spread, p99), and the sender's RSS at
the first request (its shared-memory part: the populated pool). Data is verified
on the receiver against caches it rebuilds from the same seed (first, last and every 64 KiB
sample). ``--profile`` adds a cProfile breakdown of steady-state 64 KiB requests on both sides;
``--plot FILE`` writes a PNG of the steady-state latency and bandwidth against payload size, next
to the memcpy of each size.
The control channel is a socketpair carrying JSON lines (no pickle).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import math
import os
import pstats
import random
import socket
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from omnikv.bench.common import (
    JsonChannel,
    Stats,
    bounded_list,
    print_table,
    reap,
    write_json,
)
from omnikv.bench.plot import add_plot_option, require_plot, write_plot

__all__ = ["main"]

MIB = 1 << 20
BLOCK = 16


@dataclass
class _Phases:
    """Per-sample phase figures of the current case (warm-up included; the report skips it)."""

    send_call_s: list[float] = field(default_factory=list)  # handle_finished_... duration
    extract_ms: list[float] = field(default_factory=list)  # sender: plan and gather set-up
    encode_put_ms: list[float] = field(default_factory=list)  # sender: pack into the pool + put
    after_wait_ms: list[float] = field(default_factory=list)  # receiver: its call after the wait
    #: each process's CPU clock (every thread, s; the receiver's less its data checks) when a
    #: sample ended: the difference over the steady samples is their CPU
    tx_cpu_s: list[float] = field(default_factory=list)
    rx_cpu_s: list[float] = field(default_factory=list)

    def clear(self) -> None:
        for samples in (
            self.send_call_s,
            self.extract_ms,
            self.encode_put_ms,
            self.after_wait_ms,
            self.tx_cpu_s,
            self.rx_cpu_s,
        ):
            samples.clear()

    def cpu_per_request(self, skip: int) -> tuple[float, float]:
        """(sender, receiver) CPU seconds per sample after the first ``skip`` samples: each
        process's CPU clock from the end of sample ``skip - 1`` to the end of the last one,
        every thread (the background ones too), the receiver's data checks excluded."""
        n = len(self.tx_cpu_s) - skip
        if skip < 1 or n < 1:
            return float("nan"), float("nan")
        return (
            (self.tx_cpu_s[-1] - self.tx_cpu_s[skip - 1]) / n,
            (self.rx_cpu_s[-1] - self.rx_cpu_s[skip - 1]) / n,
        )

    def summary(self, skip: int) -> str:
        def med(xs: list[float], scale: float = 1.0) -> float:
            kept = sorted(xs[skip:])
            return kept[len(kept) // 2] * scale if kept else float("nan")

        return (
            f"sender's call {med(self.send_call_s, 1e3):.3f} ms (extract"
            f" {med(self.extract_ms):.3f}, encode + put {med(self.encode_put_ms):.3f}), receiver"
            f" after its wait {med(self.after_wait_ms):.3f} ms; the rest of a sample is the"
            " receiver's wake-up"
        )


_PHASES = _Phases()


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    heads: int
    dim: int
    tokens: int

    @property
    def blocks(self) -> int:
        return -(-self.tokens // BLOCK)

    @property
    def nbytes(self) -> int:
        return 2 * self.layers * self.heads * self.dim * self.tokens * 2


SHAPES = {
    "224MiB": Shape("224 MiB (Qwen2.5-7B, 4096 tokens)", 28, 4, 128, 4096),
    "64KiB": Shape("64 KiB paged", 2, 2, 64, 64),
}


def _caches(shape: Shape) -> list[torch.Tensor]:
    """Paged fp16 KV per layer ``[2, blocks, BLOCK, heads, dim]`` from a fixed seed."""
    g = torch.Generator().manual_seed(1234)
    return [
        torch.randn(2, shape.blocks, BLOCK, shape.heads, shape.dim, generator=g).half()
        for _ in range(shape.layers)
    ]


def _config(
    namespace: str,
    role: str,
    pool: int,
    prefault: int | str = "auto",
    poll_us: int | None = None,
    expected: int = 0,
) -> Any:
    from omnikv import OmniKVCacheConfig

    conn: dict[str, Any] = {
        "type": "SharedMemoryConnector",
        "namespace": namespace,
        "pool_size_bytes": pool,
    }
    if role == "sender":
        return OmniKVCacheConfig(
            # the stage declares what it sends: the "auto" reserve is sized for it
            connector_config={
                **conn,
                "linger_s": 0,
                "prefault": prefault,
                "expected_payload_bytes": expected,
            },
            from_stage="0",
            to_stage="1",
            need_send_cache=True,
        )
    return OmniKVCacheConfig(
        connector_config=conn if poll_us is None else {**conn, "poll_us": poll_us},
        from_stage="0",
        stage_id="1",
        need_recv_cache=True,
        recv_timeout=60.0,
    )


def _verify(data: dict[str, Any] | None, caches: list[torch.Tensor], shape: Shape) -> bool:
    if data is None:
        return False
    keys, values = data["layer_blocks"]["key_cache"], data["layer_blocks"]["value_cache"]
    for layer, kv in enumerate(caches):
        want_k = kv[0].reshape(-1, shape.heads, shape.dim)[: shape.tokens]
        want_v = kv[1].reshape(-1, shape.heads, shape.dim)[: shape.tokens]
        if not (torch.equal(keys[layer], want_k) and torch.equal(values[layer], want_v)):
            return False
    return True


# -- receiver (child process) ------------------------------------------------------------------
def _receiver(fd: int, efd: int) -> int:
    """Child: ``[new, ns, shape, pool, freeze, poll_us]`` builds a manager; ``[recv, rid,
    verify]`` receives (answering ``[waiting, t]`` as it enters the call, then ``[t_got, ok,
    after_wait_ms, t_call, timings_ms]``); ``[floor]`` blocks on the eventfd ``efd`` (answering
    ``[waiting, t]``, then the time it woke); ``[profile, on|off]``; ``stop``."""
    from omnikv import OmniKVTransferManager

    chan = JsonChannel(socket.socket(fileno=fd))
    mgr: Any = None
    caches: list[torch.Tensor] = []
    shape = SHAPES["64KiB"]
    prof: cProfile.Profile | None = None
    checks_cpu = 0.0  # CPU spent verifying received data (the bench's, not the receive's)
    chan.send("ready")
    while True:
        msg = chan.recv()
        if msg[0] == "stop":
            break
        if msg[0] == "new":
            if mgr is not None:
                mgr.close()
            shape = SHAPES[msg[2]]
            caches = _caches(shape)
            mgr = OmniKVTransferManager(_config(msg[1], "receiver", int(msg[3]), poll_us=msg[5]))
            _ = mgr.connector  # a started stage has its connector before any KV arrives
            _settle_heap(bool(msg[4]))
            chan.send("ok")
        elif msg[0] == "profile":
            prof = cProfile.Profile() if msg[1] == "on" else prof
            chan.send("ok", _stats_text(prof) if msg[1] == "off" else "")
            prof = None if msg[1] == "off" else prof
        elif msg[0] == "idle":
            chan.send("ok", _idle_cpu_s(mgr, float(msg[1])))
        elif msg[0] == "floor":
            chan.send("waiting", time.monotonic())
            os.eventfd_read(efd)  # blocks until the sender writes it
            chan.send(time.monotonic())
        else:
            if prof is not None:
                prof.enable()
            t_call = time.monotonic()
            chan.send("waiting", t_call)
            data, _size = mgr.receive_kv_cache_for_request(msg[1])
            t = time.monotonic()
            if prof is not None:
                prof.disable()
            c0 = time.process_time()
            ok = _verify(data, caches, shape) if msg[2] else data is not None
            checks_cpu += time.process_time() - c0
            del data
            result = mgr.get_receive_result(msg[1])
            timings = dict(getattr(result, "timings_ms", None) or {})
            cpu = time.process_time() - checks_cpu
            chan.send(t, ok, _after_wait_ms(timings, t - t_call), t_call, timings, cpu)
    if mgr is not None:
        mgr.close()
    return 0


def _idle_cpu_s(mgr: Any, seconds: float) -> list[float]:
    """A receiver waiting ``seconds`` for KV that never comes: (wall s, CPU s of this whole
    process, every thread) over that wait, which ends at its deadline as a ``timeout``."""
    wall0, cpu0 = time.monotonic(), time.process_time()  # ns resolution, not clock ticks
    mgr.receive_kv_cache_result(f"never-{uuid.uuid4().hex[:8]}", deadline=wall0 + seconds)
    return [time.monotonic() - wall0, time.process_time() - cpu0]


def _settle_heap(freeze: bool) -> None:
    """What a vLLM stage does once it has started (``freeze_gc_heap`` in its engine core):
    collect, then freeze the start-up heap so that later collections do not walk it."""
    if freeze:
        gc.collect()
        gc.freeze()


def _after_wait_ms(timings: dict[str, float], call_s: float) -> float:
    """How long the receiver's call ran after its connector wait ended (decode, the seed's dict,
    bookkeeping): the call's duration minus the wait in the receive result's phase timings."""
    return call_s * 1e3 - float(timings.get("wait_ms", 0.0))


def _stats_text(prof: cProfile.Profile | None, top: int = 18) -> str:
    if prof is None:
        return ""
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


# -- sender (this process) ---------------------------------------------------------------------
def _rss_mib(field: str = "VmRSS") -> float:
    """This process's resident memory (``RssShmem``: its shared-memory part) in MiB."""
    with open("/proc/self/status", encoding="utf-8") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


def _await_reserve(mgr: Any, timeout: float = 60.0) -> dict[str, float]:
    """A started stage: wait until the sender connector's start-up reserve is populated.

    Polls ``health()`` (``pool_reserve_ready``) until it is or ``timeout`` passes (the first
    request then pays for the rest). Returns ``reserve_mib``, ``reserve_wait_s`` (waited here)
    and ``reserve_s`` (how long it took in the background; -1: not ready)."""
    t0 = time.monotonic()
    health: dict[str, Any] = {}
    while time.monotonic() - t0 < timeout:
        health = mgr.connector.health()
        if health.get("pool_reserve_ready", True) or "failed" in health.get("pool_prefault", ""):
            break
        time.sleep(0.005)  # a stage's start-up (model load) is what really fills this time
    took = health.get("pool_reserve_s")
    return {
        "reserve_mib": health.get("pool_reserve_bytes", 0) / MIB,
        "reserve_wait_s": time.monotonic() - t0,
        "reserve_s": -1.0 if took is None else float(took),
    }


def _run_case(
    args: argparse.Namespace, chan: JsonChannel, key: str, iters: int
) -> tuple[float, Stats, dict[str, float], list[str]]:
    """(first request s, steady-state stats, start-up and memory figures, fails)."""
    from omnikv import OmniKVTransferManager

    shape = SHAPES[key]
    pool = args.pool_mib * MIB if key == "64KiB" else 2 * shape.nbytes + 16 * MIB
    namespace = f"bench-mgr-{uuid.uuid4().hex[:10]}"
    caches = _caches(shape)
    chan.send("new", namespace, key, pool, not args.no_gc_freeze, args.poll_us)
    chan.expect("ok")
    prefault: int | str = "auto"
    if key == "224MiB" and args.prefault_mib:
        prefault = args.prefault_mib * MIB
    mgr = OmniKVTransferManager(_config(namespace, "sender", pool, prefault, None, shape.nbytes))
    _settle_heap(not args.no_gc_freeze)
    # a stage starts well before its first request: its pool is prepared meanwhile
    mem = _await_reserve(mgr)
    samples: list[float] = []
    failures: list[str] = []
    first = 0.0
    _PHASES.clear()
    try:
        for i in range(1 + args.warmup + iters):
            rss0 = _rss_mib() if i == 0 else 0.0
            t0, t_got, ok = _one(
                chan, mgr, caches, shape, rid=f"{key}-{i}", i=i, n=iters, gap_ms=args.gap_ms
            )
            if not ok:
                failures.append(f"{key} sample {i}")
            if i == 0:
                first = t_got - t0
                mem.update(
                    rss_mib=_rss_mib(),
                    rss_growth_mib=_rss_mib() - rss0,
                    rss_shmem_mib=_rss_mib("RssShmem"),
                )
            elif i > args.warmup:
                samples.append(t_got - t0)
    finally:
        mgr.close()
    print(f"{shape.name}, medians: {_PHASES.summary(1 + args.warmup)}")
    mem["tx_cpu_s"], mem["rx_cpu_s"] = _PHASES.cpu_per_request(1 + args.warmup)
    return first, Stats(f"{shape.name}, steady", samples, shape.nbytes), mem, failures


def _one(
    chan: JsonChannel,
    mgr: Any,
    caches: list[torch.Tensor],
    shape: Shape,
    *,
    rid: str,
    i: int,
    n: int,
    gap_ms: float = 0.0,
) -> tuple[float, float, bool]:
    verify = shape.nbytes <= MIB or i in (0, n)
    chan.send("recv", rid, verify)
    chan.expect("waiting")
    if gap_ms:
        time.sleep(gap_ms / 1e3)  # idle time before the request (not part of the sample)
    t0 = time.monotonic()
    _send(mgr, caches, shape, rid)
    _PHASES.send_call_s.append(time.monotonic() - t0)
    sent = mgr.get_send_result(rid)
    timings = sent.timings_ms if sent is not None else {}
    _PHASES.extract_ms.append(float(timings.get("extract_ms", "nan")))
    _PHASES.encode_put_ms.append(float(timings.get("encode_put_ms", "nan")))
    t_got, ok, after_wait_ms, _t_call, _timings, rx_cpu = chan.recv()
    _PHASES.after_wait_ms.append(float(after_wait_ms))
    _PHASES.tx_cpu_s.append(time.process_time())
    _PHASES.rx_cpu_s.append(float(rx_cpu))
    return t0, float(t_got), bool(ok)


# -- the receiver already waiting (issue: a stage's receiver usually waits longer than any spin)
#: The put comes this long after the receiver entered its wait (ms), in the waiting cases.
WAIT_GAPS_MS = (2.0, 20.0)
#: The phases of one receive in the waiting cases, in order (medians in ms are reported).
WAIT_PHASES = (
    "send call to put done",
    "put done to wait end (wake-up)",
    "decode",
    "finish (checks, verdict)",
    "seed dict, return",
)


@dataclass
class IdlePenalty:
    """One reference workload (:data:`REFERENCE_WORK`, no omnikv code) timed back to back
    (``hot``) and after idling a gap (``cold``), alternated, in the same run as the waiting
    samples: how much slower the host runs the same Python after that idle, whatever the
    library does."""

    name: str
    hot: Stats
    cold: Stats

    @property
    def ratio(self) -> float:
        """``cold`` over ``hot`` (medians)."""
        return self.cold.median / self.hot.median if self.hot.median else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"hot": self.hot.as_dict(), "cold": self.cold.as_dict(), "ratio": self.ratio}


@dataclass
class WaitingCase:
    """One gap of the waiting case: samples from the send call to the receive's return, the
    floor (a bare eventfd wake-up between the same two processes, same gap, alternated with
    the samples), the medians of the phases of one receive (:data:`WAIT_PHASES`), and the
    host's idle penalty at that gap, one :class:`IdlePenalty` per reference workload
    (measured after every gap's requests)."""

    gap_ms: float
    stats: Stats
    floor: Stats
    phases_ms: dict[str, float]
    penalties: list[IdlePenalty]


def _tight_loop() -> int:
    """Small dicts, string formatting and calls over a few KiB (about 0.08 ms hot): Python whose
    data stays in the first-level cache."""
    total = 0
    for i in range(300):
        entry: dict[str, Any] = {"rid": i, "seq_len": i * 2, "blocks": (i, i + 1)}
        total += len(f"{entry['rid']}:{entry['seq_len']}") + len(entry["blocks"])
    return total


#: The scattered workload's data: 40,000 small tuples (a few MiB of objects) and 4,000 of their
#: indices in a fixed random order, built once per process.
_SCATTERED: tuple[list[tuple[int, str]], list[int]] | None = None


def _scattered_reads() -> int:
    """4,000 reads of tuples scattered over a few MiB (about 0.2 ms hot): Python that touches as
    much memory as a request's objects, modules and buffers do, so what a cold cache costs
    shows."""
    global _SCATTERED
    if _SCATTERED is None:
        objs = [(i, str(i)) for i in range(40_000)]
        order = list(range(len(objs)))
        random.Random(1).shuffle(order)
        _SCATTERED = (objs, order[:4000])
    objs, picks = _SCATTERED
    return sum(objs[i][0] + len(objs[i][1]) for i in picks)


#: The reference workloads of the idle penalty (name, function): no omnikv code in either.
REFERENCE_WORK: tuple[tuple[str, Callable[[], int]], ...] = (
    ("tight loop (a few KiB)", _tight_loop),
    ("scattered reads (a few MiB)", _scattered_reads),
)


def _idle_penalties(gap_s: float, iters: int) -> list[IdlePenalty]:
    """Each of :data:`REFERENCE_WORK` timed ``iters`` times back to back (its second run) and
    after idling ``gap_s``, alternated. Run after the waiting samples, never between them: the
    scattered workload's few MiB would evict the library's working set from the caches."""
    out = []
    for name, work in REFERENCE_WORK:
        hot, cold = [], []
        for _ in range(iters):
            work()
            t0 = time.perf_counter()
            work()
            hot.append(time.perf_counter() - t0)
            _sleep_until(time.monotonic() + gap_s)
            t0 = time.perf_counter()
            work()
            cold.append(time.perf_counter() - t0)
        gap_ms = gap_s * 1e3
        out.append(
            IdlePenalty(
                name,
                Stats(f"{name}, back to back", hot),
                Stats(f"{name}, after {gap_ms:g} ms idle", cold),
            )
        )
    return out


def _sleep_until(t: float) -> None:
    """Pace a sample: idle until ``t`` (monotonic); the receiver is already blocked."""
    left = t - time.monotonic()
    if left > 0:
        time.sleep(left)


def _floor_sample(chan: JsonChannel, efd: int, gap_s: float) -> float:
    """One bare wake-up: the receiver blocks reading ``efd``; ``gap_s`` after it entered that
    read, this process writes it; seconds from the write to the receiver's wake."""
    chan.send("floor")
    _, t_enter = chan.expect("waiting")
    _sleep_until(float(t_enter) + gap_s)
    t0 = time.monotonic()
    os.eventfd_write(efd, 1)
    (t_woke,) = chan.recv()
    return float(t_woke) - t0


def _waiting_sample(
    chan: JsonChannel, mgr: Any, caches: list[torch.Tensor], shape: Shape, rid: str, gap_s: float
) -> tuple[float, dict[str, float], bool]:
    """One request sent ``gap_s`` after the receiver entered its receive call: (seconds from
    the send call to the receive's return, the phases of :data:`WAIT_PHASES` in ms, verified)."""
    chan.send("recv", rid, True)
    _, t_enter = chan.expect("waiting")
    _sleep_until(float(t_enter) + gap_s)
    t0 = time.monotonic()
    _send(mgr, caches, shape, rid)
    sent = mgr.get_send_result(rid)
    tx = sent.timings_ms if sent is not None else {}
    t_got, ok, after_wait_ms, t_call, rx, _cpu = chan.recv()
    # the sender's phases start a little after t0, so the put ends no earlier than this: the
    # wake-up phase below is an upper bound (by that little), the put phase a lower one
    t_put = t0 + (float(tx.get("extract_ms", 0.0)) + float(tx.get("encode_put_ms", 0.0))) / 1e3
    t_wait_end = float(t_call) + float(rx.get("wait_ms", 0.0)) / 1e3
    decode, finish = float(rx.get("decode_ms", 0.0)), float(rx.get("finish_ms", 0.0))
    phases = dict(
        zip(
            WAIT_PHASES,
            (
                (t_put - t0) * 1e3,
                (t_wait_end - t_put) * 1e3,
                decode,
                finish,
                float(after_wait_ms) - decode - finish,
            ),
            strict=True,
        )
    )
    return float(t_got) - t0, phases, bool(ok)


def _run_waiting(
    args: argparse.Namespace, chan: JsonChannel, efd: int
) -> tuple[list[WaitingCase], list[str], dict[str, float]]:
    """The 64 KiB case with the receiver already waiting when the put comes (one fresh pair of
    managers; the request samples alternate with floor samples at each gap), then the idle
    receiver's CPU (``--idle-s``): (cases, failures, idle figures or {})."""
    from omnikv import OmniKVTransferManager

    shape = SHAPES["64KiB"]
    pool = args.pool_mib * MIB
    namespace = f"bench-mgr-{uuid.uuid4().hex[:10]}"
    caches = _caches(shape)
    chan.send("new", namespace, "64KiB", pool, not args.no_gc_freeze, args.poll_us)
    chan.expect("ok")
    mgr = OmniKVTransferManager(_config(namespace, "sender", pool, expected=shape.nbytes))
    _settle_heap(not args.no_gc_freeze)
    _await_reserve(mgr)
    cases: list[WaitingCase] = []
    failures: list[str] = []
    idle: dict[str, float] = {}
    try:
        for i in range(1 + args.warmup):  # the first request and warm-up, back to back
            if not _one(chan, mgr, caches, shape, rid=f"wait-warm-{i}", i=i, n=0)[2]:
                failures.append(f"waiting warm-up {i}")
        for gap_ms in args.wait_gaps_ms:
            samples, floor = [], []
            phases: dict[str, list[float]] = {name: [] for name in WAIT_PHASES}
            for i in range(args.wait_iters):
                floor.append(_floor_sample(chan, efd, gap_ms / 1e3))
                rid = f"wait-{gap_ms:g}-{i}"
                took, parts, ok = _waiting_sample(chan, mgr, caches, shape, rid, gap_ms / 1e3)
                if not ok:
                    failures.append(rid)
                samples.append(took)
                for name, ms in parts.items():
                    phases[name].append(ms)
            cases.append(
                WaitingCase(
                    gap_ms,
                    Stats(f"64 KiB, put {gap_ms:g} ms into the wait", samples, shape.nbytes),
                    Stats(f"floor: eventfd wake-up, {gap_ms:g} ms into the wait", floor),
                    {name: sorted(ms)[len(ms) // 2] for name, ms in phases.items()},
                    [],
                )
            )
        for case in cases:  # after every request: its working set would evict theirs
            case.penalties = _idle_penalties(case.gap_ms / 1e3, args.wait_iters)
        if args.idle_s:
            chan.send("idle", args.idle_s)
            _, (wall, cpu) = chan.expect("ok", timeout_s=args.idle_s + 60)
            idle = {"wall_s": wall, "cpu_s": cpu}
            print(
                f"idle receiver: {cpu * 1e3:.1f} ms of CPU (every thread) over a {wall:.1f} s"
                f" wait for KV that never came ({cpu / wall * 100:.2f} % of one core)"
            )
    finally:
        mgr.close()
    return cases, failures, idle


def _print_waiting(cases: list[WaitingCase], steady: Stats | None) -> None:
    print("\nThe receiver already waiting (64 KiB; send call -> receive returned, ms)")
    head = f"{'case':<40} {'p50':>8} {'p99':>8} {'min':>8} {'max':>8}"
    print(head + "\n" + "-" * len(head))
    rows = ([steady] if steady is not None else []) + [
        st for case in cases for st in (case.stats, case.floor)
    ]
    for st in rows:
        lo, hi = st.spread
        print(
            f"{st.name:<40} {st.median * 1e3:8.3f} {st.p99 * 1e3:8.3f} {lo * 1e3:8.3f}"
            f" {hi * 1e3:8.3f}"
        )
    for case in cases:
        parts = ", ".join(f"{name} {ms:.3f}" for name, ms in case.phases_ms.items())
        print(f"phases at {case.gap_ms:g} ms (medians, ms): {parts}")
    for case in cases:
        for pen in case.penalties:
            print(
                f"the host's idle penalty at {case.gap_ms:g} ms, {pen.name} (no omnikv code):"
                f" {pen.cold.median * 1e3:.3f} ms after idling the gap against"
                f" {pen.hot.median * 1e3:.3f} ms back to back ({pen.ratio:.2f} x)"
            )


def _send(mgr: Any, caches: list[torch.Tensor], shape: Shape, rid: str) -> None:
    """The sender stage's call: request ``rid`` holds every block of ``caches``."""
    mgr.handle_finished_requests_kv_transfer(
        {rid: {"block_ids": list(range(shape.blocks)), "seq_len": shape.tokens}},
        caches,
        BLOCK,
        "torch.float16",
    )


def _memcpy(nbytes: int, iters: int) -> tuple[Stats, float]:
    """``iters`` copies of ``nbytes`` between pre-faulted buffers (one thread): their wall
    times and the median CPU time of one copy (seconds)."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.ones(nbytes, dtype=torch.uint8)
    samples, cpu = [], []
    for i in range(iters + 2):
        c0, t0 = time.process_time(), time.perf_counter()
        dst.copy_(src)
        t1, c1 = time.perf_counter(), time.process_time()
        if i >= 2:
            samples.append(t1 - t0)
            cpu.append(c1 - c0)
    return Stats(f"memcpy {nbytes / MIB:.3g} MiB", samples, nbytes), statistics.median(cpu)


def _profile_small(args: argparse.Namespace, chan: JsonChannel) -> tuple[str, str]:
    """cProfile of steady-state 64 KiB requests: (sender text, receiver text)."""
    from omnikv import OmniKVTransferManager

    shape = SHAPES["64KiB"]
    namespace = f"bench-mgr-{uuid.uuid4().hex[:10]}"
    caches = _caches(shape)
    chan.send("new", namespace, "64KiB", args.pool_mib * MIB, not args.no_gc_freeze, args.poll_us)
    chan.expect("ok")
    pool = args.pool_mib * MIB
    mgr = OmniKVTransferManager(_config(namespace, "sender", pool, expected=shape.nbytes))
    prof = cProfile.Profile()
    try:
        for i in range(20):
            _one(chan, mgr, caches, shape, rid=f"warm-{i}", i=i, n=20)
        chan.send("profile", "on")
        chan.expect("ok")
        for i in range(args.small_iters):
            prof.enable()
            _one(chan, mgr, caches, shape, rid=f"prof-{i}", i=i, n=args.small_iters)
            prof.disable()
        chan.send("profile", "off")
        rx_text = str(chan.expect("ok")[1])
    finally:
        mgr.close()
    return _stats_text(prof), rx_text


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; returns 0 when every target is met, 1 otherwise."""
    parser = argparse.ArgumentParser(
        prog="omnikv bench manager",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--iters", type=int, default=10, help="224 MiB steady-state samples")
    parser.add_argument(
        "--small-iters", type=int, default=2000, help="64 KiB samples (as bench shm)"
    )
    parser.add_argument("--warmup", type=int, default=2, help="leading samples discarded")
    parser.add_argument("--pool-mib", type=int, default=1024, help="64 KiB case's sender pool")
    parser.add_argument(
        "--prefault-mib",
        type=int,
        default=0,
        help="224 MiB case: prefault this many MiB at start (default: the connector's 'auto')",
    )
    parser.add_argument("--skip-large", action="store_true", help="only the 64 KiB case")
    parser.add_argument(
        "--gap-ms",
        type=float,
        default=0.0,
        help="idle time before each request, after the receiver said it waits (as bench shm: 0)",
    )
    parser.add_argument(
        "--no-gc-freeze",
        action="store_true",
        help="do not freeze the start-up heap (vLLM's engine freezes it; so do we by default)",
    )
    parser.add_argument(
        "--poll-us",
        type=int,
        default=None,
        help="the receiver connector's poll_us (a blocking wait polls this long before it"
        " sleeps; default: the connector's default, 1000; 0: never poll)",
    )
    parser.add_argument(
        "--wait-iters",
        type=int,
        default=200,
        help="samples per gap of the 'receiver already waiting' case (0: skip that case)",
    )
    parser.add_argument(
        "--wait-gaps-ms",
        type=bounded_list(float, 0, 10_000, "gaps in ms"),
        default=WAIT_GAPS_MS,
        help="comma-separated gaps (ms) between the receiver entering its wait and the put, in"
        " the waiting case (default 2,20)",
    )
    parser.add_argument(
        "--idle-s",
        type=float,
        default=10.0,
        help="measure an idle waiting receiver's CPU over this many seconds (0: skip)",
    )
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch's intra-op threads in both processes (default 1; a stage runs with more:"
        " then whatever torch copies runs on its thread pool)",
    )
    parser.add_argument("--profile", action="store_true", help="cProfile 64 KiB requests")
    parser.add_argument("--json", help="write results to this file")
    parser.add_argument(
        "--no-targets",
        action="store_true",
        help="report the speed targets but exit 0 when one is missed (smoke runs on a busy "
        "machine); a verification failure still fails",
    )
    add_plot_option(parser)
    parser.add_argument("--role", default="sender", help=argparse.SUPPRESS)
    parser.add_argument("--fd", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--efd", type=int, default=-1, help=argparse.SUPPRESS)
    args = parser.parse_args(list(argv or []))
    require_plot(parser, args.plot)
    torch.set_num_threads(max(1, args.torch_threads))
    if args.role == "receiver":
        return _receiver(args.fd, args.efd)
    parent, child = socket.socketpair()
    efd = os.eventfd(0)  # the floor's wake-up: written here, read by the receiver
    cmd = [
        sys.executable,
        "-m",
        "omnikv.cli",
        "bench",
        "manager",
        "--role",
        "receiver",
        "--fd",
        str(child.fileno()),
        "--efd",
        str(efd),
        "--torch-threads",
        str(args.torch_threads),
    ]
    proc = subprocess.Popen(cmd, pass_fds=[child.fileno(), efd])
    child.close()
    chan = JsonChannel(parent)
    try:
        chan.expect("ready")
        return _sender(args, chan, efd)
    finally:
        reap(proc, chan)
        os.close(efd)


#: Most CPU a side may spend per 224 MiB request, as a multiple of one memcpy's CPU time.
CPU_PER_MEMCPY = 1.3


def _print_cpu(key: str, mem: dict[str, float], memcpy_cpu_s: float) -> tuple[float, float]:
    """Print each side's CPU per steady-state request of case ``key`` and its ratio to the CPU
    time of one memcpy of the payload's size; returns the (sender, receiver) ratios."""
    tx, rx = mem["tx_cpu_s"], mem["rx_cpu_s"]
    ratios = (tx / memcpy_cpu_s, rx / memcpy_cpu_s) if memcpy_cpu_s > 0 else (math.nan,) * 2
    print(
        f"{SHAPES[key].name}: CPU per steady-state request (every thread; the bench's data"
        f" checks excluded): sender {tx * 1e3:.3f} ms ({ratios[0]:.2f} x memcpy's CPU),"
        f" receiver {rx * 1e3:.3f} ms ({ratios[1]:.2f} x); one memcpy of the payload"
        f" {memcpy_cpu_s * 1e3:.3f} ms of CPU"
    )
    return ratios


def _print_case(key: str, first: float, steady: Stats, mem: dict[str, float]) -> None:
    name = SHAPES[key].name
    if mem["reserve_mib"]:
        ready = "not ready" if mem["reserve_s"] < 0 else f"took {mem['reserve_s'] * 1e3:.0f} ms"
        print(
            f"{name}: sender pool reserve of {mem['reserve_mib']:.0f} MiB prepared in the"
            f" background while the stage started ({ready}; waited {mem['reserve_wait_s']:.3f} s"
            " for it before the first request)"
        )
    print(
        f"{name}: first request {first * 1e3:.3f} ms (steady median {steady.median * 1e3:.3f}"
        f" ms, p99 {steady.p99 * 1e3:.3f} ms; first - steady {(first - steady.median) * 1e3:+.1f}"
        f" ms); sender RSS at the first request {mem['rss_mib']:.0f} MiB (shared memory"
        f" {mem['rss_shmem_mib']:.0f} MiB; +{mem['rss_growth_mib']:.1f} MiB during it)"
    )


def _sender(args: argparse.Namespace, chan: JsonChannel, efd: int) -> int:
    cases = [("64KiB", args.small_iters)] + ([] if args.skip_large else [("224MiB", args.iters)])
    rows: list[Stats] = []
    memcpys: list[Stats] = []  # and the steady state of the same cases: the plot's rows
    steadies: list[Stats] = []
    out: dict[str, Any] = {"bench": "manager", "cases": {}}
    failures: list[str] = []
    targets: list[tuple[str, float, bool]] = []
    for key, iters in cases:
        first, steady, mem, fails = _run_case(args, chan, key, iters)
        failures += fails
        memcpy, memcpy_cpu = _memcpy(SHAPES[key].nbytes, min(iters, 50))
        ratios = _print_cpu(key, mem, memcpy_cpu)
        mem["memcpy_cpu_s"] = memcpy_cpu
        rows += [memcpy, steady]
        memcpys.append(memcpy)
        steadies.append(steady)
        _print_case(key, first, steady, mem)
        out["cases"][key] = {
            "first_s": first,
            "first_rss_mib": mem["rss_growth_mib"],
            **mem,
            **steady.as_dict(),
            "memcpy": memcpy.as_dict(),
        }
        targets.append(
            (
                f"{key} first - steady <= 50 ms (ms)",
                (first - steady.median) * 1e3,
                first - steady.median <= 0.05,
            )
        )
        if key == "224MiB":
            for side, ratio in zip(("sender", "receiver"), ratios, strict=True):
                targets.append(
                    (
                        f"224 MiB {side} CPU <= {CPU_PER_MEMCPY} x memcpy's (x)",
                        ratio,
                        ratio <= CPU_PER_MEMCPY,
                    )
                )
        if key == "64KiB":
            targets.append(
                ("64 KiB p50 <= 0.5 ms (ms)", steady.median * 1e3, steady.median <= 0.5e-3)
            )
            targets.append(("64 KiB p99 <= 2 ms (ms)", steady.p99 * 1e3, steady.p99 <= 2e-3))
    print_table(rows, title="through the managers, two processes (steady state)")
    if args.wait_iters > 0:
        waiting, fails, idle = _run_waiting(args, chan, efd)
        failures += fails
        out["idle_receiver"] = idle
        _print_waiting(waiting, steadies[0])
        out["waiting"] = [
            {
                "gap_ms": case.gap_ms,
                **case.stats.as_dict(),
                "floor": case.floor.as_dict(),
                "phases_ms": case.phases_ms,
                "idle_penalty": {pen.name: pen.as_dict() for pen in case.penalties},
            }
            for case in waiting
        ]
        for case in waiting:
            p50, p99 = case.stats.median * 1e3, case.stats.p99 * 1e3
            targets.append((f"waiting {case.gap_ms:g} ms: p50 <= 0.4 ms (ms)", p50, p50 <= 0.4))
            targets.append((f"waiting {case.gap_ms:g} ms: p99 <= 1 ms (ms)", p99, p99 <= 1.0))
    if failures:
        raise SystemExit(f"verification failed: {', '.join(failures[:5])}")
    print("\nTargets")
    for label, value, ok in targets:
        print(f"  {'PASS' if ok else 'MISS'}  {label}: {value:.3f}")
    if args.profile:
        tx, rx = _profile_small(args, chan)
        print("\ncProfile, sender, steady-state 64 KiB requests (tottime)\n" + tx)
        print("\ncProfile, receiver, steady-state 64 KiB requests (tottime)\n" + rx)
    out["targets_met"] = all(ok for _, _, ok in targets)
    write_json(args.json, out)
    if args.plot:
        write_plot(
            args.plot,
            {"through the managers (steady state)": steadies},
            memcpys,
            title="omnikv bench manager: paged KV through two managers",
        )
        print(f"plot written to {args.plot}")
    return 0 if args.no_targets or out["targets_met"] else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
