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
* ``get_with_deadline`` / ``abandon_get`` / ``reap_consumed``: the reference's newer names
  (vllm-omni 0.30): a receive bounded by an absolute deadline in ``get``'s shape (built on
  ``wait``), the hook after a receive gave up, and the sender's reaping of consumed payloads.
* ``cleanup``: the receiver or an orchestrator, to drop what a request left unconsumed.
* ``explain_miss``: the receiver, once after a ``wait`` returned ``None`` at its deadline, to say
  why in the timeout it reports (and whether the sender is gone).
* ``probe``: a receiver's scheduler, any time, to learn where a payload stands (``missing``,
  ``offered`` by a sender, ``ready`` in local memory) without taking or claiming it.
* ``health``: anyone, any time; cheap, never raises.
* ``close``: the owner, once or more (idempotent); afterwards put/get raise
  ``ConnectorClosedError``.

* ``flush``: the owner before closing, to wait (bounded) until what it published is consumed.
* ``acknowledge``: the receiver, once per payload it took, with its verdict (delivered or
  refused); ``set_delivery_listener``: the sender's owner, to learn each published payload's
  verdict (see :mod:`omnikv.connectors.delivery`). Transports that carry verdicts say so with
  ``acknowledges``.

``wait`` returns a :class:`ManagedBuffer` (release it when done) or ``None``. ``get`` keeps the
reference's shape, ``(obj, size)``: a :class:`ManagedBuffer` for raw payloads, the decoded object
for objects published with the reference-shaped ``put`` (they travel as
:func:`omnikv.wire.serializer.encode_object` bytes, so ``wait`` hands them over as those bytes;
:func:`get_result` turns such a buffer into the ``get`` shape). Transport failures are raised as
:class:`~omnikv.errors.ConnectorError` subclasses from ``wait`` and ``put_packed`` (each backend
translates its own errors at its boundary); the reference-shaped ``put`` / ``get`` report them as
``(False, 0, None)`` / ``None``.

Deadlines are absolute ``time.monotonic()`` values. ``put_packed`` waits for pool space until its
``deadline`` and then raises :class:`~omnikv.errors.PoolExhaustedError`; a deadline already
passed means "try once". The reference-shaped ``put`` has no deadline parameter: it waits
``put_timeout_s`` (instance attribute, default 0: try once).
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum
from types import TracebackType
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import numpy as np
import torch

from omnikv.connectors.delivery import DeliveryListener, Verdict
from omnikv.deadline import remaining
from omnikv.errors import ConnectorError
from omnikv.wire.serializer import OmniSerializer, decode_object, encode_object, is_object

if TYPE_CHECKING:
    from omnikv.connectors.boundary import ErrorMap
    from omnikv.connectors.pool import BufferAllocator

__all__ = [
    "ABORT_POLL_S",
    "ExactKey",
    "GetResult",
    "HostArrayWriter",
    "KeyProbe",
    "KeyState",
    "ManagedBuffer",
    "MissReport",
    "OmniConnectorBase",
    "PutResult",
    "SlotRelease",
    "Writer",
    "as_host_bytes",
    "as_managed",
    "cleanup_target",
    "fill_slot",
    "get_result",
    "matches_request",
    "notify_incoming",
    "polling",
    "takes_host_arrays",
]

logger = logging.getLogger(__name__)

#: How often a ``wait`` given an ``abort`` event looks at it while nothing has arrived (s).
ABORT_POLL_S = 0.05

PutResult = tuple[bool, int, "dict[str, Any] | None"]
GetResult = tuple[Any, int]
Writer = Callable[[torch.Tensor], object]
"""Fills a 1-D contiguous ``uint8`` tensor of exactly the requested size (see ``put_packed``).
A writer that is also a :class:`HostArrayWriter` may be handed a host slot as numpy instead."""


@runtime_checkable
class HostArrayWriter(Protocol):
    """A :data:`Writer` that can also fill a host slot given as a writable 1-D ``uint8`` numpy
    array, with no torch call (:class:`omnikv.wire.encode.PackedPayload` is one).

    Connectors whose slots are host memory (shared memory) check for it with ``isinstance`` and
    then call :meth:`write_host`; any other writer gets a tensor.
    """

    def __call__(self, dst: torch.Tensor) -> object:
        """Fill ``dst`` (a 1-D ``uint8`` tensor of the requested size)."""

    def write_host(self, dst: np.ndarray) -> object:
        """Fill ``dst`` (a writable 1-D ``uint8`` numpy array of the requested size)."""


