"""MooncakeTransferEngineConnector against real Transfer Engine peers in separate processes.

Every networked case runs as a ``scenario_*`` function in an isolated child (``unshare -n``
where possible, see ``mooncake_helpers``); the sender is a spawned peer driven over a queue.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any

import numpy as np
import pytest

from mooncake_helpers import (
    crc,
    free_ports,
    mooncake_skip_reason,
    omnikv_threads,
    pattern,
    peers,
    queue,
    run_scenario,
    spawn,
    tcp_sockets,
)

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(mooncake_skip_reason() is not None, reason=str(mooncake_skip_reason())),
]

MiB = 1 << 20


# -- the sender peer ----------------------------------------------------------------------------
class _HeldEngine:
    """Wraps the engine so a test can hold a pull mid-transfer (signals, then waits)."""

    def __init__(self, engine: Any, signal_q: Any, release_q: Any) -> None:
        self._engine = engine
        self._signal_q = signal_q
        self._release_q = release_q

    def transfer_sync_write(self, *args: Any) -> int:
        self._signal_q.put(("writing",))
        self._release_q.get()
        return int(self._engine.transfer_sync_write(*args))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def peer_sender(cfg: dict[str, Any], out_q: Any, in_q: Any, hold_q: Any) -> None:
    from omnikv.connectors.mooncake_te import MooncakeTransferEngineConnector

    conn = MooncakeTransferEngineConnector(cfg)
    out_q.put(("ready", conn.health()["session_id"]))
    while True:
        cmd = in_q.get()
        op = cmd[0]
        try:
            if op == "put":
                _, key, nbytes, seed, deadline_s = cmd
                data = pattern(nbytes, seed)

                def write(dst: Any, data: np.ndarray = data) -> None:
                    dst.numpy()[:] = data

                ok, size, _meta = conn.put_packed(
                    "0", "1", key, nbytes, write, deadline=time.monotonic() + deadline_s
                )
                out_q.put(("put", ok, size, crc(data)))
            elif op == "put_obj":
                out_q.put(("put", *conn.put("0", "1", cmd[1], cmd[2])[:2], 0))
            elif op == "hold":
                conn._engine = _HeldEngine(conn._engine, out_q, hold_q)
                out_q.put(("held",))
            elif op == "health":
                out_q.put(("health", conn.health()))
            elif op == "close":
                conn.close()
                conn.close()
                out_q.put(("closed", conn.health(), omnikv_threads(), tcp_sockets()))
                return
        except Exception as exc:
            out_q.put(("error", type(exc).__name__, str(exc)))


def _sender(cfg: dict[str, Any]) -> tuple[Any, Any, Any, Any]:
    out_q, in_q, hold_q = queue(), queue(), queue()
    proc = spawn(peer_sender, cfg, out_q, in_q, hold_q)
    msg = out_q.get(timeout=30)
    assert msg[0] == "ready", msg
    return proc, out_q, in_q, hold_q


def _base_cfg(**extra: Any) -> dict[str, Any]:
    cfg = {"host": "127.0.0.1", "protocol": "tcp", "memory_pool_size": 64 * MiB}
    cfg.update(extra)
    return cfg


# -- scenarios (run isolated) -------------------------------------------------------------------
def scenario_roundtrip() -> dict[str, Any]:
    from omnikv.connectors.base import ManagedBuffer
    from omnikv.connectors.mooncake_te import MooncakeTransferEngineConnector
    from omnikv.errors import ConnectorClosedError

    (zport,) = free_ports(1)
    res: dict[str, Any] = {}
    proc, out_q, in_q, _ = _sender(
        _base_cfg(role="sender", zmq_port=zport, auth_secret="s3cret", buffer_ttl_seconds=60)
    )
    with peers(proc):
        recv = MooncakeTransferEngineConnector(
            _base_cfg(role="receiver", auth_secret="s3cret", peer_timeout_seconds=2)
        )
        recv.update_sender_info("127.0.0.1", zport)
        # a miss is None and quick
        t0 = time.monotonic()
        res["miss"] = recv.get("0", "1", "absent") is None
        res["miss_s"] = time.monotonic() - t0
        # long-poll: wait first, put while it waits
        got: dict[str, Any] = {}

        def waiter() -> None:
            got["r"] = recv.wait("0", "1", "k1", deadline=time.monotonic() + 20)
            got["t"] = time.monotonic()

        th = threading.Thread(target=waiter)
        th.start()
        in_q.put(("put", "k1", 20 * MiB + 123, 7, 5.0))
        _, ok, size, sent_crc = out_q.get(timeout=20)
        t_put = time.monotonic()
        th.join(timeout=25)
        r = got["r"]
        res["put_ok"] = ok and size == 20 * MiB + 123
        res["managed"] = isinstance(r[0], ManagedBuffer)
        res["size"] = r[1]
        res["crc_ok"] = crc(r[0].tensor.numpy()) == sent_crc
        res["lag_s"] = got["t"] - t_put
        r[0].release()
        # consume-once; per-call metadata instead of the default endpoint
        meta = {"source_host": "127.0.0.1", "source_port": zport}
        res["second_get_none"] = recv.get("0", "1", "k1", metadata=meta) is None
        in_q.put(("put_obj", "obj", {"a": [1, 2], "b": "x"}))
        out_q.get(timeout=20)
        res["obj"] = recv.get("0", "1", "obj", metadata=meta)
        # a receiver with the wrong secret is refused and times out within its deadline
        bad = MooncakeTransferEngineConnector(_base_cfg(role="receiver", auth_secret="wrong"))
        in_q.put(("put", "k2", MiB, 3, 5.0))
        out_q.get(timeout=20)
        t0 = time.monotonic()
        res["bad_secret_none"] = bad.wait("0", "1", "k2", deadline=t0 + 1.0, metadata=meta) is None
        res["bad_secret_s"] = time.monotonic() - t0
        bad.close()
        in_q.put(("health",))
        h = out_q.get(timeout=20)[1]
        res["rejected"] = h["rejected_messages"]
        res["still_pending"] = h["entries"]
        # the good receiver still gets k2
        r2 = recv.wait("0", "1", "k2", deadline=time.monotonic() + 10)
        res["k2_ok"] = r2 is not None and crc(r2[0].tensor.numpy()) == crc(pattern(MiB, 3))
        view = r2[0].adopt() if r2 is not None else None
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
        in_q.put(("close",))
        _, sh, alive, res["sender_tcp"] = out_q.get(timeout=30)
        res["sender_closed"] = sh["status"]
        res["sender_threads"] = alive
        res["sender_pool"] = sh["pool_size"]
    return res


def scenario_failures() -> dict[str, Any]:
    from omnikv.connectors.mooncake_te import MooncakeTransferEngineConnector
    from omnikv.errors import PeerGoneError, PoolExhaustedError

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
        # key never put: None within the deadline
        t0 = time.monotonic()
        res["never_none"] = recv.wait("0", "1", "never", deadline=t0 + 0.8) is None
        res["never_s"] = time.monotonic() - t0
        # receiver pool exhausted: 12 MiB does not fit 8 MiB
        in_q.put(("put", "k12", 12 * MiB, 1, 1.0))
        assert out_q.get(timeout=20)[1] is True
        # sender pool exhausted: 8 more MiB do not fit 16; put_packed raises at its deadline
        t0 = time.monotonic()
        in_q.put(("put", "x8", 8 * MiB, 1, 0.3))
        res["sender_pool"] = out_q.get(timeout=20)[1]
        res["sender_pool_s"] = time.monotonic() - t0
        try:
            recv.wait("0", "1", "k12", deadline=time.monotonic() + 0.5)
            res["recv_pool"] = "no error"
        except PoolExhaustedError:
            res["recv_pool"] = "PoolExhaustedError"
        # TTL: the sender drops k12 unconsumed after 1 s, then pending is empty
        end = time.monotonic() + 10
        while time.monotonic() < end:
            in_q.put(("health",))
            h = out_q.get(timeout=20)[1]
            if h["entries"] == 0:
                break
            time.sleep(0.1)
        res["ttl_reaped"] = h["ttl_reaped"]
        # receiver gives up mid-transfer: slot quarantined; finished transfer becomes a late arrival
        in_q.put(("hold",))
        assert out_q.get(timeout=20)[0] == "held"
        in_q.put(("put", "late", 2 * MiB, 5, 1.0))
        assert out_q.get(timeout=20)[1] is True
        t0 = time.monotonic()
        res["late_first_none"] = recv.wait("0", "1", "late", deadline=t0 + 0.6) is None
        res["late_first_s"] = time.monotonic() - t0
        assert out_q.get(timeout=20)[0] == "writing"
        t_writing = time.monotonic()
        res["quarantined_during"] = recv.health()["quarantined"]
        # keep the write in flight past the 1 s TTL and its 0.5 s sweep: the reaper must skip it
        # (this sleep lets the TTL elapse; it synchronises nothing)
        time.sleep(max(0.0, t_writing + 2.0 - time.monotonic()))
        in_q.put(("health",))
        res["ttl_reaped_inflight"] = out_q.get(timeout=20)[1]["ttl_reaped"] - h["ttl_reaped"]
        hold_q.put("go")
        r = recv.wait("0", "1", "late", deadline=time.monotonic() + 10)
        res["late_ok"] = r is not None and crc(r[0].tensor.numpy()) == crc(pattern(2 * MiB, 5))
        if r is not None:
            r[0].release()
        # sender killed mid-transfer: PeerGoneError within peer_timeout, slot freed later
        in_q.put(("put", "doomed", 4 * MiB, 6, 1.0))
        assert out_q.get(timeout=20)[1] is True
        killed: dict[str, float] = {}

        def killer() -> None:
            msg = out_q.get(timeout=20)
            assert msg[0] == "writing"
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
        res["q_dump"] = [(q.key, q.xid) for q in recv._quarantine.values()]
        end = time.monotonic() + 10
        while recv.health()["quarantined"] and time.monotonic() < end:
            time.sleep(0.1)
        h = recv.health()
        res["quarantine_freed"] = h["quarantine_freed"]
        res["recv_pool_used"] = h["pool_used"]
        recv.close()
        res["threads"] = omnikv_threads()
    return res


# -- tests --------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_te_roundtrip_long_poll_auth_and_close() -> None:
    r = run_scenario(__file__, "scenario_roundtrip", timeout=100)
    assert r["miss"] and r["miss_s"] < 3
    assert r["put_ok"] and r["managed"] and r["size"] == 20 * MiB + 123 and r["crc_ok"]
    assert r["lag_s"] < 2.0, r["lag_s"]  # woken by the put, not by a poll period
    assert r["second_get_none"]
    assert r["obj"] == [{"a": [1, 2], "b": "x"}, r["obj"][1]]
    assert r["bad_secret_none"] and r["bad_secret_s"] < 1.6
    assert r["rejected"] >= 1 and r["still_pending"] == 1
    assert r["k2_ok"]
    h = r["recv_health"]
    assert h["gets"] == 3 and h["quarantined"] == 0
    assert r["closed_raises"] and r["recv_threads"] == []
    # no control socket, engine RPC listener or data connection is left open after close()
    assert r["recv_tcp"] == [] and r["sender_tcp"] == [], (r["recv_tcp"], r["sender_tcp"])
    assert r["sender_closed"] == "closed" and r["sender_threads"] == [] and r["sender_pool"] == 0


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_te_failures_are_explicit_bounded_and_leak_nothing() -> None:
    r = run_scenario(__file__, "scenario_failures", timeout=100)
    assert r["never_none"] and 0.7 < r["never_s"] < 1.5
    assert r["sender_pool"] == "PoolExhaustedError" and 0.25 < r["sender_pool_s"] < 2
    assert r["recv_pool"] == "PoolExhaustedError"
    assert r["ttl_reaped"] >= 1
    assert r["late_first_none"] and r["late_first_s"] < 1.2
    assert r["quarantined_during"] == 1
    assert r["ttl_reaped_inflight"] == 0, "the TTL reaper freed a buffer that was being written"
    assert r["late_ok"]
    assert r["killed"] == "PeerGoneError" and r["killed_detect_s"] < 3.0
    assert r["quarantined_after_kill"] == 1 and r["quarantine_freed"] >= 1
    assert r["recv_pool_used"] == 0
    assert r["threads"] == []


def test_pattern_is_positional() -> None:
    a = pattern(3 * MiB, 1)
    assert a.size == 3 * MiB and a[MiB] == 1 and a[2 * MiB] == 2
    assert crc(a) != crc(pattern(3 * MiB, 2))
    assert math.isfinite(float(a.mean()))
