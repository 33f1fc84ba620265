"""``omnikv demo``: stage 0 prefills and sends each request's KV; stage 1 decodes on from it.

Who calls it: ``omnikv demo`` (``make demo``) through :func:`main`. What it guarantees: exit code 0
only when, for every request, the KV stage 1 received is bit-identical to what stage 0 sent and
stage 1's greedy tokens equal a single-process reference run; 1 otherwise; 2 when stage 1 could
not be run. With the default ``SharedMemoryConnector`` stage 1 is a separate process
(``python -m omnikv.demo.pipeline --role stage1``), started and stopped by PID and bounded by
``--timeout``; stage 0 is this process and keeps its send pool alive until stage 1 is done. With
``--connector LocalConnector`` both stages run in this process.

Models: ``--model tiny`` (default; a paged-pool model of :mod:`omnikv.demo.model`, fp32) or
``--model hf-llama`` (a tiny transformers Llama, :mod:`omnikv.demo.hf`). After the model check,
``--realistic-tokens`` (default 4096; 0: skip) times a 224 MiB transfer of Qwen2.5-7B's KV shape
between the stages against a memcpy of the same bytes (:mod:`omnikv.demo.realistic`).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from omnikv.config import OmniKVCacheConfig
from omnikv.demo import realistic
from omnikv.demo.model import BlockPool, ModelConfig, TinyPagedLM
from omnikv.manager import LayerKV, OmniKVTransferManager
from omnikv.polling import wait_readable

__all__ = ["main"]

_PREFIX = "omnikv-demo:"
_REALISTIC_ROUNDS = 3


@dataclass(frozen=True)
class Plan:
    """What both stages agree on: requests, prompt lengths, tokens to generate."""

    requests: int
    prompt_len: int
    new_tokens: int
    seed: int = 7
    lengths: tuple[int, ...] = ()

    def prompts(self, vocab: int) -> dict[str, list[int]]:
        g = torch.Generator().manual_seed(self.seed)
        lengths = self.lengths or tuple(
            max(1, self.prompt_len - 13 * i)  # different lengths, partial last blocks
            for i in range(self.requests)
        )
        return {
            f"demo-req-{i}": torch.randint(0, vocab, (n,), generator=g).tolist()
            for i, n in enumerate(lengths)
        }


class Workload(Protocol):
    """A model the demo runs on both stages (the tiny paged model or hf-llama)."""

    vocab: int

    def describe(self) -> str: ...

    def reference(self, prompts: dict[str, list[int]], new_tokens: int) -> dict[str, list[int]]:
        """Tokens of a single-process run (prefill and decode, no transfer)."""
        ...

    def send(
        self, prompts: dict[str, list[int]], mgr: OmniKVTransferManager
    ) -> tuple[dict[str, str], float, float, list[str]]:
        """Stage 0: prefill and send; KV digests, prefill and send seconds, failures."""
        ...

    def receive(
        self,
        prompts: dict[str, list[int]],
        new_tokens: int,
        mgr: OmniKVTransferManager,
        *,
        inject_fault: bool = False,
    ) -> dict[str, Any]:
        """Stage 1: receive and decode; per-request tokens and KV digests, times, bytes."""
        ...


def _digest(ks: Sequence[torch.Tensor], vs: Sequence[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in (*ks, *vs):
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


class TinyWorkload:
    """The paged-pool model of :mod:`omnikv.demo.model`; KV goes through paged blocks."""

    def __init__(self) -> None:
        self.model = TinyPagedLM(ModelConfig())
        self.vocab = self.model.cfg.vocab

    def describe(self) -> str:
        return f"tiny paged model ({self.model.cfg.layers} layers), fp32 KV"

    def reference(self, prompts: dict[str, list[int]], new_tokens: int) -> dict[str, list[int]]:
        pool = BlockPool(self.model.cfg)
        out = {}
        for rid, prompt in prompts.items():
            ids = pool.allocate(len(prompt) + new_tokens)
            first = self.model.forward(pool, ids, prompt, 0)
            out[rid] = self.model.generate(pool, ids, first, len(prompt), new_tokens)
        return out

    def send(
        self, prompts: dict[str, list[int]], mgr: OmniKVTransferManager
    ) -> tuple[dict[str, str], float, float, list[str]]:
        cfg = self.model.cfg
        pool = BlockPool(cfg)
        finished: dict[str, dict[str, Any]] = {}
        digests: dict[str, str] = {}
        t0 = time.perf_counter()
        for rid, prompt in prompts.items():
            ids = pool.allocate(len(prompt))
            first = self.model.forward(pool, ids, prompt, 0)
            finished[rid] = {
                "block_ids": ids,
                "seq_len": len(prompt),
                "custom_metadata": {"first_token": first, "seq_len": len(prompt)},
            }
            kv = [pool.read(layer, ids, len(prompt)) for layer in range(cfg.layers)]
            digests[rid] = _digest([k for k, _ in kv], [v for _, v in kv])
        prefill_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        caches: list[LayerKV] = list(pool.caches)
        mgr.handle_finished_requests_kv_transfer(finished, caches, cfg.block_size, "torch.float32")
        send_s = time.perf_counter() - t1
        failed = []
        for rid in finished:
            res = mgr.get_send_result(rid)
            if res is None or not res.ok:
                failed.append(f"{rid}: {res.reason if res else 'no result'}")
        return digests, prefill_s, send_s, failed

    def receive(
        self,
        prompts: dict[str, list[int]],
        new_tokens: int,
        mgr: OmniKVTransferManager,
        *,
        inject_fault: bool = False,
    ) -> dict[str, Any]:
        """Receive each request's KV, write it into this stage's own pool, decode on."""
        cfg = self.model.cfg
        pool = BlockPool(cfg)
        out: dict[str, Any] = {"requests": {}, "recv_s": 0.0, "decode_s": 0.0, "bytes": 0}
        for rid in prompts:
            t0 = time.perf_counter()
            data, size = mgr.receive_kv_cache_for_request(rid)
            out["recv_s"] += time.perf_counter() - t0
            if data is None:
                res = mgr.get_receive_result(rid)
                out["requests"][rid] = {"error": res.reason if res else "no KV"}
                continue
            out["bytes"] += size
            ks = list(data["layer_blocks"]["key_cache"])
            vs = list(data["layer_blocks"]["value_cache"])
            meta = data["metadata"]
            seq = int(meta["seq_len"])
            if inject_fault:
                ks[0] = ks[0].clone()
                ks[0].view(-1)[0] += 1.0
            digest = _digest(ks, vs)
            t1 = time.perf_counter()
            ids = pool.allocate(seq + new_tokens, reverse=True)
            for layer in range(cfg.layers):
                pool.write(layer, ids, 0, ks[layer].float(), vs[layer].float())
            del ks, vs, data  # the views pin the sender's pool slot until they die
            tokens = self.model.generate(pool, ids, int(meta["first_token"]), seq, new_tokens)
            out["decode_s"] += time.perf_counter() - t1
            out["requests"][rid] = {"tokens": tokens, "kv": digest}
        return out


def _workload(ns: argparse.Namespace) -> Workload:
    if ns.model == "hf-llama":
        import importlib.util

        if importlib.util.find_spec("transformers") is None:
            raise SystemExit(
                "--model hf-llama needs transformers: pip install 'omnikv[transformers]'"
            )
        from omnikv.demo.hf import HFWorkload

        return HFWorkload(ns.dtype or "fp32")
    return TinyWorkload()


def _plan(ns: argparse.Namespace) -> Plan:
    lengths = tuple(int(x) for x in ns.prompt_lens.split(",")) if ns.prompt_lens else ()
    return Plan(ns.requests, ns.prompt_len, ns.new_tokens, lengths=lengths)


def _connector_config(name: str, namespace: str, pool_bytes: int) -> dict[str, Any]:
    if name == "SharedMemoryConnector":
        return {"type": name, "namespace": namespace, "pool_size_bytes": pool_bytes}
    return {"type": name, "namespace": namespace}


def _manager(ns: argparse.Namespace, namespace: str, *, send: bool) -> OmniKVTransferManager:
    pool_bytes = 32 << 20
    if ns.realistic_tokens > 0:
        pool_bytes += realistic.RealisticShape(ns.realistic_tokens).nbytes
    return OmniKVTransferManager(
        OmniKVCacheConfig(
            connector_config=_connector_config(ns.connector, namespace, pool_bytes),
            from_stage="0",
            to_stage="1",
            stage_id="1" if not send else "0",
            need_send_cache=send,
            need_recv_cache=not send,
            recv_timeout=ns.timeout,
        )
    )


def _emit(obj: dict[str, Any]) -> None:
    print(_PREFIX + json.dumps(obj), flush=True)


def _stage1_main(ns: argparse.Namespace) -> int:
    plan = _plan(ns)
    work = _workload(ns)
    with _manager(ns, ns.namespace, send=False) as mgr:
        _emit({"ready": True})
        if sys.stdin.readline().strip() != "go":  # stage 0 has sent (or gave up)
            return 2
        prompts = plan.prompts(work.vocab)
        _emit(work.receive(prompts, plan.new_tokens, mgr, inject_fault=ns.inject_fault))
        for i in range(_REALISTIC_ROUNDS if ns.realistic_tokens > 0 else 0):
            _emit({"waiting": i})
            _emit(realistic.receive_round(mgr, f"realistic-{i}"))
    return 0


class _Stage1Reader:
    """``omnikv-demo:`` JSON lines of stage 1, read from its stdout's file descriptor.

    Reads the descriptor directly (no buffered file object), so two lines that arrive together
    are both seen; other lines are passed on to stderr.
    """

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        self.fd = proc.stdout.fileno()
        self.pending = b""

    def next(self, deadline: float) -> dict[str, Any] | None:
        """The next message, or None when stage 1 closed its stdout or the deadline passed."""
        while True:
            while b"\n" in self.pending:
                line, self.pending = self.pending.split(b"\n", 1)
                text = line.decode("utf-8", "replace")
                if text.startswith(_PREFIX):
                    parsed: dict[str, Any] = json.loads(text[len(_PREFIX) :])
                    return parsed
                sys.stderr.write(text + "\n")
            left = deadline - time.monotonic()
            if left <= 0 or not wait_readable(self.fd, left):
                return None
            chunk = os.read(self.fd, 1 << 16)
            if not chunk:
                return None
            self.pending += chunk


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)


class _Realistic:
    """Stage 0's side of the realistic transfer: rounds, memcpy, the summary line."""

    def __init__(self, tokens: int) -> None:
        self.shape = realistic.RealisticShape(tokens)
        self.cache: list[LayerKV] = []
        self.want: list[int] = []
        self.seconds: list[float] = []
        self.ok = True

    def prepare(self) -> None:
        """Build the paged cache (once; stage 0 does it while stage 1 decodes)."""
        if not self.cache:
            self.cache = self.shape.paged_cache()
            self.want = realistic.sent_checksum(self.shape, self.cache)

    def round(
        self, sender: OmniKVTransferManager, i: int, fetch: Any
    ) -> bool:  # fetch(rid) -> stage 1's report of the round, None when it is gone
        rid = f"realistic-{i}"
        self.prepare()
        t0, err = realistic.send_round(sender, self.shape, self.cache, rid)
        got = fetch(rid)
        if got is None:
            return False
        if err or "error" in got:
            print(f"  realistic round {i} failed: {err or got['error']}")
            self.ok = False
            return True
        self.seconds.append(float(got["t_done"]) - t0)
        self.ok = self.ok and got["checksum"] == self.want
        return True

    def report(self, where: str) -> None:
        copy_s = realistic.memcpy_s(self.shape.nbytes)
        if not self.seconds:
            print(f"realistic transfer ({self.shape.describe()}): FAILED")
            self.ok = False
            return
        print(realistic.summary(self.shape, self.seconds, self.ok, copy_s, where))


