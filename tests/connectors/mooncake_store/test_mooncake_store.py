"""MooncakeStoreConnector against a real ``mooncake_master`` and clients in separate processes.

Each case runs as a ``scenario_*`` function in an isolated child (``unshare -n`` where possible,
see ``support.mooncake_peers``); the master is started on free loopback ports and killed by PID.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from support.mooncake_peers import (
    Master,
    crc,
    mooncake_skip_reason,
    pattern,
    peers,
    queue,
    run_scenario,
    spawn,
)

pytestmark = [
    pytest.mark.engine,
    pytest.mark.slow,
    pytest.mark.timeout(200),  # above the scenario's own bound (150 s) and its report
    pytest.mark.skipif(mooncake_skip_reason() is not None, reason=str(mooncake_skip_reason())),
]

MiB = 1 << 20


def store_cfg(master: Master, **extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "host": "127.0.0.1",
        "metadata_server": master.metadata_url,
        "master_server_address": master.address,
        "global_segment_size": 512 * MiB,
        "local_buffer_size": 16 * MiB,
        "memory_pool_size": 256 * MiB,
    }
    cfg.update(extra)
    return cfg


def peer_putter(cfg: dict[str, Any], out_q: Any, in_q: Any) -> None:
    """A sender client in its own process: puts what it is told, reports crc, then closes."""
    from omnikv.connectors.mooncake_store.connector import MooncakeStoreConnector

    conn = MooncakeStoreConnector(cfg)
    out_q.put(("ready",))
    while True:
        cmd = in_q.get()
        if cmd[0] == "put":
            _, key, nbytes, seed = cmd
            data = pattern(nbytes, seed)

            def write(dst: Any, data: np.ndarray = data) -> None:
                dst.numpy()[:] = data

            ok, size, _ = conn.put_packed(
                "0", "1", key, nbytes, write, deadline=time.monotonic() + 30
            )
            out_q.put(("put", ok, size, crc(data)))
        elif cmd[0] == "close":
            conn.close()
            out_q.put(("closed", conn.health()))
            return


def scenario_store() -> dict[str, Any]:
    from omnikv.connectors.base import ManagedBuffer
    from omnikv.connectors.factory import OmniConnectorFactory
    from omnikv.connectors.mooncake_store.connector import MooncakeConnector, MooncakeStoreConnector

    res: dict[str, Any] = {"alias": MooncakeConnector is MooncakeStoreConnector}
    res["factory"] = OmniConnectorFactory.get_connector_class("MooncakeConnector").__name__
    with Master() as master:
        out_q, in_q = queue(), queue()
        proc = spawn(peer_putter, store_cfg(master), out_q, in_q)
        with peers(proc):
            assert out_q.get(timeout=30)[0] == "ready"
            recv = MooncakeStoreConnector(store_cfg(master, global_segment_size=64 * MiB))
            n = 224 * MiB
            in_q.put(("put", "req-1", n, 7))
            t0 = time.monotonic()
            got = recv.wait("0", "1", "req-1", deadline=time.monotonic() + 60)
            res["wait_s"] = time.monotonic() - t0
            _, ok, size, sent_crc = out_q.get(timeout=60)
            res["put"] = [ok, size]
            assert got is not None
            buf = got
            res["managed"] = isinstance(buf, ManagedBuffer)
            res["size"] = buf.size
            res["crc_ok"] = crc(buf.tensor.numpy()) == sent_crc
            # consumed means removed from the store (remove_after_get), not only taken here
            res["removed"] = recv.health()["removed"]
            # pool exhausted: a second 224 MiB object cannot fit while the first is held
            in_q.put(("put", "req-3", n, 3))
            res["second_put"] = list(out_q.get(timeout=60)[1:3])
            t0 = time.monotonic()
            try:
                recv.wait("0", "1", "req-3", deadline=time.monotonic() + 1.0)
                res["exhausted"] = "no error"
            except Exception as exc:
                res["exhausted"] = type(exc).__name__
            res["exhausted_s"] = time.monotonic() - t0
            res["used_before_release"] = recv.health()["pool_used"]
            buf.release()
            res["used_after_release"] = recv.health()["pool_used"]
            # once the slot is back, the waiting object is delivered intact
            got3 = recv.wait("0", "1", "req-3", deadline=time.monotonic() + 30)
            assert got3 is not None
            res["third_crc_ok"] = crc(got3.tensor.numpy()) == crc(pattern(n, 3))
            got3.release()
            # consume-once: a second get finds nothing
            res["second_get"] = recv.get("0", "1", "req-1") is None
            # a key never put: None within the deadline
            t0 = time.monotonic()
            res["never_put"] = recv.wait("0", "1", "nope", deadline=time.monotonic() + 0.5) is None
            res["never_put_s"] = time.monotonic() - t0
            in_q.put(("close",))
            closed = out_q.get(timeout=30)
            res["peer_closed"] = closed[1]["status"]
            # master down mid-run: gets fail as misses, within the deadline
            master.stop()
            t0 = time.monotonic()
            try:
                res["after_master_down"] = repr(
                    recv.wait("0", "1", "req-2", deadline=time.monotonic() + 2.0)
                )
            except Exception as exc:
                res["after_master_down"] = type(exc).__name__
            res["after_master_down_s"] = time.monotonic() - t0
            recv.close()
            recv.close()
            h = recv.health()
            res["closed"] = [h["status"], h["registered"], h["pool_size"]]
    return res


@pytest.fixture(scope="module")
def store_run() -> dict[str, Any]:
    return run_scenario(__file__, "scenario_store", timeout=150)


def test_the_legacy_alias_and_factory_name_resolve(store_run: dict[str, Any]) -> None:
    assert store_run["alias"] and store_run["factory"] == "MooncakeStoreConnector"


def test_wait_returns_224mib_intact_as_a_managed_buffer(store_run: dict[str, Any]) -> None:
    assert store_run["put"] == [True, 224 * MiB]
    assert store_run["managed"] and store_run["size"] == 224 * MiB and store_run["crc_ok"]


def test_a_consumed_object_is_removed_from_the_store(store_run: dict[str, Any]) -> None:
    assert store_run["removed"] == 1
    assert store_run["second_get"]


def test_a_full_receive_pool_raises_at_the_deadline(store_run: dict[str, Any]) -> None:
    assert store_run["second_put"] == [True, 224 * MiB]
    assert store_run["exhausted"] == "PoolExhaustedError" and store_run["exhausted_s"] < 3.0


def test_release_returns_the_slot_and_the_waiting_object_arrives(
    store_run: dict[str, Any],
) -> None:
    assert store_run["used_before_release"] >= 224 * MiB and store_run["used_after_release"] == 0
    assert store_run["third_crc_ok"]


def test_a_key_never_put_is_none_at_the_deadline(store_run: dict[str, Any]) -> None:
    assert store_run["never_put"] and store_run["never_put_s"] < 2.0


def test_a_master_gone_mid_run_is_a_bounded_miss(store_run: dict[str, Any]) -> None:
    assert store_run["peer_closed"] == "closed"
    assert store_run["after_master_down"] in {"None", "ConnectorUnavailableError"}
    assert store_run["after_master_down_s"] < 8.0


def test_close_unregisters_and_unmaps(store_run: dict[str, Any]) -> None:
    assert store_run["closed"] == ["closed", False, 0]


def scenario_master_down_at_start() -> dict[str, Any]:
    """No master listens: the constructor fails fast and typed, and the manager reports it."""
    from omnikv import OmniKVCacheConfig, OmniKVTransferManager
    from omnikv.connectors.mooncake_store.connector import MooncakeStoreConnector
    from omnikv.errors import ConnectorUnavailableError
    from support.mooncake_peers import free_ports

    rpc, http = free_ports(2)
    cfg = {
        "master_server_address": f"127.0.0.1:{rpc}",
        "metadata_server": f"http://127.0.0.1:{http}/metadata",
        "master_probe_timeout_s": 1.0,
    }
    res: dict[str, Any] = {}
    t0 = time.monotonic()
    try:
        MooncakeStoreConnector(cfg)
        res["error"] = None
    except ConnectorUnavailableError as exc:
        res["error"] = type(exc).__name__
        res["message"] = str(exc)
    res["seconds"] = time.monotonic() - t0
    mgr = OmniKVTransferManager(
        OmniKVCacheConfig(
            connector_config={"type": "MooncakeStoreConnector", **cfg},
            from_stage="0",
            to_stage="1",
            need_send_cache=True,
        )
    )
    res["manager_connector"] = mgr.connector is None
    res["manager_error"] = mgr.connector_error or ""
    mgr.close()
    return res


def test_store_master_down_at_start_fails_fast() -> None:
    res = run_scenario(__file__, "scenario_master_down_at_start", timeout=60)
    assert res["error"] == "ConnectorUnavailableError", res
    assert "unreachable" in res["message"]
    assert res["seconds"] < 3.0
    assert res["manager_connector"] and "unreachable" in res["manager_error"]


def scenario_tracking_is_bounded() -> dict[str, Any]:
    """A sender's record of its own puts stays bounded when other clients consume them."""
    from omnikv.connectors.mooncake_store.connector import MooncakeStoreConnector

    res: dict[str, Any] = {}
    with Master() as master:
        conn = MooncakeStoreConnector(
            store_cfg(
                master, global_segment_size=32 * MiB, memory_pool_size=4 * MiB, max_tracked_keys=2
            )
        )
        other = MooncakeStoreConnector(
            store_cfg(master, global_segment_size=16 * MiB, memory_pool_size=4 * MiB)
        )

        def in_store(key: str) -> int:
            """Whether ``other`` finds ``key`` in the store (taking it: it is then removed)."""
            got = other.get("0", "1", key)
            if got is not None:
                got[0].release()
            return int(got is not None)

        for k in ("a", "b"):
            assert conn.put("0", "1", k, b"x" * 1000)[0]
        assert in_store("a")  # consumed by another client: the master no longer has it
        conn.put("0", "1", "c", b"y" * 1000)  # over the bound: "a" is found gone and forgotten
        res["after_consumed"] = sorted(conn.pending_keys())
        conn.put("0", "1", "d", b"z" * 1000)  # over again, all present: the oldest is forgotten
        res["after_full"] = sorted(conn.pending_keys())
        res["tracked"] = conn.health()["tracked_keys"]
        conn.cleanup("d")  # removes what it still tracks for "d" from the store
        res["d_exists"] = in_store("d")
        res["b_exists"] = in_store("b")  # forgotten, still stored (not removed)
        other.close()
        conn.close()
    return res


