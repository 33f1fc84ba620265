"""Delivery verdicts over the pull connectors (Transfer Engine, NIXL), with real engines.

One scenario per engine runs isolated (``unshare -n`` where possible, see
``support.mooncake_peers.run_scenario``). The sender is a manager in a spawned peer process,
driven over a queue and stopped by PID; the genuine receiver (a manager, and its connector for
the connector-level steps) and a forging peer (a second receiving connector that never pulls)
live in the scenario's process; one more receiver is spawned to be SIGKILLed after its pull.
The control plane is authenticated (``auth_secret``) as in a deployment.

What the sender sees, through ``get_send_result`` / ``wait_delivered``:

* a receive through the manager: ``delivered``; a second verdict from the same receiver changes
  nothing;
* a receive whose ``check`` returns a reason: ``refused`` with that reason;
* a payload nobody takes: ``expired`` at its ``buffer_ttl_seconds``;
* a receiver SIGKILLed after its pull and before its verdict: ``expired`` within
  ``ack_timeout_s``, and nothing held (entries, pool, watched verdicts);
* verdicts forged by a peer that did not pull the key (before the pull, and after another
  peer pulled it): ignored and counted; the genuine receiver's verdict still decides.

The rules without an engine (schema bounds, the bookkeeping) are at the end of the file.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

from omnikv.connectors.counters import Counters
from omnikv.connectors.delivery import MAX_KEY_CHARS, MAX_REASON_CHARS, DeliveryReport, Verdict
from omnikv.connectors.nixl.agent import unavailable_reason as nixl_skip_reason
from omnikv.connectors.pull.control import ControlCodec
from omnikv.connectors.pull.verdicts import (
    VERDICT_COUNTER_NAMES,
    SentVerdicts,
    peer_identity,
    verdict_message,
)
from omnikv.errors import ProtocolError
from support.mooncake_peers import (
    mooncake_skip_reason,
    omnikv_threads,
    peers,
    queue,
    run_scenario,
    spawn,
)
from support.pull_engine import SMALL, block_ids, cache_layer, free_base_port, kv_config

MiB = 1 << 20
TTL_S = 6.0
ACK_TIMEOUT_S = 2.0

ENGINES = {
    "te": {"type": "MooncakeTransferEngineConnector"},
    "nixl": {"type": "NixlConnector", "backends": ["UCX"]},
}


def _loopback_env() -> None:
    """UCX on loopback only (inherited by the spawned peers; harmless for the TE)."""
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")


def _omni_kv(engine: str, role: str, base: int) -> dict[str, Any]:
    cfg = kv_config(ENGINES[engine], role, base, 1, 1)
    cfg["connector_config"].update(
        memory_pool_size=16 * MiB,
        buffer_ttl_seconds=TTL_S,
        ack_timeout_s=ACK_TIMEOUT_S,
        peer_timeout_seconds=2.0,
    )
    cfg["recv_timeout"] = 20.0
    return cfg


def _connector(engine: str, cfg: dict[str, Any]) -> Any:
    if engine == "te":
        from omnikv.connectors.mooncake_te import MooncakeTransferEngineConnector

        return MooncakeTransferEngineConnector(cfg)
    from omnikv.connectors.nixl.connector import NixlConnector

    return NixlConnector(cfg)


# -- the peers ----------------------------------------------------------------------------------
def manager_sender(omni_kv: dict[str, Any], out_q: Any, in_q: Any) -> None:
    """The sender stage: ``send`` / ``result`` / ``wait`` / ``health`` / ``close`` from ``in_q``,
    answered on ``out_q`` (``("error", type, message)`` when a command fails)."""
    from omnikv import OmniKVTransferManager

    mgr = OmniKVTransferManager.from_od_config(SimpleNamespace(omni_kv_config=omni_kv))
    caches = [cache_layer(SMALL, i) for i in range(SMALL["layers"])]
    entry = {"block_ids": block_ids(SMALL), "seq_len": SMALL["seq_len"]}

    def result(res: Any) -> tuple[Any, ...]:
        return ("result", res.status.value, res.reason, list(res.keys))

    out_q.put(("ready",))
    while True:
        cmd = in_q.get()
        try:
            if cmd[0] == "send":
                mgr.handle_finished_requests_kv_transfer(
                    {cmd[1]: entry}, caches, SMALL["block_size"], "float16"
                )
                out_q.put(result(mgr.get_send_result(cmd[1])))
            elif cmd[0] == "result":
                out_q.put(result(mgr.get_send_result(cmd[1])))
            elif cmd[0] == "wait":
                out_q.put(result(mgr.wait_delivered(cmd[1], timeout=cmd[2])))
            elif cmd[0] == "health":
                out_q.put(("health", mgr.connector.health()))
            elif cmd[0] == "withdraw":
                out_q.put(("withdrew", mgr.connector.withdraw("0", "1", cmd[1])))
            elif cmd[0] == "close":
                health = mgr.connector.health()
                mgr.close()
                out_q.put(("closed", health, omnikv_threads()))
                return
        except Exception as exc:
            out_q.put(("error", type(exc).__name__, str(exc)))


def pull_then_hang(engine: str, cfg: dict[str, Any], key_q: Any, meta: Any, out_q: Any) -> None:
    """A receiver that pulls the key it is handed on ``key_q`` once ready (connector level, no
    verdict) and then waits to be killed: what a receiver that dies between its pull and its
    verdict leaves behind. It starts before the put, so a slow start on a loaded host cannot
    outlast the entry's short TTL."""
    conn = _connector(engine, cfg)
    out_q.put(("ready",))
    key = key_q.get(timeout=90)
    buf = conn.wait("0", "1", key, deadline=time.monotonic() + 20, metadata=meta)
    out_q.put(("pulled", None if buf is None else buf.size))
    time.sleep(3600)  # killed by the scenario (SIGKILL) long before