_HOST_WRITER_TYPES: dict[type, bool] = {}


def takes_host_arrays(write: Writer) -> bool:
    """Whether ``write``'s type is a :class:`HostArrayWriter` (its methods are on the type), with
    the answer kept per type: a protocol ``isinstance`` costs microseconds, and a put of a small
    payload is on the request's path."""
    kind = type(write)
    known = _HOST_WRITER_TYPES.get(kind)
    if known is None:
        known = _HOST_WRITER_TYPES[kind] = isinstance(write, HostArrayWriter)
    return known


# Bounded polling for transports that cannot notify: start fine, back off to a small cap.
_POLL_FIRST_S = 0.0005
_POLL_CAP_S = 0.01


def polling(deadline: float) -> Iterator[None]:
    """The looks of a receive that polls: one at once, then one after each sleep of a fine,
    bounded back-off (0.5 ms doubling to 10 ms, each cut to the time left), the last at
    ``deadline``; ends once a look finds the deadline passed.

    Used as ``for _ in polling(deadline): <look; return what it found>`` by the default
    :meth:`OmniConnectorBase.wait` and by transports that cannot be notified (the Mooncake
    Store's ``wait``); the loop's end is the miss.
    """
    step = _POLL_FIRST_S
    while True:
        yield
        left = remaining(deadline)
        if left <= 0:
            return
        time.sleep(min(step, left))
        step = min(step * 2, _POLL_CAP_S)


_CPU = torch.device("cpu")


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

    __slots__ = (
        "__weakref__",
        "_adopted",
        "_array",
        "_lock",
        "_release_cb",
        "_released",
        "_size",
        "_tensor",
    )

    def __init__(self, tensor: torch.Tensor, release: Callable[[], None] | None = None) -> None:
        if tensor.dtype != torch.uint8 or tensor.dim() != 1 or not tensor.is_contiguous():
            raise ValueError("ManagedBuffer needs a contiguous 1-D uint8 tensor")
        self._tensor: torch.Tensor | None = tensor
        self._array: np.ndarray | None = None
        self._size = int(tensor.numel())
        self._release_cb = release
        self._released = False
        self._adopted = False
        self._lock = threading.Lock()

    @classmethod
    def host(cls, array: np.ndarray, release: Callable[[], None] | None = None) -> ManagedBuffer:
        """A buffer over host memory given as a 1-D ``uint8`` numpy array (a mapped pool's
        span): the torch view is made only if someone asks for :attr:`tensor`; :meth:`adopt`
        and :attr:`host_array` do without it. Called by the shared-memory receiver."""
        if array.dtype != np.uint8 or array.ndim != 1 or not array.flags.c_contiguous:
            raise ValueError("ManagedBuffer needs a contiguous 1-D uint8 array")
        self = cls.__new__(cls)
        self._tensor = None
        self._array = array
        self._size = int(array.size)
        self._release_cb = release
        self._released = False
        self._adopted = False
        self._lock = threading.Lock()
        return self

    @property
    def tensor(self) -> torch.Tensor:
        """The zero-copy 1-D ``uint8`` view; raises ``RuntimeError`` after release."""
        if self._released:
            raise RuntimeError("ManagedBuffer was released; its memory may be reused")
        t = self._tensor
        if t is None:
            array = self._array
            if array is None:
                raise RuntimeError("ManagedBuffer was released; its memory may be reused")
            t = self._tensor = torch.from_numpy(array)
        return t

    @property
    def host_array(self) -> np.ndarray | None:
        """The contents as a 1-D ``uint8`` numpy view for host memory (``None`` for device
        memory); raises ``RuntimeError`` after release, like :attr:`tensor`."""
        if self._released:
            raise RuntimeError("ManagedBuffer was released; its memory may be reused")
        if self._array is not None:
            return self._array
        t = self.tensor
        return t.numpy() if t.is_cpu else None

    @property
    def size(self) -> int:
        """Number of bytes in the buffer (0 after release)."""
        return 0 if self._released else self._size

    @property
    def released(self) -> bool:
        return self._released

    @property
    def device(self) -> torch.device:
        t = self._tensor
        return _CPU if t is None else t.device

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
        arr = self.adopt_array()
        return None if arr is None else torch.from_numpy(arr)

    def adopt_array(self) -> np.ndarray | None:
        """:meth:`adopt` as a 1-D ``uint8`` numpy array: the space is released when it and every
        array or tensor made from it (``torch.from_numpy`` keeps it alive) are gone."""
        with self._lock:
            host = self._array
            if host is None:
                t = self.tensor
                if not t.is_cpu:
                    return None
                host = t.numpy()
            elif self._released:
                raise RuntimeError("ManagedBuffer was released; its memory may be reused")
            arr = host.view(_OwnedArray)
            cb = self._release_cb
            self._adopted = True
            self._released = True
            self._tensor = self._array = None
            self._release_cb = None
        if cb is not None:
            weakref.finalize(arr, _safe_call, cb)
        return arr

    def release(self) -> None:
        """Return the memory to its owner. Idempotent and thread-safe."""
        with self._lock:
            if self._released:
                return
            self._released = True
            cb = self._release_cb
            self._release_cb = None
            self._tensor = self._array = None
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