def test_store_tracking_of_own_puts_is_bounded() -> None:
    res = run_scenario(__file__, "scenario_tracking_is_bounded", timeout=60)
    assert res["after_consumed"] == ["b@0_1", "c@0_1"]
    assert res["after_full"] == ["c@0_1", "d@0_1"] and res["tracked"] == 2
    assert res["d_exists"] == 0 and res["b_exists"] == 1


def scenario_ttl() -> dict[str, Any]:
    """An object nobody consumes is removed after buffer_ttl_seconds; one consumed is not."""
    from omnikv.connectors.mooncake_store.connector import MooncakeStoreConnector

    res: dict[str, Any] = {}
    with Master() as master:
        conn = MooncakeStoreConnector(
            store_cfg(
                master,
                global_segment_size=32 * MiB,
                memory_pool_size=4 * MiB,
                buffer_ttl_seconds=0.3,
            )
        )
        other = MooncakeStoreConnector(
            store_cfg(master, global_segment_size=16 * MiB, memory_pool_size=4 * MiB)
        )
        assert conn.put("0", "1", "orphan", b"x" * 1000)[0]
        assert conn.put("0", "1", "taken", b"y" * 1000)[0]
        got = other.get("0", "1", "taken")
        assert got is not None
        got[0].release()
        end = time.monotonic() + 20
        while conn.pending_keys() and time.monotonic() < end:
            conn.health()  # a health check sweeps when a sweep is due
            time.sleep(0.05)
        res["pending"] = conn.pending_keys()
        res["ttl_reaped"] = conn.health()["ttl_reaped"]
        res["orphan_left"] = other.get("0", "1", "orphan") is not None
        other.close()
        conn.close()
    return res


