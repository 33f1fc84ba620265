"""The KV payload format: its constants, dtype tables, header structs and checksum.

Packed layout (byte-compatible with the reference packed format):

1. 4 bytes: header length ``N``, unsigned 32-bit big-endian (:data:`HEADER_LENGTH`);
2. ``N`` bytes: a UTF-8 JSON object ``{"rid", "bids", "meta", "td", "nl", ...}`` (:class:`Header`);
3. the data section: raw tensor bytes, native (little-endian) element order, at the offsets the
   ``td`` descriptors give (relative to the start of the data section).

``td`` lists all ``key_cache`` layers 0..L-1, then all ``value_cache`` layers; an absent layer is
``{"n": "key_cache_3", "x": true}``, a present one ``{"n", "i", "d", "s", "o", "b"}`` (name, layer,
dtype name, shape, offset, byte length) (:class:`TensorDesc`).

omnikv's extensions are extra header keys an old reader ignores: ``v`` (format version), ``al``
(the alignment the writer used), ``bo`` (byte order), ``dl`` (data section length), ``ss`` (the
sender's :class:`Stamp`), ``sm`` (a piece of a streamed send, :class:`StreamMark`; format
version :data:`STREAM_FORMAT_VERSION`) and ``dc``, the data check: ``"xxh3:%032x"``, the
128-bit XXH3 hash of the data section (:func:`data_check`), written by default and verified by
every omnikv reader (``payload_checksum: false`` leaves it out). Older omnikv writers wrote
``ck`` (``"crc32:%08x"``, :func:`crc32`) when asked; readers still verify it. The JSON is
padded with trailing spaces so the data section starts on an :data:`ALIGN` boundary
(:data:`PAGE` when a tensor is large), and every tensor starts on an :data:`ALIGN` boundary
(:data:`PAGE` for tensors of :data:`LARGE_TENSOR_BYTES` and more); the gaps are zero.

This module holds what both directions agree on and nothing that moves bytes:
:mod:`omnikv.wire.encode` writes the format, :mod:`omnikv.wire.decode` checks and reads it,
:mod:`omnikv.wire.views` turns its spans into tensors. Dtypes travel by name, and only the names
in :data:`DTYPE_ALLOWLIST` exist, so decoding never looks a name up on ``torch``.
"""

from __future__ import annotations

import json
import struct
import zlib
from typing import Annotated, Any, Literal, NamedTuple

import msgspec
import numpy as np
import torch
import xxhash

from omnikv.errors import EncodeError
from omnikv.wire.mac import PayloadSeal

__all__ = [
    "ALIGN",
    "BITS_NP",
    "BITS_TORCH",
    "CACHES",
    "CHECKSUM_PLACEHOLDER",
    "CHECKSUM_PREFIX",
    "DATA_CHECK_PLACEHOLDER",
    "DATA_CHECK_PREFIX",
    "DEFAULT_MAX_HEADER_BYTES",
    "DTYPE_ALLOWLIST",
    "DTYPE_TO_NAME",
    "FORMAT_VERSION",
    "HEADER_DECODER",
    "HEADER_LENGTH",
    "ITEMSIZE",
    "LARGE_TENSOR_BYTES",
    "MAX_DIMS",
    "MAX_ELEMENTS",
    "MAX_INSTANCE_CHARS",
    "MAX_LAYERS",
    "MAX_SESSION_CHARS",
    "MAX_STREAM_CHUNKS",
    "NUMPY_OF",
    "PAGE",
    "STREAM_FORMAT_VERSION",
    "Header",
    "Span",
    "Stamp",
    "StreamMark",
    "TensorDesc",
    "crc32",
    "data_check",
    "data_hasher",
    "encode_header",
    "host_bytes",
]

FORMAT_VERSION = 1
#: The format version of a piece of a streamed send (header ``sm``). A reader that does not
#: know it refuses the payload, so a stream's tail is never mistaken for a whole request's KV.
STREAM_FORMAT_VERSION = 3
#: Most chunks one streamed send may have (a manifest claiming more is refused unread).
MAX_STREAM_CHUNKS = 4096
ALIGN = 64
PAGE = 4096
LARGE_TENSOR_BYTES = 256 * 1024
#: Largest JSON header a decoder accepts unless told otherwise (and the most an encoder writes).
DEFAULT_MAX_HEADER_BYTES = 1 << 20
#: Most layers a payload may claim (the largest open models have fewer than 200).
MAX_LAYERS = 1024
MAX_DIMS = 8
#: Most elements one tensor may claim, counting zero dims as 1 (torch sizes are int64).
MAX_ELEMENTS = 1 << 48
#: The 4-byte big-endian length in front of the JSON header.
HEADER_LENGTH = struct.Struct(">I")
CHECKSUM_PREFIX = "crc32:"
#: What an encoder writes as ``ck`` before the data is there; replaced in place (same length).
CHECKSUM_PLACEHOLDER = CHECKSUM_PREFIX + "00000000"
#: The data check (header ``dc``): XXH3's 128-bit hash of the data section, 32 lowercase hex.
DATA_CHECK_PREFIX = "xxh3:"
#: What an encoder writes as ``dc`` before the data is there; replaced in place (same length).
DATA_CHECK_PLACEHOLDER = DATA_CHECK_PREFIX + "0" * 32

