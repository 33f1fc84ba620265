"""Strangers cannot spend what genuine peers need (issue 39 item 2), with real processes.

Without ``auth_secret`` anyone who reaches a Transfer Engine sender's control port can say
``hello`` with any receiver session name and token. Each scenario runs a sender peer (spawned,
stopped by PID) and a genuine receiver in the scenario's process; the stranger is a bare
control client there too.

* Burning a live receiver's name: 70 strangers, each a fresh hello with a new token and the
  live receiver's session and pool range, each pulling a bait entry whose write succeeds (into
  the last bytes of that receiver's pool). Before, each one respelt the name and after 64 the
  genuine receiver was refused ("reused by too many receivers"). Now the name's receiver is
  live, so the strangers are written to under its spelling and nothing is spent.
* Claiming names where no engine answers: 300 pulls naming 300 ``host:port`` (nothing
  listening). Before, each one added an entry to the sender's session table for good; now only
  a successful write is remembered, so the table does not grow.
* Holding the channel slots: a stranger on the receiver's address says hello on all 64
  per-peer slots and keeps them open. Before, every connection of a genuine receiver was then
  refused until its deadline; now it takes the slot of the stranger's oldest channel, and once
  granted a pull its channel is never evicted by the stranger's next 64 connections.
"""

from __future__ import annotations

import os
import time
from typing import Any

import msgpack
import pytest

from support.mooncake_peers import (
    crc,
    free_ports,
    mooncake_scenario,
    pattern,
    peers,
    run_scenario,
)
from support.pull_engine import ask, serve_sender, start_sender

# above the scenarios' own bounds (at most 300 s) and their reports
pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(350)]

KiB, MiB = 1 << 10, 1 << 20
STRANGERS = 70
FAKE_NAMES = 300
BAIT = 4 * KiB


def te_sender(cfg: dict[str, Any], out_q: Any, in_q: Any) -> None:
    from omnikv.connectors.mooncake_te import MooncakeTransferEngineConnector

    serve_sender(MooncakeTransferEngineConnector(cfg), out_q, in_q, {})


def _stranger_pull(endpoint: tuple[str, int], peer: dict[str, Any], key: str, dst: int) -> str:
    """One fresh hello claiming ``peer`` and one pull of ``key`` into ``dst``: the reply's op
    (``done``, ``error:<reason>``) or ``silent``."""
    from omnikv.connectors.mooncake_te.protocol import SCHEMA
    from omnikv.connectors.pull.client import ControlClient
    from omnikv.connectors.pull.control import ControlCodec

    client = ControlClient(ControlCodec(SCHEMA, None), peer)
    try:
        chan = client.channel(endpoint, 5.0)
        if chan is None:
            return "no channel"
        msg = {"op": "pull", "key": key, "dst": dst, "cap": BAIT, "xid": os.urandom(8).hex()}
        reply = chan.request({**msg, "budget_ms": 10_000}, 15.0)
    finally:
        client.close()
    if reply is None:
        return "silent"
    return "done" if reply["op"] == "done" else f"error:{reply.get('reason')}"


def _receive(recv: Any, key: str, want: Any) -> bool | str:
    try:
        got = recv.wait("0", "1", key, deadline=time.monotonic() + 15)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    ok = got is not None and crc(got.tensor.numpy()) == crc(want)
    if got is not None:
        got.release()
    return ok


