"""``omnikv bench nixl``: the NIXL connector's ``wait`` against a raw NIXL READ, same run.

One run, the same bytes for both cases: a KV payload (Qwen2.5-7B, 4096 tokens, fp16: 224 MiB by
default) encoded once with :mod:`omnikv.payload`. The *sender* is a child process (started here
with a socketpair for JSON-lines control messages, no pickle; reaped by PID at the end); the
*receiver* is this process. Both processes run NIXL agents with the UCX backend over loopback
(``UCX_NET_DEVICES=lo`` unless set). Raw and omnikv samples alternate (raw first on even rounds,
omnikv first on odd ones) so drift hits both; warm-up rounds are discarded. Target: omnikv >=
0.85 x the raw READ's throughput at 224 MiB (``ratio = raw median / omnikv median``).

* *raw NIXL READ*: each process has its own ``nixl_agent`` (UCX) and one registered,
  page-aligned, pre-faulted buffer (:class:`~omnikv.connectors._pool.HostPool`); the sender's
  holds the encoded bytes, the receiver loaded the sender's metadata once. Timed in the receiver:
  ``initialize_xfer`` (READ, with a notification, as the connector posts it), ``transfer``,
  polling ``check_xfer_state`` until ``DONE`` with the connector's schedule (sleeps of 20 us
  doubling to 500 us: a tight loop would take a core from UCX on small machines), ``release``.
* *omnikv wait (transport)*: :class:`~omnikv.connectors.nixl.NixlConnector`. The sender
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
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from omnikv.bench.common import (
    MODELS,
    ChannelError,
    JsonChannel,
    Stats,
    describe_payload,
    print_table,
    realistic_payload,
    write_json,
)
from omnikv.bench.mooncake_master import free_ports
from omnikv.connectors._pool import HostPool
from omnikv.connectors.base import ManagedBuffer
from omnikv.connectors.nixl_agent import import_nixl, ucx_defaults, unavailable_reason
from omnikv.connectors.nixl_receiver import POLL_CAP_S, POLL_FIRST_S
from omnikv.payload import decode

__all__ = ["main"]

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"
MIB = 1 << 20
TARGET = 0.85
TARGET_MIB = 224
SETUP_TIMEOUT_S = 300.0
WAIT_BUDGET_S = 60.0
_STAGES = ("0", "1")


class BenchError(RuntimeError):
    """A benchmark step failed (set-up, a transfer, the control channel); reported, exit 1."""


def _crc(t: torch.Tensor) -> int:
    """crc32 (zlib) of a contiguous 1-D uint8 host tensor, read through numpy (no torch threads)."""
    return zlib.crc32(t.numpy().data)


def _bytes_of(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def _same(data: dict[str, Any], source: dict[str, list[torch.Tensor]]) -> bool:
    """Every decoded tensor equals its source tensor (dtype, shape, bytes), compared in numpy."""
    for cache in ("key_cache", "value_cache"):
        for got, want in zip(data["layer_blocks"][cache], source[cache], strict=True):
            if got is None or got.dtype != want.dtype or got.shape != want.shape:
                return False
            if not np.array_equal(_bytes_of(got), _bytes_of(want)):
                return False
    return True


def _pool_size(n: int) -> int:
    """Connector pool size for one ``n``-byte payload in flight (plus alignment headroom)."""
    return n + 4 * MIB


def _nixl_env() -> None:
    """Loopback UCX for both processes (an operator's setting wins)."""
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")


def _die_with_parent() -> None:
    """Child only: SIGKILL this process when its parent dies (next to the channel's EOF)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG


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
        payload = realistic_payload(model, tokens)
        plan = payload.plan()
        self.n = plan.nbytes
        self.src = HostPool(self.n)
        plan.pack_into(self.src.tensor[: self.n])
        self.src_view = self.src.tensor[: self.n]
        self.raw: _RawAgent | None = None
        self.conn: Any = None

    def op_setup(self, zmq_port: int) -> list[Any]:
        """Raw agent over the source bytes, and the sender connector: ``["ready2", md, addr]``."""
        from omnikv.connectors.nixl import NixlConnector

        self.raw = _RawAgent(f"bench-raw-tx-{os.getpid()}", self.src)
        self.conn = NixlConnector(
            {
                "role": "sender",
                "host": HOST,
                "zmq_port": zmq_port,
                "memory_pool_size": _pool_size(self.n),
            }
        )
        return ["set_up", self.raw.metadata_b64(), self.src.address]

    def op_omni(self, key: str) -> list[Any]:
        """``put_packed`` under ``key``: ``["published", t_start, t_end, writer_seconds]``."""
        src = self.src_view.numpy()
        took: list[float] = []

        def write(dst: torch.Tensor) -> None:
            t0 = time.monotonic()
            np.copyto(dst.numpy(), src)
            took.append(time.monotonic() - t0)

        t0 = time.monotonic()
        ok, _, _ = self.conn.put_packed(*_STAGES, key, self.n, write, deadline=t0 + WAIT_BUDGET_S)
        t1 = time.monotonic()
        if not ok:
            raise BenchError(f"put_packed of {key} failed")
        if self.raw is not None:
            self.raw.agent.get_new_notifs()  # drop the raw READs' notifications (untimed)
        return ["published", t0, t1, took[0]]

    def close(self) -> None:
        conn, self.conn = self.conn, None
        if conn is not None:
            conn.close()
        raw, self.raw = self.raw, None
        if raw is not None:
            raw.close()
        self.src.close()


def _sender_main(fd: int, model: str, tokens: int) -> int:
    """Child entry point: answer the parent's commands until ``stop`` or EOF, then clean up."""
    _die_with_parent()
    chan = JsonChannel(socket.socket(fileno=fd))
    missing = unavailable_reason()
    if missing is not None:
        chan.send("error", missing)
        return 1
    try:
        sender = _Sender(model, tokens)
    except Exception as exc:
        chan.send("error", f"{type(exc).__name__}: {exc}")
        return 1
    ops: dict[str, Callable[..., list[Any]]] = {"setup": sender.op_setup, "omni": sender.op_omni}
    chan.send("ready", os.getpid(), _crc(sender.src_view), sender.n)
    try:
        while True:
            try:
                msg = chan.recv()
            except (EOFError, OSError):
                break
            if msg[0] == "stop":
                break
            try:
                reply = ops[msg[0]](*msg[1:])
            except Exception as exc:
                logger.debug("command %s failed", msg[0], exc_info=True)
                reply = ["error", f"{msg[0]}: {type(exc).__name__}: {exc}"]
            try:
                chan.send(*reply)
            except OSError:
                break
    finally:
        sender.close()
        chan.close()
    return 0


# -- receiver (this process) ---------------------------------------------------------------------
@dataclass
class _Check:
    """Verification of received samples, outside the timed regions (then the bytes are wiped)."""

    n: int
    crc: int
    source: dict[str, list[torch.Tensor]]
    failures: list[str] = field(default_factory=list)
    checked: int = 0
    decoded: int = 0

    def check(self, label: str, t: torch.Tensor, size: int, *, full: bool) -> bool:
        self.checked += 1
        ok = size == self.n and t.numel() >= self.n
        if ok:
            view = t[: self.n]
            ok = _crc(view) == self.crc
            if ok and full:
                self.decoded += 1
                try:
                    ok = _same(decode(view), self.source)
                except ValueError:  # DecodeError
                    ok = False
            view.numpy().fill(0xA5)
        if not ok:
            self.failures.append(label)
            print(f"FAIL  {label}: received data differ from the payload", flush=True)
        return ok


@dataclass
class _Results:
    raw: Stats
    wait: Stats
    e2e: Stats
    writer: Stats


def _omni_wait(conn: Any, key: str, check: _Check, label: str, full: bool) -> float:
    """Receiver: ``wait`` for an already published key; returns the seconds ``wait`` took."""
    t0 = time.monotonic()
    got = conn.wait(*_STAGES, key, deadline=t0 + WAIT_BUDGET_S)
    t1 = time.monotonic()
    if got is None:
        raise BenchError(f"{label}: wait returned nothing within {WAIT_BUDGET_S:.0f} s")
    if not isinstance(got, ManagedBuffer):
        raise BenchError(f"{label}: wait returned {type(got).__name__}, not a ManagedBuffer")
    try:
        check.check(label, got.tensor, got.size, full=full)
    finally:
        got.release()
    return t1 - t0


def _rounds(
    chan: JsonChannel, rx: Any, raw: _RawAgent, src_addr: int, check: _Check, args: Any
) -> _Results:
    n = check.n
    res = _Results(
        Stats("raw NIXL READ", [], n),
        Stats("omnikv wait (transport)", [], n),
        Stats("omnikv put->in hand (e2e)", [], n),
        Stats("omnikv writer memcpy (in e2e)", [], n),
    )
    rounds = args.warmup + args.repeat
    for i in range(rounds):
        timed = i >= args.warmup
        full = i in (args.warmup, rounds - 1)
        for which in ("raw", "omni") if i % 2 == 0 else ("omni", "raw"):
            if which == "raw":
                took = raw.read(src_addr, n, f"raw-{i}".encode())
                check.check(f"raw round {i}", raw.pool.tensor, n, full=full)
                if timed:
                    res.raw.samples.append(took)
                continue
            key = f"nixl-{i}"
            chan.send("omni", key)
            _, t_put, _, t_writer = chan.expect("published")
            t_call = time.monotonic()
            took = _omni_wait(rx, key, check, f"omnikv round {i}", full)
            if timed:
                res.wait.samples.append(took)
                res.e2e.samples.append(t_call + took - float(t_put))
                res.writer.samples.append(float(t_writer))
    return res


def _case(chan: JsonChannel, check: _Check, args: Any) -> _Results:
    """Set up both sides (raw agents, connectors), run the alternated rounds, tear down."""
    from omnikv.connectors.nixl import NixlConnector

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
                "memory_pool_size": _pool_size(n),
            }
        )
        return _rounds(chan, rx, raw, int(src_addr), check, args)
    finally:
        if rx is not None:
            rx.close()
        if raw is not None:
            raw.close()
        pool.close()


