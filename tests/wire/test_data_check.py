"""The data check every payload carries by default (header ``dc``: XXH3-128 of the data
section): written in the encoder's one pass, verified by every decode path, a flipped bit
anywhere in the data refused as corrupt, older writers' crc32 still read, readers of the
reference format unaffected."""

from __future__ import annotations

import json
import struct
import zlib

import numpy as np
import pytest
import torch
from kv_payloads import as_array, assert_same, header_payload, sample

from omnikv.bench.reference import ref_from_bytes
from omnikv.errors import DecodeError
from omnikv.wire.decode import decode, decode_kv
from omnikv.wire.encode import PackedPayload
from omnikv.wire.format import (
    DATA_CHECK_PLACEHOLDER,
    HEADER_LENGTH,
    LARGE_TENSOR_BYTES,
    data_check,
)
from omnikv.wire.transfer_data import KVCacheTransferData


def _header(raw: bytes) -> dict:
    (hlen,) = HEADER_LENGTH.unpack(raw[:4])
    out: dict = json.loads(raw[4 : 4 + hlen])
    return out


def _data_start(raw: bytes) -> int:
    return 4 + HEADER_LENGTH.unpack(raw[:4])[0]


def _mixed() -> KVCacheTransferData:
    """Layers of several sizes and dtypes, one absent: small tensors (numpy copies), one of
    LARGE_TENSOR_BYTES (torch copy, page-aligned) and padding gaps between them."""
    g = torch.Generator().manual_seed(1)
    big = LARGE_TENSOR_BYTES // (2 * 64 * 2)  # tokens of a [t, 2, 64] fp16 tensor that size
    k = [
        torch.randn(5, 2, 8, generator=g).half(),
        None,
        torch.randn(big, 2, 64, generator=g).half(),
        torch.randn(3, 1, 3, generator=g),
    ]
    v = [
        torch.randn(5, 2, 8, generator=g).to(torch.bfloat16),
        None,
        torch.randn(big, 2, 64, generator=g).half(),
        torch.randn(3, 1, 3, generator=g).double(),
    ]
    return KVCacheTransferData("mixed", {"key_cache": k, "value_cache": v}, [1, 2], {"n": 1})


def test_every_payload_carries_the_check_unless_asked_not_to() -> None:
    data = _mixed()
    raw = data.to_bytes()
    header = _header(raw)
    assert header["dc"] == data_check(np.frombuffer(raw, dtype=np.uint8)[_data_start(raw) :])
    assert header["dc"].startswith("xxh3:") and len(header["dc"]) == 5 + 32
    assert "ck" not in header
    assert "dc" not in _header(data.to_bytes(checksum=False))
    keys, values = data._caches()
    assert "dc" in _header(PackedPayload("r", keys, values).to_bytes())
    assert "dc" not in _header(PackedPayload("r", keys, values, checksum=False).to_bytes())


def test_the_check_of_the_one_pass_equals_a_hash_of_the_written_data() -> None:
    """Host packs hash each slot right after writing it: the streamed hash is the one-shot
    hash of the data section, into every kind of host buffer and at odd offsets (where the
    copies go through torch)."""
    plan = _mixed().plan()
    want = _header(plan.to_bytes())["dc"]
    for offset in (0, 3, 64):
        arr = np.full(plan.nbytes + offset, 7, dtype=np.uint8)
        plan.pack_into(arr, offset)
        ten = torch.full((plan.nbytes + offset,), 7, dtype=torch.uint8)
        plan.pack_into(ten, offset)
        buf = bytearray(plan.nbytes + offset)
        plan.pack_into(buf, offset)
        for got in (arr.tobytes(), ten.numpy().tobytes(), bytes(buf)):
            payload = got[offset:]
            assert _header(payload)["dc"] == want
            assert data_check(np.frombuffer(payload, dtype=np.uint8)[plan.data_start :]) == want


