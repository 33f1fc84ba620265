"""Property-based: 10,000 mutated payloads in all; the decoder only ever succeeds or raises
DecodeError (a ValueError) - never another exception, a crash, a hang or a huge allocation."""

from __future__ import annotations

import json
import struct
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omnikv.bench.reference import ref_to_bytes
from omnikv.errors import DecodeError
from omnikv.payload import KVCacheTransferData, decode

_K = [torch.arange(24, dtype=torch.float16).view(3, 2, 4), None]
_V = [torch.ones(3, 2, 4, dtype=torch.bfloat16), torch.zeros(0, 2, 4)]
SEEDS = [
    KVCacheTransferData("seed", {"key_cache": _K, "value_cache": _V}, [1, 2], {"a": 1}).to_bytes(),
    KVCacheTransferData("ck", {"key_cache": _K, "value_cache": _V}).to_bytes(checksum=True),
    ref_to_bytes("ref", [torch.ones(2, 1, 3)], [torch.zeros(2, 1, 3)], [5], {"m": [1]}),
]
FUZZ = settings(
    max_examples=5_000,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _check(raw: Any) -> None:
    try:
        out = decode(raw)
    except DecodeError:
        return
    assert isinstance(out, dict)
    total = len(raw)
    for cache in ("key_cache", "value_cache"):
        for t in out["layer_blocks"][cache]:
            if t is not None:
                assert t.numel() * t.element_size() <= total


byte_mutation = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 10_000), st.integers(1, 255)),
    st.tuples(st.just("truncate"), st.integers(0, 10_000), st.just(0)),
    st.tuples(st.just("insert"), st.integers(0, 10_000), st.integers(0, 255)),
    st.tuples(st.just("delete"), st.integers(0, 10_000), st.integers(1, 64)),
    st.tuples(st.just("length"), st.integers(0, 2**32 - 1), st.just(0)),
)


@FUZZ
@given(seed=st.sampled_from(SEEDS), mutations=st.lists(byte_mutation, min_size=1, max_size=6))
def test_byte_level_mutations(seed: bytes, mutations: list[tuple[str, int, int]]) -> None:
    raw = bytearray(seed)
    for op, pos, arg in mutations:
        if not raw and op != "insert":
            continue
        p = pos % max(1, len(raw))
        if op == "flip":
            raw[p] ^= arg
        elif op == "truncate":
            del raw[p:]
        elif op == "insert":
            raw[p:p] = bytes([arg])
        elif op == "delete":
            del raw[p : p + arg]
        elif op == "length" and len(raw) >= 4:
            raw[:4] = struct.pack(">I", pos)
    _check(bytes(raw))


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True)
    | st.text(max_size=12),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=4), children, max_size=4)
    ),
    max_leaves=12,
)
header_keys = st.sampled_from(["rid", "bids", "meta", "td", "nl", "v", "bo", "dl", "ck", "al"])
desc_keys = st.sampled_from(["n", "i", "d", "s", "o", "b", "x"])


@FUZZ
@given(
    seed=st.sampled_from(SEEDS),
    top=st.lists(st.tuples(header_keys, json_values | st.just("__delete__")), max_size=3),
    desc=st.lists(
        st.tuples(st.integers(0, 8), desc_keys, json_values | st.just("__delete__")), max_size=4
    ),
    pad=st.integers(0, 200),
)
def test_structural_header_mutations(
    seed: bytes, top: list[tuple[str, Any]], desc: list[tuple[int, str, Any]], pad: int
) -> None:
    (hlen,) = struct.unpack(">I", seed[:4])
    header = json.loads(seed[4 : 4 + hlen])
    data = seed[4 + hlen :]
    for key, value in top:
        if value == "__delete__":
            header.pop(key, None)
        else:
            header[key] = value
    td = header.get("td")
    if isinstance(td, list) and td:
        for idx, key, value in desc:
            entry = td[idx % len(td)]
            if isinstance(entry, dict):
                if value == "__delete__":
                    entry.pop(key, None)
                else:
                    entry[key] = value
    body = json.dumps(header).encode() + b" " * pad
    _check(struct.pack(">I", len(body)) + body + data)
