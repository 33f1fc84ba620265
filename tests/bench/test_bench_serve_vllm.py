"""``omnikv bench serve`` end to end, reduced: two vLLM servers and the router, the four cases
with one client and three requests each, ``auth_secret`` on (the default).

Speed is the benchmark's report, never asserted here. What is asserted: every request of the
measured clients completed with its KV loaded in (a), (c) and (d); the hostile ids of (c) were
refused at admission (none waited for and failed); each case reports where the consumer's
requests spent their time (KV wait where KV was loaded, prefill always); the (c)-against-(d)
target is computed. Runs in ``make test-vllm``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.engine,
    pytest.mark.skipif(find_spec("vllm") is None, reason="vLLM not installed (make test-vllm)"),
    pytest.mark.timeout(1500),
]


def test_the_four_cases_with_auth(tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    cmd = [sys.executable, "-m", "omnikv.cli", "bench", "serve", "--clients", "1"]
    cmd += ["--tokens", "96", "--requests", "3", "--max-tokens", "4", "--hostile-rate", "4"]
    cmd += ["--case-timeout", "120", "--recv-timeout", "30", "--json", str(out)]  # load, not speed
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1440, check=False)
    log = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, log
    assert "auth_secret" in proc.stdout.splitlines()[0], log
    data = json.loads(out.read_text())
    assert data["config"]["no_auth"] is False and "json" not in data["config"]
    cases = {r["case"]: r for r in data["results"]}
    assert list(cases) == ["pd", "recompute", "hostile", "busy"]
    for name in ("pd", "hostile", "busy"):
        r = cases[name]
        assert r["completed"] == 3 and r["completed_without_loaded_kv"] == 0, log
        assert r["loads"]["loads_ok"] == 3 and r["loads"]["loads_failed"] == 0, log
        assert r["consumer_timing"]["kv_wait"]["count"] == 3, log
        assert r["consumer_timing"]["prefill"]["count"] >= 3, log
    hostile = cases["hostile"]
    assert hostile["hostile"]["sent"] >= 1, log
    assert hostile["loads"]["loads_refused"] >= 1, log  # at admission: a forged id's MAC
    recompute = cases["recompute"]
    assert recompute["completed"] == 3 and "kv_wait" not in recompute["consumer_timing"], log
    assert recompute["consumer_timing"]["prefill"]["count"] == 3, log
    (target,) = data["hostile_overhead"]
    assert (target["clients"], target["tokens"]) == (1, 96)
    assert target["added"] == pytest.approx(target["hostile_p99_s"] / target["busy_p99_s"] - 1)
