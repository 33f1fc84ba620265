"""A LEADER's prefetch consume error does not strand its follower (real gloo, two processes).

Rank 0 (LEADER) prefetches request A to a device this torch cannot copy to; its payload is
taken from the connector but the post-get device copy fails, so consuming it raises
:class:`KVPrefetchConsumeError` inside ``consume_and_distribute_kv_cache``. The leader must
still enter distribution, so rank 1 (FOLLOWER) returns ``False`` promptly instead of hanging.
Process group: gloo over ``file://`` on loopback; both processes are killed by PID at the end.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import signal
import time
from multiprocessing.connection import Connection
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from omnikv.manager import OmniKVTransferManager

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.timeout(90)]

if not hasattr(OmniKVTransferManager, "distribute_kv_cache"):
    pytest.skip("distribute_kv_cache is not in the manager yet", allow_module_level=True)

_CTX = mp.get_context("spawn")
RECV_TIMEOUT = 3.0


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def rank_main(rank: int, init_file: str, namespace: str, conn: Connection) -> None:
    """Child: one rank of the receiving stage."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from omnikv import KVPrefetchConsumeError, OmniKVCacheConfig
    from omnikv.ranks.context import ParallelContext

    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=30),
    )
    ctx = ParallelContext(world_group=dist.group.WORLD, local_rank=rank, grace_s=2.0)
    local = {"type": "LocalConnector", "namespace": namespace}
    mgr = OmniKVTransferManager(
        OmniKVCacheConfig(
            connector_config=local,
            from_stage="stage1",
            stage_id="stage2",
            need_recv_cache=True,
            recv_timeout=RECV_TIMEOUT,
            enable_kv_async_prefetch=True,
        ),
        async_prefetch=True,
        parallel_context=ctx,
    )
    capture = _Capture()
    logging.getLogger("omnikv").addHandler(capture)
    job = {"request_id": "A", "kv_sender_info": {"host": "127.0.0.1", "zmq_port": 50151}}
    role = mgr.topo_config.role.value
    raised = False
    if rank == 0:
        sender = OmniKVTransferManager(
            OmniKVCacheConfig(
                connector_config=local,
                from_stage="stage1",
                to_stage="stage2",
                need_send_cache=True,
            )
        )
        caches: list[Any] = [torch.ones(2, 4, 8, 2, 4) for _ in range(2)]
        sender.handle_finished_requests_kv_transfer(
            {"A": {"block_ids": [0, 1], "seq_len": 10}}, caches, 8, "torch.float32"
        )
        pf_consume = None
        # A device this torch cannot copy to: the post-get copy fails after the payload was taken.
        mgr.start_prefetch(job, target_device=torch.device("xla"))
        pf = mgr.prefetcher
        if pf is not None:
            pf_consume = pf.consume

            def spy(*a: Any, **k: Any) -> Any:
                nonlocal raised
                try:
                    return pf_consume(*a, **k)
                except KVPrefetchConsumeError:
                    raised = True
                    raise

            pf.consume = spy  # type: ignore[method-assign]
    else:
        mgr.start_prefetch(job)  # a follower never prefetches
    conn.send(("ready", rank))
    assert conn.recv() == ("go",)
    req = SimpleNamespace(request_id="A", sampling_params=SimpleNamespace())
    t0 = time.monotonic()
    try:
        ok: Any = mgr.consume_and_distribute_kv_cache(req)
    except Exception as exc:
        ok = f"raised {type(exc).__name__}: {exc}"
    took = time.monotonic() - t0
    conn.send(
        (
            "done",
            rank,
            role,
            ok,
            took,
            raised,
            mgr.prefetcher is not None and mgr.prefetcher.thread is not None,
            any("cannot recover" in m for m in capture.messages),
        )
    )
    mgr.close()
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


def test_leader_consume_error_lets_the_follower_return_false(
    tmp_path: Path, namespace: str
) -> None:
    init_file = str(tmp_path / "gloo-init")
    procs, pipes = [], []
    try:
        for rank in range(2):
            parent, child = _CTX.Pipe()
            p = _CTX.Process(
                target=rank_main, args=(rank, init_file, namespace, child), daemon=True
            )
            p.start()
            child.close()
            procs.append(p)
            pipes.append(parent)
        for parent in pipes:
            assert parent.poll(60), "a rank did not start"
            assert parent.recv()[0] == "ready"
        for parent in pipes:
            parent.send(("go",))
        done = {}
        for parent in pipes:
            assert parent.poll(30), "a rank hung in consume_and_distribute_kv_cache"
            msg = parent.recv()
            done[msg[1]] = msg
    finally:
        for p in procs:
            if p.pid is not None and p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join(10)
    _, _, leader_role, leader_ok, leader_took, raised, leader_pf, logged = done[0]
    _, _, follower_role, follower_ok, follower_took, _, follower_pf, _ = done[1]
    assert (leader_role, follower_role) == ("leader", "follower")
    assert raised, "the leader's prefetch consume did not raise KVPrefetchConsumeError"
    assert logged, "the leader did not log the unrecoverable consume error"
    assert leader_ok is False
    assert follower_ok is False
    assert leader_pf and not follower_pf
    # no hang: no sync receive after a consume error, the follower waits only for the leader
    assert leader_took < RECV_TIMEOUT, leader_took
    assert follower_took < RECV_TIMEOUT + 2.0, follower_took
