"""``omnikv bench nixl``: the NIXL connector's ``wait`` against a raw NIXL READ, same run.

One run, the same bytes for both cases: a KV payload (Qwen2.5-7B, 4096 tokens, fp16: 224 MiB by
default) encoded once with :mod:`omnikv.wire.encode`. The *sender* is a child process (started here
with a socketpair for JSON-lines control messages, no pickle; reaped by PID at the end); the
*receiver* is this process. Both processes run NIXL agents with the UCX backend over loopback
(``UCX_NET_DEVICES=lo`` unless set). Raw and omnikv samples alternate (raw first on even rounds,
omnikv first on odd ones) so drift hits both; warm-up rounds are discarded. Target: omnikv >=
0.85 x the raw READ's throughput at 224 MiB (``ratio = raw median / omnikv median``).

* *raw NIXL READ*: each process has its own ``nixl_agent`` (UCX) and one registered,
  page-aligned, pre-faulted buffer (:class:`~omnikv.connectors.pool.HostPool`); the sender's
  holds the encoded bytes, the receiver loaded the sender's metadata once. Timed in the receiver:
  ``initialize_xfer`` (READ, with a notification, as the connector posts it), ``transfer``,
  polling ``check_xfer_state`` until ``DONE`` with the connector's schedule (sleeps of 20 us
  doubling to 500 us: a tight loop would take a core from UCX on small machines), ``release``.
* *omnikv wait (transport)*: :class:`~omnikv.connectors.nixl.connector.NixlConnector`. The sender
  ``put_packed``\\ s (its writer copies the pre-encoded bytes into the registered slot, one
  single-threaded numpy copy) and acks "published"; then the receiver times ``wait`` from the
  call to the returned buffer: claim (control round trip), receive-slot allocation, the READ,
  its polling. Both sides start with the bytes in registered memory: transport against
  transport. This is the figure the verdict uses.
* *omnikv put->in hand (e2e)*: the same samples from the start of ``put_packed`` in the sender
  to the data in hand in the receiver (``CLOCK_MONOTONIC``, one clock for the node): includes
  the writer's memcpy (reported on its own line) and this benchmark's "published" ack.

Verification, outside every timed region: the receiver checks the crc32 of every received
sample (raw and omnikv) against the payload it encoded itself from the same seed, decodes the
first and last omnikv sample and compares every tensor, then overwrites the receive buffer so a
later sample cannot pass on stale bytes. Any mismatch prints ``FAIL`` and the exit code is 1;
missing the speed target only prints ``MISS`` (exit code 0).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from omnikv.bench._alternate import (
    MIB,
    SETUP_TIMEOUT_S,
    TARGET,
    BenchError,
    Check,
    Rounds,
    Source,
    TransportSamples,
    add_common_args,
    pool_size,
    print_verdict_head,
    run_against_sender,
    serve,
    tokens_of,
    write_report,
)
from omnikv.bench.common import (
    JsonChannel,
    Stats,
    print_table,
)
from omnikv.bench.mooncake_master import free_ports
from omnikv.connectors.nixl.agent import import_nixl, ucx_defaults, unavailable_reason
from omnikv.connectors.nixl.receiving import POLL_CAP_S, POLL_FIRST_S
from omnikv.connectors.pool import HostPool

__all__ = ["main"]

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"


def _nixl_env() -> None:
    """Loopback UCX for both processes (an operator's setting wins)."""
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")


class _RawAgent:
    """A raw ``nixl_agent`` (UCX) with one registered pool: the baseline, no omnikv code."""

    def __init__(self, name: str, pool: HostPool) -> None:
        ucx_defaults()  # the same UCX module choice as the connector (see nixl_agent)
        api = import_nixl()
        self.agent = api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))
        self.pool = pool
        self.reg = self.agent.register_memory([(pool.address, pool.size, 0, "")], "DRAM")
        self.remote = ""

    def metadata_b64(self) -> str:
        return base64.b64encode(self.agent.get_agent_metadata()).decode()

    def add_remote(self, md_b64: str) -> None:
        name = self.agent.add_remote_agent(base64.b64decode(md_b64))
        self.remote = name.decode() if isinstance(name, bytes) else str(name)

    def read(self, remote_addr: int, n: int, notif: bytes) -> float:
        """One timed READ of ``n`` bytes into the pool's start; returns its seconds."""
        agent = self.agent
        t0 = time.monotonic()
        local = agent.get_xfer_descs([(self.pool.address, n, 0)], "DRAM")
        far = agent.get_xfer_descs([(remote_addr, n, 0)], "DRAM")
        handle = agent.initialize_xfer("READ", local, far, self.remote, notif)
        state = agent.transfer(handle)
        step = POLL_FIRST_S
        while state == "PROC":
            time.sleep(step)
            step = min(step * 2, POLL_CAP_S)
            state = agent.check_xfer_state(handle)
        handle.release()
        took = time.monotonic() - t0
        if state != "DONE":
            raise BenchError(f"raw NIXL READ ended in state {state}")
        return took

    def close(self) -> None:
        if self.remote:
            with contextlib.suppress(Exception):
                self.agent.remove_remote_agent(self.remote)
        self.agent.deregister_memory(self.reg)
        self.agent = None


