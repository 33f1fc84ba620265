"""What the alternating raw-vs-omnikv benchmarks of the pull transports share.

``omnikv bench nixl`` and ``omnikv bench mooncake`` run the same experiment: the receiver (this
process) encodes a realistic KV payload, starts a sender child (``--role sender``, a socketpair
of JSON lines, no pickle; reaped by PID), and alternates raw and omnikv samples of the same bytes
(raw first on even rounds, omnikv first on odd ones), verifying every sample outside the timed
regions. This module holds that frame: the command line, the payload and its verification, the
child's command loop and publishing, the receiver's ``wait`` sample, the round order, spawning
and reaping. Each benchmark keeps its own transports, cases and report.
"""

from __future__ import annotations

import argparse
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
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import numpy as np
import torch

from omnikv.bench.common import (
    MODELS,
    ChannelError,
    JsonChannel,
    Stats,
    describe_payload,
    realistic_payload,
    reap,
    serve_commands,
    spawn_bench_child,
    write_json,
)
from omnikv.connectors.base import ManagedBuffer
from omnikv.connectors.pool import HostPool
from omnikv.wire.decode import decode

__all__ = [
    "MIB",
    "SETUP_TIMEOUT_S",
    "STAGES",
    "TARGET",
    "TARGET_MIB",
    "WAIT_BUDGET_S",
    "BenchError",
    "Check",
    "Rounds",
    "Source",
    "TransportSamples",
    "add_common_args",
    "crc",
    "encode_check",
    "omni_wait",
    "pool_size",
    "print_verdict_head",
    "reap",
    "run_against_sender",
    "serve",
    "spawn_sender",
    "tokens_of",
    "write_report",
]

logger = logging.getLogger(__name__)

MIB = 1 << 20
TARGET = 0.85
TARGET_MIB = 224
SETUP_TIMEOUT_S = 300.0
WAIT_BUDGET_S = 60.0
STAGES = ("0", "1")

Op = Callable[..., list[Any]]


class BenchError(RuntimeError):
    """A benchmark step failed (set-up, a transfer, the control channel); reported, exit 1."""


# -- command line ----------------------------------------------------------------------------------
def add_common_args(parser: argparse.ArgumentParser) -> None:
    """Payload size/model, rounds and the hidden child options (``--role``, ``--fd``)."""
    parser.add_argument("--size-mib", type=int, default=TARGET_MIB, help="KV payload size (MiB)")
    parser.add_argument("--tokens", type=int, default=0, help="tokens (overrides --size-mib)")
    parser.add_argument(
        "--model",
        default="qwen2.5-7b",
        choices=sorted(MODELS),
        help="the model whose KV shape is sent",
    )
    parser.add_argument("--repeat", type=int, default=10, help="timed rounds per case")
    parser.add_argument("--warmup", type=int, default=2, help="discarded rounds per case")
    parser.add_argument("--role", default="receiver", help=argparse.SUPPRESS)
    parser.add_argument("--fd", type=int, default=-1, help=argparse.SUPPRESS)