_DTYPE_NAMES = (
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "float16",
    "float32",
    "float64",
    "bfloat16",
    "complex64",
    "complex128",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
)
#: dtype name (as written in ``td[].d``) -> torch dtype, for the names this torch has.
DTYPE_ALLOWLIST: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in _DTYPE_NAMES
    if isinstance(getattr(torch, name, None), torch.dtype)
}
#: torch dtype -> its name in ``td[].d`` (the inverse of :data:`DTYPE_ALLOWLIST`).
DTYPE_TO_NAME: dict[torch.dtype, str] = {v: k for k, v in DTYPE_ALLOWLIST.items()}
#: dtype name -> bytes per element.
ITEMSIZE: dict[str, int] = {
    name: torch.empty((), dtype=dt).element_size() for name, dt in DTYPE_ALLOWLIST.items()
}
#: The two caches of a payload, in ``td`` order (``key_cache_*`` first).
CACHES = ("key_cache", "value_cache")
#: numpy's type of each allowed dtype that numpy has (bf16 and fp8 have none: viewed as bits).
NUMPY_OF: dict[str, type[np.generic]] = {
    name: getattr(np, "bool_" if name == "bool" else name)
    for name in DTYPE_ALLOWLIST
    if name in ("bool", "uint8", "int8", "int16", "int32", "int64")
    or name in ("float16", "float32", "float64", "complex64", "complex128")
}
#: Same-size integer types by element size: a host tensor of any allowed dtype is copied as
#: these bits, and a dtype numpy lacks is viewed through them.
BITS_NP: dict[int, type[np.generic]] = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}
BITS_TORCH: dict[int, torch.dtype] = {
    1: torch.uint8,
    2: torch.int16,
    4: torch.int32,
    8: torch.int64,
}


# --------------------------------------------------------------------------------------------
# The header
# --------------------------------------------------------------------------------------------
def _json_default(obj: Any) -> Any:
    if isinstance(obj, PayloadSeal):  # the encoder writes the MAC in its placeholder's place
        return obj.placeholder
    if isinstance(obj, torch.Tensor):
        if obj.numel() > 4096:
            raise TypeError("tensors of more than 4096 elements do not belong in metadata")
        return obj.detach().cpu().tolist()
    if isinstance(obj, np.ndarray | np.generic):
        return obj.tolist()
    if isinstance(obj, set | frozenset):
        return sorted(obj)
    raise TypeError(f"object of type {type(obj).__name__} is not JSON serializable")


_HEADER_ENCODER = msgspec.json.Encoder(enc_hook=_json_default)


def encode_header(header: dict[str, Any] | list[Any]) -> bytes:
    """Compact UTF-8 JSON of a payload header (or of its ``td`` list), for the encoder.

    msgspec first (several times faster than ``json``); what it cannot encode (object keys of
    odd types, such as booleans) goes through ``json``, which writes them as strings. Small
    tensors, numpy values and sets in metadata become lists. Raises :class:`EncodeError` for
    anything else.
    """
    try:
        return _HEADER_ENCODER.encode(header)
    except (TypeError, ValueError, msgspec.EncodeError):
        pass
    try:
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False, default=_json_default)
    except (TypeError, ValueError) as exc:
        raise EncodeError(f"KV payload metadata is not JSON-serialisable: {exc}") from exc
    return text.encode("utf-8")


class TensorDesc(msgspec.Struct, frozen=True, gc=False):
    """One ``td`` entry as written; :mod:`omnikv.wire.decode` checks its fields. Frozen and
    hashable (``s`` is a tuple), so validated descriptors can be remembered."""

    n: str
    x: bool = False
    i: int | None = None
    d: str | None = None
    s: tuple[int, ...] | None = None
    o: int | None = None
    b: int | None = None


#: Longest ``instance_id`` a sender names (config) and a header may carry.
MAX_INSTANCE_CHARS = 128
#: Longest session id a header may carry.
MAX_SESSION_CHARS = 64


class Stamp(msgspec.Struct, frozen=True, gc=False):
    """Who sent a payload, and which one it is (header key ``ss``; see
    :mod:`omnikv.transfer.sessions`): ``s`` the sender's session (random per sender), ``e`` its
    epoch (its start time in ns: a restarted sender has a larger one), ``q`` the payload's
    sequence number in that session, ``i`` the configured ``instance_id`` (or absent)."""

    s: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_SESSION_CHARS)]
    e: Annotated[int, msgspec.Meta(ge=0)]
    q: Annotated[int, msgspec.Meta(ge=0)]
    i: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_INSTANCE_CHARS)] | None = None


