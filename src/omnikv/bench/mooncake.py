"""``omnikv bench mooncake``: each omnikv Mooncake connector against the raw engine, same run.

One run, the same bytes for every case: a KV payload (Qwen2.5-7B, 4096 tokens, fp16: 224 MiB by
default) encoded once with :mod:`omnikv.wire.encode`. The *sender* is a child process (started here
with a socketpair for JSON-lines control messages, no pickle; killed by PID at the end); the
*receiver* is this process. Raw and omnikv samples alternate (raw first on even rounds, omnikv
first on odd ones) so drift hits both; warm-up rounds are discarded. Target: omnikv >= 0.85 x the
raw engine's throughput at 224 MiB (``ratio = raw median / omnikv median``).

**Transfer Engine** (``--only te``; P2P handshake, tcp, loopback):

* *raw TE write*: each process has its own ``TransferEngine`` and one registered, page-aligned,
  pre-faulted buffer (:class:`~omnikv.connectors.pool.HostPool`); the sender's holds the encoded
  bytes. Timed in the sender: one ``transfer_sync_write`` of the whole payload into the
  receiver's buffer (a single 224 MiB transfer is accepted; when it returns 0 the bytes are at
  the receiver).
* *omnikv wait (transport)*:
  :class:`~omnikv.connectors.mooncake_te.MooncakeTransferEngineConnector`. The sender
  ``put_packed``s (its writer copies the pre-encoded bytes into the registered slot with one
  single-threaded numpy copy, so no spinning OpenMP worker competes with the transfer) and acks
  "published"; then the receiver times ``wait`` from the call to the returned
  ``(ManagedBuffer, size)``: query, pull request, the sender's ``transfer_sync_write``, ``done``.
  Both sides start with the bytes in registered memory: transport against transport. This is the
  figure the verdict uses.
* *omnikv put->in hand (e2e)*: the same samples from the start of ``put_packed`` in the sender
  to the data in hand in the receiver (``CLOCK_MONOTONIC``, one clock for the node). It includes
  the writer's memcpy (reported on its own line) and one control-channel hop of this benchmark
  (the "published" ack, tens of microseconds).

**Mooncake Store** (``--only store``; a real ``mooncake_master`` on free loopback ports, killed
by PID at the end; HTTP metadata). Where the master places an object decides what put and get
cost: into the putting client's own segment ``put_from`` is a local memcpy and the get crosses
TCP; into the getting client's segment the other way round; into any other client's segment
(even one in the same process) both cross TCP. The master picks at random, which moves a single
put+get by a factor of two or more whatever the connector. So by
default (``--store-placement holder``) a *holder* client in this process contributes the only
segment that can take the payload (two payloads and a margin) and the four benchmarked clients
contribute Mooncake's minimum (16 MiB): every object, raw or omnikv, travels sender -> holder ->
receiver, two TCP transfers. (A payload of 16 MiB or less cannot be pinned that way.)
``--store-placement any`` gives every benchmarked client a full segment and no holder: the
master's choice, as in a plain deployment. The placement of every sample is looked up
(``get_replica_desc``, untimed) and printed.

* *raw put+get* = ``put_from`` of the registered sender buffer (timed in the sender) +
  ``get_into`` the registered receiver buffer (timed in the receiver); ``remove`` afterwards,
  untimed.
* *omnikv put+wait*: :class:`~omnikv.connectors.mooncake_store.connector.MooncakeStoreConnector`:
  (``put_packed`` minus its writer's memcpy, which is measured inside the writer and reported on
  its own line) + ``wait`` with the object already stored (``get_size`` + ``get_into`` its
  registered pool + ``remove``).

**memcpy**: page-aligned, pre-faulted source and destination of the payload's size (the
machine's ceiling, for scale).

Verification, outside every timed region: the receiver checks the crc32 of every received
sample (raw and omnikv) against the payload it encoded itself from the same seed, decodes the
first and last omnikv sample of each connector and compares every tensor, then overwrites the
receive buffer so a later sample cannot pass on stale bytes. Any mismatch prints ``FAIL`` and the
exit code is 1; missing the speed target only prints ``MISS`` (exit code 0).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from omnikv.bench._alternate import (
    MIB,
    SETUP_TIMEOUT_S,
    STAGES,
    TARGET,
    BenchError,
    Check,
    Rounds,
    Source,
    TransportSamples,
    add_common_args,
    omni_wait,
    pool_size,
    print_verdict_head,
    run_against_sender,
    serve,
    tokens_of,
    write_report,
)
from omnikv.bench.common import (
    ChannelError,
    JsonChannel,
    Stats,
    print_table,
)
from omnikv.bench.mooncake_master import HOST, MooncakeMaster, free_ports
from omnikv.connectors.mooncake_te.engine import unavailable_reason
from omnikv.connectors.pool import HostPool

__all__ = ["main"]

logger = logging.getLogger(__name__)

MIN_SEGMENT = 16 * MIB  # Mooncake Store's smallest global segment ("must be at least 16777216")


def _segment_size(n: int) -> int:
    """A Store global segment that takes the payload: two payloads and a margin, >= 128 MiB."""
    return max(128 * MIB, 2 * n + 64 * MIB)


def _mooncake_env() -> None:
    """Environment both processes need before a Mooncake engine starts (called by ``main``)."""
    os.environ.setdefault("GLOG_minloglevel", "2")
    os.environ["MC_TCP_BIND_ADDRESS"] = HOST


def _raw_engine(pool: HostPool) -> Any:
    """A raw ``TransferEngine`` (P2P handshake, tcp, loopback) with ``pool`` registered.

    Both processes' raw TE set-up; the caller unregisters ``pool`` before closing it. Raises
    BenchError (nothing left registered) when the engine refuses.
    """
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    rc = engine.initialize(HOST, "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise BenchError(f"TransferEngine.initialize returned {rc}")
    rc = engine.register_memory(pool.address, pool.size)
    if rc != 0:
        raise BenchError(f"register_memory returned {rc}")
    return engine


def _raw_store(metadata_url: str, master: str, segment: int, pool: HostPool | None = None) -> Any:
    """A raw ``MooncakeDistributedStore`` client contributing ``segment`` bytes, with ``pool``
    registered when given. Both processes' raw Store set-up; the caller unregisters ``pool`` and
    closes the client. Raises BenchError (client closed) when set-up fails.
    """
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup(HOST, metadata_url, segment, 16 * MIB, "tcp", "", master)
    if rc != 0:
        store.close()
        raise BenchError(f"MooncakeDistributedStore.setup returned {rc}")
    if pool is not None:
        rc = store.register_buffer(pool.address, pool.size)
        if rc != 0:
            store.close()
            raise BenchError(f"register_buffer returned {rc}")
    return store


# -- sender (child process) ----------------------------------------------------------------------
class _Sender:
    """The child's state: the encoded payload and the engines / connectors of the live case.

    Built by :func:`_sender_main`; every ``op_*`` method answers one control command with the
    reply message (a list). :meth:`close_te` / :meth:`close_store` are idempotent and are also
    called when the channel ends.
    """

    def __init__(self, model: str, tokens: int) -> None:
        self.src = Source(model, tokens)
        self.n = self.src.n
        # a raw engine / store client exists only with its pool registered (see _raw_*)
        self.te_engine: Any = None
        self.te_pool: HostPool | None = None
        self.te_target: tuple[str, int] = ("", 0)
        self.te_conn: Any = None
        self.store: Any = None
        self.st_pool: HostPool | None = None
        self.st_rcfg: Any = None
        self.st_conn: Any = None

    # Transfer Engine
    def op_te_setup(self, rx_session: str, rx_addr: int, zmq_port: int) -> list[Any]:
        """Raw engine + registered buffer holding the bytes, and the sender connector."""
        from omnikv.connectors.mooncake_te import MooncakeTransferEngineConnector

        self.te_pool = HostPool(self.n)
        self.te_pool.tensor[: self.n].copy_(self.src.view)
        self.te_engine = _raw_engine(self.te_pool)
        self.te_target = (rx_session, int(rx_addr))
        self.te_conn = MooncakeTransferEngineConnector(
            {
                "role": "sender",
                "host": HOST,
                "zmq_port": zmq_port,
                "protocol": "tcp",
                "memory_pool_size": pool_size(self.n),
            }
        )
        return ["te_ready"]

    def op_te_raw(self) -> list[Any]:
        """One timed ``transfer_sync_write`` of the whole payload: ``["raw", rc, seconds]``."""
        assert self.te_engine is not None and self.te_pool is not None
        session, dst = self.te_target
        t0 = time.monotonic()
        rc = self.te_engine.transfer_sync_write(session, self.te_pool.address, dst, self.n)
        return ["raw", int(rc), time.monotonic() - t0]

    def op_te_omni(self, key: str) -> list[Any]:
        """Publish ``key`` through the Transfer Engine connector (:meth:`Source.publish`)."""
        return self.src.publish(self.te_conn, key)

    def close_te(self) -> None:
        """Close the connector, unregister and unmap the raw buffer, drop the engine."""
        conn, self.te_conn = self.te_conn, None
        if conn is not None:
            conn.close()
        if self.te_engine is not None and self.te_pool is not None:
            self.te_engine.unregister_memory(self.te_pool.address)
        self.te_engine = None
        if self.te_pool is not None:
            self.te_pool.close()
            self.te_pool = None

    # Mooncake Store
    def op_st_setup(self, metadata_url: str, master: str, segment: int) -> list[Any]:
        """Raw store client + registered buffer, and the Store connector; replies with the raw
        client's endpoint (so the parent can name where objects were placed)."""
        from mooncake.store import ReplicateConfig

        from omnikv.connectors.mooncake_store.connector import MooncakeStoreConnector

        self.st_pool = HostPool(self.n)
        self.st_pool.tensor[: self.n].copy_(self.src.view)
        store = self.store = _raw_store(metadata_url, master, segment, self.st_pool)
        self.st_rcfg = ReplicateConfig()
        self.st_conn = MooncakeStoreConnector(
            {
                "host": HOST,
                "metadata_server": metadata_url,
                "master_server_address": master,
                "global_segment_size": segment,
                "local_buffer_size": 16 * MIB,
                "memory_pool_size": pool_size(self.n),
            }
        )
        return ["st_ready", str(store.get_hostname())]

    def op_st_raw(self, key: str) -> list[Any]:
        """One timed ``put_from`` of the whole payload: ``["raw", rc, seconds]``."""
        assert self.store is not None and self.st_pool is not None
        t0 = time.monotonic()
        rc = self.store.put_from(key, self.st_pool.address, self.n, self.st_rcfg)
        return ["raw", int(rc), time.monotonic() - t0]

    def op_st_omni(self, key: str) -> list[Any]:
        """Publish ``key`` through the Store connector (:meth:`Source.publish`)."""
        return self.src.publish(self.st_conn, key)

    def close_store(self) -> None:
        """Close the connector, unregister the raw buffer, close the client (master still up)."""
        conn, self.st_conn = self.st_conn, None
        if conn is not None:
            conn.close()
        store, self.store = self.store, None
        if store is not None:
            if self.st_pool is not None:
                store.unregister_buffer(self.st_pool.address)
            store.close()
        if self.st_pool is not None:
            self.st_pool.close()
            self.st_pool = None

    def close(self) -> None:
        """Everything, in order; called once when the control channel ends."""
        self.close_te()
        self.close_store()
        self.src.close()

    def ops(self) -> dict[str, Callable[..., list[Any]]]:
        """The commands this child answers (``te_close`` / ``st_close`` reply ``["closed"]``)."""

        def closing(close: Callable[[], None]) -> Callable[[], list[Any]]:
            def op() -> list[Any]:
                close()
                return ["closed"]

            return op

        return {
            "te_setup": self.op_te_setup,
            "te_raw": self.op_te_raw,
            "te_omni": self.op_te_omni,
            "te_close": closing(self.close_te),
            "st_setup": self.op_st_setup,
            "st_raw": self.op_st_raw,
            "st_omni": self.op_st_omni,
            "st_close": closing(self.close_store),
        }


