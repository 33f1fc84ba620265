"""What the two pull-model connectors (Mooncake Transfer Engine, NIXL) share above their sides.

Both publish into a registered pool on the sender and let the receiver fetch from it; each is
split into a sending side and a receiving side, and the role is chosen once, at construction.
:class:`PullConnector` holds the glue between the connector contract
(:mod:`omnikv.connectors.base`) and those sides: the role checks, the transport key, the sender
endpoint rule, the reference-shaped ``get`` and the error boundary around every call.
"""

from __future__ import annotations

import contextlib
import logging
from abc import abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from omnikv.connectors._control import Endpoint
from omnikv.connectors._stats import Counters
from omnikv.connectors.base import (
    GetResult,
    ManagedBuffer,
    OmniConnectorBase,
    PutResult,
    Writer,
    get_result,
)
from omnikv.errors import ConnectorClosedError, ConnectorError, ConnectorUnavailableError

__all__ = ["PullConnector", "ReceivingSide", "SendingSide", "sender_endpoint"]

logger = logging.getLogger(__name__)


class SendingSide(Protocol):
    """The sender half of a pull connector (``role="sender"``)."""

    def put_packed(self, key: str, nbytes: int, write: Writer, deadline: float) -> dict[str, Any]:
        """Fill a pool slot with ``write`` (space waited for until ``deadline``), publish it
        under ``key``; the metadata a receiver needs."""
        ...

    def cleanup(self, request_id: str) -> None: ...

    def pending_keys(self) -> list[str]: ...

    def flush(self, timeout_s: float) -> list[str]:
        """Wait up to ``timeout_s`` until every entry was consumed; the keys still left."""
        ...


class ReceivingSide(Protocol):
    """The receiver half of a pull connector."""

    def take(self, key: str, endpoint: Endpoint) -> ManagedBuffer | None:
        """One attempt without holding (the reference-shaped ``get``); ``None`` if absent."""
        ...

    def wait(self, key: str, endpoint: Endpoint, deadline: float) -> ManagedBuffer | None:
        """Long-poll and fetch ``key``; ``None`` at ``deadline`` (nothing consumed)."""
        ...

    def cleanup(self, request_id: str) -> None: ...


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
    builds one for every role), ``_counters`` and ``_default_sender`` in its constructor, and
    implements :meth:`_errors` (its backend's error boundary), ``health`` and ``close``.
    """

    supports_raw_data: ClassVar[bool] = True
    _sender: _S | None = None
    _receiver: _R | None = None
    _counters: Counters
    _default_sender: Endpoint | None = None
    #: ``flush(None)`` waits this long (seconds).
    _flush_default_s: float = 0.0

    @abstractmethod
    def _errors(self, what: str) -> contextlib.AbstractContextManager[None]:
        """Translate the backend's failures during ``what`` into omnikv errors."""

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
        """Sender hot path: ``write`` encodes straight into a registered pool slot.

        Waits for pool space until ``deadline`` (absolute monotonic) and then raises
        :class:`~omnikv.errors.PoolExhaustedError`; if ``write`` raises, the slot is freed and
        nothing is published.
        """
        side = self._sending_side()
        key = self._make_key(put_key, from_stage, to_stage)
        try:
            return True, nbytes, side.put_packed(key, nbytes, write, deadline)
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

    def update_sender_info(self, host: str, port: int) -> None:
        """Default sender endpoint for gets without per-call metadata (called by the manager)."""
        self._default_sender = (str(host), int(port))

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
            with self._errors(f"get of {key}"):
                buf = side.take(key, sender_endpoint(metadata, self._default_sender))
        except ConnectorError as exc:
            logger.error("get of %s failed: %s", key, exc)
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
    ) -> ManagedBuffer | None:
        """Block until the payload is in hand or ``deadline`` passes (then ``None``).

        Returns a :class:`ManagedBuffer` over the receiver's registered slot (release it).
        Long-polls the sender (no sleep loop). Raises ``PeerGoneError`` when the sender falls
        silent mid-transfer, ``PoolExhaustedError`` when no receive slot frees up before the
        deadline, ``ConnectorUnavailableError`` for a failed transfer or a missing endpoint.
        """
        side = self._receiving_side()
        key = self._make_key(get_key, from_stage, to_stage)
        with self._errors(f"wait for {key}"):
            return side.wait(key, sender_endpoint(metadata, self._default_sender), deadline)

    # -- common --------------------------------------------------------------------------------
    def cleanup(self, request_id: str) -> None:
        """Drop unconsumed entries (sender) and late arrivals (receiver) of ``request_id``."""
        if self._sender is not None:
            self._sender.cleanup(request_id)
        if self._receiver is not None:
            self._receiver.cleanup(request_id)

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