def _spawn_sender(
    args: argparse.Namespace, tokens: int
) -> tuple[subprocess.Popen[bytes], JsonChannel]:
    """Start the sender child (``--role sender``) with one end of a socketpair passed by fd."""
    parent, child = socket.socketpair()
    cmd = [
        sys.executable, "-m", "omnikv.cli", "bench", "nixl", "--role", "sender",
        "--fd", str(child.fileno()), "--model", args.model, "--tokens", str(tokens),
    ]  # fmt: skip
    try:
        proc = subprocess.Popen(cmd, pass_fds=[child.fileno()], env=dict(os.environ))
    except BaseException:
        parent.close()
        raise
    finally:
        child.close()
    return proc, JsonChannel(parent)


def _reap(proc: subprocess.Popen[bytes], chan: JsonChannel) -> None:
    """Stop the sender child: ``stop``, a bounded wait, then SIGKILL by PID."""
    with contextlib.suppress(OSError):
        chan.send("stop")
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    chan.close()


def _encode_check(args: argparse.Namespace, tokens: int) -> _Check:
    """Encode the payload here too (same seed); its crc32 and tensors verify every sample."""
    payload = realistic_payload(args.model, tokens)
    plan = payload.plan()
    n = plan.nbytes
    print(
        f"{describe_payload(args.model, tokens, payload, n)}; {args.repeat} timed rounds "
        f"after {args.warmup} warm-up",
        flush=True,
    )
    enc = HostPool(n)
    try:
        view = enc.tensor[:n]
        plan.pack_into(view)
        expected = _crc(view)
        if not _same(decode(view), payload.layer_blocks):
            raise BenchError("local encode/decode round trip differs")
        del view
    finally:
        enc.close()
    return _Check(n, expected, payload.layer_blocks)


