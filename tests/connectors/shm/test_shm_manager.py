"""OmniKVTransferManager over SharedMemoryConnector: a paged KV crosses two real processes.

The sender stage runs in a child process (its own manager and connector, configured by the same
``connector_config`` dict a deployment would use); the receiving stage is this process. The
receive starts before the put, so the hand-off also exercises the connector's wake-up path.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import threading
from multiprocessing.connection import Connection
from typing import Any

import pytest
import torch

from omnikv import OmniKVCacheConfig, OmniKVTransferManager, ReceiveStatus
from omnikv.manager import LayerKV

pytestmark = pytest.mark.slow

_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(["omnikv.connectors.shm.connector", "omnikv.manager"])

BLOCK = 8
IDS = [1, 3, 5, 6]
SEQ = 29


def _caches() -> list[torch.Tensor]:
    """Paged KV of 3 layers: ``[2 (K, V), blocks, block_size, heads, dim]``, fp16."""
    g = torch.Generator().manual_seed(7)
    return [torch.randn(2, 8, BLOCK, 4, 16, generator=g).half() for _ in range(3)]


def _conn(namespace: str) -> dict[str, Any]:
    return {"type": "SharedMemoryConnector", "namespace": namespace, "pool_size_bytes": 1 << 22}


def sender_stage(conn: Connection, namespace: str) -> None:
    """Child: stage 0. Sends ``req-a`` when told to, reports the outcome, then serves until EOF
    (the payload lives in this process's pool until the receiver consumes it)."""
    mgr = OmniKVTransferManager(
        OmniKVCacheConfig(
            connector_config=_conn(namespace),
            from_stage="0",
            to_stage="1",
            need_send_cache=True,
        )
    )
    conn.send(("ready", os.getpid()))
    assert conn.recv() == ("go",)
    caches: list[LayerKV] = list(_caches())
    mgr.handle_finished_requests_kv_transfer(
        {"req-a": {"block_ids": IDS, "seq_len": SEQ}}, caches, BLOCK, "torch.float16"
    )
    res = mgr.get_send_result("req-a")
    conn.send(("sent", bool(res and res.ok), res.nbytes if res else 0))
    with contextlib.suppress(EOFError):
        conn.recv()
    mgr.close()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_manager_sends_and_receives_paged_kv_across_processes(namespace: str) -> None:
    parent, child = _CTX.Pipe()
    proc = _CTX.Process(target=sender_stage, args=(child, namespace), daemon=True)
    proc.start()
    child.close()
    receiver = OmniKVTransferManager(
        OmniKVCacheConfig(
            connector_config=_conn(namespace),
            from_stage="0",
            stage_id="1",
            need_recv_cache=True,
            recv_timeout=20.0,
        )
    )
    try:
        assert parent.poll(30) and parent.recv()[0] == "ready"
        out: list[tuple[dict[str, Any] | None, int]] = []
        t = threading.Thread(
            target=lambda: out.append(receiver.receive_kv_cache_for_request("req-a"))
        )
        t.start()  # blocked on the connector before the sender puts
        parent.send(("go",))
        assert parent.poll(30)
        sent = parent.recv()
        assert sent[:2] == ("sent", True) and sent[2] > 0
        t.join(30)
        assert not t.is_alive() and out
        data, size = out[0]
        assert data is not None and size == sent[2]
        caches = _caches()
        keys, values = data["layer_blocks"]["key_cache"], data["layer_blocks"]["value_cache"]
        assert len(keys) == len(values) == 3
        for layer, kv in enumerate(caches):
            want_k = torch.cat([kv[0][i] for i in IDS])[:SEQ]
            want_v = torch.cat([kv[1][i] for i in IDS])[:SEQ]
            assert keys[layer].dtype == torch.float16 and torch.equal(keys[layer], want_k)
            assert torch.equal(values[layer], want_v)
        assert data["metadata"]["seq_len"] == SEQ and data["metadata"]["block_size"] == BLOCK
        res = receiver.get_receive_result("req-a")
        assert res is not None and res.status is ReceiveStatus.OK
        out.clear()
        del data, keys, values
        # consume-once: a second receive of the same request finds nothing
        receiver.config.recv_timeout = 0.2
        assert receiver.receive_kv_cache_for_request("req-a") == (None, 0)
    finally:
        receiver.close()
        parent.close()
        proc.join(10)
        if proc.is_alive() and proc.pid is not None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(10)
