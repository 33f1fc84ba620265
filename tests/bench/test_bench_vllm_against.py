"""``omnikv bench vllm --against``: its options, each contender's ``KVTransferConfig``, the
reason it reports for a connector that cannot start, and (where vLLM is installed, ``make
test-vllm``) a reduced run: OmniKV, vLLM's ExampleConnector and MooncakeConnector, which
cannot start on a host without an accelerator."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import time
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest

from omnikv.bench import vllm as bench_vllm
from omnikv.bench import vllm_against
from support.polling import until

pytestmark = pytest.mark.timeout(60)


def test_against_names() -> None:
    assert vllm_against.parse_against("ExampleConnector, NixlConnector,ExampleConnector") == [
        "ExampleConnector",
        "NixlConnector",
    ]
    assert vllm_against.parse_against("all") == list(vllm_against.CANDIDATES)
    for bad in ("", "OmniKVConnector", "NixlConnector,Nope"):
        with pytest.raises(ValueError, match="unknown connector"):
            vllm_against.parse_against(bad)
    assert set(vllm_against.TRANSPORTS) == {vllm_against.OMNIKV, *vllm_against.CANDIDATES}


def test_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    ns = bench_vllm._parse(["--against", "NixlConnector", "--tokens", "96", "--repeat", "1"])
    assert ns.against == ["NixlConnector"] and ns.repeat == 1
    assert bench_vllm._parse([]).against is None
    for bad in (["--against", "Nope"], ["--repeat", "0"]):
        with pytest.raises(SystemExit) as exc:
            bench_vllm._parse(bad)
        assert exc.value.code == 2
    assert "unknown connector(s) ['Nope']" in capsys.readouterr().err


def test_every_contender_fails_a_load_instead_of_recomputing(tmp_path: Path) -> None:
    for name in (vllm_against.OMNIKV, *vllm_against.CANDIDATES):
        for role in ("kv_producer", "kv_consumer"):
            cfg = vllm_against.transfer_config(name, role, namespace="ns", storage=tmp_path)
            assert cfg["kv_connector"] == name and cfg["kv_load_failure_policy"] == "fail"
    omni = vllm_against.transfer_config(
        vllm_against.OMNIKV, "kv_consumer", namespace="ns", storage=tmp_path
    )
    assert omni["kv_connector_module_path"] == "omnikv.integrations.vllm"
    extra = omni["kv_connector_extra_config"]["omni_kv_config"]
    assert extra["need_recv_cache"] and extra["connector_config"]["namespace"] == "ns"
    nixl = vllm_against.transfer_config(
        "NixlConnector", "kv_producer", namespace="ns", storage=tmp_path
    )
    assert nixl["kv_buffer_device"] == "cpu" and nixl["kv_role"] == "kv_producer"
    example = vllm_against.transfer_config(
        "ExampleConnector", "kv_consumer", namespace="ns", storage=tmp_path
    )
    assert example["kv_connector_extra_config"] == {"shared_storage_path": str(tmp_path)}
    offload = vllm_against.transfer_config(
        "OffloadingConnector", "kv_consumer", namespace="ns", storage=tmp_path
    )
    assert offload["kv_role"] == "kv_both"
    assert offload["kv_connector_extra_config"]["cpu_bytes_to_use"] > 0  # else it stops there


ENGINE_LOG = """\
INFO 12-06 23:20:01 [core.py:90] Initializing a V1 LLM engine
(EngineCore pid=12) ERROR 12-06 23:20:09 [core.py:1100] EngineCore failed to start.
(EngineCore pid=12) ERROR 12-06 23:20:09 [core.py:1100] Traceback (most recent call last):
(EngineCore pid=12) ERROR 12-06 23:20:09 [core.py:1100]   File "x.py", line 3, in f
(EngineCore pid=12) ERROR 12-06 23:20:09 [core.py:1100] RuntimeError: Cannot access accelerator \
device when none is available.
Traceback (most recent call last):
  File "y.py", line 1, in g
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
"""


#: A stand-in engine: it starts a child (as vLLM's engine starts its engine core), records both
#: PIDs, and then neither replies nor notices its input closing (as an engine still loading).
FAKE_ENGINE = """
import os, subprocess, sys, time
core = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
tmp = os.path.join(os.environ["FAKE_ENGINE_DIR"], f"{os.getpid()}.tmp")
with open(tmp, "w") as f:
    f.write(f"{os.getpid()} {core.pid}")
