"""``omnikv bench fanout --readers N``: one payload that N receivers of the node each need whole.

The CFG branches or sequence-parallel ranks of a receiving stage all need the request's whole
KV. A sender (this process, one ``SharedMemoryConnector``) and N reader processes (one
connector each) of one shared-memory namespace; per sample, every reader blocks in ``wait``
for its key, then the sender puts, taking turns between three ways in the same run:

* **shared**: one :meth:`~omnikv.connectors.shm.connector.SharedMemoryConnector.put_shared`
  for N readers: the payload is encoded into the pool once and every reader maps the same slot;
* **per reader**: one ``put_packed`` per reader (its own key): N encodes into N slots, what a
  sender does for N readers without a shared put;
* **leader broadcast**: what a multi-rank receiving stage does without ``shared_readers``: one
  ``put_packed``, reader 0 (the leader) takes it and :func:`omnikv.ranks.distribution.distribute`
  broadcasts it over the readers' gloo world (loopback): the leader packs it once more into a
  message buffer and each follower receives its own copy over a socket.

Each sample is timed from the sender's first put call to the last reader holding its KV
(``decode`` of zero-copy views done; ``CLOCK_MONOTONIC``, one clock per node). The bytes written
into the pool per sample are read from the sender's ``put_bytes`` counter; the broadcast's
further copies (the leader's pack, one per follower) are what its path makes, printed beside.
The payload is Qwen2.5-7B-shaped, 4096 tokens, fp16 (224 MiB; ``--size-mib``), encoded with the
wire format the managers send; a memcpy of the same size (page-aligned, pre-faulted, one
thread) runs in the same process and run as the ceiling. Every reader checks every tensor of
every sample against a copy it rebuilt, once all readers hold it (outside the timed region),
then releases it; the next sample starts when the pool is empty again.

Targets (exit 1 when missed, unless ``--no-targets``): the shared put writes the payload's bytes
once per sample (its ``put_bytes``), and its p50 time to the last reader is at most the
per-reader path's and the leader broadcast's. A verification failure always fails.
"""

from __future__ import annotations

import argparse
import os
import socket
import time
import uuid
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from omnikv.bench.common import (
    MODELS,
    JsonChannel,
    Stats,
    describe_payload,
    print_table,
    realistic_payload,
    reap,
    serve_commands,
    spawn_bench_child,
    write_json,
)
from omnikv.wire.decode import decode

__all__ = ["run"]

MIB = 1 << 20
_PAGE = 4096
_EDGE = ("bench", "readers")
#: per-slot slack in the sender's pool (allocator rounding)
_SLACK = 4 * MIB


