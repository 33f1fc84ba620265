"""The pull engines' control plane (omnikv.connectors.pull.control): wire rules, auth, replays.

The attack tests run a real server process and real client sockets inside ``unshare -n`` (see
``support.mooncake_peers.run_scenario``): a client's signed ``hello``/``query``/``pull``/``ping``
are captured as they leave its connection and re-sent byte for byte, from another connection and
from the same one; the replays must get no answer and reach no handler (the server counts what
its handler saw, and a ``pull`` there stands for "writes the requester's memory").
"""

from __future__ import annotations

import socket
import time
from typing import Any

import msgpack
import pytest

from omnikv.connectors.pull.control import (
    NONCE_BYTES,
    PROTOCOL_VERSION,
    ControlCodec,
    ReplayGuard,
    Schema,
)
from omnikv.errors import ProtocolError
from support.mooncake_peers import free_ports, peers, queue, run_scenario, spawn

SCHEMA = Schema(
    requests={
        "query": {"key": str, "wait_ms": int},
        "pull": {"key": str, "dst": int, "cap": int},
    },
    replies={"info": {"found": bool, "size": int}, "done": {"size": int}},
    hello={"sess": str, "base": int, "len": int},
)
SECRET = b"s3cret"


def _codec(secret: bytes | None = SECRET, **kw: Any) -> ControlCodec:
    return ControlCodec(SCHEMA, secret, **kw)


# -- codec and guard (one process) ---------------------------------------------------------------
def test_signed_message_round_trips_with_nonce_and_timestamp() -> None:
    nonce, frames = _codec().encode({"op": "query", "key": "k", "wait_ms": 0})
    msg = _codec().decode_request(frames)
    assert msg["n"] == nonce and len(nonce) == NONCE_BYTES
    assert abs(msg["ts"] - time.time()) < 5 and msg["v"] == PROTOCOL_VERSION


def test_the_mac_covers_nonce_and_timestamp() -> None:
    _, (body, mac) = _codec().encode({"op": "ping"})
    fields = msgpack.unpackb(body)
    fields["ts"] += 1.0
    with pytest.raises(ProtocolError, match="signature"):
        _codec().decode_request([msgpack.packb(fields), mac])
    fields["ts"] -= 1.0
    fields["n"] = bytes(NONCE_BYTES)
    with pytest.raises(ProtocolError, match="signature"):
        _codec().decode_request([msgpack.packb(fields), mac])


def test_a_decoder_rejects_a_nonce_it_already_accepted() -> None:
    receiver = _codec()
    _, frames = _codec().encode({"op": "ping"})
    receiver.decode_request(frames)
    with pytest.raises(ProtocolError, match="replayed"):
        receiver.decode_request(frames)


def test_timestamps_outside_the_window_are_rejected() -> None:
    guard = ReplayGuard(window_s=30.0)
    now = time.time()
    with pytest.raises(ProtocolError, match="outside"):
        guard.check(b"a" * NONCE_BYTES, now - 31.0)
    with pytest.raises(ProtocolError, match="outside"):
        guard.check(b"b" * NONCE_BYTES, now + 31.0)
    with pytest.raises(ProtocolError, match="outside"):
        guard.check(b"c" * NONCE_BYTES, float("nan"))
    guard.check(b"d" * NONCE_BYTES, now - 29.0)
    assert len(guard) == 1


def test_the_replay_table_is_bounded() -> None:
    guard = ReplayGuard(window_s=30.0, max_entries=2)
    now = time.time()
    guard.check(b"a" * NONCE_BYTES, now)
    guard.check(b"b" * NONCE_BYTES, now)
    with pytest.raises(ProtocolError, match="full"):
        guard.check(b"c" * NONCE_BYTES, now)


def test_wrong_secret_and_missing_mac_are_rejected() -> None:
    _, frames = _codec(b"other").encode({"op": "ping"})
    with pytest.raises(ProtocolError, match="signature"):
        _codec().decode_request(frames)
    with pytest.raises(ProtocolError, match="unauthenticated"):
        _codec().decode_request(frames[:1])


