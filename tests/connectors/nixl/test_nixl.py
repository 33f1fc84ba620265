"""NixlConnector against real NIXL agents (UCX over loopback) in separate processes.

Every networked case runs as a ``scenario_*`` function in an isolated child (``unshare -n``
where possible, see ``support.mooncake_peers.run_scenario``) with ``UCX_NET_DEVICES=lo``; the sender
is a spawned peer driven over a queue, stopped by PID. The manager cases (224 MiB end to end,
TP 2 -> 4) reuse the Mooncake manager tests' peers and checks with a NIXL connector config.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import pytest

from omnikv.connectors.nixl.agent import unavailable_reason
from support.mooncake_peers import (
    crc,
    free_ports,
    omnikv_threads,
    pattern,
    peers,
    run_scenario,
    tcp_sockets,
)
from support.pull_engine import (
    QWEN,
    SCENARIO_224_S,
    SMALL,
    ask,
    check_closed_sender,
    check_consumed_once,
    check_received,
    check_receiver_closed,
    check_sent_224,
    long_poll,
    scenario_224,
    scenario_tp,
    serve_sender,
    start_sender,
)

pytestmark = [
    pytest.mark.engine,
    pytest.mark.slow,
    pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason())),
]

MiB = 1 << 20
# The failure scenario's peer timeout: short enough to see a killed sender quickly, long enough
# for a sender process on a loaded 2-core host (the suite runs in parallel lanes) to answer.
PEER_TIMEOUT_S = 2.0


def _loopback_env() -> None:
    """UCX on loopback only (inherited by the spawned peers)."""
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")


# -- the sender peer ----------------------------------------------------------------------------
def peer_sender(cfg: dict[str, Any], out_q: Any, in_q: Any) -> None:
    from omnikv.connectors.nixl.connector import NixlConnector

    conn = NixlConnector(cfg)

    def kill_after_grant(delay_s: float) -> tuple[Any, ...]:
        """Failure injection: this process dies ``delay_s`` after its next grant (mid-READ)."""

        def die_soon() -> None:
            threading.Timer(delay_s, os.kill, (os.getpid(), signal.SIGKILL)).start()

        conn.set_grant_hook(die_soon)
        return ("armed",)

    serve_sender(conn, out_q, in_q, {"kill_after_grant": kill_after_grant})


def _cfg(**extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {"host": "127.0.0.1", "memory_pool_size": 64 * MiB}
    cfg.update(extra)
    return cfg


def _ask(out_q: Any, in_q: Any, *cmd: Any) -> Any:
    msg = ask(in_q, out_q, *cmd)
    assert msg[0] != "error", msg
    return msg


# -- scenarios (run isolated) -------------------------------------------------------------------
def scenario_roundtrip() -> dict[str, Any]:
    _loopback_env()
    from omnikv.connectors.nixl.connector import NixlConnector
    from omnikv.errors import ConnectorClosedError

    (zport,) = free_ports(1)
    res: dict[str, Any] = {}
    proc, out_q, in_q = start_sender(
        peer_sender, _cfg(role="sender", zmq_port=zport, auth_secret="s3cret")
    )
    with peers(proc):
        # the sender must answer pings within the receiver's peer timeout; during a whole `make
        # test` (ten lanes on 2 cores) its process once went 2 s without a CPU while the receiver
        # long-polled, and the roundtrip ended as PeerGoneError. This scenario checks what comes
        # across; silence is the kill scenario's (PEER_TIMEOUT_S).
        recv = NixlConnector(_cfg(role="receiver", auth_secret="s3cret", peer_timeout_seconds=10))
        recv.update_sender_info("127.0.0.1", zport)
        # The first get opens the channel (hello, the sender's metadata): under a whole `make
        # test` that alone took seconds. A later miss is one question the sender answers.
        res["first_miss"] = recv.get("0", "1", "absent") is None
        t0 = time.monotonic()
        res["miss"] = recv.get("0", "1", "absent2") is None
        res["miss_s"] = time.monotonic() - t0
        long_poll(recv, in_q, out_q, res)  # wait first, put while it waits
        # consume-once: the sender freed the entry on the READ's notification
        meta = {"source_host": "127.0.0.1", "source_port": zport}
        res["second_wait_none"] = (
            recv.wait("0", "1", "k1", deadline=time.monotonic() + 0.5, metadata=meta) is None
        )
        _ask(out_q, in_q, "put_obj", "obj", {"a": [1, 2], "b": "x"})
        res["obj"] = recv.get("0", "1", "obj", metadata=meta)
        # a receiver with the wrong secret gets no answer and times out within its deadline
        bad = NixlConnector(_cfg(role="receiver", auth_secret="wrong"))
        _ask(out_q, in_q, "put", "k2", MiB, 3, 5.0)
        t0 = time.monotonic()
        res["bad_secret_none"] = bad.wait("0", "1", "k2", deadline=t0 + 1.0, metadata=meta) is None
        res["bad_secret_s"] = time.monotonic() - t0
        bad.close()
        res["sender_health"] = _ask(out_q, in_q, "health")[1]
        res["flush_pending"] = _ask(out_q, in_q, "flush", 0.2)[1:]
        b2 = recv.wait("0", "1", "k2", deadline=time.monotonic() + 10)
        res["flush_done"] = _ask(out_q, in_q, "flush", 10.0)[1:]
        res["k2_ok"] = b2 is not None and crc(b2.tensor.numpy()) == crc(pattern(MiB, 3))
        view = b2.adopt() if b2 is not None else None
        res["recv_health"] = recv.health()
        del view
        recv.close()
        recv.close()
        try:
            recv.wait("0", "1", "k2", deadline=time.monotonic() + 1)
            res["closed_raises"] = False
        except ConnectorClosedError:
            res["closed_raises"] = True
        res["recv_closed"] = recv.health()
        res["recv_threads"] = omnikv_threads()
        res["recv_tcp"] = tcp_sockets()
        _, sh, alive, res["sender_tcp"] = _ask(out_q, in_q, "close")
        res["sender_closed"] = sh
        res["sender_threads"] = alive
    return res


def _late_arrival(recv: Any, out_q: Any, in_q: Any) -> dict[str, Any]:
    """Hold the receiver's view of its READ at "running" past the wait's deadline, then let go."""
    from omnikv.connectors.nixl import agent as nixl_agent

    gate = threading.Event()
    real_state = nixl_agent.Transfer.state

    def held_state(self: Any) -> str:
        return real_state(self) if gate.is_set() else "PROC"

    res: dict[str, Any] = {}
    _, _, _, sent_crc = _ask(out_q, in_q, "put", "late", 8 * MiB, 9, 1.0)
    nixl_agent.Transfer.state = held_state  # type: ignore[method-assign]
    try:
        t0 = time.monotonic()
        res["first_none"] = recv.wait("0", "1", "late", deadline=t0 + 0.5) is None
        res["first_s"] = time.monotonic() - t0
        h = recv.health()
        res["parked"] = [h["quarantined"], h["pool_used"] >= 8 * MiB]
    finally:
        gate.set()
        nixl_agent.Transfer.state = real_state  # type: ignore[method-assign]
    end = time.monotonic() + 10
    while recv.health()["late_arrivals_held"] == 0 and time.monotonic() < end:
        time.sleep(0.02)
    t0 = time.monotonic()
    buf = recv.wait("0", "1", "late", deadline=t0 + 5)
    res["second_s"] = time.monotonic() - t0
    res["crc_ok"] = buf is not None and crc(buf.tensor.numpy()) == sent_crc
    if buf is not None:
        buf.release()
    h = recv.health()
    res["after"] = [h["late_arrivals"], h["quarantined"], h["late_arrivals_held"], h["pool_used"]]
    # the sender drops its entry when the READ's completion reaches it (its own thread): poll
    end = time.monotonic() + 5
    entries = _ask(out_q, in_q, "health")[1]["entries"]
    while entries > 1 and time.monotonic() < end:
        time.sleep(0.02)
        entries = _ask(out_q, in_q, "health")[1]["entries"]
    res["sender_entries"] = entries
    return res


def _abortable(recv: Any, out_q: Any, in_q: Any) -> dict[str, Any]:
    """A wait given an ``abort`` event (an admission or prefetch receive): a READ that started
    runs to the wait's deadline however long it is held at "running", and a set event ends a
    wait for a key that never comes within a poll."""
    from omnikv.connectors.nixl import agent as nixl_agent

    gate, abort = threading.Event(), threading.Event()
    reading, polled = threading.Event(), threading.Event()
    real_state = nixl_agent.Transfer.state
    polls_after_abort = [0]

    def held_state(self: Any) -> str:  # the READ stays "running" until ``gate``
        if gate.is_set():
            return real_state(self)
        reading.set()
        if abort.is_set():
            polls_after_abort[0] += 1
            if polls_after_abort[0] >= 100:
                polled.set()
        return "PROC"

    res: dict[str, Any] = {}
    before = recv.health()["quarantine_events"]
    _, _, _, sent_crc = _ask(out_q, in_q, "put", "slowread", 8 * MiB, 11, 1.0)
    got: dict[str, Any] = {}
    nixl_agent.Transfer.state = held_state  # type: ignore[method-assign]
    try:
        th = threading.Thread(
            target=lambda: got.update(
                buf=recv.wait("0", "1", "slowread", deadline=time.monotonic() + 10, abort=abort)
            )
        )
        th.start()
        # the condition under test: the wait's abort set while its READ runs, and the READ
        # watched a hundred times more after it, never cut
        assert reading.wait(20)
        abort.set()
        assert polled.wait(20)
    finally:
        gate.set()
        nixl_agent.Transfer.state = real_state  # type: ignore[method-assign]
    th.join(timeout=20)
    buf = got.get("buf")
    res["ok"] = buf is not None and crc(buf.tensor.numpy()) == sent_crc
    if buf is not None:
        buf.release()
    res["quarantined"] = recv.health()["quarantine_events"] - before
    stop = threading.Event()
    timer = threading.Timer(0.2, stop.set)
    timer.start()
    t0 = time.monotonic()
    res["aborted_none"] = recv.wait("0", "1", "never3", deadline=t0 + 10, abort=stop) is None
    res["aborted_s"] = time.monotonic() - t0
    timer.join()
    return res


def _orphaned_lease(recv: Any, out_q: Any, in_q: Any) -> dict[str, Any]:
    """The receiver's READ step vanishes after a grant (as if it died): the lease expires."""
    from omnikv.errors import ConnectorError

    res: dict[str, Any] = {}
    try:
        recv.set_grant_hook(None)
    except ConnectorError:
        res["grant_hook_refused"] = True  # a receiver grants nothing
    _, _, _, sent_crc = _ask(out_q, in_q, "put", "orphan", MiB, 4, 1.0)
    recv.set_read_hook(lambda: False)
    try:
        res["dead_none"] = recv.wait("0", "1", "orphan", deadline=time.monotonic() + 0.6) is None
    finally:
        recv.set_read_hook(None)
    res["leased"] = _ask(out_q, in_q, "health")[1]["leases"]
    t0 = time.monotonic()
    buf = recv.wait("0", "1", "orphan", deadline=t0 + 10)
    res["served_after_s"] = time.monotonic() - t0
    res["crc_ok"] = buf is not None and crc(buf.tensor.numpy()) == sent_crc
    if buf is not None:
        buf.release()
    res["lease_expired"] = _ask(out_q, in_q, "health")[1]["lease_expired"]
    return res


