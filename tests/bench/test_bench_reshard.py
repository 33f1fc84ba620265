"""``omnikv bench reshard`` runs end to end on a small request, verifies every target rank's KV
and reports bytes moved against the plan's minimum (no speed assertion: speed claims live in
the benchmark's own output)."""

from __future__ import annotations

from pathlib import Path

import pytest

from support.bench import run_bench_json


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(240)
def test_bench_reshard_small_run_moves_the_minimum(tmp_path: Path) -> None:
    out = tmp_path / "reshard.json"
    pairs = "TP 3 -> TP 2,TP 2 -> SP 4 (Ring)"
    args = ["--rounds", "1", "--tokens", "48", "--pool-mib", "16", "--pairs", pairs]
    result = run_bench_json("reshard", args, out, timeout=230)
    rows = result["pairs"]
    assert sorted(rows) == sorted(pairs.split(","))
    for row in rows.values():
        assert row["verified"]
        # the data moved is the minimum; what is above it is the 12 payloads' headers (each at
        # most a page with its alignment)
        assert row["minimum_bytes"] <= row["moved_bytes"] <= row["minimum_bytes"] + 12 * 4096
        assert row["all_to_all_bytes"] > row["minimum_bytes"]
