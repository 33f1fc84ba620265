"""MooncakeTransferEngineConnector against real Transfer Engine peers in separate processes.

Every networked scenario runs once per module (module-scoped fixtures) as a ``scenario_*``
function in an isolated child (``unshare -n`` where possible, see ``support.mooncake_peers``); the
sender is a spawned peer driven over a queue. Each test asserts one behaviour of a scenario.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import msgpack
import numpy as np
import pytest

from support.mooncake_peers import (
    crc,
    free_ports,
    mooncake_skip_reason,
    omnikv_threads,
    pattern,
    peers,
    queue,
    run_scenario,
    tcp_sockets,
)
from support.pull_engine import ask, long_poll, serve_sender, start_sender

pytestmark = [
    pytest.mark.engine,
    pytest.mark.slow,
    pytest.mark.skipif(mooncake_skip_reason() is not None, reason=str(mooncake_skip_reason())),
]

MiB = 1 << 20
SECRET = "s3cret"


# -- the sender peer ----------------------------------------------------------------------------
def peer_sender(cfg: dict[str, Any], out_q: Any, in_q: Any, hold_q: Any) -> None:
    from omnikv.connectors.mooncake_te import MooncakeTransferEngineConnector

    conn = MooncakeTransferEngineConnector(cfg)

    def held_write() -> None:  # signals, then waits to be let go: a pull held mid-transfer
        out_q.put(("writing",))
        hold_q.get()

    def hold() -> tuple[Any, ...]:
        conn.set_write_hook(held_write)
        return ("held",)

    serve_sender(conn, out_q, in_q, {"hold": hold})


def _sender(cfg: dict[str, Any]) -> tuple[Any, Any, Any, Any]:
    hold_q = queue()
    return (*start_sender(peer_sender, cfg, hold_q), hold_q)


def _base_cfg(**extra: Any) -> dict[str, Any]:
    cfg = {"host": "127.0.0.1", "protocol": "tcp", "memory_pool_size": 64 * MiB}
    cfg.update(extra)
    return cfg


# -- scenario: round trip, auth, close ------------------------------------------------------------
def scenario_roundtrip() -> dict[str, Any]:
    from omnikv.connectors.mooncake_te import MooncakeTransferEngineConnector
    from omnikv.errors import ConnectorClosedError

    (zport,) = free_ports(1)
    res: dict[str, Any] = {}
    proc, out_q, in_q, _ = _sender(
        _base_cfg(role="sender", zmq_port=zport, auth_secret=SECRET, buffer_ttl_seconds=60)
    )
    with peers(proc):
        recv = MooncakeTransferEngineConnector(
            _base_cfg(role="receiver", auth_secret=SECRET, peer_timeout_seconds=2)
        )
        recv.update_sender_info("127.0.0.1", zport)
        # The first get opens the channel (hello, the sender's metadata): under a whole `make
        # test` that alone can take seconds. A later miss is one question the sender answers.
        res["first_miss"] = recv.get("0", "1", "absent") is None
        t0 = time.monotonic()
        res["miss"] = recv.get("0", "1", "absent2") is None
        res["miss_s"] = time.monotonic() - t0
        long_poll(recv, in_q, out_q, res)
        meta = {"source_host": "127.0.0.1", "source_port": zport}
        res["second_get_none"] = recv.get("0", "1", "k1", metadata=meta) is None
        ask(in_q, out_q, "put_obj", "obj", {"a": [1, 2], "b": "x"})
        res["obj"] = recv.get("0", "1", "obj", metadata=meta)[0]
        bad = MooncakeTransferEngineConnector(_base_cfg(role="receiver", auth_secret="wrong"))
        ask(in_q, out_q, "put", "k2", MiB, 3, 5.0)
        t0 = time.monotonic()
        res["bad_secret_none"] = bad.wait("0", "1", "k2", deadline=t0 + 1.0, metadata=meta) is None
        res["bad_secret_s"] = time.monotonic() - t0
        bad.close()
        h = ask(in_q, out_q, "health")[1]
        res["rejected"], res["still_pending"] = h["rejected_messages"], h["entries"]
        r2 = recv.wait("0", "1", "k2", deadline=time.monotonic() + 10)
        res["k2_ok"] = r2 is not None and crc(r2.tensor.numpy()) == crc(pattern(MiB, 3))
        view = r2.adopt() if r2 is not None else None
        res["recv_health"] = recv.health()
        del view
        recv.close()
        recv.close()
        res["closed_raises"] = False
        try:
            recv.wait("0", "1", "k2", deadline=time.monotonic() + 1)
        except ConnectorClosedError:
            res["closed_raises"] = True
        res["recv_threads"] = omnikv_threads()
        res["recv_tcp"] = tcp_sockets()
        _, sh, res["sender_threads"], res["sender_tcp"] = ask(in_q, out_q, "close")
        res["sender_closed"], res["sender_pool"] = sh["status"], sh["pool_size"]
    return res


@pytest.fixture(scope="module")
def roundtrip() -> dict[str, Any]:
    return run_scenario(__file__, "scenario_roundtrip", timeout=100)


def test_a_miss_is_none_and_quick(roundtrip: dict[str, Any]) -> None:
    assert roundtrip["first_miss"] and roundtrip["miss"] and roundtrip["miss_s"] < 3


def test_wait_returns_the_payload_as_a_managed_buffer(roundtrip: dict[str, Any]) -> None:
    assert roundtrip["put_ok"] and roundtrip["wait_type"] == "ManagedBuffer"
    assert roundtrip["size"] == 20 * MiB + 123 and roundtrip["crc_ok"]


def test_a_waiting_receiver_is_woken_by_the_put(roundtrip: dict[str, Any]) -> None:
    assert roundtrip["lag_s"] < 2.0, roundtrip["lag_s"]  # not by a poll period


def test_a_payload_is_consumed_once(roundtrip: dict[str, Any]) -> None:
    assert roundtrip["second_get_none"]


def test_objects_come_back_decoded_from_get(roundtrip: dict[str, Any]) -> None:
    assert roundtrip["obj"] == {"a": [1, 2], "b": "x"}


def test_a_wrong_secret_is_refused_within_the_deadline(roundtrip: dict[str, Any]) -> None:
    assert roundtrip["bad_secret_none"] and roundtrip["bad_secret_s"] < 1.6
    assert roundtrip["rejected"] >= 1 and roundtrip["still_pending"] == 1


def test_the_right_receiver_is_served_after_a_refusal(roundtrip: dict[str, Any]) -> None:
    assert roundtrip["k2_ok"]
    h = roundtrip["recv_health"]
    assert h["gets"] == 3 and h["quarantined"] == 0


def test_a_closed_receiver_raises(roundtrip: dict[str, Any]) -> None:
    assert roundtrip["closed_raises"]


def test_close_leaves_no_thread_or_socket(roundtrip: dict[str, Any]) -> None:
    assert roundtrip["recv_threads"] == [] and roundtrip["sender_threads"] == []
    assert roundtrip["recv_tcp"] == [] and roundtrip["sender_tcp"] == []
    assert roundtrip["sender_closed"] == "closed" and roundtrip["sender_pool"] == 0


# -- scenario: failures ---------------------------------------------------------------------------
def _pool_and_ttl(recv: Any, in_q: Any, out_q: Any, res: dict[str, Any]) -> dict[str, Any]:
    from omnikv.errors import PoolExhaustedError

    assert ask(in_q, out_q, "put", "k12", 12 * MiB, 1, 1.0)[1] is True
    t0 = time.monotonic()
    res["sender_pool"] = ask(in_q, out_q, "put", "x8", 8 * MiB, 1, 0.3)[1]
    res["sender_pool_s"] = time.monotonic() - t0
    try:
        recv.wait("0", "1", "k12", deadline=time.monotonic() + 0.5)
        res["recv_pool"] = "no error"
    except PoolExhaustedError:
        res["recv_pool"] = "PoolExhaustedError"
    end = time.monotonic() + 10
    h = ask(in_q, out_q, "health")[1]
    while h["entries"] and time.monotonic() < end:
        time.sleep(0.1)  # polls the sender's TTL sweep (1 s); synchronises nothing
        h = ask(in_q, out_q, "health")[1]
    res["ttl_reaped"] = h["ttl_reaped"]
    return h


def _late_arrival(recv: Any, in_q: Any, out_q: Any, hold_q: Any, res: dict[str, Any]) -> None:
    ttl_before = ask(in_q, out_q, "health")[1]["ttl_reaped"]
    assert ask(in_q, out_q, "hold")[0] == "held"
    assert ask(in_q, out_q, "put", "late", 2 * MiB, 5, 1.0)[1] is True
    t0 = time.monotonic()
    res["late_first_none"] = recv.wait("0", "1", "late", deadline=t0 + 0.6) is None
    res["late_first_s"] = time.monotonic() - t0
    assert out_q.get(timeout=20)[0] == "writing"
    t_writing = time.monotonic()
    res["quarantined_during"] = recv.health()["quarantined"]
    # keep the write in flight past the 1 s TTL and its 0.5 s sweep: the reaper must skip it
    time.sleep(max(0.0, t_writing + 2.0 - time.monotonic()))  # lets the TTL elapse
    res["ttl_reaped_inflight"] = ask(in_q, out_q, "health")[1]["ttl_reaped"] - ttl_before
    hold_q.put("go")
    r = recv.wait("0", "1", "late", deadline=time.monotonic() + 10)
    res["late_ok"] = r is not None and crc(r.tensor.numpy()) == crc(pattern(2 * MiB, 5))
    if r is not None:
        r.release()


def _abortable(recv: Any, in_q: Any, out_q: Any, hold_q: Any, res: dict[str, Any]) -> None:
    """A wait given an ``abort`` event (an admission or prefetch receive): a pull that started
    runs to the wait's deadline however long it is held, and a set event ends a wait for a key
    that never comes within a poll."""
    before = recv.health()["quarantine_events"]
    assert ask(in_q, out_q, "put", "slow", 2 * MiB, 7, 1.0)[1] is True
    abort, got = threading.Event(), {}

    def wait() -> None:
        got["buf"] = recv.wait("0", "1", "slow", deadline=time.monotonic() + 10, abort=abort)

    pinged, pings = threading.Event(), [0]

    def count_pings(frames: list[bytes]) -> None:  # the receive's pings after its abort
        if abort.is_set() and msgpack.unpackb(frames[0], raw=False).get("op") == "ping":
            pings[0] += 1
            if pings[0] >= 3:
                pinged.set()

    recv.control_client.observe_sends(count_pings)
    th = threading.Thread(target=wait)
    th.start()
    assert out_q.get(timeout=20)[0] == "writing"
    # the condition under test: the abort set while the write runs, and the receive still
    # waiting for it three pings later
    abort.set()
    assert pinged.wait(20)
    recv.control_client.observe_sends(None)
    hold_q.put("go")
    th.join(timeout=20)
    buf = got.get("buf")
    res["abortable_ok"] = buf is not None and crc(buf.tensor.numpy()) == crc(pattern(2 * MiB, 7))
    if buf is not None:
        buf.release()
    res["abortable_quarantined"] = recv.health()["quarantine_events"] - before
    stop = threading.Event()
    timer = threading.Timer(0.2, stop.set)
    timer.start()
    t0 = time.monotonic()
    res["aborted_none"] = recv.wait("0", "1", "never2", deadline=t0 + 10, abort=stop) is None
    res["aborted_s"] = time.monotonic() - t0
    timer.join()


def _sender_killed(recv: Any, proc: Any, in_q: Any, out_q: Any, res: dict[str, Any]) -> None:
    from omnikv.errors import PeerGoneError

    assert ask(in_q, out_q, "put", "doomed", 4 * MiB, 6, 1.0)[1] is True
    killed: dict[str, float] = {}

    def killer() -> None:
        assert out_q.get(timeout=20)[0] == "writing"
        proc.kill()
        killed["t"] = time.monotonic()

    th = threading.Thread(target=killer)
    th.start()
    try:
        recv.wait("0", "1", "doomed", deadline=time.monotonic() + 20)
        res["killed"] = "no error"
    except PeerGoneError:
        res["killed"] = "PeerGoneError"
    th.join(timeout=20)
    res["killed_detect_s"] = time.monotonic() - killed["t"]
    res["quarantined_after_kill"] = recv.health()["quarantined"]
    end = time.monotonic() + 10
    while recv.health()["quarantined"] and time.monotonic() < end:
        time.sleep(0.1)  # polls the reaper's outcome; synchronises nothing
    h = recv.health()
    res["quarantine_freed"], res["recv_pool_used"] = h["quarantine_freed"], h["pool_used"]


def scenario_failures() -> dict[str, Any]:
    from omnikv.connectors.mooncake_te import MooncakeTransferEngineConnector

    (zport,) = free_ports(1)
    res: dict[str, Any] = {}
    proc, out_q, in_q, hold_q = _sender(
        _base_cfg(role="sender", zmq_port=zport, memory_pool_size=16 * MiB, buffer_ttl_seconds=1)
    )
    with peers(proc):
        recv = MooncakeTransferEngineConnector(
            _base_cfg(
                role="receiver",
                memory_pool_size=8 * MiB,
                peer_timeout_seconds=1.0,
                quarantine_dead_seconds=1.0,
                sender_host="127.0.0.1",
                sender_zmq_port=zport,
            )
        )
        t0 = time.monotonic()
        res["never_none"] = recv.wait("0", "1", "never", deadline=t0 + 0.8) is None
        res["never_s"] = time.monotonic() - t0
        _pool_and_ttl(recv, in_q, out_q, res)
        _late_arrival(recv, in_q, out_q, hold_q, res)
        _abortable(recv, in_q, out_q, hold_q, res)
        _sender_killed(recv, proc, in_q, out_q, res)
        recv.close()
        res["threads"] = omnikv_threads()
    return res


@pytest.fixture(scope="module")
def failures() -> dict[str, Any]:
    return run_scenario(__file__, "scenario_failures", timeout=100)


def test_a_key_never_put_is_none_at_the_deadline(failures: dict[str, Any]) -> None:
    assert failures["never_none"] and 0.7 < failures["never_s"] < 1.5


def test_a_full_sender_pool_raises_at_the_put_deadline(failures: dict[str, Any]) -> None:
    assert failures["sender_pool"] == "PoolExhaustedError"
    assert 0.25 < failures["sender_pool_s"] < 2


def test_a_full_receiver_pool_raises(failures: dict[str, Any]) -> None:
    assert failures["recv_pool"] == "PoolExhaustedError"


def test_unconsumed_entries_expire_by_ttl(failures: dict[str, Any]) -> None:
    assert failures["ttl_reaped"] >= 1


def test_a_receiver_that_gives_up_mid_write_quarantines_its_slot(failures: dict[str, Any]) -> None:
    assert failures["late_first_none"] and failures["late_first_s"] < 1.2
    assert failures["quarantined_during"] == 1


def test_the_ttl_never_frees_an_entry_being_written(failures: dict[str, Any]) -> None:
    assert failures["ttl_reaped_inflight"] == 0


def test_a_transfer_that_finishes_late_is_handed_to_the_next_wait(
    failures: dict[str, Any],
) -> None:
    assert failures["late_ok"]


def test_an_abortable_wait_never_cuts_a_pull_that_started(failures: dict[str, Any]) -> None:
    assert failures["abortable_ok"] is True
    assert failures["abortable_quarantined"] == 0


def test_an_abortable_wait_ends_soon_after_its_abort(failures: dict[str, Any]) -> None:
    assert failures["aborted_none"] is True
    assert failures["aborted_s"] < 2.0, failures["aborted_s"]


def test_a_killed_sender_is_peer_gone_quickly(failures: dict[str, Any]) -> None:
    assert failures["killed"] == "PeerGoneError" and failures["killed_detect_s"] < 3.0


def test_the_killed_transfer_slot_is_freed_later(failures: dict[str, Any]) -> None:
    assert failures["quarantined_after_kill"] == 1 and failures["quarantine_freed"] >= 1
    assert failures["recv_pool_used"] == 0 and failures["threads"] == []


# -- scenario: replay attack on the control port (issue 13 item 1) --------------------------------
def _tap_client(recv: Any) -> list[list[bytes]]:
    """Record every message the receiver's control client sends (its wire frames)."""
    wire: list[list[bytes]] = []
    recv.control_client.observe_sends(lambda frames: wire.append(list(frames)))
    return wire


