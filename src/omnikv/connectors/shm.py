"""SharedMemoryConnector: node-local KV hand-off through pooled, pre-faulted shared memory.

Design (one page):

* **Pools.** Every connector that puts owns one pool: an anonymous ``memfd`` (no name in
  ``/dev/shm``), ``0600``, sealed against resizing, mapped once with ``MAP_POPULATE``, sized by
  ``pool_size_bytes`` (default 1 GiB, made on the first put). A put allocates a page-aligned slot
  and the payload is encoded once, straight into it (``put_packed`` hands the slot to ``write``).
* **Mesh.** Every connector binds a listening socket in the Linux *abstract* Unix namespace
  (``omnikv-shm/<uid>/<namespace hash>/<pid>-<random>``; no file) and connects to the peers of
  its namespace that already exist (found in ``/proc/net/unix``) while holding a per-namespace
  abstract-name lock, so every pair of peers shares exactly one connection. Peers of another uid
  are refused (``SO_PEERCRED``).
* **Protocol** (msgpack frames, no pickle). A receiver sends ``want(key)`` to every peer; the
  peer holding the key answers ``offer(token, offset, size)`` (passing its pool's descriptor with
  ``send_fds`` before the first offer on a connection) and marks the slot as held by that reader,
  so a key is consumed exactly once. A blocking want stays registered at every peer until it is
  answered or cancelled, so a put wakes the waiter with one message (no polling). The reader's
  ``ManagedBuffer`` is a zero-copy view of the mapped pool; its ``release()`` (or the death of
  its ``adopt()`` tensors) sends ``release(token)`` and the sender frees the slot. An offer that
  arrives after the waiter gave up is ``return``-ed and the payload is published again.
* **Crash safety by construction.** Nothing has a name on disk: memfds die with their last
  descriptor or mapping, abstract names with their socket. A reader's death closes its connection
  and the sender reclaims every slot the reader held or was being offered; a sender's death is an
  EOF for readers, whose views stay valid (the mapping pins the memory) until they are dropped.
* **Bounds.** A put that finds the pool full waits (on a condition, woken by frees) until its
  deadline (at most ``put_timeout_s``) and then raises :class:`PoolExhaustedError` saying how
  much is free and held. A payload larger than the whole pool is refused at once with the same
  error (no dedicated segment: memory stays bounded by ``pool_size_bytes``).

Keys are ``"<key>@<from>_<to>"`` (edges never collide) with every part escaped to
``[A-Za-z0-9_.:=+-%]`` and at most 1024 characters. Thread-safe: any number of threads may
``put``/``get``/``wait`` at once; one I/O thread per connector serves the sockets.

Config keys (``connector_config = {"type": "SharedMemoryConnector", ...}``; all optional):

==================  ===========  ============================================================
key                 default      meaning
==================  ===========  ============================================================
``namespace``       ``default``  connectors meet only within one namespace (per uid, per node)
``pool_size_bytes`` 1 GiB        this connector's send pool (made on its first put; >= 4096);
                                 a payload larger than it is refused with PoolExhaustedError
``prefault``        ``True``     ``MAP_POPULATE`` the pool and peers' pools when mapping them
``put_timeout_s``   30           longest a put waits for pool space (the deadline caps it too)
``get_timeout_s``   0.1          how long a non-blocking ``get`` waits for peers' answers
``join_timeout_s``  10           longest the constructor waits for the namespace join lock
``type``, ``name``  (ignored)    accepted for the factory; unknown keys are logged and ignored
==================  ===========  ============================================================

Measured by ``omnikv bench shm`` (cross-process, 224 MiB KV and 64 KiB). Note for callers: a
parallel torch op leaves OpenMP workers spinning for a while; on a machine with as many busy
threads as cores that delays the connector's wake-ups to the next scheduler tick (~4 ms).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import math
import os
import secrets
import selectors
import socket
import threading
import time
import weakref
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import torch

from omnikv.connectors._shm_pool import Allocator, PeerPool, SenderPool
from omnikv.connectors._shm_wire import (
    FrameReader,
    NamespaceLock,
    abstract,
    discover,
    encode_frame,
    escape_key,
    namespace_prefix,
    peer_uid,
    transport_key,
)
from omnikv.connectors.base import GetResult, ManagedBuffer, OmniConnectorBase, PutResult, Writer
from omnikv.deadline import remaining
from omnikv.errors import (
    ConfigError,
    ConnectorClosedError,
    ConnectorError,
    ConnectorUnavailableError,
    OmniKVError,
    PeerGoneError,
    PoolExhaustedError,
)

__all__ = ["DEFAULT_POOL_SIZE", "SharedMemoryConnector"]

logger = logging.getLogger(__name__)

DEFAULT_POOL_SIZE = 1 << 30
_KIND_RAW = "raw"
_KIND_MSGPACK = "msgpack"
_EXT_TENSOR = 1
_KNOWN_CONFIG = {
    "type",
    "name",
    "namespace",
    "pool_size_bytes",
    "prefault",
    "put_timeout_s",
    "get_timeout_s",
    "join_timeout_s",
}


# -- small state records ------------------------------------------------------------------------
class _Link:
    """One connection to a peer connector (either direction). Sends are serialised by a lock."""

    def __init__(self, sock: socket.socket, pid: int) -> None:
        self.sock = sock
        self.pid = pid
        self.peer = f"pid {pid}"
        self.alive = True
        self.send_lock = threading.RLock()
        self.reader = FrameReader()
        self.fds: deque[int] = deque()
        self.pool: PeerPool | None = None  # the peer's pool, mapped here
        self.pool_sent = False  # our pool's descriptor was sent on this link

    def __repr__(self) -> str:
        return f"_Link({self.peer})"


@dataclass
class _Entry:
    """A payload in our pool: published under ``key`` or held by ``holder`` as ``token``."""

    key: str
    offset: int
    nbytes: int
    kind: str
    token: int = 0
    holder: _Link | None = None


@dataclass
class _Offer:
    link: _Link
    pool: PeerPool
    token: int
    offset: int
    nbytes: int
    kind: str


@dataclass
class _Want:
    """A receiver's outstanding request for a key (blocking: registered at every peer)."""

    wid: int
    key: str
    block: bool
    event: threading.Event = field(default_factory=threading.Event)
    offer: _Offer | None = None
    pending: set[_Link] = field(default_factory=set)  # non-blocking: peers yet to answer
    senders_lost: list[str] = field(default_factory=list)


