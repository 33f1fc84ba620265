"""Wire format: round trips, alignment, reference compatibility, and every malformed input."""

from __future__ import annotations

import functools
import json
import struct

import numpy as np
import pytest
import torch

from omnikv.bench.reference import ref_from_bytes, ref_to_bytes
from omnikv.errors import DecodeError, EncodeError
from omnikv.payload import (
    DEFAULT_MAX_HEADER_BYTES,
    DTYPE_ALLOWLIST,
    MAX_LAYERS,
    DecodedKV,
    KVCacheTransferData,
    PackedPayload,
    decode,
    decode_device,
    decode_kv,
    writes_host_arrays,
)


def _sample(
    layers: int = 3, tokens: int = 5, dtype: torch.dtype = torch.float16
) -> KVCacheTransferData:
    g = torch.Generator().manual_seed(0)
    k = [torch.randn(tokens, 2, 8, generator=g).to(dtype) for _ in range(layers)]
    v = [torch.randn(tokens, 2, 8, generator=g).to(dtype) for _ in range(layers)]
    return KVCacheTransferData(
        "req-1", {"key_cache": k, "value_cache": v}, [4, 7], {"seq_len": tokens}
    )


def _assert_same(data: KVCacheTransferData, out: dict) -> None:
    assert out["request_id"] == data.request_id
    assert out["block_ids"] == list(data.block_ids)
    for cache in ("key_cache", "value_cache"):
        got, want = out["layer_blocks"][cache], data.layer_blocks[cache]
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            if b is None:
                assert a is None
            else:
                assert a.dtype == b.dtype and a.shape == b.shape
                assert torch.equal(a.view(torch.uint8), b.contiguous().view(torch.uint8))