def test_store_objects_nobody_consumed_expire_after_the_ttl() -> None:
    res = run_scenario(__file__, "scenario_ttl", timeout=60)
    assert res["pending"] == [] and res["ttl_reaped"] == 1 and not res["orphan_left"], res


def scenario_holder_killed() -> dict[str, Any]:
    """The sender dies after its put: the object is listed but unreadable -> PeerGoneError."""
    from omnikv.connectors.mooncake_store.connector import MooncakeStoreConnector
    from omnikv.errors import PeerGoneError

    res: dict[str, Any] = {}
    with Master() as master:
        out_q, in_q = queue(), queue()
        # the receiver contributes too little to hold the object: it lands in the sender's segment
        proc = spawn(peer_putter, store_cfg(master, global_segment_size=256 * MiB), out_q, in_q)
        with peers(proc):
            assert out_q.get(timeout=30)[0] == "ready"
            recv = MooncakeStoreConnector(store_cfg(master, global_segment_size=16 * MiB))
            in_q.put(("put", "k", 64 * MiB, 1))
            res["put"] = list(out_q.get(timeout=30)[1:3])
            proc.kill()
            proc.join(10)
            t0 = time.monotonic()
            try:
                recv.wait("0", "1", "k", deadline=time.monotonic() + 10)
                res["outcome"] = "no error"
            except PeerGoneError as exc:
                res["outcome"] = type(exc).__name__
                res["message"] = str(exc)
            res["seconds"] = time.monotonic() - t0
            res["get"] = recv.get("0", "1", "k") is None  # the seed-shaped get: None, logged
            res["pool_used"] = recv.health()["pool_used"]
            recv.close()
    return res


def test_store_sender_killed_after_put_is_peer_gone() -> None:
    res = run_scenario(__file__, "scenario_holder_killed", timeout=90)
    assert res["put"] == [True, 64 * MiB]
    assert res["outcome"] == "PeerGoneError", res
    assert "TRANSFER_FAIL" in res["message"] and res["seconds"] < 3.0
    assert res["get"] and res["pool_used"] == 0