# -- receiver (this process) ---------------------------------------------------------------------
@dataclass
class _Ctx:
    """What every case of one run shares (built by :func:`_run`)."""

    chan: JsonChannel
    n: int
    check: Check
    warmup: int
    repeat: int
    store_placement: str = "holder"
    #: Store case: "raw" / "omnikv" -> segment owner label -> objects placed there
    placement: dict[str, dict[str, int]] = field(default_factory=dict)

    def place(self, case: str, label: str) -> None:
        """Count one timed Store sample of ``case`` placed on the segment owned by ``label``."""
        counts = self.placement.setdefault(case, {})
        counts[label] = counts.get(label, 0) + 1

    @property
    def rounds(self) -> Rounds:
        return Rounds(self.warmup, self.repeat)


def _te_case(ctx: _Ctx) -> dict[str, Stats]:
    """Transfer Engine: raw ``transfer_sync_write`` vs ``MooncakeTransferEngineConnector``."""
    from omnikv.connectors.mooncake_te import MooncakeTransferEngineConnector

    n, chan, check = ctx.n, ctx.chan, ctx.check
    raw = Stats("raw TE write", [], n)
    omni = TransportSamples.of(n)
    pool = HostPool(n)
    engine: Any = None
    rx: Any = None
    child_setup = False
    try:
        engine = _raw_engine(pool)
        session = f"{HOST}:{engine.get_rpc_port()}"
        zmq_port = free_ports(1)[0]
        child_setup = True
        chan.send("te_setup", session, pool.address, zmq_port)
        chan.expect("te_ready", SETUP_TIMEOUT_S)
        rx = MooncakeTransferEngineConnector(
            {
                "role": "receiver",
                "host": HOST,
                "sender_host": HOST,
                "sender_zmq_port": zmq_port,
                "protocol": "tcp",
                "memory_pool_size": pool_size(n),
            }
        )
        for i, which, timed, full in ctx.rounds:
            if which == "raw":
                chan.send("te_raw")
                _, rc, took = chan.expect("raw")
                if rc != 0:
                    raise BenchError(f"raw transfer_sync_write returned {rc}")
                check.check(f"TE raw round {i}", pool.tensor, n, full=full)
                if timed:
                    raw.samples.append(float(took))
            else:
                label = f"TE omnikv round {i}"
                omni.sample(chan, "te_omni", rx, f"te-{i}", check, label, timed=timed, full=full)
    finally:
        if rx is not None:
            rx.close()
        if child_setup:
            with contextlib.suppress(ChannelError, OSError):
                chan.send("te_close")
                chan.expect("closed", SETUP_TIMEOUT_S)
        if engine is not None:
            engine.unregister_memory(pool.address)
        del engine
        pool.close()
    return {"te_raw": raw, "te_wait": omni.wait, "te_e2e": omni.e2e, "te_writer": omni.writer}