# -- the scenario -------------------------------------------------------------------------------
def _until(probe: Callable[[], Any], timeout_s: float) -> tuple[Any, float]:
    """Poll ``probe`` until it returns something truthy or ``timeout_s`` passes: the last value
    and the seconds it took."""
    t0 = time.monotonic()
    while True:
        got = probe()
        if got or time.monotonic() - t0 >= timeout_s:
            return got, time.monotonic() - t0
        time.sleep(0.05)


def scenario_delivery(engine: str) -> dict[str, Any]:
    _loopback_env()
    from omnikv import OmniKVTransferManager

    base = free_base_port(1)
    port = base + 100
    meta = {"source_host": "127.0.0.1", "source_port": port}
    out_q, in_q = queue(), queue()
    proc = spawn(manager_sender, _omni_kv(engine, "sender", base), out_q, in_q)

    def ask(*cmd: Any) -> Any:
        in_q.put(cmd)
        msg = out_q.get(timeout=60)
        assert msg[0] != "error", msg
        return msg

    def health() -> dict[str, Any]:
        h: dict[str, Any] = ask("health")[1]
        return h

    res: dict[str, Any] = {}
    with peers(proc, timeout=30):
        assert out_q.get(timeout=90) == ("ready",)
        recv_cfg = _omni_kv(engine, "receiver", base)
        recv = OmniKVTransferManager.from_od_config(SimpleNamespace(omni_kv_config=recv_cfg))
        recv.update_sender_info({"0": {"host": "127.0.0.1", "zmq_port": port}})
        conn = recv.connector
        direct_cfg = {**recv_cfg["connector_config"], "role": "receiver"}
        forger = _connector(engine, direct_cfg)

        # 1. delivered; a second verdict from the same receiver changes nothing
        res["sent"] = ask("send", "ok")[1]
        got = recv.receive_kv_cache_result("ok")
        res["received"] = got.status.value
        res["delivered"] = ask("wait", "ok", 10.0)[1:3]
        key = ask("result", "ok")[3][0]
        conn.acknowledge("0", "1", key, Verdict.REFUSED, "second thoughts", metadata=meta)
        _, res["repeat_ignored_s"] = _until(lambda: health()["acks_ignored"] >= 1, 10)
        res["after_repeat"] = ask("result", "ok")[1]

        # 2. refused with the check's reason
        ask("send", "bad")
        got = recv.receive_kv_cache_result("bad", check=lambda kv: "binding mismatch")
        res["refused_recv"] = [got.status.value, got.reason]
        res["refused"] = ask("wait", "bad", 10.0)[1:3]

        # 3. forged before the pull: ignored; the genuine receive still decides
        key = ask("send", "forge1")[3][0]
        forger.acknowledge("0", "1", key, Verdict.REFUSED, "forged", metadata=meta)
        _, res["forged_seen_s"] = _until(lambda: health()["acks_ignored"] >= 2, 10)
        res["forged_untaken"] = ask("result", "forge1")[1]
        res["forged_untaken_then"] = [
            recv.receive_kv_cache_result("forge1").status.value,
            ask("wait", "forge1", 10.0)[1],
        ]

        # 4. forged after the genuine pull: ignored; the genuine verdict decides
        key = ask("send", "forge2")[3][0]
        buf = conn.wait("0", "1", key, deadline=time.monotonic() + 20, metadata=meta)
        res["forge2_pulled"] = buf is not None
        if buf is not None:
            buf.release()
        forger.acknowledge("0", "1", key, Verdict.DELIVERED, None, metadata=meta)
        _, res["forged_taken_seen_s"] = _until(lambda: health()["acks_ignored"] >= 3, 10)
        res["forged_taken"] = ask("result", "forge2")[1]
        conn.acknowledge("0", "1", key, Verdict.REFUSED, "genuine says no", metadata=meta)
        res["forged_taken_then"] = ask("wait", "forge2", 10.0)[1:3]

        # 5. taken back by its sender before anyone came: gone, no verdict; a pulled one stays
        key = ask("send", "withdrawn")[3][0]
        res["withdrawn"] = [ask("withdraw", key)[1], ask("withdraw", key)[1]]
        buf = conn.wait("0", "1", key, deadline=time.monotonic() + 1.0, metadata=meta)
        res["withdrawn_missed"] = buf is None
        res["withdrawn_result"] = ask("result", "withdrawn")[1]
        res["withdraw_taken"] = ask("withdraw", ask("result", "forge2")[3][0])[1]

        # 6. never taken: expired at the TTL
        ask("send", "lost")
        t0 = time.monotonic()
        res["ttl"] = ask("wait", "lost", TTL_S * 3)[1:3]
        res["ttl_s"] = time.monotonic() - t0

        # 7. receiver killed between its pull and its verdict: expired within ack_timeout_s
        kq, key_q = queue(), queue()
        victim = spawn(pull_then_hang, engine, direct_cfg, key_q, meta, kq)
        with peers(victim, timeout=1):
            assert kq.get(timeout=90) == ("ready",)
            key_q.put(ask("send", "killed")[3][0])
            res["victim_pulled"] = kq.get(timeout=90)
            t_pull = time.monotonic()
            assert victim.pid is not None
            os.kill(victim.pid, signal.SIGKILL)
            victim.join(timeout=10)
            res["killed"] = ask("wait", "killed", ACK_TIMEOUT_S * 5)[1:3]
            res["killed_s"] = time.monotonic() - t_pull

        h = health()
        res["sender_health"] = {
            k: h.get(k)
            for k in (
                "entries",
                "pool_used",
                "leases",
                "inflight",
                "awaiting_verdicts",
                "rejected_messages",
                *VERDICT_COUNTER_NAMES,
            )
        }
        forger.close()
        recv.close()
        closed = ask("close")
        res["sender_closed"] = {k: closed[1].get(k) for k in ("entries", "awaiting_verdicts")}
        res["sender_threads"] = closed[2]
    res["threads"] = omnikv_threads()
    return res


