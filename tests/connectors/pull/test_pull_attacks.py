"""The pull connectors' control plane under attack (issue 26, items 1 and 2).

Each scenario runs isolated (``unshare -n`` where possible, see ``support.mooncake_peers``): the
sender is a spawned peer stopped by PID, the attacker and the genuine receiver live in the
scenario's process. Attack traffic comes from several loopback addresses (127.0.0.1 -
127.0.0.11, the genuine receiver's own among them), as if from other hosts and from the
receiver's host.

* Connection flood: 1,100 idle TCP connections (no byte sent, so no secret needed) against a
  Transfer Engine sender whose process runs at ``RLIMIT_NOFILE`` 1024; the genuine receiver
  still gets its payload within its deadline, and the idle connections are dropped by the
  handshake timeout.
* A receiver past 1,024 descriptors (the flood's own process holds 1,100 sockets): its control
  connection, numbered past ``select``'s ``FD_SETSIZE``, is served at once over one connection.
* Endless leases (NIXL, item 3): a peer that claims an entry again and again without reading
  it, or claims and aborts in a loop, no longer holds it: it is freed at its TTL (counted from
  the put, across re-leases) or after ``max_leases_per_entry`` leases, and reported.
* Hello flood (no secret): 4,300 ``hello`` messages, each on a new connection, 100 of them kept
  open (80 from one address, past its cap of 64: each of the last 16 takes the slot of that
  address's oldest channel that was never granted anything), sent after the genuine NIXL
  receiver opened its channel and was granted a lease on it; that channel is never evicted and
  the receiver is served on it within a deadline shorter than its silence timeout; the closed
  connections take their channels with them.
"""

from __future__ import annotations

import os
import resource
import select
import socket
import time
from typing import Any

import pytest

from omnikv.connectors.nixl.agent import unavailable_reason as nixl_skip_reason
from support.mooncake_peers import (
    crc,
    free_ports,
    mooncake_scenario,
    pattern,
    peers,
    run_scenario,
)
from support.pull_engine import ask, serve_sender, start_sender

# above the scenarios' own bounds (at most 150 s) and their reports
pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(200)]

MiB = 1 << 20
SECRET = "s3cret"
FLOOD_CONNECTIONS = 1100
FLOOD_ADDRESSES = [f"127.0.0.{i}" for i in range(1, 12)]
NOFILE = 1024
HANDSHAKE_S = 1.5


# -- the sender peers ----------------------------------------------------------------------------
def te_sender_at_nofile(cfg: dict[str, Any], out_q: Any, in_q: Any) -> None:
    """A Transfer Engine sender in a process whose descriptor limit is ``NOFILE`` (soft and hard,
    so the connector cannot raise it)."""
    resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE))
    from omnikv.connectors.mooncake_te import MooncakeTransferEngineConnector

    def fds() -> tuple[Any, ...]:
        return ("fds", len(os.listdir("/proc/self/fd")))

    serve_sender(MooncakeTransferEngineConnector(cfg), out_q, in_q, {"fds": fds})


def nixl_sender(cfg: dict[str, Any], out_q: Any, in_q: Any) -> None:
    """A NIXL sender peer; ``warnings`` answers the WARNING lines its sending side logged."""
    import logging

    from omnikv.connectors.nixl.connector import NixlConnector

    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    side_log = logging.getLogger("omnikv.connectors.nixl.sending")
    side_log.addHandler(Keep(logging.WARNING))
    side_log.setLevel(logging.WARNING)

    def warnings() -> tuple[Any, ...]:
        return ("warnings", list(seen))

    serve_sender(NixlConnector(cfg), out_q, in_q, {"warnings": warnings})


def te_receiver(cfg: dict[str, Any], zport: int) -> Any:
    """A Transfer Engine receiver of the sender on ``zport`` (this process), with ``cfg``."""
    from omnikv.connectors.mooncake_te import MooncakeTransferEngineConnector

    return MooncakeTransferEngineConnector(
        {**cfg, "role": "receiver", "sender_host": "127.0.0.1", "sender_zmq_port": zport}
    )