def _where(store: Any, key: str, names: dict[str, str]) -> str:
    """The owner of the segment that holds ``key`` (``names``: endpoint -> label); untimed."""
    try:
        replicas = store.get_replica_desc(key)
        endpoint = str(replicas[0].get_memory_descriptor().buffer_descriptor.transport_endpoint)
    except Exception as exc:  # diagnostics only: never fail a sample over it
        logger.debug("get_replica_desc(%s) failed: %s", key, exc)
        return "unknown"
    return names.get(endpoint, "an omnikv client")


def _store_case(ctx: _Ctx) -> dict[str, Stats]:
    """Mooncake Store: raw ``put_from`` + ``get_into`` vs ``MooncakeStoreConnector``.

    Called by :func:`_run` with the sender child ready; starts and (in ``finally``) kills its own
    ``mooncake_master``, after every client has left. Raises BenchError on a failed step.
    """
    from omnikv.connectors.mooncake_store.connector import MooncakeStoreConnector

    n, chan, check = ctx.n, ctx.chan, ctx.check
    raw = Stats("raw put+get", [], n)
    raw_put = Stats("  raw put_from", [], n)
    raw_get = Stats("  raw get_into", [], n)
    omni = Stats("omnikv put+wait", [], n)
    omni_put = Stats("  omnikv put_packed - writer", [], n)
    wait_st = Stats("  omnikv wait (size+get_into+remove)", [], n)
    writer = Stats("omnikv writer memcpy (excluded)", [], n)
    pinned = ctx.store_placement == "holder"
    segment = MIN_SEGMENT if pinned else _segment_size(n)
    master = MooncakeMaster()
    holder: Any = None
    store: Any = None
    pool = HostPool(n)
    rx: Any = None
    child_setup = False
    try:
        try:
            master.start()
        except RuntimeError as exc:
            raise BenchError(str(exc)) from exc
        names: dict[str, str] = {}
        if pinned:
            holder = _raw_store(master.metadata_url, master.address, _segment_size(n))
            names[str(holder.get_hostname())] = "holder"
        store = _raw_store(master.metadata_url, master.address, segment, pool)
        names[str(store.get_hostname())] = "raw receiver"
        child_setup = True
        chan.send("st_setup", master.metadata_url, master.address, segment)
        names[str(chan.expect("st_ready", SETUP_TIMEOUT_S)[1])] = "raw sender"
        rx = MooncakeStoreConnector(
            {
                "host": HOST,
                "metadata_server": master.metadata_url,
                "master_server_address": master.address,
                "global_segment_size": segment,
                "local_buffer_size": 16 * MIB,
                "memory_pool_size": pool_size(n),
            }
        )
        for i, which, timed, full in ctx.rounds:
            if which == "raw":
                key = f"raw-{i}"
                chan.send("st_raw", key)
                _, rc, t_put = chan.expect("raw")
                if rc != 0:
                    raise BenchError(f"raw put_from returned {rc}")
                where = _where(store, key, names)
                t0 = time.monotonic()
                got = int(store.get_into(key, pool.address, n))
                t_get = time.monotonic() - t0
                check.check(f"Store raw round {i}", pool.tensor, got, full=full)
                rc = int(store.remove(key, True))
                if rc != 0:
                    logger.warning("remove of %s returned %d", key, rc)
                if timed:
                    ctx.place("raw", where)
                    raw_put.samples.append(float(t_put))
                    raw_get.samples.append(t_get)
                    raw.samples.append(float(t_put) + t_get)
                continue
            key = f"st-{i}"
            chan.send("st_omni", key)
            _, t0_put, t1_put, t_writer = chan.expect("published")
            where = _where(store, f"{key}@{STAGES[0]}_{STAGES[1]}", names)
            took = omni_wait(rx, key, check, f"Store omnikv round {i}", full)
            if timed:
                ctx.place("omnikv", where)
                put = float(t1_put) - float(t0_put) - float(t_writer)
                omni_put.samples.append(put)
                wait_st.samples.append(took)
                omni.samples.append(put + took)
                writer.samples.append(float(t_writer))
    finally:
        if rx is not None:
            rx.close()
        if child_setup:  # the child's clients leave while the master still runs
            with contextlib.suppress(ChannelError, OSError):
                chan.send("st_close")
                chan.expect("closed", SETUP_TIMEOUT_S)
        if store is not None:
            store.unregister_buffer(pool.address)
            store.close()
        if holder is not None:
            holder.close()
        pool.close()
        master.stop()
    return {
        "st_raw": raw,
        "st_raw_put": raw_put,
        "st_raw_get": raw_get,
        "st_omni": omni,
        "st_omni_put": omni_put,
        "st_omni_wait": wait_st,
        "st_writer": writer,
    }


