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
buffered), MAC-checked before they are parsed, then decoded by msgspec into the op's typed
Struct (:class:`Schema`: field types, non-negative ints, strings of at most
:data:`MAX_STR_CHARS`, 16-byte nonces, no unknown field), all before anything else looks at them.
The Structs list the envelope after the op's own fields, so the bytes are those of a msgpack map
in that order (the format of earlier versions, unchanged).

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
keepalive (the heartbeat) so a vanished peer's connection goes too. Past a cap a new connection
evicts the oldest connection still without a channel, else the oldest channel its engine never
vouched for (granted nothing only a genuine peer gets), or is refused: a channel that was granted
a pull, a lease or a published key's size is never evicted by new connections.

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

    class Query(msgspec.Struct):                                 # one op's fields, typed
        key: Str
        wait_ms: UInt

    SCHEMA = Schema(requests={"query": Query, ...},
                    replies={"info": {"found": bool, "size": int}, ...},  # the short form
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
from typing import Annotated, Any, Literal, Union

import msgspec

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
    "Spec",
    "Str",
    "UInt",
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

#: A string field of a control message (at most :data:`MAX_STR_CHARS` characters).
Str = Annotated[str, msgspec.Meta(max_length=MAX_STR_CHARS)]
#: An integer field of a control message (non-negative).
UInt = Annotated[int, msgspec.Meta(ge=0)]
_Nonce = Annotated[bytes, msgspec.Meta(min_length=NONCE_BYTES, max_length=NONCE_BYTES)]

#: One op's fields: a ``msgspec.Struct`` class (its fields, in order, with their types and
#: limits) or, in the short form, a mapping of field names to ``str`` / ``int`` / ``bool`` /
#: ``bytes`` / ``float`` (read as :data:`Str`, :data:`UInt` and the others as they are).
Fields = Mapping[str, type]
Spec = Fields | type[msgspec.Struct]
#: A further check of one op's message, after its fields' types: raises ``ProtocolError``.
Check = Callable[[Mapping[str, Any]], None]
Endpoint = tuple[str, int]


class Welcome(msgspec.Struct):
    tok: bytes


class Failure(msgspec.Struct):
    reason: Str


class _Empty(msgspec.Struct):
    pass


# Messages every engine shares; an engine's Schema adds its own (``hello``'s ``peer`` is the
# engine's hello Struct).
_BASE_REQUESTS: dict[str, Spec] = {"ping": _Empty}
_BASE_REPLIES: dict[str, Spec] = {"welcome": Welcome, "pong": _Empty, "error": Failure}
_SHORT = {str: Str, int: UInt}
_Token = Annotated[bytes, msgspec.Meta(min_length=TOKEN_BYTES, max_length=TOKEN_BYTES)]
#: A request on a channel carries the channel's token (``tok``) after its own fields.
_CHANNEL: list[tuple[str, Any] | tuple[str, Any, Any]] = [
    ("tok", Union[_Token, None], None),  # noqa: UP007 - a runtime type expression
]
_ENVELOPE: list[tuple[str, Any] | tuple[str, Any, Any]] = [
    ("v", Literal[PROTOCOL_VERSION]),
    ("n", _Nonce),
    ("ts", float),
    ("re", Union[_Nonce, None], None),  # noqa: UP007 - a runtime type expression
]


def _fields(spec: Spec) -> list[tuple[str, Any] | tuple[str, Any, Any]]:
    """``spec``'s fields as ``defstruct`` takes them, in order."""
    if isinstance(spec, type) and issubclass(spec, msgspec.Struct):
        out: list[tuple[str, Any] | tuple[str, Any, Any]] = []
        for f in msgspec.structs.fields(spec):
            out.append((f.name, f.type) if f.required else (f.name, f.type, f.default))
        return out
    return [(name, _SHORT.get(kind, kind)) for name, kind in spec.items()]


def _wire_struct(
    op: str, spec: Spec, *, request: bool, peer: type[msgspec.Struct] | None = None
) -> type[msgspec.Struct]:
    """The Struct of ``op`` on the wire: a map tagged ``op``, the op's fields, the channel
    token (a request's ``tok``), then the envelope (``v``, ``n``, ``ts``, ``re`` when it
    answers a request)."""
    fields: list[tuple[str, Any] | tuple[str, Any, Any]] = (
        _fields(spec) if peer is None else [("peer", peer)]
    )
    return msgspec.defstruct(
        f"Wire_{op}",
        fields + (_CHANNEL if request else []) + _ENVELOPE,
        tag_field="op",
        tag=op,
        kw_only=True,
        omit_defaults=True,
        forbid_unknown_fields=True,
    )


def _as_dict(obj: msgspec.Struct) -> dict[str, Any]:
    """A decoded message as the engines read it: ``op``, its fields and the envelope (``re``
    only on a reply, ``tok`` only when sent; ``peer`` as a mapping)."""
    info = msgspec.inspect.type_info(type(obj))
    assert isinstance(info, msgspec.inspect.StructType)
    out: dict[str, Any] = {"op": info.tag}
    for name in obj.__struct_fields__:
        value = getattr(obj, name)
        if name in ("re", "tok") and value is None:
            continue
        out[name] = msgspec.structs.asdict(value) if isinstance(value, msgspec.Struct) else value
    return out


@dataclass(frozen=True)
class Schema:
    """The messages of one engine's control protocol.

    ``requests`` (client to server) and ``replies`` (server to client) map an op to its fields
    (:data:`Spec`: a ``msgspec.Struct`` with the types and limits of its fields, or the short
    form); ``hello`` gives the fields of the client's self-description (``peer``).
    ``hello``/``welcome``, ``ping``/``pong`` and ``error`` are added by the control plane
    itself. ``checks`` (optional) maps an op to a further check of its message (value ranges,
    tighter bounds), run by the codec after the types: a message that fails it is rejected
    like a malformed one.
    """

    requests: Mapping[str, Spec]
    replies: Mapping[str, Spec]
    hello: Spec
    checks: Mapping[str, Check] = field(default_factory=dict)

    def request_structs(self) -> dict[str, type[msgspec.Struct]]:
        """Every request op's wire Struct (``hello`` and ``ping`` included)."""
        peer = msgspec.defstruct("Peer", _fields(self.hello), forbid_unknown_fields=True)
        ops = {
            op: _wire_struct(op, spec, request=True)
            for op, spec in {**_BASE_REQUESTS, **self.requests}.items()
        }
        return {"hello": _wire_struct("hello", {}, request=True, peer=peer), **ops}

    def reply_structs(self) -> dict[str, type[msgspec.Struct]]:
        """Every reply op's wire Struct (``welcome``, ``pong`` and ``error`` included)."""
        return {
            op: _wire_struct(op, spec, request=False)
            for op, spec in {**_BASE_REPLIES, **self.replies}.items()
        }


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
        self._requests = schema.request_structs()
        self._replies = schema.reply_structs()
        self._encoder = msgspec.msgpack.Encoder()
        self._request_decoder = _decoder(self._requests)
        self._reply_decoder = _decoder(self._replies)

    @property
    def authenticated(self) -> bool:
        return self._secret is not None

    def _mac(self, body: bytes) -> bytes:
        assert self._secret is not None
        return hmac.new(self._secret, body, hashlib.sha256).digest()

    def encode(
        self, msg: Mapping[str, Any], reply_to: bytes | None = None
    ) -> tuple[bytes, list[bytes]]:
        """``(nonce, frames)`` for ``msg`` with a fresh nonce and the current time.

        Encoded through its op's Struct (the bytes of a msgpack map: the op, its fields in
        the Struct's order, the token, the envelope). A message that does not fit its Struct
        (an unknown op, a missing or extra field) is encoded as the map it is, in its own
        order, as earlier versions did: the receiving side refuses it (tests forge with it)."""
        nonce = os.urandom(NONCE_BYTES)
        envelope: dict[str, Any] = {"v": PROTOCOL_VERSION, "n": nonce, "ts": time.time()}
        if reply_to is not None:
            envelope["re"] = reply_to
        first, then = (
            (self._replies, self._requests) if reply_to else (self._requests, self._replies)
        )
        wire = first.get(msg.get("op", "")) or then.get(msg.get("op", ""))
        fields = {k: v for k, v in msg.items() if k != "op"}
        try:
            if wire is None:
                raise TypeError(f"unknown op {msg.get('op')!r}")
            body = self._encoder.encode(wire(**fields, **envelope))
        except TypeError:
            body = self._encoder.encode({**msg, **envelope})
        if len(body) > self.max_message_bytes:
            raise ValueError(f"control message of {len(body)} bytes over {self.max_message_bytes}")
        return nonce, [body] if self._secret is None else [body, self._mac(body)]

    def decode_request(self, frames: list[bytes]) -> dict[str, Any]:
        return self._decode(frames, self._request_decoder)

    def decode_reply(self, frames: list[bytes]) -> dict[str, Any]:
        return self._decode(frames, self._reply_decoder)

    def _decode(self, frames: list[bytes], decoder: msgspec.msgpack.Decoder[Any]) -> dict[str, Any]:
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
        try:
            msg = _as_dict(decoder.decode(body))
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ProtocolError(f"invalid control message: {exc}") from exc
        check = self.schema.checks.get(msg["op"])
        if check is not None:
            check(msg)
        if self._secret is not None:
            self._guard.check(msg["n"], msg["ts"])
        return msg


def _decoder(structs: Mapping[str, type[msgspec.Struct]]) -> msgspec.msgpack.Decoder[Any]:
    """One decoder for a tagged union of ``structs`` (by ``op``)."""
    kinds = tuple(structs.values())
    return msgspec.msgpack.Decoder(Union[kinds])  # type: ignore[valid-type]  # noqa: UP007


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
    peer for the per-peer cap), else the oldest channel its engine never vouched for
    (:meth:`~omnikv.connectors.pull.server.ControlServer.vouch`: granted nothing only a genuine
    peer gets), or, when there is none, is refused: channels that were granted something are
    never evicted by new connections, and strangers (who can say hello without a secret) cannot
    hold the slots a genuine peer needs.
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