# -- payload (de)serialisation for non-bytes puts (msgpack, tensors as an ext type) ------------
def _ext_default(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        from omnikv.payload import DTYPE_ALLOWLIST

        name = str(obj.dtype).replace("torch.", "")
        if name not in DTYPE_ALLOWLIST:
            raise TypeError(f"tensor dtype {obj.dtype} is not allowed")
        host = obj.detach().contiguous().cpu()
        raw = host.reshape(-1).view(torch.uint8).numpy().tobytes()
        inner = msgpack.packb([name, list(host.shape), raw], use_bin_type=True)
        return msgpack.ExtType(_EXT_TENSOR, inner)
    if isinstance(obj, tuple):
        return list(obj)
    raise TypeError(f"cannot encode {type(obj).__name__} for shared memory")


def _ext_hook(code: int, data: bytes) -> Any:
    if code != _EXT_TENSOR:
        raise ValueError(f"unknown msgpack ext type {code}")
    from omnikv.payload import DTYPE_ALLOWLIST

    name, shape, raw = msgpack.unpackb(data, raw=False)
    dtype = DTYPE_ALLOWLIST.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise ValueError(f"tensor dtype {name!r} is not allowed")
    flat = (
        torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        if raw
        else torch.empty(0, dtype=torch.uint8)
    )
    return flat.view(dtype).reshape([int(s) for s in shape])


def _prepare(data: Any) -> tuple[str, int, Writer]:
    """(kind, nbytes, writer) for a reference-shaped ``put``; bytes-like data is copied as is."""
    if data is None:
        raise ValueError("cannot put None")
    src: np.ndarray | torch.Tensor
    if isinstance(data, bytes | bytearray | memoryview):
        mv = memoryview(data)
        src = np.frombuffer(mv if mv.contiguous else mv.tobytes(), dtype=np.uint8)
    elif isinstance(data, torch.Tensor) and data.dtype == torch.uint8 and data.dim() == 1:
        src = data.detach().contiguous()
    elif isinstance(data, np.ndarray) and data.dtype == np.uint8 and data.ndim == 1:
        src = np.ascontiguousarray(data)
    else:
        body = msgpack.packb(data, default=_ext_default, use_bin_type=True)
        src = np.frombuffer(body, dtype=np.uint8)
        return _KIND_MSGPACK, src.size, functools.partial(_copy_into, src)
    n = int(src.numel()) if isinstance(src, torch.Tensor) else int(src.size)
    return _KIND_RAW, n, functools.partial(_copy_into, src)


def _copy_into(src: np.ndarray | torch.Tensor, dst: torch.Tensor) -> None:
    if isinstance(src, torch.Tensor):
        dst.copy_(src)
    elif src.size:
        dst.numpy()[:] = src


def _ints(*values: Any) -> None:
    for v in values:
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"expected a non-negative int in a control message, got {v!r}")


