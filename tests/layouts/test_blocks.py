"""omnikv.layouts.blocks: a layer's blocks read and written by token range, strided or AMX-packed.

The AMX layout is checked here against an oracle that places every element by the documented
formula, one at a time; ``tests/layouts/test_layouts_vllm.py`` checks it against vLLM's own
cache writer.
"""

from __future__ import annotations

import pytest
import torch

from omnikv.errors import ExtractionError, KVMismatchError
from omnikv.layouts.blocks import (
    VLLM_BLOCK_LAYOUTS,
    VLLM_CPU_AMX_LAYOUT,
    AmxPackedLayerBlocks,
    PackedLayerBlocks,
    StridedLayerBlocks,
    vllm_layer_blocks,
)
from omnikv.layouts.specs import VLLM_CPU_LAYOUT

BLOCKS, HEADS, BS, DIM = 5, 2, 32, 32


def _tokens(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, HEADS, DIM, generator=g).to(torch.bfloat16)


def _amx_oracle(k: torch.Tensor, v: torch.Tensor, block_ids: list[int]) -> torch.Tensor:
    """A zero AMX-layout layer with tokens ``k``/``v`` placed element by element."""
    layer = torch.zeros(BLOCKS, HEADS, BS, 2 * DIM, dtype=torch.bfloat16)
    flat = layer.view(BLOCKS, HEADS, 2 * BS * DIM)
    for t in range(k.shape[0]):
        block, off = block_ids[t // BS], t % BS
        for h in range(HEADS):
            for d in range(DIM):
                k_at = ((off // 16) * (DIM // 2) + d // 2) * 32 + (off % 16) * 2 + d % 2
                v_at = BS * DIM + ((d // 16) * (BS // 2) + off // 2) * 32 + (d % 16) * 2 + off % 2
                flat[block, h, k_at] = k[t, h, d]
                flat[block, h, v_at] = v[t, h, d]
    return layer


def test_amx_reads_the_documented_order() -> None:
    k, v = _tokens(45, 1), _tokens(45, 2)
    ids = [3, 1]
    layer = _amx_oracle(k, v, ids)
    blocks = AmxPackedLayerBlocks(layer)
    gk, gv = blocks.gather(ids, 45)
    assert torch.equal(gk, k) and torch.equal(gv, v)
    (sk, sv), send_ids = blocks.send_source(ids)
    assert send_ids == (0, 1) and tuple(sk.shape) == (2, BS, HEADS, DIM)
    assert torch.equal(sk.reshape(-1, HEADS, DIM)[:45], k)
    assert torch.equal(sv.reshape(-1, HEADS, DIM)[:45], v)
    assert layer.data_ptr() != sk.data_ptr()  # a copy: the sender never reads a moving cache


@pytest.mark.parametrize("split", [0, 7, 32, 44])
def test_amx_writes_the_documented_order(split: int) -> None:
    """Two writes (a load's two ranges) land exactly where the oracle puts them."""
    k, v = _tokens(45, 3), _tokens(45, 4)
    ids = [4, 0]
    layer = torch.zeros(BLOCKS, HEADS, BS, 2 * DIM, dtype=torch.bfloat16)
    blocks = AmxPackedLayerBlocks(layer)
    blocks.scatter(ids, k[:split], v[:split], 0)
    blocks.scatter(ids, k[split:], v[split:], split)
    assert torch.equal(layer, _amx_oracle(k, v, ids))


def test_amx_partial_write_keeps_the_rest_of_the_block() -> None:
    k, v = _tokens(64, 5), _tokens(64, 6)
    ids = [1, 2]
    layer = _amx_oracle(k, v, ids)
    blocks = AmxPackedLayerBlocks(layer)
    nk, nv = _tokens(3, 7), _tokens(3, 8)
    blocks.scatter(ids, nk, nv, 30)  # tokens 30..32 straddle the two blocks
    k[30:33], v[30:33] = nk, nv
    gk, gv = blocks.gather(ids, 64)
    assert torch.equal(gk, k) and torch.equal(gv, v)


def test_amx_refuses_bad_tokens_and_writes_nothing() -> None:
    layer = torch.zeros(BLOCKS, HEADS, BS, 2 * DIM, dtype=torch.bfloat16)
    blocks = AmxPackedLayerBlocks(layer)
    k = _tokens(10, 9)
    with pytest.raises(KVMismatchError, match="dtype"):
        blocks.scatter([0], k.float(), k.float(), 0)
    with pytest.raises(KVMismatchError, match="shape"):
        blocks.scatter([0], k[:, :1], k[:, :1], 0)
    with pytest.raises(KVMismatchError, match="V tokens"):
        blocks.scatter([0], k, k[:9], 0)
    with pytest.raises(ExtractionError, match="do not fit"):
        blocks.scatter([0], k, k, 30)
    with pytest.raises(ExtractionError, match="outside"):
        blocks.scatter([BLOCKS], k, k, 0)
    with pytest.raises(ExtractionError, match="outside"):
        blocks.gather([-1], 4)
    assert not layer.any()


@pytest.mark.parametrize(
    "layer",
    [
        torch.zeros(BLOCKS, HEADS, BS, 2 * DIM),  # 4-byte dtype
        torch.zeros(BLOCKS, HEADS, 24, 2 * DIM, dtype=torch.bfloat16),  # block size not x16
        torch.zeros(BLOCKS, HEADS, BS, 2 * 40, dtype=torch.bfloat16),  # head size not x16
        torch.zeros(BLOCKS, BS, 2 * DIM, dtype=torch.bfloat16),  # 3-D
    ],
)
def test_amx_refuses_other_caches(layer: torch.Tensor) -> None:
    with pytest.raises(ExtractionError, match="vLLM AMX cache"):
        AmxPackedLayerBlocks(layer)


def test_strided_blocks_write_through_the_views() -> None:
    layer = torch.zeros(BLOCKS, HEADS, BS, 2 * DIM)
    blocks = vllm_layer_blocks(layer, VLLM_CPU_LAYOUT)
    assert isinstance(blocks, StridedLayerBlocks) and not blocks.copies_to_send
    k, v = _tokens(40, 10).float(), _tokens(40, 11).float()
    blocks.scatter([2, 0], k, v, 0)
    (sk, _), ids = blocks.send_source([2, 0])
    assert ids == (2, 0) and sk.data_ptr() == layer.data_ptr()  # the cache itself
    gk, gv = blocks.gather([2, 0], 40)
    assert torch.equal(gk, k) and torch.equal(gv, v)
    with pytest.raises(KVMismatchError, match="differ"):
        blocks.scatter([1], k[:2], v[:3], 0)


def test_layouts_by_name() -> None:
    assert VLLM_BLOCK_LAYOUTS[-1] == VLLM_CPU_AMX_LAYOUT
    layer = torch.zeros(BLOCKS, HEADS, BS, 2 * DIM, dtype=torch.bfloat16)
    assert isinstance(vllm_layer_blocks(layer, VLLM_CPU_AMX_LAYOUT), PackedLayerBlocks)
    with pytest.raises(ExtractionError, match="unknown vLLM cache layout"):
        vllm_layer_blocks(layer, "tiles")


@pytest.mark.parametrize(
    "ids",
    [
        [5, 1, 6, 3],  # each block a run of its own
        [2, 3, 4, 5],  # one run: one slice copy
        [6, 7, 0, 1],  # two runs
        [13, 11, 9, 7, 5, 3, 1, 0, 2, 4, 6, 8, 10, 12],  # > MAX_RUN_COPIES runs: index_copy_
    ],
)
@pytest.mark.parametrize(
    ("start", "n"),
    [(0, 0), (0, 5), (0, 8), (0, 24), (3, 2), (3, 5), (3, 13), (5, 19), (8, 16), (3, 20), (11, 17)],
)
def test_scatter_tokens_writes_exactly_the_tokens_a_per_token_copy_writes(
    start: int, n: int, ids: list[int]
) -> None:
    """Partial first block, whole blocks (a copy per run of consecutive ids, or one
    index_copy_), partial last block: the same cache as a token-by-token reference, through a
    strided view, nothing outside the range touched."""
    from omnikv.layouts.scatter import MAX_RUN_COPIES, scatter_tokens

    bs = 8
    if len(ids) > 4:  # the fragmented case: more whole blocks than copies per run
        n += (MAX_RUN_COPIES + 2) * bs
    base = torch.randn(14, 3, bs, 4)  # [blocks, heads, block_size, dim]: a strided token view
    view = base.permute(0, 2, 1, 3)  # [blocks, block_size, heads, dim]
    src = torch.randn(n, 3, 4)
    want = base.clone().permute(0, 2, 1, 3)
    for t in range(n):
        pos = start + t
        want[ids[pos // bs], pos % bs] = src[t]
    scatter_tokens(view, ids, src, start)
    assert torch.equal(view, want)