def scenario_failures() -> dict[str, Any]:
    _loopback_env()
    from omnikv.connectors.nixl.connector import NixlConnector
    from omnikv.errors import PeerGoneError, PoolExhaustedError

    (zport,) = free_ports(1)
    res: dict[str, Any] = {}
    proc, out_q, in_q = start_sender(
        peer_sender,
        _cfg(
            role="sender",
            zmq_port=zport,
            memory_pool_size=256 * MiB,
            buffer_ttl_seconds=60,
            # "big" must still fill the pool when "x" is put, however slowly a busy host gets
            # there (past the default 10 s grace a full pool frees it to make room)
            unclaimed_grace_seconds=600,
            peer_timeout_seconds=PEER_TIMEOUT_S,
        ),
    )
    with peers(proc):
        recv = NixlConnector(
            _cfg(
                role="receiver",
                memory_pool_size=136 * MiB,
                peer_timeout_seconds=PEER_TIMEOUT_S,
                sender_host="127.0.0.1",
                sender_zmq_port=zport,
            )
        )
        # key never put: None within the deadline, quickly for get
        t0 = time.monotonic()
        res["never_none"] = recv.wait("0", "1", "never", deadline=t0 + 0.8) is None
        res["never_s"] = time.monotonic() - t0
        t0 = time.monotonic()
        res["never_get_none"] = recv.get("0", "1", "never") is None
        res["never_get_s"] = time.monotonic() - t0
        # receiver pool exhausted: 140 MiB do not fit its 136 MiB; the lease is given back
        assert _ask(out_q, in_q, "put", "big", 140 * MiB, 1, 1.0)[1] is True
        try:
            recv.wait("0", "1", "big", deadline=time.monotonic() + 0.5)
            res["recv_pool"] = "no error"
        except PoolExhaustedError:
            res["recv_pool"] = "PoolExhaustedError"
        # sender pool exhausted: 120 more MiB do not fit 256; put_packed raises at its deadline
        _, res["sender_pool"], res["sender_pool_s"], _ = _ask(
            out_q, in_q, "put", "x", 120 * MiB, 1, 0.3
        )
        h = _ask(out_q, in_q, "health")[1]
        res["after_exhaustion"] = {k: h[k] for k in ("entries", "leases", "aborted")}
        # the receiver gives up while its READ runs: the slot is parked; the READ completes and
        # is handed to the next wait of the key (the sender consumed it on the notification)
        res["late"] = _late_arrival(recv, out_q, in_q)
        # a receiver that dies between grant and READ: the lease ends, the key is served again
        res["orphan"] = _orphaned_lease(recv, out_q, in_q)
        # an abortable wait: the READ it started is never cut short by its abort polls
        res["abortable"] = _abortable(recv, out_q, in_q)
        # sender killed mid-transfer: PeerGoneError within peer_timeout (+ a ping), nothing leaks
        assert _ask(out_q, in_q, "put", "doomed", 100 * MiB, 2, 1.0)[1] is True
        _ask(out_q, in_q, "kill_after_grant", 0.003)
        killed_t: dict[str, float] = {}
        t0 = time.monotonic()
        try:
            r = recv.wait("0", "1", "doomed", deadline=time.monotonic() + 20)
            res["killed"] = f"no error ({r})"
        except PeerGoneError as exc:
            res["killed"] = "PeerGoneError"
            res["killed_msg"] = str(exc)
        killed_t["detect"] = time.monotonic() - t0
        res["killed_detect_s"] = killed_t["detect"]
        proc.join(timeout=10)
        res["sender_exit"] = proc.exitcode
        end = time.monotonic() + 10
        while recv.health()["quarantined"] and time.monotonic() < end:
            time.sleep(0.05)
        h = recv.health()
        res["recv_after_kill"] = {k: h[k] for k in ("pool_used", "quarantined", "peer_gone")}
        recv.close()
        res["recv_closed"] = recv.health()
        res["threads"] = omnikv_threads()
        res["tcp"] = tcp_sockets()
    return res