class _Freer(Protocol):
    def free(self, offset: int) -> None: ...


class SlotPool(Protocol):
    """What :class:`SlotRelease` needs of a pool (``HostPool`` has it): an allocator and
    whether the pool's memory is gone.
    """

    @property
    def closed(self) -> bool: ...

    @property
    def allocator(self) -> _Freer: ...


class SlotRelease:
    """The release callback of a pool slot (a small class, so no closure keeps a connector alive).

    Frees ``offset`` in ``pool`` unless the pool was closed meanwhile (its memory is gone).
    """

    __slots__ = ("_offset", "_pool")

    def __init__(self, pool: SlotPool, offset: int) -> None:
        self._pool = pool
        self._offset = offset

    def __call__(self) -> None:
        if not self._pool.closed:
            self._pool.allocator.free(self._offset)


class FillPool(Protocol):
    """What :func:`fill_slot` needs of a pool (``HostPool`` and the local pool have it)."""

    @property
    def allocator(self) -> BufferAllocator: ...

    def slot(self, offset: int, nbytes: int, /) -> torch.Tensor: ...


def fill_slot(pool: FillPool, nbytes: int, write: Writer, deadline: float) -> int:
    """Reserve ``nbytes`` in ``pool`` (waiting for space until ``deadline``, then
    ``PoolExhaustedError``) and let ``write`` fill the slot; its offset.

    Called by the connectors' ``put_packed``. If ``write`` raises, the slot is freed and the
    exception propagates; on success the caller owns the slot (frees or publishes it).
    """
    if nbytes <= 0:
        raise ValueError(f"nbytes must be > 0, got {nbytes}")
    offset, _ = pool.allocator.alloc(nbytes, deadline=deadline)
    try:
        write(pool.slot(offset, nbytes))
    except BaseException:
        pool.allocator.free(offset)
        raise
    return offset


class ExactKey(str):
    """A transport key :func:`matches_request` matches only exactly: what ``cleanup(key,
    from_stage, to_stage)`` drops (the reference's 0.32 Transfer Engine form, see
    :func:`cleanup_target`)."""

    __slots__ = ()


def cleanup_target(
    request_id: str, from_stage: str | None, to_stage: str | None, make_key: Callable[..., str]
) -> str:
    """What ``cleanup(request_id, from_stage=None, to_stage=None)`` drops, as the argument the
    connectors' sides take: without stages ``request_id`` (the request rule of
    :func:`matches_request`); with both, exactly the key a ``put(from_stage, to_stage,
    request_id, ...)`` published (an :class:`ExactKey`, made by ``make_key``). Only one of the two
    stages is a ``ValueError``, as in the reference."""
    if (from_stage is None) != (to_stage is None):
        raise ValueError(
            "cleanup() requires both from_stage and to_stage, or neither; got "
            f"from_stage={from_stage!r}, to_stage={to_stage!r}"
        )
    if from_stage is None or to_stage is None:
        return request_id
    return ExactKey(make_key(request_id, from_stage, to_stage))


