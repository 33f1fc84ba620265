"""The README's served recipe ("Serving with `vllm serve`"), its exact text run end to end.

Runs in ``.venv-vllm`` (``make test-vllm``; the recipe's ``python`` and ``omnikv`` are that
environment's); skipped where vLLM is not installed. The bash block is extracted from the README
and run unchanged in a fresh directory (``examples`` linked there) in a process group of its own,
with nothing set beyond what the recipe sets; the test waits for the router's ``/health``, sends
a completion through it, checks that the consumer loaded the prompt's KV (its
``vllm:omnikv_loads_ok``: the engines agreed on the secret read from the file the recipe
generated) and that the secret is in none of the logged lines (vLLM's "non-default args"
included) nor on any command line of the group, then stops the whole group by its id.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from importlib.util import find_spec
from pathlib import Path

import pytest

from support import paths
from support.leaks import assert_secret_hidden, group_cmdlines

pytestmark = [
    pytest.mark.slow,
    pytest.mark.engine,
    pytest.mark.skipif(
        find_spec("vllm") is None, reason="vLLM not installed (make test-vllm builds .venv-vllm)"
    ),
    pytest.mark.timeout(900),
]

SECTION = "### Serving with `vllm serve`"
ROUTER = "http://127.0.0.1:8000"
CONSUMER = "http://127.0.0.1:8200"


def recipe() -> str:
    """The first bash block of the README's serving section, as written."""
    text = (paths.REPO / "README.md").read_text(encoding="utf-8")
    section = text.split(SECTION, 1)[1]
    match = re.search(r"```bash\n(.*?)```", section, flags=re.S)
    assert match is not None, "no bash block in the serving section"
    return match.group(1)


def test_the_recipe_is_whole() -> None:
    text = recipe()
    for needed in ("VLLM_CPU_KVCACHE_SPACE", "--save-model", "auth_secret_file", "--model $MODEL"):
        assert needed in text
    assert '"auth_secret"' not in text  # the secret travels by file, never on a command line


def _status(url: str) -> int:
    """The HTTP status of a GET of ``url`` (no proxy); 0 when nothing answers."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=5.0) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return 0


def _wait_healthy(proc: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the recipe exited ({proc.returncode}):\n{log.read_text()[-5000:]}")
        if _status(ROUTER + "/health") == 200:
            return
        time.sleep(1.0)  # polling a server that starts: nothing to wait on but its port
    pytest.fail(f"no healthy router after {timeout} s:\n{log.read_text()[-5000:]}")


def _secret_file(pgid: int) -> Path:
    """The ``auth_secret_file`` the servers of group ``pgid`` were given (the recipe's)."""
    for cmdline in group_cmdlines(pgid).values():
        args = cmdline.split(b"\0")
        if b"--kv-transfer-config" in args:
            ktc = json.loads(args[args.index(b"--kv-transfer-config") + 1])
            return Path(ktc["kv_connector_extra_config"]["auth_secret_file"])
    raise AssertionError("no server with --kv-transfer-config in the recipe's group")


def test_the_served_recipe_runs_as_written(tmp_path: Path) -> None:
    from omnikv.bench.serve import fetch_metrics, load_counts, post_json

    (tmp_path / "examples").symlink_to(paths.EXAMPLES)
    script = tmp_path / "recipe.sh"
    script.write_text("set -e\n" + recipe(), encoding="utf-8")
    env = dict(os.environ)
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # the recipe sets what it needs
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env.update(HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
    log = tmp_path / "recipe.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            ["bash", str(script)],
            cwd=tmp_path,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # the recipe's servers and router: one group, ours
        )
    secret_file: Path | None = None
    try:
        _wait_healthy(proc, log, timeout=700)
        before = fetch_metrics(CONSUMER)
        body = {
            "model": "tiny-llama",
            "prompt": "w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12",
            "max_tokens": 8,
            "temperature": 0.0,
            "ignore_eos": True,
        }
        status, answer = post_json(ROUTER + "/v1/completions", body)
        assert status == 200, answer
        assert answer["choices"][0]["text"]
        counts = load_counts(before, fetch_metrics(CONSUMER))
        assert counts == {"loads_ok": 1, "loads_failed": 0, "loads_refused": 0}, counts
        secret_file = _secret_file(proc.pid)
        secret = secret_file.read_bytes().removesuffix(b"\n")
        assert_secret_hidden(secret, pgid=proc.pid, log=log.read_bytes(), servers=2)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the group this test started (its own session)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        if secret_file is not None:
            secret_file.unlink(missing_ok=True)  # the recipe's mktemp file
