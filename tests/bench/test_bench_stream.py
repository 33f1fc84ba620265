"""``omnikv bench stream`` end to end: an AR stage and its next stage in two emulated nodes on a
shaped link, whole and streamed hand-offs, every received KV checked against the receiver's own
copy (bit for bit without a codec, within the bound with one), nothing left after the run.

Small prompts at 1 Gbit/s with ``--no-targets``: speed is the benchmark's own report, never
asserted here; what is asserted is that every sample verified and the run cleaned up.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from omnikv.bench.netns import unavailable_reason
from omnikv.connectors.mooncake_te.engine import unavailable_reason as mooncake_unavailable

pytestmark = [
    pytest.mark.slow,
    pytest.mark.engine,
    pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason())),
    pytest.mark.skipif(mooncake_unavailable() is not None, reason=str(mooncake_unavailable())),
]


def _bench(*args: str, timeout: float = 240.0) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "omnikv.cli", "bench", "stream", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    return proc.returncode, proc.stdout[-6000:] + proc.stderr[-3000:]


@pytest.mark.timeout(300)
def test_whole_and_streamed_hand_offs_verify_across_the_link() -> None:
    args = "--rates 1gbit --tokens 48 --decode-steps 24 --step-ms 10 --codecs off,int8 --rounds 1"
    rc, out = _bench(*args.split(), "--no-targets")
    assert rc == 0, out
    assert "FAIL" not in out, out
    for case in ("whole, codec off", "streamed, codec off", "whole, codec int8"):
        row = next((ln for ln in out.splitlines() if ln.startswith(case)), "")
        assert " ms" in row and "(no sample)" not in row, out


def test_bench_stream_refuses_bad_arguments() -> None:
    rc, out = _bench("--rates", "fast", timeout=60)
    assert rc == 2 and "rate" in out.lower(), out
    rc, out = _bench("--rounds", "0", timeout=60)
    assert rc == 2, out