def _skip(engine: str) -> str | None:
    return mooncake_skip_reason() if engine == "te" else nixl_skip_reason()


@pytest.fixture(scope="module", params=["te", "nixl"])
def delivery(request: pytest.FixtureRequest) -> dict[str, Any]:
    engine: str = request.param
    why = _skip(engine)
    if why is not None:
        pytest.skip(why)
    res = run_scenario(__file__, "scenario_delivery", {"engine": engine}, timeout=240)
    res["_engine"] = engine
    return res


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_accepted_receive_turns_the_send_delivered(delivery: dict[str, Any]) -> None:
    assert delivery["sent"] == "sent" and delivery["received"] == "ok", delivery
    assert delivery["delivered"] == ["delivered", None], delivery


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_second_verdict_from_the_taker_changes_nothing(delivery: dict[str, Any]) -> None:
    assert delivery["after_repeat"] == "delivered", delivery


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_failed_check_refuses_with_its_reason(delivery: dict[str, Any]) -> None:
    status, reason = delivery["refused_recv"]
    assert status == "refused" and "binding mismatch" in reason, delivery
    status, reason = delivery["refused"]
    assert status == "refused" and "binding mismatch" in reason, delivery


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_sender_takes_back_an_untaken_payload_and_only_that(delivery: dict[str, Any]) -> None:
    """``withdraw``: True once, then False; the receiver misses it; no verdict is reported
    (the send stays ``sent``); a payload already pulled is not withdrawn."""
    assert delivery["withdrawn"] == [True, False], delivery
    assert delivery["withdrawn_missed"] and delivery["withdrawn_result"] == "sent", delivery
    assert delivery["withdraw_taken"] is False, delivery


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_payload_never_taken_expires_at_its_ttl(delivery: dict[str, Any]) -> None:
    status, reason = delivery["ttl"]
    assert status == "expired" and "TTL" in reason, delivery
    assert TTL_S * 0.9 <= delivery["ttl_s"] <= TTL_S * 2.5, delivery


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_receiver_killed_before_its_verdict_expires_the_send(delivery: dict[str, Any]) -> None:
    assert delivery["victim_pulled"][0] == "pulled" and delivery["victim_pulled"][1], delivery
    status, reason = delivery["killed"]
    assert status == "expired" and "verdict" in reason, delivery
    # the watch starts at the pull: the verdict is due ack_timeout_s after it
    assert delivery["killed_s"] <= ACK_TIMEOUT_S + 3.0, delivery


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_nothing_is_left_held_after_the_verdicts(delivery: dict[str, Any]) -> None:
    h = delivery["sender_health"]
    assert h["entries"] == 0 and h["pool_used"] == 0 and h["awaiting_verdicts"] == 0, h
    assert h.get("leases") in (None, 0) and h.get("inflight") in (None, 0), h
    assert delivery["sender_closed"]["entries"] == 0, delivery
    assert delivery["sender_threads"] == [] and delivery["threads"] == [], delivery


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_verdicts_are_counted_by_kind(delivery: dict[str, Any]) -> None:
    h = delivery["sender_health"]
    # delivered: ok, forge1; refused: bad, forge2; expired: lost (TTL), killed (ack timeout)
    assert h["acks_delivered"] == 2 and h["acks_refused"] == 2, h
    assert h["acks_expired"] == 2, h
    # one repeat of the taker, two forgeries
    assert h["acks_ignored"] == 3 and h["rejected_messages"] in (None, 0), h


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_forged_verdict_for_a_key_not_taken_changes_nothing(delivery: dict[str, Any]) -> None:
    assert delivery["forged_seen_s"] < 10, delivery
    assert delivery["forged_untaken"] == "sent", delivery
    assert delivery["forged_untaken_then"] == ["ok", "delivered"], delivery


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_forged_verdict_for_a_key_another_peer_took_changes_nothing(
    delivery: dict[str, Any],
) -> None:
    assert delivery["forge2_pulled"] and delivery["forged_taken_seen_s"] < 10, delivery
    assert delivery["forged_taken"] == "sent", delivery
    status, reason = delivery["forged_taken_then"]
    assert status == "refused" and "genuine says no" in reason, delivery


