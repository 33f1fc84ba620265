"""The connector contract: what the sender and receiver may ask of any transport.

Who calls what:

* ``put`` / ``put_packed``: the sender, once per key per request, on the model-runner thread.
  May block until its ``deadline`` (pool full). On success the connector owns the data; on failure
  the caller still owns it and nothing stays published under the key.
* ``get``: the receiver, possibly repeatedly for one key. Never blocks for long; ``None`` means
  "not (yet) there". A successful get consumes the payload (consume-once).
* ``wait``: the receiver, once per key; blocks until the payload is there or the absolute
  monotonic ``deadline`` passes (then returns ``None`` and consumes nothing). Transports that can
  be notified override it; the default polls ``get`` finely and boundedly, never blindly.
* ``cleanup``: the receiver or an orchestrator, to drop what a request left unconsumed.
* ``health``: anyone, any time; cheap, never raises.
* ``close``: the owner, once or more (idempotent); afterwards put/get raise
  ``ConnectorClosedError``.

A ``get`` / ``wait`` result is ``(obj, size)`` where ``obj`` is ``bytes``-like, a 1-D ``uint8``
tensor, a :class:`ManagedBuffer` (the caller must ``release()`` it), or an already decoded
object (dict). Transport failures are raised as :class:`~omnikv.errors.ConnectorError`
subclasses from ``wait`` and ``put_packed``; the reference-shaped ``put`` / ``get`` report them as
``(False, 0, None)`` / ``None``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable
from types import TracebackType
from typing import Any, ClassVar

import numpy as np
import torch

from omnikv.deadline import remaining

__all__ = [
    "GetResult",
    "ManagedBuffer",
    "OmniConnectorBase",
    "PutResult",
    "Writer",
]

logger = logging.getLogger(__name__)

PutResult = tuple[bool, int, "dict[str, Any] | None"]
GetResult = tuple[Any, int]
Writer = Callable[[torch.Tensor], object]
"""Fills a 1-D contiguous ``uint8`` tensor of exactly the requested size (see ``put_packed``)."""

# Bounded polling for transports that cannot notify: start fine, back off to a small cap.
_POLL_FIRST_S = 0.0005
_POLL_CAP_S = 0.01


class _OwnedArray(np.ndarray):  # type: ignore[type-arg]
    """A numpy view whose garbage collection releases the pool space it aliases."""


class ManagedBuffer:
    """A zero-copy view of transport memory (a pool slot, a registered buffer).

    ``tensor`` is a 1-D ``uint8`` view of exactly ``size`` bytes. The memory belongs to the
    connector until :meth:`release` is called (idempotent; also on context exit and on garbage
    collection). After release ``tensor`` raises ``RuntimeError``: views made earlier must not be
    used, since the space may be reused.

    :meth:`adopt` hands the memory's lifetime to tensors instead: the space is released when the
    last tensor derived from the returned tensor dies (host memory only).
    """

    __slots__ = ("__weakref__", "_adopted", "_lock", "_release_cb", "_released", "_tensor")

    def __init__(self, tensor: torch.Tensor, release: Callable[[], None] | None = None) -> None:
        if tensor.dtype != torch.uint8 or tensor.dim() != 1 or not tensor.is_contiguous():
            raise ValueError("ManagedBuffer needs a contiguous 1-D uint8 tensor")
        self._tensor: torch.Tensor | None = tensor
        self._release_cb = release
        self._released = False
        self._adopted = False
        self._lock = threading.Lock()

    @property
    def tensor(self) -> torch.Tensor:
        """The zero-copy 1-D ``uint8`` view; raises ``RuntimeError`` after release."""
        t = self._tensor
        if t is None or self._released:
            raise RuntimeError("ManagedBuffer was released; its memory may be reused")
        return t

    @property
    def size(self) -> int:
        """Number of bytes in the buffer (0 after release)."""
        t = self._tensor
        return 0 if t is None else int(t.numel())

    @property
    def released(self) -> bool:
        return self._released

    @property
    def device(self) -> torch.device:
        t = self._tensor
        return torch.device("cpu") if t is None else t.device

    def as_tensor(
        self, dtype: torch.dtype, shape: tuple[int, ...], offset: int = 0
    ) -> torch.Tensor:
        """A typed view at ``offset``; checks the byte size and the offset's alignment."""
        t = self.tensor
        item = torch.empty((), dtype=dtype).element_size()
        count = math.prod(shape)
        nbytes = count * item
        if offset < 0 or offset + nbytes > t.numel():
            raise ValueError(f"view of {nbytes} bytes at offset {offset} exceeds {t.numel()} bytes")
        if offset % item:
            raise ValueError(f"offset {offset} is not aligned to {item} bytes for {dtype}")
        return t[offset : offset + nbytes].view(dtype).view(shape)

    def to_bytes(self) -> bytes:
        """A host copy of the contents."""
        t = self.tensor
        if t.device.type != "cpu":
            t = t.cpu()
        return t.numpy().tobytes()

    def adopt(self) -> torch.Tensor | None:
        """Return a tensor over the same memory that owns it; release follows its lifetime.

        The space returns to the pool when the returned tensor and every view derived from it are
        garbage-collected. Afterwards :meth:`release` is a no-op. Returns ``None`` (and changes
        nothing) for device memory, which the receiver then copies out instead.
        """
        with self._lock:
            t = self.tensor
            if t.device.type != "cpu":
                return None
            arr = t.numpy().view(_OwnedArray)
            cb = self._release_cb
            self._adopted = True
            self._released = True
            self._tensor = None
            self._release_cb = None
        if cb is not None:
            weakref.finalize(arr, _safe_call, cb)
        return torch.from_numpy(arr)

    def release(self) -> None:
        """Return the memory to its owner. Idempotent and thread-safe."""
        with self._lock:
            if self._released:
                return
            self._released = True
            cb = self._release_cb
            self._release_cb = None
            self._tensor = None
        if cb is not None:
            _safe_call(cb)

    def __enter__(self) -> ManagedBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.release()

    def __repr__(self) -> str:
        state = "released" if self._released else f"{self.size} bytes on {self.device}"
        return f"ManagedBuffer({state})"


