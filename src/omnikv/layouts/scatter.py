"""Writing received tokens back into a paged cache: the inverse of a gather."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from omnikv.errors import ExtractionError, KVMismatchError
from omnikv.layouts.gather import block_runs

__all__ = ["scatter_tokens"]

#: Whole blocks whose ids run in at most this many runs of consecutive ids are written one
#: slice copy per run; more fragmented ones in one ``index_copy_`` (which costs about as much
#: as a copy per block, and copies element by element even where rows are contiguous).
MAX_RUN_COPIES = 8


def _check_scatter_fit(blocks: torch.Tensor, src: torch.Tensor) -> None:
    """``KVMismatchError`` unless ``src`` is ``[n, *tail]`` tokens of ``blocks``' dtype."""
    if blocks.dim() < 2:
        shape = tuple(blocks.shape)
        raise KVMismatchError(
            f"scatter: cache blocks must be [num_blocks, block_size, ...], got {shape}"
        )
    tail = tuple(blocks.shape[2:])
    if src.dim() != len(tail) + 1 or tuple(src.shape[1:]) != tail:
        raise KVMismatchError(
            f"scatter: expected tokens of shape [n, {', '.join(map(str, tail))}] for the cache, "
            f"got token shape {tuple(src.shape[1:]) if src.dim() else ()} "
            f"(received {tuple(src.shape)})"
        )
    if src.dtype != blocks.dtype:
        raise KVMismatchError(
            f"scatter: expected KV of the cache's dtype {blocks.dtype}, got {src.dtype} "
            f"(tokens of shape {tuple(src.shape)}); omnikv does not cast received KV"
        )


def scatter_tokens(
    blocks: torch.Tensor, block_ids: Sequence[int], src: torch.Tensor, start: int = 0
) -> None:
    """Write ``src`` (``[n, *tail]``) as tokens ``[start, start + n)`` of a request's blocks.

    The inverse of :meth:`omnikv.layouts.gather.BlockGather.write_into`, called by the vLLM
    worker once per layer and K or V of a received request: ``blocks`` is
    ``[num_blocks, block_size, *tail]`` (any strides; a view such as
    :func:`omnikv.layouts.specs.vllm_layer_kv_views` returns is written through), ``block_ids``
    lists the request's blocks in token order. ``src`` must have the cache's dtype and token
    shape (it is copied to the cache's device, never cast). Nothing is written when it raises:
    :class:`~omnikv.errors.KVMismatchError` naming the dtype or shape that does not fit, or
    :class:`~omnikv.errors.ExtractionError` for too few blocks or a block id outside the cache.
    """
    _check_scatter_fit(blocks, src)
    bs = int(blocks.shape[1])
    n = int(src.shape[0])
    if start < 0 or start + n > len(block_ids) * bs:
        raise ExtractionError(
            f"scatter: tokens [{start}, {start + n}) do not fit {len(block_ids)} blocks of {bs}"
        )
    first, last = start // bs, -(-(start + n) // bs)
    ids = [int(b) for b in block_ids[first:last]]
    bad = [b for b in ids if b < 0 or b >= int(blocks.shape[0])]
    if bad:
        raise ExtractionError(f"scatter: block ids {bad[:8]} outside a cache of {blocks.shape[0]}")
    # A partial first block, the full blocks in one copy per run of consecutive ids (or one
    # index_copy_), a partial last block: few operations, so that a load thread is not held up
    # once per block by an engine loop that keeps the GIL.
    src = src.to(blocks.device)  # before the first write: nothing is written when this raises
    pos, i = 0, 0
    lo = start % bs
    if lo and n:
        pos = min(bs - lo, n)
        blocks[ids[0], lo : lo + pos].copy_(src[:pos])
        i = 1
    full = (n - pos) // bs
    if full:
        body = src[pos : pos + full * bs].reshape(full, bs, *src.shape[1:])
        _write_blocks(blocks, ids[i : i + full], body)
        pos += full * bs
        i += full
    if pos < n:
        blocks[ids[i], : n - pos].copy_(src[pos:])


def _write_blocks(blocks: torch.Tensor, ids: list[int], body: torch.Tensor) -> None:
    """``body[j]`` into block ``ids[j]`` of ``blocks`` for every ``j`` (ids checked)."""
    runs = block_runs(ids, MAX_RUN_COPIES)
    if runs is None:
        index = torch.tensor(ids, dtype=torch.long, device=blocks.device)
        blocks.index_copy_(0, index, body)
        return
    for at, first, length in runs:
        blocks[first : first + length].copy_(body[at : at + length])