def _replayed_answers(port: int, messages: list[list[bytes]]) -> list[bool]:
    """Re-send each message verbatim on a fresh connection; True where anything answered."""
    import socket

    from omnikv.connectors.pull.client import Link

    answers = []
    for frames in messages:
        link = Link(socket.create_connection(("127.0.0.1", port), timeout=5), 4096)
        answers.append(link.send(frames) and link.recv(1.0) is not None)
        link.close()
    return answers


def scenario_replay() -> dict[str, Any]:
    from omnikv.connectors.mooncake_te import MooncakeTransferEngineConnector

    (zport,) = free_ports(1)
    res: dict[str, Any] = {}
    proc, out_q, in_q, _ = _sender(_base_cfg(role="sender", zmq_port=zport, auth_secret=SECRET))
    with peers(proc):
        recv = MooncakeTransferEngineConnector(
            _base_cfg(
                role="receiver",
                auth_secret=SECRET,
                sender_host="127.0.0.1",
                sender_zmq_port=zport,
                peer_timeout_seconds=1.0,
            )
        )
        wire = _tap_client(recv)
        _, _, _, sent_crc = ask(in_q, out_q, "put", "k", 4 * MiB, 1, 5.0)
        held = recv.wait("0", "1", "k", deadline=time.monotonic() + 20)
        assert held is not None and crc(held.tensor.numpy()) == sent_crc
        chan = recv.control_client.channel(("127.0.0.1", zport), 5.0)
        assert chan is not None and chan.request({"op": "ping"}, 5.0) is not None
        wanted = ("query", "pull", "ping")
        captured = {_control_op(m): m for m in wire if _control_op(m) in wanted}
        # the same key is published again (other bytes): a served replay of the captured pull
        # would overwrite the slot the application still holds
        ask(in_q, out_q, "put", "k", 4 * MiB, 2, 5.0)
        before = ask(in_q, out_q, "health")[1]
        res["captured"] = sorted(captured)
        res["answers"] = _replayed_answers(
            zport, [captured[op] for op in ("query", "pull", "ping")]
        )
        after = ask(in_q, out_q, "health")[1]
        res["held_intact"] = crc(held.tensor.numpy()) == sent_crc
        res["pulls_served"] = after["pulls_served"] - before["pulls_served"]
        res["entries"] = after["entries"]
        res["rejected"] = after["rejected_messages"] - before["rejected_messages"]
        # an authenticated receiver cannot direct a write outside the pool it declared
        bad_pull = {
            "op": "pull",
            "key": "k@0_1",
            "dst": 1,
            "cap": 4 * MiB,
            "xid": "x",
            "budget_ms": 5000,
        }
        reply = chan.request(bad_pull, 5.0)
        res["outside_pool"] = None if reply is None else reply.get("reason")
        res["entries_after_outside"] = ask(in_q, out_q, "health")[1]["entries"]
        held.release()
        got = recv.wait("0", "1", "k", deadline=time.monotonic() + 20)
        res["genuine_ok"] = got is not None and crc(got.tensor.numpy()) == crc(pattern(4 * MiB, 2))
        recv.close()
        ask(in_q, out_q, "close")
    return res


