"""``omnikv demo``: stage 0 prefills into a paged KV pool and sends; stage 1 decodes on from it.

Who calls it: ``omnikv demo`` (``make demo``) through :func:`main`. What it guarantees: exit code 0
only when, for every request, the KV stage 1 received is bit-identical to the blocks stage 0 sent
and stage 1's greedy tokens equal a single-process reference run; 1 otherwise; 2 when stage 1
could not be run. With the default ``SharedMemoryConnector`` stage 1 is a separate process
(``python -m omnikv.demo.pipeline --role stage1``), started and stopped by PID and bounded by
``--timeout``; stage 0 is this process and keeps its send pool alive until stage 1 is done. With
``--connector LocalConnector`` both stages run in this process.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from omnikv.config import OmniKVCacheConfig
from omnikv.demo.model import BlockPool, ModelConfig, TinyPagedLM
from omnikv.manager import LayerKV, OmniKVTransferManager

__all__ = ["main"]

_PREFIX = "omnikv-demo:"


@dataclass(frozen=True)
class Plan:
    """What both stages agree on: requests, prompt lengths, tokens to generate."""

    requests: int
    prompt_len: int
    new_tokens: int
    seed: int = 7

    def prompts(self, vocab: int) -> dict[str, list[int]]:
        g = torch.Generator().manual_seed(self.seed)
        out: dict[str, list[int]] = {}
        for i in range(self.requests):
            n = max(1, self.prompt_len - 13 * i)  # different lengths, partial last blocks
            out[f"demo-req-{i}"] = torch.randint(0, vocab, (n,), generator=g).tolist()
        return out


def _digest(ks: Sequence[torch.Tensor], vs: Sequence[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in (*ks, *vs):
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _connector_config(name: str, namespace: str) -> dict[str, Any]:
    if name == "SharedMemoryConnector":
        return {"type": name, "namespace": namespace, "pool_size_bytes": 32 << 20}
    return {"type": name, "namespace": namespace}


def _manager(name: str, namespace: str, *, send: bool, timeout: float) -> OmniKVTransferManager:
    return OmniKVTransferManager(
        OmniKVCacheConfig(
            connector_config=_connector_config(name, namespace),
            from_stage="0",
            to_stage="1",
            stage_id="1" if not send else "0",
            need_send_cache=send,
            need_recv_cache=not send,
            recv_timeout=timeout,
        )
    )


def run_stage1(
    model: TinyPagedLM, plan: Plan, mgr: OmniKVTransferManager, *, inject_fault: bool = False
) -> dict[str, Any]:
    """Stage 1: receive each request's KV, write it into its own pool, decode on.

    Returns per-request tokens and KV digests plus the receive and decode times.
    """
    cfg = model.cfg
    pool = BlockPool(cfg)
    out: dict[str, Any] = {"requests": {}, "recv_s": 0.0, "decode_s": 0.0, "bytes": 0}
    for rid in plan.prompts(cfg.vocab):
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
        ids = pool.allocate(seq + plan.new_tokens, reverse=True)
        for layer in range(cfg.layers):
            pool.write(layer, ids, 0, ks[layer].float(), vs[layer].float())
        del ks, vs, data  # the views pin the sender's pool slot until they die
        tokens = model.generate(pool, ids, int(meta["first_token"]), seq, plan.new_tokens)
        out["decode_s"] += time.perf_counter() - t1
        out["requests"][rid] = {"tokens": tokens, "kv": digest}
    return out


def _stage1_main(ns: argparse.Namespace) -> int:
    plan = Plan(ns.requests, ns.prompt_len, ns.new_tokens)
    model = TinyPagedLM(ModelConfig())
    with _manager(ns.connector, ns.namespace, send=False, timeout=ns.timeout) as mgr:
        print(_PREFIX + json.dumps({"ready": True}), flush=True)
        if sys.stdin.readline().strip() != "go":  # stage 0 has sent (or gave up)
            return 2
        result = run_stage1(model, plan, mgr, inject_fault=ns.inject_fault)
    print(_PREFIX + json.dumps(result), flush=True)
    return 0


def _reference(model: TinyPagedLM, plan: Plan) -> dict[str, list[int]]:
    """Single-process run: prefill and decode in one pool, no transfer."""
    pool = BlockPool(model.cfg)
    out = {}
    for rid, prompt in plan.prompts(model.cfg.vocab).items():
        ids = pool.allocate(len(prompt) + plan.new_tokens)
        first = model.forward(pool, ids, prompt, 0)
        out[rid] = model.generate(pool, ids, first, len(prompt), plan.new_tokens)
    return out


def _stage0_send(
    model: TinyPagedLM, plan: Plan, mgr: OmniKVTransferManager
) -> tuple[dict[str, str], float, float, list[str]]:
    """Stage 0: prefill every request into the paged pool, then hand them to the manager."""
    cfg = model.cfg
    pool = BlockPool(cfg)
    finished: dict[str, dict[str, Any]] = {}
    digests: dict[str, str] = {}
    t0 = time.perf_counter()
    for rid, prompt in plan.prompts(cfg.vocab).items():
        ids = pool.allocate(len(prompt))
        first = model.forward(pool, ids, prompt, 0)
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


def _read_stage1(proc: subprocess.Popen[str], deadline: float) -> dict[str, Any] | None:
    """Next ``omnikv-demo:`` JSON line of stage 1, or None when it died or ran out of time."""
    assert proc.stdout is not None
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    try:
        while (left := deadline - time.monotonic()) > 0:
            if not sel.select(left):
                return None
            line = proc.stdout.readline()
            if not line:
                return None
            if line.startswith(_PREFIX):
                parsed: dict[str, Any] = json.loads(line[len(_PREFIX) :])
                return parsed
            sys.stderr.write(line)
        return None
    finally:
        sel.close()


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)


def _report(
    plan: Plan,
    ref: dict[str, list[int]],
    digests: dict[str, str],
    stage1: dict[str, Any],
    times: dict[str, float],
    connector: str,
) -> int:
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
            f"  {rid}: prompt {len(plan.prompts(512)[rid]):4d} tok, kv "
            f"{'bit-identical' if same_kv else 'DIFFERS'}, tokens {got['tokens'][:8]}... "
            f"{'match' if same else 'MISMATCH vs ' + str(want[:8])}"
        )
    nbytes = stage1["bytes"]
    recv = max(stage1["recv_s"], 1e-9)
    print(
        f"connector {connector}: prefill {times['prefill'] * 1e3:.1f} ms, send "
        f"{times['send'] * 1e3:.1f} ms, receive {stage1['recv_s'] * 1e3:.1f} ms, decode "
        f"{stage1['decode_s'] * 1e3:.1f} ms; {nbytes / 2**20:.2f} MiB moved, "
        f"{nbytes / recv / 1e9:.2f} GB/s receive"
    )
    print("received KV bit-identical to stage 0's: " + ("yes" if kv_ok else "NO"))
    print("tokens match the single-process reference: " + ("yes" if tok_ok else "NO"))
    print("result: " + ("PASS" if ok else "FAIL"))
    return 0 if ok else 1


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="omnikv demo", description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=200)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument(
        "--connector",
        default="SharedMemoryConnector",
        choices=["SharedMemoryConnector", "LocalConnector"],
    )
    p.add_argument("--timeout", type=float, default=60.0, help="seconds for the whole demo")
    p.add_argument("--inject-fault", action="store_true", help="perturb one received KV value")
    p.add_argument("--role", default="stage0", choices=["stage0", "stage1"], help=argparse.SUPPRESS)
    p.add_argument("--namespace", default="", help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo (see the module docstring); returns the exit code."""
    ns = _parser().parse_args(list(argv) if argv is not None else None)
    if ns.role == "stage1":
        return _stage1_main(ns)
    torch.set_num_threads(1)  # same kernels, same numbers in both stages and the reference
    plan = Plan(ns.requests, ns.prompt_len, ns.new_tokens)
    model = TinyPagedLM(ModelConfig())
    namespace = ns.namespace or f"demo-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    print(
        f"omnikv demo: {plan.requests} requests, prompts up to {plan.prompt_len} tokens, "
        f"{plan.new_tokens} new tokens, {model.cfg.layers} layers, fp32 KV, {ns.connector}"
    )
    ref = _reference(model, plan)
    deadline = time.monotonic() + ns.timeout
    with _manager(ns.connector, namespace, send=True, timeout=ns.timeout) as sender:
        if ns.connector == "LocalConnector":
            digests, prefill, send, failed = _stage0_send(model, plan, sender)
            with _manager(ns.connector, namespace, send=False, timeout=ns.timeout) as recv:
                stage1 = run_stage1(model, plan, recv, inject_fault=ns.inject_fault)
        else:
            cmd = [
                sys.executable, "-m", "omnikv.demo.pipeline", "--role", "stage1",
                "--namespace", namespace, "--connector", ns.connector,
                "--requests", str(ns.requests), "--prompt-len", str(ns.prompt_len),
                "--new-tokens", str(ns.new_tokens), "--timeout", str(ns.timeout),
            ]  # fmt: skip
            if ns.inject_fault:
                cmd.append("--inject-fault")
            env = dict(os.environ, OMP_NUM_THREADS="1")
            proc = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
            )
            try:
                if _read_stage1(proc, deadline) is None:
                    print("stage 1 did not start", file=sys.stderr)
                    return 2
                print(f"stage 1 running as pid {proc.pid}; stage 0 is pid {os.getpid()}")
                digests, prefill, send, failed = _stage0_send(model, plan, sender)
                assert proc.stdin is not None
                proc.stdin.write("go\n")
                proc.stdin.flush()
                got = _read_stage1(proc, deadline)
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            finally:
                _stop(proc)
            if got is None:
                print("stage 1 gave no result within the timeout", file=sys.stderr)
                return 2
            stage1 = got
    for line in failed:
        print(f"  send failed: {line}")
    return _report(plan, ref, digests, stage1, {"prefill": prefill, "send": send}, ns.connector)


if __name__ == "__main__":
    sys.exit(main())