class StreamMark(msgspec.Struct, frozen=True, gc=False):
    """Which piece of a streamed send a payload is (header key ``sm``; see
    :mod:`omnikv.transfer.stream`). ``k`` is ``"chunk"`` (a run of full blocks shipped during
    decode, under ``<key>#c<n>``) or ``"tail"`` (the last tokens and the request's metadata,
    under the request's key: the manifest). ``id`` names the stream; ``n`` is a chunk's index,
    or the tail's chunk count; ``r`` holds token ranges ``[start, stop)``: a chunk's own (one),
    the tail's one per chunk, in order.

    A stream shipped layer by layer (its chunks hold *layer groups*) also has ``lc``, the
    stream's layer count, and ``l``, layer spans ``[first, stop)`` matching ``r``: a chunk's
    own (one), the tail's one per chunk. Without them every chunk holds every layer."""

    k: Literal["chunk", "tail"]
    id: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_SESSION_CHARS)]
    n: Annotated[int, msgspec.Meta(ge=0, le=MAX_STREAM_CHUNKS)]
    r: Annotated[
        list[tuple[Annotated[int, msgspec.Meta(ge=0)], Annotated[int, msgspec.Meta(ge=0)]]],
        msgspec.Meta(max_length=MAX_STREAM_CHUNKS),
    ]
    l: (  # noqa: E741 - the header's one-letter keys
        Annotated[
            list[
                tuple[
                    Annotated[int, msgspec.Meta(ge=0, le=MAX_LAYERS)],
                    Annotated[int, msgspec.Meta(ge=0, le=MAX_LAYERS)],
                ]
            ],
            msgspec.Meta(max_length=MAX_STREAM_CHUNKS),
        ]
        | None
    ) = None
    lc: Annotated[int, msgspec.Meta(ge=1, le=MAX_LAYERS)] | None = None


class Header(msgspec.Struct, frozen=True, gc=False):
    """The JSON header: the reference's keys plus omnikv's optional extensions."""

    rid: str
    bids: list[int]
    meta: dict[str, Any]
    td: list[TensorDesc]
    nl: int
    v: int = FORMAT_VERSION
    al: int | None = None
    bo: str = "little"
    dl: int | None = None
    #: the data check written by older omnikv writers when asked (``crc32:%08x``)
    ck: str | None = None
    #: the data check (``xxh3:%032x`` of the data section); written by default
    dc: str | None = None
    #: the wire codec (:mod:`omnikv.wire.codec`) and the dtype it decodes to; format version 2
    cx: str | None = None
    od: str | None = None
    #: the sender's stamp (session, epoch, sequence, instance): duplicates and stale epochs
    ss: Stamp | None = None
    #: a piece of a streamed send (format version 3): a chunk, or the tail with its manifest
    sm: StreamMark | None = None


#: Typed decoder of :class:`Header`: a wrong type anywhere is a ``msgspec.ValidationError``
#: naming its path; :func:`omnikv.wire.decode.decode_kv` reports it as a ``DecodeError``.
HEADER_DECODER = msgspec.json.Decoder(Header)


class Span(NamedTuple):
    """A validated tensor descriptor: where one tensor's bytes are in the data section and
    what they are. Made by :mod:`omnikv.wire.decode`, viewed by :mod:`omnikv.wire.views`."""

    pos: int  # its index in ``td``, for messages
    cache: int  # 0: key_cache, 1: value_cache
    layer: int
    dtype_name: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def host_bytes(data: torch.Tensor | np.ndarray) -> memoryview:
    """The bytes of a contiguous 1-D ``uint8`` data section as a ``memoryview`` (a device
    tensor is copied to host first), for the checks below."""
    if isinstance(data, np.ndarray):
        return data.data
    host = data if data.device.type == "cpu" else data.cpu()
    return host.numpy().data


def crc32(data: torch.Tensor | np.ndarray) -> int:
    """The ``ck`` checksum of a data section (host or device; a device one is copied to host),
    as older omnikv writers wrote it when asked; :mod:`omnikv.wire.decode` still verifies it.
    It detects corruption, not tampering."""
    if not isinstance(data, np.ndarray) and data.numel() == 0:
        return 0
    return zlib.crc32(host_bytes(data)) & 0xFFFFFFFF


def data_hasher() -> Any:
    """A fresh streaming hasher of the data check (``update(bytes-like)``, ``hexdigest()``):
    :meth:`omnikv.wire.encode.PackedPayload.pack_into` feeds it each tensor's bytes right
    after writing them, while they are still in the CPU's caches."""
    return xxhash.xxh3_128()


def data_check(data: torch.Tensor | np.ndarray) -> str:
    """The ``dc`` value of a data section (host or device; a device one is copied to host):
    ``"xxh3:"`` and XXH3's 128-bit hash in 32 hex digits. One pass over the data at several
    times memcpy's speed (``omnikv bench codec``); it detects corruption, not tampering (the
    vLLM connector's MAC does that, :func:`omnikv.integrations.vllm.binding.kv_mac`)."""
    h = data_hasher()
    h.update(host_bytes(data))
    return DATA_CHECK_PREFIX + str(h.hexdigest())
