"""Every example in ``examples/`` runs as a newcomer runs it (``python examples/NAME.py``) and
prints what it promises. The vLLM example runs with the vLLM tests (test_examples_vllm.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.util import find_spec

import pytest

from support import paths

pytestmark = [pytest.mark.slow]

EXAMPLES = paths.EXAMPLES


def run_example(name: str, timeout: float = 300) -> str:
    """Run ``examples/<name>`` in a fresh interpreter; its output (stdout and stderr)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / name)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=EXAMPLES.parent,
        check=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    return proc.stdout


@pytest.mark.timeout(320)
@pytest.mark.skipif(find_spec("transformers") is None, reason="needs omnikv[transformers]")
def test_hf_handoff() -> None:
    out = run_example("hf_handoff.py")
    assert "prefill: sent the KV of 12 tokens (sent)" in out
    assert "decode: received" in out and "12 cached tokens" in out
    assert "same tokens as a single-process generate: True" in out


@pytest.mark.timeout(320)
def test_paged_kv_seed_api() -> None:
    out = run_example("paged_kv_seed_api.py")
    assert "stage 0: ['req-0'] handled, send sent" in out
    assert "per layer K and V of shape [40, 2, 64]" in out
    assert "KV equals the sender's blocks: True" in out


@pytest.mark.timeout(320)
def test_admission_step_loop() -> None:
    out = run_example("admission_step_loop.py")
    assert "step 0: admitted req-5 (50 tokens of KV)" in out
    assert "completed in arrival order: ['req-5', 'req-3', 'req-1', 'req-4', 'req-2']" in out
    assert "failed: ['req-6 (" in out


@pytest.mark.dist
@pytest.mark.timeout(320)
def test_tp2_to_tp4_gloo() -> None:
    out = run_example("tp2_to_tp4_gloo.py")
    assert out.count(": sent") == 2  # both sender ranks
    for rank in range(4):
        heads = [2 * rank, 2 * rank + 1]
        line = f"receiver rank {rank}: received True, heads {heads}, equal to the sender's: True"
        assert line in out
