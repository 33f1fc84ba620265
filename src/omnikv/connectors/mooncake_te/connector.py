"""MooncakeTransferEngineConnector: pull-model KV hand-off over the Mooncake Transfer Engine.

Data plane: the Mooncake Transfer Engine (``protocol`` "tcp" everywhere, "rdma" where the
hardware exists), one registered, pre-faulted host pool per process. Control plane:
:mod:`omnikv.connectors.pull.control` (msgpack over TCP, optionally authenticated with a shared
secret, replay-proof, with capped connections and handshake/idle timeouts). The role is chosen
once, at construction: every connector can receive (:class:`~.receiver.ReceiverSide`); a
``role="sender"`` connector also publishes and serves pulls (:class:`~.sender.SenderSide`) on
its control port.

Delivery verdicts (``acknowledges``; :mod:`omnikv.connectors.pull.verdicts`): a receiver's
``acknowledge`` sends its verdict to the sender it pulled the payload from, as a ``verdict``
message on the control channel (signed and replay-checked with ``auth_secret``). The sender
reports each publication once to its delivery listener: ``delivered`` / ``refused`` (with the
receiver's reason) when the receiver whose pull consumed it says so; ``expired`` when its
``buffer_ttl_seconds`` drop it unpulled, or ``ack_timeout_s`` (default 60) after that pull
without a verdict (a receiver that died). Verdicts from any other peer, for a key not pulled, or
repeated are ignored (``acks_ignored``); ``health()`` counts ``acks_delivered`` /
``acks_refused`` / ``acks_expired`` and shows ``awaiting_verdicts``.

``close`` stops and joins every thread, closes every socket, waits for in-flight writes,
unregisters the pool from the engine and unmaps it; a failed constructor leaves nothing open.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar

from omnikv.connectors.boundary import ErrorMap
from omnikv.connectors.counters import Counters
from omnikv.connectors.mooncake_te.config import TEConfig
from omnikv.connectors.mooncake_te.engine import (
    TE_ERRORS,
    import_mooncake_engine,
    set_metadata_cache,
    set_tcp_bind_address,
    set_tcp_connection_pool,
)
from omnikv.connectors.mooncake_te.protocol import COUNTER_NAMES, SCHEMA
from omnikv.connectors.mooncake_te.receiving import ReceiverSide
from omnikv.connectors.mooncake_te.sending import SenderSide
from omnikv.connectors.pool import HostPool
from omnikv.connectors.pull.connector import PullConnector
from omnikv.connectors.pull.control import ControlCodec
from omnikv.connectors.pull.host import warn_unauthenticated
from omnikv.errors import ConnectorError

__all__ = ["MooncakeTransferEngineConnector"]

logger = logging.getLogger(__name__)

#: What ``health()`` shows of a sender side on a connector that has none.
_NO_SENDER = {
    "entries": 0,
    "inflight": 0,
    "connections": 0,
    "channels": 0,
    "awaiting_verdicts": 0,
}


class MooncakeTransferEngineConnector(PullConnector[SenderSide, ReceiverSide]):
    """Cross-node KV hand-off over the Mooncake Transfer Engine (pull model, consume-once).

    Built by the factory as ``MooncakeTransferEngineConnector(config)``; the manager injects
    ``role``, ``zmq_port``, ``from_stage`` and ``to_stage`` per rank. Config keys: ``host`` (the
    address bound and advertised; missing, empty, ``"auto"`` or a wildcard: the detected local
    address), ``zmq_port``, ``role`` (``"sender"`` binds the control socket; ``"receiver"`` binds
    nothing), ``protocol`` (``"tcp"``), ``device_name`` (``""``), ``memory_pool_size`` (bytes,
    default 1 GiB), ``memory_pool_device`` (``"cpu"``), ``buffer_ttl_seconds`` (300),
    ``unclaimed_grace_seconds`` (10: a put into a full pool frees entries unpulled this long,
    oldest first),
    ``ack_timeout_s`` (60: a payload pulled without a verdict for this long is reported
    ``expired``), ``auth_secret`` (shared by all peers; without it anyone who reaches the port
    can pull),
    ``auth_window_seconds`` (30: the replay window), ``sender_host`` / ``sender_zmq_port``
    (receivers' default sender), ``peer_timeout_seconds`` (5), ``quarantine_dead_seconds``
    (60), ``close_timeout_seconds`` (30), ``workers`` (4), ``put_timeout_s`` (0),
    ``tcp_connection_pool`` (false: Mooncake's TCP transport keeps a connection per peer and
    never closes it when the peer goes, so a long-lived engine would hold one descriptor per
    peer it ever served; ``MC_TCP_ENABLE_CONNECTION_POOL`` in the environment wins),
    ``metadata_cache`` (false: Mooncake caches each peer's segment description by host:port;
    ``MC_DISABLE_METACACHE`` in the environment wins; a receiver that comes back on an earlier
    one's host:port is written to under a new spelling of it, see
    :mod:`~omnikv.connectors.mooncake_te.sending`), and the
    control port's admission limits: ``max_connections`` (1024, lowered to half the file
    descriptors left at start), ``max_connections_per_peer`` (64, per IP address),
    ``handshake_timeout_seconds`` (5: a connection must say a valid hello within it),
    ``idle_timeout_seconds`` (300: a channel without traffic is closed), ``heartbeat_seconds``
    (10: TCP keepalive). See :class:`~omnikv.connectors.pull.control.ServerLimits`.
    """

    error_map: ClassVar[ErrorMap] = TE_ERRORS

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self._closed = True  # until fully built: a failed constructor leaves nothing to close
        cfg = self._cfg = TEConfig.parse(config)
        self.role, self.host, self.zmq_port, self.protocol = (
            cfg.role,
            cfg.host,
            cfg.zmq_port,
            cfg.protocol,
        )
        self.put_timeout_s = cfg.put_timeout_s
        self._default_sender = cfg.default_sender
        engine_cls = import_mooncake_engine()
        set_tcp_bind_address(cfg.host)
        set_tcp_connection_pool(cfg.tcp_connection_pool)
        set_metadata_cache(cfg.metadata_cache)
        if cfg.role == "sender" and cfg.secret is None:
            warn_unauthenticated(cfg.host, "Transfer Engine sender")
        self._counters = Counters(COUNTER_NAMES)
        self._engine: Any = None
        self._pool: HostPool | None = None
        self._registered = False
        self._sender = None
        self._receiver = None
        try:
            with TE_ERRORS.translate("Transfer Engine set-up"):
                self._open_engine(engine_cls)
                self._open_sides()
        except BaseException:
            self._teardown()
            raise
        self._closed = False
        logger.info(
            "MooncakeTransferEngineConnector %s on %s (rpc %d, control port %s, %s, pool %d bytes)",
            self.role,
            self.host,
            self.rpc_port,
            self.zmq_port,
            self.protocol,
            cfg.pool_size,
        )

    def _open_engine(self, engine_cls: Any) -> None:
        cfg = self._cfg
        self._engine = engine_cls()
        rc = self._engine.initialize(cfg.host, "P2PHANDSHAKE", cfg.protocol, cfg.device_name)
        TE_ERRORS.check(rc, f"Transfer Engine initialize({cfg.host}, {cfg.protocol})")
        self.rpc_port = int(self._engine.get_rpc_port())
        self.session_id = f"{cfg.host}:{self.rpc_port}"
        self._pool = HostPool(cfg.pool_size)
        rc = self._engine.register_memory(self._pool.address, self._pool.size)
        TE_ERRORS.check(rc, "register_memory of the pool")
        self._registered = True

    def _open_sides(self) -> None:
        cfg, pool = self._cfg, self._pool
        assert pool is not None
        codec = ControlCodec(SCHEMA, cfg.secret, window_s=cfg.window_s)
        self._receiver = ReceiverSide(cfg, codec, self.session_id, pool, self._counters)
        if cfg.role == "sender":
            verdicts = self._open_verdicts(cfg)
            self._sender = SenderSide(cfg, codec, self._engine, pool, self._counters, verdicts)

    def get_connection_info(self) -> dict[str, Any] | None:
        """``{"host", "zmq_port", "rpc_port", "can_put"}`` of a sender (the reference's fields:
        the control endpoint, the Transfer Engine's RPC port, whether it serves puts); ``None``
        for a receiver, which serves no endpoint."""
        info = super().get_connection_info()
        if info is None:
            return None
        return {**info, "rpc_port": self.rpc_port, "can_put": True}

    def set_write_hook(self, hook: Callable[[], object] | None) -> None:
        """Fault-injection hook for tests: ``hook`` runs on a pull worker just before each
        engine write of this sender (a test holds a transfer mid-write with it, to see what a
        receiver that gives up, or a sender that dies, leaves behind); ``None`` removes it.
        Senders only (``ConnectorError`` otherwise)."""
        if self._sender is None:
            raise ConnectorError("only a role='sender' connector writes: no write hook to set")
        self._sender.write_hook = hook

    def _threads(self) -> Iterator[threading.Thread]:
        for side in (self._sender, self._receiver):
            t = None if side is None else side.thread
            if t is not None and t.is_alive():
                yield t

    def health(self) -> dict[str, Any]:
        """Status, endpoints, pool use and counters. Cheap; never raises."""
        pool = self._pool
        counters = self._counters.snapshot()
        for side in (self._sender, self._receiver):
            if side is not None:
                counters["rejected_messages"] += side.rejected
        sender = self._sender.stats() if self._sender is not None else _NO_SENDER
        receiver = self._receiver.stats() if self._receiver is not None else {}
        return {
            "status": "closed" if self._closed else "healthy",
            "type": type(self).__name__,
            "role": self.role,
            "host": self.host,
            "zmq_port": self.zmq_port,
            "session_id": getattr(self, "session_id", None),
            "protocol": self.protocol,
            "authenticated": self._cfg.secret is not None,
            "pool_size": pool.size if pool is not None else 0,
            "pool_used": pool.allocator.used_bytes if pool is not None and not pool.closed else 0,
            **sender,
            **{"quarantined": 0, "late_arrivals_held": 0, **receiver},
            "threads": [t.name for t in self._threads()],
            **counters,
        }

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
        # the sides hold the engine and the pool: drop them so the engine object goes too
        sender, self._sender = self._sender, None
        receiver, self._receiver = self._receiver, None
        idle = sender.close() if sender is not None else True
        if receiver is not None:
            receiver.close()
        if not idle:
            logger.error("a transfer is still running at close; leaving the pool mapped")
            return
        self._release_pool()

    def _release_pool(self) -> None:
        if self._registered and self._pool is not None and self._engine is not None:
            rc = self._engine.unregister_memory(self._pool.address)
            if rc != 0:
                logger.warning("unregister_memory returned %d", rc)
            self._registered = False
        self._engine = None
        if self._pool is not None:
            self._pool.close()
            self._pool = None