def _memcpy(n: int, rounds: int, warmup: int) -> Stats:
    """The ceiling: ``copy_`` between two page-aligned, pre-faulted buffers of ``n`` bytes."""
    src, dst = HostPool(n), HostPool(n)
    try:
        a, b = src.tensor[:n], dst.tensor[:n]
        a.fill_(7)
        out = Stats("memcpy (aligned, pre-faulted)", [], n)
        for i in range(rounds):
            t0 = time.monotonic()
            b.copy_(a)
            if i >= warmup:
                out.samples.append(time.monotonic() - t0)
        return out
    finally:
        del a, b
        src.close()
        dst.close()


def _run(args: argparse.Namespace, tokens: int) -> int:
    """The receiver's side of a run (:func:`run_against_sender`): the memcpy ceiling, the
    cases, the report. Called by :func:`main`; returns the exit code."""

    def cases(chan: JsonChannel, check: Check) -> tuple[_Ctx, dict[str, Stats]]:
        n = check.n
        results = {"memcpy": _memcpy(n, args.warmup + args.repeat, args.warmup)}
        ctx = _Ctx(chan, n, check, int(args.warmup), int(args.repeat), args.store_placement)
        if args.only in (None, "te"):
            results.update(_te_case(ctx))
        if args.only in (None, "store"):
            results.update(_store_case(ctx))
        return ctx, results

    done = run_against_sender("mooncake", args, tokens, cases, ("--threads", str(args.threads)))
    if done is None:
        return 1
    _, (ctx, results) = done
    return _report(args, ctx, results)