def test_schema_types_sizes_and_ops_are_enforced() -> None:
    plain = _codec(None)
    _, frames = plain.encode({"op": "pull", "key": "k", "dst": -1, "cap": 1})
    with pytest.raises(ProtocolError, match=">= 0"):
        plain.decode_request(frames)
    _, frames = plain.encode({"op": "pull", "key": "k", "dst": True, "cap": 1})
    with pytest.raises(ProtocolError, match="Expected `int`, got `bool`"):
        plain.decode_request(frames)
    _, frames = plain.encode({"op": "done", "size": 1})
    with pytest.raises(ProtocolError, match=r"Invalid value 'done' - at `\$\.op`"):
        plain.decode_request(frames)
    with pytest.raises(ProtocolError, match="oversized"):
        plain.decode_request([b"\x00" * 5000])
    with pytest.raises(ProtocolError, match="invalid control message"):
        plain.decode_request([b"\xc1"])
    _, frames = plain.encode({"op": "hello", "peer": {"sess": "h:1", "base": 0}})
    with pytest.raises(ProtocolError, match=r"missing required field `len` - at `\$\.peer`"):
        plain.decode_request(frames)


def test_an_oversized_message_is_refused_before_sending() -> None:
    with pytest.raises(ValueError, match="over"):
        _codec().encode({"op": "query", "key": "k" * 5000, "wait_ms": 0})


# -- real server process, real sockets -----------------------------------------------------------
def _server_peer(port: int, secret: bytes | None, out_q: Any, in_q: Any) -> None:
    """A control server whose handler records what reached it (pull = a memory write)."""
    from omnikv.connectors.pull.control import Request
    from omnikv.connectors.pull.server import ControlServer

    seen: list[list[Any]] = []

    def handler(req: Request) -> None:
        seen.append([req.op, req.msg.get("key"), req.peer.get("sess")])
        if req.op == "query":
            server.answer(req, {"op": "info", "found": True, "size": 7})
        else:
            server.answer(req, {"op": "done", "size": req.msg["cap"]})

    server = ControlServer(ControlCodec(SCHEMA, secret), ("127.0.0.1", port), handler)
    server.start()
    out_q.put("ready")
    in_q.get()
    server.close()
    out_q.put({"seen": seen, "rejected": server.rejected})


def _link(port: int) -> Any:
    from omnikv.connectors.pull.client import Link

    return Link(socket.create_connection(("127.0.0.1", port), timeout=5), 4096)


def _replay(port: int, frames: list[bytes], link: Any = None) -> bool:
    """Send ``frames`` verbatim (on a new connection unless ``link``); True when anything
    answers within 0.5 s (a connection the server closes answers nothing)."""
    own = link is None
    if own:
        link = _link(port)
    try:
        return link.send(frames) and link.recv(0.5) is not None
    finally:
        if own:
            link.close()


def scenario_replay(secret: str | None) -> dict[str, Any]:
    from omnikv.connectors.pull.client import ControlClient

    (port,) = free_ports(1)
    key = secret.encode() if secret else None
    out_q, in_q = queue(), queue()
    proc = spawn(_server_peer, port, key, out_q, in_q)
    res: dict[str, Any] = {}
    with peers(proc):
        assert out_q.get(timeout=30) == "ready"
        client = ControlClient(
            ControlCodec(SCHEMA, key), {"sess": "127.0.0.1:1", "base": 4096, "len": 8192}
        )
        wire: list[list[bytes]] = []
        client.observe_sends(lambda frames: wire.append(list(frames)))
        chan = client.channel(("127.0.0.1", port), 10.0)
        assert chan is not None
        res["query"] = chan.request({"op": "query", "key": "k", "wait_ms": 0}, 5.0)["size"]
        res["pull"] = chan.request({"op": "pull", "key": "k", "dst": 4096, "cap": 64}, 5.0)["size"]
        res["ping"] = chan.request({"op": "ping"}, 5.0)["op"]
        hello, query, pull, ping = wire
        # verbatim replays: from a fresh connection, a fresh connection after its own replayed
        # hello, and on the very connection that sent them
        res["other_socket"] = [_replay(port, m) for m in (query, pull, ping)]
        attacker = _link(port)
        res["after_hello"] = [_replay(port, m, attacker) for m in (hello, query, pull, ping)]
        attacker.close()
        res["same_socket"] = [_replay(port, m, chan.link) for m in (query, pull, ping)]
        # the genuine client keeps working afterwards
        res["still_served"] = chan.request({"op": "ping"}, 5.0) is not None
        client.close()
        in_q.put("stop")
        res.update(out_q.get(timeout=30))
    return res


