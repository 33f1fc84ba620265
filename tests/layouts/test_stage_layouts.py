"""Every cache layout a stage may declare, on the seed API's path, against an element-by-element
oracle.

The oracle places each element of K and V at the offset the layout's documentation gives,
one element at a time, in a flat buffer (no torch view or permute shared with the code under
test). The sender (``handle_finished_requests_kv_transfer``) must deliver exactly the request's
tokens; vLLM's write-back (:func:`omnikv.layouts.blocks.vllm_layer_blocks`) must write exactly
the oracle's bytes. ``tests/layouts/test_layouts_vllm.py`` checks the same layouts against vLLM's
own cache writer and views.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from conftest import ManagerFactory
from omnikv.errors import ExtractionError
from omnikv.layouts.blocks import VLLM_BLOCK_LAYOUTS, vllm_layer_blocks
from omnikv.layouts.gather import plan_request_kv
from omnikv.layouts.specs import LAYOUTS

BLOCKS, BS, HEADS, DIM = 5, 16, 2, 16
IDS = [3, 0, 4]
SEQ = 37  # ends inside the third block

#: vLLM 0.32's logical axes of a layer: blocks, heads, tokens in a block, channels (K then V).
_B, _H, _N, _C = 0, 1, 2, 3
#: Physical orders of vLLM 0.32's GPU layers (``KVCacheLayout``'s per-layer view order):
#: ``HND`` block interiors (LBHNC), ``NHD`` ones (LBNHC), and head-outermost (LHBNC).
BHNC_ORDERS = {"hnd": (_B, _H, _N, _C), "nhd": (_B, _N, _H, _C), "h_outer": (_H, _B, _N, _C)}

Place = Callable[[int, int, int, int, int], int]  # (side, block, token, head, channel) -> offset


def _stacked(kv_axis: int) -> tuple[tuple[int, ...], Place]:
    shape = [BLOCKS, BS, HEADS, DIM]
    shape.insert(kv_axis, 2)
    strides = [math.prod(shape[i + 1 :]) for i in range(5)]

    def place(side: int, b: int, t: int, h: int, d: int) -> int:
        idx = [b, t, h, d]
        idx.insert(kv_axis, side)
        return sum(i * s for i, s in zip(idx, strides, strict=True))

    return tuple(shape), place


def _bhnc(order: tuple[int, ...]) -> tuple[tuple[int, ...], Place]:
    logical = (BLOCKS, HEADS, BS, 2 * DIM)
    physical = [logical[a] for a in order]
    stride = {a: math.prod(physical[i + 1 :]) for i, a in enumerate(order)}

    def place(side: int, b: int, t: int, h: int, d: int) -> int:
        c = side * DIM + d
        return b * stride[_B] + h * stride[_H] + t * stride[_N] + c * stride[_C]

    return tuple(physical), place


def _cpu(side: int, b: int, t: int, h: int, d: int) -> int:
    base = (b * HEADS + h) * BS * 2 * DIM
    if side == 0:  # K transposed: [head_size, block_size], token fastest
        return base + d * BS + t
    return base + BS * DIM + t * DIM + d


def _amx(side: int, b: int, t: int, h: int, d: int) -> int:
    base = (b * HEADS + h) * BS * 2 * DIM
    if side == 0:  # K: [t // 16][d // 2][t % 16][d % 2]
        return base + ((t // 16) * (DIM // 2) + d // 2) * 32 + (t % 16) * 2 + d % 2
    # V: [d // 16][t // 2][d % 16][t % 2]
    return base + BS * DIM + ((d // 16) * (BS // 2) + t // 2) * 32 + (d % 16) * 2 + t % 2


def _layer(name: str) -> tuple[tuple[int, ...], Place, torch.dtype]:
    """The shape a stage hands over in the layout ``name``, its oracle and a dtype it allows."""
    if name == "kv_first":
        return (*_stacked(0), torch.float32)
    if name == "blocks_first":
        return (*_stacked(1), torch.float32)
    if name.startswith("vllm_bhnc"):
        return (*_bhnc(BHNC_ORDERS[name.split(":")[1]]), torch.float32)
    cpu_shape = (BLOCKS, HEADS, BS, 2 * DIM)
    if name == "vllm_cpu":
        return cpu_shape, _cpu, torch.float32
    assert name == "vllm_cpu_amx"
    return cpu_shape, _amx, torch.bfloat16


CASES = [
    "kv_first",
    "blocks_first",
    *(f"vllm_bhnc:{o}" for o in BHNC_ORDERS),
    "vllm_cpu",
    "vllm_cpu_amx",
]


def _oracle(name: str, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(storage, layer)``: K and V ``[blocks, bs, heads, dim]`` placed element by element;
    ``layer`` is the tensor a stage hands over (vLLM's logical view for ``vllm_bhnc``)."""
    shape, place, dtype = _layer(name)
    flat = torch.zeros(math.prod(shape), dtype=dtype)
    for side, src in enumerate((k, v)):
        for b in range(BLOCKS):
            for t in range(BS):
                for h in range(HEADS):
                    for d in range(DIM):
                        flat[place(side, b, t, h, d)] = src[b, t, h, d]
    storage = flat.view(shape)
    if name.startswith("vllm_bhnc"):
        order = BHNC_ORDERS[name.split(":")[1]]
        return storage, storage.permute(*[order.index(a) for a in range(4)])
    return storage, storage


