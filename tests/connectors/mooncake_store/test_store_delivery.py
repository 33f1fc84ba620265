"""Delivery verdicts through a real Mooncake Store: a sender learns delivered / refused / expired.

One scenario runs in an isolated child (``support.mooncake_peers``): a ``mooncake_master`` on
free loopback ports, the sending managers in the scenario process, a receiving manager and a
receiver that gets killed after taking, each in its own spawned process. Every client gets a
name (``127.0.0.1:<port>``) no earlier client of that master had. The record format's bounds are
checked on their own, without a store.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from types import SimpleNamespace
from typing import Any

import pytest

from omnikv.connectors.delivery import MAX_REASON_CHARS, Verdict
from omnikv.connectors.mooncake_store.protocol import (
    MAX_RECORD_BYTES,
    ack_key,
    encode_record,
    parse_record,
)
from support.mooncake_peers import (
    Master,
    free_ports,
    mooncake_skip_reason,
    omnikv_threads,
    peers,
    queue,
    run_scenario,
    spawn,
)

MiB = 1 << 20
STAGES = ("stage1", "stage2")
ACK_TIMEOUT_S = 2.0
TTL_S = 0.5


def store_cfg(master: Master, name_port: int, **extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "type": "MooncakeStoreConnector",
        "host": f"127.0.0.1:{name_port}",
        "metadata_server": master.metadata_url,
        "master_server_address": master.address,
        "global_segment_size": 32 * MiB,
        "local_buffer_size": 16 * MiB,
        "memory_pool_size": 4 * MiB,
    }
    cfg.update(extra)
    return cfg


def manager(role: str, cfg: dict[str, Any]) -> Any:
    from conftest import omni_kv_config
    from omnikv import OmniKVTransferManager

    conf = omni_kv_config("unused", role, connector_config=cfg, recv_timeout=30.0)
    return OmniKVTransferManager.from_od_config(SimpleNamespace(omni_kv_config=conf))


def peer_receiver(cfg: dict[str, Any], out_q: Any, in_q: Any) -> None:
    """A receiving manager in its own process: receives what it is told (refusing with the given
    reason through ``check``), reports the status, and closes when told."""
    mgr = manager("receiver", cfg)
    out_q.put(("ready",))
    while True:
        cmd = in_q.get()
        if cmd[0] == "receive":
            _, rid, refuse = cmd

            def check(kv: Any, refuse: str | None = refuse) -> str | None:
                return refuse

            got = mgr.receive_kv_cache_result(rid, check=check)
            out_q.put(("received", got.status.value, got.reason))
        elif cmd[0] == "close":
            health = mgr.connector.health()
            mgr.close()
            out_q.put(("closed", health))
            return


def peer_taker(cfg: dict[str, Any], out_q: Any, in_q: Any) -> None:
    """A receiver that takes one payload and then never acknowledges (it is killed)."""
    from omnikv.connectors.mooncake_store.connector import MooncakeStoreConnector

    conn = MooncakeStoreConnector(cfg)
    out_q.put(("ready",))
    _, key = in_q.get()
    buf = conn.wait(*STAGES, key, deadline=time.monotonic() + 30)
    out_q.put(("taken", buf is not None))
    in_q.get()  # never answered: the scenario kills this process by PID


def _send(mgr: Any, rid: str) -> Any:
    from conftest import make_paged_caches

    spec = {"block_ids": [0, 1], "seq_len": 12}
    mgr.handle_finished_requests_kv_transfer({rid: spec}, make_paged_caches(), 8, "float32")
    res = mgr.get_send_result(rid)
    assert res is not None and res.status.value == "sent", res
    return res


def _until(pred: Any, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, f"{what} within {timeout} s"
        time.sleep(0.02)  # polling with a deadline


def _verdict(mgr: Any, rid: str) -> list[Any]:
    res = mgr.wait_delivered(rid, timeout=20)
    return [res.status.value, res.reason]


def scenario_verdicts() -> dict[str, Any]:
    from omnikv.connectors.mooncake_store.connector import MooncakeStoreConnector

    res: dict[str, Any] = {}
    with Master() as master, contextlib.ExitStack() as clients:
        names = iter(free_ports(7))
        r_out, r_in, t_out, t_in = queue(), queue(), queue(), queue()
        recv_proc = spawn(peer_receiver, store_cfg(master, next(names)), r_out, r_in)
        take_proc = spawn(peer_taker, store_cfg(master, next(names)), t_out, t_in)
        clients.enter_context(peers(recv_proc, take_proc))
        sender = manager("sender", store_cfg(master, next(names), ack_timeout_s=ACK_TIMEOUT_S))
        clients.callback(sender.close)
        ttl_sender = manager("sender", store_cfg(master, next(names), buffer_ttl_seconds=TTL_S))
        clients.callback(ttl_sender.close)
        other = MooncakeStoreConnector(store_cfg(master, next(names)))
        clients.callback(other.close)
        assert r_out.get(timeout=60)[0] == "ready" and t_out.get(timeout=60)[0] == "ready"
        keys: list[str] = []

        def send(mgr: Any, rid: str) -> str:
            key = str(_send(mgr, rid).keys[0])
            keys.append(f"{key}@{STAGES[0]}_{STAGES[1]}")
            return keys[-1]

        # delivered: taken, decoded and accepted by a manager in another process
        send(sender, "d1")
        r_in.put(("receive", "d1", None))
        res["d1_received"] = r_out.get(timeout=60)[1]
        res["d1"] = _verdict(sender, "d1")
        # refused: the receiver's check rejects it; the sender learns why
        send(sender, "f1")
        r_in.put(("receive", "f1", "binding mismatch"))
        res["f1_received"] = r_out.get(timeout=60)[1]
        res["f1"] = _verdict(sender, "f1")
        # expired: nobody takes it within the sender's buffer_ttl_seconds
        send(ttl_sender, "e1")
        res["e1"] = _verdict(ttl_sender, "e1")
        res["ttl_sender"] = ttl_sender.connector.health()["acks_expired"]
        # malformed records are dropped and counted; the real verdict still arrives
        m1 = send(sender, "m1")
        conn = sender.connector
        bad = [
            b"\xffnot json",
            json.dumps({"key": m1, "verdict": "accepted"}).encode(),
            json.dumps({"key": "someone-else", "verdict": "delivered"}).encode(),
        ]
        raw = other.live_store()  # a Store client writing records of its own making
        for i, body in enumerate(bad, 1):
            assert raw.put(ack_key(m1), body, other.placement) == 0
            _until(lambda i=i: conn.health()["acks_malformed"] >= i, 10, "malformed dropped")
        res["m1_after_malformed"] = sender.get_send_result("m1").status.value
        r_in.put(("receive", "m1", None))
        res["m1_received"] = r_out.get(timeout=60)[1]
        res["m1"] = _verdict(sender, "m1")
        r_in.put(("close",))
        closed = r_out.get(timeout=60)[1]
        res["receiver"] = {k: v for k, v in closed.items() if "ack" in k}
        # a verdict nobody reads (its sender has no listener) is removed by its writer at
        # close, after ack_linger_s
        lone = MooncakeStoreConnector(store_cfg(master, next(names), ack_linger_s=0.3))
        clients.callback(lone.close)
        assert other.put(*STAGES, "n1", b"x" * 1000)[0]
        keys.append(f"n1@{STAGES[0]}_{STAGES[1]}")
        buf = lone.wait(*STAGES, "n1", deadline=time.monotonic() + 10)
        assert buf is not None
        buf.release()
        lone.acknowledge(*STAGES, "n1", Verdict.DELIVERED)
        res["n1_record"] = raw.is_exist(ack_key(keys[-1]))
        t0 = time.monotonic()
        lone.close()
        res["n1_close_s"] = time.monotonic() - t0
        res["n1_dropped"] = lone.health()["ack_records_dropped"]
        # withdrawn by the client that put it: removed, no verdict; another client cannot
        w1 = send(sender, "w1")
        put_key = w1.rsplit("@", 1)[0]
        res["w1_other"] = other.withdraw(*STAGES, put_key)
        res["w1"] = [conn.withdraw(*STAGES, put_key), conn.withdraw(*STAGES, put_key)]
        res["w1_there"] = raw.is_exist(w1)
        res["w1_result"] = sender.get_send_result("w1").status.value
        # expired: the receiver took it and was killed before its verdict (last: the killed
        # client's segment stays listed until its lease ends, and puts placed there fail)
        key = send(sender, "k1").rsplit("@", 1)[0]
        t_in.put(("take", key))
        res["k1_taken"] = t_out.get(timeout=60)[1]
        assert take_proc.pid is not None
        os.kill(take_proc.pid, signal.SIGKILL)
        take_proc.join(10)
        t0 = time.monotonic()
        res["k1"] = _verdict(sender, "k1")
        res["k1_s"] = time.monotonic() - t0
        health = conn.health()
        res["sender"] = {k: v for k, v in health.items() if "ack" in k or k == "watched_keys"}
        # nothing of the test is left in the store: payloads and verdict records
        everything = keys + [ack_key(k) for k in keys]
        found = raw.batch_is_exist(everything)
        res["left"] = [k for k, e in zip(everything, found, strict=True) if e != 0]
        clients.close()
        res["threads"] = [t for t in omnikv_threads() if "verdict" in t]
    return res


@pytest.fixture(scope="module")
def verdicts() -> dict[str, Any]:
    return run_scenario(__file__, "scenario_verdicts", timeout=240)


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.timeout(290)  # above the scenario's own bound (240 s) and its report
@pytest.mark.skipif(mooncake_skip_reason() is not None, reason=str(mooncake_skip_reason()))
class TestStoreVerdicts:
    def test_a_payload_accepted_in_another_process_is_delivered(
        self, verdicts: dict[str, Any]
    ) -> None:
        assert verdicts["d1_received"] == "ok"
        assert verdicts["d1"] == ["delivered", None]

    def test_a_refusal_reaches_the_sender_with_its_reason(self, verdicts: dict[str, Any]) -> None:
        assert verdicts["f1_received"] == "refused"
        status, reason = verdicts["f1"]
        assert status == "refused" and "binding mismatch" in reason

    def test_a_payload_nobody_took_expires_at_the_ttl(self, verdicts: dict[str, Any]) -> None:
        status, reason = verdicts["e1"]
        assert status == "expired" and "TTL" in reason and "buffer_ttl_seconds" in reason
        assert verdicts["ttl_sender"] == 1

    def test_a_receiver_killed_before_its_verdict_expires_at_the_ack_timeout(
        self, verdicts: dict[str, Any]
    ) -> None:
        assert verdicts["k1_taken"] is True
        status, reason = verdicts["k1"]
        assert status == "expired" and "no verdict" in reason, verdicts["k1"]
        assert verdicts["k1_s"] < ACK_TIMEOUT_S + 2.0

    def test_malformed_records_are_dropped_counted_and_change_nothing(
        self, verdicts: dict[str, Any]
    ) -> None:
        assert verdicts["m1_after_malformed"] == "sent"
        assert verdicts["m1_received"] == "ok" and verdicts["m1"] == ["delivered", None]
        assert verdicts["sender"]["acks_malformed"] == 3

    def test_counters_and_nothing_left_behind(self, verdicts: dict[str, Any]) -> None:
        sender = verdicts["sender"]
        assert sender["acks_delivered"] == 2 and sender["acks_refused"] == 1
        assert sender["acks_expired"] == 1 and sender["watched_keys"] == 0
        receiver = verdicts["receiver"]
        assert receiver["acks_sent"] == 3 and receiver["ack_failures"] == 0
        assert verdicts["left"] == []
        assert verdicts["threads"] == []

    def test_a_client_withdraws_its_own_untaken_object_and_no_other(
        self, verdicts: dict[str, Any]
    ) -> None:
        assert verdicts["w1_other"] is False and verdicts["w1"] == [True, False]
        assert verdicts["w1_there"] == 0 and verdicts["w1_result"] == "sent"

    def test_a_verdict_nobody_reads_is_removed_by_its_writer_at_close(
        self, verdicts: dict[str, Any]
    ) -> None:
        assert verdicts["n1_record"] == 1 and verdicts["n1_dropped"] == 1
        assert verdicts["n1_close_s"] < 6.0  # the linger (0.3 s) and the client's own close


# -- configuration and the record format alone ---------------------------------------------------


@pytest.mark.parametrize(("key", "bad"), [("ack_timeout_s", 0), ("ack_linger_s", -1)])
def test_bad_verdict_settings_are_config_errors_naming_the_key(key: str, bad: object) -> None:
    from omnikv.connectors.mooncake_store.connector import MooncakeStoreConnector
    from omnikv.errors import ConfigError

    with pytest.raises(ConfigError, match=key):
        MooncakeStoreConnector({key: bad})


def test_a_record_round_trips_and_its_reason_is_bounded() -> None:
    body = encode_record("k@a_b", Verdict.REFUSED, "bad\nMAC " + "x" * 5000)
    assert len(body) <= MAX_RECORD_BYTES
    verdict, reason = parse_record(body, "k@a_b") or (None, None)
    assert verdict is Verdict.REFUSED and reason is not None
    assert reason.startswith("bad MAC") and len(reason) == MAX_REASON_CHARS
    assert parse_record(encode_record("k", Verdict.DELIVERED, None), "k") == (
        Verdict.DELIVERED,
        None,
    )


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"\xff\xfe",
        b"[1, 2]",
        b"[" * 100_000,
        json.dumps({"key": "k", "verdict": "accepted"}).encode(),
        json.dumps({"key": "k", "verdict": ["delivered"]}).encode(),
        json.dumps({"key": "other", "verdict": "delivered"}).encode(),
        json.dumps({"key": "k", "verdict": "refused", "reason": {"a": 1}}).encode(),
        json.dumps({"key": "k", "verdict": "refused", "reason": "r" * MAX_RECORD_BYTES}).encode(),
    ],
)
def test_malformed_records_parse_to_none(body: bytes) -> None:
    assert parse_record(body, "k") is None
