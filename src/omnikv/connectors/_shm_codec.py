"""Payload kinds of :mod:`omnikv.connectors.shm`'s reference-shaped ``put``.

``put`` stores bytes-like data as kind ``bytes`` (``get`` returns ``bytes``, as the reference
does), 1-D ``uint8`` tensors / arrays as ``raw`` (``get`` returns a :class:`ManagedBuffer`) and
anything else as kind ``object``: framed by the one object encoder,
:func:`omnikv.serialization.encode_object` (``get`` returns the decoded object). ``wait`` returns
every kind as a :class:`ManagedBuffer` of the stored bytes, so an object comes back as its
encoding, which :func:`omnikv.connectors.base.get_result` decodes like any connector's. Never
pickled.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from omnikv.connectors.base import Writer
from omnikv.serialization import decode_object, encode_object

__all__ = ["KINDS", "KIND_BYTES", "KIND_OBJECT", "KIND_RAW", "decode", "prepare"]

KIND_RAW = "raw"
KIND_BYTES = "bytes"
KIND_OBJECT = "object"
KINDS = (KIND_RAW, KIND_BYTES, KIND_OBJECT)


def prepare(data: Any) -> tuple[str, int, Writer]:
    """(kind, nbytes, writer) for a reference-shaped ``put``; bytes-like data is copied as is."""
    if data is None:
        raise ValueError("cannot put None")
    src: np.ndarray | torch.Tensor  # type: ignore[type-arg]
    kind = KIND_RAW
    if isinstance(data, bytes | bytearray | memoryview):
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


def decode(kind: str, raw: bytes) -> Any:
    """The ``get`` object of a stored ``bytes`` / ``object`` payload (``DecodeError`` if bad)."""
    return raw if kind == KIND_BYTES else decode_object(raw)