def _tokens(model: str, size_mib: int) -> int:
    layers, heads, dim = MODELS[model]
    return max(16, size_mib * MIB // (2 * layers * heads * dim * 2))


def _same(data: dict[str, Any], source: dict[str, list[torch.Tensor]]) -> bool:
    for cache in ("key_cache", "value_cache"):
        for got, want in zip(data["layer_blocks"][cache], source[cache], strict=True):
            if got is None or not torch.equal(got, want):
                return False
    return True


# -- a reader (child process) --------------------------------------------------------------------
class _Reader:
    """One receiving rank: waits for a key, holds the decoded views, checks them on request."""

    def __init__(self, namespace: str, model: str, tokens: int, rank: int, world: int) -> None:
        from omnikv.connectors.shm.connector import SharedMemoryConnector

        self.source = realistic_payload(model, tokens).layer_blocks
        self.conn = SharedMemoryConnector({"namespace": namespace})
        self.chan: JsonChannel | None = None
        self.held: Any = None
        self.data: dict[str, Any] | None = None
        self.rank, self.world = rank, world
        self.topo: Any = None

    def join(self, init: str) -> list[Any]:
        """Join the readers' gloo world (``file://`` rendezvous, loopback): ``["joined"]``."""
        import torch.distributed as dist

        from omnikv.ranks.context import ParallelContext, build_topo_config

        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group("gloo", init_method=init, rank=self.rank, world_size=self.world)
        ctx = ParallelContext(world_group=dist.group.WORLD, buffer_cache=0)
        self.topo = build_topo_config(ctx, tp_active=False)
        return ["joined"]

    def bcast(self, key: str) -> list[Any]:
        """Today's multi-rank path: the leader takes ``key``, every reader enters the world
        broadcast; ``["waiting"]`` first, then ``["got", t_in_hand, ok]``."""
        from omnikv.ranks.distribution import distribute

        assert self.chan is not None and self.topo is not None
        self.chan.send("waiting")
        req = SimpleNamespace(request_id=key, sampling_params=SimpleNamespace())
        received = False
        if self.topo.is_leader:
            buf = self.conn.wait(*_EDGE, key, deadline=time.monotonic() + 120.0)
            if buf is not None:
                self.held, data = buf, decode(buf.tensor)
                req.past_key_values = SimpleNamespace(**data["layer_blocks"])
                received = True
        got = distribute(self.topo, req, received=received, deadline=time.monotonic() + 120.0)
        t = time.monotonic()
        if got is None:
            return ["got", t, False]
        kv = got["past_key_values"]
        self.data = {"layer_blocks": {"key_cache": kv.key_cache, "value_cache": kv.value_cache}}
        return ["got", t, True]

    def wait(self, key: str) -> list[Any]:
        """``["waiting"]`` first (the driver then puts), then ``["got", t_in_hand, ok]``."""
        assert self.chan is not None
        self.chan.send("waiting")
        buf = self.conn.wait(*_EDGE, key, deadline=time.monotonic() + 120.0)
        if buf is None:
            return ["got", time.monotonic(), False]
        self.held, self.data = buf, decode(buf.tensor)
        return ["got", time.monotonic(), True]

    def check(self) -> list[Any]:
        """Every tensor held against the rebuilt source, then release: ``["checked", ok]``."""
        ok = self.data is not None and _same(self.data, self.source)
        self.data = None
        if self.held is not None:
            self.held.release()
            self.held = None
        return ["checked", ok]

    def close(self) -> None:
        self.data = None
        if self.held is not None:
            self.held.release()
        self.conn.close()


def reader_main(fd: int, namespace: str, model: str, tokens: int, rank: int, world: int) -> int:
    """Child entry point: serve ``join`` / ``wait`` / ``bcast`` / ``check`` until ``stop`` or its
    driver goes away."""
    chan = JsonChannel(socket.socket(fileno=fd))
    reader = _Reader(namespace, model, tokens, rank, world)
    reader.chan = chan
    table = {"join": reader.join, "wait": reader.wait, "bcast": reader.bcast}
    try:
        chan.send("ready")
        serve_commands(chan, {**table, "check": reader.check})
    finally:
        reader.close()
        chan.close()
    return 0


# -- the driver and sender (this process) --------------------------------------------------------
def _aligned(n: int) -> torch.Tensor:
    raw = torch.empty(n + _PAGE, dtype=torch.uint8)
    skip = (-raw.data_ptr()) % _PAGE
    out = raw[skip : skip + n]
    out.fill_(1)
    return out


def _start(
    args: argparse.Namespace, namespace: str, tokens: int, rank: int
) -> tuple[Any, JsonChannel]:
    options = ["--namespace", namespace, "--model", args.model, "--tokens", str(tokens)]
    options += ["--rank", str(rank), "--readers", str(args.readers)]
    return spawn_bench_child("fanout", "reader", options)


def _until_empty(tx: Any, timeout_s: float = 60.0) -> None:
    """The readers' releases reached the sender: its pool is empty again (polled: releases are
    messages the driver is not told of; bounded)."""
    end = time.monotonic() + timeout_s
    while True:
        h = tx.health()
        if h["pool_free_bytes"] == h["pool_size_bytes"]:
            return
        if time.monotonic() > end:
            raise SystemExit(f"the sender's pool did not empty: {h['pool_free_bytes']} free")
        time.sleep(0.001)


def _sample(
    tx: Any,
    chans: list[JsonChannel],
    keys: list[str],
    put: Callable[[], None],
    failures: list[str],
    label: str,
    *,
    op: str = "wait",
) -> tuple[float, int]:
    """One sample: every reader waits for its key (``op``), ``put`` runs; seconds from the put
    call to the last reader holding its KV, and the bytes the sender wrote into its pool."""
    for chan, key in zip(chans, keys, strict=True):
        chan.send(op, key)
    for chan in chans:
        chan.expect("waiting")
    before = tx.health()["put_bytes"]
    t0 = time.monotonic()
    put()
    t_got = []
    for i, chan in enumerate(chans):
        _, t, ok = chan.expect("got")
        t_got.append(float(t))
        if not ok:
            failures.append(f"{label}: reader {i} got nothing")
    written = int(tx.health()["put_bytes"]) - int(before)
    for chan in chans:
        chan.send("check")
    for i, chan in enumerate(chans):
        if not chan.expect("checked")[1]:
            failures.append(f"{label}: reader {i} got wrong KV")
    _until_empty(tx)
    return max(t_got) - t0, written


def run(args: argparse.Namespace) -> int:
    """The benchmark's driver (see the module docstring); its exit status."""
    from omnikv.connectors.shm.connector import SharedMemoryConnector

    n_readers = args.readers
    tokens = _tokens(args.model, args.size_mib)
    payload = realistic_payload(args.model, tokens)
    plan = payload.plan()
    n = plan.nbytes
    print(describe_payload(args.model, tokens, payload, n))
    print(
        f"{n_readers} reader processes, {args.repeat} samples per way after {args.warmup} warm-up"
    )
    namespace = f"bench-readers-{uuid.uuid4().hex[:10]}"
    tx = SharedMemoryConnector(
        {
            "namespace": namespace,
            "pool_size_bytes": n_readers * (n + _SLACK) + 16 * MIB,
            "put_timeout_s": 60,
            "linger_s": 0,
        }
    )
    readers: list[tuple[Any, JsonChannel]] = []
    rendezvous = f"/tmp/omnikv-{namespace}"
    try:
        for rank in range(n_readers):
            readers.append(_start(args, namespace, tokens, rank))
        chans = [c for _, c in readers]
        for chan in chans:
            chan.expect("ready", timeout_s=300)
        for chan in chans:
            chan.send("join", f"file://{rendezvous}")
        for chan in chans:
            chan.expect("joined", timeout_s=120)
        results = _measure(args, tx, chans, plan, n)
    finally:
        for proc, chan in readers:
            reap(proc, chan)
        tx.close(linger=False)
        if os.path.exists(rendezvous):
            os.unlink(rendezvous)
    return _report(args, n, results)


def _measure(
    args: argparse.Namespace, tx: Any, chans: list[JsonChannel], plan: Any, n: int
) -> dict[str, Any]:
    n_readers = len(chans)
    failures: list[str] = []
    shared = Stats(f"shared: 1 put for {n_readers} readers", [], n)
    per_reader = Stats(f"per reader: {n_readers} puts", [], n)
    bcast = Stats("leader broadcast (gloo)", [], n)
    stats = {"shared": shared, "per_reader": per_reader, "bcast": bcast}
    written: dict[str, list[int]] = {name: [] for name in stats}
    for i in range(args.warmup + args.repeat):
        key = f"s{i}"

        def put_shared(key: str = key) -> None:
            ok, _, _ = tx.put_shared(*_EDGE, key, n, plan, readers=n_readers)
            if not ok:
                failures.append(f"shared put {key}")

        keys = [f"p{i}-{r}" for r in range(n_readers)]

        def put_each(keys: list[str] = keys) -> None:
            for k in keys:
                ok, _, _ = tx.put_packed(*_EDGE, k, n, plan)
                if not ok:
                    failures.append(f"put {k}")

        bkey = f"b{i}"

        def put_once(key: str = bkey) -> None:
            ok, _, _ = tx.put_packed(*_EDGE, key, n, plan)
            if not ok:
                failures.append(f"put {key}")

        # rotate which way goes first, so none always follows another
        ways: list[tuple[str, list[str], Callable[[], None], str]] = [
            ("shared", [key] * n_readers, put_shared, "wait"),
            ("per_reader", keys, put_each, "wait"),
            ("bcast", [bkey] * n_readers, put_once, "bcast"),
        ]
        for name, way_keys, put, op in ways[i % 3 :] + ways[: i % 3]:
            seconds, nbytes = _sample(tx, chans, way_keys, put, failures, f"{name} {i}", op=op)
            if i >= args.warmup:
                stats[name].samples.append(seconds)
                written[name].append(nbytes)
    if failures:
        raise SystemExit(f"verification failed ({len(failures)}): {'; '.join(failures[:5])}")
    src, dst = _aligned(n), _aligned(n)
    memcpy = Stats("memcpy (aligned, pre-faulted)", [], n)
    for i in range(args.warmup + args.repeat):
        t0 = time.perf_counter()
        dst.copy_(src)
        if i >= args.warmup:
            memcpy.samples.append(time.perf_counter() - t0)
    return {**stats, "memcpy": memcpy, "written": written}


def _report(args: argparse.Namespace, n: int, results: dict[str, Any]) -> int:
    shared: Stats = results["shared"]
    per_reader: Stats = results["per_reader"]
    bcast: Stats = results["bcast"]
    memcpy: Stats = results["memcpy"]
    written: dict[str, list[int]] = results["written"]
    print_table(
        [memcpy, shared, per_reader, bcast],
        baseline=memcpy,
        title=f"put call -> the last of {args.readers} readers holding its KV (decoded views)",
    )
    once = all(w == n for w in written["shared"])
    faster = shared.median <= min(per_reader.median, bcast.median)
    print(
        f"\nbytes written into the sender's pool per sample (put_bytes): shared"
        f" {max(written['shared']) / MIB:.1f} MiB ({'once' if once else 'MISS: more than once'}),"
        f" per reader {max(written['per_reader']) / MIB:.1f} MiB"
        f" ({max(written['per_reader']) / n:.0f} x the payload), leader broadcast"
        f" {max(written['bcast']) / MIB:.1f} MiB, then the leader's pack and"
        f" {args.readers - 1} follower copies over gloo ({args.readers + 1} x the payload in all)"
    )
    print(
        f"shared p50 {shared.median * 1e3:.1f} ms: {per_reader.median / shared.median:.2f}x"
        f" faster than per reader ({per_reader.median * 1e3:.1f} ms),"
        f" {bcast.median / shared.median:.2f}x faster than the leader broadcast"
        f" ({bcast.median * 1e3:.1f} ms): {'PASS' if faster else 'MISS'} (target: not slower"
        f" than either); {memcpy.median / shared.median:.2f} x memcpy of the payload"
    )
    write_json(
        args.json,
        {
            "bench": "fanout-readers",
            "readers": args.readers,
            "payload_bytes": n,
            "shared": shared.as_dict(),
            "per_reader": per_reader.as_dict(),
            "bcast": bcast.as_dict(),
            "memcpy": memcpy.as_dict(),
            "written_bytes": written,
            "written_once": once,
            "verified": True,
        },
    )
    return 0 if (once and faster) or args.no_targets else 1
