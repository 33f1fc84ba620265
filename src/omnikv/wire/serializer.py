"""The one object encoder: :class:`OmniSerializer` (msgpack, no pickle) and the connectors' framing.

``OmniSerializer`` keeps the reference's name and calling convention
(``OmniSerializer.serialize(obj) -> bytes``, ``OmniSerializer.deserialize(data) -> obj``) and
encodes what a pipeline hands a connector: maps, lists, scalars, ``bytes``, torch tensors (any
layout, non-contiguous included: a host copy of the values), numpy arrays, dataclasses (as maps)
and slices. Tensors and arrays travel as msgpack extension types holding ``[dtype name, shape,
raw bytes]``; the dtype must be in the KV wire format's allowlist
(:data:`omnikv.wire.format.DTYPE_ALLOWLIST`), so no name is ever looked up on ``torch``. Anything
else raises ``TypeError``; malformed input raises :class:`~omnikv.errors.DecodeError` before
anything proportional to a claimed size is allocated (every claimed size must equal the bytes
actually present).

Decoding is bounded by the input (hostile bytes must not amplify): msgpack's length limits are
the input's size, and an object may decode to at most :func:`object_budget` units of work,
``OBJECT_BUDGET_BASE + len(data) // OBJECT_BUDGET_BYTES_PER_UNIT`` (8,192 + one per 512 bytes),
where every array and map costs one unit, a slice one and a tensor or numpy array
``EXT_UNITS`` (16: building one costs about as much as sixteen lists). Past the budget decoding
stops with a ``DecodeError`` naming it, after at most that much work: 16 MB of empty lists are
refused after about 41,000 lists instead of building 16 million. Every exception raised while
decoding (msgpack's, torch's, numpy's) reaches the caller as a ``DecodeError``. The cyclic
garbage collector is paused while an object is decoded (msgpack's own advice: what it builds
is a tree, so there is nothing to collect, and a full collection in a process that imported
torch costs more than the decode itself); it runs again as soon as no decode is running.

Connectors that carry objects next to raw KV payloads frame them with :func:`encode_object`
(``MAGIC + serialize(obj)``); :func:`is_object` tells the two apart without decoding. The magic's
first four bytes read as a big-endian header length of about 4.28 GB, far above the KV format's
header limit, so a KV payload is never mistaken for an object and vice versa.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import threading
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
import torch

from omnikv.errors import DecodeError
from omnikv.wire.format import DTYPE_ALLOWLIST, DTYPE_TO_NAME, ITEMSIZE

__all__ = [
    "EXT_UNITS",
    "MAGIC",
    "OBJECT_BUDGET_BASE",
    "OBJECT_BUDGET_BYTES_PER_UNIT",
    "OmniSerializer",
    "decode_object",
    "encode_object",
    "is_object",
    "object_budget",
]

MAGIC = b"\xffOMKVMP1"
_EXT_TENSOR = 1
_EXT_NDARRAY = 2
_EXT_SLICE = 3
_MAX_DIMS = 8
#: The decode budget (see the module docstring): a floor, and one unit per this many input bytes.
OBJECT_BUDGET_BASE = 8192
OBJECT_BUDGET_BYTES_PER_UNIT = 512
#: Units a tensor or numpy array extension costs (an array or map costs one).
EXT_UNITS = 16
#: numpy dtypes accepted for arrays: the allowlist's names that numpy knows.
_NUMPY_NAMES = frozenset(name for name in DTYPE_ALLOWLIST if hasattr(np, name))


def _tensor_ext(t: torch.Tensor) -> msgpack.ExtType:
    name = DTYPE_TO_NAME.get(t.dtype)
    if name is None:
        raise TypeError(f"tensor dtype {t.dtype} is not in the allowlist")
    host = t.detach().to("cpu").contiguous()
    raw = host.reshape(-1).view(torch.uint8).numpy().tobytes() if host.numel() else b""
    body = msgpack.packb([name, list(host.shape), raw], use_bin_type=True)
    return msgpack.ExtType(_EXT_TENSOR, body)


def _ndarray_ext(a: np.ndarray) -> msgpack.ExtType:  # type: ignore[type-arg]
    name = a.dtype.name
    if name not in _NUMPY_NAMES or a.dtype.byteorder == ">":
        raise TypeError(f"numpy dtype {a.dtype} is not in the allowlist")
    body = msgpack.packb(
        [name, list(a.shape), np.ascontiguousarray(a).tobytes()], use_bin_type=True
    )
    return msgpack.ExtType(_EXT_NDARRAY, body)


def _default(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return _tensor_ext(obj)
    if isinstance(obj, np.ndarray):
        return _ndarray_ext(obj)
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, slice):
        return msgpack.ExtType(
            _EXT_SLICE, msgpack.packb([obj.start, obj.stop, obj.step], use_bin_type=True)
        )
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    raise TypeError(f"cannot serialize {type(obj).__name__} (no pickle)")


def _array_parts(
    data: bytes, allowed: frozenset[str] | dict[str, Any]
) -> tuple[str, list[int], bytes]:
    try:
        parts = msgpack.unpackb(data, raw=False, max_ext_len=0, max_array_len=_MAX_DIMS + 3)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise DecodeError(f"malformed array extension: {exc}") from exc
    if not (isinstance(parts, list) and len(parts) == 3):
        raise DecodeError("array extension must be [dtype, shape, bytes]")
    name, shape, raw = parts
    if not isinstance(name, str) or name not in allowed:
        raise DecodeError(f"expected a dtype in the allowlist, got {name!r}")
    if (
        not isinstance(shape, list)
        or len(shape) > _MAX_DIMS
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
    ):
        raise DecodeError(f"array shape must be at most {_MAX_DIMS} sizes >= 0, got {shape!r}")
    if not isinstance(raw, bytes):
        raise DecodeError("array data must be bytes")
    return name, shape, raw


def _check_size(name: str, shape: list[int], itemsize: int, raw: bytes) -> None:
    count = math.prod(shape)
    if count * itemsize != len(raw):
        raise DecodeError(
            f"array of {name}{shape} needs {count * itemsize} bytes, found {len(raw)}"
        )


def _tensor_from(data: bytes) -> torch.Tensor:
    name, shape, raw = _array_parts(data, DTYPE_ALLOWLIST)
    dtype = DTYPE_ALLOWLIST[name]
    _check_size(name, shape, ITEMSIZE[name], raw)
    if not raw:
        return torch.empty(shape, dtype=dtype)
    # one copy, into memory the tensor owns (``bytes`` are immutable)
    return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape)


def _ndarray_from(data: bytes) -> np.ndarray:  # type: ignore[type-arg]
    name, shape, raw = _array_parts(data, _NUMPY_NAMES)
    dtype = np.dtype(name)
    _check_size(name, shape, dtype.itemsize, raw)
    out: np.ndarray = np.frombuffer(raw, dtype=dtype).reshape(shape).copy()  # type: ignore[type-arg]
    return out


def _slice_from(data: bytes) -> slice:
    try:
        parts = msgpack.unpackb(data, raw=False, max_ext_len=0, max_array_len=3)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise DecodeError(f"malformed slice extension: {exc}") from exc
    if not (isinstance(parts, list) and len(parts) == 3) or not all(
        p is None or (isinstance(p, int) and not isinstance(p, bool)) for p in parts
    ):
        raise DecodeError("slice extension must be [start, stop, step] of ints or nil")
    return slice(*parts)


_gc_lock = threading.Lock()
_gc_decoders = 0
_gc_was_enabled = False


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic GC while at least one decode runs (the first one in pauses it, the last
    one out restores what it found)."""
    global _gc_decoders, _gc_was_enabled
    with _gc_lock:
        if _gc_decoders == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_decoders += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_decoders -= 1
            if _gc_decoders == 0 and _gc_was_enabled:
                gc.enable()