NIXL = {"type": "NixlConnector", "backends": ["UCX"]}


def scenario_manager_224() -> dict[str, Any]:
    _loopback_env()
    # a sender packing 224 MiB on a loaded 2-core host can be silent past the default 5 s
    return scenario_224({**NIXL, "peer_timeout_seconds": 30})


def scenario_manager_tp(s: int, t: int) -> dict[str, Any]:
    _loopback_env()
    return scenario_tp(NIXL, s, t)


def scenario_bench_small(path: str) -> dict[str, Any]:
    _loopback_env()
    import json

    from omnikv.bench.nixl import main

    rc = main(["--size-mib", "8", "--repeat", "2", "--warmup", "1", "--json", path])
    with open(path, encoding="utf-8") as fh:
        return {"rc": rc, "report": json.load(fh), "threads": omnikv_threads()}


# -- tests (each scenario runs once per module; each test checks one behaviour) -----------------
@pytest.fixture(scope="module")
def roundtrip() -> dict[str, Any]:
    return run_scenario(__file__, "scenario_roundtrip", timeout=160)


@pytest.fixture(scope="module")
def failures() -> dict[str, Any]:
    return run_scenario(__file__, "scenario_failures", timeout=160)


@pytest.fixture(scope="module")
def manager_224() -> dict[str, Any]:
    return run_scenario(__file__, "scenario_manager_224", timeout=SCENARIO_224_S)


