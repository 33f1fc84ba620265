"""The typed outcomes of the transfer layer: a send (:class:`SendResult`), a receive
(:class:`ReceiveResult`) and a streaming step (:class:`StreamProgress`).

Plain values, imported by the sending, receiving, streaming and delivery modules and by the
edge; this module imports none of them, so none of them imports another for its result type.
The seed facade turns them into the seed API's shapes (``(None, 0)``, dicts).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from omnikv.transfer.received import ReceivedKV

__all__ = [
    "ReceiveResult",
    "ReceiveStatus",
    "SendResult",
    "SendStatus",
    "StreamProgress",
]


class SendStatus(str, Enum):
    """A send's outcome. ``sent``: every key published; with a connector that acknowledges
    (``acknowledges``), it later becomes ``delivered`` (every receiver accepted its payload),
    ``refused`` (a receiver rejected it, with its reason) or ``expired`` (nobody took it within
    the TTL, or the receiver that took it went away without a verdict)."""

    SENT = "sent"
    DELIVERED = "delivered"
    REFUSED = "refused"
    EXPIRED = "expired"
    SKIPPED = "skipped"
    FAILED = "failed"
    #: The manager is configured neither to send nor to receive (see its construction warning).
    NOT_CONFIGURED = "not_configured"


@dataclass
class SendResult:
    """Outcome of one request's send. ``ok`` when every key was published (``sent``, and
    ``delivered`` after it); ``refused`` and ``expired`` are not ok."""

    request_id: str
    status: SendStatus
    transfer_id: str = ""
    keys: list[str] = field(default_factory=list)
    nbytes: int = 0
    reason: str | None = None
    timings_ms: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status is SendStatus.SENT or self.status is SendStatus.DELIVERED


class ReceiveStatus(str, Enum):
    OK = "ok"
    TIMEOUT = "timeout"
    CORRUPT = "corrupt"
    UNAVAILABLE = "unavailable"
    PEER_GONE = "peer_gone"
    SKIPPED = "skipped"
    #: The caller aborted the wait (prefetch shutdown); nothing was consumed for the missing key.
    CANCELLED = "cancelled"
    #: Taken and decoded, then rejected by a check (the caller's ``check``); the sender is told.
    REFUSED = "refused"
    #: The manager is configured neither to send nor to receive (see its construction warning).
    NOT_CONFIGURED = "not_configured"


@dataclass
class ReceiveResult:
    """Outcome of one request's receive; ``kv`` holds the received KV when ``ok``."""

    request_id: str
    status: ReceiveStatus
    kv: ReceivedKV | None = None
    nbytes: int = 0
    keys: list[str] = field(default_factory=list)
    reason: str | None = None
    waited_s: float = 0.0
    timings_ms: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status is ReceiveStatus.OK

    @property
    def data(self) -> dict[str, Any] | None:
        """The seed's dict form of :attr:`kv` (a new dict per call), or ``None``."""
        return None if self.kv is None else self.kv.to_dict()

    @property
    def metadata(self) -> dict[str, Any]:
        """The payload's metadata (``custom_metadata`` included); empty without KV."""
        return {} if self.kv is None else self.kv.metadata


@dataclass(frozen=True)
class StreamProgress:
    """Where a request's stream stands after a ``stream_kv_blocks`` call (or a step run by the
    stream worker): ``shipped`` tokens published in ``chunks`` chunks so far; ``new`` tokens
    (``nbytes`` bytes) published since the previous progress handed out for the request (a
    step's own, for a step's outcome); ``reason`` says why nothing went or the stream stopped
    (the call's own refusal, else the latest completed step's; ``None``: nothing to say);
    ``pending``: the request's steps still queued or running."""

    request_id: str
    shipped: int = 0
    chunks: int = 0
    new: int = 0
    reason: str | None = None
    nbytes: int = 0
    pending: int = 0