def object_budget(nbytes: int) -> int:
    """Units of decoding work an input of ``nbytes`` may cost (see the module docstring)."""
    return OBJECT_BUDGET_BASE + max(0, nbytes) // OBJECT_BUDGET_BYTES_PER_UNIT


class _Budget:
    """The hooks of one decode: count the containers and extensions built, refuse past the
    budget. One per :meth:`OmniSerializer.deserialize` call (never shared between threads)."""

    __slots__ = ("left", "total")

    def __init__(self, nbytes: int) -> None:
        self.total = self.left = object_budget(nbytes)

    def _spend(self, units: int) -> None:
        self.left -= units
        if self.left < 0:
            raise DecodeError(
                f"object exceeds its decode budget of {self.total} units "
                f"(containers and tensors allowed for its size)"
            )

    def container(self, obj: Any) -> Any:
        self._spend(1)
        return obj

    def ext(self, code: int, data: bytes) -> Any:
        if code == _EXT_TENSOR:
            self._spend(EXT_UNITS)
            return _tensor_from(data)
        if code == _EXT_NDARRAY:
            self._spend(EXT_UNITS)
            return _ndarray_from(data)
        if code == _EXT_SLICE:
            self._spend(1)
            return _slice_from(data)
        raise DecodeError(f"unknown msgpack extension type {code}")