@pytest.fixture(scope="module")
def replay_signed() -> dict[str, Any]:
    return run_scenario(__file__, "scenario_replay", {"secret": "s3cret"}, timeout=90)


@pytest.mark.slow
def test_a_signed_exchange_is_served(replay_signed: dict[str, Any]) -> None:
    assert replay_signed["query"] == 7 and replay_signed["pull"] == 64
    assert replay_signed["ping"] == "pong" and replay_signed["still_served"]


@pytest.mark.slow
def test_replays_from_another_socket_get_no_answer(replay_signed: dict[str, Any]) -> None:
    assert replay_signed["other_socket"] == [False, False, False]
    assert replay_signed["after_hello"] == [False, False, False, False]


@pytest.mark.slow
def test_replays_on_the_same_socket_get_no_answer(replay_signed: dict[str, Any]) -> None:
    assert replay_signed["same_socket"] == [False, False, False]


@pytest.mark.slow
def test_replays_reach_no_handler(replay_signed: dict[str, Any]) -> None:
    assert replay_signed["seen"] == [["query", "k", "127.0.0.1:1"], ["pull", "k", "127.0.0.1:1"]]
    # three from fresh connections, the replayed hello (its connection is dropped then, so what
    # follows on it never arrives), three on the genuine connection
    assert replay_signed["rejected"] == 7


@pytest.mark.slow
def test_without_a_secret_only_the_handshaken_socket_is_served() -> None:
    res = run_scenario(__file__, "scenario_replay", {"secret": None}, timeout=90)
    assert res["query"] == 7 and res["other_socket"] == [False, False, False]


# -- admission: caps, timeouts, channels that go with their connections (issue 26) ------------
def _server(**limits: Any) -> Any:
    """A started server on a free loopback port that answers ``query`` with size 7 (and
    vouches for the channel that asked)."""
    from omnikv.connectors.pull.control import ServerLimits
    from omnikv.connectors.pull.server import ControlServer

    (port,) = free_ports(1)

    def handler(req: Any) -> None:
        server.vouch(req.ident)  # told a key's size: a genuine peer, as the engines vouch
        server.answer(req, {"op": "info", "found": True, "size": 7})

    server = ControlServer(
        _codec(None), ("127.0.0.1", port), handler, limits=ServerLimits(**limits)
    )
    server.start()
    server.port = port  # type: ignore[attr-defined]
    return server


def _client(**kw: Any) -> Any:
    from omnikv.connectors.pull.client import ControlClient

    return ControlClient(_codec(None), {"sess": "s", "base": 0, "len": 1}, **kw)


def _wait_closed(sock: socket.socket, timeout_s: float) -> float | None:
    """Seconds until the server closed ``sock`` (EOF or reset), ``None`` if it did not."""
    t0 = time.monotonic()
    sock.settimeout(timeout_s)
    try:
        data = sock.recv(1)
    except TimeoutError:
        return None
    except OSError:
        data = b""
    return time.monotonic() - t0 if data == b"" else None


def _raw(port: int, source: str = "127.0.0.1") -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0))


def _refused(port: int) -> bool:
    """Whether the server closes a new connection at once (maybe before connect returns)."""
    try:
        sock = _raw(port)
    except ConnectionResetError:
        return True
    try:
        return _wait_closed(sock, 5.0) is not None
    finally:
        sock.close()


def _until(cond: Any, timeout_s: float = 5.0) -> bool:
    """Poll ``cond`` (the server's counters, updated by its thread) every 5 ms until it holds."""
    end = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.005)  # polls another thread's counters; synchronises nothing
    return True


def test_a_silent_connection_is_dropped_at_the_handshake_timeout() -> None:
    server = _server(handshake_timeout_s=0.3)
    try:
        sock = _raw(server.port)
        took = _wait_closed(sock, 5.0)
        assert took is not None and 0.2 < took < 2.0, took
        assert server.stats()["handshake_timeouts"] == 1
        sock.close()
    finally:
        server.close()


