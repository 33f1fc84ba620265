"""MooncakeStoreConnector (alias ``MooncakeConnector``): KV hand-off through a Mooncake Store.

The sender encodes into a slot of its registered, pre-faulted host pool and ``put_from``s it
under ``"{key}@{from}_{to}"``; the store copies the bytes into a segment, so the slot is free
again as soon as ``put_from`` returns. The receiver asks for the object's size, reserves a slot
of that size in its own registered pool and ``get_into``s it (zero-copy into memory the engine
can write). After a successful get the object is removed from the store (``remove_after_get``,
default true) so the store does not fill up. ``wait`` polls with a bounded back-off until its
deadline. ``close`` unregisters the pool, closes the store client and unmaps the pool.

Delivery verdicts (:mod:`omnikv.connectors.delivery`; the record format in :mod:`.protocol`,
the watch and the records written in :mod:`.acks`): a receiver's
``acknowledge`` stores ``{"key", "verdict", "reason"}`` as JSON under ``"{key}.ack"`` (one small
``put``). A sender with a delivery listener watches each key it published from one background
thread: while any key is open it polls the master (one ``batch_is_exist`` over the open keys'
records and untaken payloads, every 20 ms after a change, backing off to 200 ms; no polling
while nothing is open), reads and removes each record and reports ``delivered`` / ``refused``
with the receiver's reason. A payload found gone from the store counts as taken: without a
record within ``ack_timeout_s`` (default 60) it is reported ``expired``; so is a payload the TTL
removed unconsumed (the reason names ``buffer_ttl_seconds``). Malformed records are dropped and
counted (``acks_malformed``). Records do not outlive their use: the sender removes those it
read, and at its ack timeout or close those of the keys it stops watching; the receiver removes
its own still unread after ``buffer_ttl_seconds``, and at its close waits up to ``ack_linger_s``
(default 1) for its sender to read the recent ones (a record may lie in the receiver's segment,
which goes when it closes) before removing them.
"""

from __future__ import annotations

import collections
import logging
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from omnikv._logging import RateLimitedLog
from omnikv.connectors.base import (
    GetResult,
    KeyProbe,
    KeyState,
    ManagedBuffer,
    OmniConnectorBase,
    PutResult,
    SlotRelease,
    Writer,
    fill_slot,
    matches_request,
    notify_incoming,
    polling,
)
from omnikv.connectors.boundary import CodeRule, ErrorMap, ErrorRule
from omnikv.connectors.counters import Counters
from omnikv.connectors.delivery import (
    DeliveryListener,
    Verdict,
)
from omnikv.connectors.mooncake_store.acks import VerdictWatch, WrittenRecords
from omnikv.connectors.mooncake_store.config import StoreConfig
from omnikv.connectors.mooncake_te.engine import (
    INSTALL_HINT,
    set_metadata_cache,
    set_tcp_bind_address,
    set_tcp_connection_pool,
)
from omnikv.connectors.pool import HostPool
from omnikv.connectors.verdict_book import VerdictBook
from omnikv.errors import (
    ConfigError,
    ConnectorClosedError,
    ConnectorError,
    ConnectorUnavailableError,
    PeerGoneError,
)

__all__ = ["STORE_ERRORS", "MooncakeConnector", "MooncakeStoreConnector", "import_mooncake_store"]

logger = logging.getLogger(__name__)
_outsider = RateLimitedLog(logger)  # lines a peer, client or forger can cause

#: Mooncake's ``TRANSFER_FAIL``: the master lists the object, but the client whose segment holds
#: it did not answer (a killed sender). Later reads of it block about a second each in the engine.
_TRANSFER_FAIL = -800

