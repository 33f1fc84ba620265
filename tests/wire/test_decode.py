"""Decoding: round trips and compatibility with the reference in both directions, the typed
result, the checksum, every malformed input (on the tensor and the numpy-array path alike), and
the table of validated layouts."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from kv_payloads import (
    CASES,
    FIELD_CASES,
    as_array,
    assert_same,
    field_case,
    good_header,
    header_payload,
    raw_int_view,
    sample,
)

from omnikv.bench.reference import ref_from_bytes, ref_to_bytes
from omnikv.errors import DecodeError
from omnikv.wire.decode import (
    DecodedKV,
    clear_span_cache,
    decode,
    decode_device,
    decode_kv,
    span_cache_info,
)
from omnikv.wire.format import DEFAULT_MAX_HEADER_BYTES, DTYPE_ALLOWLIST, MAX_LAYERS
from omnikv.wire.transfer_data import KVCacheTransferData


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
    assert torch.equal(raw_int_view(out["layer_blocks"]["key_cache"][0]), raw_int_view(t))
    # and the reference decoder reads what we write
    ref = ref_from_bytes(data.to_bytes())
    assert torch.equal(raw_int_view(ref["layer_blocks"]["value_cache"][0]), raw_int_view(t))


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
        assert_same(
            KVCacheTransferData("rid", {"key_cache": k, "value_cache": v}, [1, 2, 3], {}), out
        )
    ref = ref_from_bytes(data.to_bytes())
    assert ref["layer_blocks"]["key_cache"][1] is None
    assert ref["layer_blocks"]["value_cache"][2].shape == (0, 2, 4)


def test_we_decode_what_the_reference_writes() -> None:
    data = sample()
    ref_raw = ref_to_bytes(
        data.request_id,
        data.layer_blocks["key_cache"],
        data.layer_blocks["value_cache"],
        data.block_ids,
        data.metadata,
    )
    assert_same(data, decode(ref_raw))
    assert decode(ref_raw)["metadata"] == {"seq_len": 5}


def test_reference_writes_odd_offsets_we_still_decode() -> None:
    # an odd-length request id shifts the data section to an odd address
    t = torch.arange(12, dtype=torch.float32).view(3, 2, 2)
    raw = ref_to_bytes("abc", [t], [t + 1], [], {})
    out = decode(raw)
    assert torch.equal(out["layer_blocks"]["key_cache"][0], t)
    assert torch.equal(out["layer_blocks"]["value_cache"][0], t + 1)


def test_reference_payload_decodes_equal_to_the_reference_decoder() -> None:
    data = sample(layers=3, tokens=7)
    raw = ref_to_bytes("abc", data.layer_blocks["key_cache"], data.layer_blocks["value_cache"])
    ours, theirs = decode_kv(raw), ref_from_bytes(raw)
    for cache in ("key_cache", "value_cache"):
        for a, b in zip(getattr(ours, cache), theirs["layer_blocks"][cache], strict=True):
            assert torch.equal(a, b)


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
        assert_same(data, decode(raw))
        assert_same(data, decode_kv(raw, copy=True).to_seed_dict())


def test_data_check_detects_corruption_and_can_be_left_out() -> None:
    data = sample()
    raw = bytearray(data.to_bytes())  # the data check is written by default
    decode(raw)
    raw[-3] ^= 0x40
    with pytest.raises(DecodeError, match="data check mismatch"):
        decode(raw)
    decode(raw, verify=False)  # explicitly skipped
    plain = bytearray(data.to_bytes(checksum=False))
    plain[-3] ^= 0x40
    decode(plain)  # no check written: corruption of data bytes is not detectable


def test_decode_kv_is_typed_and_builds_the_seed_dict() -> None:
    data = sample(layers=3)
    data.layer_blocks["value_cache"][1] = None
    raw = data.to_bytes()
    out = decode_kv(raw)
    assert isinstance(out, DecodedKV)
    assert (out.request_id, out.block_ids, out.metadata) == ("req-1", [4, 7], {"seq_len": 5})
    assert out.num_layers == 3 and out.value_cache[1] is None
    assert out.nbytes == 5 * 5 * 2 * 8 * 2
    seed = out.to_seed_dict()
    assert seed["layer_blocks"]["key_cache"] is out.key_cache
    assert_same(data, seed)
    assert_same(data, KVCacheTransferData.from_bytes(raw))
    with pytest.raises(AttributeError):
        out.request_id = "other"  # type: ignore[misc]


@pytest.mark.parametrize(("label", "raw", "match"), CASES, ids=[c[0] for c in CASES])
def test_malformed_framing(label: str, raw: bytes, match: str) -> None:
    with pytest.raises(DecodeError, match=match):
        decode(raw)


@pytest.mark.parametrize(
    ("label", "changes", "match"), FIELD_CASES, ids=[c[0] for c in FIELD_CASES]
)
def test_malformed_header_fields(label: str, changes: dict, match: str) -> None:
    with pytest.raises(DecodeError, match=match):
        decode(field_case(label, changes))


def test_td_entry_must_be_object_and_count_bounded() -> None:
    header = good_header()
    header["td"] = ["oops"]
    with pytest.raises(DecodeError, match="Expected `object`, got `str`"):
        decode(header_payload(header))
    header["td"] = [{"n": "x", "x": True}] * (2 * MAX_LAYERS + 1)
    with pytest.raises(DecodeError, match="more than"):
        decode(header_payload(header))


def test_duplicate_tensor_rejected() -> None:
    header = good_header()
    header["td"].append(dict(header["td"][0]))
    with pytest.raises(DecodeError, match="duplicate"):
        decode(header_payload(header, b"\x00" * 8))


def test_validated_layouts_are_kept_and_every_difference_is_checked_again() -> None:
    """The spans of a validated layout are reused for the same descriptors; a payload that
    differs anywhere (an offset, a shape, the data length, nl) is validated afresh and refused
    when wrong, also right after the good one was kept. The table is seen through its test hook
    (``span_cache_info``: lru_cache's counters)."""
    clear_span_cache()
    header = good_header()
    header["td"].append({"n": "value_cache_0", "i": 0, "d": "float32", "s": [2], "o": 8, "b": 8})
    good = header_payload(header, struct.pack("<4f", 1, 2, 3, 4))
    for _ in range(2):
        out = decode(good)
        assert out["layer_blocks"]["value_cache"][0].tolist() == [3.0, 4.0]
    info = span_cache_info()
    assert (info.misses, info.hits, info.currsize) == (1, 1, 1)
    overlap = json.loads(json.dumps(header))
    overlap["td"][1]["o"] = 4
    with pytest.raises(DecodeError, match="overlaps"):
        decode(header_payload(overlap, b"\x00" * 16))
    with pytest.raises(DecodeError, match="tensor span"):
        decode(header_payload(header, b"\x00" * 12))  # same descriptors, shorter data
    wider = json.loads(json.dumps(header))
    wider["td"][1]["s"] = [3]
    with pytest.raises(DecodeError, match="needs 12 bytes"):
        decode(header_payload(wider, b"\x00" * 16))
    fewer_layers = json.loads(json.dumps(header))
    fewer_layers["nl"] = 0
    with pytest.raises(DecodeError, match="Invalid layer index"):
        decode(header_payload(fewer_layers, b"\x00" * 16))
    info = span_cache_info()
    assert (info.misses, info.currsize) == (5, 1)  # each validated afresh, failures never kept
    assert decode(good)["layer_blocks"]["key_cache"][0].tolist() == [1.0, 2.0]
    assert span_cache_info().hits == 2


def test_oversized_header_rejected_without_reading_it() -> None:
    raw = struct.pack(">I", DEFAULT_MAX_HEADER_BYTES + 1) + b" " * (DEFAULT_MAX_HEADER_BYTES + 1)
    with pytest.raises(DecodeError, match="exceeds the limit"):
        decode(raw)


def test_explicit_index_wins_over_unparseable_name() -> None:
    header = good_header()
    header["td"][0]["n"] = "key_cache_weird"
    out = decode(header_payload(header, struct.pack("<2f", 1.0, 2.0)))
    assert out["layer_blocks"]["key_cache"][0].tolist() == [1.0, 2.0]


def test_unknown_tensor_names_are_ignored() -> None:
    header = good_header()
    header["td"][0]["n"] = "extra_blob"
    out = decode(header_payload(header, b"\x00" * 8))
    assert out["layer_blocks"]["key_cache"] == [None]


def test_wrong_buffer_types() -> None:
    with pytest.raises(DecodeError):
        decode(12345)
    with pytest.raises(DecodeError):
        decode(torch.zeros(4, dtype=torch.float32))
    with pytest.raises(DecodeError, match="1-D uint8"):
        decode_device(torch.zeros(4, dtype=torch.float32))


@pytest.mark.parametrize(("label", "raw", "match"), CASES, ids=[c[0] for c in CASES])
def test_array_decode_refuses_malformed_framing(label: str, raw: bytes, match: str) -> None:
    with pytest.raises(DecodeError, match=match):
        decode_kv(as_array(raw))


@pytest.mark.parametrize(
    ("label", "changes", "match"), FIELD_CASES, ids=[c[0] for c in FIELD_CASES]
)
def test_array_decode_refuses_malformed_header_fields(
    label: str, changes: dict, match: str
) -> None:
    with pytest.raises(DecodeError, match=match):
        decode_kv(as_array(field_case(label, changes)))


def test_array_decode_checks_the_data_check() -> None:
    data = sample(layers=2)
    raw = bytearray(data.to_bytes())
    assert decode_kv(as_array(bytes(raw))).num_layers == 2
    raw[-1] ^= 0xFF
    with pytest.raises(DecodeError, match="data check"):
        decode_kv(as_array(bytes(raw)))