# -- the attackers ---------------------------------------------------------------------------------
def open_idle_connections(port: int, count: int, timeout_s: float) -> list[socket.socket]:
    """``count`` TCP connections to ``port`` from the flood addresses in turn, sending nothing;
    the ones still established when all are through (at most ``timeout_s``; the others, refused
    or already reset by the server, are closed)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4 * count)), hard))
    socks = []
    for i in range(count):
        s = socket.socket()
        s.bind((FLOOD_ADDRESSES[i % len(FLOOD_ADDRESSES)], 0))
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", port))
        socks.append(s)
    pending = {s.fileno(): s for s in socks}
    poller = select.poll()
    for fd in pending:
        poller.register(fd, select.POLLOUT)
    end = time.monotonic() + timeout_s
    while pending and time.monotonic() < end:
        for fd, _ in poller.poll(max(1, int((end - time.monotonic()) * 1000))):
            if fd in pending:
                poller.unregister(fd)
                del pending[fd]
    established = []
    for s in socks:
        if s.fileno() not in pending and s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
            established.append(s)
        else:
            s.close()
    return established


def closed_by_peer(socks: list[socket.socket], timeout_s: float) -> int:
    """How many of ``socks`` the server closed (EOF or reset) within ``timeout_s``."""
    open_ = {s.fileno(): s for s in socks}
    poller = select.poll()
    for fd in open_:
        poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    closed = 0
    end = time.monotonic() + timeout_s
    while open_ and time.monotonic() < end:
        for fd, _ in poller.poll(max(1, int((end - time.monotonic()) * 1000))):
            s = open_.pop(fd, None)
            if s is None:
                continue
            poller.unregister(fd)
            try:
                data = s.recv(1)
            except OSError:
                data = b""
            if data == b"":
                closed += 1
    return closed


def _receive(recv: Any, key: str, want: Any, timeout_s: float) -> tuple[float, bool | str]:
    """``wait`` for ``key`` until ``timeout_s``: (seconds, whether ``want`` arrived intact, or
    the error raised)."""
    t0 = time.monotonic()
    try:
        got = recv.wait("0", "1", key, deadline=t0 + timeout_s)
    except Exception as exc:
        return time.monotonic() - t0, f"{type(exc).__name__}: {exc}"
    waited = time.monotonic() - t0
    ok = got is not None and crc(got.tensor.numpy()) == crc(want)
    if got is not None:
        got.release()
    return waited, ok


# -- scenario: 1,100 idle connections at RLIMIT_NOFILE 1024 ---------------------------------------
def scenario_connection_flood() -> dict[str, Any]:
    (zport,) = free_ports(1)
    cfg = {
        "host": "127.0.0.1",
        "protocol": "tcp",
        "memory_pool_size": 16 * MiB,
        "auth_secret": SECRET,
        "handshake_timeout_seconds": HANDSHAKE_S,
    }
    res: dict[str, Any] = {}
    proc, out_q, in_q = start_sender(
        te_sender_at_nofile, {**cfg, "role": "sender", "zmq_port": zport}
    )
    attack: list[socket.socket] = []
    with peers(proc):
        res["fds_before"] = ask(in_q, out_q, "fds")[1]
        t0 = time.monotonic()
        attack = open_idle_connections(zport, FLOOD_CONNECTIONS, timeout_s=5.0)
        res["established"] = len(attack)
        res["flood_s"] = time.monotonic() - t0
        recv = te_receiver(cfg, zport)
        try:
            res["put_during"] = list(ask(in_q, out_q, "put", "k1", MiB, 1, 5.0))
            # the sender still accepts and drops the flood while the receiver says hello: on a
            # loaded host that takes seconds
            res["wait_s"], res["served"] = _receive(recv, "k1", pattern(MiB, 1), 20.0)
            res["fds_during"] = ask(in_q, out_q, "fds")[1]
            # the idle connections are dropped by the handshake timeout
            res["closed_by_sender"] = closed_by_peer(attack, HANDSHAKE_S + 5.0)
            for s in attack:
                s.close()
            attack = []
            res["put_after"] = list(ask(in_q, out_q, "put", "k2", MiB, 2, 5.0))
            res["after_s"], res["after_served"] = _receive(recv, "k2", pattern(MiB, 2), 10.0)
            res["health"] = ask(in_q, out_q, "health")[1]
        finally:
            for s in attack:
                s.close()
            recv.close()
        ask(in_q, out_q, "close")
    return res


@pytest.fixture(scope="module")
def connection_flood() -> dict[str, Any]:
    return mooncake_scenario(__file__, "scenario_connection_flood", timeout=150)


def test_the_flood_reached_the_sender(connection_flood: dict[str, Any]) -> None:
    # every connection was accepted (most evicted again at once: see the caps below)
    h = connection_flood["health"]
    assert h["accepted_connections"] > FLOOD_CONNECTIONS, h
    assert connection_flood["established"] > 0, connection_flood


def test_a_genuine_receiver_is_served_during_a_connection_flood(
    connection_flood: dict[str, Any],
) -> None:
    assert connection_flood["put_during"][:2] == ["put", True], repr(connection_flood)
    assert connection_flood["served"] is True, repr(connection_flood)
    assert connection_flood["wait_s"] < 20.0


def test_the_sender_keeps_descriptors_in_reserve(connection_flood: dict[str, Any]) -> None:
    assert connection_flood["fds_during"] < NOFILE * 0.75, connection_flood
    h = connection_flood["health"]
    assert h["refused_connections"] + h["evicted_connections"] > 0, h


def test_idle_unauthenticated_connections_are_dropped(connection_flood: dict[str, Any]) -> None:
    assert connection_flood["closed_by_sender"] == connection_flood["established"]
    assert connection_flood["health"]["connections"] <= 1  # the genuine receiver's channel


def test_the_receiver_is_served_after_the_flood(connection_flood: dict[str, Any]) -> None:
    assert connection_flood["put_after"][:2] == ["put", True], connection_flood
    assert connection_flood["after_served"] is True and connection_flood["after_s"] < 10.0


# -- scenario: a receiver past 1,024 descriptors --------------------------------------------------
def scenario_receiver_past_fd_setsize() -> dict[str, Any]:
    """A Transfer Engine receiver made once every descriptor below 1024 is taken, as beside the
    flood above (whose 1,100 sockets live in the receiver's process): its control connection
    is numbered past ``select``'s ``FD_SETSIZE``. The wait once used ``select`` there, took
    its ``ValueError`` for a closed connection, and dialled again until its deadline."""
    from support.fds import descriptors_past

    (zport,) = free_ports(1)
    cfg = {"host": "127.0.0.1", "protocol": "tcp", "memory_pool_size": 16 * MiB}
    cfg["auth_secret"] = SECRET
    res: dict[str, Any] = {}
    proc, out_q, in_q = start_sender(
        te_sender_at_nofile, {**cfg, "role": "sender", "zmq_port": zport}
    )
    with peers(proc), descriptors_past() as first:
        res["first_fd"] = first
        recv = te_receiver(cfg, zport)
        try:
            res["put"] = list(ask(in_q, out_q, "put", "k1", MiB, 1, 5.0))
            res["wait_s"], res["served"] = _receive(recv, "k1", pattern(MiB, 1), 20.0)
            res["health"] = ask(in_q, out_q, "health")[1]
        finally:
            recv.close()
        ask(in_q, out_q, "close")
    return res


def test_a_receiver_past_1024_descriptors_is_served() -> None:
    res = mooncake_scenario(__file__, "scenario_receiver_past_fd_setsize", timeout=90)
    assert res["first_fd"] >= 1024 and res["put"][:2] == ["put", True], res
    assert res["served"] is True and res["wait_s"] < 20.0, res
    # one connection: the wait never took its own channel for a closed one
    assert res["health"]["accepted_connections"] == 1, res["health"]


# -- scenario: 4,300 hellos without a secret ------------------------------------------------------
HELLOS = 4300
KEPT_ONE_ADDRESS = 80  # kept open from 127.0.0.2: past its per-peer cap (64)
KEPT_RECEIVER_ADDRESS = 20  # kept open from the genuine receiver's address
PER_PEER = 64
CHURN_ADDRESSES = [a for a in FLOOD_ADDRESSES if a != "127.0.0.2"]


WAVE = 100  # churned hellos in flight at once: 10 per address, far below every cap


def hello_flood(endpoint: tuple[str, int], count: int) -> tuple[int, list[Any]]:
    """Say ``hello`` ``count`` times, each on a new connection: the first ``KEPT_*`` ones kept
    open (one after the other: which of 127.0.0.2's are evicted depends on their order), the
    rest closed after the welcome, from the other flood addresses in turn, ``WAVE`` at a time
    (all sent, then all replies read: a loaded host schedules the sender once per wave, not
    once per hello). Returns how many were welcomed and the connections kept."""
    from omnikv.connectors.nixl.protocol import MAX_MESSAGE_BYTES, SCHEMA
    from omnikv.connectors.pull.client import Link
    from omnikv.connectors.pull.control import ControlCodec

    codec = ControlCodec(SCHEMA, None, max_message_bytes=MAX_MESSAGE_BYTES)

    def say_hello(i: int, source: str) -> tuple[Any, bytes] | None:
        try:
            sock = socket.create_connection(endpoint, timeout=5.0, source_address=(source, 0))
        except OSError:
            return None
        link = Link(sock, MAX_MESSAGE_BYTES)
        nonce, frames = codec.encode({"op": "hello", "peer": {"agent": f"flood-{i}"}})
        if not link.send(frames):
            link.close()
            return None
        return link, nonce

    def welcomed_on(said: tuple[Any, bytes]) -> bool:
        reply = said[0].recv(10.0)
        return reply is not None and codec.decode_reply(reply)["re"] == said[1]

    welcomed, kept = 0, []
    kept_count = KEPT_ONE_ADDRESS + KEPT_RECEIVER_ADDRESS
    for i in range(kept_count):
        said = say_hello(i, "127.0.0.2" if i < KEPT_ONE_ADDRESS else "127.0.0.1")
        if said is None:
            continue
        if welcomed_on(said):
            welcomed += 1
            kept.append(said[0])
        else:
            said[0].close()
    # the others, 127.0.0.2 excepted (its cap is full of channels)
    for first in range(kept_count, count, WAVE):
        wave = [
            say_hello(i, CHURN_ADDRESSES[i % len(CHURN_ADDRESSES)])
            for i in range(first, min(first + WAVE, count))
        ]
        for said in wave:
            if said is not None:
                welcomed += welcomed_on(said)
                said[0].close()
    return welcomed, kept


def scenario_hello_flood() -> dict[str, Any]:
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    from omnikv.connectors.nixl.connector import NixlConnector

    (zport,) = free_ports(1)
    endpoint = ("127.0.0.1", zport)
    cfg = {"host": "127.0.0.1", "memory_pool_size": 16 * MiB, "peer_timeout_seconds": 5.0}
    res: dict[str, Any] = {}
    proc, out_q, in_q = start_sender(nixl_sender, {**cfg, "role": "sender", "zmq_port": zport})
    kept: list[Any] = []
    with peers(proc):
        recv = NixlConnector({**cfg, "role": "receiver"})
        recv.update_sender_info(*endpoint)
        try:
            ask(in_q, out_q, "put", "k1", MiB, 1, 5.0)
            res["first_served"] = _receive(recv, "k1", pattern(MiB, 1), 10.0)[1]
            chan = recv.control_client.channel(endpoint, 5.0)  # this thread's, made by the get
            t0 = time.monotonic()
            res["welcomed"], kept = hello_flood(endpoint, HELLOS)
            res["flood_s"] = time.monotonic() - t0
            res["kept"] = len(kept)
            ask(in_q, out_q, "put", "k2", MiB, 2, 5.0)
            # a deadline shorter than the receiver's 5 s silence timeout
            res["wait_s"], res["served"] = _receive(recv, "k2", pattern(MiB, 2), 3.0)
            same = recv.control_client.channel(endpoint, 0.0)
            res["same_channel"] = same is chan and not chan.closed
            res["health"] = ask(in_q, out_q, "health")[1]
        finally:
            for link in kept:
                link.close()
            recv.close()
        ask(in_q, out_q, "close")
    return res


@pytest.fixture(scope="module")
def hello_flood_run() -> dict[str, Any]:
    if nixl_skip_reason() is not None:
        pytest.skip(str(nixl_skip_reason()))
    return run_scenario(__file__, "scenario_hello_flood", timeout=150)


def test_the_hellos_reached_the_sender(hello_flood_run: dict[str, Any]) -> None:
    assert hello_flood_run["first_served"] is True
    # all were welcomed: past the per-peer cap of 127.0.0.2 a hello takes the slot of that
    # address's oldest channel never granted anything (strangers cannot hold the slots)
    assert hello_flood_run["welcomed"] == HELLOS, hello_flood_run


def test_a_live_channel_is_never_evicted_by_new_ones(hello_flood_run: dict[str, Any]) -> None:
    assert hello_flood_run["same_channel"], hello_flood_run
    assert hello_flood_run["served"] is True and hello_flood_run["wait_s"] < 3.0, hello_flood_run


def test_channels_go_with_their_connections_and_are_bounded_per_peer(
    hello_flood_run: dict[str, Any],
) -> None:
    h = hello_flood_run["health"]
    assert hello_flood_run["kept"] == KEPT_ONE_ADDRESS + KEPT_RECEIVER_ADDRESS, hello_flood_run
    # the kept channels still open and the receiver's; the 4,200 closed ones are gone with their
    # connections, and 127.0.0.2's oldest 16 were evicted by its newer ones, never refused
    assert h["channels"] == PER_PEER + KEPT_RECEIVER_ADDRESS + 1, h
    assert h["evicted_connections"] == KEPT_ONE_ADDRESS - PER_PEER, h
    assert h["refused_connections"] == 0, h


# -- scenario: NIXL leases that never end (item 3) ------------------------------------------------
TTL_S = 2.0
MAX_LEASES = 8


def _nixl_codec() -> Any:
    from omnikv.connectors.nixl.protocol import MAX_MESSAGE_BYTES, SCHEMA
    from omnikv.connectors.pull.control import ControlCodec

    return ControlCodec(SCHEMA, None, max_message_bytes=MAX_MESSAGE_BYTES)


def keep_claiming(endpoint: tuple[str, int], key: str, stop: Any, out: dict[str, Any]) -> None:
    """Claim ``key`` again and again (each claim parked until the last lease ends), never READ
    and never abort, until ``stop`` is set: a peer that holds an entry by leasing it forever."""
    import uuid

    from omnikv.connectors.pull.client import ControlClient

    client = ControlClient(_nixl_codec(), {"agent": "hog"})
    out["grants"] = 0
    try:
        chan = client.channel(endpoint, 5.0)
        assert chan is not None
        while not stop.is_set():
            claim = {"op": "claim", "key": key, "wait_ms": 1000, "xid": uuid.uuid4().hex}
            reply = chan.request({**claim, "budget_ms": 200}, 3.0)
            if reply is not None and reply["op"] == "grant" and reply["found"]:
                out["grants"] += 1
    finally:
        client.close()


def claim_and_abort(endpoint: tuple[str, int], key: str, times: int) -> int:
    """Claim ``key`` and abort the lease at once, ``times`` times; how many claims were granted."""
    import uuid

    from omnikv.connectors.pull.client import ControlClient

    client = ControlClient(_nixl_codec(), {"agent": "churn"})
    granted = 0
    try:
        chan = client.channel(endpoint, 5.0)
        assert chan is not None
        for _ in range(times):
            xid = uuid.uuid4().hex
            claim = {"op": "claim", "key": key, "wait_ms": 0, "xid": xid, "budget_ms": 1000}
            reply = chan.request(claim, 3.0)
            if reply is not None and reply["found"]:
                granted += 1
                chan.send({"op": "abort", "xid": xid})
    finally:
        client.close()
    return granted


def scenario_endless_leases() -> dict[str, Any]:
    import threading

    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    (zport,) = free_ports(1)
    endpoint = ("127.0.0.1", zport)
    cfg = {
        "host": "127.0.0.1",
        "role": "sender",
        "zmq_port": zport,
        "memory_pool_size": 16 * MiB,
        "peer_timeout_seconds": 0.5,
        "buffer_ttl_seconds": TTL_S,
        "max_leases_per_entry": MAX_LEASES,
    }
    res: dict[str, Any] = {}
    proc, out_q, in_q = start_sender(nixl_sender, cfg)
    with peers(proc):
        # 1. re-leased back to back: the TTL still applies, while the peer keeps claiming
        ask(in_q, out_q, "put", "hogged", MiB, 1, 5.0)
        stop, hog = threading.Event(), {}
        t0 = time.monotonic()
        th = threading.Thread(target=keep_claiming, args=(endpoint, "hogged@0_1", stop, hog))
        th.start()
        try:
            health = ask(in_q, out_q, "health")[1]
            while health["pool_used"] and time.monotonic() - t0 < TTL_S + 5.0:
                time.sleep(0.05)  # polls the sender's TTL sweep; synchronises nothing
                health = ask(in_q, out_q, "health")[1]
            res["freed_after_s"] = time.monotonic() - t0
            res["hogged"] = {k: health[k] for k in ("entries", "pool_used", "ttl_reaped")}
            res["hog_alive"] = th.is_alive()
        finally:
            stop.set()
            th.join(timeout=10)
        res["hog_grants"] = hog.get("grants")
        # 2. leased and given back again and again: the number of leases is capped
        ask(in_q, out_q, "put", "churned", MiB, 2, 5.0)
        t0 = time.monotonic()
        res["churn_grants"] = claim_and_abort(endpoint, "churned@0_1", 3 * MAX_LEASES)
        health = ask(in_q, out_q, "health")[1]
        res["churn_s"] = time.monotonic() - t0
        res["churned"] = {k: health.get(k) for k in ("entries", "pool_used", "lease_limit_reaped")}
        res["warnings"] = ask(in_q, out_q, "warnings")[1]
        ask(in_q, out_q, "close")
    return res


@pytest.fixture(scope="module")
def endless_leases() -> dict[str, Any]:
    if nixl_skip_reason() is not None:
        pytest.skip(str(nixl_skip_reason()))
    return run_scenario(__file__, "scenario_endless_leases", timeout=120)


def test_an_entry_re_leased_forever_is_freed_at_its_ttl(endless_leases: dict[str, Any]) -> None:
    r = endless_leases
    assert r["hog_alive"], r  # the peer was still claiming when the entry went
    assert r["hogged"] == {"entries": 0, "pool_used": 0, "ttl_reaped": 1}, r
    # the TTL, the sweep (every TTL / 2) and one lease (200 ms + 0.5 s) at most
    assert r["freed_after_s"] < TTL_S + TTL_S / 2 + 0.7 + 1.0, r
    assert r["hog_grants"] >= 2, r  # it was re-leased before


def test_the_number_of_leases_per_entry_is_capped(endless_leases: dict[str, Any]) -> None:
    r = endless_leases
    assert r["churn_grants"] == MAX_LEASES, r
    assert r["churned"] == {"entries": 0, "pool_used": 0, "lease_limit_reaped": 1}, r
    assert r["churn_s"] < TTL_S, r  # freed by the cap, not by the TTL


def test_freed_entries_are_reported(endless_leases: dict[str, Any]) -> None:
    warnings = endless_leases["warnings"]
    assert any("hogged@0_1" in w and "TTL" in w for w in warnings), warnings
    assert any("churned@0_1" in w and "leases" in w for w in warnings), warnings