def test_an_invalid_first_message_drops_the_connection_at_once() -> None:
    from omnikv.connectors.pull.control import pack_message

    server = _server()
    try:
        for garbage in (pack_message([b"\xc1"]), b"\xff" * 64):  # undecodable; header > max
            sock = _raw(server.port)
            sock.sendall(garbage)
            took = _wait_closed(sock, 5.0)
            assert took is not None and took < 1.0
            sock.close()
        assert server.stats()["dropped_connections"] == 2 and server.rejected == 2
    finally:
        server.close()


def test_the_per_peer_cap_evicts_connections_without_a_channel_then_unvouched_channels() -> None:
    server = _server(max_connections_per_peer=3)
    client = _client()
    query = {"op": "query", "key": "k", "wait_ms": 0}
    try:
        chan = client.channel(("127.0.0.1", server.port), 5.0)
        assert chan is not None and chan.request(query, 5.0) is not None  # vouched for
        idle = [_raw(server.port) for _ in range(2)]  # the cap (3) is reached
        newer = _raw(server.port)  # evicts the oldest idle connection, not the channel
        assert _wait_closed(idle[0], 5.0) is not None
        assert _until(lambda: server.stats()["evicted_connections"] == 1)
        others = [_client() for _ in range(3)]
        chans = [c.channel(("127.0.0.1", server.port), 5.0) for c in others[:2]]
        assert all(c is not None for c in chans)  # they evicted idle[1] and newer
        # the cap is full of channels: a newcomer evicts the oldest one never vouched for
        third = others[2].channel(("127.0.0.1", server.port), 5.0)
        assert third is not None
        assert _until(lambda: chans[0] is not None and chans[0].closed)
        # with every channel vouched for, newcomers are refused
        for c in (chans[1], third):
            assert c is not None and c.request(query, 5.0) is not None
        assert _refused(server.port)
        assert server.stats()["refused_connections"] >= 1
        reply = chan.request(query, 5.0)
        assert reply is not None and reply["size"] == 7 and not chan.closed
        # another address has its own allowance
        other = _raw(server.port, source="127.0.0.2")
        assert _wait_closed(other, 0.3) is None
        for s in (*idle, newer, other):
            s.close()
        for c in others:
            c.close()
    finally:
        client.close()
        server.close()


def test_the_total_cap_evicts_the_oldest_connection_without_a_channel() -> None:
    server = _server(max_connections=2)
    client = _client()
    try:
        first = _raw(server.port, "127.0.0.2")
        second = _raw(server.port, "127.0.0.3")
        assert _until(lambda: server.stats()["connections"] == 2)
        chan = client.channel(("127.0.0.1", server.port), 5.0)  # evicts ``first``
        assert chan is not None
        assert _wait_closed(first, 5.0) is not None
        assert _wait_closed(second, 0.2) is None
        assert server.stats()["connections"] == 2 and server.stats()["channels"] == 1
        first.close()
        second.close()
    finally:
        client.close()
        server.close()


@pytest.mark.timing  # a bound of 0.5 s or less past a deadline: run alone, after the lanes
def test_a_channel_goes_with_its_connection() -> None:
    server = _server()
    client = _client()
    try:
        chan = client.channel(("127.0.0.1", server.port), 5.0)
        assert chan is not None
        assert _until(lambda: server.stats()["channels"] == 1)
        t0 = time.monotonic()
        assert client.channel(("127.0.0.1", server.port), 5.0) is chan  # reused, at once
        assert time.monotonic() - t0 < 0.5
        client.discard(("127.0.0.1", server.port))
        assert _until(lambda: server.stats()["connections"] == 0)
    finally:
        client.close()
        server.close()


def test_an_idle_channel_is_closed_and_the_client_greets_again() -> None:
    server = _server(idle_timeout_s=0.3)
    client = _client()
    endpoint = ("127.0.0.1", server.port)
    try:
        chan = client.channel(endpoint, 5.0)
        assert chan is not None
        assert _until(lambda: server.stats()["idle_closed"] == 1)
        assert chan.request({"op": "ping"}, 5.0) is None and chan.closed  # at once, not at 5 s
        again = client.channel(endpoint, 5.0)
        assert again is not None and again is not chan
        assert again.request({"op": "query", "key": "k", "wait_ms": 0}, 5.0) is not None
    finally:
        client.close()
        server.close()


