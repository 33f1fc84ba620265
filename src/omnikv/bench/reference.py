"""The reference's packed format, re-implemented from its description (reference-behaviour §3).

Used in two places: compatibility tests (what the reference writes we decode, what we write it
decodes) and benchmarks (the reference's ``to_bytes`` shape: every tensor ``tobytes`` and a
``b"".join``, no alignment). Written from the behaviour spec; deliberately simple, not fast.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from typing import Any

import torch

from omnikv.wire.format import DTYPE_ALLOWLIST

__all__ = ["ref_from_bytes", "ref_to_bytes"]


def _tensor_bytes(t: torch.Tensor) -> bytes:
    host = t.detach().contiguous().cpu()
    return host.reshape(-1).view(torch.uint8).numpy().tobytes()


def ref_to_bytes(
    request_id: str,
    key_cache: Sequence[torch.Tensor | None],
    value_cache: Sequence[torch.Tensor | None],
    block_ids: Sequence[int] = (),
    metadata: dict[str, Any] | None = None,
) -> bytes:
    """Pack like the reference: header of descriptors, then every tensor's bytes joined."""
    td: list[dict[str, Any]] = []
    chunks: list[bytes] = []
    offset = 0
    for cache, layers in (("key_cache", key_cache), ("value_cache", value_cache)):
        for i, t in enumerate(layers):
            name = f"{cache}_{i}"
            if t is None:
                td.append({"n": name, "x": True})
                continue
            raw = _tensor_bytes(t)
            td.append(
                {
                    "n": name,
                    "i": i,
                    "d": str(t.dtype).replace("torch.", ""),
                    "s": list(t.shape),
                    "o": offset,
                    "b": len(raw),
                }
            )
            chunks.append(raw)
            offset += len(raw)
    header = json.dumps(
        {
            "rid": request_id,
            "bids": list(block_ids),
            "meta": metadata or {},
            "td": td,
            "nl": len(key_cache),
        },
        separators=(",", ":"),
    ).encode()
    return struct.pack(">I", len(header)) + header + b"".join(chunks)


def ref_from_bytes(raw: bytes | bytearray | memoryview) -> dict[str, Any]:
    """Unpack like the reference's host decoder (views, its checks, its error messages).

    The tensors alias ``raw``; a read-only ``raw`` gives read-only views (torch warns once).
    """
    mv = memoryview(raw)
    if len(mv) < 4:
        raise ValueError("missing 4-byte header length")
    (hlen,) = struct.unpack(">I", mv[:4])
    if hlen > len(mv) - 4:
        raise ValueError(f"header_len={hlen} exceeds buffer size")
    header = json.loads(bytes(mv[4 : 4 + hlen]))
    data = mv[4 + hlen :]
    nl = header["nl"]
    keys: list[torch.Tensor | None] = [None] * nl
    values: list[torch.Tensor | None] = [None] * nl
    for desc in header["td"]:
        if desc.get("x"):
            continue
        dtype = DTYPE_ALLOWLIST.get(desc["d"])  # the reference's whitelist is ours (§3.4)
        if dtype is None:
            raise ValueError(f"Unsupported dtype in KV payload: {desc['d']}")
        o, b = desc["o"], desc["b"]
        if o < 0 or b < 0 or o + b > len(data):
            raise ValueError("tensor span out of range")
        if b == 0:
            t = torch.empty(desc["s"], dtype=dtype)
        else:  # a view over the input buffer, as the reference's host decoder makes
            t = torch.frombuffer(data[o : o + b], dtype=dtype).reshape(desc["s"])
        name = desc["n"]
        idx = desc.get("i")
        if idx is None:
            idx = int(name.rsplit("_", 1)[1])
        if not 0 <= idx < nl:
            raise ValueError("Invalid layer index")
        if name.startswith("key_cache_"):
            keys[idx] = t
        elif name.startswith("value_cache_"):
            values[idx] = t
    return {
        "request_id": header["rid"],
        "layer_blocks": {"key_cache": keys, "value_cache": values},
        "block_ids": header["bids"],
        "metadata": header["meta"],
    }
