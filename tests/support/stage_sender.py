"""A sending stage in its own process, for receiver tests over real shared memory.

The child runs an ``OmniKVTransferManager`` (sender side, ``SharedMemoryConnector`` on the
test's namespace) and sends a request's KV when told over a pipe (plain tuples only): layer
``i`` of both K and V is filled with ``fill + i``. Tests kill it by PID at the end.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from multiprocessing.connection import Connection
from typing import Any

import torch

_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(["omnikv.manager", "omnikv.connectors.shm.connector"])


def sender_main(conn: Connection, namespace: str, pool_size_bytes: int) -> None:
    """Child: ``("send", rid, fill)`` sends that request's KV; ``("close",)`` closes."""
    from omnikv import OmniKVCacheConfig, OmniKVTransferManager

    mgr = OmniKVTransferManager(
        OmniKVCacheConfig(
            connector_config={
                "type": "SharedMemoryConnector",
                "namespace": namespace,
                "pool_size_bytes": pool_size_bytes,
            },
            from_stage="stage1",
            to_stage="stage2",
            need_send_cache=True,
        )
    )
    conn.send(("ready", os.getpid()))
    while True:
        try:
            cmd = conn.recv()
        except EOFError:
            break
        if cmd[0] == "send":
            _, rid, fill = cmd
            caches: list[Any] = [torch.full((2, 4, 8, 2, 4), float(fill) + i) for i in range(2)]
            mgr.handle_finished_requests_kv_transfer(
                {rid: {"block_ids": [0, 1], "seq_len": 10}}, caches, 8, "torch.float32"
            )
            res = mgr.get_send_result(rid)
            conn.send(("sent", rid, bool(res is not None and res.ok)))
        elif cmd[0] == "close":
            mgr.close()
            conn.send(("closed",))
            break


def stage_receiver(namespace: str, timeout: float, *, prefetch: bool = False) -> Any:
    """The receiving stage's manager on the test's namespace (``stage1`` -> ``stage2``)."""
    from omnikv import OmniKVCacheConfig, OmniKVTransferManager

    return OmniKVTransferManager(
        OmniKVCacheConfig(
            connector_config={"type": "SharedMemoryConnector", "namespace": namespace},
            from_stage="stage1",
            stage_id="stage2",
            need_recv_cache=True,
            recv_timeout=timeout,
            enable_kv_async_prefetch=prefetch,
        ),
        async_prefetch=prefetch,
    )


class SenderProc:
    """Handle of one sender process (started and ready when constructed)."""

    def __init__(self, namespace: str, pool_size_bytes: int = 8 << 20) -> None:
        self.conn, child = _CTX.Pipe()
        self.proc = _CTX.Process(
            target=sender_main, args=(child, namespace, pool_size_bytes), daemon=True
        )
        self.proc.start()
        child.close()
        assert self.recv(30.0)[0] == "ready"

    def recv(self, timeout: float = 10.0) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"sender {self.proc.pid} did not answer within {timeout}s")
        return self.conn.recv()

    def send_kv(self, rid: str, fill: float) -> None:
        """Send ``rid``'s KV and wait until the sender says it was published."""
        self.conn.send(("send", rid, fill))
        assert self.recv() == ("sent", rid, True)

    def kill(self) -> None:
        """SIGKILL by PID and reap."""
        if self.proc.pid is not None and self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)
        assert not self.proc.is_alive()
