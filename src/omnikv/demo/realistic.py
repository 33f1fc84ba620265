"""The demo's realistic transfer: one request's KV of Qwen2.5-7B's shape between the two stages.

28 layers x 4 KV heads x 128 dims, fp16, 4096 tokens = 224 MiB, in a vLLM-style paged cache
(``[2, blocks, 16, 4, 128]`` per layer). Stage 0 gathers and sends it through the manager; stage 1
receives it; the time is taken from stage 0's send call to stage 1 holding the decoded KV
(``time.monotonic`` is one clock for all processes of the machine). A memcpy of the same bytes,
measured in the same run, puts the figure in proportion. Each round's KV is checked by a
per-layer checksum on both sides.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from omnikv.manager import LayerKV, OmniKVTransferManager

__all__ = ["RealisticShape", "checksum", "memcpy_s", "receive_round", "send_round"]

_BLOCK = 16


@dataclass(frozen=True)
class RealisticShape:
    """Qwen2.5-7B's KV shape; ``tokens`` is the prompt length (4096 by default)."""

    tokens: int = 4096
    layers: int = 28
    kv_heads: int = 4
    head_dim: int = 128
    dtype: torch.dtype = torch.float16

    @property
    def blocks(self) -> int:
        return -(-self.tokens // _BLOCK)

    @property
    def nbytes(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.layers * self.tokens * self.kv_heads * self.head_dim * itemsize

    def describe(self) -> str:
        return (
            f"Qwen2.5-7B KV: {self.layers} layers x {self.kv_heads} kv heads x "
            f"{self.head_dim} dims, fp16, {self.tokens} tokens"
        )

    def paged_cache(self, seed: int = 11) -> list[LayerKV]:
        """Per layer ``[2, blocks, 16, kv_heads, head_dim]``: random 16-bit words from ``seed``.

        Random bits, not random numbers: generating them is cheap and the transfer never looks
        at the values (some words are NaN or inf patterns, which is fine for moving bytes).
        """
        g = torch.Generator().manual_seed(seed)
        shape = (2, self.blocks, _BLOCK, self.kv_heads, self.head_dim)
        return [
            torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=g).view(self.dtype)
            for _ in range(self.layers)
        ]


def checksum(layers: list[torch.Tensor]) -> list[int]:
    """One int64 sum of the raw 16-bit words per tensor (cheap, order-independent)."""
    return [int(t.contiguous().view(torch.int16).sum(dtype=torch.int64)) for t in layers]


def sent_checksum(shape: RealisticShape, cache: list[LayerKV]) -> list[int]:
    """The checksum stage 1 must find: K of every layer, then V, first ``tokens`` tokens."""
    flat = [t.flatten(1, 2)[:, : shape.tokens] for t in cache if isinstance(t, torch.Tensor)]
    return checksum([t[0] for t in flat] + [t[1] for t in flat])


def send_round(
    mgr: OmniKVTransferManager, shape: RealisticShape, cache: list[LayerKV], rid: str
) -> tuple[float, str | None]:
    """Send ``rid``; returns ``(monotonic start, failure reason or None)``."""
    t0 = time.monotonic()
    entry = {"block_ids": list(range(shape.blocks)), "seq_len": shape.tokens}
    mgr.handle_finished_requests_kv_transfer({rid: entry}, cache, _BLOCK, "float16")
    res = mgr.get_send_result(rid)
    if res is None or not res.ok:
        return t0, res.reason if res else "no send result"
    return t0, None


def receive_round(mgr: OmniKVTransferManager, rid: str) -> dict[str, Any]:
    """Receive ``rid``; returns the monotonic time it was held, its checksum or an error."""
    data, _ = mgr.receive_kv_cache_for_request(rid)
    t_done = time.monotonic()
    if data is None:
        res = mgr.get_receive_result(rid)
        return {"t_done": t_done, "error": res.reason if res else "no KV"}
    blocks = data["layer_blocks"]
    sums = checksum(list(blocks["key_cache"]) + list(blocks["value_cache"]))
    return {"t_done": t_done, "checksum": sums}


def memcpy_s(nbytes: int, repeats: int = 3) -> float:
    """Median seconds of one host memcpy of ``nbytes`` (warm buffers)."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def summary(
    shape: RealisticShape, seconds: list[float], ok: bool, copy_s: float, where: str
) -> str:
    """The one line the demo prints for the realistic transfer."""
    t = statistics.median(seconds)
    spread = f", {min(seconds) * 1e3:.0f}-{max(seconds) * 1e3:.0f} ms" if len(seconds) > 1 else ""
    return (
        f"realistic transfer, {where}: {shape.nbytes / 2**20:.0f} MiB ({shape.describe()}) in "
        f"{t * 1e3:.0f} ms (median of {len(seconds)}{spread}), {shape.nbytes / t / 1e9:.2f} GB/s "
        f"= {t / copy_s:.1f}x the time of a memcpy of the same bytes in this run "
        f"({copy_s * 1e3:.0f} ms, {shape.nbytes / copy_s / 1e9:.2f} GB/s); "
        f"KV checksums {'match' if ok else 'DIFFER'}"
    )