def _report(args: argparse.Namespace, ctx: _Ctx, r: dict[str, Stats]) -> int:
    """Tables, one verdict line per connector, the JSON file; exit code 1 only on bad data."""
    n, check = ctx.n, ctx.check
    memcpy = r["memcpy"]
    ratios: dict[str, float] = {}
    verdicts: list[tuple[str, float, str]] = []
    size = f"{n / MIB:.0f} MiB"
    if "te_raw" in r:
        rows = [memcpy, r["te_raw"], r["te_wait"], r["te_e2e"], r["te_writer"]]
        print_table(rows, baseline=r["te_raw"], title=f"Transfer Engine, {size} (ratio = x raw)")
        ratios["te"] = r["te_raw"].median / r["te_wait"].median
        ratios["te_e2e"] = r["te_raw"].median / r["te_e2e"].median
        verdicts.append(
            (
                "TE: omnikv wait vs raw transfer_sync_write",
                ratios["te"],
                f"(e2e incl. writer memcpy: {ratios['te_e2e']:.2f} x)",
            )
        )
    if "st_raw" in r:
        keys = ("st_raw", "st_raw_put", "st_raw_get", "st_omni", "st_omni_put", "st_omni_wait")
        rows = [memcpy, *(r[k] for k in keys), r["st_writer"]]
        print_table(rows, baseline=r["st_raw"], title=f"Mooncake Store, {size} (ratio = x raw)")
        for case, counts in sorted(ctx.placement.items(), key=lambda kv: kv[0] != "raw"):
            spread = ", ".join(f"{c} on {label}" for label, c in sorted(counts.items()))
            print(f"  {case} objects placed ({ctx.store_placement}): {spread}")
        if ctx.store_placement == "holder" and n <= MIN_SEGMENT:
            print(f"  note: a payload <= {MIN_SEGMENT // MIB} MiB cannot be pinned to the holder")
        ratios["store"] = r["st_raw"].median / r["st_omni"].median
        verdicts.append(
            (
                "Store: omnikv put+wait vs raw put_from+get_into",
                ratios["store"],
                f"(writer memcpy {r['st_writer'].median * 1e3:.1f} ms not counted)",
            )
        )
    print_verdict_head(n)
    for label, ratio, extra in verdicts:
        print(f"  {'PASS' if ratio >= TARGET else 'MISS'}  {label}: {ratio:.2f} x {extra}")
    verified = check.summary()
    write_report(
        "mooncake",
        args,
        check,
        verified,
        r,
        store_placement=ctx.store_placement,
        placement=ctx.placement,
        ratios=ratios,
        targets_met=all(v >= TARGET for v in ratios.values()),
    )
    return 0 if verified else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark (``omnikv bench mooncake``); returns the exit code.

    Called by :mod:`omnikv.cli` and by tests (``main(["--repeat", "1", "--warmup", "0",
    "--size-mib", "8"])``). 0 when every sample verified (speed targets only print PASS / MISS);
    1 when data differed, a step failed, or Mooncake is not installed (with the install hint).
    """
    parser = argparse.ArgumentParser(
        prog="omnikv bench mooncake",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_common_args(parser)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--only", choices=["te", "store"], help="run one connector only")
    parser.add_argument(
        "--store-placement",
        choices=["holder", "any"],
        default="holder",
        help="Store: pin objects to one holder segment (default) or let the master choose",
    )
    parser.add_argument("--json", help="write results to this file")
    args = parser.parse_args(list(argv or []))
    tokens = tokens_of(parser, args)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    _mooncake_env()
    if args.role == "sender":
        missing = unavailable_reason()
        return serve(args.fd, missing, lambda: _Sender(args.model, tokens), _Sender.ops)
    missing = unavailable_reason()
    if missing is not None:
        print(f"omnikv bench mooncake: {missing}", file=sys.stderr)
        return 1
    return _run(args, tokens)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
