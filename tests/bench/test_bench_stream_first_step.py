"""``omnikv bench stream --first-step`` end to end: a request's first ``stream_kv_blocks``
call timed on the caller's thread per prompt and codec, its chunk checked to be published,
nothing left in shared memory after the run.

A small prompt with ``--no-targets``: speed is the benchmark's own report, never asserted here.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def _leftovers() -> set[str]:
    return (
        {n for n in os.listdir("/dev/shm") if "okvfs" in n} if os.path.isdir("/dev/shm") else set()
    )


@pytest.mark.timeout(300)
def test_the_first_step_is_timed_for_every_prompt_and_codec() -> None:
    before = _leftovers()
    args = "--first-step --tokens 64,96 --codecs off,int8 --rounds 1 --decode-steps 2 --step-ms 5"
    cmd = [sys.executable, "-m", "omnikv.cli", "bench", "stream", *args.split(), "--no-targets"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False)
    out = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.returncode == 0 and "FAIL" not in out, out
    rows = [ln.split() for ln in out.splitlines() if ln.strip()[:3] in ("64 ", "96 ")]
    assert sorted((r[0], r[1]) for r in rows) == [
        ("64", "int8"),
        ("64", "off"),
        ("96", "int8"),
        ("96", "off"),
    ], out
    assert all(r[3] == "ms" for r in rows), out  # "<p50> ms", not "(no sample)"
    assert _leftovers() <= before