@pytest.fixture(scope="module")
def manager_tp() -> dict[str, Any]:
    return run_scenario(__file__, "scenario_manager_tp", {"s": 2, "t": 4}, timeout=420)


@pytest.mark.timing  # bounds of 1-3 s on one answer: run alone (the scenario runs there anyway)
@pytest.mark.timeout(180)
def test_a_miss_is_none_and_quick(roundtrip: dict[str, Any]) -> None:
    assert roundtrip["first_miss"] and roundtrip["miss"] and roundtrip["miss_s"] < 3


@pytest.mark.timeout(180)
def test_wait_is_woken_by_the_put_and_gets_the_bytes(roundtrip: dict[str, Any]) -> None:
    r = roundtrip
    assert (
        r["put_ok"]
        and r["wait_type"] == "ManagedBuffer"
        and r["size"] == 20 * MiB + 123
        and r["crc_ok"]
    )
    assert r["lag_s"] < 2.0, r["lag_s"]  # woken by the put, not by a poll period


@pytest.mark.timeout(180)
def test_payloads_are_consumed_once(roundtrip: dict[str, Any]) -> None:
    assert roundtrip["second_wait_none"]
    sh = roundtrip["sender_health"]
    assert sh["entries"] == 1 and sh["consumed"] == 2 and sh["leases"] == 0, sh


