"""MooncakeTransferEngineConnector: pull-model KV hand-off over the Mooncake Transfer Engine.

Data plane: the Mooncake Transfer Engine (``protocol`` "tcp" everywhere, "rdma" where the
hardware exists), one registered, pre-faulted host pool per process. Control plane: msgpack
messages over pyzmq (ROUTER on the sender, one DEALER per thread and sender on the receiver),
optionally authenticated by HMAC-SHA256 with a shared secret.

How a payload moves:

1. The sender's ``put_packed`` reserves a slot in its registered pool and lets the caller encode
   straight into it; the entry is then published under ``"{key}@{from}_{to}"``.
2. The receiver's ``wait`` sends ``query`` (the sender holds it until the key is there or the
   requester's deadline: long-poll, no sleep loop), learns the size, reserves a slot of that size
   in its own registered pool and sends ``pull`` with the slot's address and capacity.
3. A sender worker checks the capacity against the stored size (it never writes more than the
   receiver asked for), marks the entry in flight, writes it with ``transfer_sync_write`` and on
   success frees its slot (consume-once) and answers ``done``.
4. While it waits for ``done`` the receiver pings the sender's listener; silence for
   ``peer_timeout_seconds`` raises :class:`~omnikv.errors.PeerGoneError`. If the receiver gives up
   (deadline, peer gone) while the write may still be running, its slot is *quarantined*: a
   reaper asks the sender about the transfer and frees the slot only once the transfer is known
   finished or dead, so no later allocation is overwritten. A quarantined transfer that did
   finish is kept as a late arrival and handed to the next ``get`` / ``wait`` of that key.

Senders reap entries older than ``buffer_ttl_seconds`` (never one in flight). ``close`` stops and
joins every thread, closes every socket, waits for in-flight writes, unregisters the pool from
the engine and unmaps it.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import hmac
import itertools
import logging
import math
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack
import torch

from omnikv.connectors._mooncake_common import (
    as_host_bytes,
    decode_if_object,
    encode_object,
    import_mooncake_engine,
    matches_request,
    parse_size,
    resolve_host,
    set_tcp_bind_address,
)
from omnikv.connectors._pool import HostPool
from omnikv.connectors.base import GetResult, ManagedBuffer, OmniConnectorBase, PutResult, Writer
from omnikv.deadline import remaining
from omnikv.errors import (
    ConfigError,
    ConnectorClosedError,
    ConnectorError,
    ConnectorUnavailableError,
    PeerGoneError,
)

__all__ = ["MooncakeTransferEngineConnector"]

logger = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 4096
MAX_KEY_CHARS = 1024
LONG_POLL_CAP_S = 5.0
_MAC_BYTES = 32
_XFER_HISTORY = 4096
_OPS = frozenset({"query", "pull", "status", "ping"})
_REPLY_OPS = frozenset({"info", "done", "error", "xstate", "pong"})


def _transfer_budget_s(nbytes: int) -> float:
    """The reference's pull timeout: 30 s + 5 s per full 100 MiB."""
    return 30.0 + 5.0 * (nbytes // (100 << 20))


class _ProtocolError(ValueError):
    """A control message failed validation (dropped, counted)."""


# -- control messages --------------------------------------------------------------------------
_FIELDS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "query": {"key": str, "wait_ms": int},
    "pull": {"key": str, "sess": str, "dst": int, "cap": int, "xid": str, "budget_ms": int},
    "status": {"xid": str},
    "ping": {},
    "info": {"found": bool, "size": int},
    "done": {"size": int},
    "error": {"reason": str},
    "pong": {},
    "xstate": {"state": str},
}


def _validate(msg: Any, allowed: frozenset[str]) -> dict[str, Any]:
    """Check a decoded control message against the schema; returns it or raises."""
    if not isinstance(msg, dict):
        raise _ProtocolError("control message is not a map")
    if msg.get("v") != PROTOCOL_VERSION:
        raise _ProtocolError(f"unsupported protocol version {msg.get('v')!r}")
    op = msg.get("op")
    if op not in allowed:
        raise _ProtocolError(f"unexpected op {op!r}")
    n = msg.get("n")
    if not isinstance(n, int) or isinstance(n, bool):
        raise _ProtocolError("missing nonce")
    for name, kind in _FIELDS[op].items():
        value = msg.get(name)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise _ProtocolError(f"{op}: field {name!r} must be {kind}, got {type(value).__name__}")
        if isinstance(value, int) and not isinstance(value, bool) and value < 0:
            raise _ProtocolError(f"{op}: field {name!r} must be >= 0")
        if isinstance(value, str) and len(value) > MAX_KEY_CHARS:
            raise _ProtocolError(f"{op}: field {name!r} longer than {MAX_KEY_CHARS}")
    if op == "pull" and not msg["sess"].rpartition(":")[2].isdigit():
        raise _ProtocolError("pull: sess must be host:port")
    return msg