class OmniSerializer:
    """msgpack encoding of pipeline objects (tensors and numpy arrays included); no pickle."""

    @staticmethod
    def serialize(obj: Any) -> bytes:
        """Encode ``obj``; ``TypeError`` for what cannot travel (e.g. ``SimpleNamespace``)."""
        packed: bytes = msgpack.packb(obj, default=_default, use_bin_type=True)
        return packed

    @staticmethod
    def deserialize(data: bytes | bytearray | memoryview) -> Any:
        """Decode what :meth:`serialize` wrote (called by the connectors' object gets).

        Raises ``DecodeError`` for malformed input, for input past its decode budget
        (:func:`object_budget`) and for any other exception raised while decoding; the work done
        before a refusal is bounded by that budget.
        """
        nbytes = memoryview(data).nbytes
        budget = _Budget(nbytes)
        try:
            with _gc_paused():
                return _unpack(data, nbytes, budget)
        except DecodeError:
            raise
        except Exception as exc:  # torch, numpy and msgpack alike: the input is at fault
            raise DecodeError(f"malformed serialized object: {type(exc).__name__}: {exc}") from exc


def _unpack(data: bytes | bytearray | memoryview, nbytes: int, budget: _Budget) -> Any:
    """msgpack with every length limit at the input's size and ``budget``'s hooks."""
    return msgpack.unpackb(
        data,
        raw=False,
        ext_hook=budget.ext,
        list_hook=budget.container,
        object_hook=budget.container,
        strict_map_key=False,
        use_list=True,
        max_str_len=nbytes,
        max_bin_len=nbytes,
        max_array_len=nbytes,
        max_map_len=nbytes,
        max_ext_len=nbytes,
    )


def encode_object(obj: Any) -> bytes:
    """``MAGIC + OmniSerializer.serialize(obj)``: an object as connectors carry it."""
    return MAGIC + OmniSerializer.serialize(obj)


def is_object(data: bytes | bytearray | memoryview | torch.Tensor) -> bool:
    """Whether ``data`` (bytes or a 1-D ``uint8`` host tensor) starts with :data:`MAGIC`."""
    if isinstance(data, torch.Tensor):
        if data.numel() < len(MAGIC) or data.device.type != "cpu":
            return False
        return bytes(data[: len(MAGIC)].numpy()) == MAGIC
    return bytes(memoryview(data)[: len(MAGIC)]) == MAGIC


def decode_object(data: bytes | bytearray | memoryview | torch.Tensor) -> Any:
    """The object framed by :func:`encode_object`; ``DecodeError`` when it is not one."""
    if not is_object(data):
        raise DecodeError("not an encoded object (magic missing)")
    if isinstance(data, torch.Tensor):
        data = data.numpy().data
    return OmniSerializer.deserialize(memoryview(data)[len(MAGIC) :])