def matches_request(transport_key: str, request_id: str) -> bool:
    """The ``cleanup(request_id)`` rule of every connector (the reference's).

    True when the key before its ``@from_to`` suffix is the id, starts with ``id_`` or ends with
    ``_id``; for an :class:`ExactKey`, only when the transport key is that key.
    """
    if isinstance(request_id, ExactKey):
        return transport_key == request_id
    base = transport_key.rsplit("@", 1)[0]
    return (
        base == request_id or base.startswith(f"{request_id}_") or base.endswith(f"_{request_id}")
    )


def as_host_bytes(data: Any) -> memoryview | None:
    """A flat byte view of raw data (bytes-like, numpy, tensor, ManagedBuffer); else ``None``.

    Zero-copy for host data; device tensors are copied to host once.
    """
    if isinstance(data, ManagedBuffer):
        data = data.tensor
    if isinstance(data, torch.Tensor):
        t = data.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        return t.contiguous().reshape(-1).view(torch.uint8).numpy().data
    if isinstance(data, np.ndarray):
        return np.ascontiguousarray(data).reshape(-1).view(np.uint8).data
    if isinstance(data, bytes | bytearray | memoryview):
        return memoryview(data).cast("B")
    return None


def _encoded(data: Any) -> memoryview:
    """Raw data as bytes, anything else framed by the one object encoder."""
    if data is None:
        raise ValueError("cannot put None")
    view = as_host_bytes(data)
    if view is None:
        view = memoryview(encode_object(data))
    if view.nbytes == 0:
        raise ValueError("empty payload")
    return view


def as_managed(obj: Any) -> ManagedBuffer:
    """Any ``get`` result object as a :class:`ManagedBuffer` (``wait``'s one shape).

    A ManagedBuffer is returned as is; 1-D ``uint8`` tensors are wrapped without a copy; other
    raw data is viewed (bytes) or copied once; objects are encoded (``encode_object``).
    """
    if isinstance(obj, ManagedBuffer):
        return obj
    if isinstance(obj, torch.Tensor) and obj.dtype == torch.uint8 and obj.dim() == 1:
        return ManagedBuffer(obj.contiguous())
    view = _encoded(obj)
    if view.readonly:
        return ManagedBuffer(torch.frombuffer(bytearray(view), dtype=torch.uint8))
    return ManagedBuffer(torch.frombuffer(view, dtype=torch.uint8))


def get_result(buf: ManagedBuffer) -> GetResult:
    """The reference-shaped ``get`` result for ``buf``: the decoded object for an encoded
    object (``buf`` is released), ``(buf, size)`` otherwise.
    """
    t = buf.tensor
    if t.device.type == "cpu" and is_object(t):
        try:
            return decode_object(t), buf.size
        finally:
            buf.release()
    return buf, buf.size


def notify_incoming(on_incoming: Callable[[int], object] | None, nbytes: int) -> None:
    """Tell a waiter that ``nbytes`` are on their way (a connector with ``reports_incoming``,
    from inside its ``wait``). A failing callback is logged, never raised into the transfer."""
    if on_incoming is None:
        return
    try:
        on_incoming(int(nbytes))
    except Exception:
        logger.exception("on_incoming callback failed")


@dataclass(frozen=True)
class MissReport:
    """Why a wait found nothing, as a transport knows it (:meth:`OmniConnectorBase.explain_miss`).

    ``detail`` is one line for the receive's reason (which senders were seen, what they hold);
    ``peer_gone``: the sender is known to be gone (the receive is then ``peer_gone``, not
    ``timeout``).
    """

    detail: str
    peer_gone: bool = False


class KeyState(str, Enum):
    """Where a payload stands for its receiver, as :meth:`OmniConnectorBase.probe` sees it."""

    #: Nobody offers it (yet): not published, already taken, or dropped.
    MISSING = "missing"
    #: A sender holds it, unclaimed: taking it moves its bytes to this node.
    OFFERED = "offered"
    #: It is in memory this process maps or holds: taking it is local.
    READY = "ready"
    #: The transport cannot tell without taking it, or a peer did not answer in time.
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class KeyProbe:
    """One :meth:`OmniConnectorBase.probe` answer (a snapshot: a take may still miss it)."""

    state: KeyState
    #: The payload's size when ``offered`` or ``ready``, else 0.
    nbytes: int = 0
    #: Why ``unknown`` (one line), else ``None``.
    detail: str | None = None