def _report(
    prompts: dict[str, list[int]],
    ref: dict[str, list[int]],
    digests: dict[str, str],
    stage1: dict[str, Any],
    times: dict[str, float],
    connector: str,
) -> bool:
    ok = kv_ok = tok_ok = True
    for rid, want in ref.items():
        got = stage1["requests"].get(rid, {"error": "missing"})
        if "error" in got:
            print(f"  {rid}: NO KV ({got['error']})")
            ok = kv_ok = tok_ok = False
            continue
        same_kv = got["kv"] == digests[rid]
        same = got["tokens"] == want
        kv_ok, tok_ok = kv_ok and same_kv, tok_ok and same
        ok = ok and same and same_kv
        print(
            f"  {rid}: prompt {len(prompts[rid]):4d} tok, kv "
            f"{'bit-identical' if same_kv else 'DIFFERS'}, tokens {got['tokens'][:8]}... "
            f"{'match' if same else 'MISMATCH vs ' + str(want[:8])}"
        )
    print(
        f"connector {connector}: prefill {times['prefill'] * 1e3:.1f} ms, send "
        f"{times['send'] * 1e3:.1f} ms, receive {stage1['recv_s'] * 1e3:.1f} ms, decode "
        f"{stage1['decode_s'] * 1e3:.1f} ms; {stage1['bytes'] / 2**20:.2f} MiB of toy KV "
        "(these times are per-request overheads, not bandwidth)"
    )
    print("received KV bit-identical to stage 0's: " + ("yes" if kv_ok else "NO"))
    print("tokens match the single-process reference: " + ("yes" if tok_ok else "NO"))
    return ok


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="omnikv demo", description=__doc__.split("\n")[0])
    p.add_argument(
        "--model",
        default="tiny",
        choices=["tiny", "hf-llama"],
        help="tiny: a built-in toy model; hf-llama: a small transformers Llama",
    )
    p.add_argument(
        "--dtype",
        choices=["fp32", "bf16", "fp16"],
        help="hf-llama's dtype (default fp32); --save-model's (default bf16)",
    )
    p.add_argument("--requests", type=int, default=4, help="requests to hand over")
    p.add_argument("--prompt-len", type=int, default=200, help="prompt length in tokens")
    p.add_argument("--prompt-lens", default="", help="comma-separated prompt lengths")
    p.add_argument("--new-tokens", type=int, default=16, help="tokens stage 1 decodes")
    p.add_argument(
        "--connector",
        default="SharedMemoryConnector",
        choices=["SharedMemoryConnector", "LocalConnector"],
        help="the transport between the two stage processes",
    )
    p.add_argument(
        "--realistic-tokens",
        type=int,
        default=4096,
        help="tokens of the Qwen2.5-7B-shaped transfer (0: skip it)",
    )
    p.add_argument("--timeout", type=float, default=60.0, help="seconds for the whole demo")
    p.add_argument("--inject-fault", action="store_true", help="perturb one received KV value")
    p.add_argument(
        "--save-model",
        metavar="DIR",
        help="write the tiny random-weight Llama (and its tokenizer) the vLLM recipes serve to "
        "DIR (save_pretrained: a model path for vLLM, transformers) and exit; --dtype sets its "
        "dtype (default here bf16); needs transformers and tokenizers",
    )
    p.add_argument("--role", default="stage0", choices=["stage0", "stage1"], help=argparse.SUPPRESS)
    p.add_argument("--namespace", default="", help=argparse.SUPPRESS)
    p.add_argument("--log-level", default="", help=argparse.SUPPRESS)
    return p


