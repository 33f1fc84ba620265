"""The omnikv error tree.

Every layer above the connectors catches only these types. Each backend translates its own
exceptions into a :class:`ConnectorError` subclass at its boundary (``raise ... from exc``).

``KVPrefetchConsumeError`` keeps the seed's base class (``RuntimeError``); the payload errors are
``ValueError`` subclasses so code written against the reference (which raises ``ValueError`` for
malformed payloads) keeps working.

Retrying: every class says whether a retry can help (``transient``). The sender's put loop retries
only transient errors, and never past the send deadline:

* transient: :class:`ConnectorUnavailableError` (the engine may be back a moment later) and
  :class:`PoolExhaustedError` (a consumer may free space; a connector that already waited until
  the deadline leaves no time for a retry, so it is not retried then);
* not transient: everything else, in particular :class:`ConnectorClosedError` (nothing will
  reopen it), :class:`PeerGoneError`, payload and configuration errors, and any exception that is
  not an :class:`OmniKVError` (a bug or a misuse, e.g. KV that requires grad).
"""

from __future__ import annotations

from typing import ClassVar

__all__ = [
    "ConfigError",
    "ConnectorClosedError",
    "ConnectorError",
    "ConnectorUnavailableError",
    "DecodeError",
    "EncodeError",
    "KVMismatchError",
    "KVPrefetchConsumeError",
    "OmniKVError",
    "PayloadError",
    "PayloadRefused",
    "PeerGoneError",
    "PoolExhaustedError",
    "ReceiveTimeout",
    "is_transient",
]


class OmniKVError(Exception):
    """Base class of every error omnikv raises on purpose."""

    #: Whether trying the same operation again (before its deadline) may succeed.
    transient: ClassVar[bool] = False


class ConfigError(OmniKVError, ValueError):
    """A configuration value is invalid (raised at configuration time, never mid-transfer)."""


class PayloadError(OmniKVError, ValueError):
    """A KV payload could not be encoded or decoded."""


class DecodeError(PayloadError):
    """A packed KV payload is malformed; the message says what was expected, found, and where."""


class PayloadRefused(PayloadError):
    """A payload was taken and decoded, then rejected by a check (the caller's, or a duplicate
    or stale one); its sender is told ``refused`` with this message."""


class EncodeError(PayloadError):
    """A KV payload cannot be represented in the wire format (e.g. non-JSON metadata)."""


class KVMismatchError(PayloadError):
    """Received KV does not fit where it is to be written or handed over (rank, shape, dtype,
    or values); the message names what did not fit, what was expected and what was found."""


class ConnectorError(OmniKVError):
    """A transport failed. Subclasses say how; ``__cause__`` holds the backend's own error."""


class ConnectorUnavailableError(ConnectorError):
    """The transport cannot be reached or is not set up (engine down, master unreachable)."""

    transient = True


class ConnectorClosedError(ConnectorError):
    """The connector was closed; no further put or get is possible."""


class PeerGoneError(ConnectorError):
    """The remote side of a transfer died or went away mid-transfer."""


class PoolExhaustedError(ConnectorError):
    """No space in the connector's buffer pool before the deadline."""

    transient = True


class ReceiveTimeout(OmniKVError, TimeoutError):
    """A receive did not complete before its deadline.

    Attributes:
        request_id: the request whose KV was awaited.
        waited_s: seconds waited before giving up.
    """

    def __init__(self, request_id: str, waited_s: float, detail: str = "") -> None:
        self.request_id = request_id
        self.waited_s = waited_s
        msg = f"KV for request {request_id!r} did not arrive within {waited_s:.3f}s"
        if detail:
            msg = f"{msg} ({detail})"
        super().__init__(msg)


class ExtractionError(OmniKVError, ValueError):
    """A request's KV cannot be extracted (bad block ids, missing seq_len, unknown layout)."""


class DistributionError(OmniKVError):
    """A group operation failed or timed out; the group is marked broken."""


class HFCacheError(OmniKVError, ValueError):
    """A transformers cache omnikv cannot send (batch > 1, uneven layers, wrong shape), or
    received KV that does not fit the model (layers, heads, head size, dtype)."""


class ProtocolError(ValueError):
    """A control message failed authentication or validation (dropped and counted)."""


class ReceiveCancelled(OmniKVError):
    """The caller's ``abort`` event was set between two wait slices (nothing more consumed)."""


class KVPrefetchConsumeError(RuntimeError):
    """Payload consumed from connector but post-get processing failed — sync retry impossible."""


def is_transient(exc: BaseException) -> bool:
    """True when ``exc`` is an omnikv error marked ``transient`` (a retry may succeed)."""
    return isinstance(exc, OmniKVError) and exc.transient