def _put_packed_via_put(
    self: OmniConnectorBase,
    from_stage: str,
    to_stage: str,
    put_key: str,
    nbytes: int,
    write: Writer,
    *,
    deadline: float,
) -> PutResult:
    """``put_packed`` of a connector that defines only the reference's ``put``: the payload is
    written into a host buffer of its own, then handed to ``put`` as bytes. ``deadline`` is the
    caller's; ``put`` has no deadline of its own to honour it with."""
    buf = torch.empty(nbytes, dtype=torch.uint8)
    write(buf)
    return self.put(from_stage, to_stage, put_key, bytes(buf.numpy()))


class OmniConnectorBase(ABC):
    """Base class of every omnikv transport (see the module docstring for the contract).

    Subclasses implement ``put_packed``, ``get`` and ``close``; the reference-shaped ``put`` is
    written on top of ``put_packed`` here, and the rest have working defaults. Capabilities are
    class attributes read directly, never probed with ``hasattr``.
    """

    #: The table this connector translates its backend's errors with (``None``: no backend of
    #: its own); see :mod:`omnikv.connectors.boundary`.
    error_map: ClassVar[ErrorMap | None] = None
    #: Seconds the reference-shaped ``put`` waits for pool space (0: try once).
    put_timeout_s: float = 0.0
    #: Carries receivers' verdicts back to the sender (:meth:`acknowledge`,
    #: :meth:`set_delivery_listener`); without it a send never gets past ``sent``.
    acknowledges: ClassVar[bool] = False
    #: :meth:`wait` takes the keyword ``on_incoming``: a callable it calls once with the
    #: payload's size when the payload's bytes start to move to this node (a pull granted, an
    #: object found), before they have arrived (see :func:`notify_incoming`).
    reports_incoming: ClassVar[bool] = False
    #: Senders on this connector give payloads a data check unless ``payload_checksum`` says
    #: otherwise: the bytes cross a link between nodes, and hashing them costs a small share of
    #: moving them. Shared memory and in-process connectors leave it off by default (their
    #: receive is a zero-copy view, where the check would be a whole extra pass).
    checks_data: ClassVar[bool] = False
    #: :meth:`wait` takes the keyword ``abort`` (a ``threading.Event``): it looks at it at
    #: least every :data:`ABORT_POLL_S` while nothing has arrived and then returns ``None``
    #: (consuming nothing), while a transfer already granted runs to ``deadline``. A receive
    #: that can be aborted gives such a connector its whole deadline instead of slices (a
    #: slice's deadline would cut a large pull short).
    takes_abort: ClassVar[bool] = False

    def __init__(self) -> None:
        self._closed = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A connector written against the reference defines only ``put``: give it a
        ``put_packed`` on top of that ``put`` (one extra copy) so it instantiates and serves the
        manager unchanged. Connectors of this library implement ``put_packed`` themselves."""
        super().__init_subclass__(**kwargs)
        if "put" in cls.__dict__ and "put_packed" not in cls.__dict__:
            cls.put_packed = _put_packed_via_put  # type: ignore[method-assign]

    # -- required -------------------------------------------------------------------------
    @abstractmethod
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
        """Publish a payload of ``nbytes`` bytes that ``write`` fills in place.

        Called by the sender once per key and request (and by :meth:`put`). ``write`` is called
        exactly once with a contiguous 1-D ``uint8`` tensor of ``nbytes`` bytes; transports with
        pooled memory pass their own space, so the payload is encoded once, straight into the
        memory that travels. Waits for that space until ``deadline``, then raises
        :class:`~omnikv.errors.PoolExhaustedError`. If ``write`` raises, nothing is published
        and the exception propagates. Returns ``(ok, size, metadata)`` as :meth:`put` does;
        transport failures raise :class:`~omnikv.errors.ConnectorError` subclasses.
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

    # -- put: the reference shape on top of put_packed ---------------------------------------
    def put(self, from_stage: str, to_stage: str, put_key: str, data: Any) -> PutResult:
        """Publish ``data`` under ``put_key`` for the edge ``from_stage -> to_stage``.

        Raw data (bytes-like, tensors, arrays) travels as is, anything else framed by
        :func:`omnikv.wire.serializer.encode_object`. One copy into the transport's memory
        (``put_packed``), waiting ``put_timeout_s`` for space. Returns ``(ok, size, metadata)``;
        ``(False, 0, None)`` on any failure (logged).
        """
        try:
            src = _encoded(data)

            def copy(dst: torch.Tensor) -> None:
                dst.numpy()[:] = np.frombuffer(src, dtype=np.uint8)

            deadline = time.monotonic() + self.put_timeout_s
            return self.put_packed(
                from_stage, to_stage, put_key, src.nbytes, copy, deadline=deadline
            )
        except (ConnectorError, ValueError, TypeError) as exc:
            logger.error("%s put of %s failed: %s", type(self).__name__, put_key, exc)
            return False, 0, None

    # -- optional, with defaults ----------------------------------------------------------
    def wait(
        self,
        from_stage: str,
        to_stage: str,
        get_key: str,
        *,
        deadline: float,
        metadata: dict[str, Any] | None = None,
    ) -> ManagedBuffer | None:
        """Block until the payload under ``get_key`` is there or ``deadline`` passes.

        Returns it as a :class:`ManagedBuffer` (see :func:`as_managed`), or ``None`` at the
        deadline without consuming anything. The default polls ``get`` with a fine, bounded
        back-off (0.5 ms doubling to 10 ms), each sleep cut to the time left; notifying
        transports override it.
        """
        for _ in polling(deadline):
            result = self.get(from_stage, to_stage, get_key, metadata)
            if result is not None:
                return as_managed(result[0])
        return None

    def get_with_deadline(
        self,
        from_stage: str,
        to_stage: str,
        get_key: str,
        metadata: dict[str, Any] | None = None,
        *,
        deadline: float,
    ) -> GetResult | None:
        """The reference's deadline-aware receive: ``(payload, size)`` or ``None`` at ``deadline``.

        Called by code written for vllm-omni 0.30+ (its synchronous payload receive), once per
        key with an absolute ``time.monotonic()`` deadline. Built on :meth:`wait`, so every
        connector honours it: it blocks no longer than the deadline (plus one poll step), consumes
        the payload only when it returns one, and hands it over in :meth:`get`'s shape (see
        :func:`get_result`: release a :class:`ManagedBuffer` when done). A deadline already past
        means one non-blocking look. Transport failures raise, as from :meth:`wait`
        (:class:`~omnikv.errors.ConnectorError` subclasses).
        """
        buf = self.wait(from_stage, to_stage, get_key, deadline=deadline, metadata=metadata)
        return None if buf is None else get_result(buf)

    def abandon_get(self, get_key: str) -> None:  # noqa: B027 - optional hook
        """Retire what an unsuccessful receive of ``get_key`` left behind (the reference's hook).

        Called by the receiver after it gave up on a key. Never cancels a transfer that is already
        moving data. Default: nothing to retire, since no omnikv receive leaves a claim behind
        when it returns ``None``.
        """

    def reap_consumed(self, *, max_keys: int = 64) -> None:  # noqa: B027 - optional hook
        """Release the sender's bookkeeping of payloads another process has consumed, looking at
        no more than ``max_keys`` of them per call (the reference's 0.32 bounded sweep; 0.30
        code calls it without arguments).

        Called by a sender whenever it likes (the reference calls it between steps); cheap and
        never raising. Default: nothing to reap (the transport tracks consumption itself).
        """

    def cleanup(self, request_id: str) -> bool | None:
        """Drop anything left unconsumed for ``request_id`` (see :func:`matches_request`).

        A transport that can tell returns whether anything was dropped (the shared-memory
        connector does, as the reference's 0.32 does); the default returns ``None``."""
        return None

    def explain_miss(
        self,
        from_stage: str,
        to_stage: str,
        get_key: str,
        *,
        metadata: dict[str, Any] | None = None,
    ) -> MissReport | None:
        """Why :meth:`wait` for ``get_key`` found nothing by its deadline, as far as known.

        Called by the receiver once per receive that timed out, after that wait returned, with
        the wait's arguments. Takes at most a small bounded time (it may ask peers), consumes
        nothing and never raises. Default: ``None`` (nothing known beyond the timeout).
        """
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
        """Where the payload under ``get_key`` stands, without taking or claiming it.

        Called by a receiver's scheduler (``OmniKVTransferManager.probe_kv_cache``) to order
        its queue before it receives, with the metadata it would give :meth:`wait`. Consumes
        nothing, leases nothing and leaves every sender's state as it was; returns by
        ``deadline`` (a transport that asks its peers waits for their answers at most that
        long: a peer that did not answer makes it ``unknown``); never raises. The answer is
        a snapshot: another receiver may take an ``offered`` payload first. Default:
        ``unknown`` (the transport cannot tell without taking it).
        """
        return KeyProbe(KeyState.UNKNOWN, detail=f"{type(self).__name__} cannot probe")

    def withdraw(self, from_stage: str, to_stage: str, put_key: str) -> bool:
        """Take back the payload this connector published with ``put(from_stage, to_stage,
        put_key, ...)`` while no receiver has taken it: it is offered no more, its memory is
        free again and no verdict is reported for it.

        Called by the transfer edge for the keys nobody took of a send that was refused or
        expired (an early hand-off's tail when its receiver refused a chunk after the finish),
        also on the delivery listener's thread: it never reports a verdict, never waits for
        a peer and never raises. Touches only what this connector published, never another
        process's or connector's keys. True when the payload was removed; False when there
        was none (never published here, taken, expired, removed already) or the transport
        cannot take one key back (the default, and connectors written against the reference).
        """
        return False

    def flush(self, timeout: float | None = None) -> list[str]:
        """Wait up to ``timeout`` seconds for published payloads to be consumed; returns the
        keys still unconsumed. Default: a transport that keeps nothing has nothing to wait for.
        """
        return []

    def acknowledge(  # noqa: B027 - optional hook
        self,
        from_stage: str,
        to_stage: str,
        get_key: str,
        verdict: Verdict,
        reason: str | None = None,
        *,
        metadata: dict[str, Any] | None = None,
    ) -> None:
        """Tell the sender of the payload taken under ``get_key`` what became of it.

        Called by the receiver once per payload it took, after its checks: ``delivered`` or
        ``refused`` (with the reason). ``metadata`` is the one given to that ``wait``. Never
        blocks for long and never raises (a verdict that cannot be carried is logged; the
        sender then learns ``expired`` from its own watch). Default: nothing carries verdicts.
        """

    def set_delivery_listener(self, listener: DeliveryListener | None) -> None:  # noqa: B027
        """Have each payload this connector publishes from now on reported once to ``listener``
        (a :class:`~omnikv.connectors.delivery.DeliveryReport`: delivered, refused or expired).

        Called by the sender's owner (the manager's send path) before it publishes. The listener
        runs on a transport thread: it must be quick and must not call back into the connector.
        Default: nothing is reported (``acknowledges`` is false).
        """

    def health(self) -> dict[str, Any]:
        """Status and counters; cheap and never raising."""
        return {"status": "closed" if self._closed else "healthy", "type": type(self).__name__}

    def update_sender_info(  # noqa: B027 - optional hook
        self, sender_host: str, sender_zmq_port: int, sender_rank: int | None = None
    ) -> None:
        """Set the default sender endpoint (pull transports), or, with ``sender_rank``, the
        endpoint of that sender rank (the reference's 0.32 form; the default stays). Called by
        the manager (``update_sender_info(sender_info)``) and by code written for the
        reference. Default: not needed."""

    def get_connection_info(self) -> dict[str, Any] | None:
        """What a receiver needs to reach this sender (pull transports: ``host``, ``zmq_port``;
        the reference's ``get_connection_info``), for the manager's
        ``get_sender_connection_info``; ``None`` for a transport that has no endpoint to share
        (the default). Cheap and never raising."""
        return None

    @property
    def closed(self) -> bool:
        return self._closed

    @staticmethod
    def serialize_obj(obj: Any) -> bytes:
        """The reference's helper: :meth:`OmniSerializer.serialize`."""
        return OmniSerializer.serialize(obj)

    @staticmethod
    def deserialize_obj(data: bytes | bytearray | memoryview) -> Any:
        """The reference's helper: :meth:`OmniSerializer.deserialize`."""
        return OmniSerializer.deserialize(data)

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
