"""Intra-stage message framing: a KV payload dict as ONE uint8 buffer, without pickle.

Used by :mod:`omnikv.ranks.distribution` to move a collected request payload (``past_key_values``
namespaces, metadata dicts, ``sp.*`` CFG fields) from a leader rank to its followers.

Layout of one message (all offsets from the start of the buffer)::

    [4s magic b"OKVD"][u32 BE msgpack length][u64 BE tensor-region offset]
    [msgpack structure][zero padding][tensor region: a packed KV payload]

Every tensor of the payload is written once into the tensor region (the KV payload format of
:mod:`omnikv.wire.format`, tensors listed as ``key_cache_<i>``); a tensor object referenced twice
is stored once. The structure is msgpack with three extension types of our own schema:
``1`` tensor reference (its index), ``2`` ``SimpleNamespace`` (a map of its attributes), ``3``
tuple. Anything else that msgpack cannot write natively is an :class:`EncodeError`; decoding
validates everything and raises :class:`DecodeError`. Decoded tensors are views into the buffer.

Bounds (a message comes from another rank, but is still input): the structure is at most 64 MiB,
nesting at most 32 levels when encoding and 32 nested extensions when decoding (each extension is
unpacked by a nested ``unpackb`` call, so without the bound a 1 KB message could exhaust the C
stack), and the tensor region goes through :func:`omnikv.wire.decode.decode_kv` with all its
checks.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import msgpack
import torch

from omnikv.errors import DecodeError, EncodeError
from omnikv.wire.decode import decode_kv
from omnikv.wire.encode import PackedPayload

__all__ = ["Frame", "decode_frame", "encode_frame"]

MAGIC = b"OKVD"
_FIXED = struct.Struct(">4sIQ")
_EXT_TENSOR = 1
_EXT_NAMESPACE = 2
_EXT_TUPLE = 3
_MAX_DEPTH = 32
_MAX_STRUCT_BYTES = 64 * 1024 * 1024
_PAGE = 4096
_SCALARS = (str, int, float, bool, bytes, type(None))


class _Encoder:
    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self._index: dict[int, int] = {}

    def tensor_ref(self, t: torch.Tensor) -> msgpack.ExtType:
        idx = self._index.get(id(t))
        if idx is None:
            idx = len(self.tensors)
            self.tensors.append(t)
            self._index[id(t)] = idx
        return msgpack.ExtType(_EXT_TENSOR, msgpack.packb(idx))

    def walk(self, obj: Any, where: str, depth: int) -> Any:
        if depth > _MAX_DEPTH:
            raise EncodeError(f"payload nested deeper than {_MAX_DEPTH} at {where}")
        if isinstance(obj, _SCALARS):
            return obj
        if isinstance(obj, torch.Tensor):
            return self.tensor_ref(obj)
        if isinstance(obj, SimpleNamespace):
            inner = {k: self.walk(v, f"{where}.{k}", depth + 1) for k, v in vars(obj).items()}
            return msgpack.ExtType(_EXT_NAMESPACE, _pack(inner, where))
        if isinstance(obj, Mapping):
            out: dict[Any, Any] = {}
            for k, v in obj.items():
                if not isinstance(k, str | int):
                    raise EncodeError(
                        f"map keys must be str or int, got {type(k).__name__} at {where}"
                    )
                out[k] = self.walk(v, f"{where}[{k!r}]", depth + 1)
            return out
        if isinstance(obj, list):
            return [self.walk(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(obj)]
        if isinstance(obj, tuple):
            items = [self.walk(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(obj)]
            return msgpack.ExtType(_EXT_TUPLE, _pack(items, where))
        raise EncodeError(
            f"cannot frame a value of type {type(obj).__name__} at {where} "
            "(tensors, SimpleNamespace, dict, list, tuple and scalars only)"
        )


def _pack(obj: Any, where: str) -> bytes:
    try:
        out = msgpack.packb(obj, use_bin_type=True, strict_types=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise EncodeError(f"cannot encode the structure at {where}: {exc}") from exc
    assert isinstance(out, bytes)
    return out


class Frame:
    """An encoding plan for one message; ``nbytes`` exact, :meth:`pack_into` copies once."""

    def __init__(self, payload: Mapping[str, Any]) -> None:
        enc = _Encoder()
        structure = _pack(enc.walk(dict(payload), "payload", 0), "payload")
        if len(structure) > _MAX_STRUCT_BYTES:
            raise EncodeError(f"payload structure of {len(structure)} bytes is too large")
        self._structure = structure
        self.num_tensors = len(enc.tensors)
        self._packed = PackedPayload("", list(enc.tensors), [], (), None)
        head = _FIXED.size + len(structure)
        align = _PAGE if self._packed.data_nbytes >= _PAGE else 64
        self.region_offset = (head + align - 1) // align * align
        self.nbytes = self.region_offset + self._packed.nbytes

    def pack_into(self, buf: torch.Tensor) -> int:
        """Write the message into the first ``nbytes`` of a 1-D uint8 host tensor."""
        if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() < self.nbytes:
            raise ValueError(f"need a 1-D uint8 tensor of >= {self.nbytes} bytes")
        head = _FIXED.pack(MAGIC, len(self._structure), self.region_offset) + self._structure
        pad = self.region_offset - len(head)
        raw = bytearray(head) + bytes(pad)
        buf[: len(raw)].copy_(torch.frombuffer(raw, dtype=torch.uint8))
        self._packed.pack_into(buf, self.region_offset)
        return self.nbytes


def encode_frame(payload: Mapping[str, Any]) -> Frame:
    """The plan for ``payload``; raises :class:`EncodeError` for what cannot be framed."""
    return Frame(payload)


class _Decoder:
    """msgpack ``ext_hook`` with a depth bound: every extension unpacks its body with a nested
    ``unpackb`` call (C recursion), so nesting is counted and refused past ``_MAX_DEPTH``."""

    def __init__(self, tensors: list[torch.Tensor | None]) -> None:
        self.tensors = tensors
        self.depth = 0

    def unpack(self, data: bytes) -> Any:
        try:
            return msgpack.unpackb(
                data, raw=False, strict_map_key=False, ext_hook=self.ext_hook, use_list=True
            )
        except DecodeError:
            raise
        except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError) as exc:
            raise DecodeError(f"corrupt distribution message: {exc}") from exc

    def ext_hook(self, code: int, data: bytes) -> Any:
        if self.depth >= _MAX_DEPTH:
            raise DecodeError(f"corrupt distribution message: nested deeper than {_MAX_DEPTH}")
        self.depth += 1
        try:
            return self._ext(code, data)
        finally:
            self.depth -= 1

    def _ext(self, code: int, data: bytes) -> Any:
        if code == _EXT_TENSOR:
            idx = msgpack.unpackb(data)
            tensors = self.tensors
            if not isinstance(idx, int) or not 0 <= idx < len(tensors) or tensors[idx] is None:
                raise DecodeError(f"corrupt distribution message: bad tensor reference {idx!r}")
            return tensors[idx]
        if code == _EXT_NAMESPACE:
            attrs = self.unpack(data)
            if not isinstance(attrs, dict) or not all(isinstance(k, str) for k in attrs):
                raise DecodeError("corrupt distribution message: namespace is not a str map")
            return SimpleNamespace(**attrs)
        if code == _EXT_TUPLE:
            items = self.unpack(data)
            if not isinstance(items, list):
                raise DecodeError("corrupt distribution message: tuple is not a list")
            return tuple(items)
        raise DecodeError(f"corrupt distribution message: unknown extension type {code}")


def decode_frame(buf: torch.Tensor) -> dict[str, Any]:
    """Decode a message; the tensors are zero-copy views into ``buf`` (host, 1-D uint8).

    Extensions may nest at most ``_MAX_DEPTH`` deep; anything malformed is a DecodeError.
    """
    if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.device.type != "cpu":
        raise DecodeError("corrupt distribution message: need a 1-D uint8 host tensor")
    total = buf.numel()
    if total < _FIXED.size:
        raise DecodeError(f"corrupt distribution message: {total} bytes, no fixed header")
    raw_head = buf[: _FIXED.size].numpy().tobytes()
    magic, slen, region = _FIXED.unpack(raw_head)
    if magic != MAGIC:
        raise DecodeError(f"corrupt distribution message: magic {magic!r}, expected {MAGIC!r}")
    if slen > _MAX_STRUCT_BYTES or _FIXED.size + slen > region or region > total:
        raise DecodeError(
            f"corrupt distribution message: structure length {slen} / region offset {region} "
            f"do not fit {total} bytes"
        )
    decoder = _Decoder(list(decode_kv(buf[region:]).key_cache))
    out = decoder.unpack(buf[_FIXED.size : _FIXED.size + slen].numpy().tobytes())
    if not isinstance(out, dict):
        raise DecodeError("corrupt distribution message: top level is not a map")
    return out
