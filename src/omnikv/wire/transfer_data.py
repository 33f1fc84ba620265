"""The seed's :class:`KVCacheTransferData`: one request's KV cache as the seed API hands it over.

A plain dataclass with the reference's fields and methods (``to_bytes``, ``from_bytes``,
``from_bytes_device`` and its old alias ``from_bytes_gpu``, ...), so code written against the
reference runs unchanged; encoding goes through :class:`~omnikv.wire.encode.PackedPayload`
(``pack_into`` writes into a caller's buffer with one copy of each tensor, ``to_bytes`` returns
``bytes``) and decoding through :func:`~omnikv.wire.decode.decode_kv`. Exported by
:mod:`omnikv`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from omnikv.wire.decode import decode_device, decode_kv
from omnikv.wire.encode import PackedPayload
from omnikv.wire.format import CACHES

__all__ = ["KVCacheTransferData"]


@dataclass
class KVCacheTransferData:
    """Container for KV cache transfer data.

    ``layer_blocks`` holds ``{"key_cache": [...], "value_cache": [...]}``, one tensor (or None)
    per layer, each ``[seq_len, heads, head_dim]``; ``metadata`` must be JSON-serialisable for the
    packed format (tuples become lists; small tensors and numpy values become lists).
    """

    request_id: str
    layer_blocks: dict[str, Any]
    block_ids: list[int] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """A plain dict with the same tensors (no deep copy of tensor data)."""
        return {
            "request_id": self.request_id,
            "layer_blocks": {k: list(v) for k, v in self.layer_blocks.items()},
            "block_ids": list(self.block_ids),
            "metadata": dict(self.metadata),
        }

    def _caches(self) -> tuple[list[Any], list[Any]]:
        keys = list(self.layer_blocks.get("key_cache") or [])
        values = list(self.layer_blocks.get("value_cache") or [])
        if len(values) < len(keys):
            values += [None] * (len(keys) - len(values))
        return keys, values[: max(len(keys), len(values))]

    def plan(self, *, checksum: bool = True) -> PackedPayload:
        """The encoding plan (header and offsets) for this payload; ``checksum`` (default)
        gives it the data check (header ``dc``) that readers verify."""
        keys, values = self._caches()
        return PackedPayload(
            self.request_id, keys, values, self.block_ids, self.metadata, checksum=checksum
        )

    def packed_size(self, *, checksum: bool = True) -> int:
        """Exact number of bytes :meth:`pack_into` writes."""
        return self.plan(checksum=checksum).nbytes

    def pack_into(self, buf: Any, offset: int = 0, *, checksum: bool = True) -> int:
        """Encode into ``buf`` (1-D uint8 tensor or writable buffer) at ``offset``; one copy."""
        return self.plan(checksum=checksum).pack_into(buf, offset)

    def to_bytes(self, *, checksum: bool = True) -> bytes:
        """The packed format as ``bytes``."""
        return self.plan(checksum=checksum).to_bytes()

    def to_gpu_tensor(self) -> torch.Tensor:
        """The packed format as a 1-D uint8 tensor on the device of the first device tensor.

        Raises ``RuntimeError`` when no tensor lives on a device (use :meth:`to_bytes`). The
        payload carries no data check: hashing device memory would copy it all to host.
        """
        device = None
        for t in _iter_tensors(self.layer_blocks):
            if t.device.type != "cpu":
                device = t.device
                break
        if device is None:
            raise RuntimeError("No device tensors found, use to_bytes() instead")
        plan = self.plan(checksum=False)
        out = torch.empty(plan.nbytes, dtype=torch.uint8, device=device)
        plan.pack_into(out)
        return out

    @staticmethod
    def from_bytes(raw: Any) -> dict[str, Any]:
        """Reconstruct KV cache data from the packed bytes format (zero-copy views)."""
        return decode_kv(raw).to_seed_dict()

    @staticmethod
    def from_bytes_device(t: torch.Tensor) -> dict[str, Any]:
        """Reconstruct KV cache data from a packed device tensor (tensors are fresh copies)."""
        return decode_device(t, copy=True)

    @staticmethod
    def from_bytes_gpu(t: torch.Tensor) -> dict[str, Any]:
        """Compatibility alias for callers using the old GPU-specific name."""
        return decode_device(t, copy=True)


def _iter_tensors(layer_blocks: Mapping[str, Any]) -> Iterator[torch.Tensor]:
    for cache in CACHES:
        for t in layer_blocks.get(cache) or []:
            if isinstance(t, torch.Tensor):
                yield t
