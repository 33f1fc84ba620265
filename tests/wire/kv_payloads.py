"""Payloads and malformed inputs shared by the wire tests (imported by its basename, like the
shm tests' ``test_shm_peer``): a sample request, a byte-exact comparison, hand-made headers,
and the tables of malformed framings and header fields every decode path must refuse."""

from __future__ import annotations

import json
import struct

import numpy as np
import torch

from omnikv.wire.format import MAX_LAYERS
from omnikv.wire.transfer_data import KVCacheTransferData


def sample(
    layers: int = 3, tokens: int = 5, dtype: torch.dtype = torch.float16
) -> KVCacheTransferData:
    g = torch.Generator().manual_seed(0)
    k = [torch.randn(tokens, 2, 8, generator=g).to(dtype) for _ in range(layers)]
    v = [torch.randn(tokens, 2, 8, generator=g).to(dtype) for _ in range(layers)]
    return KVCacheTransferData(
        "req-1", {"key_cache": k, "value_cache": v}, [4, 7], {"seq_len": tokens}
    )


def assert_same(data: KVCacheTransferData, out: dict) -> None:
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


def raw_int_view(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def header_payload(header: dict, data: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack(">I", len(raw)) + raw + data


def good_header() -> dict:
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
    ("not an object", header_payload([1, 2]), "Expected `object`, got `array`"),  # type: ignore[arg-type]
    (
        "deep nesting",
        struct.pack(">I", 200000) + b"[" * 100000 + b"]" * 100000,
        "nested too deeply|JSON|Expected `object`",
    ),
]


def _mutated(**changes: object) -> bytes:
    header = good_header()
    for key, value in changes.items():
        if key.startswith("td_"):
            header["td"][0][key[3:]] = value
        elif value is None:
            del header[key]
        else:
            header[key] = value
    return header_payload(header, b"\x00" * 8)


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
    ("unknown data check", {"dc": "md5:" + "0" * 33}, "data check of an unknown form"),
    ("short data check", {"dc": "xxh3:00"}, "data check of an unknown form"),
    ("data check not str", {"dc": 7}, "Expected `str \\| null`, got `int`"),
    ("wrong data check", {"dc": "xxh3:" + "0" * 32}, "data check mismatch"),
]


def field_case(label: str, changes: dict) -> bytes:
    """The payload of one ``FIELD_CASES`` row."""
    if label != "bad name":
        return _mutated(**changes)
    header = good_header()
    header["td"][0]["n"] = "key_cache_zz"
    del header["td"][0]["i"]
    return header_payload(header, b"\x00" * 8)


def as_array(raw: bytes, shift: int = 0) -> np.ndarray:
    """``raw`` in a fresh 1-D uint8 numpy array, starting ``shift`` bytes past an aligned
    address (numpy aligns its allocations to at least 16 bytes)."""
    backing = np.zeros(len(raw) + 64, dtype=np.uint8)
    start = -backing.ctypes.data % 64 + shift
    arr = backing[start : start + len(raw)]
    arr[:] = np.frombuffer(raw, dtype=np.uint8)
    return arr
