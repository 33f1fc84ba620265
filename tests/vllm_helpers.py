"""Helpers for the vLLM engine tests and ``omnikv bench vllm``: engine processes over JSON lines."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

SCRIPTS = Path(__file__).resolve().parent / "vllm_scripts"
PREFIX = "OMNIKV-RESULT "


def engine_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        }
    )
    src = str(SCRIPTS.parent.parent / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    return env


class EngineProc:
    """One ``vllm_scripts/engine.py`` process; :meth:`call` sends a command, waits for its reply."""

    def __init__(self, config: dict[str, Any], *, log: Path) -> None:
        self._log = open(log, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, str(SCRIPTS / "engine.py"), json.dumps(config)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=engine_env(),
        )
        self._replies: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(PREFIX):
                self._replies.put(json.loads(line[len(PREFIX) :]))
            else:
                self._log.write(line)
        self._replies.put(None)

    def wait_ready(self, timeout: float) -> None:
        self._next(timeout)

    def _next(self, timeout: float) -> dict[str, Any]:
        try:
            got = self._replies.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"engine {self.proc.pid}: no reply within {timeout}s") from None
        if got is None:
            raise RuntimeError(f"engine {self.proc.pid} exited (rc={self.proc.poll()})")
        if "error" in got:
            raise RuntimeError(f"engine {self.proc.pid}: {got['error']}")
        return got

    def call(self, op: str, timeout: float = 120, **args: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        return self._next(timeout)

    def stop(self, timeout: float = 30) -> None:
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
    configs: list[dict[str, Any]], logs: list[Path], timeout: float
) -> list[EngineProc]:
    """Start engines in parallel; all ready, or all stopped and the error raised."""
    engines = [EngineProc(c, log=p) for c, p in zip(configs, logs, strict=True)]
    try:
        deadline = time.monotonic() + timeout
        for e in engines:
            e.wait_ready(max(1.0, deadline - time.monotonic()))
    except BaseException:
        for e in engines:
            e.stop(timeout=5)
        raise
    return engines


def shm_config(
    namespace: str, role: str, *, recv_timeout: float = 30.0, slow: bool = False
) -> dict[str, Any]:
    """The ``omni_kv_config`` of a producer (stage 0) or consumer (stage 1) over shared memory."""
    connector = {
        "type": "SlowSharedMemoryConnector" if slow else "SharedMemoryConnector",
        "namespace": namespace,
        "pool_size_bytes": 256 << 20,
    }
    if role == "kv_producer":
        return {
            "need_send_cache": True,
            "omni_from_stage": 0,
            "omni_to_stage": 1,
            "connector_config": connector,
        }
    return {
        "need_recv_cache": True,
        "stage_id": 1,
        "omni_from_stage": 0,
        "recv_timeout": recv_timeout,
        "connector_config": connector,
    }
