"""What the two pull-model connectors (Mooncake Transfer Engine, NIXL) share above their sides.

Both publish into a registered pool on the sender and let the receiver fetch from it; each is
split into a sending side and a receiving side, and the role is chosen once, at construction.
:class:`PullConnector` holds the glue between the connector contract
(:mod:`omnikv.connectors.base`) and those sides: the role checks, the transport key, the sender
endpoint rule, the reference-shaped ``get``, the error boundary around every call, and the
delivery verdicts (:mod:`omnikv.connectors.pull.verdicts`): a receiver's ``acknowledge`` sends
its verdict to the sender it took the payload from; a sender reports each publication once to
its delivery listener (``delivered`` / ``refused`` from the receiver that took it, ``expired`` at
its ``buffer_ttl_seconds`` or ``ack_timeout_s`` after it was taken without a verdict).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeVar

import msgspec

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
    cleanup_target,
    get_result,
    matches_request,
)
from omnikv.connectors.boundary import ErrorMap
from omnikv.connectors.counters import Counters
from omnikv.connectors.delivery import DEFAULT_ACK_TIMEOUT_S, DeliveryListener, Verdict
from omnikv.connectors.pool import HostPool
from omnikv.connectors.pull.client import ControlClient
from omnikv.connectors.pull.control import (
    DEFAULT_WINDOW_S,
    Endpoint,
    ServerLimits,
    Spec,
    Str,
    UInt,
)
from omnikv.connectors.pull.host import resolve_host
from omnikv.connectors.pull.room import DEFAULT_UNCLAIMED_GRACE_S, PoolRoom
from omnikv.connectors.pull.verdicts import VERDICT_COUNTER_NAMES, SentVerdicts, verdict_message
from omnikv.deadline import remaining
from omnikv.errors import (
    ConfigError,
    ConnectorClosedError,
    ConnectorError,
    ConnectorUnavailableError,
)
from omnikv.values import (
    parse_choice,
    parse_int,
    parse_number,
    parse_port,
    parse_positive,
    parse_size,
    resolve_secret,
)

__all__ = [
    "PEEK_OP",
    "PEEK_REPLIES",
    "PEEK_REQUESTS",
    "PULL_COUNTER_NAMES",
    "LateArrivals",
    "PullConnector",
    "PullSettings",
    "ReceivingSide",
    "SendingSide",
    "deliver",
    "peek_answer",
    "published",
    "sender_endpoint",
    "transfer_budget_s",
]

if TYPE_CHECKING:
    from omnikv.connectors.pull.receiving import PullReceiver

logger = logging.getLogger(__name__)
_outsider = RateLimitedLog(logger)  # lines a peer, client or forger can cause


#: The events every pull connector counts (each adds its own; see its protocol module).
PULL_COUNTER_NAMES = (
    "puts",
    "put_bytes",
    "put_failures",
    "gets",
    "get_bytes",
    "misses",
    "ttl_reaped",
    "grace_evicted",
    "quarantine_events",
    "quarantine_freed",
    "late_arrivals",
    "peer_gone",
    *VERDICT_COUNTER_NAMES,
)


#: A receiver's probe of one key at a sender (``OmniConnectorBase.probe``): ``peek`` {``key``}
#: -> ``held`` {``found``, ``size``}. Answered at once from the sender's table; claims, leases
#: and counts nothing. Every pull connector's schema includes these.
PEEK_OP = "peek"


class Peek(msgspec.Struct):
    """``peek``: could ``key`` be claimed now?"""

    key: Str


class Held(msgspec.Struct):
    """``held``: the answer to ``peek``."""

    found: bool
    size: UInt


PEEK_REQUESTS: dict[str, Spec] = {PEEK_OP: Peek}
PEEK_REPLIES: dict[str, Spec] = {"held": Held}


def peek_answer(size: int | None) -> dict[str, Any]:
    """A sender's ``held`` reply: the entry's size when it could be claimed now, ``None``
    when it is absent, in flight or spent."""
    return {"op": "held", "found": size is not None, "size": size or 0}


def transfer_budget_s(nbytes: int) -> float:
    """How long one transfer of ``nbytes`` may take: the reference's pull timeout, 30 s + 5 s
    per full 100 MiB (both pull connectors)."""
    return 30.0 + 5.0 * (nbytes // (100 << 20))


def _limits(cfg: Mapping[str, Any]) -> ServerLimits:
    """The control port's admission limits from ``cfg`` (``ConfigError`` names the key)."""
    return ServerLimits(
        max_connections=parse_int("max_connections", cfg.get("max_connections"), 1024),
        max_connections_per_peer=parse_int(
            "max_connections_per_peer", cfg.get("max_connections_per_peer"), 64
        ),
        handshake_timeout_s=parse_positive(
            "handshake_timeout_seconds", cfg.get("handshake_timeout_seconds"), 5.0
        ),
        idle_timeout_s=parse_positive(
            "idle_timeout_seconds", cfg.get("idle_timeout_seconds"), 300.0
        ),
        heartbeat_s=parse_positive("heartbeat_seconds", cfg.get("heartbeat_seconds"), 10.0),
    )