#: The Store connector's boundary. Mooncake's bindings (pybind11) declare no exception classes:
#: the store reports failures as return codes (a read's ``TRANSFER_FAIL`` means the sender is
#: gone; any other non-zero code is ``ConnectorUnavailableError``, and so is every code of
#: ``put_from``), and a C++ exception escaping it arrives as ``RuntimeError``. ``OSError`` covers
#: the master probe and the system calls around the client.
STORE_ERRORS = ErrorMap(
    "Mooncake Store",
    (
        ErrorRule(RuntimeError, ConnectorUnavailableError),
        ErrorRule(OSError, ConnectorUnavailableError),
    ),
    codes=(
        CodeRule(
            _TRANSFER_FAIL,
            PeerGoneError,
            "TRANSFER_FAIL: the master lists the object, but the client holding it did not "
            "answer: the sender is gone",
        ),
    ),
)


def import_mooncake_store() -> tuple[Any, Any]:
    """``(MooncakeDistributedStore, ReplicateConfig)``; ``ImportError`` with the hint otherwise."""
    try:
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig
    except ImportError as exc:
        raise ImportError(f"{INSTALL_HINT}: {exc}") from exc
    return MooncakeDistributedStore, ReplicateConfig


def _probe_master(address: str, timeout_s: float) -> None:
    """Fail fast when the master does not accept connections (the engine's own set-up keeps
    retrying for about 90 s). Called by the constructor; raises ``ConnectorUnavailableError``
    within ``timeout_s``, or returns once a TCP connection to ``address`` was opened and closed.
    """
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"master_server_address must be host:port, got {address!r}")
    endpoint = (host.strip("[]") or "127.0.0.1", int(port))
    with (
        STORE_ERRORS.translate(f"Mooncake master {address} is unreachable"),
        socket.create_connection(endpoint, timeout_s),
    ):
        pass