def _wake(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.write(fd, b"\0")


def _close_fds(*fds: int) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


class SharedMemoryConnector(OmniConnectorBase):
    """Node-local connector over memfd pools and abstract Unix sockets (see module docstring).

    Config keys (all optional): ``namespace`` (``"default"``; connectors meet only within one),
    ``pool_size_bytes`` (1 GiB; the sender's pool, made on the first put), ``prefault`` (True),
    ``put_timeout_s`` (30; the longest a put waits for pool space), ``get_timeout_s`` (0.1; how
    long a non-blocking ``get`` waits for peers to answer), ``join_timeout_s`` (10). ``type`` is
    accepted and ignored; unknown keys are logged and ignored.
    """

    supports_raw_data = True
    supports_notify = True
    supports_zero_copy_put = True

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self._closed = True  # until fully built, so __del__ of a half-built object is a no-op
        cfg = dict(config or {})
        unknown = sorted(set(cfg) - _KNOWN_CONFIG)
        if unknown:
            logger.info("SharedMemoryConnector ignores config keys %s", unknown)
        self.namespace = str(cfg.get("namespace", "default"))
        try:
            self.pool_size = int(cfg.get("pool_size_bytes", DEFAULT_POOL_SIZE))
            self.prefault = bool(cfg.get("prefault", True))
            self.put_timeout_s = float(cfg.get("put_timeout_s", 30.0))
            self.get_timeout_s = float(cfg.get("get_timeout_s", 0.1))
            join_timeout = float(cfg.get("join_timeout_s", 10.0))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"invalid SharedMemoryConnector config: {exc}") from exc
        if self.pool_size < 4096:
            raise ConfigError(f"pool_size_bytes must be >= 4096, got {self.pool_size}")
        for name, value in (
            ("put_timeout_s", self.put_timeout_s),
            ("get_timeout_s", self.get_timeout_s),
            ("join_timeout_s", join_timeout),
        ):
            if math.isnan(value) or value < 0:
                raise ConfigError(f"{name} must be >= 0 seconds, got {value!r}")

        self._lock = threading.Lock()
        self._space = threading.Condition(self._lock)
        self._pool_lock = threading.Lock()
        self._pool: SenderPool | None = None
        self._alloc: Allocator | None = None
        self._pool_id = secrets.randbits(48)
        self._published: dict[str, _Entry] = {}
        self._held: dict[int, _Entry] = {}
        self._wanters: dict[str, list[tuple[_Link, int]]] = {}
        self._wants: dict[int, _Want] = {}
        self._links: set[_Link] = set()
        self._tokens = itertools.count(1)
        self._wids = itertools.count(1)
        self._counters: dict[str, int] = dict.fromkeys(
            (
                "puts",
                "put_failures",
                "gets",
                "misses",
                "bytes_put",
                "bytes_got",
                "put_waits",
                "put_timeouts",
                "releases",
                "returns",
                "replaced",
                "reclaimed_from_dead_readers",
                "peers_gone",
                "peers_refused",
            ),
            0,
        )

        self._prefix = namespace_prefix(self.namespace)
        self.instance = f"{os.getpid()}-{secrets.token_hex(6)}"
        self._name = self._prefix + self.instance
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        # The wake pipe outlives close(), so a late wake-up never writes to a reused descriptor.
        weakref.finalize(self, _close_fds, self._wake_r, self._wake_w)
        self._sel = selectors.DefaultSelector()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._stop = False
        try:
            with NamespaceLock(self._prefix, join_timeout):
                self._listener.bind(abstract(self._name))
                self._listener.listen(128)
                peers = sorted(discover(self._prefix) - {self._name})
                for name in peers:
                    self._connect(name)
        except (OSError, TimeoutError) as exc:
            self._listener.close()
            for link in self._links:
                link.sock.close()
            self._sel.close()
            raise ConnectorUnavailableError(
                f"cannot join shared-memory namespace {self.namespace!r}: {exc}"
            ) from exc
        self._sel.register(self._listener, selectors.EVENT_READ, "listen")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        for link in self._links:
            self._sel.register(link.sock, selectors.EVENT_READ, link)
        self._closed = False
        self._thread = threading.Thread(target=self._io_loop, name="omnikv-shm-io", daemon=True)
        self._thread.start()
        logger.debug(
            "SharedMemoryConnector %s joined namespace %r with %d peer(s)",
            self.instance,
            self.namespace,
            len(self._links),
        )

    # -- joining ------------------------------------------------------------------------------
    def _connect(self, name: str) -> None:
        """Connect to a listening peer found at join time (namespace lock held)."""
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(abstract(name))
            pid, uid = peer_uid(s)
        except OSError as exc:  # it went away between listing and connecting
            s.close()
            logger.debug("peer %s not reachable: %s", name, exc)
            return
        if uid != os.getuid():
            s.close()
            self._counters["peers_refused"] += 1
            logger.warning("refusing shared-memory peer %s of uid %d", name, uid)
            return
        link = _Link(s, pid)
        link.peer = name.rsplit("/", 1)[-1]
        self._links.add(link)
        self._send(link, [["hello", self.instance, os.getpid()]])

    def _accept(self) -> None:
        try:
            s, _ = self._listener.accept()
            pid, uid = peer_uid(s)
        except OSError as exc:
            logger.debug("accept failed: %s", exc)
            return
        if uid != os.getuid():
            s.close()
            with self._lock:
                self._counters["peers_refused"] += 1
            logger.warning("refused a shared-memory connection from uid %d (pid %d)", uid, pid)
            return
        link = _Link(s, pid)
        with self._lock:
            self._links.add(link)
            wants = [w for w in self._wants.values() if w.block and w.offer is None]
        self._sel.register(s, selectors.EVENT_READ, link)
        msgs: list[list[Any]] = [["hello", self.instance, os.getpid()]]
        msgs += [["want", w.wid, w.key, True] for w in wants]
        self._send(link, msgs)

    # -- sending ------------------------------------------------------------------------------
    def _send(self, link: _Link, msgs: list[list[Any]], *, with_pool: bool = False) -> bool:
        """Send frames on ``link`` (pool descriptor first when needed). False if the link died.

        Called from any thread without ``self._lock`` held. A failure shuts the socket down, so
        the I/O thread sees EOF and does the peer-gone bookkeeping.
        """
        data = b"".join(encode_frame(m) for m in msgs)
        with link.send_lock:
            if not link.alive:
                return False
            try:
                if with_pool and not link.pool_sent:
                    pool = self._pool
                    if pool is None or pool.fd is None:
                        raise OSError("pool is closed")
                    frame = encode_frame(["pool", self._pool_id, pool.size])
                    sent = socket.send_fds(link.sock, [frame], [pool.fd])
                    if sent != len(frame):
                        link.sock.sendall(frame[sent:])
                    link.pool_sent = True
                link.sock.sendall(data)
                return True
            except OSError as exc:
                logger.debug("send to %s failed: %s", link, exc)
                with contextlib.suppress(OSError):
                    link.sock.shutdown(socket.SHUT_RDWR)
                return False

    def _release_cb(self, link: _Link, token: int) -> None:
        """Release callback of a handed-out view (any thread, also a GC finalizer).

        Sends ``release`` at once, so a later message of the same thread (a get, a want) reaches
        the sender after it. The send lock is reentrant and no other lock is taken here, so a
        finalizer that runs while this thread is inside ``_send`` only puts whole frames first.
        """
        if not self._closed:
            self._send(link, [["release", token]])

    # -- sender side --------------------------------------------------------------------------
    def _ensure_pool(self) -> tuple[SenderPool, Allocator]:
        pool, alloc = self._pool, self._alloc
        if pool is not None and alloc is not None:
            return pool, alloc
        with self._pool_lock:
            if self._pool is None:
                try:
                    pool = SenderPool(self.pool_size, "omnikv-shm", prefault=self.prefault)
                except OSError as exc:
                    raise ConnectorUnavailableError(
                        f"cannot create a shared-memory pool of {self.pool_size} bytes: {exc}"
                    ) from exc
                with self._lock:
                    self._alloc = Allocator(pool.size)
                    self._pool = pool
                logger.debug("SharedMemoryConnector %s pool of %d bytes", self.instance, pool.size)
        assert self._pool is not None and self._alloc is not None
        return self._pool, self._alloc

    def _allocate(self, alloc: Allocator, key: str, nbytes: int, deadline: float) -> int:
        """A slot for ``nbytes``; waits for frees until ``deadline`` (PoolExhaustedError)."""
        t0 = time.monotonic()
        waited = False
        with self._space:
            while True:
                if self._closed:
                    raise ConnectorClosedError("SharedMemoryConnector is closed")
                off = alloc.alloc(nbytes)
                if off is not None:
                    return off
                left = remaining(deadline)
                if left <= 0:
                    self._counters["put_timeouts"] += 1
                    raise PoolExhaustedError(
                        f"no space for {nbytes} bytes ({key}) after {time.monotonic() - t0:.3f}s:"
                        f" pool of {alloc.total} bytes has {alloc.free_bytes} free (largest"
                        f" {alloc.largest_free}); {len(self._held)} payload(s) held by readers,"
                        f" {len(self._published)} published and unconsumed"
                    )
                if not waited:
                    waited = True
                    self._counters["put_waits"] += 1
                self._space.wait(min(left, 3600.0))

    def _free(self, entry: _Entry) -> None:
        """Return an entry's slot (``self._lock`` held) and wake puts waiting for space."""
        if self._alloc is not None:
            self._alloc.free(entry.offset)
        self._space.notify_all()

    def _hold(self, entry: _Entry, link: _Link, wid: int) -> list[Any]:
        """Mark ``entry`` as offered to ``link`` (lock held); the offer message to send."""
        entry.token = next(self._tokens)
        entry.holder = link
        self._held[entry.token] = entry
        return ["offer", wid, entry.token, entry.offset, entry.nbytes, entry.kind]

    def _deliver(self, entry: _Entry) -> None:
        """Offer ``entry`` to the first live waiter of its key, else publish it (replacing)."""
        while True:
            with self._lock:
                if self._closed:
                    return
                queue = self._wanters.get(entry.key)
                target: tuple[_Link, list[Any]] | None = None
                while queue:
                    link, wid = queue.pop(0)
                    if link.alive:
                        target = (link, self._hold(entry, link, wid))
                        break
                if not queue:
                    self._wanters.pop(entry.key, None)
                if target is None:
                    old = self._published.pop(entry.key, None)
                    if old is not None:
                        self._counters["replaced"] += 1
                        logger.warning("key %s put again before it was consumed", entry.key)
                        self._free(old)
                    self._published[entry.key] = entry
                    return
            if self._send(target[0], [target[1]], with_pool=True):
                return
            self._take_back(entry)

    def _take_back(self, entry: _Entry) -> None:
        """An offer could not be sent: the entry is ours again (lock not held)."""
        with self._lock:
            if self._held.get(entry.token) is entry:
                del self._held[entry.token]
            entry.holder = None

    def _put(self, key: str, nbytes: int, write: Writer, kind: str, deadline: float) -> PutResult:
        if self._closed:
            raise ConnectorClosedError("SharedMemoryConnector is closed")
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        pool, alloc = self._ensure_pool()
        if alloc.block_size(nbytes) > alloc.total:
            with self._lock:
                self._counters["put_failures"] += 1
            raise PoolExhaustedError(
                f"payload of {nbytes} bytes ({key}) can never fit the pool of {alloc.total} bytes;"
                " raise pool_size_bytes"
            )
        deadline = min(deadline, time.monotonic() + self.put_timeout_s)
        try:
            offset = self._allocate(alloc, key, nbytes, deadline)
        except ConnectorError:
            with self._lock:
                self._counters["put_failures"] += 1
            raise
        entry = _Entry(key, offset, nbytes, kind)
        try:
            write(pool.slot(offset, nbytes))
        except BaseException:
            with self._lock:
                self._free(entry)
                self._counters["put_failures"] += 1
            raise
        self._deliver(entry)
        with self._lock:
            self._counters["puts"] += 1
            self._counters["bytes_put"] += nbytes
        logger.debug("SharedMemoryConnector put %s (%d bytes at %d)", key, nbytes, offset)
        return True, nbytes, {"key": key, "size": nbytes}

    def put(self, from_stage: str, to_stage: str, put_key: str, data: Any) -> PutResult:
        """Reference-shaped put: ``data`` is copied into the pool once; ``(False, 0, None)`` on
        failure (the reason is logged).

        ``data`` may be bytes-like, a 1-D ``uint8`` tensor / array (kept raw; ``get`` returns a
        :class:`ManagedBuffer`) or anything msgpack can encode, tensors included (``get``
        returns the decoded object). Waits for pool space up to ``put_timeout_s``.
        """
        try:
            key = transport_key(put_key, from_stage, to_stage)
            kind, nbytes, write = _prepare(data)
            return self._put(key, nbytes, write, kind, math.inf)
        except (OmniKVError, ValueError, TypeError, OverflowError) as exc:
            logger.warning("SharedMemoryConnector put of %r failed: %s", put_key, exc)
            return False, 0, None

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
        """The sender's hot path: ``write`` fills a pool slot of ``nbytes`` in place (one copy).

        Waits for space until ``deadline`` (capped at ``put_timeout_s``), then raises
        :class:`PoolExhaustedError`; a payload larger than the pool raises it at once. Raises
        ``ConnectorClosedError`` after close and ``ValueError`` for an unusable key. If ``write``
        raises, the slot is freed, nothing is published and the exception propagates.
        """
        key = transport_key(put_key, from_stage, to_stage)
        return self._put(key, int(nbytes), write, _KIND_RAW, deadline)

    # -- receiver side ------------------------------------------------------------------------
    def _take(self, key: str, block: bool, deadline: float) -> GetResult | None:
        want = _Want(next(self._wids), key, block)
        with self._lock:
            if self._closed:
                raise ConnectorClosedError("SharedMemoryConnector is closed")
            links = [link for link in self._links if link.alive]
            self._wants[want.wid] = want
            if not block:
                want.pending = set(links)
        msg = ["want", want.wid, key, block]
        for link in links:
            if not self._send(link, [msg]) and not block:
                with self._lock:
                    want.pending.discard(link)
        offer: _Offer | None = None
        try:
            while True:
                want.event.clear()
                with self._lock:
                    offer = want.offer
                    if offer is not None or self._closed or (not block and not want.pending):
                        break
                left = remaining(deadline)
                if left <= 0:
                    break
                want.event.wait(min(left, 3600.0))
        finally:
            with self._lock:
                self._wants.pop(want.wid, None)
                offer = want.offer
                others = [link for link in self._links if link.alive]
                if offer is None:
                    self._counters["misses"] += 1
            if block:
                for link in others:
                    if offer is None or link is not offer.link:
                        self._send(link, [["cancel", want.wid]])
        if offer is None:
            if want.senders_lost and not self._closed:
                raise PeerGoneError(
                    f"sender(s) {', '.join(want.senders_lost)} went away while waiting for {key}"
                )
            return None
        return self._materialize(offer)

    def _materialize(self, offer: _Offer) -> GetResult:
        """Turn an accepted offer into the caller's result; the slot is released later."""
        release = functools.partial(self._release_cb, offer.link, offer.token)
        try:
            view = offer.pool.view(offer.offset, offer.nbytes)
        except (RuntimeError, ValueError) as exc:
            release()
            raise PeerGoneError(f"payload {offer.token} from {offer.link} unusable: {exc}") from exc
        with self._lock:
            self._counters["gets"] += 1
            self._counters["bytes_got"] += offer.nbytes
        if offer.kind == _KIND_RAW:
            return ManagedBuffer(view, release), offer.nbytes
        try:
            obj = msgpack.unpackb(view.numpy().tobytes(), raw=False, ext_hook=_ext_hook)
        except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError) as exc:
            raise ConnectorError(f"undecodable msgpack payload: {exc}") from exc
        finally:
            release()
        return obj, offer.nbytes

    def get(
        self,
        from_stage: str,
        to_stage: str,
        get_key: str,
        metadata: dict[str, Any] | None = None,
    ) -> GetResult | None:
        """Take the payload if some peer holds it (consume-once); ``None`` otherwise.

        Asks every peer and waits for their answers at most ``get_timeout_s``. Raw payloads come
        back as a :class:`ManagedBuffer` (zero-copy; the caller releases it), others decoded.
        Raises ``ConnectorClosedError`` after close; other failures are logged and give ``None``.
        """
        if self._closed:
            raise ConnectorClosedError("SharedMemoryConnector is closed")
        try:
            key = transport_key(get_key, from_stage, to_stage)
            return self._take(key, False, time.monotonic() + self.get_timeout_s)
        except ConnectorClosedError:
            raise
        except (ConnectorError, ValueError) as exc:
            logger.warning("SharedMemoryConnector get of %r failed: %s", get_key, exc)
            return None

    def wait(  # type: ignore[override]  # merge: shm returns ManagedBuffer (contract 1)
        self,
        from_stage: str,
        to_stage: str,
        get_key: str,
        *,
        deadline: float,
        metadata: dict[str, Any] | None = None,
    ) -> GetResult | None:
        """Block until a peer offers ``get_key`` or ``deadline`` (absolute monotonic) passes.

        Woken by the sender's offer message (no polling). Returns ``None`` at the deadline
        without consuming anything, or raises :class:`PeerGoneError` when a sender connected
        during the wait went away and nothing arrived. Returns ``None`` if closed meanwhile.
        """
        key = transport_key(get_key, from_stage, to_stage)
        return self._take(key, True, deadline)

    def cleanup(self, request_id: str) -> None:
        """Drop unconsumed payloads of ``request_id`` here and at every peer of the namespace.

        Matches transport keys whose key part equals the id, starts with ``id_`` or ends with
        ``_id`` (like the reference). Payloads already held by readers are theirs to release.
        """
        self._cleanup_local(request_id)
        with self._lock:
            links = [link for link in self._links if link.alive]
        for link in links:
            self._send(link, [["cleanup", request_id]])

    def _cleanup_local(self, request_id: str) -> None:
        rid = escape_key(request_id)
        with self._lock:
            for key in list(self._published):
                base = key.rsplit("@", 1)[0]
                if base == rid or base.startswith(f"{rid}_") or base.endswith(f"_{rid}"):
                    self._free(self._published.pop(key))
                    logger.debug("cleanup dropped %s", key)

    # -- I/O thread ---------------------------------------------------------------------------
    def _io_loop(self) -> None:
        """Serve accepts and peer messages until close."""
        while not self._stop:
            try:
                events = self._sel.select()
            except (OSError, ValueError):
                if self._stop:
                    break
                raise
            for key, _mask in events:
                if key.data == "wake":
                    with contextlib.suppress(OSError):
                        while os.read(self._wake_r, 4096):
                            pass
                elif key.data == "listen":
                    self._accept()
                else:
                    self._read(key.data)

    def _read(self, link: _Link) -> None:
        try:
            data, fds, _flags, _addr = socket.recv_fds(link.sock, 256 * 1024, 4)
        except OSError as exc:
            logger.debug("read from %s failed: %s", link, exc)
            self._link_gone(link)
            return
        link.fds.extend(fds)
        if not data:
            self._link_gone(link)
            return
        try:
            for msg in link.reader.feed(data):
                self._dispatch(link, msg)
        except (ValueError, TypeError, IndexError, KeyError, msgpack.ExtraData) as exc:
            logger.warning("protocol error from %s: %s; dropping the connection", link, exc)
            self._link_gone(link)

    def _dispatch(self, link: _Link, msg: list[Any]) -> None:
        kind = msg[0]
        if kind == "want":
            wid, key, block = msg[1], msg[2], bool(msg[3])
            _ints(wid)
            if not isinstance(key, str):
                raise ValueError("want key must be a string")
            self._on_want(link, wid, key, block)
        elif kind == "offer":
            wid, token, offset, nbytes, pkind = msg[1:6]
            _ints(wid, token, offset, nbytes)
            self._on_offer(link, wid, token, offset, nbytes, str(pkind))
        elif kind == "release":
            _ints(msg[1])
            self._on_release(link, msg[1], republish=False)
        elif kind == "return":
            _ints(msg[1])
            self._on_release(link, msg[1], republish=True)
        elif kind == "cancel":
            _ints(msg[1])
            with self._lock:
                for key, queue in list(self._wanters.items()):
                    queue[:] = [(lk, w) for lk, w in queue if not (lk is link and w == msg[1])]
                    if not queue:
                        del self._wanters[key]
        elif kind == "miss":
            _ints(msg[1])
            with self._lock:
                want = self._wants.get(msg[1])
                if want is not None:
                    want.pending.discard(link)
                    want.event.set()
        elif kind == "pool":
            pool_id, size = msg[1], msg[2]
            _ints(pool_id, size)
            if not link.fds:
                raise ValueError("pool message without a descriptor")
            fd = link.fds.popleft()
            if link.pool is not None:
                os.close(fd)
            else:
                link.pool = PeerPool(pool_id, fd, size, prefault=self.prefault)
        elif kind == "hello":
            link.peer = f"{msg[1]}"
        elif kind == "cleanup":
            if isinstance(msg[1], str):
                self._cleanup_local(msg[1])
        else:
            raise ValueError(f"unknown control message {kind!r}")

    def _on_want(self, link: _Link, wid: int, key: str, block: bool) -> None:
        with self._lock:
            entry = self._published.pop(key, None)
            if entry is None:
                if block:
                    queue = self._wanters.setdefault(key, [])
                    if (link, wid) not in queue:
                        queue.append((link, wid))
                reply = None if block else ["miss", wid]
            else:
                reply = self._hold(entry, link, wid)
        if reply is None:
            return
        if not self._send(link, [reply], with_pool=entry is not None) and entry is not None:
            self._take_back(entry)
            self._deliver(entry)

    def _on_offer(
        self, link: _Link, wid: int, token: int, offset: int, nbytes: int, kind: str
    ) -> None:
        pool = link.pool
        accepted = False
        with self._lock:
            want = self._wants.get(wid)
            usable = pool is not None and kind in (_KIND_RAW, _KIND_MSGPACK)
            if want is not None and want.offer is None and usable and pool is not None:
                want.offer = _Offer(link, pool, token, offset, nbytes, kind)
                want.event.set()
                accepted = True
        if not accepted:
            self._send(link, [["return", token]])

    def _on_release(self, link: _Link, token: int, *, republish: bool) -> None:
        with self._lock:
            entry = self._held.get(token)
            if entry is None or entry.holder is not link:
                logger.debug("%s released unknown token %d", link, token)
                return
            del self._held[token]
            entry.holder = None
            if republish and entry.key not in self._published:
                self._counters["returns"] += 1
            else:  # released, or returned after a newer put of the key (the newer one wins)
                self._counters["releases"] += 1
                self._free(entry)
                return
        self._deliver(entry)

    def _link_gone(self, link: _Link) -> None:
        """I/O thread: a peer closed or died. Reclaim what it held; tell waiters."""
        with link.send_lock:
            link.alive = False
        with self._lock:
            if link not in self._links:
                return
            self._links.discard(link)
            self._counters["peers_gone"] += 1
            for token, entry in list(self._held.items()):
                if entry.holder is link:
                    del self._held[token]
                    entry.holder = None
                    self._counters["reclaimed_from_dead_readers"] += 1
                    self._free(entry)
            for key, queue in list(self._wanters.items()):
                queue[:] = [(lk, w) for lk, w in queue if lk is not link]
                if not queue:
                    del self._wanters[key]
            for want in self._wants.values():
                if link in want.pending:
                    want.pending.discard(link)
                    want.event.set()
                if want.block and link.pool is not None and want.offer is None:
                    want.senders_lost.append(link.peer)
                    want.event.set()
        logger.debug("shared-memory peer %s gone", link)
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(link.sock)
        link.sock.close()
        while link.fds:
            _close_fds(link.fds.popleft())
        if link.pool is not None:
            link.pool.close()

    # -- status and teardown --------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        """Status, pool occupancy and counters; cheap and never raising."""
        with self._lock:
            alloc = self._alloc
            out: dict[str, Any] = {
                "status": "closed" if self._closed else "healthy",
                "type": "SharedMemoryConnector",
                "namespace": self.namespace,
                "instance": getattr(self, "instance", ""),
                "peers": len(self._links),
                "pool_size_bytes": alloc.total if alloc else 0,
                "pool_free_bytes": alloc.free_bytes if alloc else 0,
                "pool_largest_free": alloc.largest_free if alloc else 0,
                "published": len(self._published),
                "held_by_readers": len(self._held),
                "waiting_receivers": sum(len(q) for q in self._wanters.values()),
                **self._counters,
            }
        return out

    def close(self) -> None:
        """Idempotent. Wakes waiters (they return ``None``) and puts waiting for space (they
        raise ``ConnectorClosedError``); frees the pool (views held by readers stay valid)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for want in self._wants.values():
                want.event.set()
            self._space.notify_all()
            links = list(self._links)
            self._links.clear()
        self._stop = True
        _wake(self._wake_w)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5.0)
        for link in links:
            with link.send_lock:
                link.alive = False
            with contextlib.suppress(OSError):
                link.sock.close()
            while link.fds:
                _close_fds(link.fds.popleft())
            if link.pool is not None:
                link.pool.close()
        with contextlib.suppress(OSError):
            self._listener.close()
        with contextlib.suppress(OSError, ValueError):
            self._sel.close()
        with self._lock:
            pool, self._pool = self._pool, None
            self._published.clear()
            self._held.clear()
            self._wanters.clear()
        if pool is not None:
            pool.close()
        logger.debug("SharedMemoryConnector %s closed", self.instance)