@dataclass(frozen=True)
class PullSettings:
    """The configuration keys both pull connectors read, checked once (``ConfigError`` names
    the key). Each connector's settings class adds its own keys (see :meth:`common`)."""

    role: str
    host: str
    zmq_port: int | None
    pool_size: int
    ttl_s: float
    unclaimed_grace_s: float
    ack_timeout_s: float
    peer_timeout_s: float
    quarantine_dead_s: float
    close_timeout_s: float
    window_s: float
    put_timeout_s: float
    secret: bytes | None = field(repr=False)
    default_sender: tuple[str, int] | None
    limits: ServerLimits

    @staticmethod
    def common(cfg: Mapping[str, Any]) -> dict[str, Any]:
        """The shared fields parsed from ``cfg``: keyword arguments for a subclass.

        ``role`` ("sender" binds ``zmq_port``, required then; "receiver" binds nothing),
        ``host``, ``memory_pool_size`` (1 GiB), ``buffer_ttl_seconds`` (300),
        ``unclaimed_grace_seconds`` (10: a put that finds the pool full frees payloads
        published this long ago that no receiver is pulling, oldest first:
        :mod:`omnikv.connectors.pull.room`),
        ``ack_timeout_s`` (:data:`~omnikv.connectors.delivery.DEFAULT_ACK_TIMEOUT_S`: a payload
        taken without a verdict for this long is reported ``expired``),
        ``peer_timeout_seconds`` (5), ``quarantine_dead_seconds`` (60),
        ``close_timeout_seconds`` (30), ``auth_window_seconds`` (30), ``put_timeout_s`` (0),
        ``auth_secret`` (or ``auth_secret_file``, or ``$OMNIKV_AUTH_SECRET``:
        :func:`~omnikv.values.resolve_secret`), ``sender_host`` / ``sender_zmq_port`` (a
        receiver's default sender),
        and the control port's admission limits (``limits``, a
        :class:`~omnikv.connectors.pull.control.ServerLimits`): ``max_connections`` (1024),
        ``max_connections_per_peer`` (64),
        ``handshake_timeout_seconds`` (5), ``idle_timeout_seconds`` (300),
        ``heartbeat_seconds`` (10; a receiver's keepalive too).
        """
        role = parse_choice("role", cfg.get("role"), "sender", ("sender", "receiver"))
        zmq_port = None  # a receiver binds nothing: its zmq_port (if any) is not used
        if role == "sender":
            if cfg.get("zmq_port") is None:
                raise ConfigError("a sender needs zmq_port")
            zmq_port = parse_port("zmq_port", cfg["zmq_port"], 0)
        default_sender = None
        if cfg.get("sender_host") and cfg.get("sender_zmq_port") is not None:
            sender_port = parse_port("sender_zmq_port", cfg["sender_zmq_port"], 0)
            default_sender = (str(cfg["sender_host"]), sender_port)

        def seconds(key: str, default: float) -> float:
            return parse_positive(key, cfg.get(key), default)

        return {
            "role": role,
            "host": resolve_host(cfg.get("host")),
            "zmq_port": zmq_port,
            "pool_size": parse_size("memory_pool_size", cfg.get("memory_pool_size"), 1 << 30),
            "ttl_s": seconds("buffer_ttl_seconds", 300.0),
            "unclaimed_grace_s": parse_number(
                "unclaimed_grace_seconds",
                cfg.get("unclaimed_grace_seconds"),
                DEFAULT_UNCLAIMED_GRACE_S,
            ),
            "ack_timeout_s": parse_positive(
                "ack_timeout_s", cfg.get("ack_timeout_s"), DEFAULT_ACK_TIMEOUT_S
            ),
            "peer_timeout_s": seconds("peer_timeout_seconds", 5.0),
            "quarantine_dead_s": seconds("quarantine_dead_seconds", 60.0),
            "close_timeout_s": seconds("close_timeout_seconds", 30.0),
            "window_s": seconds("auth_window_seconds", DEFAULT_WINDOW_S),
            "put_timeout_s": parse_number("put_timeout_s", cfg.get("put_timeout_s"), 0.0),
            "secret": resolve_secret(cfg),
            "default_sender": default_sender,
            "limits": _limits(cfg),
        }