class MooncakeStoreConnector(OmniConnectorBase):
    """KV hand-off through a Mooncake Store (master + clients), zero-copy on registered pools.

    Built by the factory as ``MooncakeStoreConnector(config)``. Config keys: ``host``
    (``127.0.0.1``), ``metadata_server`` (``"P2PHANDSHAKE"`` or the master's HTTP metadata URL),
    ``master_server_address`` (``"127.0.0.1:50051"``), ``global_segment_size`` (512 MiB: what
    this client contributes to the store; size it for the live working set),
    ``local_buffer_size`` (64 MiB), ``protocol`` (``"tcp"``), ``device_name`` (``""``),
    ``memory_pool_size`` (512 MiB: the registered pool for put_from / get_into),
    ``remove_after_get`` (true), ``replica_num`` (1), ``prefer_local_segment`` (true: a
    payload is put into this client's own segment when it has one, so a hand-off's data lives
    with its sender and a put never lands in a dead client's segment that the master still
    lists; false: the master places it), ``master_probe_timeout_s`` (3: a master
    that does not accept a TCP connection within it fails the constructor with
    ``ConnectorUnavailableError`` instead of the engine's ~90 s of retries),
    ``max_tracked_keys`` (4096: how many of its own puts a client remembers for ``cleanup``;
    beyond it, keys another client consumed are forgotten first, then the oldest),
    ``buffer_ttl_seconds`` (300, as the other connectors; 0: never: an object this client put
    that nobody consumed within it is removed from the store, see :meth:`reap_expired`),
    ``put_timeout_s`` (0: how long the reference-shaped ``put`` waits for pool space),
    ``tcp_connection_pool`` (false: Mooncake's TCP transport keeps a connection per peer and
    never closes it when the peer goes, so a long-lived client would hold one descriptor per
    client it ever exchanged objects with; ``MC_TCP_ENABLE_CONNECTION_POOL`` in the
    environment wins), ``metadata_cache`` (false: Mooncake caches each peer's segment
    description by host:port; ``MC_DISABLE_METACACHE`` in the environment wins). A segment a
    client opened stays open under its name for as long as the client lives, so a client that
    starts under an earlier client's name is unreachable to the long-lived ones: give ``host``
    as ``"ip:port"`` with a port no earlier client had where clients restart often.
    ``ack_timeout_s`` (60: a payload taken without a verdict for that long is reported
    ``expired``) and ``ack_linger_s`` (1: how long ``close`` waits for the verdict records this
    client wrote as a receiver to be read by their senders) govern delivery verdicts (see the
    module docstring).
    """

    acknowledges: ClassVar[bool] = True
    reports_incoming: ClassVar[bool] = True
    checks_data: ClassVar[bool] = True
    takes_abort: ClassVar[bool] = True
    error_map: ClassVar[ErrorMap] = STORE_ERRORS

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self._closed = True  # until fully built
        cfg = StoreConfig.parse(config)
        self.config = cfg
        self.host = cfg.host
        self.metadata_server = cfg.metadata_server
        self.master = cfg.master
        self.protocol = cfg.protocol
        self.device_name = cfg.device_name
        self.remove_after_get = cfg.remove_after_get
        self.put_timeout_s = cfg.put_timeout_s
        self.max_tracked_keys = cfg.max_tracked_keys
        self.buffer_ttl_s = cfg.buffer_ttl_s
        self.ack_linger_s = cfg.ack_linger_s
        self._next_sweep = 0.0
        store_cls, replicate_cls = import_mooncake_store()
        _probe_master(self.master, cfg.master_probe_timeout_s)
        set_tcp_bind_address(self.host)
        set_tcp_connection_pool(cfg.tcp_connection_pool)
        set_metadata_cache(cfg.metadata_cache)
        self._lock = threading.Lock()
        # Keys this client put and has not seen consumed, oldest first, with when they were
        # put (for cleanup() and the TTL).
        self._put_keys: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._counters = Counters(
            (
                "puts",
                "put_bytes",
                "put_failures",
                "gets",
                "get_bytes",
                "misses",
                "removed",
                "ttl_reaped",
                "acks_sent",
                "ack_failures",
                "ack_records_dropped",
                "acks_delivered",
                "acks_refused",
                "acks_expired",
                "acks_malformed",
            )
        )
        self._book = VerdictBook(cfg.ack_timeout_s, self._counters)
        self._verdicts = VerdictWatch(self, self._book, self._counters, STORE_ERRORS)
        self._records = WrittenRecords(self._counters, STORE_ERRORS, self.max_tracked_keys)
        self._replicate_cls = replicate_cls
        self._rcfg = self._placement(
            cfg.replica_num, cfg.prefer_local_segment and cfg.global_segment_size > 0
        )
        # key taken -> the segment that held it (its sender's): where its verdict record goes
        self._holders: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._store: Any = None
        self._pool: HostPool | None = None
        self._registered = False
        try:
            with STORE_ERRORS.translate("Mooncake Store set-up"):
                self._open(
                    store_cls(),
                    cfg.global_segment_size,
                    cfg.local_buffer_size,
                    cfg.memory_pool_size,
                )
        except BaseException:
            self._teardown()
            raise
        self._closed = False
        logger.info(
            "MooncakeStoreConnector on %s (master %s, %s, pool %d bytes)",
            self.host,
            self.master,
            self.protocol,
            cfg.memory_pool_size,
        )

    def _open(self, store: Any, segment: int, local_buf: int, pool_size: int) -> None:
        rc = store.setup(
            self.host,
            self.metadata_server,
            segment,
            local_buf,
            self.protocol,
            self.device_name,
            self.master,
        )
        self._store = store
        STORE_ERRORS.check(rc, f"Mooncake Store setup (master {self.master})")
        self._pool = HostPool(pool_size)
        rc = store.register_buffer(self._pool.address, self._pool.size)
        STORE_ERRORS.check(rc, "register_buffer of the pool")
        self._registered = True

    # -- helpers -----------------------------------------------------------------------------
    def _live(self) -> tuple[Any, HostPool]:
        if self._closed or self._store is None or self._pool is None:
            raise ConnectorClosedError("MooncakeStoreConnector is closed")
        return self._store, self._pool

    @property
    def placement(self) -> Any:
        """The ``ReplicateConfig`` of this client's puts (its verdict records use it too)."""
        return self._rcfg

    def live_store(self) -> Any | None:
        """The store client while open, else ``None`` (for the verdict watch)."""
        return None if self._closed else self._store

    def consumed_elsewhere(self, key: str) -> None:
        """The verdict watch found ``key`` gone from the store: a receiver took it, so it is no
        longer this client's to clean up or expire."""
        with self._lock:
            self._put_keys.pop(key, None)

    # -- sender ------------------------------------------------------------------------------
    def put_packed(
        self,
        from_stage: str,
        to_stage: str,
        put_key: str,
        nbytes: int,
        write: Writer,
        *,
        deadline: float,
    ) -> PutResult:
        """``write`` fills a slot of the registered pool and ``put_from`` stores it; the slot is
        free again when this returns (the store holds its own copy). A failed ``put_from``
        raises ``ConnectorUnavailableError``."""
        store, pool = self._live()
        offset = fill_slot(pool, nbytes, write, deadline)
        key = self._make_key(put_key, from_stage, to_stage)
        try:
            with STORE_ERRORS.translate(f"put of {key}"):
                rc = store.put_from(key, pool.address + offset, nbytes, self._rcfg)
        finally:
            pool.allocator.free(offset)
        if rc != 0:
            # whatever the code (TRANSFER_FAIL included: the segment chosen for the replica is
            # gone), a retry may place the object elsewhere: transient, not the read's mapping
            self._counters.add("put_failures")
            raise STORE_ERRORS.other_codes(f"put_from of {key} returned {rc}")
        self._track(key)
        self._verdicts.published(key, put_key)
        self.reap_expired()
        self._counters.add("puts")
        self._counters.add("put_bytes", nbytes)
        logger.debug("stored %s (%d bytes)", key, nbytes)
        return True, nbytes, {"data_size": nbytes, "key": key}

    # -- receiver ----------------------------------------------------------------------------
    def _take(
        self, key: str, deadline: float, on_incoming: Callable[[int], object] | None = None
    ) -> ManagedBuffer | None:
        store, pool = self._live()
        with STORE_ERRORS.translate(f"size of {key}"):
            size = int(store.get_size(key))
        if size <= 0:
            return None
        notify_incoming(on_incoming, size)
        self._note_holder(store, key)
        offset, _ = pool.allocator.alloc(size, deadline=deadline)
        try:
            with STORE_ERRORS.translate(f"get of {key}"):
                got = int(store.get_into(key, pool.address + offset, size))
        except BaseException:
            pool.allocator.free(offset)
            raise
        if got != size:
            pool.allocator.free(offset)
            return self._short_read(key, got, size)
        self._consumed(store, key)
        self._counters.add("gets")
        self._counters.add("get_bytes", size)
        return ManagedBuffer(pool.slot(offset, size), SlotRelease(pool, offset))

    def _placement(self, replicas: int, local: bool) -> Any:
        """The ``ReplicateConfig`` of this client's puts. ``local``: into its own segment, so a
        hand-off's data lives with its sender (as on every other transport) and a put never
        lands in the segment of a client that died (the master lists that segment until its
        ``client_ttl`` passes, and a put into it fails with ``TRANSFER_FAIL``)."""
        config = self._replicate_cls()
        config.replica_num = replicas
        if local:
            config.preferred_segment = self.host
        return config

    def _note_holder(self, store: Any, key: str) -> None:
        """Remember which segment holds ``key`` (its sender's, with ``prefer_local_segment``),
        so that the verdict record goes there and outlives this receiver. Best effort: without
        it the master places the record."""
        try:
            replicas = store.get_replica_desc(key)
            holder = str(replicas[0].get_memory_descriptor().buffer_descriptor.transport_endpoint)
        except Exception:  # an optional placement hint, never an error
            return
        with self._lock:
            self._holders[key] = holder
            while len(self._holders) > self.max_tracked_keys:
                self._holders.popitem(last=False)

    def _record_config(self, key: str) -> Any:
        """The placement of ``key``'s verdict record: its sender's segment when known."""
        with self._lock:
            holder = self._holders.pop(key, None)
        if holder is None:
            return self._rcfg
        config = self._replicate_cls()
        config.replica_num = 1
        config.preferred_segment = holder
        return config

    @staticmethod
    def _short_read(key: str, got: int, size: int) -> None:
        """A ``get_into`` of ``size`` bytes that returned ``got``: a code the table names raises
        (``TRANSFER_FAIL``: the sender is gone); another negative code is a miss (the object was
        removed or expired since ``get_size``); a short count is ``ConnectorUnavailableError``."""
        if STORE_ERRORS.code_rule(got) is not None:
            STORE_ERRORS.check(got, f"get_into of {key}")
        if got < 0:
            return None
        raise ConnectorUnavailableError(f"get_into of {key} returned {got} of {size} bytes")

    def _consumed(self, store: Any, key: str) -> None:
        if self.remove_after_get:
            with STORE_ERRORS.translate(f"remove of {key}"):
                rc = int(store.remove(key, True))  # force: our own read lease is held
            if rc == 0:
                self._counters.add("removed")
            else:
                logger.debug("remove of %s returned %d", key, rc)
        with self._lock:
            self._put_keys.pop(key, None)

    def get(
        self,
        from_stage: str,
        to_stage: str,
        get_key: str,
        metadata: dict[str, Any] | None = None,
    ) -> GetResult | None:
        """Take the object if it is in the store: ``(ManagedBuffer, size)`` or ``(obj, size)``.

        ``None`` when absent or on error (logged). Consumes it (removal: ``remove_after_get``).
        """
        if self._closed:
            raise ConnectorClosedError("MooncakeStoreConnector is closed")
        try:  # one look of wait
            return self.get_with_deadline(from_stage, to_stage, get_key, metadata, deadline=0.0)
        except ConnectorError as exc:
            key = self._make_key(get_key, from_stage, to_stage)
            _outsider.error("get of %s failed: %s", key, exc)
            return None

    def wait(
        self,
        from_stage: str,
        to_stage: str,
        get_key: str,
        *,
        deadline: float,
        metadata: dict[str, Any] | None = None,
        on_incoming: Callable[[int], object] | None = None,
        abort: threading.Event | None = None,
    ) -> ManagedBuffer | None:
        """Poll the store (:func:`~omnikv.connectors.base.polling`) until the object is there.

        ``on_incoming`` is called with the object's size once it is found, before it is read;
        a set ``abort`` ends the wait with ``None`` between polls (a read that started runs
        until ``deadline``).

        Raises ``PoolExhaustedError`` when no receive slot frees up before the deadline and
        ``PeerGoneError`` at once when the object's holder does not answer (sender killed after
        its put), instead of retrying reads that each block the engine for about a second.
        """
        key = self._make_key(get_key, from_stage, to_stage)
        for _ in polling(deadline):
            if self._closed:
                raise ConnectorClosedError("MooncakeStoreConnector is closed")
            if abort is not None and abort.is_set():
                return None
            buf = self._take(key, deadline, on_incoming)
            if buf is not None:
                return buf
        self._counters.add("misses")
        return None

    def probe(
        self,
        from_stage: str,
        to_stage: str,
        get_key: str,
        *,
        deadline: float,
        metadata: dict[str, Any] | None = None,
    ) -> KeyProbe:
        """``offered`` with its size while the object is in the store (one ``get_size`` at the
        master; the bytes live in the segment they were put into, so a take moves them),
        ``missing`` when it is not; ``unknown`` when the master cannot be asked or once
        closed. Reads nothing, takes no lease; ``deadline`` is not checked (the master's RPC
        has its own timeout). Never raises."""
        if self._closed:
            return KeyProbe(KeyState.UNKNOWN, detail="MooncakeStoreConnector is closed")
        key = self._make_key(get_key, from_stage, to_stage)
        try:
            store, _pool = self._live()
            with STORE_ERRORS.translate(f"size of {key}"):
                size = int(store.get_size(key))
        except Exception as exc:  # never raises: the scheduler asks again or receives
            return KeyProbe(KeyState.UNKNOWN, detail=f"{type(exc).__name__}: {exc}")
        if size <= 0:
            return KeyProbe(KeyState.MISSING)
        return KeyProbe(KeyState.OFFERED, size)

    # -- common ------------------------------------------------------------------------------
    def _track(self, key: str) -> None:
        """Remember a put for :meth:`cleanup`, keeping at most ``max_tracked_keys``.

        Consumption happens in another client, so this one learns of it lazily: when the bound
        is passed, one ``batch_is_exist`` forgets every key that is gone from the store; if more
        than three quarters of the bound are still there, the oldest are forgotten down to that
        mark (they stay in the store until consumed or evicted). So a check runs at most once
        per ``max_tracked_keys // 4`` puts, however slowly the receivers consume.
        """
        with self._lock:
            self._put_keys[key] = time.monotonic()
            self._put_keys.move_to_end(key)
            if len(self._put_keys) <= self.max_tracked_keys:
                return
            keys = list(self._put_keys)
        exists: list[int] | None = None
        store = self._store
        if store is not None:
            try:
                with STORE_ERRORS.translate("batch_is_exist"):
                    exists = [int(e) for e in store.batch_is_exist(keys)]
            except ConnectorUnavailableError as exc:  # store down: forget the oldest instead
                logger.debug("batch_is_exist over %d keys failed: %s", len(keys), exc)
        with self._lock:
            if exists is not None and len(exists) == len(keys):
                for k, e in zip(keys, exists, strict=True):
                    if e == 0:
                        self._put_keys.pop(k, None)
            dropped = 0
            low_water = self.max_tracked_keys - self.max_tracked_keys // 4
            while len(self._put_keys) > low_water:
                self._put_keys.popitem(last=False)
                dropped += 1
        if dropped:
            logger.debug("forgot %d unconsumed keys past max_tracked_keys", dropped)

    def reap_expired(self) -> list[str]:
        """Remove from the store the objects this client put ``buffer_ttl_seconds`` ago or more
        that nobody consumed (each named in a warning, counted as ``ttl_reaped``, reported
        ``expired`` to the delivery listener); returns their keys. Verdict records this client
        wrote that long ago and nobody read are removed too. Runs at each put and health check
        and from the verdict watch, at most every ``buffer_ttl_seconds / 2``; 0 turns it off.
        Objects already consumed are only forgotten. Never raises."""
        now = time.monotonic()
        ttl = self.buffer_ttl_s
        with self._lock:
            if ttl <= 0 or now < self._next_sweep or self._store is None or self._closed:
                return []
            self._next_sweep = now + max(0.05, ttl / 2)
            old = [k for k, t in self._put_keys.items() if now - t >= ttl]
            for k in old:
                del self._put_keys[k]
        store, reaped = self._store, []
        self._records.reap(store, ttl)
        for k in old:
            try:
                with STORE_ERRORS.translate(f"remove of {k}"):
                    rc = int(store.remove(k, True))
            except ConnectorError as exc:
                logger.debug("TTL remove of %s failed: %s", k, exc)
                continue
            if rc == 0:  # it was still there: nobody consumed it
                reaped.append(k)
                self._verdicts.expired_by_ttl(k, ttl)
        if reaped:
            self._counters.add("ttl_reaped", len(reaped))
            _outsider.warning(
                "MooncakeStoreConnector removed %d object(s) unconsumed after %.0f s (TTL): %s",
                len(reaped),
                ttl,
                reaped[:8],
            )
        return reaped

    def pending_keys(self) -> list[str]:
        """Keys this client stored and has not seen consumed, oldest first (for cleanup)."""
        with self._lock:
            return list(self._put_keys)

    def cleanup(self, request_id: str) -> None:
        """Remove objects this client stored for ``request_id`` and nobody consumed (no verdict
        is reported for those)."""
        with self._lock:
            keys = [k for k in self._put_keys if matches_request(k, request_id)]
            for k in keys:
                del self._put_keys[k]
        if self._store is None or self._closed:
            return
        for k in keys:
            with STORE_ERRORS.translate(f"remove of {k}"):
                rc = int(self._store.remove(k, True))
            if rc == 0:
                self._counters.add("removed")
                self._verdicts.forget(k)

    def withdraw(self, from_stage: str, to_stage: str, put_key: str) -> bool:
        """Remove the object this client stored under ``put_key`` and has not seen consumed
        (:meth:`~omnikv.connectors.base.OmniConnectorBase.withdraw`); no verdict is reported
        for it. The ``remove`` is forced, as ``cleanup``'s: the store grants a lease to every
        existence check, this client's own verdict watch included, so an unforced one fails
        on an object nobody reads; a reader that found the object a moment before gets a
        failed read (withdraw is for objects whose send was decided, that nobody should take).
        An object another client stored is never named here (only this client's puts are)."""
        key = self._make_key(put_key, from_stage, to_stage)
        with self._lock:
            put_at = self._put_keys.pop(key, None)
        store = self.live_store()
        if put_at is None or store is None:
            return False
        try:
            with STORE_ERRORS.translate(f"withdraw of {key}"):
                rc = int(store.remove(key, True))
        except ConnectorError as exc:
            logger.debug("withdraw of %s failed: %s", key, exc)
            rc = -1
        if rc != 0:  # gone already (taken), or the store could not be asked: the TTL decides
            with self._lock:
                self._put_keys.setdefault(key, put_at)
            return False
        self._counters.add("removed")
        self._verdicts.forget(key)
        return True

    def acknowledge(
        self,
        from_stage: str,
        to_stage: str,
        get_key: str,
        verdict: Verdict,
        reason: str | None = None,
        *,
        metadata: dict[str, Any] | None = None,
    ) -> None:
        """Store the verdict on the payload taken under ``get_key`` for its sender to read: one
        small ``put`` (bounded by the store client's own RPC timeouts) into the sender's segment
        when known. A record that cannot be stored is counted ``ack_failures``."""
        store = self.live_store()
        key = self._make_key(get_key, from_stage, to_stage)
        if store is None:
            logger.warning("no verdict for %s: the connector is closed", key)
            return
        self._records.write(store, self._record_config(key), key, verdict, reason)
        self.reap_expired()  # a receiver puts nothing: its unread records age out here

    def set_delivery_listener(self, listener: DeliveryListener | None) -> None:
        """Report each payload put from now on once to ``listener`` (see the module
        docstring)."""
        self._book.set_listener(listener)

    def health(self) -> dict[str, Any]:
        """Status, endpoints, pool use and counters (after a TTL sweep when one is due, and the
        ``ack_timeout_s`` sweep); never raises."""
        self.reap_expired()
        self._verdicts.sweep()
        pool = self._pool
        counters = self._counters.snapshot()
        with self._lock:
            pending = len(self._put_keys)
        return {
            "status": "closed" if self._closed else "healthy",
            "type": type(self).__name__,
            "host": self.host,
            "master": self.master,
            "protocol": self.protocol,
            "pool_size": pool.size if pool is not None else 0,
            "pool_used": pool.allocator.used_bytes if pool is not None and not pool.closed else 0,
            "registered": self._registered,
            "tracked_keys": pending,
            "watched_keys": self._verdicts.watched(),
            **counters,
        }

    def close(self) -> None:
        """Wait up to ``ack_linger_s`` for the verdicts this client wrote to be read, stop the
        verdict watch (removing the records of keys still watched), unregister the pool, close
        the store client, unmap the pool. Idempotent."""
        if self._closed:
            return
        store = self._store
        if store is not None:
            self._records.settle(store, self.ack_linger_s)
        self._closed = True
        self._verdicts.close(store)
        self._teardown()

    def _teardown(self) -> None:
        store, self._store = self._store, None
        if store is not None and self._registered and self._pool is not None:
            rc = store.unregister_buffer(self._pool.address)
            if rc != 0:
                logger.warning("unregister_buffer returned %d", rc)
        self._registered = False
        if store is not None:
            try:
                store.close()
            except STORE_ERRORS.handled:
                logger.warning("closing the Mooncake Store client failed", exc_info=True)
        if self._pool is not None:
            self._pool.close()
            self._pool = None


MooncakeConnector = MooncakeStoreConnector
