"""A full pull sender pool serves the newest hand-off (issue 39 item 9), with real processes.

Hand-offs nobody comes for (a served deployment's ``do_remote_decode`` requests whose
parameters are never used) fill a Transfer Engine or NIXL sender's pool. Before, every later
put waited until its deadline and failed, until the 300 s TTL freed the pool. Now a put that
finds no space frees the payloads unclaimed past ``unclaimed_grace_seconds``, oldest first
(counted ``grace_evicted``, named in a WARNING); younger ones keep their space.

Each scenario runs a sender peer (spawned, stopped by PID) and the genuine receiver in the
scenario's process.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import pytest

from support.mooncake_peers import (
    crc,
    free_ports,
    mooncake_skip_reason,
    pattern,
    peers,
    run_scenario,
)
from support.polling import until
from support.pull_engine import ask, serve_sender, start_sender

# above the scenarios' own bounds (at most 240 s) and their reports
pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(290)]

MiB = 1 << 20
UNUSED = 4
GRACE_S = 1.0


def room_sender(kind: str, cfg: dict[str, Any], out_q: Any, in_q: Any) -> None:
    """A sender peer that also answers ``logs`` (its WARNING lines) and ``pending``."""
    if kind == "te":
        from omnikv.connectors.mooncake_te import MooncakeTransferEngineConnector as Conn
    else:
        from omnikv.connectors.nixl.connector import NixlConnector as Conn  # type: ignore[assignment]
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logging.getLogger("omnikv").addHandler(Keep(logging.WARNING))
    conn = Conn(cfg)
    extra = {
        "logs": lambda: ("logs", list(lines)),
        "pending": lambda: ("pending", conn.pending_keys()),
    }
    serve_sender(conn, out_q, in_q, extra)


def te_room_sender(cfg: dict[str, Any], out_q: Any, in_q: Any) -> None:
    room_sender("te", cfg, out_q, in_q)


def nixl_room_sender(cfg: dict[str, Any], out_q: Any, in_q: Any) -> None:
    room_sender("nixl", cfg, out_q, in_q)


def scenario_room(kind: str) -> dict[str, Any]:
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    if kind == "te":
        from omnikv.connectors.mooncake_te import MooncakeTransferEngineConnector as Conn

        peer, cfg = te_room_sender, {"host": "127.0.0.1", "protocol": "tcp"}
    else:
        from omnikv.connectors.nixl.connector import NixlConnector as Conn  # type: ignore[assignment]

        peer, cfg = nixl_room_sender, {"host": "127.0.0.1"}
    (zport,) = free_ports(1)
    sender_cfg = {
        **cfg,
        "role": "sender",
        "zmq_port": zport,
        "memory_pool_size": UNUSED * MiB,
        "unclaimed_grace_seconds": GRACE_S,
    }
    proc, out_q, in_q = start_sender(peer, sender_cfg)
    res: dict[str, Any] = {}
    with peers(proc):
        recv = Conn({**cfg, "role": "receiver", "memory_pool_size": 8 * MiB})
        recv.update_sender_info("127.0.0.1", zport)
        try:
            # unused hand-offs fill the pool: nobody ever comes for them
            res["fill"] = [
                ask(in_q, out_q, "put", f"unused{i}", MiB, i, 5.0)[1] for i in range(UNUSED)
            ]
            filled = time.monotonic()
            # within the grace a put cannot take their space
            res["young"] = ask(in_q, out_q, "put", "early", MiB, 50, 0.3)[1]
            res["young_s"] = time.monotonic() - filled
            # a genuine put waits for the oldest one's grace at most, not until its deadline
            t0 = time.monotonic()
            res["genuine"] = ask(in_q, out_q, "put", "genuine", MiB, 99, 20.0)[1]
            res["genuine_wait_s"] = time.monotonic() - t0
            res["genuine_since_fill_s"] = time.monotonic() - filled
            got = recv.wait("0", "1", "genuine", deadline=time.monotonic() + 15)
            res["received"] = got is not None and crc(got.tensor.numpy()) == crc(pattern(MiB, 99))
            if got is not None:
                got.release()

            def settled() -> list[str] | None:
                """The sender's pending keys once the receiver's ``done`` for the genuine
                hand-off reached it (it travels after the receiver's wait returned)."""
                pending = sorted(ask(in_q, out_q, "pending")[1])
                return None if "genuine@0_1" in pending else pending

            res["pending"] = until(settled, 10.0, "the sender saw the genuine hand-off taken")
            res["grace_evicted"] = ask(in_q, out_q, "health")[1].get("grace_evicted")
            res["logs"] = [line for line in ask(in_q, out_q, "logs")[1] if "pool full" in line]
        finally:
            recv.close()
        ask(in_q, out_q, "close")
    return res


def _check(res: dict[str, Any]) -> None:
    assert res["fill"] == [True] * UNUSED, res
    assert res["young"] == "PoolExhaustedError", res  # the grace protects fresh payloads
    assert res["genuine"] is True, res
    # before: the put waited its 20 s deadline and failed
    assert res["genuine_since_fill_s"] < GRACE_S + 4.0, res
    assert res["received"] is True, res
    assert res["grace_evicted"] == 1, res  # the oldest only: one slot was needed
    assert res["pending"] == [f"unused{i}@0_1" for i in range(1, UNUSED)], res
    assert len(res["logs"]) == 1 and "unused0@0_1" in res["logs"][0], res
    assert "unclaimed_grace_seconds" in res["logs"][0], res


def test_a_full_te_pool_serves_the_newest_hand_off() -> None:
    reason = mooncake_skip_reason()
    if reason is not None:
        pytest.skip(str(reason))
    res = run_scenario(__file__, "scenario_room", {"kind": "te"}, timeout=240)
    _check(res)


def test_a_full_nixl_pool_serves_the_newest_hand_off() -> None:
    from omnikv.connectors.nixl.agent import unavailable_reason

    if unavailable_reason() is not None:
        pytest.skip(str(unavailable_reason()))
    res = run_scenario(__file__, "scenario_room", {"kind": "nixl"}, timeout=240)
    _check(res)