# -- the rules without an engine ----------------------------------------------------------------
def _codec() -> ControlCodec:
    from omnikv.connectors.mooncake_te.protocol import SCHEMA

    return ControlCodec(SCHEMA, b"secret")


def _verdict_frames(codec: ControlCodec, **fields: Any) -> list[bytes]:
    msg = {"op": "verdict", "key": "k@0_1", "verdict": "delivered", "reason": "", **fields}
    _, frames = codec.encode({**msg, "tok": b"t" * 16})
    return frames


@pytest.mark.parametrize(
    "fields",
    [
        {"verdict": "accepted"},
        {"verdict": ""},
        {"reason": "x" * (MAX_REASON_CHARS + 1)},
        {"key": ""},
        {"key": "k" * (MAX_KEY_CHARS + 1)},
        {"key": 7},
        {"reason": None},
    ],
)
def test_the_schema_rejects_out_of_bounds_verdicts(fields: dict[str, Any]) -> None:
    codec = _codec()
    with pytest.raises(ProtocolError):
        codec.decode_request(_verdict_frames(codec, **fields))


def test_the_schema_accepts_every_verdict_and_the_nixl_schema_too() -> None:
    codec = _codec()
    for v in Verdict:
        msg = codec.decode_request(_verdict_frames(codec, verdict=v.value, reason="why"))
        assert msg["verdict"] == v.value
    from omnikv.connectors.nixl.protocol import SCHEMA as NIXL_SCHEMA

    assert "verdict" in NIXL_SCHEMA.request_structs() and "verdict" in NIXL_SCHEMA.checks