def test_metadata_cannot_be_taken_for_the_checks_place() -> None:
    """The check is filled in at its own key, never at the same text elsewhere in the header."""
    data = sample()
    data.metadata["trap"] = DATA_CHECK_PLACEHOLDER
    raw = data.to_bytes()
    assert _header(raw)["meta"]["trap"] == DATA_CHECK_PLACEHOLDER
    assert decode(raw)["metadata"]["trap"] == DATA_CHECK_PLACEHOLDER


def _spots(raw: bytes) -> dict[str, int]:
    """Byte positions to damage: the first, middle and last byte of each tensor, and the data
    section's first and last byte (a padding gap's bytes among them)."""
    start = _data_start(raw)
    out = {"data first": start, "data last": len(raw) - 1}
    for entry in _header(raw)["td"]:
        if entry.get("x") or not entry["b"]:
            continue
        o, b = start + entry["o"], entry["b"]
        out.update({f"{entry['n']} first": o, f"{entry['n']} mid": o + b // 2})
        out[f"{entry['n']} last"] = o + b - 1
    gaps = [start + e["o"] - 1 for e in _header(raw)["td"] if not e.get("x") and e["o"] > 0]
    out["padding before a tensor"] = gaps[-1]
    return out


def test_a_flipped_bit_anywhere_in_the_data_is_corrupt() -> None:
    """Every spot, every decode path (numpy array, tensor, bytes, copy=True)."""
    raw = _mixed().to_bytes()
    spots = _spots(raw)
    assert len(spots) >= 3 * 6 + 2
    for label, at in spots.items():
        bad = bytearray(raw)
        bad[at] ^= 1 << (at % 8)
        for path, call in (
            ("array", lambda b=bytes(bad): decode_kv(as_array(b))),
            ("tensor", lambda b=bad: decode_kv(torch.frombuffer(b, dtype=torch.uint8))),
            ("bytes", lambda b=bytes(bad): decode_kv(b)),
            ("copy", lambda b=bytes(bad): decode_kv(b, copy=True)),
        ):
            with pytest.raises(DecodeError, match="data check mismatch"):
                call()
            assert path  # (named for the failure's traceback)
        assert decode_kv(bytes(bad), verify=False).num_layers == 4, label
    assert_same(_mixed(), decode(raw))


def test_a_damaged_check_is_corrupt_too() -> None:
    raw = bytearray(sample().to_bytes())
    at = raw.index(b'"dc":"xxh3:') + len('"dc":"xxh3:')
    raw[at] = ord("f") if raw[at] != ord("f") else ord("0")
    with pytest.raises(DecodeError, match="data check mismatch"):
        decode(bytes(raw))


def test_an_older_writers_crc32_is_still_read_and_verified() -> None:
    """A payload as an older omnikv wrote it with ``payload_checksum: true`` (``ck``, no
    ``dc``) decodes, and its crc32 still catches a flipped bit."""
    data = sample()
    raw = data.to_bytes(checksum=False)
    header = _header(raw)
    payload = raw[_data_start(raw) :]
    header.pop("al")  # written unpadded here, as the reference does
    header["ck"] = f"crc32:{zlib.crc32(payload) & 0xFFFFFFFF:08x}"
    old = header_payload(header, payload)
    assert_same(data, decode(old))
    bad = bytearray(old)
    bad[-1] ^= 0x10
    with pytest.raises(DecodeError, match="checksum mismatch"):
        decode(bytes(bad))


def test_readers_of_the_reference_format_read_checked_payloads() -> None:
    """The check is an extension the reference's reader ignores; ours ignores extensions it
    does not know (a newer writer's) the same way."""
    data = _mixed()
    raw = data.to_bytes()
    assert "dc" in _header(raw)
    assert_same(data, ref_from_bytes(raw))
    header = _header(raw)
    header["zz"] = {"a newer writer's": "extension"}
    text = json.dumps(header).encode()
    pad = _data_start(raw) - 4 - len(text)
    assert pad >= 0  # the padded header has room for it
    newer = struct.pack(">I", len(text) + pad) + text + b" " * pad + raw[_data_start(raw) :]
    assert_same(data, decode(newer))
