"""``omnikv bench manager`` runs end to end on small iteration counts and verifies its data (no
speed assertion: speed claims live in the benchmark's own output, see README)."""

from __future__ import annotations

from pathlib import Path

import pytest

from support.bench import run_bench_json


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_bench_manager_small_run_verifies(tmp_path: Path) -> None:
    out = tmp_path / "manager.json"
    args = [
        "--skip-large",
        "--small-iters",
        "20",
        "--warmup",
        "1",
        "--pool-mib",
        "16",
        "--no-targets",
    ]
    result = run_bench_json("manager", args, out, timeout=140)
    case = result["cases"]["64KiB"]
    assert result["bench"] == "manager" and case["runs"] == 20 and case["first_s"] > 0
