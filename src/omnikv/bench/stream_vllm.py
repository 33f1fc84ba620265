"""``omnikv bench stream --vllm``: a vLLM producer hands a prompt's KV to a vLLM consumer in
another emulated node, with and without ``stream_kv``, with and without a wire codec.

What a disaggregated deployment waits for is the *tail*: from the moment the producer has
finished a request to the moment the consumer holds its KV (*KV-ready*) and has sampled its
first token. Sent whole, the tail is the whole transfer over the link; streamed, the blocks of
each prefill chunk leave while the next chunk computes and the consumer takes them meanwhile.

Set-up: two emulated nodes (:class:`~omnikv.bench.netns.EmulatedLink`, ``tc tbf`` at each
``--rates`` entry, the host's CPUs split between them), a tiny random-weight Llama sized so that
a 4096-token prompt's KV is 128 MiB (8 layers, 8 KV heads of 64, float32: 32 KiB a token; at
10 Gbit/s that takes >= 100 ms), Mooncake Transfer Engine over TCP between the nodes, and
``auth_secret`` on both engines. Node *a* runs the producer (``LLM``, its engine core in its
own process, stepping by itself as in a server; prefill chunks of ``--chunk`` tokens), node *b*
the consumer (engine core in its process, so that its connector's load record can be read).
Per request the orchestrator acts as a router doing the **early hand-off**: it issues a router
id (:func:`~omnikv.integrations.vllm.binding.new_router_transfer_id`) and sends the same prompt
to both engines at once (:func:`~omnikv.integrations.vllm.binding.early_handoff_params`); the
consumer is admitted and waits while the producer prefills.

Timed on the one host's monotonic clock: *finish* = the producer's ``generate`` returned (its
request finished); *KV-ready* = the consumer's load ended (its connector's record); *first
token* = the consumer's ``generate`` returned (``max_tokens=1``). Cases: producers without and
with ``stream_kv`` (once per ``--layer-groups`` entry: the producer's ``stream_layer_groups``,
1 and 2 by default), each with every ``--codecs`` entry (a producer engine per case, its rounds
back to back after a discarded warm-up round; the consumer serves them all), the same prompts
in every case. Checked: every load succeeded (none recomputed) and, without a codec, each
case's first token equals the whole uncoded hand-off's for the same prompt (``off`` first in
``--codecs``, as by default). Target (``--tokens`` >= 1024, codec off): streamed KV-ready tail
<= 0.1 x the whole hand-off's. Exit code 0 unless a check failed or (without ``--no-targets``)
a target was missed. Needs vLLM (``.venv-vllm``); skipped with a note elsewhere.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import secrets
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from omnikv.bench.common import Stats
from omnikv.bench.netns import EmulatedLink, LinkError, Node, Shape, format_rate, parse_rate
from omnikv.bench.stream import te_connector, te_sender_stage
from omnikv.bench.vllm import EngineProcess, build_tiny_llama, serve

__all__ = ["TARGET", "main"]

logger = logging.getLogger(__name__)

MIB = 1 << 20
#: The streamed KV-ready tail's bar against the whole hand-off's (>= 1024 tokens, no codec).
TARGET = 0.1
#: The model: layers, KV heads (of 64), float32, so 32 KiB of KV a token.
LAYERS, KV_HEADS, HEAD = 8, 8, 64
BYTES_PER_TOKEN = 2 * LAYERS * KV_HEADS * HEAD * 4
#: The producer's control port in node a (a fresh namespace: nothing else listens there).
SENDER_PORT = 17100
PRODUCER_TAG = "5ea1ed00"
#: vLLM's block size in the engines (``omnikv.bench.vllm``).
BLOCK = 32
_MODULE = "omnikv.bench.stream_vllm"


def _op_record(llm: Any, cmd: dict[str, Any]) -> dict[str, Any]:
    """The connector's record of a transfer (in this process: the engine core is in it)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return {"record": get_kv_transfer_group().transfer_record(str(cmd["transfer_id"]))}


# -- the engines ---------------------------------------------------------------------------------
@dataclass
class _Case:
    stream: bool
    codec: str
    #: the producer's stream_layer_groups (1: a chunk per prefill chunk)
    groups: int = 1
    ready: list[float] = field(default_factory=list)
    first_token: list[float] = field(default_factory=list)

    @property
    def name(self) -> str:
        if not self.stream:
            return f"whole, codec {self.codec}"
        by = f" by {self.groups} layer groups" if self.groups > 1 else ""
        return f"streamed{by}, codec {self.codec}"