def _control_op(frames: list[bytes]) -> str:
    import msgpack

    return str(msgpack.unpackb(frames[0])["op"])


@pytest.fixture(scope="module")
def replay() -> dict[str, Any]:
    return run_scenario(__file__, "scenario_replay", timeout=100)


def test_signed_query_pull_and_ping_were_captured(replay: dict[str, Any]) -> None:
    assert replay["captured"] == ["ping", "pull", "query"]


def test_replayed_messages_get_no_answer(replay: dict[str, Any]) -> None:
    assert replay["answers"] == [False, False, False]


def test_a_replayed_pull_changes_no_memory(replay: dict[str, Any]) -> None:
    assert replay["held_intact"] and replay["pulls_served"] == 0 and replay["entries"] == 1


def test_replays_are_counted_as_rejected(replay: dict[str, Any]) -> None:
    assert replay["rejected"] == 3


def test_a_pull_outside_the_declared_pool_is_refused(replay: dict[str, Any]) -> None:
    assert replay["outside_pool"] == "outside_pool" and replay["entries_after_outside"] == 1


def test_the_genuine_receiver_is_still_served(replay: dict[str, Any]) -> None:
    assert replay["genuine_ok"]


# -- scenario: construction ---------------------------------------------------------------------
def _build(cfg: dict[str, Any]) -> str:
    from omnikv.connectors.mooncake_te import MooncakeTransferEngineConnector

    try:
        MooncakeTransferEngineConnector(cfg).close()
    except Exception as exc:
        return type(exc).__name__
    return "ok"


