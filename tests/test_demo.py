"""``omnikv demo`` end to end: two real processes over shared memory, and in one process.

The demo itself checks the KV bit for bit and the tokens against a single-process run; these
tests check its exit codes and that a perturbed KV is caught (exit 1), with nothing left behind.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"


def _demo(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(SRC), OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "omnikv.cli", "demo", "--timeout", "60", *args],
        capture_output=True,
        text=True,
        timeout=90,
        env=env,
        check=False,
    )


def _shm_files() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if "omnikv" in n}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("connector", ["SharedMemoryConnector", "LocalConnector"])
def test_demo_tokens_match_reference(connector: str) -> None:
    before = _shm_files()
    out = _demo(
        "--requests", "2", "--prompt-len", "60", "--new-tokens", "6", "--connector", connector
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "tokens match the single-process reference: yes" in out.stdout
    assert "result: PASS" in out.stdout
    assert out.stdout.count("kv bit-identical") == 2
    assert _shm_files() <= before


@pytest.mark.timeout(120)
def test_demo_fails_on_a_perturbed_kv() -> None:
    out = _demo("--requests", "1", "--prompt-len", "40", "--new-tokens", "4", "--inject-fault")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "DIFFERS" in out.stdout
    assert "received KV bit-identical to stage 0's: NO" in out.stdout
    assert "result: FAIL" in out.stdout
