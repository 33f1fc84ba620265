"""The control client of the pull connectors: one channel per thread and server.

Built by a pull connector's receiving side (Mooncake Transfer Engine, NIXL); the wire rules are
:mod:`omnikv.connectors.pull.control`'s. A channel is one TCP connection opened with a ``hello`` and
answered with a ``welcome``; it belongs to the thread that opened it. A channel the server closed
(idle timeout, restart, eviction of a peer that never said hello) is noticed before it is
reused, and the next :meth:`ControlClient.channel` connects and says hello again; a request in
flight on it ends at once (:attr:`Channel.closed`) instead of waiting out its timeout.

Nothing is kept for servers that went away: before each new connection the client closes the
calling thread's channels whose server closed them and every channel of a thread that has
ended, so a long-lived receiver that meets many senders in turn holds no descriptor for the
ones gone.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from omnikv._logging import RateLimitedLog
from omnikv.connectors.pull.control import (
    ControlCodec,
    Endpoint,
    MessageReader,
    pack_message,
    set_keepalive,
)
from omnikv.errors import ConnectorUnavailableError, ProtocolError

__all__ = ["Channel", "ControlClient", "Link"]

logger = logging.getLogger(__name__)
_outsider = RateLimitedLog(logger)  # lines a peer, client or forger can cause

_RECV_BYTES = 65536
_SEND_TIMEOUT_S = 5.0
_CONNECT_TIMEOUT_S = 5.0
#: Back-off between connection attempts to a server that refused or closed: 10 ms doubling to
#: 250 ms, never past the caller's timeout.
_RETRY_FIRST_S = 0.01
_RETRY_MAX_S = 0.25


class Link:
    """One connection: framing, timeouts and end of stream. Owned by one thread (its channel's);
    :meth:`close` may come from another (the client's ``close``)."""

    __slots__ = ("closed", "endpoint", "owner", "reader", "sock")

    def __init__(
        self, sock: socket.socket, max_body: int, endpoint: Endpoint | None = None
    ) -> None:
        self.sock = sock
        self.reader = MessageReader(max_body)
        self.closed = False
        self.endpoint = endpoint
        self.owner = threading.current_thread()

    def send(self, frames: list[bytes]) -> bool:
        """Send one message; ``False`` (and :attr:`closed`) when the connection is gone."""
        if self.closed:
            return False
        try:
            self.sock.settimeout(_SEND_TIMEOUT_S)
            self.sock.sendall(pack_message(frames))
        except OSError:
            self.closed = True
            return False
        return True

    def recv(self, timeout_s: float) -> list[bytes] | None:
        """The next message within ``timeout_s`` (what already arrived is read even at 0);
        ``None`` at the timeout or when the connection ended (then :attr:`closed`)."""
        end = time.monotonic() + max(0.0, timeout_s)
        while True:
            try:
                frames = self.reader.next()
            except ProtocolError as exc:
                _outsider.warning("closing a control connection: %s", exc)
                self.close()
                return None
            if frames is not None or self.closed:
                return frames
            left = end - time.monotonic()
            try:
                self.sock.settimeout(max(left, 0.0))
                data = self.sock.recv(_RECV_BYTES)
            except (TimeoutError, BlockingIOError):
                return None
            except OSError:
                data = b""
            if not data:
                self.closed = True
                return None
            self.reader.feed(data)

    def alive(self) -> bool:
        """Whether the server still holds this connection (a non-blocking look, no read)."""
        if self.closed:
            return False
        try:
            self.sock.settimeout(0.0)  # a socket with a timeout would wait that long first
            data = self.sock.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            return True
        except OSError:
            data = b""
        if not data:
            self.closed = True
        return bool(data)

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked reading it
        self.sock.close()


class Channel:
    """One connection to one server after a completed hello, owned by one thread."""

    def __init__(self, client: ControlClient, link: Link, token: bytes) -> None:
        self._client = client
        self.link = link
        self.token = token

    @property
    def closed(self) -> bool:
        """Whether the connection ended (the server closed it or went away)."""
        return self.link.closed

    def send(self, msg: Mapping[str, Any]) -> bytes:
        """Send a request on this channel; returns its nonce (match replies with it). On a
        closed channel nothing is sent (a reply never comes; :attr:`closed` says why)."""
        nonce, frames = self._client.codec.encode({**msg, "tok": self.token})
        self._client.send(self.link, frames)
        return nonce

    def recv(
        self, nonces: set[bytes] | frozenset[bytes], timeout_s: float
    ) -> dict[str, Any] | None:
        """The next valid reply to one of ``nonces`` within ``timeout_s``; ``None`` otherwise
        (at once when the channel is closed)."""
        return self._client.recv(self.link, nonces, timeout_s)

    def request(self, msg: Mapping[str, Any], timeout_s: float) -> dict[str, Any] | None:
        return self.recv({self.send(msg)}, timeout_s)


class ControlClient:
    """Channels to servers, one per (thread, endpoint), each opened with a ``hello``.

    ``hello`` is this client's self-description (the schema's hello fields). A channel whose
    server stays silent should be dropped with :meth:`discard`, so the next call reconnects and
    says hello again (a restarted server knows no old channel); a channel the server closed is
    replaced by :meth:`channel` on its own. ``heartbeat_s`` is the TCP keepalive interval.
    """

    def __init__(
        self, codec: ControlCodec, hello: Mapping[str, Any], *, heartbeat_s: float = 10.0
    ) -> None:
        self.codec = codec
        self._hello = dict(hello)
        self._heartbeat_s = heartbeat_s
        self._tls = threading.local()
        self._links: set[Link] = set()
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._observer: Callable[[list[bytes]], object] | None = None
        self.rejected = 0

    def observe_sends(self, observer: Callable[[list[bytes]], object] | None) -> None:
        """Test hook: ``observer`` sees the frames of every message this client sends from now
        on (hellos included), on the sending thread, before they leave; ``None`` stops it.

        The replay tests capture genuine messages with it to send them again verbatim.
        """
        self._observer = observer

    def send(self, link: Link, frames: list[bytes]) -> bool:
        """Send one encoded message on ``link`` (a channel's, or a connection being greeted);
        ``False`` when the connection is gone."""
        observer = self._observer
        if observer is not None:
            observer(frames)
        return link.send(frames)

    @property
    def connections(self) -> int:
        """How many connections this client holds, over all threads (diagnostics); one its
        server closed counts until :meth:`channel` sweeps it."""
        with self._lock:
            return len(self._links)

    def _mine(self) -> dict[Endpoint, Channel]:
        chans: dict[Endpoint, Channel] | None = getattr(self._tls, "chans", None)
        if chans is None:
            chans = self._tls.chans = {}
        return chans

    def channel(self, endpoint: Endpoint, timeout_s: float) -> Channel | None:
        """This thread's channel to ``endpoint``, connecting and saying hello if there is none
        (or the server closed it). Retries a refused connection with a short back-off until
        ``timeout_s``; ``None`` when no welcome came in that time (server down, wrong secret).
        Raises ``ConnectorUnavailableError`` once the client is closed."""
        chans = self._mine()
        chan = chans.get(endpoint)
        if chan is not None:
            if chan.link.alive():
                return chan
            self.discard(endpoint)
        self._sweep(chans)
        end = time.monotonic() + max(0.0, timeout_s)
        delay = _RETRY_FIRST_S
        while True:
            link = self._connect(endpoint, end - time.monotonic())
            if link is not None:
                token = self._greet(link, end)
                if token is not None:
                    chan = chans[endpoint] = Channel(self, link, token)
                    return chan
                silent = not link.closed
                self._close(link)
                if silent:  # connected and greeted, but no answer in the time given
                    return None
            left = end - time.monotonic()
            if left <= 0 or self._closing.wait(min(delay, left)):
                return None
            delay = min(delay * 2, _RETRY_MAX_S)

    def _greet(self, link: Link, end: float) -> bytes | None:
        """Say hello on ``link``; the channel token of the welcome, or ``None``."""
        nonce, frames = self.codec.encode({"op": "hello", "peer": self._hello})
        if not self.send(link, frames):
            return None
        reply = self.recv(link, {nonce}, end - time.monotonic())
        if reply is None or reply["op"] != "welcome":
            return None
        token: bytes = reply["tok"]
        return token

    def _sweep(self, chans: dict[Endpoint, Channel]) -> None:
        """Close the links nobody can use: this thread's whose server closed them, and every
        link of a thread that has ended (their channels went with the thread)."""
        for endpoint, chan in list(chans.items()):
            if not chan.link.alive():
                del chans[endpoint]
                self._close(chan.link)
        with self._lock:
            dead = [lk for lk in self._links if lk.closed or not lk.owner.is_alive()]
        for link in dead:
            self._close(link)

    def has_channel(self, endpoint: Endpoint) -> bool:
        """Whether any thread holds a channel to ``endpoint`` not known to be closed."""
        with self._lock:
            return any(lk.endpoint == endpoint and not lk.closed for lk in self._links)

    def discard(self, endpoint: Endpoint) -> None:
        """Drop this thread's channel to ``endpoint`` (after silence or an error)."""
        chan = self._mine().pop(endpoint, None)
        if chan is not None:
            self._close(chan.link)

    def _connect(self, endpoint: Endpoint, timeout_s: float) -> Link | None:
        """A new connection to ``endpoint`` (``None`` when refused or unreachable in time)."""
        if self._closing.is_set():
            raise ConnectorUnavailableError("control client is closed")
        try:
            sock = socket.create_connection(
                endpoint, timeout=max(0.001, min(timeout_s, _CONNECT_TIMEOUT_S))
            )
        except OSError as exc:
            logger.debug("control connection to %s:%d failed: %s", *endpoint, exc)
            return None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            set_keepalive(sock, self._heartbeat_s)
        except OSError:
            sock.close()
            return None
        link = Link(sock, self.codec.max_message_bytes, endpoint)
        with self._lock:
            if self._closing.is_set():
                link.close()
                raise ConnectorUnavailableError("control client is closed")
            self._links.add(link)
        return link

    def _close(self, link: Link) -> None:
        with self._lock:
            self._links.discard(link)
        link.close()

    def recv(
        self, link: Link, nonces: set[bytes] | frozenset[bytes], timeout_s: float
    ) -> dict[str, Any] | None:
        """The next valid reply to one of ``nonces`` on ``link`` within ``timeout_s``."""
        end = time.monotonic() + max(0.0, timeout_s)
        while True:
            frames = link.recv(end - time.monotonic())
            if frames is None:
                return None
            try:
                msg = self.codec.decode_reply(frames)
            except ProtocolError as exc:
                self.rejected += 1
                _outsider.warning("rejected a control reply: %s", exc)
                continue
            if msg.get("re") in nonces:
                return msg

    def close(self) -> None:
        """Close every channel of every thread. Idempotent."""
        with self._lock:
            self._closing.set()
            links = list(self._links)
            self._links.clear()
        for link in links:
            link.close()