def scenario_construction() -> dict[str, Any]:
    import socket

    from omnikv.connectors.mooncake_te import MooncakeTransferEngineConnector

    (zport,) = free_ports(1)
    res: dict[str, Any] = {"sockets_before": len(tcp_sockets())}
    t0 = time.monotonic()
    res["workers0"] = _build(_base_cfg(role="sender", zmq_port=zport, workers=0))
    res["workers0_s"] = time.monotonic() - t0
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", zport))
    squatter.listen()
    t0 = time.monotonic()
    res["port_taken"] = _build(_base_cfg(role="sender", zmq_port=zport))
    res["port_taken_s"] = time.monotonic() - t0
    squatter.close()
    res["empty_secret"] = _build(_base_cfg(role="sender", zmq_port=zport, auth_secret=""))
    res["threads_after_failures"] = omnikv_threads()
    res["sockets_after_failures"] = len(tcp_sockets())
    auto = MooncakeTransferEngineConnector(_base_cfg(role="sender", zmq_port=zport, host="auto"))
    h = auto.health()
    res["auto_host"], res["auto_session"] = h["host"], h["session_id"]
    auto.close()
    return res


@pytest.fixture(scope="module")
def construction() -> dict[str, Any]:
    return run_scenario(__file__, "scenario_construction", timeout=60)


