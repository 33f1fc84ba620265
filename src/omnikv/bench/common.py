"""Shared helpers for the benchmarks: realistic payloads, timing statistics, table output."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from omnikv.wire.transfer_data import KVCacheTransferData

logger = logging.getLogger(__name__)

__all__ = [
    "MODELS",
    "ChannelError",
    "JsonChannel",
    "Stats",
    "bounded_list",
    "describe_payload",
    "measure",
    "print_table",
    "qwen_payload",
    "realistic_payload",
    "serve_commands",
    "shm_stage_config",
    "write_json",
]

#: name -> (layers, kv_heads, head_dim); fp16, bytes/token = 2 * layers * heads * dim * 2
MODELS: dict[str, tuple[int, int, int]] = {
    "qwen2.5-7b": (28, 4, 128),
    "llama-3.1-8b": (32, 8, 128),
    "qwen3-8b": (36, 8, 128),
}


def realistic_payload(
    model: str = "qwen2.5-7b", tokens: int = 4096, dtype: torch.dtype = torch.float16, seed: int = 0
) -> KVCacheTransferData:
    """A KV payload shaped like ``model``'s cache for ``tokens`` tokens (random values)."""
    layers, heads, dim = MODELS[model]
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(tokens, heads, dim, generator=g).to(dtype)
    keys = [base + i for i in range(layers)]
    values = [base - i for i in range(layers)]
    return KVCacheTransferData(
        "bench-req",
        {"key_cache": keys, "value_cache": values},
        list(range(tokens // 16)),
        {"seq_len": tokens, "model": model},
    )


def qwen_payload(tokens: int = 4096) -> KVCacheTransferData:
    """Qwen2.5-7B, fp16: 56 KiB per token, 224 MiB for 4096 tokens."""
    return realistic_payload("qwen2.5-7b", tokens)


def describe_payload(model: str, tokens: int, payload: KVCacheTransferData, nbytes: int) -> str:
    """The one-line description the benchmarks print first (payload, threads, cores)."""
    tensors = 2 * len(payload.layer_blocks["key_cache"])
    return (
        f"payload: {model}, {tokens} tokens, {nbytes / (1 << 20):.1f} MiB, {tensors} tensors; "
        f"torch threads {torch.get_num_threads()}; cores {os.cpu_count()}"
    )


def bounded_list(
    convert: Callable[[str], float], lo: float, hi: float, what: str
) -> Callable[[str], tuple[Any, ...]]:
    """An argparse ``type`` for a comma-separated list of numbers, each ``convert``ed and in
    ``lo..hi`` (empty items are skipped; at least one is required). The benchmarks' list
    options use it so that a bad value is refused before anything starts, naming ``what`` the
    list holds."""

    def parse(text: str) -> tuple[Any, ...]:
        try:
            values = tuple(convert(part) for part in text.split(",") if part.strip())
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"not a list of {what}: {text!r}") from exc
        if not values or any(not lo <= v <= hi for v in values):
            raise argparse.ArgumentTypeError(f"{what} must be {lo:g}..{hi:g}, got {text!r}")
        return values

    return parse


class ChannelError(RuntimeError):
    """The benchmark peer did not answer as expected (closed, timed out, reported an error)."""


class JsonChannel:
    """JSON lines over one end of a socketpair: the benchmarks' control channel (never pickle).

    Used by ``bench shm`` and ``bench mooncake`` between this process and the peer process they
    start. ``recv`` raises ``EOFError`` when the peer closed and ``TimeoutError`` after
    ``timeout_s`` (``None``: wait for ever; a child's wait ends with EOF when its parent dies).
    """

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._rf = sock.makefile("rb")

    def send(self, *msg: Any) -> None:
        self.sock.sendall(json.dumps(list(msg)).encode() + b"\n")

    def recv(self, timeout_s: float | None = None) -> list[Any]:
        self.sock.settimeout(timeout_s)
        line = self._rf.readline()
        if not line:
            raise EOFError("peer closed the control channel")
        out: list[Any] = json.loads(line)
        return out

    def expect(self, tag: str, timeout_s: float | None = 120.0) -> list[Any]:
        """The next message, which must be ``[tag, ...]``; ``ChannelError`` otherwise (a peer's
        ``["error", text]`` included)."""
        try:
            msg = self.recv(timeout_s)
        except (EOFError, TimeoutError, OSError) as exc:
            raise ChannelError(f"peer process: no {tag!r} reply ({exc})") from exc
        if msg and msg[0] == "error":
            raise ChannelError(f"peer process: {msg[1] if len(msg) > 1 else msg}")
        if not msg or msg[0] != tag:
            raise ChannelError(f"peer process: expected {tag!r}, got {msg!r}")
        return msg

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._rf.close()
        self.sock.close()


@dataclass
class Stats:
    """Seconds per run after warm-up; GB/s derived for ``nbytes``."""

    name: str
    samples: list[float]
    nbytes: int = 0

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def p99(self) -> float:
        s = sorted(self.samples)
        return s[min(len(s) - 1, round(0.99 * (len(s) - 1)))]

    @property
    def spread(self) -> tuple[float, float]:
        return min(self.samples), max(self.samples)

    def gbps(self, seconds: float | None = None) -> float:
        sec = self.median if seconds is None else seconds
        return self.nbytes / sec / 1e9 if sec > 0 and self.nbytes else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "median_s": self.median,
            "p99_s": self.p99,
            "min_s": self.spread[0],
            "max_s": self.spread[1],
            "gbps_median": self.gbps(),
            "nbytes": self.nbytes,
            "runs": len(self.samples),
        }