def published(settings: PullSettings, counters: Counters, key: str, size: int) -> dict[str, Any]:
    """Count a publication of ``size`` bytes under ``key`` (called by a sending side once the
    entry is visible); the metadata a receiver can fetch it with."""
    counters.add("puts")
    counters.add("put_bytes", size)
    logger.debug("published %s (%d bytes)", key, size)
    return {
        "source_host": settings.host,
        "source_port": settings.zmq_port,
        "data_size": size,
        "is_fast_path": True,
    }


def deliver(pool: HostPool, counters: Counters, offset: int, size: int) -> ManagedBuffer:
    """Hand a filled receive slot to the caller (counted as a get); released, it is freed."""
    counters.add("gets")
    counters.add("get_bytes", size)
    return ManagedBuffer(pool.slot(offset, size), SlotRelease(pool, offset))


class LateArrivals:
    r"""Receive slots whose transfer finished after their receiver gave up on them.

    A receiving side quarantines a slot whose transfer may still be writing; when its reaper
    learns that the transfer completed, it :meth:`keep`\ s the slot under its key, and the next
    ``wait`` / ``get`` of that key :meth:`take`\ s it without a new transfer (the sender
    consumed the entry already). Thread-safe; ``cleanup`` and ``clear`` free what is held.
    """

    def __init__(self, pool: HostPool, counters: Counters, limit: int | None = None) -> None:
        self._pool = pool
        self._counters = counters
        self._limit = limit
        self._lock = threading.Lock()
        self._held: dict[str, tuple[int, int]] = {}

    def keep(self, key: str, offset: int, size: int) -> bool:
        """Hold the slot for ``key`` (one held earlier for it is freed); False, holding
        nothing, when ``limit`` slots are held already (the caller frees the slot)."""
        with self._lock:
            if self._limit is not None and len(self._held) >= self._limit:
                return False
            old = self._held.pop(key, None)
            self._held[key] = (offset, size)
        if old is not None:
            self._pool.allocator.free(old[0])
        self._counters.add("late_arrivals")
        return True

    def size(self, key: str) -> int | None:
        """The size of the slot held for ``key``, or ``None`` (a probe; takes nothing)."""
        with self._lock:
            held = self._held.get(key)
        return None if held is None else held[1]

    def take(self, key: str) -> ManagedBuffer | None:
        """The slot held for ``key`` as a buffer (counted as a get), or ``None``."""
        with self._lock:
            late = self._held.pop(key, None)
        return None if late is None else deliver(self._pool, self._counters, *late)

    def cleanup(self, request_id: str) -> None:
        """Free the slots held for ``request_id`` (:func:`matches_request`)."""
        with self._lock:
            keys = [k for k in self._held if matches_request(k, request_id)]
            dropped = [self._held.pop(k) for k in keys]
        for offset, _ in dropped:
            self._pool.allocator.free(offset)

    def clear(self) -> None:
        """Forget everything held (at close: the pool goes with the connector)."""
        with self._lock:
            self._held.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)


class SendingSide(Protocol):
    """The sender half of a pull connector (``role="sender"``)."""

    @property
    def room(self) -> PoolRoom[Any]:
        """Where a put's slot is reserved (waiting until its deadline, a full pool first
        freeing entries unclaimed past ``unclaimed_grace_seconds``) and filled."""
        ...

    def publish(self, key: str, offset: int, size: int, put_key: str) -> dict[str, Any]:
        """Publish the slot at ``offset`` (filled through :attr:`room`) under ``key``, watched
        for its verdict as ``put_key``; the metadata a receiver needs."""
        ...

    def cleanup(self, request_id: str) -> None: ...

    def withdraw(self, key: str) -> bool:
        """Drop ``key``'s entry unless a receiver has it (pulled, leased); whether it went."""
        ...

    def pending_keys(self) -> list[str]: ...

    def flush(self, timeout_s: float) -> list[str]:
        """Wait up to ``timeout_s`` until every entry was consumed; the keys still left."""
        ...


