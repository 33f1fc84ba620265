"""The manager end to end over real Mooncake engines, sender and receivers in separate processes.

* 224 MiB (Qwen2.5-7B, 4096 tokens, fp16, paged blocks of 16 in shuffled order) from a sender
  stage's ``handle_finished_requests_kv_transfer`` to a receiver stage's
  ``receive_kv_cache_for_request``, through ``MooncakeTransferEngineConnector`` and through
  ``MooncakeStoreConnector`` (with a real ``mooncake_master``); every tensor is compared with
  what the sender's cache holds, and the outcomes, consume-once and clean close are checked.
* Heterogeneous TP 2 -> 4 through the Transfer Engine connector: two sender ranks, four receiver
  ranks, each receiver must end up with exactly its heads.

Every case runs as a ``scenario_*`` function in an isolated child (``unshare -n`` where possible,
see ``support.mooncake_peers``); peers are spawned processes stopped by PID. Managers are built
through the seed API (``from_od_config`` with an ``omni_kv_config`` dict, ``LOCAL_RANK`` for the
rank).
"""

from __future__ import annotations

from typing import Any

import pytest

from support.mooncake_peers import Master, mooncake_skip_reason, run_scenario
from support.pull_engine import (
    QWEN,
    SCENARIO_224_S,
    SMALL,
    check_closed_sender,
    check_consumed_once,
    check_received,
    check_receiver_closed,
    check_sent_224,
    hand_off_224,
    scenario_224,
    scenario_tp,
)

pytestmark = [
    pytest.mark.engine,
    pytest.mark.slow,
    pytest.mark.skipif(mooncake_skip_reason() is not None, reason=str(mooncake_skip_reason())),
]

MiB = 1 << 20
TE = {"type": "MooncakeTransferEngineConnector", "protocol": "tcp"}


# -- scenarios (run isolated) -------------------------------------------------------------------
def scenario_te_224() -> dict[str, Any]:
    return scenario_224(TE)


def scenario_store_224() -> dict[str, Any]:
    res: dict[str, Any] = {}
    with Master() as master:
        res["metadata_port"] = master.http_port
        conn = {
            "type": "MooncakeStoreConnector",
            "host": "127.0.0.1",
            "metadata_server": master.metadata_url,
            "master_server_address": master.address,
            "global_segment_size": 320 * MiB,
            "local_buffer_size": 16 * MiB,
            "memory_pool_size": 256 * MiB,
        }
        send_cfg = {
            "connector_config": conn,
            "omni_from_stage": "0",
            "omni_to_stage": "1",
            "need_send_cache": True,
        }
        recv_cfg = {
            "connector_config": dict(conn),
            "stage_id": 1,
            "engine_input_source": [0],
            "need_recv_cache": True,
            "recv_timeout": 60.0,
        }
        res.update(hand_off_224(send_cfg, recv_cfg, None))
        # nothing was left in the store: a fresh client finds no object under the key
        from omnikv.connectors.mooncake_store.connector import MooncakeStoreConnector

        probe = MooncakeStoreConnector({**conn, "global_segment_size": 16 * MiB})
        res["left_in_store"] = int(probe.get("0", "1", "req") is not None)
        probe.close()
    return res


def scenario_te_tp(s: int, t: int) -> dict[str, Any]:
    return scenario_tp(TE, s, t)


# -- tests (each scenario runs once per module; each test checks one behaviour) -----------------
@pytest.fixture(scope="module")
def te_224() -> dict[str, Any]:
    return run_scenario(__file__, "scenario_te_224", timeout=SCENARIO_224_S)


@pytest.fixture(scope="module")
def store_224() -> dict[str, Any]:
    return run_scenario(__file__, "scenario_store_224", timeout=SCENARIO_224_S)


@pytest.fixture(scope="module")
def te_tp() -> dict[str, Any]:
    return run_scenario(__file__, "scenario_te_tp", {"s": 2, "t": 4}, timeout=420)


@pytest.mark.timeout(SCENARIO_224_S + 60)
def test_te_sender_reports_the_224mib_kv_sent(te_224: dict[str, Any]) -> None:
    check_sent_224(te_224["sent"])


@pytest.mark.timeout(SCENARIO_224_S + 60)
def test_te_receiver_gets_every_tensor_intact(te_224: dict[str, Any]) -> None:
    check_received(te_224["recv"], QWEN, QWEN["heads"])


@pytest.mark.timeout(SCENARIO_224_S + 60)
def test_te_kv_is_consumed_once(te_224: dict[str, Any]) -> None:
    check_consumed_once(te_224["recv"])


@pytest.mark.timeout(SCENARIO_224_S + 60)
def test_te_receiver_leaves_nothing_after_close(te_224: dict[str, Any]) -> None:
    check_receiver_closed(te_224["recv"])


@pytest.mark.timeout(SCENARIO_224_S + 60)
def test_te_sender_leaves_nothing_after_close(te_224: dict[str, Any]) -> None:
    check_closed_sender(te_224["closed"])


@pytest.mark.timeout(SCENARIO_224_S + 60)
def test_store_sender_reports_the_224mib_kv_sent(store_224: dict[str, Any]) -> None:
    check_sent_224(store_224["sent"])


@pytest.mark.timeout(SCENARIO_224_S + 60)
def test_store_receiver_gets_every_tensor_intact(store_224: dict[str, Any]) -> None:
    check_received(store_224["recv"], QWEN, QWEN["heads"])


@pytest.mark.timeout(SCENARIO_224_S + 60)
def test_store_kv_is_consumed_once(store_224: dict[str, Any]) -> None:
    check_consumed_once(store_224["recv"])
    assert store_224["left_in_store"] != 1, "the consumed object must be removed from the store"


@pytest.mark.timeout(SCENARIO_224_S + 60)
def test_store_receiver_leaves_nothing_after_close(store_224: dict[str, Any]) -> None:
    check_receiver_closed(store_224["recv"], store_224["metadata_port"])


@pytest.mark.timeout(SCENARIO_224_S + 60)
def test_store_sender_leaves_nothing_after_close(store_224: dict[str, Any]) -> None:
    closed = store_224["closed"]
    # the sender remembers its put until its verdict watch sees it taken (it polls the store)
    assert closed["pool_used"] == 0 and closed["entries"] in (0, 1), closed
    assert closed["threads"] == [], closed
    assert [c for c in closed["tcp"] if c[1] != store_224["metadata_port"]] == [], closed


@pytest.mark.timeout(440)
def test_tp2_senders_slice_heads_for_their_tp4_receivers(te_tp: dict[str, Any]) -> None:
    sent = te_tp["sent"]
    assert sorted(sent) == ["0", "1"]
    for rank, body in sent.items():
        # published; a fast receiver may have accepted it already
        assert body["status"] in ("sent", "delivered"), body
        # sender rank r slices its heads for receivers 2r and 2r + 1: one key each
        first = 2 * int(rank)
        assert body["keys"] == [f"req_0_0_{rank}_{first}", f"req_0_0_{rank}_{first + 1}"]


@pytest.mark.timeout(440)
def test_every_tp4_receiver_gets_its_heads_intact(te_tp: dict[str, Any]) -> None:
    assert sorted(te_tp["received"]) == ["0", "1", "2", "3"]
    for body in te_tp["received"].values():
        check_received(body, SMALL, SMALL["heads"] // 4)
        check_consumed_once(body)
        check_receiver_closed(body)


@pytest.mark.timeout(440)
def test_tp2_senders_leave_nothing_after_close(te_tp: dict[str, Any]) -> None:
    for body in te_tp["closed"].values():
        check_closed_sender(body)