def _safe_call(cb: Callable[[], None]) -> None:
    try:
        cb()
    except Exception:
        logger.exception("releasing a connector buffer failed")


class OmniConnectorBase(ABC):
    """Base class of every omnikv transport (see the module docstring for the contract).

    Subclasses implement ``put``, ``get`` and ``close``; the rest have working defaults.
    Capabilities are class attributes, never probed with ``hasattr``.
    """

    #: Accepts raw bytes / uint8 tensors / its own pool buffers without msgpack wrapping; the
    #: manager then hands it packed device tensors when the KV lives on a device.
    supports_raw_data: ClassVar[bool] = False
    #: ``wait`` is woken by the transport (no polling at all).
    supports_notify: ClassVar[bool] = False
    #: ``put_packed`` writes straight into transport memory (no staging copy).
    supports_zero_copy_put: ClassVar[bool] = False

    def __init__(self) -> None:
        self._closed = False

    # -- required -------------------------------------------------------------------------
    @abstractmethod
    def put(self, from_stage: str, to_stage: str, put_key: str, data: Any) -> PutResult:
        """Publish ``data`` under ``put_key`` for the edge ``from_stage -> to_stage``.

        Returns ``(ok, size, metadata)``; ``metadata`` may carry transport handles for ``get``.
        """

    @abstractmethod
    def get(
        self,
        from_stage: str,
        to_stage: str,
        get_key: str,
        metadata: dict[str, Any] | None = None,
    ) -> GetResult | None:
        """Take the payload published under ``get_key`` if it is there; ``None`` otherwise."""

    @abstractmethod
    def close(self) -> None:
        """Release every resource. Idempotent."""

    # -- optional, with defaults ----------------------------------------------------------
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
        """Publish a payload of ``nbytes`` bytes that ``write`` fills in place.

        ``write`` is called exactly once with a contiguous 1-D ``uint8`` tensor of ``nbytes``
        bytes; transports with pooled memory pass their own space, so the payload is encoded once,
        straight into the memory that travels. If ``write`` raises, nothing is published and the
        exception propagates. The default stages into a fresh host buffer and calls ``put``.
        """
        buf = torch.empty(nbytes, dtype=torch.uint8)
        write(buf)
        return self.put(from_stage, to_stage, put_key, buf)

    def wait(
        self,
        from_stage: str,
        to_stage: str,
        get_key: str,
        *,
        deadline: float,
        metadata: dict[str, Any] | None = None,
    ) -> GetResult | None:
        """Block until the payload under ``get_key`` is there or ``deadline`` passes.

        Returns the ``get`` result, or ``None`` at the deadline without consuming anything.
        The default polls ``get`` with a fine, bounded back-off (0.5 ms doubling to 10 ms), each
        sleep cut to the time left; notifying transports override it.
        """
        step = _POLL_FIRST_S
        while True:
            result = self.get(from_stage, to_stage, get_key, metadata)
            if result is not None:
                return result
            left = remaining(deadline)
            if left <= 0:
                return None
            time.sleep(min(step, left))
            step = min(step * 2, _POLL_CAP_S)

    def cleanup(self, request_id: str) -> None:  # noqa: B027 - optional hook
        """Drop anything left unconsumed for ``request_id``. Default: nothing to drop."""

    def health(self) -> dict[str, Any]:
        """Status and counters; cheap and never raising."""
        return {"status": "closed" if self._closed else "healthy", "type": type(self).__name__}

    def update_sender_info(self, host: str, port: int) -> None:  # noqa: B027 - optional hook
        """Set the default sender endpoint (pull transports). Default: not needed."""

    @property
    def closed(self) -> bool:
        return self._closed

    @staticmethod
    def _make_key(key: str, from_stage: str, to_stage: str, sep: str = "@") -> str:
        """The transport-level key for an edge: ``"{key}@{from}_{to}"``."""
        return f"{key}{sep}{from_stage}_{to_stage}"

    def __enter__(self) -> OmniConnectorBase:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if not getattr(self, "_closed", True):
                self.close()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass
