"""Payload kinds of :mod:`omnikv.connectors.shm.connector`'s reference-shaped ``put``.

``put`` stores bytes-like data as kind ``bytes`` (``get`` returns ``bytes``, as the reference
does), 1-D ``uint8`` tensors / arrays as ``raw`` (``get`` returns a :class:`ManagedBuffer`) and
anything else as kind ``object``: framed by the one object encoder,
:func:`omnikv.wire.serializer.encode_object` (``get`` returns the decoded object). ``wait`` returns
every kind as a :class:`ManagedBuffer` of the stored bytes, so an object comes back as its
encoding, which :func:`omnikv.connectors.base.get_result` decodes like any connector's. Never
pickled.

With ``inline_small_payloads`` a payload whose serialized form (the reference's:
:meth:`~omnikv.wire.serializer.OmniSerializer.serialize`, no frame) is at most
``shm_threshold_bytes`` travels in the put's metadata instead (``{"inline_bytes", "size"}``,
:func:`serialize_small`), and a ``get`` / ``wait`` given that metadata decodes it from there
(:func:`inline_payload`); nothing of it is stored.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from omnikv.connectors.base import Writer
from omnikv.wire.serializer import MAGIC, OmniSerializer, decode_object, encode_object

__all__ = [
    "KINDS",
    "KIND_BYTES",
    "KIND_OBJECT",
    "KIND_RAW",
    "decode",
    "decode_inline",
    "inline_frame",
    "inline_payload",
    "prepare",
    "serialize_small",
]

KIND_RAW = "raw"
KIND_BYTES = "bytes"
KIND_OBJECT = "object"
KINDS = (KIND_RAW, KIND_BYTES, KIND_OBJECT)


def prepare(data: Any, serialized: bytes | None = None) -> tuple[str, int, Writer]:
    """(kind, nbytes, writer) for a reference-shaped ``put``; bytes-like data is copied as is.

    ``serialized``: ``data`` already serialized (by :func:`serialize_small`, too large to go
    inline); it is stored as an object without being encoded again."""
    if data is None:
        raise ValueError("cannot put None")
    src: np.ndarray | torch.Tensor  # type: ignore[type-arg]
    kind = KIND_RAW
    if serialized is not None:
        src = np.frombuffer(MAGIC + serialized, dtype=np.uint8)
        kind = KIND_OBJECT
    elif isinstance(data, bytes | bytearray | memoryview):
        mv = memoryview(data)
        src = np.frombuffer(mv if mv.contiguous else mv.tobytes(), dtype=np.uint8)
        kind = KIND_BYTES
    elif isinstance(data, torch.Tensor) and data.dtype == torch.uint8 and data.dim() == 1:
        src = data.detach().contiguous()
    elif isinstance(data, np.ndarray) and data.dtype == np.uint8 and data.ndim == 1:
        src = np.ascontiguousarray(data)
    else:
        src = np.frombuffer(encode_object(data), dtype=np.uint8)
        kind = KIND_OBJECT
    n = int(src.numel()) if isinstance(src, torch.Tensor) else int(src.size)
    return kind, n, functools.partial(_copy_into, src)


def _copy_into(src: np.ndarray | torch.Tensor, dst: torch.Tensor) -> None:  # type: ignore[type-arg]
    if isinstance(src, torch.Tensor):
        dst.copy_(src)
    elif src.size:
        dst.numpy()[:] = src


def _raw_nbytes(data: Any) -> int | None:
    """The size of bytes-like data, a tensor or an array without encoding it; else ``None``."""
    if isinstance(data, bytes | bytearray | memoryview):
        return memoryview(data).nbytes
    if isinstance(data, torch.Tensor):
        return int(data.numel()) * data.element_size()
    if isinstance(data, np.ndarray):
        return int(data.nbytes)
    return None


def serialize_small(data: Any, limit: int) -> bytes | None:
    """``data`` serialized as the reference does (``OmniSerializer.serialize``), unless its raw
    size alone (bytes-like data, tensors, arrays) exceeds ``limit``: then ``None``, without
    encoding it. Called by the ``put`` of a connector with ``inline_small_payloads``; ``None``
    for ``None`` (which ``prepare`` refuses); ``TypeError`` for what cannot travel."""
    size = _raw_nbytes(data)
    if data is None or (size is not None and size > limit):
        return None
    return OmniSerializer.serialize(data)


def inline_payload(metadata: Any) -> bytes | None:
    """The ``inline_bytes`` of a reference-shaped put's metadata, plain or wrapped as
    ``{key: meta}``; ``None`` when there are none (the payload is in a pool)."""
    if not isinstance(metadata, dict):
        return None
    if "inline_bytes" not in metadata and len(metadata) == 1:
        metadata = next(iter(metadata.values()))
        if not isinstance(metadata, dict):
            return None
    raw = metadata.get("inline_bytes")
    return bytes(raw) if isinstance(raw, bytes | bytearray | memoryview) else None


def inline_frame(raw: bytes) -> np.ndarray:  # type: ignore[type-arg]
    """An inline payload as ``wait`` hands it over: framed like a stored object, so
    :func:`omnikv.connectors.base.get_result` decodes it."""
    return np.frombuffer(bytearray(MAGIC + raw), dtype=np.uint8)  # writable, as a slot is


def decode(kind: str, raw: bytes) -> Any:
    """The ``get`` object of a stored ``bytes`` / ``object`` payload (``DecodeError`` if bad)."""
    return raw if kind == KIND_BYTES else decode_object(raw)


def decode_inline(raw: bytes) -> Any:
    """The ``get`` object of an inline payload (``DecodeError`` if bad)."""
    return OmniSerializer.deserialize(raw)