def _stage1_cmd(ns: argparse.Namespace, namespace: str) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "omnikv.demo.pipeline",
        "--role",
        "stage1",
        "--namespace",
        namespace,
        "--connector",
        ns.connector,
        "--model",
        ns.model,
        "--dtype",
        ns.dtype or "fp32",
        "--requests",
        str(ns.requests),
        "--prompt-len",
        str(ns.prompt_len),
        "--prompt-lens",
        ns.prompt_lens,
        "--new-tokens",
        str(ns.new_tokens),
        "--timeout",
        str(ns.timeout),
        "--realistic-tokens",
        str(ns.realistic_tokens),
    ]
    level = logging.getLogger().getEffectiveLevel()
    cmd += ["--log-level", logging.getLevelName(level)]  # stage 1 logs like stage 0
    return [*cmd, "--inject-fault"] if ns.inject_fault else cmd


def _run_local(
    ns: argparse.Namespace, work: Workload, plan: Plan, namespace: str, real: _Realistic | None
) -> tuple[dict[str, Any], tuple[dict[str, str], float, float, list[str]]] | None:
    prompts = plan.prompts(work.vocab)
    with (
        _manager(ns, namespace, send=True) as sender,
        _manager(ns, namespace, send=False) as recv,
    ):
        sent = work.send(prompts, sender)
        stage1 = work.receive(prompts, plan.new_tokens, recv, inject_fault=ns.inject_fault)
        for i in range(_REALISTIC_ROUNDS if real else 0):
            assert real is not None
            real.round(sender, i, lambda rid: realistic.receive_round(recv, rid))
    return stage1, sent


