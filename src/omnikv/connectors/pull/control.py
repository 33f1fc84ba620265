"""The control plane of pull-model engines (Mooncake Transfer Engine, NIXL): msgpack over TCP.

One implementation of the wire rules, the authentication, the replay protection and the
admission limits, used by every pull-model connector; each engine only declares the fields of its
own messages (:class:`Schema`) and handles the requests that reach it. This module holds the
rules; :mod:`omnikv.connectors.pull.server` the server (one listener thread, admission,
timeouts) and :mod:`omnikv.connectors.pull.client` the client (one channel per thread and
server).

Wire format. A message travels over one TCP connection as a 6-byte header (body length, 4 bytes
big-endian; MAC length, 2 bytes: 0 or 32), a msgpack map (the body) and, when the connectors
share a secret, an HMAC-SHA256 of the body. Every body carries ``v`` (protocol version), ``op``,
``n`` (16 random bytes, the nonce) and ``ts`` (the sender's wall clock, seconds); replies add
``re``, the nonce of the request they answer. The MAC covers the whole body, so nonce and
timestamp are authenticated with the rest. Bodies are bounded (``max_message_bytes``, 4 KiB
unless the engine asks for more: a larger header closes the connection before anything is
buffered), MAC-checked before they are parsed, parsed with msgpack limits, then checked against
the schema (types, non-negative ints, bounded strings), all before anything else looks at them.

Channels. A client opens one connection per thread and server and first sends ``hello`` with its
self-description (``peer``: for the Transfer Engine its session and the address range of its
receive pool). The server answers ``welcome`` with a fresh random channel token and keeps
``(token, peer)`` with that connection, and only as long as the connection lives. Every later
request must come on that connection and carry that token; requests from anywhere else get no
answer. Handlers see the channel's ``peer``, so an engine can refuse a pull that would write
outside the memory its requester declared.

Admission (:class:`ServerLimits`). The server caps connections in total and per peer address,
drops a connection that has not completed its ``hello`` within the handshake timeout or that
sent anything invalid before it, closes channels idle past the idle timeout, and turns on TCP
keepalive (the heartbeat) so a vanished peer's connection goes too. New connections never evict
a channel: past a cap they evict the oldest connection still without a channel, or are refused.

Replay protection (with a secret). The server (and the client, for replies) rejects a timestamp
more than ``window_s`` (default 30 s) away from its own clock and a nonce it has already accepted
within the window (nonces are remembered for twice the window, the longest time in which a
timestamp can still pass). A message captured on the wire and re-sent byte for byte, from
another connection or the same one, is dropped without an answer and changes nothing; after a
server restart the old channel tokens are unknown, so captured requests fail there too.

Rejected messages are counted (``rejected``) and logged at WARNING, rate-limited
(:class:`omnikv._logging.RateLimitedLog`: a few lines per interval, then one summary line with
the count); nothing is answered to them.

Using it (an engine connector)::

    SCHEMA = Schema(requests={"query": {"key": str, "wait_ms": int}, ...},
                    replies={"info": {"found": bool, "size": int}, ...},
                    hello={"agent": str, "md": bytes})          # what a receiver declares
    codec = ControlCodec(SCHEMA, secret, window_s=30.0, max_message_bytes=64 << 10)
    # sender: handler(req) runs on the listener thread; answer from any thread
    server = ControlServer(codec, (host, port), handler, tick=tick, name="omnikv-x",
                           limits=ServerLimits())
    server.start(); ...; server.answer(req, {"op": "info", "found": True, "size": n})
    # receiver: one channel per thread and sender, opened with the hello
    client = ControlClient(codec, {"agent": name, "md": metadata})
    chan = client.channel((host, port), timeout_s)   # None: no welcome (wrong secret, down)
    reply = chan.request({"op": "query", "key": k, "wait_ms": 0}, timeout_s)
    # close: server.close(); client.close()

``req.peer`` is what that receiver declared in its hello: check every request against it.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import math
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

from omnikv.connectors.boundary import ErrorMap, ErrorRule
from omnikv.errors import ConnectorUnavailableError, ProtocolError

__all__ = [
    "CONTROL_ERRORS",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DEFAULT_WINDOW_S",
    "FRAME_HEADER",
    "MAC_BYTES",
    "PROTOCOL_VERSION",
    "ControlCodec",
    "Endpoint",
    "MessageReader",
    "ReplayGuard",
    "Request",
    "Schema",
    "ServerLimits",
    "pack_message",
    "set_keepalive",
]

#: The control plane's boundary (used by the NIXL connector around its control calls; the
#: Transfer Engine connector's table covers the same sockets): a failed socket call is
#: ``ConnectorUnavailableError``. A malformed or forged message is not an error of a call: it is
#: dropped and counted (``ProtocolError`` never leaves the client or the server).
CONTROL_ERRORS = ErrorMap(
    "control channel",
    (ErrorRule(OSError, ConnectorUnavailableError),),
)

PROTOCOL_VERSION = 2
DEFAULT_MAX_MESSAGE_BYTES = 4096
DEFAULT_WINDOW_S = 30.0
NONCE_BYTES = 16
TOKEN_BYTES = 16
MAC_BYTES = 32
MAX_STR_CHARS = 1024
MAX_REPLAY_ENTRIES = 1 << 17
#: Header of every message on a connection: body length, MAC length (0 or ``MAC_BYTES``).
FRAME_HEADER = struct.Struct("!IH")

Fields = Mapping[str, type | tuple[type, ...]]
#: A further check of one op's message, after its fields' types: raises ``ProtocolError``.
Check = Callable[[Mapping[str, Any]], None]
Endpoint = tuple[str, int]

# Messages every engine shares; an engine's Schema adds its own.
_BASE_REQUESTS: dict[str, Fields] = {"hello": {"peer": dict}, "ping": {}}
_BASE_REPLIES: dict[str, Fields] = {"welcome": {"tok": bytes}, "pong": {}, "error": {"reason": str}}
_ENVELOPE: Fields = {"n": bytes, "ts": float}


@dataclass(frozen=True)
class Schema:
    """The messages of one engine's control protocol.

    ``requests`` (client to server) and ``replies`` (server to client) map an op to its fields
    and their types (``str``, ``int`` (non-negative), ``bool``, ``bytes``, ``float``, ``dict``);
    ``hello`` gives the fields of the client's self-description. ``hello``/``welcome``,
    ``ping``/``pong`` and ``error`` are added by the control plane itself. ``checks`` (optional)
    maps an op to a further check of its message (value ranges, tighter bounds), run by the
    codec after the types: a message that fails it is rejected like a malformed one.
    """

    requests: Mapping[str, Fields]
    replies: Mapping[str, Fields]
    hello: Fields
    checks: Mapping[str, Check] = field(default_factory=dict)

    def request_ops(self) -> dict[str, Fields]:
        return {**_BASE_REQUESTS, **self.requests}

    def reply_ops(self) -> dict[str, Fields]:
        return {**_BASE_REPLIES, **self.replies}


def _check_field(op: str, name: str, value: Any, kind: type | tuple[type, ...]) -> None:
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        got = type(value).__name__
        raise ProtocolError(f"{op}: field {name!r} must be {kind}, got {got}")
    if isinstance(value, int) and not isinstance(value, bool) and value < 0:
        raise ProtocolError(f"{op}: field {name!r} must be >= 0")
    if isinstance(value, str) and len(value) > MAX_STR_CHARS:
        raise ProtocolError(f"{op}: field {name!r} longer than {MAX_STR_CHARS}")


def _check_fields(op: str, msg: Mapping[str, Any], fields: Fields) -> None:
    for name, kind in fields.items():
        _check_field(op, name, msg.get(name), kind)


def validate(
    msg: Any,
    ops: Mapping[str, Fields],
    hello: Fields,
    checks: Mapping[str, Check] | None = None,
) -> dict[str, Any]:
    """Check a decoded body against the envelope, the op's fields and its ``checks`` entry;
    returns it or raises ``ProtocolError``."""
    if not isinstance(msg, dict):
        raise ProtocolError("control message is not a map")
    if msg.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(f"unsupported protocol version {msg.get('v')!r}")
    op = msg.get("op")
    if not isinstance(op, str) or op not in ops:
        raise ProtocolError(f"unexpected op {op!r}")
    _check_fields(op, msg, _ENVELOPE)
    if len(msg["n"]) != NONCE_BYTES:
        raise ProtocolError(f"nonce must be {NONCE_BYTES} bytes")
    if "re" in msg and not (isinstance(msg["re"], bytes) and len(msg["re"]) == NONCE_BYTES):
        raise ProtocolError("malformed reply reference")
    _check_fields(op, msg, ops[op])
    if op == "hello":
        _check_fields("hello.peer", msg["peer"], hello)
    check = None if checks is None else checks.get(op)
    if check is not None:
        check(msg)
    return msg


class ReplayGuard:
    """Rejects timestamps outside ``+-window_s`` and nonces already accepted within the window.

    Thread-safe; remembers at most ``max_entries`` nonces (then refuses new messages until old
    ones expire: only authenticated messages reach it, so a full table means a flooding peer).
    """

    def __init__(self, window_s: float = DEFAULT_WINDOW_S, max_entries: int = MAX_REPLAY_ENTRIES):
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self._max = max_entries
        self._seen: collections.OrderedDict[bytes, float] = collections.OrderedDict()
        self._lock = threading.Lock()

    def check(self, nonce: bytes, ts: float, *, now: float | None = None) -> None:
        wall = time.time() if now is None else now
        if not math.isfinite(ts) or abs(wall - ts) > self.window_s:
            raise ProtocolError(f"timestamp {ts:.3f} outside +-{self.window_s:g}s of {wall:.3f}")
        mono = time.monotonic()
        with self._lock:
            while self._seen:
                oldest, expires = next(iter(self._seen.items()))
                if expires > mono:
                    break
                del self._seen[oldest]
            if nonce in self._seen:
                raise ProtocolError("replayed nonce")
            if len(self._seen) >= self._max:
                raise ProtocolError("replay table full")
            self._seen[nonce] = mono + 2 * self.window_s

    def __len__(self) -> int:
        with self._lock:
            return len(self._seen)


class ControlCodec:
    """Encodes and checks control messages: envelope, optional HMAC, bounds, schema, replays."""

    def __init__(
        self,
        schema: Schema,
        secret: bytes | None,
        *,
        window_s: float = DEFAULT_WINDOW_S,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        self.schema = schema
        self._secret = secret or None
        self._guard = ReplayGuard(window_s)
        self.max_message_bytes = max_message_bytes
        self._requests = schema.request_ops()
        self._replies = schema.reply_ops()

    @property
    def authenticated(self) -> bool:
        return self._secret is not None

    def _mac(self, body: bytes) -> bytes:
        assert self._secret is not None
        return hmac.new(self._secret, body, hashlib.sha256).digest()

    def encode(
        self, msg: Mapping[str, Any], reply_to: bytes | None = None
    ) -> tuple[bytes, list[bytes]]:
        """``(nonce, frames)`` for ``msg`` with a fresh nonce and the current time."""
        nonce = os.urandom(NONCE_BYTES)
        body_map = {**msg, "v": PROTOCOL_VERSION, "n": nonce, "ts": time.time()}
        if reply_to is not None:
            body_map["re"] = reply_to
        body: bytes = msgpack.packb(body_map, use_bin_type=True)
        if len(body) > self.max_message_bytes:
            raise ValueError(f"control message of {len(body)} bytes over {self.max_message_bytes}")
        return nonce, [body] if self._secret is None else [body, self._mac(body)]

    def decode_request(self, frames: list[bytes]) -> dict[str, Any]:
        return self._decode(frames, self._requests)

    def decode_reply(self, frames: list[bytes]) -> dict[str, Any]:
        return self._decode(frames, self._replies)

    def _decode(self, frames: list[bytes], ops: Mapping[str, Fields]) -> dict[str, Any]:
        if not frames or len(frames[0]) > self.max_message_bytes:
            raise ProtocolError("empty or oversized control message")
        body = frames[0]
        if self._secret is not None:
            if len(frames) != 2 or len(frames[1]) != MAC_BYTES:
                raise ProtocolError("unauthenticated control message")
            if not hmac.compare_digest(self._mac(body), frames[1]):
                raise ProtocolError("bad control message signature")
        elif len(frames) != 1:
            raise ProtocolError("unexpected extra frames")
        limit = self.max_message_bytes
        try:
            raw = msgpack.unpackb(
                body,
                raw=False,
                strict_map_key=True,
                max_bin_len=limit,
                max_str_len=limit,
                max_array_len=256,
                max_map_len=64,
                max_ext_len=0,
            )
        except (
            ValueError,
            TypeError,
            msgpack.ExtraData,
            msgpack.FormatError,
            msgpack.StackError,
        ) as exc:
            raise ProtocolError(f"undecodable control message: {exc}") from exc
        msg = validate(raw, ops, self.schema.hello, self.schema.checks)
        if self._secret is not None:
            self._guard.check(msg["n"], msg["ts"])
        return msg


# -- framing ---------------------------------------------------------------------------------------
def pack_message(frames: Sequence[bytes]) -> bytes:
    """One message as it goes on a connection: header, body and (when signed) the MAC."""
    body = frames[0]
    mac = frames[1] if len(frames) > 1 else b""
    return FRAME_HEADER.pack(len(body), len(mac)) + body + mac


class MessageReader:
    """Splits the bytes of one connection into messages (``[body]`` or ``[body, mac]``).

    Used by the server (per connection) and the client (per channel). A header announcing a body
    over ``max_body`` bytes or a MAC of another length than ``MAC_BYTES`` raises
    :class:`ProtocolError` before anything of it is buffered: the caller closes the connection.
    Holds at most one message plus what arrived after it.
    """

    __slots__ = ("_buf", "_max")

    def __init__(self, max_body: int) -> None:
        self._buf = bytearray()
        self._max = max_body

    def feed(self, data: bytes) -> None:
        self._buf += data

    @property
    def buffered(self) -> int:
        return len(self._buf)

    def next(self) -> list[bytes] | None:
        """The next complete message, or ``None`` until more bytes arrive."""
        buf = self._buf
        if len(buf) < FRAME_HEADER.size:
            return None
        body_len, mac_len = FRAME_HEADER.unpack_from(buf)
        if body_len > self._max or mac_len not in (0, MAC_BYTES):
            raise ProtocolError(
                f"message header announces {body_len} bytes (max {self._max}) and a "
                f"{mac_len}-byte MAC"
            )
        end = FRAME_HEADER.size + body_len + mac_len
        if len(buf) < end:
            return None
        body = bytes(buf[FRAME_HEADER.size : FRAME_HEADER.size + body_len])
        frames = [body, bytes(buf[FRAME_HEADER.size + body_len : end])] if mac_len else [body]
        del buf[:end]
        return frames


def set_keepalive(sock: socket.socket, interval_s: float) -> None:
    """TCP keepalive as the connection's heartbeat: probes after ``interval_s`` of silence, then
    every ``interval_s``; three unanswered probes close the connection (server and client)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    secs = max(1, round(interval_s))
    for name, value in (("TCP_KEEPIDLE", secs), ("TCP_KEEPINTVL", secs), ("TCP_KEEPCNT", 3)):
        opt = getattr(socket, name, None)
        if opt is not None:
            sock.setsockopt(socket.IPPROTO_TCP, opt, value)


