"""Helpers for the vLLM engine tests: test engines (``vllm_scripts/engine.py``) in parallel."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from omnikv.bench.vllm import EngineProcess, start_engines

ENGINE_SCRIPT = Path(__file__).resolve().parent / "vllm_scripts" / "engine.py"


def start_test_engines(
    configs: list[dict[str, Any]], logs: list[Path], timeout: float
) -> list[EngineProcess]:
    """Start one in-process test engine per config, in parallel; all ready or all stopped."""
    argvs = [[sys.executable, str(ENGINE_SCRIPT), json.dumps(c)] for c in configs]
    return start_engines(argvs, logs, timeout=timeout, in_process=True)