class ReceivingSide(Protocol):
    """The receiver half of a pull connector: the backend (ask, transfer) of its
    :class:`~omnikv.connectors.pull.receiving.PullReceiver`, which the connector receives
    through (``wait``, ``take``, ``held``, ``cleanup``)."""

    @property
    def core(self) -> PullReceiver[Any]:
        """The wait loop, quarantine and late arrivals this side is the backend of."""
        ...

    @property
    def client(self) -> ControlClient:
        """The control client this side reaches senders through."""
        ...


def sender_endpoint(metadata: Mapping[str, Any] | None, default: Endpoint | None) -> Endpoint:
    """Where to fetch from: the put's metadata (``source_host`` / ``source_port``) if it names
    one, else ``default`` (``update_sender_info``, ``sender_host`` / ``sender_zmq_port``);
    ``ConnectorUnavailableError`` when neither does."""
    if metadata:
        host, port = metadata.get("source_host"), metadata.get("source_port")
        if host and port is not None:
            return str(host), int(port)
    if default is None:
        raise ConnectorUnavailableError(
            "no sender endpoint: call update_sender_info() or pass source_host/source_port"
        )
    return default


_S = TypeVar("_S", bound=SendingSide)
_R = TypeVar("_R", bound=ReceivingSide)


class PullConnector(OmniConnectorBase, Generic[_S, _R]):
    """Base of the pull-model connectors: the contract's methods, delegated to the sides.

    A subclass builds ``_sender`` (senders only) and ``_receiver`` (receivers; the TE connector
    builds one for every role), ``_counters`` and ``_default_sender`` in its constructor, and a
    sender its ``_verdicts`` (:meth:`_open_verdicts`, before its sending side, which reports to
    it); declares ``error_map`` (its backend's table, applied around every call into a side),
    and implements ``health`` and ``close``.
    """

    acknowledges: ClassVar[bool] = True
    reports_incoming: ClassVar[bool] = True
    checks_data: ClassVar[bool] = True
    takes_abort: ClassVar[bool] = True
    error_map: ClassVar[ErrorMap]
    _verdicts: SentVerdicts | None = None
    #: How long ``acknowledge`` may take to reach the sender (the peer timeout).
    _ack_send_s: float = 5.0
    _sender: _S | None = None
    _receiver: _R | None = None
    _counters: Counters
    _default_sender: Endpoint | None = None
    #: Per sender rank endpoints (``update_sender_info(..., sender_rank=)``), replaced whole.
    _rank_senders: dict[int, Endpoint] = {}  # noqa: RUF012 - never mutated in place
    #: The control endpoint a sender serves (``get_connection_info``).
    host: str
    zmq_port: int | None
    #: ``flush(None)`` waits this long (seconds).
    _flush_default_s: float = 0.0

    # -- sending -------------------------------------------------------------------------------
    def _sending_side(self) -> _S:
        if self._closed:
            raise ConnectorClosedError(f"{type(self).__name__} is closed")
        if self._sender is None:
            raise ConnectorError(f"only a {type(self).__name__} with role='sender' serves puts")
        return self._sender

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
        """``write`` fills a slot of the sending side's registered pool (its
        :attr:`~SendingSide.room`: a full pool first frees entries unclaimed past
        ``unclaimed_grace_seconds``), which the side then publishes for a receiver to pull. A
        connector without ``role="sender"`` refuses (``ConnectorError``)."""
        side = self._sending_side()
        key = self._make_key(put_key, from_stage, to_stage)
        try:
            offset = side.room.fill(key, nbytes, write, deadline)
            return True, nbytes, side.publish(key, offset, nbytes, put_key)
        except ConnectorError:
            self._counters.add("put_failures")
            raise

    # -- receiving -----------------------------------------------------------------------------
    def _receiving_side(self) -> _R:
        if self._closed:
            raise ConnectorClosedError(f"{type(self).__name__} is closed")
        if self._receiver is None:
            raise ConnectorError(f"only a {type(self).__name__} with role='receiver' receives")
        return self._receiver

    @property
    def control_client(self) -> ControlClient | None:
        """The receiving side's control client (``None`` without one): every message this
        connector sends to a sender leaves through it. For diagnostics and tests (a test taps
        it with :meth:`~omnikv.connectors.pull.client.ControlClient.observe_sends`)."""
        return None if self._receiver is None else self._receiver.client

    def update_sender_info(
        self, sender_host: str, sender_zmq_port: int, sender_rank: int | None = None
    ) -> None:
        """The default sender endpoint for gets without per-call metadata (called by the
        manager); with ``sender_rank``, that rank's endpoint instead (:meth:`sender_endpoint`),
        the default staying as it was (the reference's 0.32 form)."""
        endpoint = (str(sender_host), int(sender_zmq_port))
        if sender_rank is None:
            self._default_sender = endpoint
        else:
            self._rank_senders = {**self._rank_senders, int(sender_rank): endpoint}

    def sender_endpoint(self, sender_rank: int | None = None) -> Endpoint | None:
        """Where a get without metadata fetches from: ``sender_rank``'s endpoint when one was
        set, else the default one, else ``None`` (the reference's resolution order)."""
        if sender_rank is not None and sender_rank in self._rank_senders:
            return self._rank_senders[sender_rank]
        return self._default_sender

    def get_connection_info(self) -> dict[str, Any] | None:
        """``{"host", "zmq_port"}``: the control endpoint receivers reach this sender at (what
        they pass to :meth:`update_sender_info`); ``None`` for a receiver, which serves none."""
        if self._sender is None:
            return None
        return {"host": self.host, "zmq_port": self.zmq_port}

    def get(
        self,
        from_stage: str,
        to_stage: str,
        get_key: str,
        metadata: dict[str, Any] | None = None,
    ) -> GetResult | None:
        """Reference-shaped get: one attempt (no hold), fetch if present; ``None`` otherwise.

        Returns ``(ManagedBuffer, size)`` over the receiver's registered pool slot (the caller
        releases it), or ``(obj, size)`` for an object put. Errors are logged and give ``None``.
        """
        side = self._receiving_side()
        key = self._make_key(get_key, from_stage, to_stage)
        try:
            with self.error_map.translate(f"get of {key}"):
                buf = side.core.take(key, sender_endpoint(metadata, self._default_sender))
        except ConnectorError as exc:
            _outsider.error("get of %s failed: %s", key, exc)
            return None
        return None if buf is None else get_result(buf)

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
        """Long-poll the sender (no sleep loop) and fetch into a slot of the receiver's
        registered pool, through the receiving side's
        :class:`~omnikv.connectors.pull.receiving.PullReceiver`; a set ``abort`` ends the wait
        while nothing has been granted. ``on_incoming`` is called with the payload's size once
        the sender granted the transfer, before the bytes move. Raises
        ``PeerGoneError`` when the sender falls silent mid-transfer, ``PoolExhaustedError``
        when no receive slot frees up before the deadline, ``ConnectorUnavailableError`` for a
        failed transfer or a missing endpoint.
        """
        side = self._receiving_side()
        key = self._make_key(get_key, from_stage, to_stage)
        with self.error_map.translate(f"wait for {key}"):
            endpoint = sender_endpoint(metadata, self._default_sender)
            return side.core.wait(key, endpoint, deadline, on_incoming, abort)

    def probe(
        self,
        from_stage: str,
        to_stage: str,
        get_key: str,
        *,
        deadline: float,
        metadata: dict[str, Any] | None = None,
    ) -> KeyProbe:
        """``ready`` when the payload is in this receiver's pool already (it arrived after an
        earlier wait gave up), else one ``peek`` to its sender (``metadata``'s endpoint, as
        for ``wait``, else the default sender): ``offered`` with its size when the sender
        could grant it now, ``missing`` when it holds no claimable entry (absent, in flight
        to another receiver, or spent). ``unknown`` when the sender is unreachable or silent
        by ``deadline``, for a sender that does not know ``peek``, and for a sender-only or
        closed connector. Never raises, never claims."""
        try:
            side = self._receiving_side()
            key = self._make_key(get_key, from_stage, to_stage)
            size = side.core.held(key)
            if size is not None:
                return KeyProbe(KeyState.READY, size)
            endpoint = sender_endpoint(metadata, self._default_sender)
            with self.error_map.translate(f"probe of {key}"):
                chan = side.client.channel(endpoint, max(0.0, remaining(deadline)))
                reply = None
                if chan is not None:
                    reply = chan.request({"op": PEEK_OP, "key": key}, max(0.0, remaining(deadline)))
        except Exception as exc:  # never raises: the scheduler asks again or receives
            return KeyProbe(KeyState.UNKNOWN, detail=f"{type(exc).__name__}: {exc}")
        if reply is None:
            how = "unreachable" if chan is None else "silent"
            return KeyProbe(KeyState.UNKNOWN, detail=f"sender {endpoint[0]}:{endpoint[1]} {how}")
        if reply["op"] != "held":
            return KeyProbe(KeyState.UNKNOWN, detail=f"sender answered {reply['op']!r}")
        if not reply["found"]:
            return KeyProbe(KeyState.MISSING)
        return KeyProbe(KeyState.OFFERED, int(reply["size"]))

    # -- delivery verdicts ----------------------------------------------------------------------
    def _open_verdicts(self, settings: PullSettings) -> SentVerdicts:
        """The sender's verdict bookkeeping (called by a subclass's constructor)."""
        self._ack_send_s = settings.peer_timeout_s
        self._verdicts = SentVerdicts(settings.ack_timeout_s, self._counters)
        return self._verdicts

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
        """Send ``verdict`` on the payload taken under ``get_key`` to the sender it came from
        (``metadata``'s endpoint, as for that ``wait``, else the default sender): one message on
        this thread's control channel to that sender (opened if needed, within the peer
        timeout); no answer is awaited."""
        key = self._make_key(get_key, from_stage, to_stage)
        try:
            side = self._receiving_side()
            msg = verdict_message(key, verdict, reason)
            if msg is None:
                _outsider.warning("no verdict sent for %.200s: key too long", key)
                return
            endpoint = sender_endpoint(metadata, self._default_sender)
            with self.error_map.translate(f"verdict on {key}"):
                chan = side.client.channel(endpoint, self._ack_send_s)
                if chan is not None:
                    chan.send(msg)
            if chan is None or chan.closed:
                logger.warning(
                    "verdict %s on %s not delivered: sender %s:%d unreachable",
                    msg["verdict"],
                    key,
                    *endpoint,
                )
        except Exception as exc:  # never raises: the sender's own watch expires it
            logger.warning("verdict on %s not sent: %s: %s", key, type(exc).__name__, exc)

    def set_delivery_listener(self, listener: DeliveryListener | None) -> None:
        """Report each payload this sender publishes to ``listener`` once (see
        :mod:`omnikv.connectors.pull.verdicts`); a receiver-only connector reports nothing."""
        if self._verdicts is not None:
            self._verdicts.set_listener(listener)

    # -- common --------------------------------------------------------------------------------
    def cleanup(
        self, request_id: str, from_stage: str | None = None, to_stage: str | None = None
    ) -> None:
        """Drop unconsumed entries (sender) and late arrivals (receiver) of ``request_id``
        (:func:`matches_request`), or, given both stages, of exactly the key ``put(from_stage,
        to_stage, request_id, ...)`` published (the reference's 0.32 form; one stage alone is a
        ``ValueError``)."""
        target = cleanup_target(request_id, from_stage, to_stage, self._make_key)
        if self._sender is not None:
            self._sender.cleanup(target)
        if self._receiver is not None:
            self._receiver.core.cleanup(target)

    def withdraw(self, from_stage: str, to_stage: str, put_key: str) -> bool:
        """Drop the entry this sender published under ``put_key`` while no receiver has it
        (:meth:`~omnikv.connectors.base.OmniConnectorBase.withdraw`); a receiver-only
        connector has none."""
        if self._sender is None or self._closed:
            return False
        return self._sender.withdraw(self._make_key(put_key, from_stage, to_stage))

    def pending_keys(self) -> list[str]:
        """Keys published by this sender and not yet consumed (tests, diagnostics)."""
        return [] if self._sender is None else self._sender.pending_keys()

    def flush(self, timeout: float | None = None) -> list[str]:
        """Wait up to ``timeout`` seconds (``None``: the connector's default) until every
        published payload was consumed; the keys still unconsumed (a receiver publishes none).
        """
        if self._sender is None or self._closed:
            return []
        limit = self._flush_default_s if timeout is None else max(0.0, float(timeout))
        return self._sender.flush(limit)
