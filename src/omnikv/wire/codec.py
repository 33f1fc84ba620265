"""An optional lossy KV codec for the wire: 8-bit values with one scale per token and head.

Off by default (``TransferOptions.wire_codec``; the reference format is what travels). With
``"int8"`` or ``"fp8_e4m3"`` every K and V tensor ``[tokens, heads, head_size]`` of a 16- or
32-bit float dtype travels as ``[tokens, heads, head_size + 4]`` bytes: per row (one token of one
head) the ``head_size`` coded values, then the row's scale as a little-endian float32. Half the
bytes of fp16/bf16 (a quarter of fp32), plus 4 bytes per row.

* ``int8``: ``scale = max|x| / 127`` per row, ``q = round(x / scale)`` in ``[-127, 127]``. Error
  bound: ``|x - x'| <= scale / 2 = max|x| / 254`` per element (plus the original dtype's rounding
  of the result).
* ``fp8_e4m3``: ``scale = max|x| / 448`` per row, ``q = float8_e4m3fn(x / scale)``. Error bound:
  ``|x - x'| <= 2**-4 * |x|`` for ``|x| >= 2**-6 * scale``, ``<= 2**-10 * scale`` below (the
  format's subnormal step), plus the original dtype's rounding.

A payload with a codec is format version :data:`CODEC_FORMAT_VERSION` and names the codec and the
original dtype in its header (``cx``, ``od``), so a reader that does not know the codec refuses it
(``unsupported format version``) instead of handing out coded bytes as KV. The receiver decodes
into fresh tensors of the original dtype (no zero-copy views with a codec).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omnikv.errors import DecodeError, EncodeError

__all__ = [
    "CODECS",
    "CODEC_FORMAT_VERSION",
    "SCALE_BYTES",
    "Coded",
    "carrier_dtype",
    "decode_rows",
    "encode_rows",
    "round_trip",
]

#: The codecs a sender may name (``TransferOptions.wire_codec``).
CODECS: tuple[str, ...] = ("int8", "fp8_e4m3")
#: The format version of a payload that carries a codec (plain payloads stay at 1).
CODEC_FORMAT_VERSION = 2
#: Bytes of the per-row scale (float32) after the coded values.
SCALE_BYTES = 4

_MAX = {"int8": 127.0, "fp8_e4m3": 448.0}
_CODED = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
#: The dtype a coded tensor travels as (named in ``td``): bytes that are values and scales.
_CARRIER = {"int8": torch.int8, "fp8_e4m3": torch.uint8}
_CODABLE = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class Coded:
    """How a payload's tensors were coded: ``codec`` (one of :data:`CODECS`) and the dtype name
    a receiver decodes them to (the header's ``cx`` and ``od``, which travel together)."""

    codec: str
    original_dtype: str


def carrier_dtype(codec: str) -> torch.dtype:
    """The dtype a tensor coded with ``codec`` is described as in the payload."""
    return _CARRIER[codec]


def encode_rows(x: torch.Tensor, codec: str) -> torch.Tensor:
    """``x`` (``[..., head_size]``, fp16 / bf16 / fp32) coded as ``[..., head_size + 4]`` of the
    carrier dtype. Called by the sender once per K and V tensor; raises :class:`EncodeError` for
    an unknown codec or a dtype it does not code."""
    if codec not in _MAX:
        raise EncodeError(f"unknown wire codec {codec!r}; expected one of {CODECS}")
    if x.dtype not in _CODABLE:
        raise EncodeError(f"wire codec {codec} codes fp16, bf16 and fp32 KV, not {x.dtype}")
    if x.dim() < 1 or x.shape[-1] < 1:
        raise EncodeError(f"wire codec {codec}: cannot code a tensor of shape {tuple(x.shape)}")
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / _MAX[codec], torch.ones_like(amax))
    scaled = xf / scale
    if codec == "int8":
        coded = scaled.round_().clamp_(-127, 127).to(torch.int8)
    else:
        coded = scaled.to(torch.float8_e4m3fn)
    dim = int(x.shape[-1])
    out = torch.empty((*x.shape[:-1], dim + SCALE_BYTES), dtype=torch.uint8, device=x.device)
    out[..., :dim] = coded.view(torch.uint8)
    out[..., dim:] = scale.contiguous().view(torch.uint8)
    return out.view(_CARRIER[codec])


def decode_rows(coded: torch.Tensor, codec: str, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of :func:`encode_rows`: a fresh ``[..., head_size]`` tensor of ``dtype``.
    Called by the decoder once per tensor; raises :class:`DecodeError` for anything that is not
    a coded tensor of this codec."""
    if codec not in _MAX:
        raise DecodeError(f"corrupt KV payload: unknown wire codec {codec!r}")
    if dtype not in _CODABLE:
        raise DecodeError(f"corrupt KV payload: wire codec {codec} cannot decode to {dtype}")
    if coded.dtype != _CARRIER[codec] or coded.dim() < 1 or coded.shape[-1] <= SCALE_BYTES:
        raise DecodeError(
            f"corrupt KV payload: a {codec} tensor must be [..., head_size + 4] of "
            f"{_CARRIER[codec]}, got {tuple(coded.shape)} {coded.dtype}"
        )
    raw = coded.view(torch.uint8)
    dim = int(raw.shape[-1]) - SCALE_BYTES
    values = raw[..., :dim].contiguous().view(_CODED[codec]).float()
    scale = raw[..., dim:].contiguous().view(torch.float32)
    if not bool(torch.isfinite(scale).all()):
        raise DecodeError(f"corrupt KV payload: {codec} scales that are not finite")
    return (values * scale).to(dtype)


def round_trip(x: torch.Tensor, codec: str) -> torch.Tensor:
    """``x`` as a receiver decodes it after ``codec`` (deterministic on the host): what a MAC over
    coded KV must cover, and what the codec's error is measured on."""
    return decode_rows(encode_rows(x, codec), codec, x.dtype)
