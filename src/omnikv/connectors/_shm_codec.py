"""Payload kinds of :mod:`omnikv.connectors.shm` and the object encoder of its ``put``.

``put`` stores bytes-like data as kind ``bytes`` (``get`` returns ``bytes``), 1-D ``uint8``
tensors / arrays as ``raw`` (``get`` returns a :class:`ManagedBuffer`) and anything else msgpack
can encode, tensors included, as ``msgpack`` (``get`` returns the decoded object). ``wait``
returns every kind as a :class:`ManagedBuffer` of the stored bytes. Never pickled.
"""

# merge: switch encode/decode to omnikv.serialization.OmniSerializer once engines lands

from __future__ import annotations

import functools
from typing import Any

import msgpack
import numpy as np
import torch

from omnikv.connectors.base import Writer
from omnikv.errors import ConnectorError

__all__ = ["KIND_BYTES", "KIND_MSGPACK", "KIND_RAW", "decode_object", "prepare"]

KIND_RAW = "raw"
KIND_BYTES = "bytes"
KIND_MSGPACK = "msgpack"
_EXT_TENSOR = 1


def _ext_default(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        from omnikv.payload import DTYPE_ALLOWLIST

        name = str(obj.dtype).replace("torch.", "")
        if name not in DTYPE_ALLOWLIST:
            raise TypeError(f"tensor dtype {obj.dtype} is not allowed")
        host = obj.detach().contiguous().cpu()
        raw = host.reshape(-1).view(torch.uint8).numpy().tobytes()
        inner = msgpack.packb([name, list(host.shape), raw], use_bin_type=True)
        return msgpack.ExtType(_EXT_TENSOR, inner)
    if isinstance(obj, tuple):
        return list(obj)
    raise TypeError(f"cannot encode {type(obj).__name__} for shared memory")


def _ext_hook(code: int, data: bytes) -> Any:
    if code != _EXT_TENSOR:
        raise ValueError(f"unknown msgpack ext type {code}")
    from omnikv.payload import DTYPE_ALLOWLIST

    name, shape, raw = msgpack.unpackb(data, raw=False)
    dtype = DTYPE_ALLOWLIST.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise ValueError(f"tensor dtype {name!r} is not allowed")
    flat = (
        torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        if raw
        else torch.empty(0, dtype=torch.uint8)
    )
    return flat.view(dtype).reshape([int(s) for s in shape])


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
        body = msgpack.packb(data, default=_ext_default, use_bin_type=True)
        src = np.frombuffer(body, dtype=np.uint8)
        kind = KIND_MSGPACK
    n = int(src.numel()) if isinstance(src, torch.Tensor) else int(src.size)
    return kind, n, functools.partial(_copy_into, src)


def _copy_into(src: np.ndarray | torch.Tensor, dst: torch.Tensor) -> None:  # type: ignore[type-arg]
    if isinstance(src, torch.Tensor):
        dst.copy_(src)
    elif src.size:
        dst.numpy()[:] = src


def decode_object(raw: bytes) -> Any:
    """Decode a ``msgpack`` payload; :class:`ConnectorError` if it is not one."""
    try:
        return msgpack.unpackb(raw, raw=False, ext_hook=_ext_hook)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError) as exc:
        raise ConnectorError(f"undecodable msgpack payload: {exc}") from exc
