"""``examples/vllm_offline_pd.py``: two offline vLLM engines, prefill on one, decode on the other.

Runs in ``.venv-vllm`` (``make test-vllm``); skipped where vLLM is not installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.util import find_spec

import pytest

from support import paths

pytestmark = [
    pytest.mark.slow,
    pytest.mark.engine,
    pytest.mark.skipif(
        find_spec("vllm") is None, reason="vLLM not installed (make test-vllm builds .venv-vllm)"
    ),
    pytest.mark.timeout(900),
]

EXAMPLE = paths.EXAMPLES / "vllm_offline_pd.py"


def test_vllm_offline_pd() -> None:
    env = dict(os.environ)
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # as a user runs it: the example sets what it needs
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE)],
        capture_output=True,
        text=True,
        timeout=850,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-5000:]
    out = proc.stdout
    assert "producer: prefilled 17 tokens" in out
    assert "from the transferred KV" in out
    assert "same tokens as computing the prompt on the consumer: True" in out
