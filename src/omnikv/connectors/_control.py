"""The control plane of pull-model engines (Mooncake Transfer Engine, NIXL): msgpack over pyzmq.

One implementation of the wire rules, the authentication and the replay protection, used by
every pull-model connector; each engine only declares the fields of its own messages
(:class:`Schema`) and handles the requests that reach it.

Wire format. A message is one or two zmq frames: a msgpack map (the body) and, when the
connectors share a secret, an HMAC-SHA256 of the body. Every body carries ``v`` (protocol
version), ``op``, ``n`` (16 random bytes, the nonce) and ``ts`` (the sender's wall clock,
seconds); replies add ``re``, the nonce of the request they answer. The MAC covers the whole
body, so nonce and timestamp are authenticated with the rest. Bodies are bounded
(``max_message_bytes``, 4 KiB unless the engine asks for more), MAC-checked before they are
parsed, parsed with msgpack limits, then checked against the schema (types, non-negative ints,
bounded strings), all before anything else looks at them.

Channels. A client opens one DEALER socket per thread and server and first sends ``hello`` with
its self-description (``peer``: for the Transfer Engine its session and the address range of its
receive pool). The server answers ``welcome`` with a fresh random channel token and remembers
``(zmq routing id -> token, peer)``. Every later request must come from that routing id and carry
that token; requests from anywhere else get no answer. Handlers see the channel's ``peer``, so an
engine can refuse a pull that would write outside the memory its requester declared.

Replay protection (with a secret). The server (and the client, for replies) rejects a timestamp
more than ``window_s`` (default 30 s) away from its own clock and a nonce it has already accepted
within the window (nonces are remembered for twice the window, the longest time in which a
timestamp can still pass). A message captured on the wire and re-sent byte for byte, from
another socket or the same one, is dropped without an answer and changes nothing; after a
server restart the old channel tokens are unknown, so captured requests fail there too.

Rejected messages are counted (``rejected``) and logged at WARNING; nothing is answered to them.

Using it (an engine connector)::

    SCHEMA = Schema(requests={"query": {"key": str, "wait_ms": int}, ...},
                    replies={"info": {"found": bool, "size": int}, ...},
                    hello={"agent": str, "md": bytes})          # what a receiver declares
    codec = ControlCodec(SCHEMA, secret, window_s=30.0, max_message_bytes=64 << 10)
    # sender: handler(req) runs on the listener thread; answer from any thread
    server = ControlServer(zmq_ctx, codec, (host, port), handler, tick=tick, name="omnikv-x")
    server.start(); ...; server.answer(req, {"op": "info", "found": True, "size": n})
    # receiver: one channel per thread and sender, opened with the hello
    client = ControlClient(zmq_ctx, codec, {"agent": name, "md": metadata})
    chan = client.channel((host, port), timeout_s)   # None: no welcome (wrong secret, down)
    reply = chan.request({"op": "query", "key": k, "wait_ms": 0}, timeout_s)
    # close: server.close(); client.close(); zmq_ctx.destroy(linger=0)

``req.peer`` is what that receiver declared in its hello: check every request against it.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import hmac
import logging
import math
import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgpack

from omnikv.errors import ConnectorUnavailableError

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DEFAULT_WINDOW_S",
    "PROTOCOL_VERSION",
    "Channel",
    "ControlClient",
    "ControlCodec",
    "ControlServer",
    "Endpoint",
    "ProtocolError",
    "ReplayGuard",
    "Request",
    "Schema",
]

logger = logging.getLogger(__name__)

PROTOCOL_VERSION = 2
DEFAULT_MAX_MESSAGE_BYTES = 4096
DEFAULT_WINDOW_S = 30.0
NONCE_BYTES = 16
TOKEN_BYTES = 16
MAC_BYTES = 32
MAX_STR_CHARS = 1024
MAX_REPLAY_ENTRIES = 1 << 17
MAX_PEERS = 4096
_LOUD_REJECTS = 10

Fields = Mapping[str, type | tuple[type, ...]]
Endpoint = tuple[str, int]

# Messages every engine shares; an engine's Schema adds its own.
_BASE_REQUESTS: dict[str, Fields] = {"hello": {"peer": dict}, "ping": {}}
_BASE_REPLIES: dict[str, Fields] = {"welcome": {"tok": bytes}, "pong": {}, "error": {"reason": str}}
_ENVELOPE: Fields = {"n": bytes, "ts": float}


class ProtocolError(ValueError):
    """A control message failed authentication or validation (dropped and counted)."""


@dataclass(frozen=True)
class Schema:
    """The messages of one engine's control protocol.

    ``requests`` (client to server) and ``replies`` (server to client) map an op to its fields
    and their types (``str``, ``int`` (non-negative), ``bool``, ``bytes``, ``float``, ``dict``);
    ``hello`` gives the fields of the client's self-description. ``hello``/``welcome``,
    ``ping``/``pong`` and ``error`` are added by the control plane itself.
    """

    requests: Mapping[str, Fields]
    replies: Mapping[str, Fields]
    hello: Fields

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


def validate(msg: Any, ops: Mapping[str, Fields], hello: Fields) -> dict[str, Any]:
    """Check a decoded body against the envelope and the op's fields; returns it or raises."""
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
        msg = validate(raw, ops, self.schema.hello)
        if self._secret is not None:
            self._guard.check(msg["n"], msg["ts"])
        return msg