# -- sender (child process) ----------------------------------------------------------------------
class _Sender:
    """The child's state: the encoded payload, a raw agent holding it, the sender connector."""

    def __init__(self, model: str, tokens: int) -> None:
        self.src = Source(model, tokens)
        self.raw: _RawAgent | None = None
        self.conn: Any = None

    def op_setup(self, zmq_port: int) -> list[Any]:
        """Raw agent over the source bytes, and the sender connector: ``["set_up", md, addr]``."""
        from omnikv.connectors.nixl.connector import NixlConnector

        self.raw = _RawAgent(f"bench-raw-tx-{os.getpid()}", self.src.pool)
        self.conn = NixlConnector(
            {
                "role": "sender",
                "host": HOST,
                "zmq_port": zmq_port,
                "memory_pool_size": pool_size(self.src.n),
            }
        )
        return ["set_up", self.raw.metadata_b64(), self.src.pool.address]

    def op_omni(self, key: str) -> list[Any]:
        """``put_packed`` under ``key``: ``["published", t_start, t_end, writer_seconds]``."""
        reply = self.src.publish(self.conn, key)
        if self.raw is not None:
            self.raw.agent.get_new_notifs()  # drop the raw READs' notifications (untimed)
        return reply

    def ops(self) -> dict[str, Callable[..., list[Any]]]:
        return {"setup": self.op_setup, "omni": self.op_omni}

    def close(self) -> None:
        conn, self.conn = self.conn, None
        if conn is not None:
            conn.close()
        raw, self.raw = self.raw, None
        if raw is not None:
            raw.close()
        self.src.close()


# -- receiver (this process) ---------------------------------------------------------------------
@dataclass
class _Results:
    raw: Stats
    omni: TransportSamples


def _rounds(
    chan: JsonChannel, rx: Any, raw: _RawAgent, src_addr: int, check: Check, args: Any
) -> _Results:
    n = check.n
    res = _Results(Stats("raw NIXL READ", [], n), TransportSamples.of(n))
    for i, which, timed, full in Rounds(args.warmup, args.repeat):
        if which == "raw":
            took = raw.read(src_addr, n, f"raw-{i}".encode())
            check.check(f"raw round {i}", raw.pool.tensor, n, full=full)
            if timed:
                res.raw.samples.append(took)
        else:
            key = f"nixl-{i}"
            res.omni.sample(
                chan, "omni", rx, key, check, f"omnikv round {i}", timed=timed, full=full
            )
    return res


def _case(chan: JsonChannel, check: Check, args: Any) -> _Results:
    """Set up both sides (raw agents, connectors), run the alternated rounds, tear down."""
    from omnikv.connectors.nixl.connector import NixlConnector

    n = check.n
    pool = HostPool(n)
    raw: _RawAgent | None = None
    rx: Any = None
    try:
        raw = _RawAgent(f"bench-raw-rx-{os.getpid()}", pool)
        zmq_port = free_ports(1)[0]
        chan.send("setup", zmq_port)
        _, md, src_addr = chan.expect("set_up", SETUP_TIMEOUT_S)
        raw.add_remote(str(md))
        rx = NixlConnector(
            {
                "role": "receiver",
                "host": HOST,
                "sender_host": HOST,
                "sender_zmq_port": zmq_port,
                "memory_pool_size": pool_size(n),
            }
        )
        return _rounds(chan, rx, raw, int(src_addr), check, args)
    finally:
        if rx is not None:
            rx.close()
        if raw is not None:
            raw.close()
        pool.close()


def _run(args: argparse.Namespace, tokens: int) -> int:
    """The receiver's side of a run (:func:`run_against_sender`) and its report."""
    done = run_against_sender("nixl", args, tokens, lambda chan, check: _case(chan, check, args))
    if done is None:
        return 1
    check, results = done
    return _report(args, check, results)


def _report(args: argparse.Namespace, check: Check, r: _Results) -> int:
    """The table, the verdict line, the JSON file; exit code 1 only on bad data."""
    n = check.n
    size = f"{n / MIB:.0f} MiB"
    o = r.omni
    print_table([r.raw, o.wait, o.e2e, o.writer], baseline=r.raw, title=f"NIXL, {size}")
    ratio = r.raw.median / o.wait.median
    ratio_e2e = r.raw.median / o.e2e.median
    print_verdict_head(n)
    verdict = "PASS" if ratio >= TARGET else "MISS"
    print(
        f"  {verdict}  NIXL: omnikv wait vs raw READ: {ratio:.2f} x "
        f"(e2e incl. writer memcpy: {ratio_e2e:.2f} x)"
    )
    verified = check.summary()
    stats = {"raw": r.raw, "wait": o.wait, "e2e": o.e2e, "writer": o.writer}
    write_report(
        "nixl",
        args,
        check,
        verified,
        stats,
        ratios={"nixl": ratio, "nixl_e2e": ratio_e2e},
        target_met=ratio >= TARGET,
    )
    return 0 if verified else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark (``omnikv bench nixl``); returns the exit code.

    0 when every sample verified (the speed target only prints PASS / MISS); 1 when data
    differed, a step failed, or NIXL is not installed (with the install hint).
    """
    parser = argparse.ArgumentParser(
        prog="omnikv bench nixl",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_common_args(parser)
    parser.add_argument("--json", help="write results to this file")
    args = parser.parse_args(list(argv or []))
    tokens = tokens_of(parser, args)
    _nixl_env()
    if args.role == "sender":
        return serve(
            args.fd, unavailable_reason(), lambda: _Sender(args.model, tokens), _Sender.ops
        )
    missing = unavailable_reason()
    if missing is not None:
        print(f"FAIL  {missing}")
        return 1
    return _run(args, tokens)
