"""A real ``mooncake_master`` on free loopback ports, for the benchmarks and the engine tests.

Started by ``omnikv bench mooncake`` and by the Mooncake tests
(``tests/support/mooncake_peers.py``);
nothing in the library's transfer path uses it. The master binary ships in the Mooncake wheel
(``pip install 'omnikv[mooncake]'``), next to the ``mooncake`` package. Every listener is bound
to ``127.0.0.1`` (the binary's defaults listen on all interfaces), with the HTTP metadata server
on, so clients use ``metadata_url`` and ``address``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["HOST", "MooncakeMaster", "free_ports", "master_binary"]

HOST = "127.0.0.1"

#: ``python -c`` shim: SIGKILL me when my parent dies (kept across exec), then exec argv[2:]
#: (the PID stays the same, so killing by PID still works).
_EXEC_DYING_WITH_PARENT = (
    "import ctypes, os, sys\n"
    "ctypes.CDLL(None).prctl(1, 9)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(1)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


def free_ports(n: int) -> list[int]:
    """``n`` distinct free TCP ports on 127.0.0.1 (bound to port 0 together, then released)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((HOST, 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def master_binary() -> str:
    """Path of the wheel's ``mooncake_master`` (``ImportError`` when Mooncake is missing)."""
    import mooncake

    return str(Path(mooncake.__file__).resolve().parent / "mooncake_master")


def _accepts(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((HOST, port)) == 0


class MooncakeMaster:
    """One ``mooncake_master`` process: ``start`` (bounded), ``stop`` (SIGKILL by PID).

    ``start`` returns once the RPC and HTTP metadata ports accept connections, or raises
    ``RuntimeError`` within ``timeout_s`` (the process is killed then). ``stop`` is idempotent.
    On Linux the master also dies with the process that started it (a ``PR_SET_PDEATHSIG`` shim
    execs it), so a killed benchmark or test leaves no master behind. Object leases are
    ``lease_ttl_ms`` (Mooncake's default is 5 s as well, stated so it does not drift).
    """

    def __init__(self, lease_ttl_ms: int = 5000) -> None:
        self.rpc_port, self.http_port, self.metrics_port = free_ports(3)
        self.lease_ttl_ms = int(lease_ttl_ms)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        """``host:port`` of the master's RPC service (the clients' ``master_server_address``)."""
        return f"{HOST}:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        """The HTTP metadata server (the clients' ``metadata_server``)."""
        return f"http://{HOST}:{self.http_port}/metadata"

    def start(self, timeout_s: float = 15.0) -> MooncakeMaster:
        args = [
            master_binary(),
            f"--rpc_address={HOST}",
            f"--rpc_port={self.rpc_port}",
            "--enable_http_metadata_server=true",
            f"--http_metadata_server_host={HOST}",
            f"--http_metadata_server_port={self.http_port}",
            f"--metrics_host={HOST}",
            f"--metrics_port={self.metrics_port}",
            f"--default_kv_lease_ttl={self.lease_ttl_ms}",
        ]
        if sys.platform.startswith("linux"):
            args = [sys.executable, "-c", _EXEC_DYING_WITH_PARENT, str(os.getpid()), *args]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        end = time.monotonic() + timeout_s
        for port in (self.rpc_port, self.http_port):
            while not _accepts(port):
                if self.proc.poll() is not None:
                    code = self.proc.returncode
                    self.proc = None
                    raise RuntimeError(f"mooncake_master exited with {code}")
                if time.monotonic() > end:
                    self.stop()
                    raise RuntimeError(f"mooncake_master did not listen within {timeout_s:.0f} s")
                time.sleep(0.02)  # bounded wait for "port accepts", re-checked every 20 ms
        return self

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)

    def __enter__(self) -> MooncakeMaster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