# -- server ----------------------------------------------------------------------------------------
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


@dataclass
class _Channel:
    token: bytes
    peer: dict[str, Any]


Handler = Callable[[Request], None]
Tick = Callable[[], float]


class ControlServer:
    """A ROUTER socket served by one listener thread.

    ``handler`` runs on the listener thread for every valid request on an established channel
    (except ``ping``, answered here) and must not block; it answers through :meth:`reply` (any
    thread). ``tick`` (optional) runs after every loop turn and returns the seconds until it
    wants to run again (long-poll expiries, TTL sweeps). Construction binds the socket or raises
    :class:`~omnikv.errors.ConnectorUnavailableError`, leaving no socket open.
    """

    def __init__(
        self,
        ctx: Any,
        codec: ControlCodec,
        address: Endpoint,
        handler: Handler,
        *,
        tick: Tick | None = None,
        name: str = "omnikv-control",
        max_peers: int = MAX_PEERS,
    ) -> None:
        import zmq

        self._zmq = zmq
        self._codec = codec
        self._handler = handler
        self._tick = tick
        self._name = name
        self._max_peers = max_peers
        self._channels: collections.OrderedDict[bytes, _Channel] = collections.OrderedDict()
        self._outbox: collections.deque[tuple[bytes, list[bytes]]] = collections.deque()
        self._stop = threading.Event()
        self._wake_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.rejected = 0
        self._sockets: list[Any] = []
        try:
            self._router = self._open(ctx, zmq.ROUTER)
            self._router.setsockopt(zmq.MAXMSGSIZE, codec.max_message_bytes + 256)
            self._router.setsockopt(zmq.ROUTER_MANDATORY, 0)
            self._bind(address)
            wake_addr = f"inproc://{name}-{uuid.uuid4().hex}"
            self._wake_pull = self._open(ctx, zmq.PULL)
            self._wake_pull.bind(wake_addr)
            self._wake_push = self._open(ctx, zmq.PUSH)
            self._wake_push.connect(wake_addr)
        except BaseException:
            self._close_sockets()
            raise

    def _open(self, ctx: Any, kind: int) -> Any:
        sock = ctx.socket(kind)
        sock.setsockopt(self._zmq.LINGER, 0)
        self._sockets.append(sock)
        return sock

    def _bind(self, address: Endpoint) -> None:
        url = f"tcp://{address[0]}:{address[1]}"
        try:
            self._router.bind(url)
        except self._zmq.ZMQError as exc:
            raise ConnectorUnavailableError(f"cannot bind the control socket {url}: {exc}") from exc

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._listen, name=f"{self._name}-listener", daemon=True
        )
        self._thread.start()

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    def wake(self) -> None:
        """Make the listener run a loop turn now (e.g. after a put, for long-polls)."""
        with self._wake_lock, contextlib.suppress(self._zmq.ZMQError):
            self._wake_push.send(b"", self._zmq.NOBLOCK)

    def reply(self, ident: bytes, request_nonce: bytes, msg: Mapping[str, Any]) -> None:
        """Queue the answer to a request (thread-safe; sent by the listener)."""
        _, frames = self._codec.encode(msg, reply_to=request_nonce)
        self._outbox.append((ident, frames))
        self.wake()

    def answer(self, req: Request, msg: Mapping[str, Any]) -> None:
        self.reply(req.ident, req.nonce, msg)

    def close(self, timeout: float = 5.0) -> None:
        """Stop and join the listener, then close the sockets. Idempotent."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            self.wake()
            thread.join(timeout=timeout)
            if thread.is_alive():
                logger.error("%s listener did not stop within %.1fs", self._name, timeout)
                return
        self._close_sockets()

    def _close_sockets(self) -> None:
        with self._wake_lock:
            for sock in self._sockets:
                with contextlib.suppress(Exception):
                    sock.close(0)
            self._sockets.clear()

    # -- listener thread ---------------------------------------------------------------------------
    def _listen(self) -> None:
        zmq = self._zmq
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_pull, zmq.POLLIN)
        timeout = 1.0
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(max(0, math.ceil(min(timeout, 1.0) * 1000))))
                if self._wake_pull in events:
                    self._drain_wakes()
                if self._router in events:
                    self._receive_batch()
                timeout = self._tick() if self._tick is not None else 1.0
                self._flush_outbox()
        except Exception:
            logger.exception("%s listener failed", self._name)

    def _drain_wakes(self) -> None:
        with contextlib.suppress(self._zmq.Again):
            for _ in range(1024):
                self._wake_pull.recv(self._zmq.NOBLOCK)

    def _receive_batch(self) -> None:
        for _ in range(256):
            try:
                frames = self._router.recv_multipart(self._zmq.NOBLOCK)
            except self._zmq.Again:
                return
            self._handle(frames)

    def _flush_outbox(self) -> None:
        while self._outbox:
            ident, frames = self._outbox.popleft()
            with contextlib.suppress(self._zmq.ZMQError):
                self._router.send_multipart([ident, *frames], self._zmq.NOBLOCK)

    def _reject(self, why: str) -> None:
        self.rejected += 1
        # the first few at WARNING, then one in a thousand: a flood must not flood the log
        if self.rejected <= _LOUD_REJECTS or self.rejected % 1000 == 0:
            logger.warning(
                "%s rejected a control message (%d so far): %s", self._name, self.rejected, why
            )
        else:
            logger.debug("%s rejected a control message: %s", self._name, why)

    def _handle(self, frames: list[bytes]) -> None:
        if len(frames) < 2:
            self._reject("no routing id")
            return
        ident = frames[0]
        try:
            msg = self._codec.decode_request(frames[1:])
        except ProtocolError as exc:
            self._reject(str(exc))
            return
        if msg["op"] == "hello":
            self._welcome(ident, msg)
            return
        chan = self._channels.get(ident)
        tok = msg.get("tok")
        if chan is None or not isinstance(tok, bytes) or not hmac.compare_digest(tok, chan.token):
            self._reject(f"{msg['op']} outside an established channel")
            return
        self._channels.move_to_end(ident)
        if msg["op"] == "ping":
            self.reply(ident, msg["n"], {"op": "pong"})
            return
        self._handler(Request(ident, msg["op"], msg, chan.peer))

    def _welcome(self, ident: bytes, msg: dict[str, Any]) -> None:
        token = os.urandom(TOKEN_BYTES)
        self._channels[ident] = _Channel(token, dict(msg["peer"]))
        self._channels.move_to_end(ident)
        while len(self._channels) > self._max_peers:
            self._channels.popitem(last=False)
        self.reply(ident, msg["n"], {"op": "welcome", "tok": token})


# -- client ----------------------------------------------------------------------------------------
class Channel:
    """One DEALER socket to one server, owned by one thread, after a completed hello."""

    def __init__(self, client: ControlClient, sock: Any, token: bytes) -> None:
        self._client = client
        self.sock = sock
        self.token = token

    def send(self, msg: Mapping[str, Any]) -> bytes:
        """Send a request on this channel; returns its nonce (match replies with it)."""
        nonce, frames = self._client.codec.encode({**msg, "tok": self.token})
        self.sock.send_multipart(frames)
        return nonce

    def recv(
        self, nonces: set[bytes] | frozenset[bytes], timeout_s: float
    ) -> dict[str, Any] | None:
        """The next valid reply to one of ``nonces`` within ``timeout_s``; ``None`` otherwise."""
        return self._client.recv(self.sock, nonces, timeout_s)

    def request(self, msg: Mapping[str, Any], timeout_s: float) -> dict[str, Any] | None:
        return self.recv({self.send(msg)}, timeout_s)


class ControlClient:
    """Channels to servers, one per (thread, endpoint), each opened with a ``hello``.

    ``hello`` is this client's self-description (the schema's hello fields). A channel whose
    server stays silent should be dropped with :meth:`discard`, so the next call reconnects and
    says hello again (a restarted server knows no old channel).
    """

    def __init__(self, ctx: Any, codec: ControlCodec, hello: Mapping[str, Any]) -> None:
        import zmq

        self._zmq = zmq
        self._ctx = ctx
        self.codec = codec
        self._hello = dict(hello)
        self._tls = threading.local()
        self._sockets: set[Any] = set()
        self._lock = threading.Lock()
        self._closed = False
        self.rejected = 0

    def _mine(self) -> dict[Endpoint, Channel]:
        chans: dict[Endpoint, Channel] | None = getattr(self._tls, "chans", None)
        if chans is None:
            chans = self._tls.chans = {}
        return chans

    def channel(self, endpoint: Endpoint, timeout_s: float) -> Channel | None:
        """This thread's channel to ``endpoint``; says hello first if new (``None``: no welcome)."""
        chans = self._mine()
        chan = chans.get(endpoint)
        if chan is not None:
            return chan
        sock = self._connect(endpoint)
        nonce, frames = self.codec.encode({"op": "hello", "peer": self._hello})
        sock.send_multipart(frames)
        reply = self.recv(sock, {nonce}, timeout_s)
        if reply is None or reply["op"] != "welcome":
            self._close(sock)
            return None
        chan = chans[endpoint] = Channel(self, sock, reply["tok"])
        return chan

    def discard(self, endpoint: Endpoint) -> None:
        """Drop this thread's channel to ``endpoint`` (after silence or an error)."""
        chan = self._mine().pop(endpoint, None)
        if chan is not None:
            self._close(chan.sock)

    def _connect(self, endpoint: Endpoint) -> Any:
        zmq = self._zmq
        with self._lock:
            if self._closed:
                raise ConnectorUnavailableError("control client is closed")
            sock = self._ctx.socket(zmq.DEALER)
            self._sockets.add(sock)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.codec.max_message_bytes + 256)
        sock.connect(f"tcp://{endpoint[0]}:{endpoint[1]}")
        return sock

    def _close(self, sock: Any) -> None:
        with self._lock:
            self._sockets.discard(sock)
        with contextlib.suppress(Exception):
            sock.close(0)

    def recv(
        self, sock: Any, nonces: set[bytes] | frozenset[bytes], timeout_s: float
    ) -> dict[str, Any] | None:
        end = time.monotonic() + max(0.0, timeout_s)
        while True:
            left = end - time.monotonic()
            if left <= 0 or not sock.poll(math.ceil(left * 1000)):
                return None
            try:
                msg = self.codec.decode_reply(sock.recv_multipart())
            except ProtocolError as exc:
                self.rejected += 1
                logger.warning("rejected a control reply: %s", exc)
                continue
            if msg.get("re") in nonces:
                return msg

    def close(self) -> None:
        """Close every channel of every thread. Idempotent."""
        with self._lock:
            self._closed = True
            socks = list(self._sockets)
            self._sockets.clear()
        for sock in socks:
            with contextlib.suppress(Exception):
                sock.close(0)
