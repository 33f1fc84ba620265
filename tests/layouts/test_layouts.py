"""Paged layouts: every supported form, declared layouts, strict failures, gathers into views."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from omnikv.errors import ExtractionError
from omnikv.layouts.cache import LayerCache, PreparedBlocks
from omnikv.layouts.gather import BlockGather, BlockIndex, plan_request_kv
from omnikv.layouts.specs import normalize_layer_kv, split_layer_kv
from omnikv.wire.encode import host_bits


def _cache(num_blocks: int = 8, bs: int = 4, heads: int = 2, dim: int = 3) -> torch.Tensor:
    n = 2 * num_blocks * bs * heads * dim
    return torch.arange(n, dtype=torch.float32).view(2, num_blocks, bs, heads, dim)


def _expected(k_blocks: torch.Tensor, ids: list[int], seq_len: int) -> torch.Tensor:
    return torch.cat([k_blocks[i] for i in ids])[:seq_len]


def test_kv_first_blocks_first_and_tuple_agree() -> None:
    kv = _cache()
    blocks_first = kv.transpose(0, 1).contiguous()
    ids, seq = [5, 1, 6], 10
    for layer, layout in ((kv, None), (blocks_first, None), ((kv[0], kv[1]), None)):
        keys, values = plan_request_kv([layer], ids, seq, 4, layout=layout)
        assert keys[0] is not None and values[0] is not None
        assert torch.equal(keys[0].materialize(), _expected(kv[0], ids, seq))
        assert torch.equal(values[0].materialize(), _expected(kv[1], ids, seq))


def test_gather_writes_into_given_view() -> None:
    kv = _cache()
    keys, _ = plan_request_kv([kv], [3, 0], 7, 4)
    g = keys[0]
    assert g is not None and g.shape == (7, 2, 3)
    out = torch.full((7, 2, 3), -1.0)
    g.write_into(out)
    assert torch.equal(out, _expected(kv[0], [3, 0], 7))


def test_ambiguous_shape_needs_declared_layout() -> None:
    kv = torch.arange(2 * 2 * 4 * 1 * 2, dtype=torch.float32).view(2, 2, 4, 1, 2)
    with pytest.raises(ExtractionError, match="declare kv_cache_layout"):
        plan_request_kv([kv], [0, 1], 8, 4)
    keys, _ = plan_request_kv([kv], [1], 4, 4, layout="kv_first")
    assert keys[0] is not None and torch.equal(keys[0].materialize(), kv[0][1])
    keys, _ = plan_request_kv([kv], [1], 4, 4, layout="blocks_first")
    assert keys[0] is not None and torch.equal(keys[0].materialize(), kv[1][0])


def test_declared_layout_mismatch_and_unknown_layout() -> None:
    with pytest.raises(ExtractionError, match="does not match layout"):
        split_layer_kv(torch.zeros(3, 5, 4, 2, 2), layout="kv_first")
    with pytest.raises(ExtractionError, match="unknown kv_cache_layout"):
        split_layer_kv(torch.zeros(2, 5, 4, 2, 2), layout="weird")


@pytest.mark.parametrize(
    ("block_ids", "seq_len", "match"),
    [
        ([0, 99], 8, "outside K cache"),
        ([0, -1], 8, "outside"),
        ([0, 1], None, "seq_len must be an int"),
        ([0, 1], "8", "seq_len must be an int"),
        ([0, 1], -1, "seq_len must be >= 0"),
        ([0, 1], 9, "exceeds 2 blocks x 4 tokens"),
        ([], 0, "no block_ids"),
    ],
)
def test_bad_requests_fail_with_reason(block_ids: list[int], seq_len: object, match: str) -> None:
    with pytest.raises(ExtractionError, match=match):
        plan_request_kv([_cache()], block_ids, seq_len, 4)


def test_mismatched_kv_block_counts_fail_instead_of_dropping() -> None:
    k = torch.zeros(3, 8, 4, 16)
    v = torch.zeros(2, 8, 4, 16)
    with pytest.raises(ExtractionError, match="outside V cache of 2 blocks"):
        plan_request_kv([(k, v)], [0, 1, 2], 24, 8)
    keys, _ = plan_request_kv([(k, v)], [0, 1, 2], 16, 8)  # only blocks 0, 1 needed
    assert keys[0] is not None and keys[0].shape == (16, 4, 16)


def test_block_size_must_match_cache_and_none_layers_pass() -> None:
    with pytest.raises(ExtractionError, match="block size"):
        plan_request_kv([_cache()], [0], 2, 8)
    keys, values = plan_request_kv([None, _cache()], [0], 2, 4)
    assert keys[0] is None and values[0] is None and keys[1] is not None
    with pytest.raises(ExtractionError, match="no layer"):
        plan_request_kv([None], [0], 2, 4)


def test_normalize_layer_kv_reference_cases() -> None:
    kv = _cache()
    k, _v = normalize_layer_kv(kv) or (None, None)
    assert k is not None and torch.equal(k, kv[0])
    assert normalize_layer_kv(torch.zeros(3, 3, 4, 2, 2)) is None
    assert normalize_layer_kv((kv[0], kv[1], kv[0])) is None
    assert normalize_layer_kv((kv[0], "x")) is None
    assert normalize_layer_kv("nope") is None


def test_normalize_layer_kv_takes_the_032_block_size_and_never_guesses_a_4d_layout() -> None:
    """vllm-omni 0.32 calls it with ``block_size=``; a 4-D cache whose dim 2 is the block size
    (read as [blocks, heads, block_size, K | V] by the reference, K transposed on vLLM's CPU
    backend) needs its layout declared."""
    kv = _cache()
    bs = int(kv.shape[2])
    got = normalize_layer_kv(kv, req_id="r", layer_idx=0, block_size=bs)
    assert got is not None and torch.equal(got[0], kv[0])
    assert normalize_layer_kv(kv, block_size=bs + 1) is None
    packed = torch.randn(6, 3, bs, 16)
    assert normalize_layer_kv(packed, block_size=bs) is None
    got = normalize_layer_kv(packed, block_size=bs, layout="vllm_bhnc")
    assert got is not None and torch.equal(got[0], packed[..., :8].transpose(1, 2))


def test_zero_seq_len_gives_empty_tensors() -> None:
    keys, _ = plan_request_kv([_cache()], [2], 0, 4)
    assert keys[0] is not None and keys[0].materialize().shape == (0, 2, 3)


@pytest.mark.parametrize(
    ("ids", "seq"),
    [
        ([2, 3, 4], 4),
        ([2, 3, 4], 9),
        ([2, 3, 4], 12),
        ([5, 1, 6], 4),
        ([5, 1, 6], 9),
        ([5, 1, 6], 12),
        ([7], 3),
        ([7], 4),
    ],
    ids=[
        "run-1",
        "run-partial",
        "run-full",
        "scat-1",
        "scat-partial",
        "scat-full",
        "one-part",
        "one",
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_host_bits_gather_equals_the_torch_gather(
    ids: list[int], seq: int, dtype: torch.dtype
) -> None:
    """``write_bits`` (numpy, the sender's host fast path) writes exactly what ``write_into``
    writes, for consecutive ids (one slice), scattered ids (one take) and a partial last block,
    for dtypes numpy has no type for (bf16, fp8: copied as bits), and for a head slice."""
    kv = (torch.randn(2, 8, 4, 4, 3) * 8).to(dtype)
    keys, _ = plan_request_kv([kv], ids, seq, 4)
    g = keys[0]
    assert g is not None and g.index is not None
    full = list(ids[: seq // 4])
    assert list(g.index.ids) == full
    consecutive = not full or full == list(range(full[0], full[0] + len(full)))
    assert (g.index.start is not None) == consecutive
    for gather in (g, BlockGather(g.blocks[:, :, 1:3], g.block_ids, g.seq_len, g.index)):
        want = torch.empty(gather.shape, dtype=dtype)
        gather.write_into(want)
        got = torch.empty(gather.shape, dtype=dtype)
        bits = host_bits(got)
        assert bits is not None and gather.write_bits(bits)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        assert torch.equal(want.float(), _expected(gather.blocks, ids, seq).float())


@pytest.mark.parametrize(
    ("ids", "seq", "one_range"),
    [
        ([2, 3, 4], 9, True),  # consecutive, partial last block
        ([2, 3, 4], 12, True),  # consecutive, full blocks only
        ([2, 3, 6], 9, False),  # full blocks consecutive, the partial one elsewhere
        ([3, 2, 4], 12, False),  # a permutation
        ([7], 3, True),  # one partial block
        ([0, 1, 2, 3, 4, 5, 6, 7], 0, False),  # nothing to copy: no range
        ([6, 7, 0], 5, True),  # the ids after those needed do not matter
    ],
)
@pytest.mark.parametrize("layout", ["kv_first", "blocks_first", "pair"])
@pytest.mark.parametrize("kept", [False, True])
def test_one_range_copy_only_where_the_tokens_are_one_range(
    ids: list[int], seq: int, one_range: bool, layout: str, kept: bool
) -> None:
    """Tokens of consecutive blocks in a C-contiguous cache are copied with one slice of the
    flat cache (K and V of a ``kv_first`` layer, or of a pair once the sender's
    :class:`LayerCache` has prepared it); any other order, and a strided cache
    (``blocks_first`` K and V are not contiguous), take the block-wise copy. Either way the
    bytes are those of the torch gather, into a flat or a shaped destination. A probe gather
    whose ``flat`` is marked (every bit pattern changed) shows which copy ``write_bits`` took:
    the one-range copy reads ``flat``, the block-wise one the cache."""
    kv = torch.randn(2, 8, 4, 2, 3)
    layers: dict[str, object] = {
        "kv_first": kv,
        "blocks_first": kv.transpose(0, 1).contiguous(),
        "pair": (kv[0], kv[1]),
    }
    cache = LayerCache() if kept else None
    for _ in range(2 if kept else 1):  # the second plan reads the kept preparation
        keys, values = plan_request_kv(
            [layers[layout]], ids, seq, 4, layout=None if layout == "pair" else layout, cache=cache
        )
    has_flat = layout == "kv_first" or (layout == "pair" and kept)
    for g in (keys[0], values[0]):
        assert g is not None
        assert (g.flat is not None) == has_flat
        span = g.flat_range()
        assert (span is not None) == (one_range and has_flat)
        want = torch.empty(g.shape)
        g.write_into(want)
        for shaped in (False, True):
            got = torch.full(g.shape, float("nan"))
            bits = host_bits(got)
            assert bits is not None
            assert g.write_bits(bits if shaped else bits.reshape(-1))
            assert torch.equal(got, want)
            if g.flat is None:
                continue
            assert g.tail is not None
            marked = g.flat ^ 1
            probe = BlockGather(
                g.blocks, g.block_ids, g.seq_len, g.index, PreparedBlocks(g.bits, g.tail, marked)
            )
            assert probe.write_bits(bits if shaped else bits.reshape(-1))
            if span is None:
                assert torch.equal(got, want)
            else:
                assert (bits.reshape(-1) == marked[span[0] : span[1]]).all()


def test_block_index_is_shared_by_every_layer_and_made_once_per_device() -> None:
    caches = [_cache(), _cache()]
    keys, values = plan_request_kv(caches, [6, 2, 0], 12, 4)
    indexes = {id(g.index) for g in (*keys, *values) if g is not None}
    assert len(indexes) == 1
    index = keys[0].index if keys[0] is not None else None
    assert index is not None and index.start is None
    assert index.tensor(torch.device("cpu")) is index.tensor(torch.device("cpu"))
    assert index.array().tolist() == [6, 2, 0]


def test_host_bits_gather_from_a_strided_cache_reads_only_the_requests_blocks() -> None:
    """A strided cache (vLLM's CPU layout keeps K and V side by side in each token's row) with
    the request's blocks out of order: ``write_bits`` copies one slice per run of consecutive
    ids (numpy's ``take`` would first copy the whole cache, which then costs every send the
    cache's size), and writes what the torch gather writes. Measured by what numpy allocates
    (it reports its buffers to tracemalloc): a few blocks' worth, not the 32 MiB cache."""
    import tracemalloc

    cache = torch.randn(2048, 16, 2, 2 * 128)  # [blocks, block_size, heads, K | V]: 32 MiB
    k = cache[..., :128]
    ids, seq = [9, 10, 11, 3, 4, 700, 12], 7 * 16 - 5
    gather = BlockGather(k, tuple(ids), seq)
    assert BlockIndex(tuple(ids[:6])).runs() == ((0, 9, 3), (3, 3, 2), (5, 700, 1))
    want = torch.empty(gather.shape)
    gather.write_into(want)
    got = torch.full(gather.shape, float("nan"))
    bits = host_bits(got)
    assert bits is not None
    tracemalloc.start()
    try:
        assert gather.write_bits(bits)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert torch.equal(got, want)
    assert torch.equal(want, _expected(k, ids, seq))
    assert peak < 1 << 20, peak


def test_host_bits_refuses_what_numpy_cannot_view() -> None:
    assert host_bits(torch.zeros(3, dtype=torch.complex128)) is None  # no 16-byte integer
    assert host_bits(torch.zeros(3).conj()) is not None  # real: conj is a no-op
    assert host_bits(torch.zeros(3, dtype=torch.complex64).conj()) is None  # conjugate bit


@pytest.mark.parametrize("layout", ["kv_first", "blocks_first", "pair"])
def test_planner_converts_a_stacked_host_layer_once_for_both_sides(layout: str) -> None:
    """A host layer stored as one tensor is viewed as integers once, and K's and V's views are
    numpy slices of it; they equal each side's own conversion and write the same bytes as the
    torch gather. A (K, V) pair has none (each side converts itself when written)."""
    kv = (torch.randn(2, 8, 4, 2, 3) * 8).to(torch.bfloat16)
    layer: object = {
        "kv_first": kv,
        "blocks_first": kv.transpose(0, 1),
        "pair": (kv[0], kv[1]),
    }[layout]
    keys, values = plan_request_kv([layer], [5, 1, 6], 10, 4)
    for g in (keys[0], values[0]):
        assert g is not None
        if layout == "pair":
            assert g.bits is None
            continue
        own = host_bits(g.blocks)
        assert g.bits is not None and own is not None
        assert g.bits.shape == own.shape and (g.bits == own).all()
        assert g.bits.ctypes.data == own.ctypes.data
        want = torch.empty(g.shape, dtype=torch.bfloat16)
        g.write_into(want)
        got = torch.empty(g.shape, dtype=torch.bfloat16)
        bits = host_bits(got)
        assert bits is not None and g.write_bits(bits)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def _planned(caches: list, ids: list[int], seq: int, bs: int, **kw: object) -> list[torch.Tensor]:
    keys, values = plan_request_kv(caches, ids, seq, bs, **kw)  # type: ignore[arg-type]
    return [g.materialize() for g in (*keys, *values) if g is not None]


def test_layer_cache_prepares_each_layer_once_and_reads_the_same() -> None:
    """The sender's cache keeps each layer's split; a kept layer reads exactly what a fresh
    plan reads, for stacked layers and (K, V) pairs, and its data changes are seen."""
    cache = LayerCache()
    kv = _cache()
    pair = (kv[0].clone(), kv[1].clone())
    caches = [kv, pair]
    ids, seq = [5, 1, 6], 10
    first = _planned(caches, ids, seq, 4, cache=cache)
    assert len(cache) == 2
    assert all(torch.equal(a, b) for a, b in zip(first, _planned(caches, ids, seq, 4), strict=True))
    kv.add_(1)  # the data changes (a new request's KV): the kept views see it
    pair[1].mul_(2)
    again = _planned(caches, ids, seq, 4, cache=cache)
    assert all(torch.equal(a, b) for a, b in zip(again, _planned(caches, ids, seq, 4), strict=True))
    assert len(cache) == 2


@pytest.mark.slow
def test_layer_cache_never_keeps_a_layer_alive() -> None:
    """Entries go with the tensors: dropping a layer frees it (no kept view pins it)."""
    cache = LayerCache()
    kv = _cache()
    pair = (kv[0].clone(), kv[1].clone())
    plan_request_kv([kv, pair], [0], 4, 4, cache=cache)
    assert len(cache) == 2
    watches = [weakref.ref(kv), weakref.ref(pair[0]), weakref.ref(pair[1])]
    del kv, pair
    gc.collect()
    assert all(w() is None for w in watches) and len(cache) == 0


def test_layer_cache_still_refuses_what_a_fresh_plan_refuses() -> None:
    """A kept layer is checked again where the request differs (block ids out of range, another
    block size), and an in-place change of the tensor (new storage, shape) is noticed."""
    cache = LayerCache()
    kv = _cache(num_blocks=8)
    plan_request_kv([kv], [0, 1], 8, 4, cache=cache)
    with pytest.raises(ExtractionError, match="outside K cache of 8 blocks"):
        plan_request_kv([kv], [0, 8], 8, 4, cache=cache)
    with pytest.raises(ExtractionError, match="block size 4 != block_size 8"):
        plan_request_kv([kv], [0], 8, 8, cache=cache)
    bigger = _cache(num_blocks=12).add_(1000)
    kv.set_(bigger.untyped_storage(), 0, bigger.shape, bigger.stride())  # resized in place
    keys, _ = plan_request_kv([kv], [11], 4, 4, cache=cache)
    assert keys[0] is not None
    assert torch.equal(keys[0].materialize(), bigger[0, 11])