def tokens_of(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Check the common arguments (``parser.error`` on bad ones); the payload's token count."""
    if args.repeat < 1 or args.warmup < 0 or args.size_mib < 1 or args.tokens < 0:
        parser.error("--repeat and --size-mib must be >= 1, --warmup and --tokens >= 0")
    layers, heads, dim = MODELS[args.model]
    per_token = 2 * layers * heads * dim * 2
    return int(args.tokens or max(1, args.size_mib * MIB // per_token))


# -- helpers shared by both processes --------------------------------------------------------------
def crc(t: torch.Tensor) -> int:
    """crc32 (zlib) of a contiguous 1-D uint8 host tensor, read through numpy (no torch threads)."""
    return zlib.crc32(t.numpy().data)


def _bytes_of(t: torch.Tensor) -> np.ndarray:
    """A flat uint8 numpy view (a copy only if ``t`` is not contiguous) of a host tensor."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def _same(data: dict[str, Any], source: dict[str, list[torch.Tensor]]) -> bool:
    """Every decoded tensor equals its source tensor (dtype, shape, bytes).

    Compared with numpy, single-threaded: a parallel torch op would leave OpenMP workers
    spinning into the next timed sample.
    """
    for cache in ("key_cache", "value_cache"):
        for got, want in zip(data["layer_blocks"][cache], source[cache], strict=True):
            if got is None or got.dtype != want.dtype or got.shape != want.shape:
                return False
            if not np.array_equal(_bytes_of(got), _bytes_of(want)):
                return False
    return True


def pool_size(n: int) -> int:
    """Connector pool size for one ``n``-byte payload in flight (plus alignment headroom)."""
    return n + 4 * MIB


# -- the sender child ------------------------------------------------------------------------------
class Source:
    """The child's encoded payload in a page-aligned, pre-faulted host pool, and publishing it."""

    def __init__(self, model: str, tokens: int) -> None:
        payload = realistic_payload(model, tokens)
        plan = payload.plan()
        self.n = plan.nbytes
        self.pool = HostPool(self.n)
        plan.pack_into(self.pool.tensor[: self.n])
        self.view = self.pool.tensor[: self.n]

    def writer(self, took: list[float]) -> Callable[[torch.Tensor], None]:
        """A ``put_packed`` writer that copies the pre-encoded bytes and records its own time.

        A single-threaded numpy copy: a parallel torch ``copy_`` leaves OpenMP workers spinning
        for a while afterwards, and on a machine with few cores they slow the transfer that
        follows, which would charge the writer's side effect to the transport.
        """
        src = self.view.numpy()

        def write(dst: torch.Tensor) -> None:
            t0 = time.monotonic()
            np.copyto(dst.numpy(), src)
            took.append(time.monotonic() - t0)

        return write

    def publish(self, conn: Any, key: str) -> list[Any]:
        """``put_packed`` under ``key``: ``["published", t_start, t_end, writer_seconds]``."""
        took: list[float] = []
        t0 = time.monotonic()
        ok, _, _ = conn.put_packed(
            *STAGES, key, self.n, self.writer(took), deadline=t0 + WAIT_BUDGET_S
        )
        t1 = time.monotonic()
        if not ok:
            raise BenchError(f"put_packed of {key} failed")
        return ["published", t0, t1, took[0]]

    def close(self) -> None:
        self.pool.close()


def _die_with_parent() -> None:
    """Child only: ask Linux to SIGKILL this process when its parent dies (belt and braces
    next to the control channel's EOF, for a child stuck inside an engine call)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG


class _Closable(Protocol):
    src: Source

    def close(self) -> None: ...


_S = TypeVar("_S", bound=_Closable)


def serve(
    fd: int,
    unavailable: str | None,
    build: Callable[[], _S],
    ops: Callable[[_S], Mapping[str, Op]],
) -> int:
    """Child entry point: answer the parent's commands until ``stop`` or EOF, then clean up.

    Sends ``["ready", pid, crc32, nbytes]`` once ``build()`` made the sender; replies
    ``["error", text]`` to a command that failed (the parent aborts the run) and to a missing
    transport (``unavailable``); exits when the channel closes, so a dead parent never leaves
    it behind.
    """
    _die_with_parent()
    chan = JsonChannel(socket.socket(fileno=fd))
    if unavailable is not None:
        chan.send("error", unavailable)
        return 1
    try:
        sender = build()
    except Exception as exc:
        chan.send("error", f"{type(exc).__name__}: {exc}")
        return 1
    table = ops(sender)
    chan.send("ready", os.getpid(), crc(sender.src.view), sender.src.n)
    try:
        serve_commands(chan, table)
    finally:
        sender.close()
        chan.close()
    return 0


def spawn_sender(
    bench: str, args: argparse.Namespace, tokens: int, extra: Sequence[str] = ()
) -> tuple[subprocess.Popen[bytes], JsonChannel]:
    """Start ``omnikv bench <bench> --role sender`` (this process's environment, ``extra``
    options) with one end of a socketpair passed by fd."""
    options = ["--model", args.model, "--tokens", str(tokens), *extra]
    return spawn_bench_child(bench, "sender", options)


# -- the receiver (this process) -------------------------------------------------------------------
@dataclass
class Check:
    """The receiver's verification of received samples (called outside the timed regions).

    ``check`` compares size and crc32 with the locally encoded payload, optionally decodes and
    compares every tensor, records a failure, and then overwrites the buffer (``0xA5``) so that
    a later sample landing in the same memory cannot pass on stale bytes.
    """

    n: int
    crc: int
    source: dict[str, list[torch.Tensor]]
    failures: list[str] = field(default_factory=list)
    checked: int = 0
    decoded: int = 0

    def check(self, label: str, t: torch.Tensor, size: int, *, full: bool) -> bool:
        """Verify one received sample (first ``n`` bytes of ``t``); True when it matches."""
        self.checked += 1
        ok = size == self.n and t.numel() >= self.n
        if ok:
            view = t[: self.n]
            ok = crc(view) == self.crc
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

    def summary(self) -> bool:
        """Print the data line of the verdict; True when every sample verified."""
        if not self.failures:
            print(
                f"  data: OK ({self.checked} samples crc32-checked, {self.decoded} fully decoded)"
            )
            return True
        print(f"  FAIL  data: {len(self.failures)} bad samples: {', '.join(self.failures[:5])}")
        return False


def encode_check(args: argparse.Namespace, tokens: int) -> Check:
    """Encode the payload here too (same seed); its crc32 and tensors verify every sample.

    Prints the run's first line (payload, rounds); raises BenchError if the local
    encode/decode round trip differs.
    """
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
        expected = crc(view)
        if not _same(decode(view), payload.layer_blocks):
            raise BenchError("local encode/decode round trip differs")
        del view
    finally:
        enc.close()
    return Check(n, expected, payload.layer_blocks)


_R = TypeVar("_R")


def run_against_sender(
    bench: str,
    args: argparse.Namespace,
    tokens: int,
    cases: Callable[[JsonChannel, Check], _R],
    extra: Sequence[str] = (),
) -> tuple[Check, _R] | None:
    """The receiver's side of a run: encode the payload here (:func:`encode_check`), start the
    sender child (:func:`spawn_sender` with ``extra``), see that it encoded the same bytes, run
    ``cases(chan, check)`` against it and reap it whatever happens (``stop``, bounded wait,
    SIGKILL by PID). The check and what ``cases`` returned, or ``None`` once ``FAIL`` and the
    reason are printed (a local round trip that differs, a step that failed)."""
    try:
        check = encode_check(args, tokens)
    except BenchError as exc:
        print(f"FAIL  {exc}")
        return None
    proc, chan = spawn_sender(bench, args, tokens, extra)
    try:
        ready = chan.expect("ready", SETUP_TIMEOUT_S)
        if int(ready[2]) != check.crc or int(ready[3]) != check.n:
            raise BenchError("the sender encoded different bytes from the same seed")
        return check, cases(chan, check)
    except (BenchError, ChannelError) as exc:
        error = str(exc)
    finally:
        reap(proc, chan)
    print(f"FAIL  {error}")
    return None


def print_verdict_head(n: int) -> None:
    """The verdict's first lines: the target, and a note when the payload of ``n`` bytes is
    not the size the target is defined at."""
    print(f"\nVerdict (target: omnikv >= {TARGET} x raw throughput at {TARGET_MIB} MiB)")
    if round(n / MIB) != TARGET_MIB:
        print(f"  note: {n / MIB:.0f} MiB payload; the target is defined at {TARGET_MIB} MiB")


def write_report(
    bench: str,
    args: argparse.Namespace,
    check: Check,
    verified: bool,
    stats: Mapping[str, Stats],
    **fields: Any,
) -> None:
    """Write the run's JSON file (``--json``; nothing without it): the run's shape, the
    benchmark's own ``fields`` (ratios, targets), every figure with its samples and what the
    data check found."""
    write_json(
        args.json,
        {
            "bench": bench,
            "model": args.model,
            "nbytes": check.n,
            "repeat": args.repeat,
            "warmup": args.warmup,
            **fields,
            "results": {k: {**s.as_dict(), "samples_s": s.samples} for k, s in stats.items()},
            "target": TARGET,
            "verified": verified,
            "samples_checked": check.checked,
            "samples_decoded": check.decoded,
            "failures": check.failures,
        },
    )


def omni_wait(conn: Any, key: str, check: Check, label: str, full: bool) -> float:
    """Receiver: ``wait`` for an already published key; returns the seconds ``wait`` took.

    Verifies and releases the ManagedBuffer after the timing; raises BenchError when nothing
    arrived by the deadline.
    """
    t0 = time.monotonic()
    got = conn.wait(*STAGES, key, deadline=t0 + WAIT_BUDGET_S)
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


@dataclass(frozen=True)
class Rounds:
    """The alternation: ``warmup`` discarded rounds, then ``repeat`` timed ones."""

    warmup: int
    repeat: int

    def __iter__(self) -> Iterator[tuple[int, str, bool, bool]]:
        """``(round, "raw" | "omni", timed, full)``: raw first on even rounds, omnikv first on
        odd ones; ``full`` (decode and compare) on the first and the last timed round."""
        rounds = self.warmup + self.repeat
        for i in range(rounds):
            timed = i >= self.warmup
            full = i in (self.warmup, rounds - 1)
            for which in ("raw", "omni") if i % 2 == 0 else ("omni", "raw"):
                yield i, which, timed, full


@dataclass
class TransportSamples:
    """The omnikv side of a transport case: the sender publishes, the receiver ``wait``\\ s.

    ``wait``: the receiver's ``wait`` call to the buffer in hand (the verdict's figure);
    ``e2e``: from the start of the sender's ``put_packed`` to the data in hand (one clock for
    the node); ``writer``: the writer's memcpy inside ``e2e``.
    """

    wait: Stats
    e2e: Stats
    writer: Stats

    @classmethod
    def of(cls, n: int) -> TransportSamples:
        return cls(
            Stats("omnikv wait (transport)", [], n),
            Stats("omnikv put->in hand (e2e)", [], n),
            Stats("omnikv writer memcpy (in e2e)", [], n),
        )

    def sample(
        self,
        chan: JsonChannel,
        op: str,
        conn: Any,
        key: str,
        check: Check,
        label: str,
        *,
        timed: bool,
        full: bool,
    ) -> None:
        """Ask the child to publish ``key`` (command ``op``), then time this side's ``wait``."""
        chan.send(op, key)
        _, t_put, _, t_writer = chan.expect("published")
        t_call = time.monotonic()
        took = omni_wait(conn, key, check, label, full)
        if timed:
            self.wait.samples.append(took)
            self.e2e.samples.append(t_call + took - float(t_put))
            self.writer.samples.append(float(t_writer))