@pytest.mark.timeout(180)
def test_objects_travel_through_the_reference_put_and_get(roundtrip: dict[str, Any]) -> None:
    assert roundtrip["obj"] == [{"a": [1, 2], "b": "x"}, roundtrip["obj"][1]]


@pytest.mark.timing  # a bound of 0.6 s past the deadline: run alone, not beside the lanes
@pytest.mark.timeout(180)
def test_a_wrong_secret_gets_nothing_within_the_deadline(roundtrip: dict[str, Any]) -> None:
    assert roundtrip["bad_secret_none"] and roundtrip["bad_secret_s"] < 1.6
    assert roundtrip["k2_ok"]  # and the right receiver still gets the key afterwards


@pytest.mark.timing  # bounds of 1-3 s on one answer: run alone (the scenario runs there anyway)
@pytest.mark.timeout(180)
def test_flush_waits_for_consumption_boundedly(roundtrip: dict[str, Any]) -> None:
    pending, done = roundtrip["flush_pending"], roundtrip["flush_done"]
    assert pending[0] == ["k2@0_1"] and 0.15 < pending[1] < 1.0, pending
    assert done[0] == [] and done[1] < 5.0, done


@pytest.mark.timeout(180)
def test_metadata_is_loaded_once_per_sender(roundtrip: dict[str, Any]) -> None:
    h = roundtrip["recv_health"]
    assert h["gets"] == 3 and h["quarantined"] == 0 and h["remote_agents"] == 1, h


@pytest.mark.timeout(180)
def test_receiver_close_leaves_nothing_registered_and_no_thread(roundtrip: dict[str, Any]) -> None:
    r = roundtrip
    assert r["closed_raises"] and r["recv_threads"] == [] and r["recv_tcp"] == []
    assert r["recv_closed"]["status"] == "closed" and r["recv_closed"]["registered_regions"] == 0


@pytest.mark.timeout(180)
def test_sender_close_leaves_nothing_registered_and_no_thread(roundtrip: dict[str, Any]) -> None:
    sc = roundtrip["sender_closed"]
    assert sc["status"] == "closed" and sc["registered_regions"] == 0 and sc["pool_size"] == 0
    assert roundtrip["sender_threads"] == [] and roundtrip["sender_tcp"] == []


@pytest.mark.timing  # bounds of 0.5-0.7 s on a miss: run alone (the scenario runs there anyway)
@pytest.mark.timeout(180)
def test_a_key_never_put_is_a_bounded_miss(failures: dict[str, Any]) -> None:
    assert failures["never_none"] and 0.7 < failures["never_s"] < 1.5, failures["never_s"]
    assert failures["never_get_none"] and failures["never_get_s"] < 1.0


@pytest.mark.timeout(180)
def test_receiver_pool_exhausted_gives_the_lease_back(failures: dict[str, Any]) -> None:
    assert failures["recv_pool"] == "PoolExhaustedError"
    assert failures["after_exhaustion"] == {"entries": 1, "leases": 0, "aborted": 1}


@pytest.mark.timing  # a put deadline held to 1.7 s: run alone (the scenario runs there anyway)
@pytest.mark.timeout(180)
def test_sender_pool_exhausted_raises_at_the_put_deadline(failures: dict[str, Any]) -> None:
    assert failures["sender_pool"] == "PoolExhaustedError"
    assert 0.25 < failures["sender_pool_s"] < 2, failures["sender_pool_s"]


@pytest.mark.timing  # bounds of 1 s on a read's give-up and hand-over: run alone
@pytest.mark.timeout(180)
def test_a_read_given_up_is_parked_then_handed_over(failures: dict[str, Any]) -> None:
    late = failures["late"]
    assert late["first_none"] and late["first_s"] < 1.0 and late["parked"] == [1, True], late
    assert late["crc_ok"] and late["second_s"] < 1.0 and late["after"] == [1, 0, 0, 0], late
    assert late["sender_entries"] == 1  # only "big" (aborted earlier) is left at the sender