def _run_two_processes(
    ns: argparse.Namespace, work: Workload, plan: Plan, namespace: str, real: _Realistic | None
) -> tuple[dict[str, Any], tuple[dict[str, str], float, float, list[str]]] | None:
    deadline = time.monotonic() + ns.timeout
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with _manager(ns, namespace, send=True) as sender:
        proc = subprocess.Popen(
            _stage1_cmd(ns, namespace), stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
        )
        try:
            stage1 = _Stage1Reader(proc)
            if stage1.next(deadline) is None:
                print("stage 1 did not start", file=sys.stderr)
                return None
            print(f"stage 1 running as pid {proc.pid}; stage 0 is pid {os.getpid()}")
            sent = work.send(plan.prompts(work.vocab), sender)
            assert proc.stdin is not None
            proc.stdin.write(b"go\n")
            proc.stdin.flush()
            if real is not None:
                real.prepare()
            got = stage1.next(deadline)
            if got is None:
                print("stage 1 gave no result within the timeout", file=sys.stderr)
                return None
            for i in range(_REALISTIC_ROUNDS if real else 0):
                assert real is not None
                ready = stage1.next(deadline)  # stage 1 now waits for this round
                if ready is None or not real.round(sender, i, lambda _: stage1.next(deadline)):
                    real.seconds.clear()
                    break
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        finally:
            _stop(proc)
    return got, sent


