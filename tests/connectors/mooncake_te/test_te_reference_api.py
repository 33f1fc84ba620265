"""The Transfer Engine connector's reference API of vllm-omni 0.32.0rc1, against real peers:
``get_connection_info()``, ``update_sender_info(sender_host, sender_zmq_port, sender_rank=None)``
and ``cleanup(request_id, from_stage=None, to_stage=None)``, with the reference's semantics (the
0.30 forms keep working). One scenario in an isolated child (``support.mooncake_peers``); the
sender is a spawned peer driven over a queue.
"""

from __future__ import annotations

from typing import Any

import pytest

from support.mooncake_peers import free_ports, mooncake_skip_reason, peers, run_scenario
from support.pull_engine import ask, serve_sender, start_sender

pytestmark = [
    pytest.mark.engine,
    pytest.mark.slow,
    pytest.mark.skipif(mooncake_skip_reason() is not None, reason=str(mooncake_skip_reason())),
]

MiB = 1 << 20


def peer_sender(cfg: dict[str, Any], out_q: Any, in_q: Any) -> None:
    from omnikv.connectors.mooncake_te import MooncakeTransferEngineConnector

    conn = MooncakeTransferEngineConnector(cfg)

    def cleanup(*args: Any) -> tuple[Any, ...]:
        conn.cleanup(*args)
        return ("cleaned", sorted(conn.pending_keys()))

    serve_sender(
        conn,
        out_q,
        in_q,
        {
            "info": lambda: ("info", conn.get_connection_info()),
            "pending": lambda: ("pending", sorted(conn.pending_keys())),
            "cleanup": cleanup,
        },
    )


def scenario_reference_api() -> dict[str, Any]:
    from omnikv.connectors.mooncake_te import MooncakeTransferEngineConnector

    (zport,) = free_ports(1)
    res: dict[str, Any] = {"zport": zport}
    base = {"host": "127.0.0.1", "protocol": "tcp", "memory_pool_size": 16 * MiB}
    proc, out_q, in_q = start_sender(peer_sender, {**base, "role": "sender", "zmq_port": zport})
    with peers(proc):
        res["sender_info"] = ask(in_q, out_q, "info")[1]
        recv = MooncakeTransferEngineConnector({**base, "role": "receiver"})
        res["receiver_info"] = recv.get_connection_info()
        # 0.32: a rank's endpoint leaves the default alone; a get without metadata uses the
        # default
        recv.update_sender_info("127.0.0.1", zport + 1, sender_rank=1)
        res["no_default"] = recv.sender_endpoint()
        recv.update_sender_info(res["sender_info"]["host"], res["sender_info"]["zmq_port"])
        res["rank1"] = recv.sender_endpoint(1)
        res["rank0"] = recv.sender_endpoint(0)
        ask(in_q, out_q, "put", "r1", 1000, 1, 5.0)
        got = recv.get("0", "1", "r1")
        res["got_from_default"] = got is not None and got[1] == 1000
        # cleanup: the stage form drops exactly that key; the request rule stays
        for key in ("r2", "r2_cfg", "r3", "x_r3"):
            ask(in_q, out_q, "put", key, 100, 2, 5.0)
        res["pending"] = ask(in_q, out_q, "pending")[1]
        res["after_exact"] = ask(in_q, out_q, "cleanup", "r2", "0", "1")[1]
        res["after_other_edge"] = ask(in_q, out_q, "cleanup", "r2_cfg", "1", "2")[1]
        res["after_rule"] = ask(in_q, out_q, "cleanup", "r3")[1]
        res["one_stage"] = ask(in_q, out_q, "cleanup", "r2_cfg", "0", None)
        recv.cleanup("anything", "0", "1")  # a receiver: nothing held, nothing raised
        recv.close()
        ask(in_q, out_q, "close")
    return res


@pytest.fixture(scope="module")
def api() -> dict[str, Any]:
    return run_scenario(__file__, "scenario_reference_api", timeout=100)


def test_a_sender_shares_its_endpoint_as_the_reference_does(api: dict[str, Any]) -> None:
    info = api["sender_info"]
    assert set(info) == {"host", "zmq_port", "rpc_port", "can_put"}
    assert info["host"] == "127.0.0.1" and info["zmq_port"] == api["zport"]
    assert isinstance(info["rpc_port"], int) and info["rpc_port"] > 0 and info["can_put"] is True
    assert api["receiver_info"] is None  # a receiver serves no endpoint


def test_update_sender_info_takes_a_rank_and_keeps_the_default(api: dict[str, Any]) -> None:
    assert api["no_default"] is None  # a rank's endpoint did not become the default
    # (the scenario's result crossed JSON: endpoints come back as lists)
    assert api["rank1"] == ["127.0.0.1", api["zport"] + 1]
    assert api["rank0"] == ["127.0.0.1", api["zport"]]  # unknown rank: the default
    assert api["got_from_default"]


def test_cleanup_with_stages_drops_exactly_that_key(api: dict[str, Any]) -> None:
    keys = ["r2@0_1", "r2_cfg@0_1", "r3@0_1", "x_r3@0_1"]
    assert api["pending"] == keys
    assert api["after_exact"] == keys[1:]  # not r2_cfg, which the request rule would take
    assert api["after_other_edge"] == keys[1:]  # another edge's key of that name: nothing
    assert api["after_rule"] == ["r2_cfg@0_1"]  # 0.30's form: the request rule
    assert api["one_stage"][:2] == ["error", "ValueError"]
    assert "both from_stage and to_stage" in api["one_stage"][2]