@pytest.mark.timeout(180)
def test_a_lease_whose_reader_vanished_expires(failures: dict[str, Any]) -> None:
    o = failures["orphan"]
    assert o["dead_none"] and o["leased"] >= 1 and o.get("grant_hook_refused"), o
    # lease = the claim's budget (0.6 s) + the sender's peer timeout (1 s), then served again
    assert o["crc_ok"] and 0.3 < o["served_after_s"] < 5.0 and o["lease_expired"] >= 1, o


@pytest.mark.timeout(180)
def test_an_abortable_wait_never_cuts_a_read_that_started(failures: dict[str, Any]) -> None:
    a = failures["abortable"]
    assert a["ok"] is True and a["quarantined"] == 0, a
    assert a["aborted_none"] is True and a["aborted_s"] < 2.0, a


@pytest.mark.timeout(180)
def test_sender_killed_mid_read_is_peer_gone_and_leaks_nothing(failures: dict[str, Any]) -> None:
    r = failures
    # silent for the peer timeout, plus one ping round and the scheduling of a loaded host
    assert r["killed"] == "PeerGoneError" and r["killed_detect_s"] < 2 * PEER_TIMEOUT_S + 2.0, r
    assert r["sender_exit"] == -signal.SIGKILL
    after = r["recv_after_kill"]
    assert after["pool_used"] == 0 and after["quarantined"] == 0 and after["peer_gone"] >= 1
    assert r["recv_closed"]["registered_regions"] == 0
    assert r["threads"] == [] and r["tcp"] == [], (r["threads"], r["tcp"])


@pytest.mark.timeout(SCENARIO_224_S + 60)
def test_manager_sends_the_224mib_kv(manager_224: dict[str, Any]) -> None:
    check_sent_224(manager_224["sent"])


@pytest.mark.timeout(SCENARIO_224_S + 60)
def test_manager_receives_every_tensor_intact(manager_224: dict[str, Any]) -> None:
    check_received(manager_224["recv"], QWEN, QWEN["heads"])


@pytest.mark.timeout(SCENARIO_224_S + 60)
def test_manager_kv_is_consumed_once(manager_224: dict[str, Any]) -> None:
    check_consumed_once(manager_224["recv"])


@pytest.mark.timeout(SCENARIO_224_S + 60)
def test_managers_leave_nothing_after_close(manager_224: dict[str, Any]) -> None:
    check_receiver_closed(manager_224["recv"])
    check_closed_sender(manager_224["closed"])


@pytest.mark.timeout(440)
def test_tp2_senders_slice_heads_for_their_tp4_receivers(manager_tp: dict[str, Any]) -> None:
    assert sorted(manager_tp["sent"]) == ["0", "1"]
    for rank, body in manager_tp["sent"].items():
        # published; a fast receiver may have accepted it already
        assert body["status"] in ("sent", "delivered"), body
        first = 2 * int(rank)  # sender rank r slices its heads for receivers 2r and 2r + 1
        assert body["keys"] == [f"req_0_0_{rank}_{first}", f"req_0_0_{rank}_{first + 1}"]


@pytest.mark.timeout(440)
def test_every_tp4_receiver_gets_its_heads_intact(manager_tp: dict[str, Any]) -> None:
    assert sorted(manager_tp["received"]) == ["0", "1", "2", "3"]
    for body in manager_tp["received"].values():
        check_received(body, SMALL, SMALL["heads"] // 4)
        check_consumed_once(body)
        check_receiver_closed(body)


@pytest.mark.timeout(440)
def test_tp2_senders_leave_nothing_after_close(manager_tp: dict[str, Any]) -> None:
    for body in manager_tp["closed"].values():
        check_closed_sender(body)


@pytest.mark.timeout(180)
def test_bench_nixl_small_run_verifies(tmp_path: Any) -> None:
    r = run_scenario(__file__, "scenario_bench_small", {"path": str(tmp_path / "n.json")}, 80)
    rep = r["report"]
    assert r["rc"] == 0 and rep["verified"] and rep["failures"] == [], rep
    assert rep["samples_checked"] == 6 and rep["samples_decoded"] == 4
    assert set(rep["results"]) == {"raw", "wait", "e2e", "writer"}
    assert all(len(v["samples_s"]) == 2 for v in rep["results"].values())
    assert rep["ratios"]["nixl"] > 0 and r["threads"] == []
