"""Running ``omnikv bench NAME`` as a user would, for the benchmarks' smoke tests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any


def run_bench_json(name: str, args: list[str], out: Path, *, timeout: float) -> dict[str, Any]:
    """Run ``omnikv bench name *args --json out`` in a fresh interpreter and return the JSON it
    wrote; fails the test (with the end of its output) when it exits non-zero. The callers pass
    ``--no-targets``: a missed speed target (likely on a busy machine) is reported, not fatal,
    while a verification failure still fails the run."""
    cmd = [sys.executable, "-m", "omnikv.cli", "bench", name, *args, "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    output = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, output
    assert out.exists(), output
    result: dict[str, Any] = json.loads(out.read_text())
    return result