# -- what the server hands its engine, and how it admits connections --------------------------
@dataclass(frozen=True)
class Request:
    """A validated request on an established channel (handed to the engine's handler)."""

    ident: bytes
    op: str
    msg: dict[str, Any]
    peer: Mapping[str, Any]

    @property
    def nonce(self) -> bytes:
        n: bytes = self.msg["n"]
        return n


@dataclass(frozen=True)
class ServerLimits:
    """How a control server admits and keeps connections (config keys of the pull connectors).

    * ``max_connections`` (``max_connections``, 1024): open connections in total; the server
      lowers it to half the file descriptors left under ``RLIMIT_NOFILE`` at start, so a flood
      never takes the descriptors its engine needs;
    * ``max_connections_per_peer`` (``max_connections_per_peer``, 64): per peer IP address;
    * ``handshake_timeout_s`` (``handshake_timeout_seconds``, 5): time from accept to a valid
      ``hello``; a connection past it, or one that sends anything invalid before it, is dropped;
    * ``idle_timeout_s`` (``idle_timeout_seconds``, 300): a channel without traffic either way
      for this long is closed (its client reconnects and says hello again on next use); keep it
      above the long-poll hold (5 s);
    * ``heartbeat_s`` (``heartbeat_seconds``, 10): TCP keepalive of every connection.

    Past a cap, a new connection evicts the oldest connection that has no channel yet (of that
    peer for the per-peer cap) or, when there is none, is refused: live channels are never
    evicted by new connections.
    """

    max_connections: int = 1024
    max_connections_per_peer: int = 64
    handshake_timeout_s: float = 5.0
    idle_timeout_s: float = 300.0
    heartbeat_s: float = 10.0

    def __post_init__(self) -> None:
        if self.max_connections < 1 or self.max_connections_per_peer < 1:
            raise ValueError("connection limits must be >= 1")
        for name in ("handshake_timeout_s", "idle_timeout_s", "heartbeat_s"):
            value = getattr(self, name)
            if not 0 < value < math.inf:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