_SAVED_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _save_model(folder: str, dtype: str | None) -> int:
    """``omnikv demo --save-model DIR``: the tiny Llama the vLLM docs and tests serve, written
    offline (:func:`omnikv.bench.vllm.build_tiny_llama`); prints the path. ``dtype`` defaults
    to bf16 here, vLLM's usual dtype on a CPU."""
    from omnikv.bench.vllm import build_tiny_llama

    name = _SAVED_DTYPES[dtype or "bf16"]
    out = build_tiny_llama(folder, dtype=name)
    print(f"omnikv demo: wrote a tiny random-weight Llama ({name}) to {out}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo (see the module docstring); returns the exit code."""
    ns = _parser().parse_args(list(argv) if argv is not None else None)
    if ns.save_model:
        return _save_model(ns.save_model, ns.dtype)
    if ns.role == "stage1":
        if ns.log_level:
            logging.basicConfig(
                level=ns.log_level, format="%(asctime)s stage1 %(levelname)s %(name)s: %(message)s"
            )
        return _stage1_main(ns)
    torch.set_num_threads(1)  # same kernels, same numbers in both stages and the reference
    plan = _plan(ns)
    work = _workload(ns)
    prompts = plan.prompts(work.vocab)
    namespace = ns.namespace or f"demo-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    print(
        f"omnikv demo: {len(prompts)} requests, prompts up to {max(map(len, prompts.values()))} "
        f"tokens, {plan.new_tokens} new tokens, {work.describe()}, {ns.connector}"
    )
    real = _Realistic(ns.realistic_tokens) if ns.realistic_tokens > 0 else None
    run = _run_local if ns.connector == "LocalConnector" else _run_two_processes
    got = run(ns, work, plan, namespace, real)
    if got is None:
        return 2
    stage1, (digests, prefill, send, failed) = got
    ref = work.reference(prompts, plan.new_tokens)
    for line in failed:
        print(f"  send failed: {line}")
    ok = _report(prompts, ref, digests, stage1, {"prefill": prefill, "send": send}, ns.connector)
    if real is not None:
        where = (
            "in one process" if ns.connector == "LocalConnector" else "stage 0 -> stage 1 process"
        )
        real.report(where)
        ok = ok and real.ok
    print("result: " + ("PASS" if ok else "FAIL"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