os.rename(tmp, tmp[:-4] + ".pids")
sys.stdin.read()
time.sleep(600)
"""
#: The benchmark's run with the stand-in engines (OmniKV and one contender: four engines).
DRIVER = """
import argparse, sys
from pathlib import Path
from omnikv.bench import vllm_against
vllm_against._argv = lambda cfg: [sys.executable, "-c", sys.argv[2]]
vllm_against.build_tiny_llama = lambda path, dtype: path
ns = argparse.Namespace(tokens="96", dtype="float32", repeat=1, start_timeout=600,
                        round_timeout=60)
vllm_against.run_against(ns, Path(sys.argv[1]), ["ExampleConnector"])
"""


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


@pytest.mark.slow  # five processes per case
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_every_engine_dies_with_the_benchmark(tmp_path: Path, sig: signal.Signals) -> None:
    """Killed while its engines start (SIGINT, SIGTERM as ``timeout`` sends it, or SIGKILL),
    the benchmark leaves no engine and no engine's child alive, checked by PID."""
    pids_dir = tmp_path / "pids"
    pids_dir.mkdir()
    env = os.environ | {"FAKE_ENGINE_DIR": str(pids_dir)}
    bench = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(tmp_path), FAKE_ENGINE],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 40
        while len(list(pids_dir.glob("*.pids"))) < 4 and time.monotonic() < deadline:
            assert bench.poll() is None, bench.communicate()[0].decode(errors="replace")
            time.sleep(0.05)  # polling for the four engines' files, bounded by the deadline
        files = list(pids_dir.glob("*.pids"))
        pids = [int(p) for f in files for p in f.read_text().split()]
        assert len(files) == 4 and all(_alive(p) for p in pids), pids
        bench.send_signal(sig)
        bench.wait(timeout=30)
        deadline = time.monotonic() + 20
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)  # polling for the kills to land, bounded by the deadline
        assert [p for p in pids if _alive(p)] == []
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait(timeout=10)
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def test_an_engine_runs_only_once_the_reaper_lists_its_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race the SIGKILL case above can lose on a starved host: the engine's program must
    not run before its group reaches the reaper. When the reaper is told, the child is still
    in the gate (its command line is the gate's, the engine has written nothing); it then
    becomes the engine with the same PID, and dies with the group."""
    groups = vllm_against.EngineGroups()
    ran = tmp_path / "ran"
    listed: list[tuple[list[bytes], bool]] = []
    real_tell = groups._tell

    def tell(line: str) -> None:
        if int(line) > 0:
            # the child cannot pass the gate while this runs; its command line reads empty for a
            # moment after its exec (the kernel sets it up after the exec's point of no return)
            path = Path(f"/proc/{line}/cmdline")
            until(path.read_bytes, 10.0, "the gate's command line")
            listed.append((path.read_bytes().split(b"\0"), ran.exists()))
        real_tell(line)

    monkeypatch.setattr(groups, "_tell", tell)
    engine = f"open({str(ran)!r}, 'w').close(); import sys; sys.stdin.read()"
    try:
        proc = groups.popen([sys.executable, "-c", engine], stdin=subprocess.PIPE, text=True)
        [(cmdline, engine_ran)] = listed
        assert cmdline[2] == vllm_against._GATE.encode() and not engine_ran
        until(ran.exists, 30.0, "the engine's program ran")
        assert Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")[2] == engine.encode()
        assert proc.pid in groups.groups
    finally:
        groups.close()
    assert proc.wait(timeout=10) == -signal.SIGKILL


def test_an_engine_whose_benchmark_died_before_listing_it_never_runs(tmp_path: Path) -> None:
    """The gate's other way out: the pipe ends without the byte (the benchmark died between the
    engine's start and its listing), so the engine's program never runs."""
    ran = tmp_path / "ran"
    gate_r, gate_w = os.pipe()
    os.close(gate_w)
    try:
        engine = [sys.executable, "-c", f"open({str(ran)!r}, 'w').close()"]
        done = subprocess.run(
            [sys.executable, "-c", vllm_against._GATE, str(gate_r), *engine],
            pass_fds=(gate_r,),
            timeout=30,
            check=False,
        )
    finally:
        os.close(gate_r)
    assert done.returncode == 1 and not ran.exists()


def test_the_reason_is_the_root_error_not_vllms_wrapper() -> None:
    reason = vllm_against.failure_reason(ENGINE_LOG)
    assert reason == "RuntimeError: Cannot access accelerator device when none is available."
    assert vllm_against.failure_reason("ModuleNotFoundError: No module named 'lmcache'\n") == (
        "ModuleNotFoundError: No module named 'lmcache'"
    )
    assert vllm_against.failure_reason("Fatal Python error: SIGILL in x\n").startswith("SIGILL")
    assert vllm_against.failure_reason("just\nlines\n") == "lines"
    assert vllm_against.failure_reason("") == "no output"
    assert len(vllm_against.failure_reason("ValueError: " + "x" * 900)) == 300


class _Starting:
    """An engine whose first reply is ``replies`` (nothing: it never answers)."""

    def __init__(self, *replies: dict[str, Any]) -> None:
        self._replies: queue.Queue[dict[str, Any]] = queue.Queue()
        for r in replies:
            self._replies.put(r)

    def next_reply(self, timeout: float) -> dict[str, Any]:
        try:
            return self._replies.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError("no reply") from None


def test_a_start_that_vllm_logged_as_failed_ends_without_waiting_out_its_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's engine may hang after its worker failed; once either engine of the contender
    logged that it cannot start, the wait ends (not at the start deadline), and the reason is
    the root cause the failed engine logged, not what the hanging one raised on its way."""
    monkeypatch.setattr(vllm_against, "START_POLL_S", 0.05)
    producer, consumer = tmp_path / "X-producer.log", tmp_path / "X-consumer.log"
    producer.write_text("AttributeError: 'Worker' object has no attribute 'ctx'\n")
    consumer.write_text("loading\n")
    t0 = time.monotonic()
    vllm_against._wait_started(_Starting({"ok": True}), [producer, consumer], t0 + 60)
    with pytest.raises(TimeoutError):  # nothing logged: the deadline decides
        vllm_against._wait_started(_Starting(), [producer, consumer], time.monotonic() + 0.3)
    consumer.write_text(
        "RuntimeError: Worker failed with error 'Cannot access accelerator device', see above\n"
        "RuntimeError: Engine core initialization failed. See root cause above.\n"
    )
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="X-consumer: the engine logged that it cannot start"):
        vllm_against._wait_started(_Starting(), [producer, consumer], t0 + 60)
    assert time.monotonic() - t0 < 10


