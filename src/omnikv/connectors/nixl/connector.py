"""NixlConnector: pull-model KV hand-off over NIXL (the transfer library behind vLLM's P/D).

Data plane: one NIXL agent per connector (backends from ``backends``, default ``["UCX"]``) with
one registered, pre-faulted host pool. Control plane: :mod:`omnikv.connectors.pull.control`
(msgpack over TCP, HMAC + nonce + timestamp with ``auth_secret``, capped connections, handshake
and idle timeouts), shared with the Mooncake Transfer Engine connector; the NIXL messages are in
:mod:`omnikv.connectors.nixl.protocol`.

How a payload moves:

1. The sender's ``put_packed`` reserves a slot in its registered pool and lets the caller encode
   straight into it; the entry is published under ``"{key}@{from}_{to}"``.
2. The receiver's ``wait`` loads the sender agent's metadata once per sender, then ``claim``\\ s
   the key (a long-poll: the sender answers when the key is there or the hold ends): the sender
   leases the entry to one transfer id and answers with its size and address.
3. The receiver reserves a slot in its own registered pool and READs the bytes with NIXL, the
   transfer id as notification; the sender frees the entry when the notification arrives.

Failures: a sender that answered before and falls silent for ``peer_timeout_seconds`` is
:class:`~omnikv.errors.PeerGoneError`; a receive slot whose READ may still run when the receiver
gives up is quarantined until NIXL reports it finished (then it is a late arrival for the next
``wait`` of that key) or cancelled. See :mod:`~omnikv.connectors.nixl.sending` and
:mod:`~omnikv.connectors.nixl.receiving` for the two sides; the role is chosen once, here.

Delivery verdicts (``acknowledges``; :mod:`omnikv.connectors.pull.verdicts`): after its checks
the receiver's ``acknowledge`` sends a ``verdict`` message to the sender it READ from, on the
control channel. The sender reports each publication once to its delivery listener:
``delivered`` / ``refused`` (with the receiver's reason) from the receiver whose READ
notification consumed it (a verdict that overtakes its notification is kept until that
arrives); ``expired`` when ``buffer_ttl_seconds`` or ``max_leases_per_entry`` drop it unread,
or ``ack_timeout_s`` (default 60) after its READ without a verdict (a receiver that died).
Verdicts from any other peer, for a key not read, or repeated are ignored (``acks_ignored``);
``health()`` counts ``acks_delivered`` / ``acks_refused`` / ``acks_expired`` and shows
``awaiting_verdicts``.

Trust model: the control plane can be authenticated (``auth_secret``); the data plane is NIXL's
(UCX): an agent that holds the sender's metadata can READ its registered pool, and that metadata
is handed out only over the (authenticated, when configured) control plane.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar

from omnikv.connectors.boundary import ErrorMap
from omnikv.connectors.counters import Counters
from omnikv.connectors.nixl.agent import NixlAgent, import_nixl
from omnikv.connectors.nixl.config import NixlSettings
from omnikv.connectors.nixl.protocol import COUNTER_NAMES, MAX_MESSAGE_BYTES, SCHEMA
from omnikv.connectors.nixl.receiving import NixlReceiverSide
from omnikv.connectors.nixl.sending import NixlSenderSide
from omnikv.connectors.pool import HostPool
from omnikv.connectors.pull.client import ControlClient
from omnikv.connectors.pull.connector import PullConnector
from omnikv.connectors.pull.control import CONTROL_ERRORS, ControlCodec
from omnikv.connectors.pull.host import warn_unauthenticated
from omnikv.connectors.pull.server import ControlServer
from omnikv.errors import ConnectorError

__all__ = ["NixlConnector"]

logger = logging.getLogger(__name__)

import_nixl()  # a missing NIXL is an ImportError naming the extra (factory, ``omnikv doctor``)


class NixlConnector(PullConnector[NixlSenderSide, NixlReceiverSide]):
    """Cross-node KV hand-off over NIXL (pull model, consume-once).

    Built by the factory as ``NixlConnector(config)``; the manager injects ``role``,
    ``zmq_port``, ``from_stage`` and ``to_stage`` per rank. Config keys: ``host`` (bound and
    advertised as is; missing, empty, ``"auto"`` or a wildcard: the detected local address, as
    for the Transfer Engine connector), ``zmq_port``, ``role``
    (``"sender"`` binds the control socket; ``"receiver"`` binds nothing), ``backends``
    (``["UCX"]``), ``memory_pool_size`` (bytes or "512MB", default 1 GiB),
    ``buffer_ttl_seconds`` (300), ``unclaimed_grace_seconds`` (10: a put into a full pool
    frees entries unleased this long, oldest first), ``ack_timeout_s`` (60: a payload READ
    without a verdict for this long is reported ``expired``), ``auth_secret``,
    ``sender_host`` / ``sender_zmq_port`` (receivers' default sender),
    ``peer_timeout_seconds`` (5), ``quarantine_dead_seconds`` (60), ``close_timeout_seconds``
    (30), ``auth_window_seconds`` (30: the replay window),
    ``put_timeout_s`` (0: the reference-shaped ``put`` tries once), ``max_leases_per_entry``
    (8: a sender drops an entry leased that often without a completed READ; its
    ``buffer_ttl_seconds`` counts from the put across re-leases), and the control port's
    admission limits: ``max_connections`` (1024, lowered to half the file
    descriptors left at start), ``max_connections_per_peer`` (64, per IP address),
    ``handshake_timeout_seconds`` (5: a connection must say a valid hello within it),
    ``idle_timeout_seconds`` (300: a channel without traffic is closed), ``heartbeat_seconds``
    (10: TCP keepalive). See :class:`~omnikv.connectors.pull.control.ServerLimits`.
    """

    #: Around every call into a side: the control sockets' table (NIXL's own errors are
    #: translated inside :class:`~omnikv.connectors.nixl.agent.NixlAgent`, by
    #: :func:`~omnikv.connectors.nixl.agent.nixl_error_map`).
    error_map: ClassVar[ErrorMap] = CONTROL_ERRORS

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self._closed = True  # until fully built: a failed constructor leaves nothing to close
        cfg = dict(config or {})
        self.settings = s = NixlSettings.from_config(cfg)
        self.role = s.role
        self.host, self.zmq_port = s.host, s.zmq_port
        self.put_timeout_s = s.put_timeout_s
        self._default_sender = s.default_sender
        self._flush_default_s = s.close_timeout_s
        self._counters = Counters(COUNTER_NAMES)
        self._lock = threading.Lock()
        self._agent: NixlAgent | None = None
        self._pool: HostPool | None = None
        self._server: ControlServer | None = None
        self._client: ControlClient | None = None
        self._sender = None
        self._receiver = None
        try:
            self._build(s)
        except BaseException:
            self._teardown()
            raise
        self._closed = False
        logger.info(
            "NixlConnector %s on %s (agent %s, control port %s, backends %s, pool %d bytes)",
            s.role,
            s.host,
            self.agent_name,
            s.zmq_port,
            ",".join(s.backends),
            s.pool_size,
        )

    def _build(self, s: NixlSettings) -> None:
        # 122 random bits: a sender accepts verdicts only from the hello of the agent that took
        # the payload, and no other receiver can guess the name
        self.agent_name = f"omnikv-nixl-{s.role}-{os.getpid()}-{uuid.uuid4().hex}"
        self._agent = NixlAgent(self.agent_name, s.backends)
        self._pool = HostPool(s.pool_size)
        self._agent.register(self._pool.address, self._pool.size)
        codec = ControlCodec(
            SCHEMA, s.secret, window_s=s.window_s, max_message_bytes=MAX_MESSAGE_BYTES
        )
        if s.role == "sender":
            assert s.zmq_port is not None
            if s.secret is None:
                warn_unauthenticated(s.host, "NIXL sender")
            verdicts = self._open_verdicts(s)
            side = NixlSenderSide(s, self._agent, self._pool, self._counters, self._lock, verdicts)
            self._server = ControlServer(
                codec,
                (s.host, s.zmq_port),
                side.handle,
                tick=side.tick,
                name="omnikv-nixl",
                limits=s.limits,
            )
            side.attach(self._server)
            self._sender = side
            self._server.start()
        else:
            hello = {"agent": self.agent_name}
            self._client = ControlClient(codec, hello, heartbeat_s=s.limits.heartbeat_s)
            self._receiver = NixlReceiverSide(
                s, self._agent, self._pool, self._client, self._counters, self._lock
            )

    # == test hooks ===============================================================================
    def set_grant_hook(self, hook: Callable[[], object] | None) -> None:
        """Fault-injection hook for tests: ``hook`` runs on the control thread right after each
        grant this sender answers (a test kills the process mid-READ with it); ``None`` removes
        it. Senders only (``ConnectorError`` otherwise)."""
        if self._sender is None:
            raise ConnectorError("only a role='sender' connector grants: no grant hook to set")
        self._sender.grant_hook = hook

    def set_read_hook(self, hook: Callable[[], object] | None) -> None:
        """Fault-injection hook for tests: ``hook`` runs before each READ of a granted payload;
        when it returns ``False`` the READ is skipped and the sender's lease left to expire (a
        receiver that died after its grant); ``None`` removes it. Receivers only
        (``ConnectorError`` otherwise)."""
        if self._receiver is None:
            raise ConnectorError("only a role='receiver' connector reads: no read hook to set")
        self._receiver.read_hook = hook

    # == common ===================================================================================
    def health(self) -> dict[str, Any]:
        """Status, endpoints, pool use, registrations, threads and counters. Never raises."""
        pool, agent = self._pool, self._agent
        side_stats: dict[str, int] = {}
        if self._sender is not None:
            side_stats.update(self._sender.stats())
        if self._server is not None:
            side_stats.update(self._server.stats())
        if self._receiver is not None:
            side_stats.update(self._receiver.stats())
        return {
            "status": "closed" if self._closed else "healthy",
            "type": type(self).__name__,
            "role": self.role,
            "host": self.settings.host,
            "zmq_port": self.settings.zmq_port,
            "agent": getattr(self, "agent_name", None),
            "backends": list(self.settings.backends),
            "authenticated": self.settings.secret is not None,
            "pool_size": pool.size if pool is not None else 0,
            "pool_used": pool.allocator.used_bytes if pool is not None and not pool.closed else 0,
            "registered_regions": agent.registered_regions if agent is not None else 0,
            "threads": [t.name for t in self._threads() if t.is_alive()],
            **side_stats,
            **self._counters.snapshot(),
            "rejected_messages": self._rejected(),
        }

    def _rejected(self) -> int:
        """Control messages dropped as invalid, forged or replayed, by the server (requests)
        and the client (replies): ``rejected_messages``, as the Transfer Engine connector."""
        server, client = self._server, self._client
        return (server.rejected if server is not None else 0) + (
            client.rejected if client is not None else 0
        )

    def _threads(self) -> Iterator[threading.Thread]:
        for t in (
            self._server.thread if self._server is not None else None,
            self._receiver.reaper if self._receiver is not None else None,
        ):
            if t is not None:
                yield t

    def close(self) -> None:
        """Stop threads, wait (bounded) for running READs, deregister, unmap. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._teardown()

    def _teardown(self) -> None:
        """Listener, leases, receive side, sockets, agent (deregisters), then the pool.

        A sender's pool is only ever read by peers: once its agent is gone nothing can reach
        it, so it is unmapped after a bounded wait for running READs. A receiver's pool is
        written by its own READs: it stays mapped if one could not be cancelled.
        """
        timeout = self.settings.close_timeout_s
        if self._server is not None:
            self._server.close()
        quiet = True
        if self._sender is not None:
            if not self._sender.drain(timeout):
                logger.warning("closing with READs of this sender's pool unconfirmed")
            self._sender.forget_all()
        if self._receiver is not None:
            quiet = self._receiver.close(timeout)
        if self._client is not None:
            self._client.close()
        if self._agent is not None:
            self._agent.close()  # deregisters: NIXL refuses any later access to the pool
            self._agent = None
        if self._pool is not None:
            if not quiet:
                logger.error("a NIXL READ may still be running at close; leaving the pool mapped")
                return
            self._pool.close()
            self._pool = None