def test_a_refused_connection_is_retried_until_the_timeout() -> None:
    (port,) = free_ports(1)
    client = _client()
    try:
        t0 = time.monotonic()
        assert client.channel(("127.0.0.1", port), 0.3) is None
        assert 0.25 < time.monotonic() - t0 < 1.5
    finally:
        client.close()


def test_limits_are_checked() -> None:
    from omnikv.connectors.pull.control import ServerLimits

    with pytest.raises(ValueError, match=">= 1"):
        ServerLimits(max_connections=0)
    with pytest.raises(ValueError, match="handshake_timeout_s"):
        ServerLimits(handshake_timeout_s=0)


_NOFILE_CHILD = r"""
import json, resource
resource.setrlimit(resource.RLIMIT_NOFILE, (256, 512))
from omnikv.connectors.pull.control import ServerLimits
from omnikv.connectors.pull.server import effective_max_connections
low = effective_max_connections(ServerLimits())
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))
capped = effective_max_connections(ServerLimits())
print(json.dumps({"soft": soft, "hard": hard, "raised_cap": low, "capped": capped}))
"""


@pytest.mark.slow
def test_the_soft_descriptor_limit_is_raised_and_bounds_the_connections() -> None:
    import json
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", _NOFILE_CHILD],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["soft"] == res["hard"] == 512, res  # raised to the hard limit
    assert res["raised_cap"] < 256 and res["capped"] < 64, res  # half of what is left


def test_channels_to_servers_gone_are_closed_and_threads_share_one() -> None:
    """A long-lived client meeting servers in turn keeps no connection to the ones gone, and
    every thread talks to a server over the same one connection (issue 39 item 3)."""
    import threading

    first, second = _server(), _server()
    client = _client()
    try:
        old = client.channel(("127.0.0.1", first.port), 5.0)
        assert old is not None and client.has_channel(("127.0.0.1", first.port))
        first.close()  # the sender goes away: its connection is closed under the channel
        held: list[Any] = []
        workers = [
            threading.Thread(
                target=lambda: held.append(client.channel(("127.0.0.1", second.port), 5.0))
            )
            for _ in range(8)
        ]
        for w in workers:
            w.start()
        for w in workers:
            w.join(timeout=10)
        assert len(held) == 8 and held[0] is not None
        assert all(c is held[0] for c in held)  # one connection for every thread
        assert client.channel(("127.0.0.1", second.port), 5.0) is held[0]
        assert old.closed and not client.has_channel(("127.0.0.1", first.port))
        assert not held[0].closed  # the threads that asked for it ended; it stays
        assert client.connections == 1
        assert _until(lambda: second.stats()["channels"] == 1)
    finally:
        client.close()
        second.close()


def test_concurrent_requests_on_the_shared_channel_each_get_their_own_reply() -> None:
    """64 threads ask at once over the one channel; the reader hands every reply to the thread
    that sent its request (answers come back in another order than the requests)."""
    import threading

    from omnikv.connectors.pull.control import Request
    from omnikv.connectors.pull.server import ControlServer

    (port,) = free_ports(1)
    held: list[Request] = []

    def handler(req: Request) -> None:  # answers in batches, last request first
        held.append(req)
        if len(held) == 8:
            for r in reversed(held):
                server.answer(r, {"op": "info", "found": True, "size": int(r.msg["key"])})
            held.clear()

    server = ControlServer(_codec(None), ("127.0.0.1", port), handler)
    server.start()
    client = _client()
    got: dict[int, Any] = {}
    try:
        chan = client.channel(("127.0.0.1", port), 5.0)
        assert chan is not None

        def ask(i: int) -> None:
            reply = chan.request({"op": "query", "key": str(i), "wait_ms": 0}, 20.0)
            got[i] = None if reply is None else reply["size"]

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(64)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert got == {i: i for i in range(64)}
        assert client.connections == 1 and server.stats()["connections"] == 1
    finally:
        client.close()
        server.close()
