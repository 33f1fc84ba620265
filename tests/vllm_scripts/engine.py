"""One vLLM engine with OmniKVConnector in its own process, driven by JSON lines on stdin.

``python engine.py '<json>'`` with ``{"model", "dtype", "role", "omni_kv_config",
"max_model_len"}``; every reply is one stdout line ``OMNIKV-RESULT <json>`` (the first one says the
engine is ready). Commands: ``generate``, ``pump``, ``stats``, ``record``, ``dump``,
``set_delay``, ``quit``. The engine core and its worker run in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the worker's connector is reachable here through vLLM's
``get_kv_transfer_group()``; ``pump`` steps the engine while a send is in flight (a server's engine
loop does this by itself: ``has_pending_push_work``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

PREFIX = "OMNIKV-RESULT "


def reply(obj: dict[str, Any]) -> None:
    sys.stdout.write(PREFIX + json.dumps(obj) + "\n")
    sys.stdout.flush()


def _register_slow_connector() -> None:
    """``SlowSharedMemoryConnector``: the SHM connector with a settable delay before each put."""
    from omnikv.connectors.factory import OmniConnectorFactory
    from omnikv.connectors.shm import SharedMemoryConnector

    class SlowSharedMemoryConnector(SharedMemoryConnector):
        delay_s = 0.0

        def put_packed(self, *args: Any, **kwargs: Any) -> Any:
            time.sleep(type(self).delay_s)  # a slow transport, for the "engine keeps serving" test
            return super().put_packed(*args, **kwargs)

    OmniConnectorFactory.register_connector("SlowSharedMemoryConnector", SlowSharedMemoryConnector)
    globals()["SLOW"] = SlowSharedMemoryConnector


def make_llm(cfg: dict[str, Any]) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    ktc = None
    if cfg.get("role"):
        ktc = KVTransferConfig(
            kv_connector="OmniKVConnector",
            kv_connector_module_path="omnikv.integrations.vllm",
            kv_role=cfg["role"],
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"omni_kv_config": cfg["omni_kv_config"]},
        )
    return LLM(
        model=cfg["model"],
        dtype=cfg.get("dtype", "float32"),
        enforce_eager=True,
        block_size=32,
        max_model_len=int(cfg.get("max_model_len", 512)),
        max_num_batched_tokens=int(cfg.get("max_model_len", 512)),
        enable_prefix_caching=False,
        kv_transfer_config=ktc,
        seed=0,
    )


def connector() -> Any:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group()


def op_generate(llm: Any, cmd: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in cmd["prompts"]]
    n = len(prompts)
    max_tokens = cmd.get("max_tokens", 8)
    max_tokens = max_tokens if isinstance(max_tokens, list) else [max_tokens] * n
    kv_params = cmd.get("kv_transfer_params") or [None] * n
    params = [
        SamplingParams(
            temperature=0.0,
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
                "kv_transfer_params": o.kv_transfer_params,
                "num_cached_tokens": o.num_cached_tokens,
            }
            for o in outs
        ],
    }


def op_pump(llm: Any, cmd: dict[str, Any]) -> dict[str, Any]:
    """Step the engine until every listed transfer has ended (bounded), then a few more steps."""
    deadline = time.monotonic() + float(cmd.get("timeout", 60))
    ids = list(cmd["transfer_ids"])
    conn = connector()
    while time.monotonic() < deadline:
        records = [conn.transfer_record(t) or {} for t in ids]
        if all("end" in r for r in records):
            break
        llm.llm_engine.step()
        time.sleep(0.002)
    for _ in range(3):  # report finished_sending so vLLM frees the blocks
        llm.llm_engine.step()
    return {"records": [conn.transfer_record(t) for t in ids]}


def op_dump(llm: Any, cmd: dict[str, Any]) -> dict[str, Any]:
    """Save tokens [0, num_tokens) of a transfer's blocks, per layer K and V, as float32 .npz."""
    import numpy as np

    from omnikv.layouts import BlockGather

    conn = connector()
    rec = conn.transfer_record(cmd["transfer_id"])
    ids, n = tuple(rec["block_ids"]), int(rec["num_tokens"])
    arrays: dict[str, Any] = {}
    for i, (k, v) in enumerate(conn.layer_kv_views().values()):
        arrays[f"k{i}"] = BlockGather(k, ids, n).materialize().float().numpy()
        arrays[f"v{i}"] = BlockGather(v, ids, n).materialize().float().numpy()
    np.savez(cmd["path"], **arrays)
    return {"path": cmd["path"], "num_tokens": n}


def op_set_delay(llm: Any, cmd: dict[str, Any]) -> dict[str, Any]:
    globals()["SLOW"].delay_s = float(cmd["seconds"])
    return {"delay_s": float(cmd["seconds"])}


OPS = {
    "generate": op_generate,
    "pump": op_pump,
    "dump": op_dump,
    "set_delay": op_set_delay,
    "stats": lambda llm, cmd: {"stats": connector().stats()},
    "record": lambda llm, cmd: {"record": connector().transfer_record(cmd["transfer_id"])},
}


def main() -> None:
    cfg = json.loads(sys.argv[1])
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    _register_slow_connector()
    llm = make_llm(cfg)
    reply({"ready": True, "pid": os.getpid()})
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            reply({"bye": True})
            break
        try:
            reply(OPS[cmd["op"]](llm, cmd))
        except Exception as exc:
            reply({"error": f"{type(exc).__name__}: {exc}"})


if __name__ == "__main__":
    main()