@pytest.mark.slow
@pytest.mark.engine
@pytest.mark.skipif(find_spec("vllm") is None, reason="vLLM not installed (make test-vllm)")
@pytest.mark.timeout(1500)
def test_a_reduced_run_side_by_side(tmp_path: Path) -> None:
    # NixlConnector's run is the benchmark's (docs/benchmarks.md): here the two contenders
    # that bound the test's time, one that loads and one that cannot start on this host
    against = ["ExampleConnector", "MooncakeConnector"]
    out = tmp_path / "against.json"
    cmd = [sys.executable, "-m", "omnikv.cli", "bench", "vllm", "--against", ",".join(against)]
    cmd += ["--tokens", "96", "--repeat", "2", "--dtype", "float32", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1440, check=False)
    log = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, log
    (case,) = json.loads(out.read_text())["cases"]
    rows = {c["connector"]: c for c in case["contenders"]}
    assert list(rows) == [vllm_against.OMNIKV, *against]
    for name in (vllm_against.OMNIKV, "ExampleConnector"):
        row = rows[name]
        assert row["reason"] is None and row["failures"] == [], log
        assert row["transfer"]["runs"] == 2 and row["mismatches"] == 0, log
        # vLLM counts the prompt's loaded tokens as cached; prefix caching is off
        assert min(row["loaded_tokens"]) >= 64, log
    mooncake = rows["MooncakeConnector"]
    assert not mooncake["ran"] and "accelerator" in mooncake["reason"], log
