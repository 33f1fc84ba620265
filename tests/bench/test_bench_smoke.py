"""The benchmarks run end to end on small payloads and verify their data (no speed assertion:
speed claims live in the benchmarks' own output, see README)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from omnikv.bench.common import bounded_list
from support.bench import run_bench_json
from support.mooncake_peers import mooncake_skip_reason, run_scenario


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_bench_shm_small_run_verifies(tmp_path: Path) -> None:
    out = tmp_path / "shm.json"
    args = [
        "--size-mib",
        "8",
        "--iters",
        "2",
        "--ref-iters",
        "1",
        "--small-iters",
        "20",
        "--no-targets",
    ]
    result = run_bench_json("shm", args, out, timeout=100)
    assert result["bench"] == "shm" and result["nbytes"] > 7 << 20
    assert set(result["ratios"]) >= {"view_vs_memcpy", "copy_vs_memcpy"}, result["ratios"]


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_bench_codec_small_run_verifies(tmp_path: Path) -> None:
    """Encode and decode with and without the data check, and the KV MACs (this version's and
    the one before) over a small payload, each result verified."""
    out = tmp_path / "codec.json"
    args = ["--tokens", "64", "--quick", "--quality-prompts", "0", "--no-targets"]
    result = run_bench_json("codec", args, out, timeout=100)
    names = [r["name"] for r in result["results"]]
    assert "kv_mac: keyed BLAKE3 (v4)" in names and "HMAC-SHA256 (v3, before)" in names, names
    assert {"pack_into, no check", "pack_into + data check", "decode_kv + data check"} <= set(
        names
    ), names
    ratios = result["ratios"]
    assert ratios["mac_vs_memcpy"] > 0 and ratios["data_check_vs_memcpy"] > 0, ratios
    assert ratios["authenticated_vs_not"] > 1, ratios


def scenario_bench_mooncake(path: str) -> dict[str, Any]:
    from omnikv.bench.mooncake import main

    rc = main(["--repeat", "1", "--warmup", "0", "--size-mib", "8", "--json", path])
    out: dict[str, Any] = json.loads(Path(path).read_text())
    out["rc"] = rc
    return out


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.skipif(mooncake_skip_reason() is not None, reason=str(mooncake_skip_reason()))
def test_bench_mooncake_small_run_verifies(tmp_path: Path) -> None:
    path = str(tmp_path / "mooncake.json")
    r = run_scenario(__file__, "scenario_bench_mooncake", {"path": path}, timeout=130)
    assert r["rc"] == 0 and r["verified"] and r["failures"] == []
    assert set(r["ratios"]) == {"te", "te_e2e", "store"}
    assert r["samples_checked"] == 4 and r["samples_decoded"] >= 2
    assert all(v > 0 for v in r["ratios"].values())


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_bench_admission_small_run_verifies(tmp_path: Path) -> None:
    """Both modes run over two real sender processes and every payload is verified; admission
    never waits for a transfer (a wait would last until the missing request's deadline; the
    bench's own 5 ms stall threshold is a speed figure, not checked here); the only request that
    fails is the one never sent. The deadline (4 s) leaves a starved sender room to publish
    late: a sent request fails only when it is published past its deadline (the failure says
    when it was)."""
    out = tmp_path / "admission.json"
    args = ["--requests", "12", "--max-tokens", "256", "--rounds", "1", "--span-s", "0.4"]
    args += ["--recv-timeout", "4.0", "--no-targets", "--json", str(out)]
    proc = subprocess.run(
        [sys.executable, "-m", "omnikv.cli", "bench", "admission", *args],
        capture_output=True,
        text=True,
        timeout=170,
        check=False,
    )
    output = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, output
    result = json.loads(out.read_text())
    assert result["bench"] == "admission", result
    fifo, admission = result["rounds"]["fifo"][0], result["rounds"]["admission"][0]
    assert admission["max_in_kv_calls_s"] < 1.0 < fifo["max_in_kv_calls_s"], result
    assert fifo["completed"] + fifo["failed"] == 12 == admission["completed"] + admission["failed"]
    never = result["never_sent"]
    assert len(never) == 1, result  # 10 % of 12
    # the one never sent fails in both modes, at its deadline, and nothing else does
    for mode in (fifo, admission):
        assert list(mode["failures"]) == never, mode["failures"]
        assert mode["failures"][never[0]].startswith("timeout"), mode["failures"]


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("2,x", "not a list of gaps in ms"),
        ("", "must be 0..10000"),
        (" , ", "must be 0..10000"),
        ("2,10001", "must be 0..10000"),
        ("-1", "must be 0..10000"),
    ],
)
def test_a_bad_list_option_is_refused_before_anything_starts(text: str, error: str) -> None:
    """The benchmarks' comma-separated options (``bounded_list``) refuse a bad item, an empty
    list and a value out of range with argparse's error, naming what the list holds."""
    parse = bounded_list(float, 0, 10_000, "gaps in ms")
    assert parse("2, 20,") == (2.0, 20.0)
    with pytest.raises(argparse.ArgumentTypeError, match=error):
        parse(text)


@pytest.mark.timeout(60)
def test_the_command_line_refuses_a_bad_list_before_starting_a_process() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "omnikv.cli", "bench", "fanout", "--large-tokens", "8"],
        check=False,
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert result.returncode == 2 and "token counts must be 16..8192" in result.stderr
