"""``omnikv bench manager`` runs end to end on small iteration counts and verifies its data (no
speed assertion: speed claims live in the benchmark's own output, see README)."""

from __future__ import annotations

import math
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
        "--wait-iters",
        "5",
        "--wait-gaps-ms",
        "2,20",
        "--idle-s",
        "0.5",
        "--torch-threads",
        "2",
        "--no-targets",
    ]
    result = run_bench_json("manager", args, out, timeout=140)
    case = result["cases"]["64KiB"]
    assert result["bench"] == "manager" and case["runs"] == 20 and case["first_s"] > 0
    # CPU per steady-state request on each side, next to one memcpy's CPU of the payload
    assert case["tx_cpu_s"] > 0 and case["rx_cpu_s"] > 0 and case["memcpy_cpu_s"] >= 0
    # the receiver-already-waiting case: each gap with its floor and the phases of a receive
    waiting = {row["gap_ms"]: row for row in result["waiting"]}
    assert sorted(waiting) == [2.0, 20.0]
    for row in waiting.values():
        assert row["runs"] == 5 and row["floor"]["runs"] == 5
        assert row["floor"]["median_s"] > 0 and row["median_s"] > 0
        phases = row["phases_ms"]
        assert list(phases) == [
            "send call to put done",
            "put done to wait end (wake-up)",
            "decode",
            "finish (checks, verdict)",
            "seed dict, return",
        ]
        assert phases["decode"] > 0 and phases["send call to put done"] > 0
        # the host's idle penalty beside it: the same Python back to back and after the gap
        penalties = row["idle_penalty"]
        assert sorted(penalties) == ["scattered reads (a few MiB)", "tight loop (a few KiB)"]
        for pen in penalties.values():
            assert pen["hot"]["runs"] == 5 and pen["cold"]["runs"] == 5
            hot, cold = pen["hot"]["median_s"], pen["cold"]["median_s"]
            assert hot > 0 and pen["ratio"] == pytest.approx(cold / hot)
    idle = result["idle_receiver"]
    assert idle["wall_s"] >= 0.5 and 0 <= idle["cpu_s"] < idle["wall_s"]


def test_cpu_per_request_counts_only_the_steady_samples() -> None:
    """Each side's CPU per request is the growth of its CPU clock from the end of the last
    skipped sample (first request, warm-up) to the end of the last sample, per sample."""
    from omnikv.bench.manager import _Phases

    phases = _Phases()
    phases.tx_cpu_s += [5.0, 6.0, 8.0, 11.0]  # 5 s of set-up before the first sample ended
    phases.rx_cpu_s += [1.0, 1.5, 2.0, 3.0]
    assert phases.cpu_per_request(2) == (2.5, 0.75)
    assert all(math.isnan(x) for x in phases.cpu_per_request(4))  # nothing steady
    phases.clear()
    assert phases.tx_cpu_s == [] and phases.rx_cpu_s == []