def _raw_int_view(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("name", sorted(DTYPE_ALLOWLIST))
def test_round_trip_every_allowlisted_dtype(name: str) -> None:
    dtype = DTYPE_ALLOWLIST[name]
    raw = torch.arange(5 * 2 * 8 * 16, dtype=torch.int64).remainder(251).to(torch.uint8)
    if dtype == torch.bool:
        raw = raw.remainder(2)  # only 0 and 1 are valid bool bytes
    itemsize = torch.empty((), dtype=dtype).element_size()
    t = raw[: 5 * 2 * 8 * itemsize].view(dtype).view(5, 2, 8)
    data = KVCacheTransferData("r", {"key_cache": [t], "value_cache": [t.clone()]}, [], {})
    out = decode(data.to_bytes())
    assert out["layer_blocks"]["key_cache"][0].dtype == dtype
    assert torch.equal(_raw_int_view(out["layer_blocks"]["key_cache"][0]), _raw_int_view(t))
    # and the reference decoder reads what we write
    ref = ref_from_bytes(data.to_bytes())
    assert torch.equal(_raw_int_view(ref["layer_blocks"]["value_cache"][0]), _raw_int_view(t))


def test_round_trip_none_layers_zero_element_and_metadata() -> None:
    k = [torch.ones(3, 2, 4), None, torch.empty(0, 2, 4)]
    v = [torch.zeros(3, 2, 4), None, torch.empty(0, 2, 4)]
    meta = {"seq_len": 3, "rope": (1, 2), "nested": {"a": [1.5, None, "x"]}}
    data = KVCacheTransferData("rid", {"key_cache": k, "value_cache": v}, [1, 2, 3], meta)
    for raw in (data.to_bytes(), bytearray(data.to_bytes()), memoryview(data.to_bytes())):
        out = decode(raw)
        assert out["metadata"] == {"seq_len": 3, "rope": [1, 2], "nested": {"a": [1.5, None, "x"]}}
        assert out["layer_blocks"]["key_cache"][1] is None
        assert out["layer_blocks"]["key_cache"][2].shape == (0, 2, 4)
        _assert_same(
            KVCacheTransferData("rid", {"key_cache": k, "value_cache": v}, [1, 2, 3], {}), out
        )
    ref = ref_from_bytes(data.to_bytes())
    assert ref["layer_blocks"]["key_cache"][1] is None
    assert ref["layer_blocks"]["value_cache"][2].shape == (0, 2, 4)


def test_we_decode_what_the_reference_writes() -> None:
    data = _sample()
    ref_raw = ref_to_bytes(
        data.request_id,
        data.layer_blocks["key_cache"],
        data.layer_blocks["value_cache"],
        data.block_ids,
        data.metadata,
    )
    _assert_same(data, decode(ref_raw))
    assert decode(ref_raw)["metadata"] == {"seq_len": 5}


def test_reference_writes_odd_offsets_we_still_decode() -> None:
    # an odd-length request id shifts the data section to an odd address
    t = torch.arange(12, dtype=torch.float32).view(3, 2, 2)
    raw = ref_to_bytes("abc", [t], [t + 1], [], {})
    out = decode(raw)
    assert torch.equal(out["layer_blocks"]["key_cache"][0], t)
    assert torch.equal(out["layer_blocks"]["value_cache"][0], t + 1)


def test_reference_decodes_what_we_write() -> None:
    data = _sample(layers=4)
    _assert_same(data, ref_from_bytes(data.to_bytes()))
    _assert_same(data, ref_from_bytes(data.to_bytes(checksum=True)))


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
    data = _sample()
    size = data.packed_size()
    buf = torch.full((size + 128,), 0xAB, dtype=torch.uint8)
    assert data.pack_into(buf, offset=64) == size
    assert buf[:64].eq(0xAB).all() and buf[64 + size :].eq(0xAB).all()
    _assert_same(data, decode(buf[64 : 64 + size]))
    ba = bytearray(size)
    data.pack_into(ba)
    assert bytes(ba) == data.to_bytes()
    with pytest.raises(ValueError, match="cannot hold"):
        data.pack_into(bytearray(size - 1))
    with pytest.raises(ValueError, match="read-only"):
        data.pack_into(bytes(size))


def test_decode_returns_views_not_copies() -> None:
    data = _sample()
    buf = torch.empty(data.packed_size(), dtype=torch.uint8)
    data.pack_into(buf)
    out = decode(buf)
    k0 = out["layer_blocks"]["key_cache"][0]
    lo, hi = buf.data_ptr(), buf.data_ptr() + buf.numel()
    assert lo <= k0.data_ptr() < hi


def test_non_contiguous_source_tensors() -> None:
    base = torch.randn(4, 6, 8)
    k = base.transpose(0, 1)[:, :3]  # non-contiguous
    data = KVCacheTransferData("r", {"key_cache": [k], "value_cache": [k * 2]})
    out = decode(data.to_bytes())
    assert torch.equal(out["layer_blocks"]["key_cache"][0], k)


def test_checksum_detects_corruption_and_is_optional() -> None:
    data = _sample()
    raw = bytearray(data.to_bytes(checksum=True))
    decode(raw)
    raw[-3] ^= 0x40
    with pytest.raises(DecodeError, match="checksum mismatch"):
        decode(raw)
    decode(raw, verify=False)  # explicitly skipped
    plain = bytearray(data.to_bytes())
    plain[-3] ^= 0x40
    decode(plain)  # no checksum requested: corruption of data bytes is not detectable


def test_metadata_not_json_serialisable_is_encode_error() -> None:
    data = _sample()
    data.metadata["bad"] = object()
    with pytest.raises(EncodeError, match="not JSON-serialisable"):
        data.to_bytes()
    data.metadata["bad"] = torch.tensor([1, 2])  # small tensors become lists
    assert decode(data.to_bytes())["metadata"]["bad"] == [1, 2]


def test_device_decoder_on_host_tensor_and_aliases() -> None:
    data = _sample()
    t = torch.frombuffer(bytearray(data.to_bytes()), dtype=torch.uint8)
    out = KVCacheTransferData.from_bytes_device(t)
    _assert_same(data, out)
    k0 = out["layer_blocks"]["key_cache"][0]
    assert not (t.data_ptr() <= k0.data_ptr() < t.data_ptr() + t.numel())  # copies
    _assert_same(data, KVCacheTransferData.from_bytes_gpu(t))
    views = decode_device(t, copy=False)
    assert t.data_ptr() <= views["layer_blocks"]["key_cache"][0].data_ptr()


def test_to_gpu_tensor_without_device_tensors() -> None:
    with pytest.raises(RuntimeError, match="No device tensors"):
        _sample().to_gpu_tensor()


def test_to_dict_keeps_tensors() -> None:
    data = _sample()
    d = data.to_dict()
    assert d["layer_blocks"]["key_cache"][0] is data.layer_blocks["key_cache"][0]
    assert d["request_id"] == "req-1" and d["metadata"] == {"seq_len": 5}


# ---------------------------------------------------------------------------------------
# Malformed inputs: each raises DecodeError (a ValueError) naming the problem
# ---------------------------------------------------------------------------------------
def _header_payload(header: dict, data: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack(">I", len(raw)) + raw + data


def _good_header() -> dict:
    return {
        "rid": "r",
        "bids": [],
        "meta": {},
        "td": [{"n": "key_cache_0", "i": 0, "d": "float32", "s": [2], "o": 0, "b": 8}],
        "nl": 1,
    }


CASES = [
    ("short buffer", b"\x00\x00", "missing 4-byte header length"),
    ("empty", b"", "missing 4-byte header length"),
    ("header too long", struct.pack(">I", 100) + b"{}", "header_len=100"),
    ("bad json", struct.pack(">I", 3) + b"{x}", "not valid UTF-8 JSON"),
    ("bad utf8", struct.pack(">I", 2) + b"\xff\xfe", "not valid UTF-8 JSON"),
    ("not an object", _header_payload([1, 2]), "Expected `object`, got `array`"),  # type: ignore[arg-type]
    (
        "deep nesting",
        struct.pack(">I", 200000) + b"[" * 100000 + b"]" * 100000,
        "nested too deeply|JSON|Expected `object`",
    ),
]


@pytest.mark.parametrize(("label", "raw", "match"), CASES, ids=[c[0] for c in CASES])
def test_malformed_framing(label: str, raw: bytes, match: str) -> None:
    with pytest.raises(DecodeError, match=match):
        decode(raw)


def _mutated(**changes: object) -> bytes:
    header = _good_header()
    for key, value in changes.items():
        if key.startswith("td_"):
            header["td"][0][key[3:]] = value
        elif value is None:
            del header[key]
        else:
            header[key] = value
    return _header_payload(header, b"\x00" * 8)


FIELD_CASES = [
    ("missing rid", {"rid": None}, "missing required field `rid`"),
    ("missing td", {"td": None}, "missing required field `td`"),
    ("missing nl", {"nl": None}, "missing required field `nl`"),
    ("missing meta", {"meta": None}, "missing required field `meta`"),
    ("nl is str", {"nl": "1"}, "Expected `int`, got `str` - at `\\$.nl`"),
    ("nl is bool", {"nl": True}, "Expected `int`, got `bool` - at `\\$.nl`"),
    ("huge nl", {"nl": 10**9}, f"outside \\[0, {MAX_LAYERS}\\]"),
    ("negative nl", {"nl": -1}, "outside"),
    ("unknown dtype", {"td_d": "cuda"}, "Unsupported dtype"),
    ("object dtype", {"td_d": "object"}, "Unsupported dtype"),
    ("span past end", {"td_o": 4}, "tensor span"),
    ("negative offset", {"td_o": -1}, "tensor span"),
    ("float offset", {"td_o": 0.5}, "got `float` - at `\\$.td\\[0\\].o`"),
    ("shape mismatch", {"td_s": [3]}, "needs 12 bytes"),
    ("negative dim", {"td_s": [-2]}, "non-negative"),
    ("too many dims", {"td_s": [1] * 9}, "at most 8 dims"),
    ("bad layer index", {"td_i": 5}, "Invalid layer index"),
    ("str layer index", {"td_i": "0"}, "got `str` - at `\\$.td\\[0\\].i`"),
    (
        "bad name",
        {"td_n": "key_cache_zz", "td_i": None},
        "Invalid KV tensor name|Invalid layer index",
    ),
    ("name not str", {"td_n": 3}, "Expected `str`, got `int`"),
    ("future version", {"v": 99}, "unsupported format version"),
    (
        "other byte order",
        {"bo": "big" if __import__("sys").byteorder == "little" else "little"},
        "byte order",
    ),
    ("bad checksum field", {"ck": "md5:zz"}, "malformed checksum"),
]


@pytest.mark.parametrize(
    ("label", "changes", "match"), FIELD_CASES, ids=[c[0] for c in FIELD_CASES]
)
def test_malformed_header_fields(label: str, changes: dict, match: str) -> None:
    with pytest.raises(DecodeError, match=match):
        decode(_field_case(label, changes))


def _field_case(label: str, changes: dict) -> bytes:
    """The payload of one ``FIELD_CASES`` row."""
    if label != "bad name":
        return _mutated(**changes)
    header = _good_header()
    header["td"][0]["n"] = "key_cache_zz"
    del header["td"][0]["i"]
    return _header_payload(header, b"\x00" * 8)


def test_td_entry_must_be_object_and_count_bounded() -> None:
    header = _good_header()
    header["td"] = ["oops"]
    with pytest.raises(DecodeError, match="Expected `object`, got `str`"):
        decode(_header_payload(header))
    header["td"] = [{"n": "x", "x": True}] * (2 * MAX_LAYERS + 1)
    with pytest.raises(DecodeError, match="more than"):
        decode(_header_payload(header))


def test_duplicate_tensor_rejected() -> None:
    header = _good_header()
    header["td"].append(dict(header["td"][0]))
    with pytest.raises(DecodeError, match="duplicate"):
        decode(_header_payload(header, b"\x00" * 8))


def test_validated_layouts_are_kept_and_every_difference_is_checked_again() -> None:
    """The spans of a validated layout are reused for the same descriptors; a payload that
    differs anywhere (an offset, a shape, the data length, nl) is validated afresh and refused
    when wrong, also right after the good one was kept."""
    payload_mod = __import__("omnikv.payload", fromlist=["_SPANS_SEEN"])
    payload_mod._SPANS_SEEN.clear()
    header = _good_header()
    header["td"].append({"n": "value_cache_0", "i": 0, "d": "float32", "s": [2], "o": 8, "b": 8})
    good = _header_payload(header, struct.pack("<4f", 1, 2, 3, 4))
    for _ in range(2):
        out = decode(good)
        assert out["layer_blocks"]["value_cache"][0].tolist() == [3.0, 4.0]
    assert len(payload_mod._SPANS_SEEN) == 1
    overlap = json.loads(json.dumps(header))
    overlap["td"][1]["o"] = 4
    with pytest.raises(DecodeError, match="overlaps"):
        decode(_header_payload(overlap, b"\x00" * 16))
    with pytest.raises(DecodeError, match="tensor span"):
        decode(_header_payload(header, b"\x00" * 12))  # same descriptors, shorter data
    wider = json.loads(json.dumps(header))
    wider["td"][1]["s"] = [3]
    with pytest.raises(DecodeError, match="needs 12 bytes"):
        decode(_header_payload(wider, b"\x00" * 16))
    fewer_layers = json.loads(json.dumps(header))
    fewer_layers["nl"] = 0
    with pytest.raises(DecodeError, match="Invalid layer index"):
        decode(_header_payload(fewer_layers, b"\x00" * 16))
    assert len(payload_mod._SPANS_SEEN) == 1  # failures are never kept
    assert decode(good)["layer_blocks"]["key_cache"][0].tolist() == [1.0, 2.0]


def test_oversized_header_rejected_without_reading_it() -> None:
    raw = struct.pack(">I", DEFAULT_MAX_HEADER_BYTES + 1) + b" " * (DEFAULT_MAX_HEADER_BYTES + 1)
    with pytest.raises(DecodeError, match="exceeds the limit"):
        decode(raw)


def test_explicit_index_wins_over_unparseable_name() -> None:
    header = _good_header()
    header["td"][0]["n"] = "key_cache_weird"
    out = decode(_header_payload(header, struct.pack("<2f", 1.0, 2.0)))
    assert out["layer_blocks"]["key_cache"][0].tolist() == [1.0, 2.0]


def test_unknown_tensor_names_are_ignored() -> None:
    header = _good_header()
    header["td"][0]["n"] = "extra_blob"
    out = decode(_header_payload(header, b"\x00" * 8))
    assert out["layer_blocks"]["key_cache"] == [None]


def test_wrong_buffer_types() -> None:
    with pytest.raises(DecodeError):
        decode(12345)
    with pytest.raises(DecodeError):
        decode(torch.zeros(4, dtype=torch.float32))
    with pytest.raises(DecodeError, match="1-D uint8"):
        decode_device(torch.zeros(4, dtype=torch.float32))


def test_plan_rejects_unknown_dtype() -> None:
    with pytest.raises(EncodeError, match="unsupported dtype"):
        PackedPayload("r", [torch.zeros(2, dtype=torch.uint16)], [None])


# ---------------------------------------------------------------------------------------
# decode_kv: the typed result
# ---------------------------------------------------------------------------------------
def test_decode_kv_is_typed_and_builds_the_seed_dict() -> None:
    data = _sample(layers=3)
    data.layer_blocks["value_cache"][1] = None
    raw = data.to_bytes()
    out = decode_kv(raw)
    assert isinstance(out, DecodedKV)
    assert (out.request_id, out.block_ids, out.metadata) == ("req-1", [4, 7], {"seq_len": 5})
    assert out.num_layers == 3 and out.value_cache[1] is None
    assert out.nbytes == 5 * 5 * 2 * 8 * 2
    seed = out.to_seed_dict()
    assert seed["layer_blocks"]["key_cache"] is out.key_cache
    _assert_same(data, seed)
    _assert_same(data, KVCacheTransferData.from_bytes(raw))
    with pytest.raises(AttributeError):
        out.request_id = "other"  # type: ignore[misc]


def test_decode_kv_views_and_copies() -> None:
    data = _sample(layers=4)
    buf = torch.empty(data.packed_size(), dtype=torch.uint8)
    data.pack_into(buf)
    lo, hi = buf.data_ptr(), buf.data_ptr() + buf.numel()
    views = decode_kv(buf)
    assert all(lo <= t.data_ptr() < hi for t in views.key_cache if t is not None)
    copied = decode_kv(buf, copy=True)
    assert all(not lo <= t.data_ptr() < hi for t in copied.key_cache if t is not None)
    buf.zero_()  # the copies are the caller's now; the views see the change
    _assert_same(data, copied.to_seed_dict())
    assert views.key_cache[0] is not None and not views.key_cache[0].any()


def test_mixed_shapes_dtypes_and_gaps_round_trip() -> None:
    # runs of equal layers are decoded as one strided view; breaks in the run must not confuse it
    g = torch.Generator().manual_seed(1)
    k = [
        torch.randn(4, 2, 8, generator=g).half(),
        torch.randn(4, 2, 8, generator=g).half(),
        None,
        torch.randn(4, 2, 8, generator=g).half(),
        torch.randn(5, 2, 8, generator=g).half(),
        torch.randn(4, 2, 8, generator=g).float(),
        torch.empty(0, 2, 8, dtype=torch.float16),
        torch.randn(4, 2, 8, generator=g).half(),
    ]
    v = [t.clone() if t is not None else None for t in reversed(k)]
    data = KVCacheTransferData("mixed", {"key_cache": k, "value_cache": v})
    for raw in (data.to_bytes(), ref_to_bytes("mixed", k, v)):
        _assert_same(data, decode(raw))
        _assert_same(data, decode_kv(raw, copy=True).to_seed_dict())


def test_misaligned_buffer_address_is_copied_not_misread() -> None:
    data = _sample(layers=2, dtype=torch.float32)
    raw = bytearray(1) + data.to_bytes()
    view = memoryview(raw)[1:]  # every tensor now sits at an odd address
    out = decode_kv(view)
    assert all(t.data_ptr() % 4 == 0 for t in out.key_cache if t is not None)
    _assert_same(data, out.to_seed_dict())


def test_reference_payload_decodes_equal_to_the_reference_decoder() -> None:
    data = _sample(layers=3, tokens=7)
    raw = ref_to_bytes("abc", data.layer_blocks["key_cache"], data.layer_blocks["value_cache"])
    ours, theirs = decode_kv(raw), ref_from_bytes(raw)
    for cache in ("key_cache", "value_cache"):
        for a, b in zip(getattr(ours, cache), theirs["layer_blocks"][cache], strict=True):
            assert torch.equal(a, b)


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
    """A connector may hand a host slot over as a numpy array (``pack_into`` says so with
    ``writes_host_arrays``): the bytes are those written into a tensor, at any offset, also for
    a tensor large enough for the torch copy path and at an offset that misaligns the data;
    a read-only array and one too small are refused."""
    g = torch.Generator().manual_seed(5)
    big = torch.randn(300 * 1024 // 4, generator=g)  # >= LARGE_TENSOR_BYTES: torch copies it
    k = [torch.randn(7, 2, 8, generator=g).half(), big]
    v = [torch.randn(7, 2, 8, generator=g).half()[:, :, ::2], big + 1]
    plan = PackedPayload("r", k, v, [1, 2], {"seq_len": 7})
    assert writes_host_arrays(plan.pack_into) and not writes_host_arrays(lambda buf: None)
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
    metadata; a dtype the format cannot name is refused and not kept; the table is bounded."""
    from omnikv import payload as payload_mod

    g = torch.Generator().manual_seed(9)

    def make(shape: tuple[int, ...], dtype: torch.dtype, none_v: bool = False) -> PackedPayload:
        k = [torch.randn(*shape, generator=g).to(dtype) for _ in range(2)]
        v = [None if none_v else torch.randn(*shape, generator=g).to(dtype), k[0] + 1]
        return PackedPayload(f"r{len(shape)}", k, v, [len(shape)], {"seq_len": shape[0]})

    a, b = make((4, 2, 8), torch.float16), make((4, 2, 8), torch.float16)
    assert a._slots is b._slots  # one layout
    others = [
        make((5, 2, 8), torch.float16),
        make((4, 2, 8), torch.bfloat16),
        make((4, 2, 8), torch.float16, none_v=True),
    ]
    assert len({id(p._slots) for p in (a, *others)}) == 4
    for plan in (a, b, *others):
        raw = plan.to_bytes()
        out = decode_kv(raw)
        first = plan._sources[0]
        assert isinstance(first, torch.Tensor)
        assert (out.request_id, out.block_ids) == ("r3", [3])
        assert out.metadata == {"seq_len": first.shape[0]}
        for got, src in zip((*out.key_cache, *out.value_cache), plan._sources, strict=True):
            assert (got is None) == (src is None)
            if got is not None:
                assert isinstance(src, torch.Tensor) and torch.equal(got, src)
    with pytest.raises(EncodeError, match="unsupported dtype"):
        PackedPayload("r", [torch.zeros(2, dtype=torch.uint32)], [None])
    assert not any(
        entry is not None and entry[0] == torch.uint32
        for key in payload_mod._LAYOUTS
        for entry in key[1]
    )
    for n in range(payload_mod._LAYOUTS_MAX + 5):
        PackedPayload("r", [torch.zeros(n + 1)], [None])
    assert len(payload_mod._LAYOUTS) <= payload_mod._LAYOUTS_MAX


def _slice(raw: bytes, start: int, n: int) -> bytes:
    return raw[start : start + n]


def test_host_array_decode_views_a_run_of_alike_tensors_at_once() -> None:
    """Decoding from a numpy array (the shared-memory receiver's path): K and V tensors of one
    dtype and shape back to back form a run and are views of the array; mixed shapes, and an
    array whose address misaligns the run, decode through the per-tensor path; every tensor
    equals what was packed."""
    from omnikv import payload as payload_mod

    g = torch.Generator().manual_seed(11)
    alike = [torch.randn(6, 2, 8, generator=g).half() for _ in range(6)]
    mixed = [torch.randn(6, 2, 8, generator=g).half(), torch.randn(5, 2, 8, generator=g).half()]
    for k, v, is_run in ((alike[:3], alike[3:], True), (mixed, mixed[::-1], False)):
        raw = PackedPayload("r", k, v, [0], {}).to_bytes()
        for shift in (0, 1):  # 1: the run's address is odd, misaligned for float16
            arr = np.zeros(len(raw) + shift, dtype=np.uint8)[shift:]
            arr[:] = np.frombuffer(raw, dtype=np.uint8)
            header, _hlen = payload_mod._read_header(
                raw[:4], len(raw), functools.partial(_slice, raw), 1 << 20
            )
            _spans, run = payload_mod._spans_and_run(header, header.dl or 0)
            assert (run is not None) == is_run
            out = decode_kv(arr)
            for got, want in zip((*out.key_cache, *out.value_cache), (*k, *v), strict=True):
                assert got is not None and torch.equal(got, want)
                if not shift:
                    assert np.shares_memory(got.numpy(), arr)


def test_header_metadata_msgspec_cannot_encode_goes_through_json() -> None:
    """Metadata keys of odd types (booleans) are still written as JSON object keys, as before."""
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


# -- the host-array decode (the shared-memory receiver's path) --------------------------------
def _as_array(raw: bytes, shift: int = 0) -> np.ndarray:
    """``raw`` in a fresh 1-D uint8 numpy array, starting ``shift`` bytes past an aligned
    address (numpy aligns its allocations to at least 16 bytes)."""
    backing = np.zeros(len(raw) + 64, dtype=np.uint8)
    start = -backing.ctypes.data % 64 + shift
    arr = backing[start : start + len(raw)]
    arr[:] = np.frombuffer(raw, dtype=np.uint8)
    return arr


@pytest.mark.parametrize("name", sorted(DTYPE_ALLOWLIST))
def test_array_decode_equals_the_tensor_decode_for_every_dtype(name: str) -> None:
    """``decode_kv`` of a numpy array (numpy views, one ``from_numpy`` per dtype; bf16 and
    fp8 through integer bits) gives the same tensors as the tensor path, viewing the array."""
    dtype = DTYPE_ALLOWLIST[name]
    raw = torch.arange(3 * 5 * 2 * 8 * 16, dtype=torch.int64).remainder(251).to(torch.uint8)
    if dtype == torch.bool:
        raw = raw.remainder(2)
    itemsize = torch.empty((), dtype=dtype).element_size()
    n = 5 * 2 * 8 * itemsize
    layers = [raw[i * n : (i + 1) * n].view(dtype).view(5, 2, 8) for i in range(3)]
    data = KVCacheTransferData("r", {"key_cache": layers, "value_cache": layers[::-1]}, [3], {})
    arr = _as_array(data.to_bytes())
    got = decode_kv(arr)
    want = decode_kv(data.to_bytes())
    base = arr.ctypes.data
    pairs = zip(got.key_cache + got.value_cache, want.key_cache + want.value_cache, strict=True)
    for a, b in pairs:
        assert a is not None and b is not None
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(_raw_int_view(a), _raw_int_view(b))
        assert base <= a.data_ptr() < base + arr.size  # a view of the array, not a copy
    assert got.request_id == "r" and got.block_ids == [3]


def test_array_decode_of_gaps_runs_and_misaligned_addresses() -> None:
    g = torch.Generator().manual_seed(1)
    k = [
        torch.randn(4, 2, 8, generator=g).half(),
        None,
        torch.randn(5, 2, 8, generator=g).float(),
        torch.empty(0, 2, 8, dtype=torch.float16),
        torch.randn(4, 2, 8, generator=g).to(torch.bfloat16),
    ]
    v = [t.clone() if t is not None else None for t in reversed(k)]
    data = KVCacheTransferData("mixed", {"key_cache": k, "value_cache": v})
    for raw in (data.to_bytes(), ref_to_bytes("mixed", k, v)):
        for shift in (0, 1, 2):  # odd addresses: such tensors are copied, never misread
            out = decode_kv(_as_array(raw, shift))
            _assert_same(data, out.to_seed_dict())
            assert all(t.data_ptr() % t.element_size() == 0 for t in out.key_cache if t is not None)


@pytest.mark.parametrize(("label", "raw", "match"), CASES, ids=[c[0] for c in CASES])
def test_array_decode_refuses_malformed_framing(label: str, raw: bytes, match: str) -> None:
    with pytest.raises(DecodeError, match=match):
        decode_kv(_as_array(raw))


@pytest.mark.parametrize(
    ("label", "changes", "match"), FIELD_CASES, ids=[c[0] for c in FIELD_CASES]
)
def test_array_decode_refuses_malformed_header_fields(
    label: str, changes: dict, match: str
) -> None:
    with pytest.raises(DecodeError, match=match):
        decode_kv(_as_array(_field_case(label, changes)))


def test_array_decode_checks_the_checksum() -> None:
    data = _sample(layers=2)
    raw = bytearray(data.to_bytes(checksum=True))
    assert decode_kv(_as_array(bytes(raw))).num_layers == 2
    raw[-1] ^= 0xFF
    with pytest.raises(DecodeError, match="checksum"):
        decode_kv(_as_array(bytes(raw)))
