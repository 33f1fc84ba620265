"""``omnikv bench fanout`` runs end to end on a short round of many senders and receivers: every
payload verified, the report's figures present, every process's RSS and open files sampled
three times (no speed assertion: speed claims live in the benchmark's own output)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from omnikv.bench.fanout import _grew
from support.bench import run_bench_json


@pytest.mark.slow
@pytest.mark.timeout(260)
def test_bench_fanout_short_run_verifies_every_payload(tmp_path: Path) -> None:
    out = tmp_path / "fanout.json"
    args = ["--senders", "4", "--receivers", "4", "--in-flight", "32", "--rounds", "2"]
    args += ["--large-tokens", "64", "--no-targets"]
    result = run_bench_json("fanout", args, out, timeout=240)
    assert result["verified"]
    assert result["in_flight"] == 32
    assert result["latency"]["runs"] == 2 * 32
    assert 0 < result["latency"]["median_s"] <= result["latency"]["p99_s"]
    assert result["aggregate_gbps"] > 0 and result["memcpy"]["gbps_median"] > 0
    names = {f"sender {i}" for i in range(4)} | {f"receiver {i}" for i in range(4)}
    assert set(result["processes"]) == names
    for row in result["processes"].values():
        assert len(row["rss_mib"]) == len(row["private_mib"]) == len(row["fds"]) == 3
        assert all(r > 0 for r in row["rss_mib"]) and all(f > 0 for f in row["fds"])


@pytest.mark.slow
@pytest.mark.timeout(260)
def test_bench_fanout_readers_writes_once_and_every_reader_verifies(tmp_path: Path) -> None:
    """``--readers 3``: the shared put wrote the payload once per sample, the per-reader path
    three times (the sender's ``put_bytes``), the leader broadcast once before its gloo copies,
    and every reader checked every sample of each way."""
    out = tmp_path / "readers.json"
    args = ["--readers", "3", "--size-mib", "8", "--repeat", "2", "--warmup", "1", "--no-targets"]
    result = run_bench_json("fanout", args, out, timeout=240)
    assert result["verified"] and result["written_once"]
    n = result["payload_bytes"]
    assert 7 << 20 <= n <= 9 << 20
    assert result["written_bytes"]["shared"] == [n, n]
    assert result["written_bytes"]["per_reader"] == [3 * n, 3 * n]
    assert result["written_bytes"]["bcast"] == [n, n]  # then copied on by the leader
    for case in ("shared", "per_reader", "bcast", "memcpy"):
        assert result[case]["runs"] == 2 and result[case]["median_s"] > 0


def test_growth_beyond_a_bound_is_a_miss() -> None:
    flat = [(200.0, 30), (230.0, 31), (210.0, 30)]
    assert not _grew(flat, 64.0, 4)
    assert _grew([(200.0, 30), (200.0, 30), (265.0, 30)], 64.0, 4)  # RSS at the end
    assert _grew([(200.0, 30), (200.0, 35), (200.0, 30)], 64.0, 4)  # files in the middle


@pytest.mark.slow
@pytest.mark.timeout(260)
def test_a_killed_driver_takes_its_stage_processes_with_it() -> None:
    cmd = [sys.executable, "-m", "omnikv.cli", "bench", "fanout", "--senders", "2"]
    cmd += ["--receivers", "2", "--in-flight", "64", "--rounds", "10000", "--large-tokens", "64"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    driver = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    try:
        assert driver.stdout is not None
        # printed once every stage process said it is ready: they all exist now
        assert "2 senders x 2 receivers" in driver.stdout.readline().decode()
        with open(f"/proc/{driver.pid}/task/{driver.pid}/children", encoding="ascii") as f:
            children = [int(pid) for pid in f.read().split()]
        assert len(children) == 4
        # rounds are running once every stage maps a pool: the receivers are then (almost
        # always) blocked in a receive, which without the kernel's help outlives the driver
        deadline = time.monotonic() + 60
        while not all(_shmem_kib(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.05)  # polling the kernel's view, bounded by the deadline
        assert all(_shmem_kib(pid) for pid in children)
    finally:
        driver.kill()
        driver.wait(30)
    deadline = time.monotonic() + 30
    alive = children
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in alive if _running(pid)]
        time.sleep(0.05)  # polling the kernel's view, bounded by the deadline
    for pid in alive:  # never leave one behind, even when the test fails
        os.kill(pid, signal.SIGKILL)
    assert not alive


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (not gone, not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _shmem_kib(pid: int) -> int:
    """The shared-memory part of ``pid``'s RSS in KiB (0 when it has none or is gone)."""
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8") as f:
            for line in f:
                if line.startswith("RssShmem:"):
                    return int(line.split()[1])
    except FileNotFoundError:
        pass
    return 0
