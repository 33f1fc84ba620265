"""Encoding: what the plan lays out and what the writers write, on every path (numpy and torch,
tensor and array buffers, aligned and not), the layout table, and the header's metadata."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch
from kv_payloads import assert_same, sample

from omnikv.bench.reference import ref_from_bytes
from omnikv.connectors.base import HostArrayWriter
from omnikv.errors import EncodeError
from omnikv.wire.decode import decode, decode_kv
from omnikv.wire.encode import (
    PackedPayload,
    clear_layout_cache,
    layout_cache_info,
)
from omnikv.wire.transfer_data import KVCacheTransferData


def test_alignment_of_data_regions() -> None:
    big = torch.zeros(1024, 4, 128, dtype=torch.float16)  # 1 MiB: page aligned
    small = torch.zeros(3, 1, 7, dtype=torch.float16)
    data = KVCacheTransferData("r" * 7, {"key_cache": [small, big], "value_cache": [big, small]})
    raw = data.to_bytes()
    hlen = struct.unpack(">I", raw[:4])[0]
    header = json.loads(raw[4 : 4 + hlen])
    start = 4 + hlen
    assert start % 4096 == 0
    assert header["v"] == 1 and header["al"] == 64 and header["dl"] == len(raw) - start
    for d in header["td"]:
        align = 4096 if d["b"] >= 256 * 1024 else 64
        assert (start + d["o"]) % align == 0


def test_pack_into_buffer_and_offset() -> None:
    data = sample()
    size = data.packed_size()
    buf = torch.full((size + 128,), 0xAB, dtype=torch.uint8)
    assert data.pack_into(buf, offset=64) == size
    assert buf[:64].eq(0xAB).all() and buf[64 + size :].eq(0xAB).all()
    assert_same(data, decode(buf[64 : 64 + size]))
    ba = bytearray(size)
    data.pack_into(ba)
    assert bytes(ba) == data.to_bytes()
    with pytest.raises(ValueError, match="cannot hold"):
        data.pack_into(bytearray(size - 1))
    with pytest.raises(ValueError, match="read-only"):
        data.pack_into(bytes(size))


def test_non_contiguous_source_tensors() -> None:
    base = torch.randn(4, 6, 8)
    k = base.transpose(0, 1)[:, :3]  # non-contiguous
    data = KVCacheTransferData("r", {"key_cache": [k], "value_cache": [k * 2]})
    out = decode(data.to_bytes())
    assert torch.equal(out["layer_blocks"]["key_cache"][0], k)


def test_metadata_not_json_serialisable_is_encode_error() -> None:
    data = sample()
    data.metadata["bad"] = object()
    with pytest.raises(EncodeError, match="not JSON-serialisable"):
        data.to_bytes()
    data.metadata["bad"] = torch.tensor([1, 2])  # small tensors become lists
    assert decode(data.to_bytes())["metadata"]["bad"] == [1, 2]


def test_plan_rejects_unknown_dtype() -> None:
    with pytest.raises(EncodeError, match="unsupported dtype"):
        PackedPayload("r", [torch.zeros(2, dtype=torch.uint16)], [None])


def test_reference_decodes_what_we_write() -> None:
    data = sample(layers=4)
    assert_same(data, ref_from_bytes(data.to_bytes()))
    assert_same(data, ref_from_bytes(data.to_bytes(checksum=True)))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float8_e5m2, torch.int8])
def test_host_fast_path_and_torch_path_write_the_same_bytes(dtype: torch.dtype) -> None:
    """pack_into copies host tensors through numpy (as same-size integer bits); at an offset
    that misaligns the data for the dtype it takes the torch path. Both decode to the input."""
    g = torch.Generator().manual_seed(3)
    k = [(torch.randn(5, 2, 8, generator=g) * 4).to(dtype) for _ in range(2)]
    v = [(torch.randn(5, 2, 8, generator=g) * 4).to(dtype)[:, :, ::2] for _ in range(2)]
    plan = PackedPayload("r", k, v, [1], {"seq_len": 5})
    fast = torch.empty(plan.nbytes, dtype=torch.uint8)
    plan.pack_into(fast)
    odd = torch.empty(plan.nbytes + 1, dtype=torch.uint8)
    plan.pack_into(odd, 1)
    assert torch.equal(fast, odd[1:])
    out = decode_kv(fast)
    for got, want in zip((*out.key_cache, *out.value_cache), (*k, *v), strict=True):
        assert got is not None
        assert torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8))


def test_pack_into_a_numpy_array_writes_the_same_bytes_as_into_a_tensor() -> None:
    """A connector may hand a host slot over as a numpy array (the plan is a
    ``HostArrayWriter``): the bytes are those written into a tensor, at any offset, also for
    a tensor large enough for the torch copy path and at an offset that misaligns the data;
    a read-only array and one too small are refused."""
    g = torch.Generator().manual_seed(5)
    big = torch.randn(300 * 1024 // 4, generator=g)  # >= LARGE_TENSOR_BYTES: torch copies it
    k = [torch.randn(7, 2, 8, generator=g).half(), big]
    v = [torch.randn(7, 2, 8, generator=g).half()[:, :, ::2], big + 1]
    plan = PackedPayload("r", k, v, [1, 2], {"seq_len": 7})
    assert isinstance(plan, HostArrayWriter) and not isinstance(lambda buf: None, HostArrayWriter)
    want = torch.zeros(plan.nbytes, dtype=torch.uint8)
    plan.pack_into(want)
    for offset in (0, 1, 64):
        arr = np.full(plan.nbytes + offset + 5, 0xCD, dtype=np.uint8)
        assert plan.pack_into(arr, offset) == plan.nbytes
        assert bytes(arr[offset : offset + plan.nbytes]) == bytes(want.numpy())
        assert (arr[:offset] == 0xCD).all() and (arr[offset + plan.nbytes :] == 0xCD).all()
    out = decode_kv(want)
    k1, v0 = out.key_cache[1], out.value_cache[0]
    assert k1 is not None and v0 is not None
    assert torch.equal(k1, big) and torch.equal(v0, v[0])
    frozen = np.zeros(plan.nbytes, dtype=np.uint8)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        plan.pack_into(frozen)
    with pytest.raises(ValueError, match="cannot hold"):
        plan.pack_into(np.zeros(plan.nbytes - 1, dtype=np.uint8))


def test_payloads_of_one_layout_share_it_and_every_difference_gets_its_own() -> None:
    """The slots and the encoded ``td`` are made once per layout (dtypes, shapes, ``None``
    layers, layer count) and shared; each payload still decodes to its own tensors, ids and
    metadata; a dtype the format cannot name is refused and not kept; the table is bounded.
    The table is seen through its test hook (``layout_cache_info``: lru_cache's counters)."""
    g = torch.Generator().manual_seed(9)

    def make(
        shape: tuple[int, ...], dtype: torch.dtype, none_v: bool = False
    ) -> tuple[PackedPayload, list[torch.Tensor | None]]:
        k = [torch.randn(*shape, generator=g).to(dtype) for _ in range(2)]
        v = [None if none_v else torch.randn(*shape, generator=g).to(dtype), k[0] + 1]
        plan = PackedPayload(f"r{len(shape)}", k, v, [len(shape)], {"seq_len": shape[0]})
        return plan, [*k, *v]

    clear_layout_cache()
    a, b = make((4, 2, 8), torch.float16), make((4, 2, 8), torch.float16)
    info = layout_cache_info()
    assert (info.misses, info.hits, info.currsize) == (1, 1, 1)  # one layout, made once
    others = [
        make((5, 2, 8), torch.float16),
        make((4, 2, 8), torch.bfloat16),
        make((4, 2, 8), torch.float16, none_v=True),
    ]
    info = layout_cache_info()
    assert (info.misses, info.hits, info.currsize) == (4, 1, 4)  # each difference its own
    for plan, sources in (a, b, *others):
        out = decode_kv(plan.to_bytes())
        first = sources[0]
        assert first is not None
        assert (out.request_id, out.block_ids) == ("r3", [3])
        assert out.metadata == {"seq_len": first.shape[0]}
        for got, src in zip((*out.key_cache, *out.value_cache), sources, strict=True):
            assert (got is None) == (src is None)
            if got is not None:
                assert src is not None and torch.equal(got, src)
    with pytest.raises(EncodeError, match="unsupported dtype"):
        PackedPayload("r", [torch.zeros(2, dtype=torch.uint32)], [None])
    assert layout_cache_info().currsize == 4  # refused, not kept
    maxsize = layout_cache_info().maxsize
    assert maxsize is not None
    for n in range(maxsize + 5):
        PackedPayload("r", [torch.zeros(n + 1)], [None])
    assert layout_cache_info().currsize == maxsize


def test_header_metadata_msgspec_cannot_encode_goes_through_json() -> None:
    """Metadata keys of odd types (booleans), which msgspec refuses, go through ``json``: they
    are written as JSON object keys (strings)."""
    plan = PackedPayload("r", [torch.ones(2)], [torch.ones(2)], [0], {"m": {True: 1, 2: "b"}})
    meta = json.loads(plan.header_bytes[4:])["meta"]
    assert meta == {"m": {"true": 1, "2": "b"}}
    assert decode_kv(plan.to_bytes()).metadata == {"m": {"true": 1, "2": "b"}}


def test_header_of_numpy_and_tensor_metadata_is_plain_json() -> None:
    meta = {"a": np.int64(3), "b": torch.tensor([1, 2]), "c": np.arange(2), "d": {"x"}}
    plan = PackedPayload("r", [torch.ones(2)], [torch.ones(2)], [0], meta)
    assert json.loads(plan.header_bytes[4:])["meta"] == {
        "a": 3,
        "b": [1, 2],
        "c": [0, 1],
        "d": ["x"],
    }
