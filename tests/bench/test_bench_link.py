"""``omnikv bench link`` end to end: each connector moves verified bytes between two emulated
nodes across a shaped link, and the run leaves nothing behind, also when it is killed.

Every run is a separate ``omnikv bench link`` process with small payloads at 1 Gbit/s (seconds
per case) and ``--no-targets`` (speed is the benchmark's own report, never asserted here). The
benchmark checks each sample's crc32 and that the sender's veth sent at least the payload's size
during it, and lists in its JSON anything of the link left after its teardown.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from omnikv.bench.link import CASES, CONNECTORS
from omnikv.bench.netns import namespace_in_use, unavailable_reason

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason())),
]


def _status(case: str) -> str:
    from omnikv.cli import connector_status

    return connector_status(CONNECTORS[case])


def _bench(*args: str, timeout: float = 100.0) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "omnikv.cli", "bench", "link", "--rate", "1gbit", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    return proc.returncode, proc.stdout[-4000:] + proc.stderr[-3000:]


def _check_run(result: dict[str, Any], cases: list[str], output: str) -> None:
    assert result["verified"] and result["failures"] == [], output
    assert result["leftovers"] == [], output
    for case in cases:
        ratios = result["ratios"][case]
        assert ratios["link_bytes_min"] >= 1.0, (case, ratios)  # every sample crossed the link
        assert result["results"][case]["runs"] == result["repeat"], output


@pytest.mark.engine
@pytest.mark.timeout(150)
@pytest.mark.parametrize("case", CASES)
def test_each_connector_moves_verified_bytes_across_the_link(case: str, tmp_path: Path) -> None:
    status = _status(case)
    if status != "ok":
        pytest.skip(status)
    out = tmp_path / f"{case}.json"
    args = ["--only", case, "--size-mib", "8", "--repeat", "2", "--warmup", "0"]
    rc, output = _bench(*args, "--no-targets", "--json", str(out))
    assert rc == 0, output
    result = json.loads(out.read_text())
    _check_run(result, [case], output)
    assert result["rate_bps"] == 10**9 and result["nbytes"] == 8 << 20
    assert result["delay_applied"] or "netem" in result["delay_note"]


@pytest.mark.timeout(150)
def test_bench_link_smoke_runs_every_available_connector(tmp_path: Path) -> None:
    out = tmp_path / "link.json"
    rc, output = _bench(
        "--size-kib", "512", "--repeat", "1", "--warmup", "0", "--no-targets", "--json", str(out)
    )
    assert rc == 0, output
    result = json.loads(out.read_text())
    ran = [c for c in CASES if c not in result["skipped"]]
    _check_run(result, ran, output)
    assert "raw TCP stream" in output and "Verdict" in output
    # per connector: raw samples before its set-up and in its rounds
    expected_raw = 2 * len(ran) * result["repeat"] if ran else result["repeat"]
    assert result["results"]["raw"]["runs"] == expected_raw, output


def test_bench_link_refuses_a_bad_rate_and_an_unknown_case() -> None:
    rc, output = _bench("--rate", "10gbps")
    assert rc == 2 and "bytes per second" in output
    rc, output = _bench("--only", "rdma", "--size-kib", "64")
    assert rc == 1 and "unknown case" in output


# -- teardown when the benchmark is stopped by a signal ----------------------------------------
def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                ppid = int(stat.rsplit(")", 1)[1].split()[1])
                tree.setdefault(ppid, []).append(int(entry))
    return tree


def _descendants(pid: int) -> list[int]:
    tree, out, todo = _children(), [], [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _read_until(proc: subprocess.Popen[bytes], marker: str, timeout: float) -> str:
    """The benchmark's output up to ``marker`` (waits on the pipe, bounded by ``timeout``)."""
    assert proc.stdout is not None
    fd, seen, end = proc.stdout.fileno(), b"", time.monotonic() + timeout
    while marker.encode() not in seen:
        left = end - time.monotonic()
        assert left > 0, f"no {marker!r} within {timeout} s:\n{seen.decode()}"
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            chunk = os.read(fd, 1 << 16)
            assert chunk, f"the benchmark exited before {marker!r}:\n{seen.decode()}"
            seen += chunk
    return seen.decode()


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Wait (on pidfds, no polling) until every process in ``pids`` exited; those that did not."""
    fds = {}
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            fds[pid] = os.pidfd_open(pid)
    try:
        end = time.monotonic() + timeout
        pending = dict(fds)
        while pending and (left := end - time.monotonic()) > 0:
            ready, _, _ = select.select(list(pending.values()), [], [], left)
            pending = {p: fd for p, fd in pending.items() if fd not in ready}
        return sorted(pending)
    finally:
        for fd in fds.values():
            os.close(fd)


@pytest.mark.engine
@pytest.mark.timeout(300)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_stopped_benchmark_leaves_no_process_or_namespace(sig: signal.Signals) -> None:
    if _status("store") != "ok":
        pytest.skip(_status("store"))
    # Store: agents in both nodes and a mooncake_master under node a's agent; 100 Mbit/s and
    # 32 MiB make each sample last seconds, so the signal lands mid-transfer
    cmd = [sys.executable, "-m", "omnikv.cli", "bench", "link", "--rate", "100mbit"]
    cmd += ["--only", "store", "--size-mib", "32", "--repeat", "3", "--no-targets"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        # four processes in two namespaces, each importing torch and Mooncake, and a master:
        # minutes on a loaded host
        _read_until(proc, "store: set up", timeout=180)
        tree = _descendants(proc.pid)
        spaces = set()
        for pid in tree:
            for kind in ("net", "mnt"):
                with contextlib.suppress(OSError):
                    spaces.add((kind, os.stat(f"/proc/{pid}/ns/{kind}").st_ino))
        ours = {(k, os.stat(f"/proc/self/ns/{k}").st_ino) for k in ("net", "mnt")}
        spaces -= ours
        assert len(tree) >= 5 and len(spaces) == 4, (tree, spaces)  # holders, agents, master
        os.kill(proc.pid, sig)
        proc.wait(timeout=60)
        assert _wait_gone(tree, timeout=30) == []
        for kind, inode in spaces:
            assert namespace_in_use(kind, inode) == []
        if sig == signal.SIGTERM:
            assert proc.returncode == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()