def test_workers_zero_is_a_config_error_not_a_hang(construction: dict[str, Any]) -> None:
    assert construction["workers0"] == "ConfigError" and construction["workers0_s"] < 5


def test_a_taken_port_fails_the_constructor_promptly(construction: dict[str, Any]) -> None:
    assert construction["port_taken"] == "ConnectorUnavailableError"
    assert construction["port_taken_s"] < 10


def test_an_empty_secret_is_a_config_error(construction: dict[str, Any]) -> None:
    assert construction["empty_secret"] == "ConfigError"


def test_failed_constructors_leave_no_thread_or_socket(construction: dict[str, Any]) -> None:
    assert construction["threads_after_failures"] == []
    assert construction["sockets_after_failures"] == construction["sockets_before"]


def test_host_auto_advertises_the_detected_address(construction: dict[str, Any]) -> None:
    from omnikv.connectors.pull.host import detect_local_address

    expected = "127.0.0.1" if construction["_isolated"] else detect_local_address()
    assert construction["auto_host"] == expected
    assert construction["auto_session"].startswith(f"{expected}:")


def test_pattern_is_positional() -> None:
    a = pattern(3 * MiB, 1)
    assert a.size == 3 * MiB and a[MiB] == 1 and a[2 * MiB] == 2
    assert crc(a) != crc(pattern(3 * MiB, 2))
    assert np.isfinite(float(a.mean()))