@dataclass
class _Bench:
    link: EmulatedLink
    args: argparse.Namespace
    model: Path
    workdir: Path
    secret: str = field(default_factory=lambda: secrets.token_hex(16))
    failures: list[str] = field(default_factory=list)
    engines: list[EngineProcess] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)

    def _engine(
        self, node: Node, name: str, cfg: dict[str, Any], *, in_process: bool
    ) -> EngineProcess:
        env = {"MC_TCP_BIND_ADDRESS": node.address, "GLOG_minloglevel": "2"}
        argv = [sys.executable, "-m", _MODULE, "--role", "engine", json.dumps(cfg)]
        log = self.workdir / f"{name}.log"
        engine = EngineProcess(argv, log=log, env=env, popen=node.popen, in_process=in_process)
        self.engines.append(engine)
        self.logs.append(log)
        return engine

    def log_tails(self, limit: int = 3000) -> str:
        """The end of every engine's log (printed when the run fails)."""
        parts = []
        for log in self.logs:
            text = log.read_text(errors="replace") if log.exists() else ""
            parts.append(f"--- {log.name}\n{text[-limit:]}")
        return "\n".join(parts)

    def _cfg(self, role: str, omni: dict[str, Any], chunk: int, groups: int = 1) -> dict[str, Any]:
        extra: dict[str, Any] = {}  # auth_secret: from the connector_config
        if role == "kv_producer":
            extra["producer_tag"] = PRODUCER_TAG
            extra["stream_layer_groups"] = groups
        else:
            extra["accept_producer_tags"] = [PRODUCER_TAG]
        return {
            "model": str(self.model),
            "dtype": "float32",
            "role": role,
            "max_model_len": max(self.args.tokens) + 64,
            "max_num_batched_tokens": chunk,
            "omni_kv_config": omni,
            "connector_extra": extra,
            # the worker in the engine core's process: on a node of one CPU, a separate worker
            # process and the engine core's spin-wait for it (sched_yield) starve each other
            "executor": "uni",
            # as many blocks as the longest prompt needs (and two more), so that every request
            # writes the blocks the warm-up round touched, as on a server that has run a while
            # (with a larger cache, each request's fresh blocks fault their pages in)
            "num_blocks": math.ceil((max(self.args.tokens) + 64) / BLOCK) + 2,
        }

    @property
    def pool(self) -> int:
        return int(4 * max(self.args.tokens) * BYTES_PER_TOKEN + 64 * MIB)

    def consumer(self) -> EngineProcess:
        node = self.link.b
        conn = te_connector(
            node.address,
            self.pool,
            self.secret,
            sender_host=self.link.a.address,
            sender_zmq_port=SENDER_PORT,
        )
        omni = {
            "connector_config": conn,
            "stage_id": 1,
            "omni_from_stage": "0",
            "need_recv_cache": True,
            "recv_timeout": 300.0,
            "stream_kv": True,  # take a streamed prefill's chunks as they are published
        }
        cfg = self._cfg("kv_consumer", omni, max(self.args.tokens) + 64)
        # in this process, its engine core and worker: the connector's load record is readable
        return self._engine(node, "consumer", cfg, in_process=True)

    def producer(self, case: _Case) -> EngineProcess:
        node = self.link.a
        omni = te_sender_stage(
            node.address,
            SENDER_PORT,
            self.pool,
            self.secret,
            stream=case.stream,
            codec=case.codec,
        )
        cfg = self._cfg("kv_producer", omni, self.args.chunk, case.groups)
        name = "producer-" + case.name.replace(", ", "-").replace(" ", "-")
        # its engine core in its own process, stepping by itself (sends start at a step)
        return self._engine(node, name, cfg, in_process=False)

    def stop(self, engine: EngineProcess) -> None:
        engine.stop(timeout=30)
        if engine in self.engines:
            self.engines.remove(engine)


# -- one hand-off --------------------------------------------------------------------------------
def _prompt(tokens: int, index: int) -> list[int]:
    rnd = random.Random(tokens * 1000 + index)
    return [rnd.randrange(4, 500) for _ in range(tokens)]


