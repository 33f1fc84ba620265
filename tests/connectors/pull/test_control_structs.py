"""The pull control messages as msgspec Structs: the same bytes as before, hostile ones refused.

Earlier versions encoded every control message with ``msgpack.packb`` of a map (the message's
own keys, then ``v``, ``n``, ``ts`` and, on a reply, ``re``) and checked each field by hand.
The codec now encodes and decodes through each op's Struct; these tests hold it to the old
bytes for every message the Transfer Engine and NIXL connectors send, in both directions, and
send hostile messages over a real socket to a control server: each is refused, counted as
``rejected``, and reaches no handler.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

import msgpack
import pytest

from omnikv.connectors.delivery import Verdict
from omnikv.connectors.mooncake_te.protocol import SCHEMA as TE
from omnikv.connectors.nixl.protocol import MAX_MESSAGE_BYTES
from omnikv.connectors.nixl.protocol import SCHEMA as NIXL
from omnikv.connectors.pull.client import Link
from omnikv.connectors.pull.connector import peek_answer
from omnikv.connectors.pull.control import (
    MAX_STR_CHARS,
    PROTOCOL_VERSION,
    ControlCodec,
    Schema,
)
from omnikv.connectors.pull.verdicts import verdict_message
from omnikv.errors import ProtocolError
from support.mooncake_peers import free_ports

TOK = os.urandom(16)
XID = os.urandom(16).hex()
TE_HELLO = {"sess": "127.0.0.1:15000", "inc": os.urandom(16), "base": 1 << 40, "len": 1 << 30}

# (schema, message as the connectors build it, is it a reply)
MESSAGES: list[tuple[Schema, dict[str, Any], bool]] = [
    (TE, {"op": "hello", "peer": TE_HELLO}, False),
    (TE, {"op": "query", "key": "req-1@0_1", "wait_ms": 4980, "tok": TOK}, False),
    (
        TE,
        {
            "op": "pull",
            "key": "req-1@0_1",
            "dst": (1 << 40) + 4096,
            "cap": 123_456_789,
            "xid": XID,
            "budget_ms": 30_000,
            "tok": TOK,
        },
        False,
    ),
    (TE, {"op": "status", "xid": XID, "tok": TOK}, False),
    (TE, {"op": "peek", "key": "req-1@0_1", "tok": TOK}, False),
    (TE, {"op": "ping", "tok": TOK}, False),
    (TE, {**verdict_message("req-1@0_1", Verdict.REFUSED, "binding mismatch"), "tok": TOK}, False),  # type: ignore[dict-item]
    (TE, {"op": "welcome", "tok": TOK}, True),
    (TE, {"op": "info", "found": True, "size": 224 << 20}, True),
    (TE, {"op": "done", "size": 1}, True),
    (TE, {"op": "xstate", "state": "inflight"}, True),
    (TE, peek_answer(None), True),
    (TE, peek_answer(7), True),
    (TE, {"op": "pong"}, True),
    (TE, {"op": "error", "reason": "outside_pool"}, True),
    (NIXL, {"op": "hello", "peer": {"agent": "omnikv-3f2a"}}, False),
    (NIXL, {"op": "meta", "tok": TOK}, False),
    (
        NIXL,
        {"op": "claim", "key": "k@0_1", "wait_ms": 0, "xid": XID, "budget_ms": 5, "tok": TOK},
        False,
    ),
    (NIXL, {"op": "abort", "xid": XID, "tok": TOK}, False),
    (NIXL, {"op": "agentmd", "md": os.urandom(3000), "agent": "omnikv-3f2a"}, True),
    (
        NIXL,
        {"op": "grant", "found": True, "size": 1 << 20, "addr": 1 << 44, "agent": "omnikv-3f2a"},
        True,
    ),
]


def _old_encode(msg: dict[str, Any], nonce: bytes, ts: float, reply_to: bytes | None) -> bytes:
    """How earlier versions encoded a control message body."""
    body = {**msg, "v": PROTOCOL_VERSION, "n": nonce, "ts": ts}
    if reply_to is not None:
        body["re"] = reply_to
    out: bytes = msgpack.packb(body, use_bin_type=True)
    return out


@pytest.mark.parametrize(
    ("schema", "msg", "reply"), MESSAGES, ids=[m["op"] for _, m, _ in MESSAGES]
)
def test_the_old_and_new_encoders_write_and_accept_the_same_bytes(
    schema: Schema, msg: dict[str, Any], reply: bool
) -> None:
    codec = ControlCodec(schema, None, max_message_bytes=MAX_MESSAGE_BYTES)
    reply_to = os.urandom(16) if reply else None
    _, frames = codec.encode(msg, reply_to=reply_to)
    sent = msgpack.unpackb(frames[0], raw=False)
    old = _old_encode(msg, sent["n"], sent["ts"], reply_to)
    assert frames[0] == old
    decode = codec.decode_reply if reply else codec.decode_request
    got = decode([old])
    want = {**msg, "v": PROTOCOL_VERSION, "n": sent["n"], "ts": sent["ts"]}
    if reply_to is not None:
        want["re"] = reply_to
    assert got == want


# -- hostile messages over a real socket ----------------------------------------------------------
def _body(fields: dict[str, Any]) -> bytes:
    base = {"v": PROTOCOL_VERSION, "n": os.urandom(16), "ts": time.time(), "tok": None}
    out: bytes = msgpack.packb({**base, **fields}, use_bin_type=True)
    return out


def _nest(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


HOSTILE = {
    "unknown op": {"op": "write_anywhere", "key": "k"},
    "missing field": {"op": "query", "key": "k"},
    "unknown field": {"op": "query", "key": "k", "wait_ms": 0, "dst": 5},
    "negative int": {"op": "query", "key": "k", "wait_ms": -1},
    "bool for int": {"op": "query", "key": "k", "wait_ms": True},
    "string for int": {"op": "pull", "key": "k", "dst": "0", "cap": 1, "xid": "x", "budget_ms": 1},
    "long string": {"op": "query", "key": "k" * (MAX_STR_CHARS + 1), "wait_ms": 0},
    "deep nesting": {"op": "query", "key": _nest(400), "wait_ms": 0},
    "wrong version": {"op": "ping", "v": PROTOCOL_VERSION + 1},
    "short nonce": {"op": "ping", "n": b"\x00" * 8},
    "short token": {"op": "ping", "tok": b"\x00" * 8},
    "verdict value": {"op": "verdict", "key": "k", "verdict": "maybe", "reason": ""},
}


def _read_welcome(link: Link, codec: ControlCodec) -> bytes:
    reply = link.recv(5.0)
    assert reply is not None
    msg = codec.decode_reply(reply)
    assert msg["op"] == "welcome"
    tok: bytes = msg["tok"]
    return tok


def test_hostile_messages_are_refused_counted_and_reach_no_handler() -> None:
    from omnikv.connectors.pull.server import ControlServer

    (port,) = free_ports(1)
    handled: list[str] = []
    codec = ControlCodec(TE, None)

    def handler(req: Any) -> None:
        handled.append(req.op)
        server.answer(req, {"op": "info", "found": False, "size": 0})

    server = ControlServer(codec, ("127.0.0.1", port), handler)
    server.start()
    link = Link(socket.create_connection(("127.0.0.1", port), timeout=5), MAX_MESSAGE_BYTES)
    try:
        link.send(codec.encode({"op": "hello", "peer": TE_HELLO})[1])
        tok = _read_welcome(link, codec)
        for name, fields in HOSTILE.items():
            before = server.rejected
            link.send([_body({"tok": tok, **fields})])
            # a genuine request after it is answered: the hostile one was handled before it
            nonce, frames = codec.encode({"op": "query", "key": "k", "wait_ms": 0, "tok": tok})
            link.send(frames)
            reply = link.recv(5.0)
            assert reply is not None and codec.decode_reply(reply)["re"] == nonce, name
            assert server.rejected == before + 1, name
        assert handled == ["query"] * len(HOSTILE)
        assert not link.closed  # an established channel survives what it sent wrong
        # before its hello a peer gets one try: a hostile message closes the connection
        raw = Link(socket.create_connection(("127.0.0.1", port), timeout=5), MAX_MESSAGE_BYTES)
        raw.send([_body({"op": "hello", "peer": {**TE_HELLO, "len": -1}})])
        assert raw.recv(5.0) is None and raw.closed
        raw.close()
    finally:
        link.close()
        server.close()


def test_a_message_of_another_engine_is_refused() -> None:
    te, nixl = ControlCodec(TE, None), ControlCodec(NIXL, None)
    _, frames = nixl.encode({"op": "claim", "key": "k", "wait_ms": 0, "xid": "x", "budget_ms": 1})
    with pytest.raises(ProtocolError, match="claim"):
        te.decode_request(frames)
    _, frames = te.encode({"op": "hello", "peer": TE_HELLO})
    with pytest.raises(ProtocolError, match="peer"):
        nixl.decode_request(frames)
