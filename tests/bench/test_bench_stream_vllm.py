"""``omnikv bench stream --vllm`` end to end: a vLLM producer and a vLLM consumer in two emulated
nodes on a shaped link, the router-led early hand-off whole and streamed in two layer groups,
over the Mooncake Transfer Engine with ``auth_secret`` (each case starts a producer engine: a
stream of one group, the benchmark's third case, goes through the same stream worker and is
``test_vllm_engine.py``'s ``test_a_producer_that_streams_its_prefill_hands_off_the_same_kv``).

Small prompts with ``--no-targets``: speed is the benchmark's report, never asserted here. What
is asserted: every load succeeded (none recomputed), the streamed hand-off's tokens equal the
whole one's, both cases have samples, and nothing is left of the nodes. Runs in ``make
test-vllm`` (needs vLLM, Mooncake and network namespaces).
"""

from __future__ import annotations

import subprocess
import sys
from importlib.util import find_spec

import pytest

from omnikv.bench.netns import unavailable_reason

pytestmark = [
    pytest.mark.slow,
    pytest.mark.engine,
    pytest.mark.skipif(find_spec("vllm") is None, reason="vLLM not installed (make test-vllm)"),
    pytest.mark.skipif(find_spec("mooncake") is None, reason="Mooncake not installed"),
    pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason())),
]


@pytest.mark.timeout(660)
def test_whole_and_streamed_vllm_hand_offs_load_the_same_kv_across_the_link() -> None:
    cmd = [sys.executable, "-m", "omnikv.cli", "bench", "stream", "--vllm"]
    cmd += ["--rates", "1gbit", "--tokens", "192", "--chunk", "64", "--rounds", "1", "--no-targets"]
    cmd += ["--layer-groups", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=630, check=False)
    out = proc.stdout[-6000:] + proc.stderr[-6000:]
    assert proc.returncode == 0, out
    assert "FAIL" not in proc.stdout and "skipped" not in proc.stdout, out
    for case in ("whole, codec off", "streamed by 2 layer groups"):
        row = next((ln for ln in proc.stdout.splitlines() if ln.startswith(case)), "")
        assert " ms" in row and "(no sample)" not in row, out