def _hand_off(
    bench: _Bench, producer: EngineProcess, consumer: EngineProcess, prompt: list[int]
) -> tuple[float, float, list[int], dict[str, Any]]:
    """One early hand-off: (KV-ready tail s, first-token tail s, consumer tokens, load record)."""
    from omnikv.integrations.vllm.binding import early_handoff_params, new_router_transfer_id

    tid = new_router_transfer_id(PRODUCER_TAG, bench.secret.encode())
    to_producer, to_consumer = early_handoff_params(tid, len(prompt))
    timeout = bench.args.timeout
    consumer.submit("generate", prompts=[prompt], max_tokens=1, kv_transfer_params=[to_consumer])
    producer.submit("generate", prompts=[prompt], max_tokens=1, kv_transfer_params=[to_producer])
    sent = producer.next_reply(timeout)
    got = consumer.next_reply(timeout)
    params = sent["outputs"][0]["kv_transfer_params"] or {}
    if params.get("omnikv_transfer_id") != tid:
        raise RuntimeError(f"the producer did not use the router's id: {params}")
    record = consumer.call("record", transfer_id=tid)["record"] or {}
    finish = float(sent["t_end"])
    ready = float(record.get("end", math.nan)) - finish
    first = float(got["t_end"]) - finish
    return ready, first, list(got["outputs"][0]["tokens"]), record


def _run_case(
    bench: _Bench,
    case: _Case,
    consumer: EngineProcess,
    tokens: int,
    reference: dict[int, list[int]],
) -> None:
    """Every round of ``case`` at ``tokens`` (round 0 warms up): timed, checked."""
    producer = bench.producer(case)
    try:
        producer.next_reply(bench.args.timeout)  # ready
        for index in range(1 + bench.args.rounds):
            prompt = _prompt(tokens, index)
            ready, first, out, record = _hand_off(bench, producer, consumer, prompt)
            if not record.get("ok"):
                bench.failures.append(
                    f"{case.name} {tokens} tokens round {index}: load failed "
                    f"({record.get('reason')}); the consumer recomputed"
                )
                continue
            if not case.stream and case.codec == "off":
                reference[index] = out  # the whole, uncoded hand-off's tokens: the reference
            want = reference.get(index)
            if want is not None and out != want and case.codec == "off":
                bench.failures.append(
                    f"{case.name} {tokens} tokens round {index}: tokens {out} != {want}"
                )
            if index:
                case.ready.append(ready)
                case.first_token.append(first)
            logger.info(
                "%s %d tokens round %d: ready %.1f ms", case.name, tokens, index, ready * 1e3
            )
    finally:
        bench.stop(producer)


def _report(rate: str, tokens: int, cases: list[_Case]) -> list[str]:
    """Print one rate and prompt length's table (flushed: a run takes minutes); the targets
    missed."""
    whole = {c.codec: c for c in cases if not c.stream}
    mib = tokens * BYTES_PER_TOKEN / MIB
    print(f"\n{rate}, {tokens}-token prompt ({mib:.0f} MiB of KV), router-led early hand-off")
    print(f"{'case':<40}{'KV-ready p50':>14}{'min..max':>22}{'x whole':>9}{'1st token p50':>15}")
    missed = []
    for c in cases:
        if not c.ready:
            print(f"{c.name:<40}{'(no sample)':>14}")
            continue
        st = Stats(c.name, c.ready)
        lo, hi = st.spread
        base = whole.get(c.codec)
        ratio = st.median / Stats("w", base.ready).median if base and base.ready else math.nan
        first = Stats("f", c.first_token).median
        print(
            f"{c.name:<40}{st.median * 1e3:>11.1f} ms{lo * 1e3:>10.1f}..{hi * 1e3:.1f} ms"
            f"{ratio:>9.3f}{first * 1e3:>12.1f} ms"
        )
        if c.stream and c.codec == "off" and tokens >= 1024 and not ratio <= TARGET:
            missed.append(f"{rate} {tokens} tokens: streamed tail {ratio:.3f} x whole > {TARGET}")
    sys.stdout.flush()
    return missed


