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

from omnikv.config import TransferOptions

_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(["omnikv.manager", "omnikv.connectors.shm.connector"])


def _caches(fill: float) -> list[Any]:
    """Two layers of a 4-block paged cache (block size 8); layer ``i`` filled with ``fill + i``."""
    return [torch.full((2, 4, 8, 2, 4), float(fill) + i) for i in range(2)]


def sender_main(
    conn: Connection, namespace: str, pool_size_bytes: int, stream_kv: bool = False
) -> None:
    """Child: the sending stage's loop, through its transfer edge (plain tuples only).

    ``("send", rid, fill)`` sends 10 tokens in blocks 0 and 1 and answers whether they were
    published; ``("finish", rid, ids, seq_len, fill)`` sends (a streamed request: its tail)
    and answers the result's status and reason; ``("ship", rid, ids, seq_len, fill)`` ships a
    stream step (``stream_kv``) and answers the chunks shipped and the reason;
    ``("abort", rid)`` drops its stream's chunks; ``("wait", rid, timeout)`` waits for the
    send's verdict; ``("pending",)`` lists the keys still published; ``("close",)``."""
    from omnikv import OmniKVCacheConfig, OmniKVTransferManager
    from omnikv.transfer.edge import KVCaches

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
        ),
        options=TransferOptions(stream_kv=stream_kv),
    )
    edge = mgr.edge
    conn.send(("ready", os.getpid()))
    while True:
        try:
            cmd = conn.recv()
        except EOFError:
            break
        if cmd[0] == "send":
            _, rid, fill = cmd
            entry = {"block_ids": [0, 1], "seq_len": 10}
            res = edge.send(rid, entry, KVCaches(_caches(fill), 8, "torch.float32"))
            conn.send(("sent", rid, res.ok))
        elif cmd[0] in ("finish", "ship"):
            _, rid, ids, seq_len, fill = cmd
            entry = {"block_ids": list(ids), "seq_len": seq_len}
            caches = KVCaches(_caches(fill), 8, "torch.float32")
            if cmd[0] == "ship":
                called = edge.ship(rid, entry, caches)
                progress = edge.wait_stream(rid, 30.0)
                conn.send(("shipped", progress.chunks, called.reason or progress.reason))
            else:
                res = edge.send(rid, entry, caches)
                conn.send(("result", res.status.value, res.reason))
        elif cmd[0] == "abort":
            conn.send(("aborted", edge.abort_stream(cmd[1])))
        elif cmd[0] == "wait":
            res = edge.wait_delivered(cmd[1], cmd[2])
            conn.send(("status", None if res is None else res.status.value))
        elif cmd[0] == "pending":
            conn.send(("pending", mgr.flush(0.0)))
        elif cmd[0] == "close":
            mgr.close()
            conn.send(("closed",))
            break


def stage_receiver(
    namespace: str, timeout: float, *, prefetch: bool = False, stream_kv: bool = False
) -> Any:
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
        options=TransferOptions(stream_kv=stream_kv),
    )


class SenderProc:
    """Handle of one sender process (started and ready when constructed)."""

    def __init__(
        self, namespace: str, pool_size_bytes: int = 8 << 20, *, stream_kv: bool = False
    ) -> None:
        self.conn, child = _CTX.Pipe()
        self.proc = _CTX.Process(
            target=sender_main, args=(child, namespace, pool_size_bytes, stream_kv), daemon=True
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

    def ask(self, *cmd: Any, timeout: float = 10.0) -> Any:
        """Send ``cmd`` and return the sender's answer (a tuple)."""
        self.conn.send(cmd)
        return self.recv(timeout)

    def kill(self) -> None:
        """SIGKILL by PID and reap."""
        if self.proc.pid is not None and self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)
        assert not self.proc.is_alive()