class _Codec:
    """msgpack bodies, each followed by an HMAC-SHA256 frame when a secret is configured."""

    def __init__(self, secret: bytes | None) -> None:
        self._secret = secret

    def encode(self, msg: dict[str, Any]) -> list[bytes]:
        body = msgpack.packb(msg, use_bin_type=True)
        if self._secret is None:
            return [body]
        return [body, hmac.new(self._secret, body, hashlib.sha256).digest()]

    def decode(self, frames: list[bytes], allowed: frozenset[str]) -> dict[str, Any]:
        if not frames or len(frames[0]) > MAX_MESSAGE_BYTES:
            raise _ProtocolError("empty or oversized control message")
        body = frames[0]
        if self._secret is not None:
            if len(frames) != 2 or len(frames[1]) != _MAC_BYTES:
                raise _ProtocolError("unauthenticated control message")
            mac = hmac.new(self._secret, body, hashlib.sha256).digest()
            if not hmac.compare_digest(mac, frames[1]):
                raise _ProtocolError("bad control message signature")
        elif len(frames) != 1:
            raise _ProtocolError("unexpected extra frames")
        try:
            msg = msgpack.unpackb(body, raw=False, strict_map_key=True, max_bin_len=0)
        except Exception as exc:
            raise _ProtocolError(f"undecodable control message: {exc}") from exc
        return _validate(msg, allowed)


# -- sender state ------------------------------------------------------------------------------
@dataclass
class _Entry:
    key: str
    offset: int
    size: int
    created: float
    inflight: bool = False


@dataclass
class _Waiter:
    ident: bytes
    nonce: int
    key: str
    expires: float


# -- receiver state ----------------------------------------------------------------------------
@dataclass
class _Quarantined:
    key: str
    endpoint: tuple[str, int]
    xid: str
    offset: int
    size: int
    since: float
    last_heard: float


@dataclass
class _Late:
    offset: int
    size: int
    arrived: float


@dataclass
class _Counters:
    values: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(
            (
                "puts",
                "put_bytes",
                "put_failures",
                "gets",
                "get_bytes",
                "misses",
                "pulls_served",
                "pull_failures",
                "ttl_reaped",
                "quarantine_events",
                "quarantine_freed",
                "late_arrivals",
                "rejected_messages",
                "peer_gone",
            ),
            0,
        )
    )
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, name: str, n: int = 1) -> None:
        with self.lock:
            self.values[name] += n


