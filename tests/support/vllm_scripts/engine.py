"""A test engine: ``omnikv.bench.vllm.serve`` plus commands that look inside the engine.

``python engine.py '<json>'`` (the config of ``serve``). The engine core and its worker run in
this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set by the parent), so the worker's connector
is reachable through vLLM's ``get_kv_transfer_group()``. Extra commands: ``pump`` (step the engine
while sends are in flight: a server's engine loop does this by itself, ``has_pending_push_work``),
``stats`` (the worker's counts), ``scheduler_stats`` (the scheduler half's: admission refusals),
``record``, ``layout`` (the cache layout the worker reads), ``dump`` (a transfer's tokens as
float32 .npz), ``hold`` / ``release`` (every put of ``HeldSharedMemoryConnector`` waits until
released, or ``seconds`` at most).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any


class _Hold:
    """The gate every put of ``HeldSharedMemoryConnector`` passes (open unless held)."""

    gate = threading.Event()
    bound_s = 0.0


_Hold.gate.set()


def _register_held_connector() -> None:
    from omnikv.connectors.factory import OmniConnectorFactory
    from omnikv.connectors.shm.connector import SharedMemoryConnector

    class HeldSharedMemoryConnector(SharedMemoryConnector):
        def put_packed(self, *args: Any, **kwargs: Any) -> Any:
            # a transport that takes as long as the test says: the "engine keeps serving" test
            _Hold.gate.wait(_Hold.bound_s)
            return super().put_packed(*args, **kwargs)

    OmniConnectorFactory.register_connector("HeldSharedMemoryConnector", HeldSharedMemoryConnector)


def _connector() -> Any:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group()


def op_pump(llm: Any, cmd: dict[str, Any]) -> dict[str, Any]:
    """Step the engine until every listed transfer has ended (bounded), then a few more steps."""
    deadline = time.monotonic() + float(cmd.get("timeout", 60))
    ids = list(cmd["transfer_ids"])
    conn = _connector()
    while time.monotonic() < deadline:
        if all("end" in (conn.transfer_record(t) or {}) for t in ids):
            break
        llm.llm_engine.step()
        time.sleep(0.002)
    for _ in range(3):  # report finished_sending, so that vLLM frees the blocks
        llm.llm_engine.step()
    return {"records": [conn.transfer_record(t) for t in ids]}


def op_dump(llm: Any, cmd: dict[str, Any]) -> dict[str, Any]:
    """Save tokens [0, num_tokens) of a transfer's blocks, per layer K and V, as float32 .npz."""
    import numpy as np

    conn = _connector()
    rec = conn.transfer_record(cmd["transfer_id"])
    ids, n = tuple(rec["block_ids"]), int(rec["num_tokens"])
    arrays: dict[str, Any] = {}
    for i, (k, v) in enumerate(conn.layer_tokens(ids, n)):
        arrays[f"k{i}"] = k.float().numpy()
        arrays[f"v{i}"] = v.float().numpy()
    np.savez(cmd["path"], **arrays)
    return {"path": cmd["path"], "num_tokens": n}


def op_scheduler_stats(llm: Any, cmd: dict[str, Any]) -> dict[str, Any]:
    """The scheduler half's cumulative counts (the engine core runs in this process)."""
    core = llm.llm_engine.engine_core.engine_core
    return {"stats": core.scheduler.connector.stats()}


def op_hold(llm: Any, cmd: dict[str, Any]) -> dict[str, Any]:
    """From now on every put waits until ``release`` (``seconds`` at most)."""
    _Hold.bound_s = float(cmd["seconds"])
    _Hold.gate.clear()
    return {"held": True}


def op_release(llm: Any, cmd: dict[str, Any]) -> dict[str, Any]:
    _Hold.gate.set()
    return {"held": False}


OPS = {
    "pump": op_pump,
    "dump": op_dump,
    "hold": op_hold,
    "release": op_release,
    "scheduler_stats": op_scheduler_stats,
    "stats": lambda llm, cmd: {"stats": _connector().stats()},
    "layout": lambda llm, cmd: {"layout": _connector().kv_layout},
    "record": lambda llm, cmd: {"record": _connector().transfer_record(cmd["transfer_id"])},
}


if __name__ == "__main__":
    from omnikv.bench.vllm import serve

    _register_held_connector()
    serve(json.loads(sys.argv[1]), extra_ops=OPS)
