"""Helpers for the Mooncake engine tests: isolated scenarios, a real master, peer processes.

A networked test calls :func:`run_scenario` with a ``scenario_*`` function of its module. The
function runs in a fresh child interpreter, inside ``unshare -n`` (a network namespace where only
loopback exists) when this process may create one, with ``MC_TCP_BIND_ADDRESS=127.0.0.1``. The
child's process group is killed by PID when the scenario ends or overruns its time limit. The
scenario returns a JSON-able dict, which :func:`run_scenario` returns to the test.

Inside a scenario, :class:`Master` starts the wheel's ``mooncake_master`` on free loopback ports
and :func:`spawn` starts peers (``multiprocessing`` spawn); both are stopped by PID.

The child runs ``python tests/support/scenario_child.py <module file> <function> <json params>``,
which arms the stack dump first and then calls :func:`scenario_main`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from omnikv.bench.mooncake_master import MooncakeMaster, free_ports
from omnikv.connectors.mooncake_te.engine import unavailable_reason as mooncake_skip_reason

__all__ = [
    "Master",
    "crc",
    "free_ports",
    "mooncake_scenario",
    "mooncake_skip_reason",
    "omnikv_threads",
    "pattern",
    "peers",
    "queue",
    "run_scenario",
    "spawn",
    "stop",
    "tcp_sockets",
]

RESULT_PREFIX = "OMNIKV-RESULT "
HERE = Path(__file__).resolve().parent
SRC = HERE.parent.parent / "src"
MiB = 1 << 20


def pattern(nbytes: int, seed: int) -> np.ndarray:
    """Deterministic bytes: a seeded 1 MiB block tiled, each MiB stamped with its index."""
    block = np.random.default_rng(seed).integers(0, 256, MiB, dtype=np.uint8)
    reps = -(-nbytes // MiB)
    out = np.tile(block, reps)[:nbytes].copy()
    out[::MiB] = (np.arange(reps, dtype=np.int64) % 256).astype(np.uint8)
    return out


def crc(buf: Any) -> int:
    return zlib.crc32(memoryview(np.ascontiguousarray(buf)).cast("B"))


def _can_unshare() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("ip") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-n", "sh", "-c", "ip link set lo up"],
        capture_output=True,
        timeout=10,
        check=False,
    )
    return probe.returncode == 0


def mooncake_scenario(module_file: str, func: str, timeout: float) -> dict[str, Any]:
    """A module fixture's scenario: skips the test where the Mooncake engine cannot run here,
    else :func:`run_scenario` of ``func`` in ``module_file``."""
    reason = mooncake_skip_reason()
    if reason is not None:
        pytest.skip(str(reason))
    return run_scenario(module_file, func, timeout=timeout)


_UNSHARE: bool | None = None


# what a scenario needs after its bound to be killed and reported
SCENARIO_REPORT_S = 15.0
# a scenario still running this long before its bound prints its threads' stacks
SCENARIO_STACKS_BEFORE_S = 8.0


def _check_fits_the_test_timeout(func: str, timeout: float) -> None:
    """Refuse a scenario whose bound does not fit in what is left of the test's pytest-timeout.

    pytest-timeout's default (signal) method arms ``ITIMER_REAL``; a scenario bound above what
    is left of it never fires, and a slow scenario then fails as a bare pytest timeout, without
    its output. Checked on every run, so a test whose mark is too low fails at once, on any host.
    """
    left, _ = signal.getitimer(signal.ITIMER_REAL)
    if left and left < timeout + SCENARIO_REPORT_S:
        raise AssertionError(
            f"scenario {func}: its bound of {timeout:.0f} s does not fit in the {left:.0f} s "
            f"left of the test's timeout; mark the test pytest.mark.timeout("
            f"{math.ceil(timeout + SCENARIO_REPORT_S) + 30}) or more"
        )


def run_scenario(
    module_file: str,
    func: str,
    params: dict[str, Any] | None = None,
    timeout: float = 60.0,
    *,
    private_shm: bool = False,
) -> dict[str, Any]:
    """Run ``func(**params)`` of ``module_file`` in an isolated child; return its dict.

    ``private_shm``: where the child runs in its own network namespace, it also gets its own
    mount namespace with an empty ``/dev/shm`` (so what it finds there, it created; the result's
    ``_private_shm`` says whether that was possible). Raises ``AssertionError`` with the child's
    output when it fails or overruns ``timeout``.
    """
    _check_fits_the_test_timeout(func, timeout)
    global _UNSHARE
    if _UNSHARE is None:
        _UNSHARE = _can_unshare() and os.environ.get("OMNIKV_NO_UNSHARE") != "1"
    env = dict(os.environ)
    env["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
    # the scenario's own directory too: processes it spawns import their targets from its module
    module_dir = str(Path(module_file).resolve().parent)
    path = [str(SRC), str(HERE.parent), module_dir, env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(path)
    env.setdefault("GLOG_minloglevel", "2")
    # an overrunning scenario prints its threads' stacks first (what it was waiting on)
    env["OMNIKV_SCENARIO_STACKS_S"] = str(max(1.0, timeout - SCENARIO_STACKS_BEFORE_S))
    cmd = [
        sys.executable,
        str(HERE / "scenario_child.py"),
        module_file,
        func,
        json.dumps(params or {}),
    ]
    if _UNSHARE and private_shm:
        setup = 'ip link set lo up && mount -t tmpfs -o size=1g omnikv-shm /dev/shm && exec "$@"'
        cmd = ["unshare", "-n", "-m", "--propagation", "private", "sh", "-c", setup, "sh", *cmd]
    elif _UNSHARE:
        cmd = ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", *cmd]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
        text=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        out, _ = proc.communicate()
        raise AssertionError(f"scenario {func} overran {timeout}s:\n{out[-12000:]}") from None
    finally:
        _kill_group(proc.pid)
    lines = [ln for ln in out.splitlines() if ln.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        raise AssertionError(f"scenario {func} failed (rc {proc.returncode}):\n{out[-6000:]}")
    result: dict[str, Any] = json.loads(lines[-1][len(RESULT_PREFIX) :])
    result["_isolated"] = bool(_UNSHARE)
    result["_private_shm"] = bool(_UNSHARE and private_shm)
    return result


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


# -- inside a scenario ---------------------------------------------------------------------------
# ``Master`` starts the wheel's ``mooncake_master`` on free loopback ports; stopped by PID.
Master = MooncakeMaster


_CTX = mp.get_context("spawn")


def spawn(target: Callable[..., None], *args: Any) -> BaseProcess:
    """Start ``target(*args)`` in a spawned peer process (stop it with :func:`stop`)."""
    proc = _CTX.Process(target=target, args=args, daemon=True)
    proc.start()
    return proc


def queue() -> Any:
    return _CTX.Queue()


def stop(*procs: BaseProcess, timeout: float = 10.0) -> None:
    """Join peers that finished; kill by PID those still running after ``timeout``."""
    end = time.monotonic() + timeout
    for p in procs:
        p.join(timeout=max(0.0, end - time.monotonic()))
        if p.is_alive() and p.pid is not None:
            os.kill(p.pid, signal.SIGKILL)
            p.join(timeout=5)


@contextlib.contextmanager
def peers(*procs: BaseProcess, timeout: float = 10.0) -> Iterator[tuple[BaseProcess, ...]]:
    try:
        yield procs
    finally:
        stop(*procs, timeout=timeout)


def tcp_sockets() -> list[list[int]]:
    """This process's open TCP sockets as ``[local_port, remote_port, state]`` (state 10: LISTEN,
    1: ESTABLISHED), read from ``/proc/self/fd`` and ``/proc/net/tcp{,6}`` of the current
    network namespace. Used by the leak checks after ``close()``.
    """
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/self/fd/{fd}")
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table, encoding="ascii") as fh:
            for line in list(fh)[1:]:
                cols = line.split()
                if len(cols) > 9 and cols[9] in inodes:
                    local, remote = (int(c.rsplit(":", 1)[1], 16) for c in cols[1:3])
                    found.append([local, remote, int(cols[3], 16)])
    return found


def omnikv_threads() -> list[str]:
    """Names of live threads that omnikv started (they all begin with ``omnikv``)."""
    return [t.name for t in threading.enumerate() if t.name.startswith("omnikv")]


def scenario_main(argv: list[str]) -> int:
    """Inside the child (``scenario_child.py``): run ``func(**params)`` of ``module_file`` and
    print its result on one ``RESULT_PREFIX`` line."""
    module_file, func, params = argv[0], argv[1], json.loads(argv[2])
    spec = importlib.util.spec_from_file_location(Path(module_file).stem, module_file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    result = getattr(module, func)(**params)
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0
