"""The control client of the pull connectors: one channel per server, shared by every thread.

Built by a pull connector's receiving side (Mooncake Transfer Engine, NIXL); the wire rules are
:mod:`omnikv.connectors.pull.control`'s. A channel is one TCP connection opened with a ``hello`` and
answered with a ``welcome``. One process holds one channel per server, whatever the number of
threads, lanes and receives that talk to it: requests from any thread go out on it (sends are
serialised), and a reader thread of the channel hands each reply to the thread waiting for its
nonce. So a receiving process costs a sender one connection slot (see
:class:`~omnikv.connectors.pull.control.ServerLimits`), never one per thread.

A channel the server closed (idle timeout, restart, eviction of a peer that never said hello) is
noticed by its reader at once: every request in flight on it ends (:attr:`Channel.closed`)
instead of waiting out its timeout, and the next :meth:`ControlClient.channel` connects and says
hello again. Nothing is kept for servers that went away: a closed channel is forgotten when the
next channel is asked for, so a long-lived receiver that meets many senders in turn holds no
descriptor for the ones gone. Replies nobody collects (their waiter gave up) are kept at most
:data:`REPLY_KEEP_S` seconds and :data:`MAX_OUTSTANDING` per channel.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
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
from omnikv.polling import wait_readable

__all__ = ["MAX_OUTSTANDING", "REPLY_KEEP_S", "Channel", "ControlClient", "Link"]

logger = logging.getLogger(__name__)
_outsider = RateLimitedLog(logger)  # lines a peer, client or forger can cause

_RECV_BYTES = 65536
_SEND_TIMEOUT_S = 5.0
_CONNECT_TIMEOUT_S = 5.0
#: Back-off between connection attempts to a server that refused or closed: 10 ms doubling to
#: 250 ms, never past the caller's timeout.
_RETRY_FIRST_S = 0.01
_RETRY_MAX_S = 0.25
#: How long a request sent on a channel waits for its reply to be collected (then it is
#: forgotten), and how many requests a channel tracks at once (the oldest go first).
REPLY_KEEP_S = 300.0
MAX_OUTSTANDING = 4096


class Link:
    """One connection: framing, timeouts and end of stream.

    Reads come from one thread at a time (a channel's reader, or the thread greeting the server
    before the reader starts); sends from any thread, serialised by the caller. The socket keeps
    one timeout (:data:`_SEND_TIMEOUT_S`, for sends): reads wait with ``select`` instead, so no
    thread changes a timeout another one relies on. :meth:`close` may come from any thread.
    """

    __slots__ = ("closed", "endpoint", "reader", "sock")

    def __init__(
        self, sock: socket.socket, max_body: int, endpoint: Endpoint | None = None
    ) -> None:
        self.sock = sock
        self.reader = MessageReader(max_body)
        self.closed = False
        self.endpoint = endpoint
        sock.settimeout(_SEND_TIMEOUT_S)

    def send(self, frames: list[bytes]) -> bool:
        """Send one message; ``False`` (and :attr:`closed`) when the connection is gone."""
        if self.closed:
            return False
        try:
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
            try:
                if not wait_readable(self.sock.fileno(), max(0.0, end - time.monotonic())):
                    return None
                data = self.sock.recv(_RECV_BYTES)
            except (TimeoutError, BlockingIOError, InterruptedError):
                continue
            except (OSError, ValueError):  # ValueError: closed by another thread meanwhile
                data = b""
            if not data:
                self.closed = True
                return None
            self.reader.feed(data)

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes a thread waiting to read it
        self.sock.close()


class _Outstanding:
    """A request sent on a channel: its reply once it came, the event of the thread waiting."""

    __slots__ = ("reply", "sent", "waiter")

    def __init__(self, sent: float) -> None:
        self.sent = sent
        self.reply: dict[str, Any] | None = None
        self.waiter: threading.Event | None = None


class Channel:
    """One connection to one server after a completed hello, shared by every thread.

    Built by :meth:`ControlClient.channel`, which starts its reader thread. :meth:`send` and
    :meth:`recv` may be called from any number of threads at once: each waits for the replies
    to its own nonces.
    """

    def __init__(self, client: ControlClient, link: Link, token: bytes) -> None:
        self._client = client
        self.link = link
        self.token = token
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._out: collections.OrderedDict[bytes, _Outstanding] = collections.OrderedDict()
        self._reader = threading.Thread(
            target=self._read, name="omnikv-control-reader", daemon=True
        )

    def start(self) -> None:
        self._reader.start()

    @property
    def closed(self) -> bool:
        """Whether the connection ended (the server closed it or went away)."""
        return self.link.closed

    def send(self, msg: Mapping[str, Any]) -> bytes:
        """Send a request on this channel; returns its nonce (collect its reply with
        :meth:`recv`). On a closed channel nothing is sent (a reply never comes; :attr:`closed`
        says why)."""
        nonce, frames = self._client.codec.encode({**msg, "tok": self.token})
        now = time.monotonic()
        with self._lock:
            while self._out and (
                len(self._out) >= MAX_OUTSTANDING
                or next(iter(self._out.values())).sent + REPLY_KEEP_S < now
            ):
                self._out.popitem(last=False)
            self._out[nonce] = _Outstanding(now)
        with self._send_lock:
            self._client.send(self.link, frames)
        if self.link.closed:
            self._wake_all()
        return nonce

    def recv(self, nonces: Iterable[bytes], timeout_s: float) -> dict[str, Any] | None:
        """The next reply to one of ``nonces`` (sent on this channel) within ``timeout_s``;
        ``None`` otherwise (at once when the channel is closed). The other nonces stay
        collectable."""
        wanted = tuple(nonces)
        end = time.monotonic() + max(0.0, timeout_s)
        event = threading.Event()
        while True:
            with self._lock:
                for nonce in wanted:
                    out = self._out.get(nonce)
                    if out is not None and out.reply is not None:
                        del self._out[nonce]
                        return out.reply
                left = end - time.monotonic()
                if self.link.closed or left <= 0:
                    return None
                event.clear()
                for nonce in wanted:
                    out = self._out.get(nonce)
                    if out is not None:
                        out.waiter = event
            event.wait(left)

    def request(self, msg: Mapping[str, Any], timeout_s: float) -> dict[str, Any] | None:
        nonce = self.send(msg)
        reply = self.recv((nonce,), timeout_s)
        if reply is None:
            self.forget((nonce,))
        return reply

    def forget(self, nonces: Iterable[bytes]) -> None:
        """Stop tracking ``nonces`` (their replies are dropped when they come)."""
        with self._lock:
            for nonce in nonces:
                self._out.pop(nonce, None)

    def close(self) -> None:
        self.link.close()
        self._wake_all()
        if self._reader.is_alive() and self._reader is not threading.current_thread():
            self._reader.join(timeout=_SEND_TIMEOUT_S)

    def _wake_all(self) -> None:
        with self._lock:
            waiters = {id(o.waiter): o.waiter for o in self._out.values() if o.waiter is not None}
        for event in waiters.values():
            event.set()

    def _read(self) -> None:
        """Reader thread: hand each valid reply to the thread waiting for its nonce."""
        try:
            while not self.link.closed:
                frames = self.link.recv(_SEND_TIMEOUT_S)
                if frames is None:
                    continue
                msg = self._client.decode(frames)
                if msg is None:
                    continue
                with self._lock:
                    out = self._out.get(msg.get("re", b""))
                    if out is None:
                        continue  # nobody waits for it (any more)
                    out.reply = msg
                    waiter = out.waiter
                if waiter is not None:
                    waiter.set()
        finally:
            self.link.closed = True
            self._wake_all()


class ControlClient:
    """Channels to servers, one per endpoint shared by every thread, each opened with a
    ``hello``.

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
        self._chans: dict[Endpoint, Channel] = {}
        self._dialing: dict[Endpoint, threading.Lock] = {}
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

    def decode(self, frames: list[bytes]) -> dict[str, Any] | None:
        """A checked reply, or ``None`` (counted in :attr:`rejected`) for an invalid one."""
        try:
            return self.codec.decode_reply(frames)
        except ProtocolError as exc:
            self.rejected += 1
            _outsider.warning("rejected a control reply: %s", exc)
            return None

    @property
    def connections(self) -> int:
        """How many open connections this client holds (diagnostics)."""
        with self._lock:
            return sum(not chan.closed for chan in self._chans.values())

    def channel(self, endpoint: Endpoint, timeout_s: float) -> Channel | None:
        """The channel to ``endpoint``, connecting and saying hello if there is none (or the
        server closed it); threads asking at once share one connection attempt. Retries a
        refused connection with a short back-off until ``timeout_s``; ``None`` when no welcome
        came in that time (server down, wrong secret). Raises ``ConnectorUnavailableError``
        once the client is closed."""
        end = time.monotonic() + max(0.0, timeout_s)
        with self._lock:
            chan = self._chans.get(endpoint)
            if chan is not None and not chan.closed:
                return chan
            dialing = self._dialing.setdefault(endpoint, threading.Lock())
        if not dialing.acquire(timeout=max(0.0, end - time.monotonic())):
            return None
        try:
            with self._lock:
                chan = self._chans.get(endpoint)
                if chan is not None and not chan.closed:
                    return chan  # another thread connected meanwhile
            self._sweep()
            return self._dial(endpoint, end)
        finally:
            dialing.release()

    def _dial(self, endpoint: Endpoint, end: float) -> Channel | None:
        delay = _RETRY_FIRST_S
        while True:
            link = self._connect(endpoint, end - time.monotonic())
            if link is not None:
                token = self._greet(link, end)
                if token is not None:
                    chan = Channel(self, link, token)
                    with self._lock:
                        if self._closing.is_set():
                            link.close()
                            raise ConnectorUnavailableError("control client is closed")
                        self._chans[endpoint] = chan
                    chan.start()
                    return chan
                silent = not link.closed
                link.close()
                if silent:  # connected and greeted, but no answer in the time given
                    return None
            left = end - time.monotonic()
            if left <= 0 or self._closing.wait(min(delay, left)):
                return None
            delay = min(delay * 2, _RETRY_MAX_S)

    def _greet(self, link: Link, end: float) -> bytes | None:
        """Say hello on ``link`` (before any reader runs on it); the channel token of the
        welcome, or ``None``."""
        nonce, frames = self.codec.encode({"op": "hello", "peer": self._hello})
        if not self.send(link, frames):
            return None
        while True:
            got = link.recv(end - time.monotonic())
            if got is None:
                return None
            reply = self.decode(got)
            if reply is None or reply.get("re") != nonce:
                continue
            if reply["op"] != "welcome":
                return None
            token: bytes = reply["tok"]
            return token

    def _sweep(self) -> None:
        """Forget the channels whose server closed them."""
        with self._lock:
            dead = [(ep, ch) for ep, ch in self._chans.items() if ch.closed]
            for ep, _ in dead:
                del self._chans[ep]
        for _, chan in dead:
            chan.close()

    def has_channel(self, endpoint: Endpoint) -> bool:
        """Whether a channel to ``endpoint`` is open (not known to be closed)."""
        with self._lock:
            chan = self._chans.get(endpoint)
        return chan is not None and not chan.closed

    def discard(self, endpoint: Endpoint, chan: Channel | None = None) -> None:
        """Close the channel to ``endpoint`` (after its server stayed silent), or only ``chan``
        when given and still the current one; every request in flight on it ends."""
        with self._lock:
            current = self._chans.get(endpoint)
            if current is None or (chan is not None and current is not chan):
                return
            del self._chans[endpoint]
        current.close()

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
        return Link(sock, self.codec.max_message_bytes, endpoint)

    def close(self) -> None:
        """Close every channel. Idempotent."""
        with self._lock:
            self._closing.set()
            chans = list(self._chans.values())
            self._chans.clear()
        for chan in chans:
            chan.close()