class MooncakeTransferEngineConnector(OmniConnectorBase):
    """Cross-node KV hand-off over the Mooncake Transfer Engine (pull model, consume-once).

    Built by the factory as ``MooncakeTransferEngineConnector(config)``; the manager injects
    ``role``, ``zmq_port``, ``from_stage`` and ``to_stage`` per rank. Config keys: ``host``
    (default ``127.0.0.1``; bound and advertised as is, ``"auto"`` detects), ``zmq_port``,
    ``role`` (``"sender"`` binds the control socket; ``"receiver"`` binds nothing), ``protocol``
    (``"tcp"``), ``device_name`` (``""``), ``memory_pool_size`` (bytes, default 1 GiB),
    ``memory_pool_device`` (``"cpu"``), ``buffer_ttl_seconds`` (300), ``auth_secret``,
    ``sender_host`` / ``sender_zmq_port`` (receivers' default sender), ``peer_timeout_seconds``
    (5), ``quarantine_dead_seconds`` (60), ``workers`` (4).
    """

    supports_raw_data: ClassVar[bool] = True
    supports_zero_copy_put: ClassVar[bool] = True

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self._closed = True  # until fully built: a failed constructor leaves nothing to close
        cfg = dict(config or {})
        self.host = resolve_host(cfg.get("host", "127.0.0.1"))
        self.role = str(cfg.get("role", "sender"))
        if self.role not in {"sender", "receiver"}:
            raise ConfigError(f"role must be 'sender' or 'receiver', got {self.role!r}")
        self.protocol = str(cfg.get("protocol", "tcp"))
        self.device_name = str(cfg.get("device_name", "") or "")
        self.pool_device = str(cfg.get("memory_pool_device", "cpu"))
        if self.pool_device != "cpu":
            raise ConfigError(
                f"memory_pool_device {self.pool_device!r} is not supported yet; use 'cpu'"
            )
        pool_size = parse_size(cfg.get("memory_pool_size", 1 << 30), "memory_pool_size")
        self.ttl_s = float(cfg.get("buffer_ttl_seconds", 300.0))
        self.peer_timeout_s = float(cfg.get("peer_timeout_seconds", 5.0))
        self.quarantine_dead_s = float(cfg.get("quarantine_dead_seconds", 60.0))
        self.close_timeout_s = float(cfg.get("close_timeout_seconds", 30.0))
        workers = int(cfg.get("workers", 4))
        secret = cfg.get("auth_secret")
        if secret is not None and not isinstance(secret, str | bytes):
            raise ConfigError("auth_secret must be a string or bytes")
        secret_bytes = secret.encode() if isinstance(secret, str) else secret
        self._codec = _Codec(secret_bytes or None)
        port = cfg.get("zmq_port")
        self.zmq_port = int(port) if port is not None else None
        if self.role == "sender" and self.zmq_port is None:
            raise ConfigError("a sender needs zmq_port")
        self.from_stage = cfg.get("from_stage")
        self.to_stage = cfg.get("to_stage")
        self._default_sender: tuple[str, int] | None = None
        if cfg.get("sender_host") and cfg.get("sender_zmq_port") is not None:
            self._default_sender = (str(cfg["sender_host"]), int(cfg["sender_zmq_port"]))

        import zmq

        self._zmq = zmq
        engine_cls = import_mooncake_engine()
        set_tcp_bind_address(self.host)
        self._counters = _Counters()
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._waiters: list[_Waiter] = []
        self._xfers: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._outbox: collections.deque[tuple[bytes, list[bytes]]] = collections.deque()
        self._inflight = 0
        self._inflight_cond = threading.Condition(self._lock)
        self._quarantine: dict[str, _Quarantined] = {}
        self._late: dict[str, _Late] = {}
        self._stop = threading.Event()
        self._nonce = itertools.count(1)
        self._tls = threading.local()
        self._sockets: set[Any] = set()
        self._sockets_lock = threading.Lock()
        self._listener: threading.Thread | None = None
        self._reaper: threading.Thread | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._engine: Any = None
        self._pool: HostPool | None = None
        self._registered = False
        self._ctx: Any = None
        try:
            self._engine = engine_cls()
            rc = self._engine.initialize(self.host, "P2PHANDSHAKE", self.protocol, self.device_name)
            if rc != 0:
                raise ConnectorUnavailableError(
                    f"Transfer Engine initialize({self.host}, {self.protocol}) returned {rc}"
                )
            self.rpc_port = int(self._engine.get_rpc_port())
            self.session_id = f"{self.host}:{self.rpc_port}"
            self._pool = HostPool(pool_size)
            rc = self._engine.register_memory(self._pool.address, self._pool.size)
            if rc != 0:
                raise ConnectorUnavailableError(f"register_memory of the pool returned {rc}")
            self._registered = True
            self._ctx = zmq.Context()
            if self.role == "sender":
                self._start_sender(workers)
        except BaseException:
            self._teardown()
            raise
        self._closed = False
        logger.info(
            "MooncakeTransferEngineConnector %s on %s (rpc %d, zmq %s, %s, pool %d bytes)",
            self.role,
            self.host,
            self.rpc_port,
            self.zmq_port,
            self.protocol,
            self._pool.size,
        )

    # == sender ===================================================================================
    def _start_sender(self, workers: int) -> None:
        zmq = self._zmq
        router = self._ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES + 256)
        router.setsockopt(zmq.ROUTER_MANDATORY, 0)
        try:
            router.bind(f"tcp://{self.host}:{self.zmq_port}")
        except zmq.ZMQError as exc:
            router.close(0)
            raise ConnectorUnavailableError(
                f"cannot bind the control socket tcp://{self.host}:{self.zmq_port}: {exc}"
            ) from exc
        wake_addr = f"inproc://omnikv-te-{uuid.uuid4().hex}"
        wake_pull = self._ctx.socket(zmq.PULL)
        wake_pull.setsockopt(zmq.LINGER, 0)
        wake_pull.bind(wake_addr)
        self._wake_push = self._ctx.socket(zmq.PUSH)
        self._wake_push.setsockopt(zmq.LINGER, 0)
        self._wake_push.connect(wake_addr)
        self._wake_lock = threading.Lock()
        self._executor = ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix="omnikv-te-pull"
        )
        self._listener = threading.Thread(
            target=self._listen, args=(router, wake_pull), name="omnikv-te-listener", daemon=True
        )
        self._listener.start()

    def _wake(self) -> None:
        with self._wake_lock, contextlib.suppress(Exception):
            self._wake_push.send(b"", self._zmq.NOBLOCK)

    def _reply(self, ident: bytes, msg: dict[str, Any]) -> None:
        """Queue a reply for the listener thread (the only user of the ROUTER socket)."""
        msg["v"] = PROTOCOL_VERSION
        self._outbox.append((ident, self._codec.encode(msg)))
        self._wake()

    def _listen(self, router: Any, wake_pull: Any) -> None:
        """The sender's control loop: answers queries, hands pulls to workers, reaps by TTL."""
        zmq = self._zmq
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(wake_pull, zmq.POLLIN)
        sweep_every = max(0.05, min(10.0, self.ttl_s / 2))
        next_sweep = time.monotonic() + sweep_every
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                timeout = min(next_sweep - now, 1.0)
                with self._lock:
                    if self._waiters:
                        timeout = min(timeout, min(w.expires for w in self._waiters) - now)
                events = dict(poller.poll(max(0, math.ceil(timeout * 1000))))
                if wake_pull in events:
                    with contextlib.suppress(zmq.Again):
                        for _ in range(1024):
                            wake_pull.recv(zmq.NOBLOCK)
                if router in events:
                    for _ in range(256):
                        try:
                            frames = router.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._handle(frames)
                self._serve_waiters()
                while self._outbox:
                    ident, out = self._outbox.popleft()
                    with contextlib.suppress(zmq.ZMQError):
                        router.send_multipart([ident, *out], zmq.NOBLOCK)
                if time.monotonic() >= next_sweep:
                    self._reap_ttl()
                    next_sweep = time.monotonic() + sweep_every
        except Exception:
            logger.exception("Transfer Engine control listener failed")
        finally:
            router.close(0)
            wake_pull.close(0)

    def _handle(self, frames: list[bytes]) -> None:
        if len(frames) < 2:
            self._counters.add("rejected_messages")
            return
        ident = frames[0]
        try:
            msg = self._codec.decode(frames[1:], _OPS)
        except _ProtocolError as exc:
            self._counters.add("rejected_messages")
            logger.warning("rejected a control message: %s", exc)
            return
        op, nonce = msg["op"], msg["n"]
        if op == "ping":
            self._reply(ident, {"op": "pong", "n": nonce})
        elif op == "status":
            with self._lock:
                state = self._xfers.get(msg["xid"], "unknown")
            self._reply(ident, {"op": "xstate", "n": nonce, "state": state})
        elif op == "query":
            with self._lock:
                entry = self._entries.get(msg["key"])
                if entry is None or entry.inflight:
                    wait_s = min(msg["wait_ms"] / 1000.0, LONG_POLL_CAP_S)
                    if wait_s > 0:
                        self._waiters.append(
                            _Waiter(ident, nonce, msg["key"], time.monotonic() + wait_s)
                        )
                        return
                    found, size = False, 0
                else:
                    found, size = True, entry.size
            self._reply(ident, {"op": "info", "n": nonce, "found": found, "size": size})
        else:
            self._start_pull(ident, msg)

    def _serve_waiters(self) -> None:
        now = time.monotonic()
        with self._lock:
            if not self._waiters:
                return
            keep: list[_Waiter] = []
            answers: list[tuple[_Waiter, bool, int]] = []
            for w in self._waiters:
                entry = self._entries.get(w.key)
                if entry is not None and not entry.inflight:
                    answers.append((w, True, entry.size))
                elif now >= w.expires:
                    answers.append((w, False, 0))
                else:
                    keep.append(w)
            self._waiters = keep
        for w, found, size in answers:
            self._reply(w.ident, {"op": "info", "n": w.nonce, "found": found, "size": size})

    def _start_pull(self, ident: bytes, msg: dict[str, Any]) -> None:
        key, xid, nonce = msg["key"], msg["xid"], msg["n"]
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.inflight:
                reason = "not_found" if entry is None else "busy"
            elif msg["cap"] < entry.size:
                reason = "too_small"
            else:
                reason = ""
                entry.inflight = True
                self._inflight += 1
                self._xfers[xid] = "inflight"
                while len(self._xfers) > _XFER_HISTORY:
                    self._xfers.popitem(last=False)
        if reason:
            self._reply(ident, {"op": "error", "n": nonce, "reason": reason})
            return
        assert entry is not None and self._executor is not None
        started = time.monotonic()
        try:
            self._executor.submit(self._do_pull, ident, msg, entry, started)
        except RuntimeError:  # executor shut down: closing
            self._finish_pull(entry, xid, ok=False)
            self._reply(ident, {"op": "error", "n": nonce, "reason": "closing"})

    def _do_pull(self, ident: bytes, msg: dict[str, Any], entry: _Entry, started: float) -> None:
        """Worker: one engine write of the entry into the requester's slot, then the answer."""
        xid, nonce = msg["xid"], msg["n"]
        ok = False
        reason = "expired"
        try:
            if time.monotonic() - started < msg["budget_ms"] / 1000.0 and not self._stop.is_set():
                assert self._pool is not None
                t0 = time.perf_counter()
                rc = self._engine.transfer_sync_write(
                    msg["sess"], self._pool.address + entry.offset, msg["dst"], entry.size
                )
                ok = rc == 0
                reason = "" if ok else f"transfer_sync_write returned {rc}"
                logger.debug(
                    "pull %s -> %s: %d bytes in %.3f ms (rc %d)",
                    entry.key,
                    msg["sess"],
                    entry.size,
                    (time.perf_counter() - t0) * 1e3,
                    rc,
                )
        except Exception as exc:
            reason = f"transfer raised {exc}"
        finally:
            self._finish_pull(entry, xid, ok=ok)
        if ok:
            self._counters.add("pulls_served")
            self._reply(ident, {"op": "done", "n": nonce, "size": entry.size})
        else:
            self._counters.add("pull_failures")
            logger.warning("pull of %s failed: %s", entry.key, reason)
            self._reply(ident, {"op": "error", "n": nonce, "reason": reason})

    def _finish_pull(self, entry: _Entry, xid: str, *, ok: bool) -> None:
        with self._lock:
            self._xfers[xid] = "done" if ok else "failed"
            entry.inflight = False
            free = ok
            if ok and self._entries.get(entry.key) is entry:
                del self._entries[entry.key]
            elif self._entries.get(entry.key) is not entry:
                free = True  # replaced by a newer put while in flight
            self._inflight -= 1
            self._inflight_cond.notify_all()
        if free and self._pool is not None:
            self._pool.allocator.free(entry.offset)
        if not ok:
            self._wake()  # waiters may retry

    def _reap_ttl(self) -> None:
        cutoff = time.monotonic() - self.ttl_s
        with self._lock:
            old = [e for e in self._entries.values() if e.created < cutoff and not e.inflight]
            for e in old:
                del self._entries[e.key]
        for e in old:
            assert self._pool is not None
            self._pool.allocator.free(e.offset)
            logger.warning("dropped %s after %.0f s unconsumed (TTL)", e.key, self.ttl_s)
        if old:
            self._counters.add("ttl_reaped", len(old))

    def _publish(self, key: str, offset: int, size: int) -> dict[str, Any]:
        entry = _Entry(key, offset, size, time.monotonic())
        with self._lock:
            old = self._entries.get(key)
            self._entries[key] = entry
        if old is not None and not old.inflight and self._pool is not None:
            self._pool.allocator.free(old.offset)
        self._wake()
        self._counters.add("puts")
        self._counters.add("put_bytes", size)
        logger.debug("published %s (%d bytes)", key, size)
        return {
            "source_host": self.host,
            "source_port": self.zmq_port,
            "data_size": size,
            "is_fast_path": True,
        }

    def _check_sender(self) -> HostPool:
        if self._closed:
            raise ConnectorClosedError("MooncakeTransferEngineConnector is closed")
        if self.role != "sender" or self._pool is None:
            raise ConnectorError("only a connector with role='sender' serves puts")
        return self._pool

    def put_packed(
        self,
        from_stage: str,
        to_stage: str,
        put_key: str,
        nbytes: int,
        write: Writer,
        *,
        deadline: float = math.inf,
    ) -> PutResult:
        """Sender hot path: ``write`` encodes straight into a registered pool slot.

        Waits for pool space until ``deadline`` and then raises
        :class:`~omnikv.errors.PoolExhaustedError`; if ``write`` raises, the slot is freed and
        nothing is published.
        """
        pool = self._check_sender()
        if nbytes <= 0:
            raise ValueError(f"nbytes must be > 0, got {nbytes}")
        offset, _ = pool.allocator.alloc(nbytes, deadline=0.0 if deadline <= 0 else deadline)
        try:
            write(pool.slot(offset, nbytes))
        except BaseException:
            pool.allocator.free(offset)
            raise
        key = self._make_key(put_key, from_stage, to_stage)
        return True, nbytes, self._publish(key, offset, nbytes)

    def put(self, from_stage: str, to_stage: str, put_key: str, data: Any) -> PutResult:
        """Reference-shaped put: copies ``data`` into a pool slot; ``(False, 0, None)`` on error.

        Bytes-like data and tensors travel raw; other objects as msgpack (non-raw path).
        """
        try:
            view = as_host_bytes(data)
            if view is None:
                view = memoryview(encode_object(data))
            if view.nbytes == 0:
                raise ValueError("empty payload")
            pool = self._check_sender()
            src = view

            def copy(dst: torch.Tensor) -> None:
                pool.copy_in(int(dst.data_ptr()) - pool.address, src)

            return self.put_packed(from_stage, to_stage, put_key, view.nbytes, copy, deadline=0.0)
        except (ConnectorError, ValueError, TypeError) as exc:
            self._counters.add("put_failures")
            logger.error("put of %s failed: %s", put_key, exc)
            return False, 0, None

    # == receiver =================================================================================
    def update_sender_info(self, host: str, port: int) -> None:
        """Default sender endpoint for gets without per-call metadata (called by the manager)."""
        self._default_sender = (str(host), int(port))

    def _endpoint(self, metadata: Mapping[str, Any] | None) -> tuple[str, int]:
        if metadata:
            host = metadata.get("source_host")
            port = metadata.get("source_port")
            if host and port is not None:
                return str(host), int(port)
        if self._default_sender is None:
            raise ConnectorUnavailableError(
                "no sender endpoint: call update_sender_info() or pass source_host/source_port"
            )
        return self._default_sender

    def _socket(self, endpoint: tuple[str, int]) -> Any:
        socks: dict[tuple[str, int], Any] | None = getattr(self._tls, "socks", None)
        if socks is None:
            socks = self._tls.socks = {}
        sock = socks.get(endpoint)
        if sock is None:
            zmq = self._zmq
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES + 256)
            sock.connect(f"tcp://{endpoint[0]}:{endpoint[1]}")
            socks[endpoint] = sock
            with self._sockets_lock:
                self._sockets.add(sock)
        return sock

    def _send(self, sock: Any, msg: dict[str, Any]) -> int:
        nonce = next(self._nonce)
        msg["n"] = nonce
        msg["v"] = PROTOCOL_VERSION
        sock.send_multipart(self._codec.encode(msg))
        return nonce

    def _recv(self, sock: Any, nonces: set[int], timeout_s: float) -> dict[str, Any] | None:
        """The next valid reply whose nonce is in ``nonces`` within ``timeout_s``; else ``None``."""
        end = time.monotonic() + max(0.0, timeout_s)
        while True:
            left = end - time.monotonic()
            if left <= 0 or not sock.poll(math.ceil(left * 1000)):
                return None
            try:
                msg = self._codec.decode(sock.recv_multipart(), _REPLY_OPS)
            except _ProtocolError as exc:
                self._counters.add("rejected_messages")
                logger.warning("rejected a reply: %s", exc)
                continue
            if msg["n"] in nonces:
                return msg

    def _query(self, endpoint: tuple[str, int], key: str, deadline: float, hold: bool) -> int:
        """Size of ``key`` at the sender, ``0`` if absent (after a long-poll when ``hold``)."""
        left = remaining(deadline)
        wait_s = min(max(0.0, left - 0.02), LONG_POLL_CAP_S) if hold else 0.0
        sock = self._socket(endpoint)
        nonce = self._send(sock, {"op": "query", "key": key, "wait_ms": int(wait_s * 1000)})
        reply = self._recv(sock, {nonce}, min(left, wait_s + self.peer_timeout_s))
        if reply is None or reply["op"] != "info" or not reply["found"]:
            return 0
        return int(reply["size"])

    def _pull(
        self, endpoint: tuple[str, int], key: str, size: int, deadline: float
    ) -> GetResult | None:
        """Reserve a slot, ask for the write, wait for ``done`` (pinging the sender)."""
        pool = self._pool
        assert pool is not None
        alloc_deadline = deadline if math.isfinite(deadline) else time.monotonic() + 1.0
        offset, _ = pool.allocator.alloc(size, deadline=alloc_deadline)
        xid = uuid.uuid4().hex
        budget = min(remaining(deadline), _transfer_budget_s(size))
        sock = self._socket(endpoint)
        msg = {
            "op": "pull",
            "key": key,
            "sess": self.session_id,
            "dst": pool.address + offset,
            "cap": size,
            "xid": xid,
            "budget_ms": int(budget * 1000),
        }
        try:
            pull_nonce = self._send(sock, msg)
        except Exception:
            pool.allocator.free(offset)
            raise
        end = time.monotonic() + budget
        nonces = {pull_nonce}
        heard = time.monotonic()
        ping_every = max(0.05, self.peer_timeout_s / 5)
        while True:
            now = time.monotonic()
            if now >= end:
                self._quarantine_slot(key, endpoint, xid, offset, size, heard)
                return None
            if now - heard > self.peer_timeout_s:
                self._quarantine_slot(key, endpoint, xid, offset, size, heard)
                self._counters.add("peer_gone")
                raise PeerGoneError(
                    f"sender {endpoint[0]}:{endpoint[1]} silent for {now - heard:.1f}s "
                    f"while transferring {key}"
                )
            reply = self._recv(sock, nonces, min(ping_every, end - now))
            if reply is None:
                nonces.add(self._send(sock, {"op": "ping"}))
                continue
            heard = time.monotonic()
            op = reply["op"]
            if op == "pong":
                continue
            if op == "done":
                got = int(reply["size"])
                return self._deliver(offset, got)
            pool.allocator.free(offset)  # the sender says it did not (and will not) write
            reason = reply.get("reason", "")
            if reason in {"not_found", "busy", "expired"}:
                return None
            raise ConnectorUnavailableError(f"sender failed to transfer {key}: {reason}")

    def _deliver(self, offset: int, size: int) -> GetResult:
        pool = self._pool
        assert pool is not None
        buf = ManagedBuffer(pool.slot(offset, size), _Release(pool, offset))
        self._counters.add("gets")
        self._counters.add("get_bytes", size)
        decoded = decode_if_object(buf, size)
        return decoded if decoded is not None else (buf, size)

    def _quarantine_slot(
        self,
        key: str,
        endpoint: tuple[str, int],
        xid: str,
        offset: int,
        size: int,
        heard: float,
    ) -> None:
        now = time.monotonic()
        with self._lock:
            self._quarantine[xid] = _Quarantined(key, endpoint, xid, offset, size, now, heard)
            start = self._reaper is None and not self._stop.is_set()
            if start:
                self._reaper = threading.Thread(
                    target=self._reap_quarantine, name="omnikv-te-quarantine", daemon=True
                )
        self._counters.add("quarantine_events")
        logger.warning(
            "quarantined a %d-byte slot for %s (transfer %s may be running)", size, key, xid
        )
        if start and self._reaper is not None:
            self._reaper.start()

    def _reap_quarantine(self) -> None:
        """Receiver thread: frees quarantined slots once their transfer is finished or dead."""
        interval = max(0.05, min(0.5, self.peer_timeout_s / 5))
        while not self._stop.wait(interval):
            with self._lock:
                items = list(self._quarantine.values())
            for q in items:
                if self._stop.is_set():
                    return
                self._check_quarantined(q)

    def _check_quarantined(self, q: _Quarantined) -> None:
        state = "silent"
        try:
            sock = self._socket(q.endpoint)
            nonce = self._send(sock, {"op": "status", "xid": q.xid})
            reply = self._recv(sock, {nonce}, min(1.0, self.peer_timeout_s))
            if reply is not None and reply["op"] == "xstate":
                state = str(reply.get("state", "unknown"))
        except Exception:
            logger.debug("status query for %s failed", q.xid, exc_info=True)
        now = time.monotonic()
        if state == "inflight" or (
            state == "silent" and now - q.last_heard < self.quarantine_dead_s
        ):
            if state == "inflight":
                q.last_heard = now
            return
        with self._lock:
            if self._quarantine.pop(q.xid, None) is None:
                return
            late = state == "done" and not self._closed
            if late:
                old = self._late.pop(q.key, None)
                self._late[q.key] = _Late(q.offset, q.size, now)
        assert self._pool is not None
        if late:
            self._counters.add("late_arrivals")
            logger.info(
                "transfer of %s finished after its receiver gave up; kept for a retry", q.key
            )
            if old is not None:
                self._pool.allocator.free(old.offset)
        else:
            self._pool.allocator.free(q.offset)
            self._counters.add("quarantine_freed")

    def _take_late(self, key: str) -> GetResult | None:
        with self._lock:
            late = self._late.pop(key, None)
        if late is None:
            return None
        return self._deliver(late.offset, late.size)

    def _check_receiver(self) -> None:
        if self._closed:
            raise ConnectorClosedError("MooncakeTransferEngineConnector is closed")

    def get(
        self,
        from_stage: str,
        to_stage: str,
        get_key: str,
        metadata: dict[str, Any] | None = None,
    ) -> GetResult | None:
        """Reference-shaped get: one query (no hold), pull if present; ``None`` otherwise.

        Returns ``(ManagedBuffer, size)`` over the receiver's registered pool slot (the caller
        releases it), or ``(obj, size)`` for an object put. Errors are logged and give ``None``.
        """
        self._check_receiver()
        key = self._make_key(get_key, from_stage, to_stage)
        try:
            late = self._take_late(key)
            if late is not None:
                return late
            endpoint = self._endpoint(metadata)
            deadline = time.monotonic() + self.peer_timeout_s
            size = self._query(endpoint, key, deadline, hold=False)
            if size <= 0:
                self._counters.add("misses")
                return None
            return self._pull(endpoint, key, size, time.monotonic() + _transfer_budget_s(size))
        except ConnectorError as exc:
            logger.error("get of %s failed: %s", key, exc)
            return None

    def wait(
        self,
        from_stage: str,
        to_stage: str,
        get_key: str,
        *,
        deadline: float,
        metadata: dict[str, Any] | None = None,
    ) -> GetResult | None:
        """Block until the payload is delivered or ``deadline`` passes (then ``None``).

        Long-polls the sender (no sleep loop). Raises ``PeerGoneError`` when the sender falls
        silent mid-transfer, ``PoolExhaustedError`` when no receive slot frees up before the
        deadline, ``ConnectorUnavailableError`` for a failed transfer or a missing endpoint.
        """
        self._check_receiver()
        key = self._make_key(get_key, from_stage, to_stage)
        late = self._take_late(key)
        if late is not None:
            return late
        endpoint = self._endpoint(metadata)
        try:
            while True:
                if self._closed:
                    raise ConnectorClosedError("MooncakeTransferEngineConnector is closed")
                if remaining(deadline) <= 0:
                    self._counters.add("misses")
                    return None
                with self._lock:
                    pending = any(q.key == key for q in self._quarantine.values())
                hold_deadline = min(deadline, time.monotonic() + 0.25) if pending else deadline
                size = self._query(endpoint, key, hold_deadline, hold=True)
                if size <= 0 and pending:
                    late = self._take_late(key)
                    if late is not None:
                        return late
                if size <= 0:
                    continue
                result = self._pull(endpoint, key, size, deadline)
                if result is not None:
                    return result
                late = self._take_late(key)
                if late is not None:
                    return late
        except self._zmq.ZMQError as exc:
            raise ConnectorUnavailableError(f"control channel to {endpoint}: {exc}") from exc

    # == common ===================================================================================
    def cleanup(self, request_id: str) -> None:
        """Drop unconsumed entries (sender) and late arrivals (receiver) of ``request_id``."""
        with self._lock:
            entries = [
                e
                for k, e in self._entries.items()
                if matches_request(k, request_id) and not e.inflight
            ]
            for e in entries:
                del self._entries[e.key]
            lates = [k for k in self._late if matches_request(k, request_id)]
            late_items = [self._late.pop(k) for k in lates]
        if self._pool is not None:
            for e in entries:
                self._pool.allocator.free(e.offset)
            for late in late_items:
                self._pool.allocator.free(late.offset)

    def pending_keys(self) -> list[str]:
        """Keys published by this sender and not yet consumed (tests, diagnostics)."""
        with self._lock:
            return list(self._entries)

    def health(self) -> dict[str, Any]:
        """Status, endpoints, pool use and counters. Cheap; never raises."""
        pool = self._pool
        with self._lock:
            entries, quarantined, late = len(self._entries), len(self._quarantine), len(self._late)
            inflight = self._inflight
        with self._counters.lock:
            counters = dict(self._counters.values)
        return {
            "status": "closed" if self._closed else "healthy",
            "type": type(self).__name__,
            "role": self.role,
            "host": self.host,
            "zmq_port": self.zmq_port,
            "session_id": getattr(self, "session_id", None),
            "protocol": self.protocol,
            "authenticated": self._codec._secret is not None,
            "pool_size": pool.size if pool is not None else 0,
            "pool_used": pool.allocator.used_bytes if pool is not None and not pool.closed else 0,
            "entries": entries,
            "inflight": inflight,
            "quarantined": quarantined,
            "late_arrivals_held": late,
            "threads": [t.name for t in self._threads() if t.is_alive()],
            **counters,
        }

    def _threads(self) -> Iterator[threading.Thread]:
        for t in (self._listener, self._reaper):
            if t is not None:
                yield t

    def close(self) -> None:
        """Stop and join threads, close sockets, wait for in-flight writes, unregister, unmap.

        Idempotent. In-flight pulls are waited for up to ``close_timeout_seconds``; if one is
        still running then, the pool stays mapped (leaked, logged) rather than freed under it.
        """
        if self._closed:
            return
        self._closed = True
        self._teardown()

    def _teardown(self) -> None:
        self._stop.set()
        if self._listener is not None:
            self._wake()
        for t in list(self._threads()):
            if t is not threading.current_thread():
                t.join(timeout=max(5.0, self.peer_timeout_s * 2))
        safe_to_free = True
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            with self._inflight_cond:
                end = time.monotonic() + self.close_timeout_s
                while self._inflight > 0 and time.monotonic() < end:
                    self._inflight_cond.wait(timeout=max(0.0, end - time.monotonic()))
                safe_to_free = self._inflight == 0
            if safe_to_free:
                self._executor.shutdown(wait=True)
        with self._lock:
            if self._quarantine:
                # unregistering below makes the engine refuse any later write into the pool
                logger.warning("closing with %d quarantined receive slots", len(self._quarantine))
            self._quarantine.clear()
            self._late.clear()
            self._entries.clear()
            self._waiters.clear()
        with self._sockets_lock:
            socks = list(self._sockets)
            self._sockets.clear()
        for s in socks:
            with contextlib.suppress(Exception):
                s.close(0)
        if getattr(self, "_wake_push", None) is not None:
            with contextlib.suppress(Exception):
                self._wake_push.close(0)
        if self._ctx is not None:
            with contextlib.suppress(Exception):
                self._ctx.term()
            self._ctx = None
        if not safe_to_free:
            logger.error("a transfer is still running at close; leaving the pool mapped")
            return
        if self._registered and self._pool is not None and self._engine is not None:
            rc = self._engine.unregister_memory(self._pool.address)
            if rc != 0:
                logger.warning("unregister_memory returned %d", rc)
            self._registered = False
        self._engine = None
        if self._pool is not None:
            self._pool.close()
            self._pool = None


class _Release:
    """The release callback of a receive slot (a small class so no closure keeps ``self``)."""

    __slots__ = ("_offset", "_pool")

    def __init__(self, pool: HostPool, offset: int) -> None:
        self._pool = pool
        self._offset = offset

    def __call__(self) -> None:
        if not self._pool.closed:
            self._pool.allocator.free(self._offset)
