"""The pull engines' control plane (omnikv.connectors._control): wire rules, auth, replays.

The attack tests run a real server process and real client sockets inside ``unshare -n`` (see
``mooncake_helpers.run_scenario``): a client's signed ``hello``/``query``/``pull``/``ping`` are
captured as they leave its socket and re-sent byte for byte, from another socket and from the
same one; the replays must get no answer and reach no handler (the server counts what its
handler saw, and a ``pull`` there stands for "writes the requester's memory").
"""

from __future__ import annotations

import time
from typing import Any

import msgpack
import pytest

from mooncake_helpers import free_ports, peers, queue, run_scenario, spawn
from omnikv.connectors._control import (
    NONCE_BYTES,
    PROTOCOL_VERSION,
    ControlCodec,
    ProtocolError,
    ReplayGuard,
    Schema,
)

zmq = pytest.importorskip("zmq")

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
    with pytest.raises(ProtocolError, match="must be"):
        plain.decode_request(frames)
    _, frames = plain.encode({"op": "done", "size": 1})
    with pytest.raises(ProtocolError, match="unexpected op"):
        plain.decode_request(frames)
    with pytest.raises(ProtocolError, match="oversized"):
        plain.decode_request([b"\x00" * 5000])
    with pytest.raises(ProtocolError, match="undecodable"):
        plain.decode_request([b"\xc1"])
    _, frames = plain.encode({"op": "hello", "peer": {"sess": "h:1", "base": 0}})
    with pytest.raises(ProtocolError, match=r"hello\.peer"):
        plain.decode_request(frames)


def test_an_oversized_message_is_refused_before_sending() -> None:
    with pytest.raises(ValueError, match="over"):
        _codec().encode({"op": "query", "key": "k" * 5000, "wait_ms": 0})


# -- real server process, real sockets -----------------------------------------------------------
def _server_peer(port: int, secret: bytes | None, out_q: Any, in_q: Any) -> None:
    """A control server whose handler records what reached it (pull = a memory write)."""
    import zmq as zmq_mod

    from omnikv.connectors._control import ControlServer, Request

    ctx = zmq_mod.Context()
    seen: list[list[Any]] = []

    def handler(req: Request) -> None:
        seen.append([req.op, req.msg.get("key"), req.peer.get("sess")])
        if req.op == "query":
            server.answer(req, {"op": "info", "found": True, "size": 7})
        else:
            server.answer(req, {"op": "done", "size": req.msg["cap"]})

    server = ControlServer(ctx, ControlCodec(SCHEMA, secret), ("127.0.0.1", port), handler)
    server.start()
    out_q.put("ready")
    in_q.get()
    server.close()
    ctx.destroy(linger=0)
    out_q.put({"seen": seen, "rejected": server.rejected})


class _Tap:
    """Wraps a zmq socket; records every multipart message sent through it."""

    def __init__(self, sock: Any, log: list[list[bytes]]) -> None:
        self._sock = sock
        self._log = log

    def send_multipart(self, frames: list[bytes]) -> None:
        self._log.append(list(frames))
        self._sock.send_multipart(frames)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


def _replay(ctx: Any, port: int, frames: list[bytes], sock: Any = None) -> bool:
    """Send ``frames`` verbatim (new DEALER unless ``sock``); True when anything answers."""
    own = sock is None
    if own:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        sock.send_multipart(frames)
        return bool(sock.poll(500))
    finally:
        if own:
            sock.close(0)


def scenario_replay(secret: str | None) -> dict[str, Any]:
    import zmq as zmq_mod

    from omnikv.connectors import _control

    (port,) = free_ports(1)
    key = secret.encode() if secret else None
    out_q, in_q = queue(), queue()
    proc = spawn(_server_peer, port, key, out_q, in_q)
    res: dict[str, Any] = {}
    with peers(proc):
        assert out_q.get(timeout=30) == "ready"
        ctx = zmq_mod.Context()
        client = _control.ControlClient(
            ctx, ControlCodec(SCHEMA, key), {"sess": "127.0.0.1:1", "base": 4096, "len": 8192}
        )
        wire: list[list[bytes]] = []
        orig_connect = client._connect
        client._connect = lambda ep: _Tap(orig_connect(ep), wire)  # type: ignore[method-assign]
        chan = client.channel(("127.0.0.1", port), 10.0)
        assert chan is not None
        res["query"] = chan.request({"op": "query", "key": "k", "wait_ms": 0}, 5.0)["size"]
        res["pull"] = chan.request({"op": "pull", "key": "k", "dst": 4096, "cap": 64}, 5.0)["size"]
        res["ping"] = chan.request({"op": "ping"}, 5.0)["op"]
        hello, query, pull, ping = wire
        # verbatim replays: from a fresh socket, a fresh socket after its own replayed hello, and
        # on the very socket that sent them
        res["other_socket"] = [_replay(ctx, port, m) for m in (query, pull, ping)]
        attacker = ctx.socket(zmq_mod.DEALER)
        attacker.setsockopt(zmq_mod.LINGER, 0)
        attacker.connect(f"tcp://127.0.0.1:{port}")
        res["after_hello"] = [_replay(ctx, port, m, attacker) for m in (hello, query, pull, ping)]
        attacker.close(0)
        res["same_socket"] = [_replay(ctx, port, m, chan.sock) for m in (query, pull, ping)]
        # the genuine client keeps working afterwards
        res["still_served"] = chan.request({"op": "ping"}, 5.0) is not None
        client.close()
        ctx.destroy(linger=0)
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
    assert replay_signed["rejected"] == 10


@pytest.mark.slow
def test_without_a_secret_only_the_handshaken_socket_is_served() -> None:
    res = run_scenario(__file__, "scenario_replay", {"secret": None}, timeout=90)
    assert res["query"] == 7 and res["other_socket"] == [False, False, False]