def _run(args: argparse.Namespace, workdir: Path) -> tuple[list[str], list[str]]:
    model = build_tiny_llama(
        workdir / "model", "float32", max(args.tokens) + 64, layers=LAYERS, kv_heads=KV_HEADS
    )
    failures: list[str] = []
    missed: list[str] = []
    link = EmulatedLink(Shape(parse_rate(args.rates[0]), 0.0), split_cpus=True)
    bench = _Bench(link, args, model, workdir)
    try:
        link.start()
        consumer = bench.consumer()
        consumer.next_reply(args.timeout)
        for rate in args.rates:
            link.reshape(Shape(parse_rate(rate), 0.0))
            for tokens in args.tokens:
                cases = [
                    case
                    for c in args.codecs
                    for case in (
                        _Case(False, c),
                        *(_Case(True, c, g) for g in args.layer_groups),
                    )
                ]
                reference: dict[int, list[int]] = {}
                for case in cases:
                    _run_case(bench, case, consumer, tokens, reference)
                missed += _report(format_rate(link.shape.rate_bps), tokens, cases)
    except (LinkError, RuntimeError, TimeoutError) as exc:
        failures.append(f"{type(exc).__name__}: {exc}")
    finally:
        for engine in list(bench.engines):
            bench.stop(engine)
        link.close()
    failures = bench.failures + failures
    if failures or os.environ.get("OMNIKV_BENCH_ENGINE_LOGS"):
        print(bench.log_tails(), file=sys.stderr)
    failures += [f"left behind: {item}" for item in link.leftovers()]
    return failures, missed


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="omnikv bench stream --vllm", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--vllm", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rates", default="1gbit,10gbit", help="link rates, comma-separated")
    p.add_argument("--tokens", default="1024,4096", help="prompt lengths, comma-separated")
    p.add_argument("--chunk", type=int, default=64, help="the producer's prefill chunk (tokens)")
    p.add_argument("--codecs", default="off", help="wire codecs, comma-separated (off,int8)")
    p.add_argument(
        "--layer-groups",
        default="1,2",
        help="the streaming producer's stream_layer_groups, comma-separated (1: a chunk per "
        "prefill chunk; e.g. 1,2,8)",
    )
    p.add_argument("--rounds", type=int, default=3, help="timed rounds per case")
    p.add_argument("--timeout", type=float, default=600.0, help="longest wait for an engine")
    p.add_argument("--no-targets", action="store_true", help="a missed target is not fatal")
    p.add_argument("--role", default="orchestrator", help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; the engines' entry point too (``--role engine <config>``)."""
    argv = list(argv or [])
    if argv[:2] == ["--role", "engine"]:
        serve(json.loads(argv[2]), {"record": _op_record})
        return 0
    parser = _parser()
    args = parser.parse_args(argv)
    from omnikv.bench.netns import unavailable_reason

    why = unavailable_reason()
    if find_spec("vllm") is None:
        why = "vLLM is not installed (make test-vllm builds .venv-vllm)"
    if why is None and find_spec("mooncake") is None:
        why = "Mooncake is not installed"
    if why is not None:
        print(f"bench stream --vllm: skipped, {why}")
        return 0
    try:
        args.tokens = [int(t) for t in str(args.tokens).split(",") if t]
        args.codecs = [c.strip() for c in str(args.codecs).split(",") if c.strip()]
        args.layer_groups = [int(g) for g in str(args.layer_groups).split(",") if g.strip()]
        if not args.layer_groups or min(args.layer_groups) < 1:
            raise ValueError(f"--layer-groups wants integers >= 1, got {args.layer_groups}")
        args.rates = [r.strip() for r in str(args.rates).split(",") if r.strip()]
        for r in args.rates:
            parse_rate(r)
    except ValueError as exc:
        parser.error(str(exc))
    print(
        f"bench stream --vllm: tiny Llama ({LAYERS} layers, {KV_HEADS} KV heads x {HEAD}, "
        f"float32), prefill chunks of {args.chunk} tokens, Mooncake TE (tcp), "
        f"{args.rounds} rounds + 1 warm-up per case"
    )
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="omnikv-bench-stream-vllm-") as tmp:
        failures, missed = _run(args, Path(tmp))
    print(f"\n({time.monotonic() - started:.0f} s)")
    for line in failures:
        print(f"FAIL {line}")
    for line in missed:
        print(f"target missed: {line}")
    if failures:
        return 1
    return 1 if missed and not args.no_targets else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