def spawn_bench_child(
    bench: str, role: str, options: Sequence[str]
) -> tuple[subprocess.Popen[bytes], JsonChannel]:
    """Start ``omnikv bench <bench> --role <role> --fd N <options>`` with this process's
    environment, ``N`` one end of a socketpair passed by fd; the other end as its
    :class:`JsonChannel`. Called by the benchmarks that drive child processes (fanout, the
    alternating sender of mooncake and nixl); neither end is left open if the start fails."""
    parent, child = socket.socketpair()
    cmd = [sys.executable, "-m", "omnikv.cli", "bench", bench, "--role", role]
    cmd += ["--fd", str(child.fileno()), *options]
    try:
        proc = subprocess.Popen(cmd, pass_fds=[child.fileno()])
    except BaseException:
        parent.close()
        raise
    finally:
        child.close()
    return proc, JsonChannel(parent)


def measure(
    name: str,
    fn: Callable[[], object],
    *,
    repeat: int,
    warmup: int = 2,
    nbytes: int = 0,
    setup: Callable[[], object] | None = None,
) -> Stats:
    """Run ``fn`` ``warmup`` times (discarded) then ``repeat`` times, timing each run."""
    for _ in range(warmup):
        if setup is not None:
            setup()
        fn()
    samples: list[float] = []
    for _ in range(repeat):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return Stats(name, samples, nbytes)


def _fmt_time(sec: float) -> str:
    return f"{sec * 1e3:9.3f} ms" if sec >= 1e-3 else f"{sec * 1e6:9.1f} us"


def print_table(rows: Sequence[Stats], *, baseline: Stats | None = None, title: str = "") -> None:
    """Median, p99, spread, GB/s and (with ``baseline``) the ratio to it, one row per Stats."""
    if title:
        print(f"\n{title}")
    head = f"{'case':38} {'median':>12} {'p99':>12} {'min..max':>25} {'GB/s':>7}"
    if baseline is not None:  # "x memcpy": the baseline's name without its parenthesis
        head += f" {'x ' + baseline.name.split(' (', 1)[0]:>18}"
    print(head)
    print("-" * len(head))
    for st in rows:
        lo, hi = st.spread
        line = (
            f"{st.name:38} {_fmt_time(st.median):>12} {_fmt_time(st.p99):>12} "
            f"{_fmt_time(lo).strip() + '..' + _fmt_time(hi).strip():>25} {st.gbps():7.2f}"
        )
        if baseline is not None:
            line += f" {baseline.median / st.median:18.2f}"
        print(line)


def shm_stage_config(namespace: str, pool: int, **kw: Any) -> Any:
    """An ``OmniKVCacheConfig`` of a ``stage1`` -> ``stage2`` edge over a
    ``SharedMemoryConnector`` on ``namespace`` with a ``pool``-byte pool; ``kw`` says the role
    (``to_stage`` and ``need_send_cache``, or ``stage_id`` and ``need_recv_cache``). Used by the
    benchmarks whose stages are a manager each (prefetch, admission)."""
    from omnikv import OmniKVCacheConfig

    conn = {"type": "SharedMemoryConnector", "namespace": namespace, "pool_size_bytes": pool}
    return OmniKVCacheConfig(connector_config=conn, from_stage="stage1", **kw)


def write_json(path: str | None, payload: dict[str, Any]) -> None:
    """Write benchmark results as JSON when a path is given."""
    if path:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(payload, fh, indent=2)


def run_ranks(procs: Sequence[Any], out: Any, expected: int, timeout_s: float) -> list[Any]:
    """Start ``procs``, collect up to ``expected`` reports from the queue ``out``, reap them.

    Used by ``omnikv bench dist`` and the distribution tests for one process per rank. Returns
    within about ``timeout_s`` (plus 5 s per killed process) with what arrived by then; every
    process still alive at the end is SIGKILLed by PID and joined.
    """
    import os
    import queue
    import signal

    for p in procs:
        p.start()
    results: list[Any] = []
    try:
        deadline = time.monotonic() + timeout_s
        while len(results) < expected:
            try:
                results.append(out.get(timeout=max(0.1, deadline - time.monotonic())))
            except queue.Empty:
                break
        for p in procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive() and p.pid is not None:
                os.kill(p.pid, signal.SIGKILL)
                p.join(5)
    return results


def serve_commands(chan: JsonChannel, table: Mapping[str, Callable[..., list[Any]]]) -> None:
    """A benchmark child's command loop: each message ``[op, *args]`` runs ``table[op](*args)``
    and its reply list is sent back; a command that raises is answered ``["error", text]`` (the
    parent aborts the run). Returns on ``stop``, on an empty message, or when the channel
    closes (a dead parent), so a child never outlives its benchmark. The caller closes."""
    while True:
        try:
            msg = chan.recv()
        except (EOFError, OSError):
            return
        if not msg or msg[0] == "stop":
            return
        try:
            reply = table[msg[0]](*msg[1:])
        except Exception as exc:
            logger.debug("command %s failed", msg[0], exc_info=True)
            reply = ["error", f"{msg[0]}: {type(exc).__name__}: {exc}"]
        try:
            chan.send(*reply)
        except OSError:
            return


def reap(proc: subprocess.Popen[bytes], chan: JsonChannel) -> None:
    """Stop a benchmark's child process: ``stop`` over ``chan``, a bounded wait, then SIGKILL by
    PID; ``chan`` is closed. Called in the ``finally`` of every two-process benchmark."""
    with contextlib.suppress(OSError):
        chan.send("stop")
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    chan.close()
