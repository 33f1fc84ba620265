"""``omnikv demo`` end to end: two real processes over shared memory, and in one process.

The demo itself checks the KV bit for bit and the tokens against a single-process run; these
tests check its exit codes, that a perturbed KV is caught (exit 1) with nothing left behind, and
that it prints the realistic transfer's figures (time, GB/s, ratio to a memcpy of the same run).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

from support import paths

pytestmark = pytest.mark.slow  # every test runs the demo as a process

SRC = paths.SRC


def _demo(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(SRC), OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "omnikv.cli", "demo", "--timeout", "90", *args],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        check=False,
    )


def _shm_files() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if "omnikv" in n}


_REALISTIC = re.compile(
    r"realistic transfer, (.+?): (\d+) MiB \(Qwen2\.5-7B KV: 28 layers x 4 kv heads x 128 dims, "
    r"fp16, (\d+) tokens\) in [\d.]+ ms \(median of 3, [\d.]+-[\d.]+ ms\), [\d.]+ GB/s = "
    r"[\d.]+x the time of a memcpy of the same bytes in this run \([\d.]+ ms, [\d.]+ GB/s\); "
    r"KV checksums match"
)


@pytest.mark.timeout(270)
@pytest.mark.parametrize("connector", ["SharedMemoryConnector", "LocalConnector"])
def test_demo_tokens_match_reference(connector: str) -> None:
    before = _shm_files()
    out = _demo(
        "--requests",
        "2",
        "--prompt-len",
        "60",
        "--new-tokens",
        "6",
        "--connector",
        connector,
        "--realistic-tokens",
        "512",
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "tokens match the single-process reference: yes" in out.stdout
    assert "result: PASS" in out.stdout
    assert out.stdout.count("kv bit-identical") == 2
    assert "GB/s" not in out.stdout.split("realistic transfer")[0]  # no bandwidth for the toy
    found = _REALISTIC.search(out.stdout)
    assert found is not None, out.stdout
    assert found.group(2, 3) == ("28", "512")
    where = "in one process" if connector == "LocalConnector" else "stage 0 -> stage 1 process"
    assert found.group(1) == where
    assert _shm_files() <= before


@pytest.mark.timeout(270)
def test_demo_fails_on_a_perturbed_kv() -> None:
    out = _demo(
        "--requests",
        "1",
        "--prompt-len",
        "40",
        "--new-tokens",
        "4",
        "--inject-fault",
        "--realistic-tokens",
        "0",
    )
    assert out.returncode == 1, out.stdout + out.stderr
    assert "DIFFERS" in out.stdout
    assert "received KV bit-identical to stage 0's: NO" in out.stdout
    assert "realistic transfer" not in out.stdout
    assert "result: FAIL" in out.stdout


@pytest.mark.timeout(270)
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="no transformers")
def test_hf_llama_demo_in_one_process() -> None:
    out = _demo(
        "--model",
        "hf-llama",
        "--connector",
        "LocalConnector",
        "--prompt-lens",
        "1,17",
        "--new-tokens",
        "3",
        "--realistic-tokens",
        "0",
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "hf-llama (4 layers, 4 heads over 2 kv heads), fp32 KV" in out.stdout
    assert out.stdout.count("kv bit-identical") == 2
    assert "result: PASS" in out.stdout