def _run(args: argparse.Namespace, tokens: int) -> int:
    """The receiver's side of a run; the sender child is reaped whatever happens."""
    try:
        check = _encode_check(args, tokens)
    except BenchError as exc:
        print(f"FAIL  {exc}")
        return 1
    proc, chan = _spawn_sender(args, tokens)
    error = ""
    try:
        ready = chan.expect("ready", SETUP_TIMEOUT_S)
        if int(ready[2]) != check.crc or int(ready[3]) != check.n:
            raise BenchError("the sender encoded different bytes from the same seed")
        results = _case(chan, check, args)
    except (BenchError, ChannelError) as exc:
        error = str(exc)
    finally:
        _reap(proc, chan)
    if error:
        print(f"FAIL  {error}")
        return 1
    return _report(args, check, results)


def _report(args: argparse.Namespace, check: _Check, r: _Results) -> int:
    """The table, the verdict line, the JSON file; exit code 1 only on bad data."""
    n = check.n
    size = f"{n / MIB:.0f} MiB"
    print_table([r.raw, r.wait, r.e2e, r.writer], baseline=r.raw, title=f"NIXL, {size}")
    ratio = r.raw.median / r.wait.median
    ratio_e2e = r.raw.median / r.e2e.median
    print(f"\nVerdict (target: omnikv >= {TARGET} x raw throughput at {TARGET_MIB} MiB)")
    if round(n / MIB) != TARGET_MIB:
        print(f"  note: {size} payload; the target is defined at {TARGET_MIB} MiB")
    verdict = "PASS" if ratio >= TARGET else "MISS"
    print(
        f"  {verdict}  NIXL: omnikv wait vs raw READ: {ratio:.2f} x "
        f"(e2e incl. writer memcpy: {ratio_e2e:.2f} x)"
    )
    verified = not check.failures
    if verified:
        print(f"  data: OK ({check.checked} samples crc32-checked, {check.decoded} fully decoded)")
    else:
        print(f"  FAIL  data: {len(check.failures)} bad samples: {', '.join(check.failures[:5])}")
    stats = {"raw": r.raw, "wait": r.wait, "e2e": r.e2e, "writer": r.writer}
    write_json(
        args.json,
        {
            "bench": "nixl",
            "model": args.model,
            "nbytes": n,
            "repeat": args.repeat,
            "warmup": args.warmup,
            "results": {k: {**s.as_dict(), "samples_s": s.samples} for k, s in stats.items()},
            "ratios": {"nixl": ratio, "nixl_e2e": ratio_e2e},
            "target": TARGET,
            "target_met": ratio >= TARGET,
            "verified": verified,
            "samples_checked": check.checked,
            "samples_decoded": check.decoded,
            "failures": check.failures,
        },
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
    parser.add_argument("--size-mib", type=int, default=TARGET_MIB, help="KV payload size (MiB)")
    parser.add_argument("--tokens", type=int, default=0, help="tokens (overrides --size-mib)")
    parser.add_argument("--model", default="qwen2.5-7b", choices=sorted(MODELS))
    parser.add_argument("--repeat", type=int, default=10, help="timed rounds per case")
    parser.add_argument("--warmup", type=int, default=2, help="discarded rounds per case")
    parser.add_argument("--json", help="write results to this file")
    parser.add_argument("--role", default="receiver", help=argparse.SUPPRESS)
    parser.add_argument("--fd", type=int, default=-1, help=argparse.SUPPRESS)
    args = parser.parse_args(list(argv or []))
    if args.repeat < 1 or args.warmup < 0 or args.size_mib < 1 or args.tokens < 0:
        parser.error("--repeat and --size-mib must be >= 1, --warmup and --tokens >= 0")
    layers, heads, dim = MODELS[args.model]
    tokens = args.tokens or max(1, args.size_mib * MIB // (2 * layers * heads * dim * 2))
    _nixl_env()
    if args.role == "sender":
        return _sender_main(args.fd, args.model, tokens)
    missing = unavailable_reason()
    if missing is not None:
        print(f"FAIL  {missing}")
        return 1
    return _run(args, tokens)
