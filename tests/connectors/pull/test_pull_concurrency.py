"""Many receives at once over the pull connectors' control plane (issue 39 item 3).

A receiving process talks to a sender over one control connection, whatever the number of
threads: 70 receives, each with a second lane thread as ``stream_kv`` runs one (140 threads
waiting at once), against a Transfer Engine sender at its default caps (64 connections per
peer address). Before, each thread opened its own channel and most were refused.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from support.mooncake_peers import (
    crc,
    free_ports,
    mooncake_scenario,
    pattern,
    peers,
)
from support.pull_engine import ask, serve_sender, start_sender

# above the scenarios' own bounds (at most 240 s) and their reports
pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(290)]

KiB = 1 << 10
RECEIVES = 70
LANES = 2  # the receive's own thread and one lane thread


def te_sender(cfg: dict[str, Any], out_q: Any, in_q: Any) -> None:
    from omnikv.connectors.mooncake_te import MooncakeTransferEngineConnector

    serve_sender(MooncakeTransferEngineConnector(cfg), out_q, in_q, {})


def scenario_concurrent_receives() -> dict[str, Any]:
    from omnikv.connectors.mooncake_te import MooncakeTransferEngineConnector

    (zport,) = free_ports(1)
    cfg = {"host": "127.0.0.1", "protocol": "tcp", "memory_pool_size": 32 << 20}
    proc, out_q, in_q = start_sender(te_sender, {**cfg, "role": "sender", "zmq_port": zport})
    res: dict[str, Any] = {}
    with peers(proc):
        recv = MooncakeTransferEngineConnector(
            {**cfg, "role": "receiver", "sender_host": "127.0.0.1", "sender_zmq_port": zport}
        )
        keys = [f"r{i}#lane{j}" for i in range(RECEIVES) for j in range(LANES)]
        got: dict[str, Any] = {}
        started = threading.Barrier(len(keys) + 1)

        def receive(n: int, key: str) -> None:
            started.wait(timeout=30)
            try:
                buf = recv.wait("0", "1", key, deadline=time.monotonic() + 60)
            except Exception as exc:
                got[key] = f"{type(exc).__name__}: {exc}"
                return
            if buf is None:
                got[key] = "timed out"
                return
            got[key] = crc(buf.tensor.numpy()) == crc(pattern(16 * KiB, n))
            buf.release()

        threads = [threading.Thread(target=receive, args=(n, key)) for n, key in enumerate(keys)]
        try:
            for t in threads:
                t.start()
            started.wait(timeout=30)
            for n, key in enumerate(keys):
                ask(in_q, out_q, "put", key, 16 * KiB, n, 10.0)
            for t in threads:
                t.join(timeout=90)
            res["results"] = got
            res["client_connections"] = recv.control_client.connections
            res["health"] = ask(in_q, out_q, "health")[1]
        finally:
            recv.close()
        ask(in_q, out_q, "close")
    return res


@pytest.fixture(scope="module")
def concurrent() -> dict[str, Any]:
    return mooncake_scenario(__file__, "scenario_concurrent_receives", timeout=240)


def test_seventy_concurrent_laned_receives_all_succeed(concurrent: dict[str, Any]) -> None:
    results = concurrent["results"]
    failed = {k: v for k, v in results.items() if v is not True}
    assert len(results) == RECEIVES * LANES and not failed, failed


def test_one_receiving_process_holds_one_control_connection(concurrent: dict[str, Any]) -> None:
    h = concurrent["health"]
    assert concurrent["client_connections"] == 1
    assert h["channels"] == 1 and h["refused_connections"] == 0, h
