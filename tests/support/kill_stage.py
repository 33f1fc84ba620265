"""A stage (sender or receiver manager) in its own process, driven by commands and killed at a
chosen moment: the pieces of the kill matrix (``tests/transfer/test_kill_matrix.py``) and of the
readiness probe's scenarios (``tests/transfer/test_probe.py``).

Commands (tuples on ``in_q``; one answer each on ``out_q``):

* ``("send", rid)``: send ``rid``'s small KV -> ``("sent", status, reason)``;
* ``("stall_put", key)``: start a ``put_packed`` whose writer says ``("stalling",)`` and then
  never returns (the sender is killed mid-put);
* ``("verdict", rid, timeout)``: ``wait_delivered`` -> ``("verdict", status, reason, seconds)``;
* ``("receive", rid)``: a receive with the stage's ``recv_timeout`` -> ``("received", status,
  reason, seconds)``;
* ``("receive_watched", rid)``: a receive that records its ``on_arrival`` calls ->
  ``("received", status, nbytes, [bytes of each call])``;
* ``("take_and_hang", rid)``: a receive whose check says ``("taken",)`` and then never returns
  (the payload is taken and decoded, its verdict never given: the receiver is killed there);
* ``("probe", rid, timeout)``: ``probe_kv_cache`` -> ``("probe", state, nbytes, detail,
  seconds)``;
* ``("result", rid)``: ``get_send_result`` -> ``("sent", status, reason)``;
* ``("sender", info)``: ``update_sender_info(info)`` -> ``("ok",)``;
* ``("health",)``: the connector's health -> ``("health", dict)``;
* ``("close",)``: close -> ``("closed",)`` and exit.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from multiprocessing.process import BaseProcess
from types import SimpleNamespace
from typing import Any

from support.mooncake_peers import queue, spawn

#: The KV every sender sends: two layers of 2 blocks x 8 tokens x 2 heads x 4 dims (float32).
BLOCK_IDS, SEQ_LEN = [0, 1], 10


def _caches(fill: float) -> list[Any]:
    import torch

    return [torch.full((2, 4, 8, 2, 4), fill + i) for i in range(2)]


def _plain(health: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in health.items() if isinstance(v, int | float | str | bool | None)}


def stage_main(cfg: dict[str, Any], sender_info: Any, in_q: Any, out_q: Any) -> None:
    """Child entry point: a manager built from ``cfg`` serving commands until ``close``."""
    from omnikv import OmniKVTransferManager
    from omnikv.transfer.edge import KVCaches

    mgr = OmniKVTransferManager.from_od_config(SimpleNamespace(omni_kv_config=cfg))
    if sender_info is not None:
        mgr.update_sender_info(sender_info)
    hang = threading.Event()  # never set: what a stalled writer or check waits on
    out_q.put(("ready", os.getpid()))
    while True:
        cmd = in_q.get()
        op = cmd[0]
        if op == "send":
            entry = {"block_ids": BLOCK_IDS, "seq_len": SEQ_LEN}
            res = mgr.edge.send(cmd[1], entry, KVCaches(_caches(1.0), 8, "torch.float32"))
            out_q.put(("sent", res.status.value, res.reason))
        elif op == "stall_put":
            conn = mgr.connector
            assert conn is not None

            def stall(dst: Any) -> None:
                out_q.put(("stalling",))
                hang.wait()

            conn.put_packed("0", "1", cmd[1], 1 << 16, stall, deadline=time.monotonic() + 600)
        elif op == "verdict":
            t0 = time.monotonic()
            res = mgr.wait_delivered(cmd[1], timeout=cmd[2])
            status = res.status.value if res else None
            out_q.put(("verdict", status, res.reason if res else None, time.monotonic() - t0))
        elif op == "receive":
            t0 = time.monotonic()
            got = mgr.receive_kv_cache_result(cmd[1], quiet=True)
            out_q.put(("received", got.status.value, got.reason, time.monotonic() - t0))
            del got  # its KV may be views of the connector's memory: adopted, then let go
        elif op == "receive_watched":
            arrivals: list[int] = []
            got = mgr.receive_kv_cache_result(cmd[1], quiet=True, on_arrival=arrivals.append)
            out_q.put(("received", got.status.value, got.nbytes, arrivals))
            del got
        elif op == "take_and_hang":

            def check(kv: Any) -> str | None:
                out_q.put(("taken",))
                hang.wait()
                return None

            mgr.receive_kv_cache_result(cmd[1], quiet=True, check=check)
        elif op == "probe":
            t0 = time.monotonic()
            p = mgr.probe_kv_cache(cmd[1], timeout=cmd[2])
            out_q.put(("probe", p.state.value, p.nbytes, p.detail, time.monotonic() - t0))
        elif op == "result":
            res = mgr.get_send_result(cmd[1])
            out_q.put(("sent", res.status.value if res else None, res.reason if res else None))
        elif op == "sender":
            mgr.update_sender_info(cmd[1])
            out_q.put(("ok",))
        elif op == "health":
            conn = mgr.connector
            out_q.put(("health", _plain(conn.health()) if conn is not None else {}))
        elif op == "close":
            mgr.close()
            out_q.put(("closed",))
            return


class Stage:
    """Handle of one stage process (ready when constructed); :meth:`kill` by PID."""

    def __init__(self, cfg: dict[str, Any], sender_info: Any = None) -> None:
        self.in_q, self.out_q = queue(), queue()
        self.proc: BaseProcess = spawn(stage_main, cfg, sender_info, self.in_q, self.out_q)
        ready = self.answer(90.0)
        assert ready[0] == "ready", ready

    def answer(self, timeout: float = 30.0) -> tuple[Any, ...]:
        got: tuple[Any, ...] = self.out_q.get(timeout=timeout)
        return got

    def ask(self, *cmd: Any, timeout: float = 30.0) -> tuple[Any, ...]:
        self.in_q.put(cmd)
        return self.answer(timeout)

    def kill(self) -> None:
        """SIGKILL by PID and reap."""
        if self.proc.pid is not None and self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)
        assert not self.proc.is_alive()

    def close(self) -> None:
        with_answer = self.proc.is_alive()
        if with_answer:
            self.in_q.put(("close",))
            try:
                self.answer(30.0)
            finally:
                self.kill()
