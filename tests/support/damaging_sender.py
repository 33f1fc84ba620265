"""A sending stage in its own process whose payloads are damaged after they were written.

The child runs an ``OmniKVTransferManager`` (sender side, ``SharedMemoryConnector`` on the
test's namespace, the data check on as by default) and, told over a pipe
``("send", rid, where)``, sends a request's KV with one bit of the payload's data section
flipped in shared memory after the encoder wrote it (and its check): ``where`` is a byte
offset into the data section (negative: from its end), or ``None`` for an intact payload. It
answers ``("sent", rid, ok)``. This is a fault injected into real memory between a real
sender and a real receiver, as a bad DIMM or a stray write would. Tests kill it by PID.
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


def caches() -> list[Any]:
    """Two layers of a 4-block paged cache (block size 8, 2 heads of 4); every value distinct."""
    return [
        torch.arange(2 * 4 * 8 * 2 * 4, dtype=torch.float32).reshape(2, 4, 8, 2, 4) + 1000 * i
        for i in range(2)
    ]


def damaging_main(conn: Connection, namespace: str) -> None:
    """Child: the sending stage's loop (plain tuples only); see the module docstring."""
    from omnikv import OmniKVCacheConfig, OmniKVTransferManager
    from omnikv.config import TransferOptions
    from omnikv.transfer.edge import KVCaches

    mgr = OmniKVTransferManager(
        OmniKVCacheConfig(
            connector_config={"type": "SharedMemoryConnector", "namespace": namespace},
            from_stage="stage1",
            to_stage="stage2",
            need_send_cache=True,
        ),
        options=TransferOptions(payload_checksum=True),  # shared memory leaves it off unless asked
    )
    connector = mgr.connector
    assert connector is not None
    put_packed = connector.put_packed
    damage: list[int | None] = [None]

    def damaging_put(*args: Any, **kwargs: Any) -> Any:
        *head, write = args

        def write_then_flip(dst: Any) -> Any:
            n = write(dst)
            where = damage[0]
            if where is not None:
                at = write.data_start + where if where >= 0 else write.nbytes + where
                view = dst if isinstance(dst, torch.Tensor) else torch.from_numpy(dst)
                view[at] ^= 1 << (at % 8)
            return n

        return put_packed(*head, write_then_flip, **kwargs)

    connector.put_packed = damaging_put  # type: ignore[method-assign]
    conn.send(("ready", os.getpid()))
    while True:
        try:
            cmd = conn.recv()
        except EOFError:
            break
        if cmd[0] == "send":
            _, rid, where = cmd
            damage[0] = where
            entry = {"block_ids": [0, 1], "seq_len": 10}
            res = mgr.edge.send(rid, entry, KVCaches(caches(), 8, "torch.float32"))
            conn.send(("sent", rid, res.ok))
        elif cmd[0] == "close":
            mgr.close()
            conn.send(("closed",))
            break


class DamagingSender:
    """Handle of one damaging sender process (started and ready when constructed)."""

    def __init__(self, namespace: str) -> None:
        self.conn, child = _CTX.Pipe()
        self.proc = _CTX.Process(target=damaging_main, args=(child, namespace), daemon=True)
        self.proc.start()
        child.close()
        assert self.recv(30.0)[0] == "ready"

    def recv(self, timeout: float = 10.0) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"sender {self.proc.pid} did not answer within {timeout}s")
        return self.conn.recv()

    def send_kv(self, rid: str, where: int | None) -> None:
        """Send ``rid``'s KV, damaged at ``where`` (see the module docstring), and wait until
        the sender says it was published."""
        self.conn.send(("send", rid, where))
        assert self.recv() == ("sent", rid, True)

    def kill(self) -> None:
        """SIGKILL by PID and reap."""
        if self.proc.pid is not None and self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)
        assert not self.proc.is_alive()