def _kv(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(BLOCKS, BS, HEADS, DIM, generator=g).to(dtype)
    v = torch.randn(BLOCKS, BS, HEADS, DIM, generator=g).to(dtype)
    return k, v


def _tokens(blocks: torch.Tensor) -> torch.Tensor:
    return torch.cat([blocks[i] for i in IDS])[:SEQ]


def test_every_declarable_layout_is_covered() -> None:
    assert {c.split(":")[0] for c in CASES} == set(LAYOUTS) - {"auto"}


@pytest.mark.parametrize("name", CASES)
def test_the_seed_api_sends_exactly_the_requests_tokens(
    name: str, make_manager: ManagerFactory
) -> None:
    layout = name.split(":", maxsplit=1)[0]
    k, v = _kv(_layer(name)[2])
    _storage, layer = _oracle(name, k, v)
    sender = make_manager("sender", kv_cache_layout=layout)
    receiver = make_manager("receiver")
    caches = [layer, None, layer]
    done = sender.handle_finished_requests_kv_transfer(
        {"r1": {"block_ids": IDS, "seq_len": SEQ}}, caches, BS, str(layer.dtype)
    )
    assert done == ["r1"]
    result = sender.get_send_result("r1")
    assert result is not None and result.ok, result
    data, _size = receiver.receive_kv_cache_for_request("r1")
    assert data is not None
    got_k, got_v = data["layer_blocks"]["key_cache"], data["layer_blocks"]["value_cache"]
    assert got_k[1] is None and got_v[1] is None
    for layer_idx in (0, 2):
        assert torch.equal(got_k[layer_idx], _tokens(k))
        assert torch.equal(got_v[layer_idx], _tokens(v))


@pytest.mark.parametrize("name", CASES)
def test_vllms_write_back_writes_the_oracles_bytes(name: str) -> None:
    layout = name.split(":", maxsplit=1)[0]
    assert layout in VLLM_BLOCK_LAYOUTS
    k, v = _kv(_layer(name)[2], seed=1)
    want_storage, _layer_view = _oracle(name, k, v)
    ours_storage, ours = _oracle(name, torch.zeros_like(k), torch.zeros_like(v))
    target = vllm_layer_blocks(ours, layout)
    order = [2, 0, 4, 1, 3]  # every block, in an order of its own
    tok_k, tok_v = (torch.cat([t[i] for i in order]) for t in (k, v))
    target.scatter(order, tok_k[:21], tok_v[:21], 0)  # two ranges, the first ending mid-block
    target.scatter(order, tok_k[21:], tok_v[21:], 21)
    assert torch.equal(ours_storage, want_storage)
    got_k, got_v = target.gather(order, BLOCKS * BS)
    assert torch.equal(got_k, tok_k) and torch.equal(got_v, tok_v)


def test_a_packed_layer_is_read_afresh_for_every_request(make_manager: ManagerFactory) -> None:
    """The AMX layout is copied per request (no view): a later request reads the cache as it
    is then, never a copy kept from an earlier one."""
    k, v = _kv(torch.bfloat16)
    _storage, layer = _oracle("vllm_cpu_amx", k, v)
    sender = make_manager("sender", kv_cache_layout="vllm_cpu_amx")
    receiver = make_manager("receiver")
    for rid, scale in (("a", 1), ("b", 2)):
        if scale != 1:
            layer.copy_(_oracle("vllm_cpu_amx", k * scale, v * scale)[1])
        sender.handle_finished_requests_kv_transfer(
            {rid: {"block_ids": IDS, "seq_len": SEQ}}, [layer], BS, "torch.bfloat16"
        )
        data, _ = receiver.receive_kv_cache_for_request(rid)
        assert data is not None
        assert torch.equal(data["layer_blocks"]["key_cache"][0], _tokens(k * scale))


@pytest.mark.parametrize("layout", ["vllm_cpu", "vllm_cpu_amx", "vllm_bhnc"])
def test_a_vllm_layout_refuses_a_cache_that_does_not_fit(layout: str) -> None:
    wrong_bs = torch.zeros(BLOCKS, HEADS, 2 * BS, 2 * DIM, dtype=torch.bfloat16)
    with pytest.raises(ExtractionError, match="block size 32 != block_size 16"):
        plan_request_kv([wrong_bs], IDS, SEQ, BS, layout=layout, request_id="r")
    with pytest.raises(ExtractionError, match=r"outside"):
        plan_request_kv(
            [torch.zeros(2, HEADS, BS, 2 * DIM, dtype=torch.bfloat16)],
            IDS,
            SEQ,
            BS,
            layout=layout,
            request_id="r",
        )
    with pytest.raises(ExtractionError, match="layer 0"):
        plan_request_kv([torch.zeros(2, BLOCKS, BS, HEADS, DIM)], IDS, SEQ, BS, layout=layout)


@pytest.mark.parametrize(
    "shape",
    [
        (61, 3, 128, 64),  # vllm-cpu 0.32's cache, as the issue met it (fewer blocks)
        (BLOCKS, 2, BS, 2 * DIM),  # two KV heads: fits [blocks, 2, ...] too
        (2, HEADS, BS, 2 * DIM),  # two blocks: fits [2, blocks, ...] too
    ],
)
def test_auto_refuses_vllms_4d_caches_naming_the_layouts_to_declare(
    shape: tuple[int, ...], make_manager: ManagerFactory
) -> None:
    """vLLM 0.32's GPU, CPU and AMX caches have one shape: "auto" never guesses among them (nor
    reads a 2 among the first dims as the K/V axis); the reason names what to declare."""
    with pytest.raises(ExtractionError) as info:
        plan_request_kv([torch.zeros(shape)], [0, 1], 3, shape[2], request_id="r")
    for name in ("'vllm_bhnc'", "'vllm_cpu'", "'vllm_cpu_amx'", "from_vllm_config"):
        assert name in str(info.value)
    sender = make_manager("sender")
    sender.handle_finished_requests_kv_transfer(
        {"r": {"block_ids": [0, 1], "seq_len": 3}}, [torch.zeros(shape)], shape[2], "float32"
    )
    result = sender.get_send_result("r")
    assert result is not None and not result.ok and "vllm_cpu" in str(result.reason)