def test_the_receiver_clips_the_reason_and_refuses_an_overlong_key() -> None:
    msg = verdict_message("k@0_1", Verdict.REFUSED, "a\nb " + "x" * 2000)
    assert msg is not None and len(msg["reason"]) == MAX_REASON_CHARS
    assert msg["reason"].startswith("a b")
    assert verdict_message("k" * (MAX_KEY_CHARS + 1), Verdict.DELIVERED, None) is None
    assert verdict_message("k", Verdict.DELIVERED, None) == {
        "op": "verdict",
        "key": "k",
        "verdict": "delivered",
        "reason": "",
    }


def _book() -> tuple[SentVerdicts, list[DeliveryReport], Counters]:
    counters = Counters(VERDICT_COUNTER_NAMES)
    verdicts = SentVerdicts(0.2, counters)
    reports: list[DeliveryReport] = []
    verdicts.set_listener(reports.append)
    return verdicts, reports, counters


A, B = peer_identity({"agent": "a", "inc": b"1"}), peer_identity({"agent": "a", "inc": b"2"})


def test_only_the_taker_s_first_verdict_counts() -> None:
    verdicts, reports, counters = _book()
    pub = verdicts.published("r1@0_1", "r1")
    assert not verdicts.receive("r1@0_1", A, "refused", "not taken yet")
    verdicts.taken("r1@0_1", pub, A)
    assert not verdicts.receive("r1@0_1", B, "refused", "not the taker")
    assert verdicts.receive("r1@0_1", A, "delivered", "")
    assert not verdicts.receive("r1@0_1", A, "refused", "again")
    assert reports == [DeliveryReport("r1", Verdict.DELIVERED, None)]
    snap = counters.snapshot()
    assert snap["acks_delivered"] == 1 and snap["acks_ignored"] == 3 and len(verdicts) == 0


def test_events_about_a_replaced_publication_change_nothing() -> None:
    verdicts, reports, _ = _book()
    old = verdicts.published("r1@0_1", "r1")
    new = verdicts.published("r1@0_1", "r1")
    verdicts.expired("r1@0_1", old, "TTL")
    verdicts.taken("r1@0_1", old, A)
    verdicts.forget("r1@0_1", old)
    assert reports == [] and len(verdicts) == 1
    verdicts.expired("r1@0_1", new, "TTL")
    assert reports == [DeliveryReport("r1", Verdict.EXPIRED, "TTL")]


def test_an_early_verdict_waits_for_the_same_taker() -> None:
    verdicts, reports, _ = _book()
    pub = verdicts.published("r1@0_1", "r1")
    assert verdicts.receive("r1@0_1", A, "refused", "bad", early_ok=True)
    assert not verdicts.receive("r1@0_1", B, "delivered", "", early_ok=True)  # one kept
    assert reports == []
    verdicts.taken("r1@0_1", pub, A)
    assert reports == [DeliveryReport("r1", Verdict.REFUSED, "bad")]
    # another taker than the early one: the early verdict is dropped, the watch goes on
    pub = verdicts.published("r2@0_1", "r2")
    verdicts.receive("r2@0_1", A, "delivered", "", early_ok=True)
    verdicts.taken("r2@0_1", pub, B)
    assert len(reports) == 1 and len(verdicts) == 1


def test_a_taken_key_without_a_verdict_expires_at_the_ack_timeout() -> None:
    verdicts, reports, counters = _book()
    assert verdicts.sweep() == float("inf")
    pub = verdicts.published("r1@0_1", "r1")
    verdicts.taken("r1@0_1", pub, A)
    left = verdicts.sweep()
    assert 0 < left <= 0.2 and reports == []
    assert verdicts.sweep(time.monotonic() + 0.3) == float("inf")
    assert [r.verdict for r in reports] == [Verdict.EXPIRED]
    assert "0.2 s" in (reports[0].reason or "")
    assert counters.snapshot()["acks_expired"] == 1 and len(verdicts) == 0
    assert not verdicts.receive("r1@0_1", A, "delivered", "")  # too late