def scenario_strangers() -> dict[str, Any]:
    from omnikv.connectors.mooncake_te import MooncakeTransferEngineConnector

    (zport,) = free_ports(1)
    endpoint = ("127.0.0.1", zport)
    cfg = {"host": "127.0.0.1", "protocol": "tcp", "memory_pool_size": 16 * MiB}
    proc, out_q, in_q = start_sender(te_sender, {**cfg, "role": "sender", "zmq_port": zport})
    res: dict[str, Any] = {}
    with peers(proc):
        recv = MooncakeTransferEngineConnector({**cfg, "role": "receiver"})
        recv.update_sender_info(*endpoint)
        hellos: list[dict[str, Any]] = []

        def keep_hello(frames: list[bytes]) -> None:
            body = msgpack.unpackb(frames[0], raw=False)
            if body.get("op") == "hello":
                hellos.append(body["peer"])

        recv.control_client.observe_sends(keep_hello)
        try:
            ask(in_q, out_q, "put", "k1", MiB, 1, 5.0)
            res["first"] = _receive(recv, "k1", pattern(MiB, 1))
            genuine = hellos[0]  # what the receiver declared: its session and pool range
            tail = genuine["base"] + genuine["len"] - BAIT
            for i in range(STRANGERS):
                ask(in_q, out_q, "put", f"bait{i}", BAIT, 100 + i, 5.0)
            outcomes = []
            for i in range(STRANGERS):
                peer = {**genuine, "inc": os.urandom(16)}
                outcomes.append(_stranger_pull(endpoint, peer, f"bait{i}@0_1", tail))
            res["stranger_outcomes"] = sorted(set(outcomes))
            res["names_after_burn"] = ask(in_q, out_q, "health")[1]["session_names"]
            ask(in_q, out_q, "put", "k2", MiB, 2, 5.0)
            res["after_burn"] = _receive(recv, "k2", pattern(MiB, 2))
            # names where nothing listens: every write fails, nothing may be remembered
            ask(in_q, out_q, "put", "fake-bait", BAIT, 7, 5.0)
            dead = free_ports(1)[0]
            fake_outcomes = set()
            for i in range(FAKE_NAMES):
                peer = {
                    "sess": f"127.0.0.{2 + i % 200}:{dead}",
                    "inc": os.urandom(16),
                    "base": 1 << 20,
                    "len": 1 << 30,
                }
                fake_outcomes.add(_stranger_pull(endpoint, peer, "fake-bait@0_1", 1 << 20)[:5])
            res["fake_outcomes"] = sorted(fake_outcomes)
            res["names_after_fakes"] = ask(in_q, out_q, "health")[1]["session_names"]
            ask(in_q, out_q, "put", "k3", MiB, 3, 5.0)
            res["after_fakes"] = _receive(recv, "k3", pattern(MiB, 3))
        finally:
            recv.close()
        ask(in_q, out_q, "close")
    return res


@pytest.fixture(scope="module")
def strangers() -> dict[str, Any]:
    return mooncake_scenario(__file__, "scenario_strangers", timeout=300)


def test_the_strangers_writes_reached_the_live_receivers_engine(strangers: dict[str, Any]) -> None:
    assert strangers["first"] is True, strangers
    assert strangers["stranger_outcomes"] == ["done"], strangers


def test_strangers_cannot_respell_a_live_receivers_name(strangers: dict[str, Any]) -> None:
    assert strangers["after_burn"] is True, strangers
    assert strangers["names_after_burn"] == 1, strangers


def test_claims_of_names_nobody_answers_spend_nothing(strangers: dict[str, Any]) -> None:
    assert strangers["fake_outcomes"] == ["error"], strangers
    assert strangers["names_after_fakes"] == 1, strangers
    assert strangers["after_fakes"] is True, strangers


# -- strangers cannot hold the per-peer channel slots (issue 39 item 2) ----------------------------
SLOTS = 64  # max_connections_per_peer's default


def _stranger_channels(endpoint: tuple[str, int], n: int, peer: dict[str, Any]) -> list[Any]:
    """``n`` connections from this process, each greeted with ``hello``: the links welcomed
    (held open by the caller)."""
    import socket

    from omnikv.connectors.mooncake_te.protocol import SCHEMA
    from omnikv.connectors.pull.client import Link
    from omnikv.connectors.pull.control import ControlCodec

    codec = ControlCodec(SCHEMA, None)
    held = []
    for _ in range(n):
        try:  # a refused connection is reset by the server
            link = Link(socket.create_connection(endpoint, timeout=5), codec.max_message_bytes)
        except OSError:
            continue
        link.send(codec.encode({"op": "hello", "peer": {**peer, "inc": os.urandom(16)}})[1])
        reply = link.recv(5.0)
        if reply is not None and codec.decode_reply(reply)["op"] == "welcome":
            held.append(link)
        else:
            link.close()
    return held


def _timed_receive(recv: Any, key: str, want: Any) -> tuple[bool | str, float]:
    t0 = time.monotonic()
    return _receive(recv, key, want), time.monotonic() - t0


def scenario_slots() -> dict[str, Any]:
    from omnikv.connectors.mooncake_te import MooncakeTransferEngineConnector

    (zport,) = free_ports(1)
    endpoint = ("127.0.0.1", zport)
    cfg = {"host": "127.0.0.1", "protocol": "tcp", "memory_pool_size": 16 * MiB}
    proc, out_q, in_q = start_sender(te_sender, {**cfg, "role": "sender", "zmq_port": zport})
    res: dict[str, Any] = {}
    held: list[Any] = []
    fake = {"sess": "127.0.0.1:1", "base": 1 << 20, "len": 1 << 20}
    with peers(proc):
        recv = MooncakeTransferEngineConnector({**cfg, "role": "receiver"})
        recv.update_sender_info(*endpoint)
        hellos: list[int] = []
        recv.control_client.observe_sends(
            lambda frames: (
                hellos.append(1)
                if msgpack.unpackb(frames[0], raw=False).get("op") == "hello"
                else None
            )
        )
        try:
            # a stranger on the receiver's address holds every slot with a channel
            held += _stranger_channels(endpoint, SLOTS, fake)
            res["stranger_channels"] = len(held)
            res["channels_before"] = ask(in_q, out_q, "health")[1]["channels"]
            ask(in_q, out_q, "put", "k1", MiB, 1, 5.0)
            res["first"], res["first_s"] = _timed_receive(recv, "k1", pattern(MiB, 1))
            # the stranger comes back for the slots: the genuine receiver's channel stays
            held += _stranger_channels(endpoint, SLOTS, fake)
            ask(in_q, out_q, "put", "k2", MiB, 2, 5.0)
            res["second"], res["second_s"] = _timed_receive(recv, "k2", pattern(MiB, 2))
            res["hellos"] = len(hellos)
            health = ask(in_q, out_q, "health")[1]
            res["evicted"] = health["evicted_connections"]
            res["refused"] = health["refused_connections"]
        finally:
            for link in held:
                link.close()
            recv.close()
        ask(in_q, out_q, "close")
    return res


def test_strangers_cannot_hold_the_channels_a_genuine_receiver_needs() -> None:
    res = mooncake_scenario(__file__, "scenario_slots", timeout=300)
    assert res["stranger_channels"] == SLOTS and res["channels_before"] == SLOTS, res
    # before: every connection of the genuine receiver was refused until its deadline (15 s)
    assert res["first"] is True and res["first_s"] < 5.0, res
    assert res["second"] is True and res["second_s"] < 5.0, res
    assert res["hellos"] == 1, res  # its channel was never evicted
    assert res["evicted"] >= SLOTS + 1 and res["refused"] == 0, res


# -- NIXL counts what it rejects (issue 39 item 9; docs/security.md promises ``rejected``) -------
def scenario_nixl_rejected() -> dict[str, Any]:
    import socket

    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    from omnikv.connectors.nixl.connector import NixlConnector
    from omnikv.connectors.nixl.protocol import MAX_MESSAGE_BYTES, SCHEMA
    from omnikv.connectors.pull.client import Link
    from omnikv.connectors.pull.control import ControlCodec

    (zport,) = free_ports(1)
    sender = NixlConnector(
        {
            "host": "127.0.0.1",
            "memory_pool_size": 4 * MiB,
            "role": "sender",
            "zmq_port": zport,
            "auth_secret": "s3cret",
        }
    )
    res: dict[str, Any] = {"before": sender.health()["rejected_messages"]}
    try:
        forged = ControlCodec(SCHEMA, b"wrong", max_message_bytes=MAX_MESSAGE_BYTES)
        for i in range(5):  # signed with the wrong secret: each dropped, counted
            link = Link(
                socket.create_connection(("127.0.0.1", zport), timeout=5), MAX_MESSAGE_BYTES
            )
            _, frames = forged.encode({"op": "hello", "peer": {"agent": f"forger-{i}"}})
            link.send(frames)
            res.setdefault("answered", []).append(link.recv(1.0) is not None)
            link.close()
        res["after"] = sender.health()["rejected_messages"]
    finally:
        sender.close()
    return res


def test_the_nixl_connector_counts_rejected_control_messages() -> None:
    from omnikv.connectors.nixl.agent import unavailable_reason

    if unavailable_reason() is not None:
        pytest.skip(str(unavailable_reason()))
    res = run_scenario(__file__, "scenario_nixl_rejected", timeout=120)
    assert res["before"] == 0 and res["answered"] == [False] * 5, res
    assert res["after"] == 5, res
