"""Hostile payloads: the attacks reported against the decoder, then property-based payloads
(random byte and header mutations, and structured attacks: overlapping and aliased spans, huge
shapes, deep nesting, oversized headers) generated on every run. The decoder only ever succeeds
or raises DecodeError (a ValueError), fast, without allocating what the payload claims."""

from __future__ import annotations

import json
import struct
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omnikv import OmniKVCacheConfig, OmniKVTransferManager, TransferOptions
from omnikv.bench.reference import ref_to_bytes
from omnikv.connectors.local import LocalConnector
from omnikv.errors import DecodeError
from omnikv.transfer.receive import ReceiveStatus
from omnikv.wire.decode import decode, decode_kv
from omnikv.wire.format import MAX_LAYERS
from omnikv.wire.frames import decode_frame, encode_frame
from omnikv.wire.transfer_data import KVCacheTransferData

_K = [torch.arange(24, dtype=torch.float16).view(3, 2, 4), None]
_V = [torch.ones(3, 2, 4, dtype=torch.bfloat16), torch.zeros(0, 2, 4)]
SEEDS = [
    KVCacheTransferData("seed", {"key_cache": _K, "value_cache": _V}, [1, 2], {"a": 1}).to_bytes(),
    KVCacheTransferData("ck", {"key_cache": _K, "value_cache": _V}).to_bytes(checksum=True),
    ref_to_bytes("ref", [torch.ones(2, 1, 3)], [torch.zeros(2, 1, 3)], [5], {"m": [1]}),
]
FUZZ = settings(
    max_examples=400,
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
@pytest.mark.slow
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
@pytest.mark.slow
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


STRUCTURED = settings(
    max_examples=300,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _payload(td: list[dict[str, Any]], data_len: int, nl: int = 1, **extra: Any) -> bytes:
    header = {"rid": "r", "bids": [], "meta": {}, "td": td, "nl": nl, **extra}
    body = json.dumps(header, separators=(",", ":")).encode()
    return struct.pack(">I", len(body)) + body + bytes(data_len)


def _desc(name: str, o: int, b: int, shape: list[int], dtype: str = "uint8") -> dict[str, Any]:
    return {"n": name, "d": dtype, "s": shape, "o": o, "b": b}


def _fastest(fn: Callable[[], Any], tries: int = 5) -> float:
    """The shortest of ``tries`` runs of ``fn``: its cost, without the noise of a loaded machine
    (2 CPUs shared by the whole test run)."""
    times = []
    for _ in range(tries):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _rejected_fast(raw: bytes, match: str, decoder: Callable[..., Any] = decode_kv) -> None:
    """DecodeError matching ``match`` in < 50 ms; < 16 MiB traced allocations."""

    def attempt() -> None:
        with pytest.raises(DecodeError, match=match):
            decoder(raw)

    assert _fastest(attempt) < 0.05
    tracemalloc.start()  # (slows allocation down: timed separately, above)
    try:
        with pytest.raises(DecodeError, match=match):
            decoder(raw)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, peak


# --------------------------------------------------------------------------------------------
# The reported attacks
# --------------------------------------------------------------------------------------------
def test_8192_descriptors_over_the_same_bytes_are_rejected_fast() -> None:
    # the report: 590 KiB, 8192 descriptors all covering the same bytes: +518 MB, 7.7 s, "ok"
    shape = [64, 1024]
    td = [_desc(f"key_cache_{i}", 0, 65536, shape) for i in range(8192)]
    _rejected_fast(_payload(td, 65536, nl=8192), "nl=8192 outside|more than")
    # under the count bound, the same bytes claimed by every layer: overlap
    n = MAX_LAYERS
    td = [_desc(f"key_cache_{i}", 0, 65536, shape) for i in range(n)]
    td += [_desc(f"value_cache_{i}", 0, 65536, shape) for i in range(n)]
    _rejected_fast(_payload(td, 65536, nl=n), "overlaps")


def test_key_and_value_at_the_same_bytes_are_rejected() -> None:
    td = [_desc("key_cache_0", 0, 64, [64]), _desc("value_cache_0", 0, 64, [64])]
    _rejected_fast(_payload(td, 64), "overlaps")
    td = [_desc("key_cache_0", 0, 64, [64]), _desc("value_cache_0", 32, 64, [64])]
    _rejected_fast(_payload(td, 128), "overlaps")


def test_copy_out_never_allocates_more_than_the_data_section() -> None:
    """copy=True gives every tensor memory of its own, exactly its size (the sum is at most the
    data section), and the tensors outlive the input buffer."""
    k = [torch.randn(16, 2, 8).to(torch.float16), torch.randn(3, 5)]
    v = [torch.ones(16, 2, 8, dtype=torch.bfloat16), torch.arange(7, dtype=torch.int64)]
    raw = bytearray(KVCacheTransferData("r", {"key_cache": k, "value_cache": v}).to_bytes())
    (hlen,) = struct.unpack(">I", raw[:4])
    out = decode_kv(raw, copy=True)
    tensors = [t for t in (*out.key_cache, *out.value_cache) if t is not None]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    assert len(storages) == len(tensors)
    assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in tensors)
    assert sum(storages.values()) <= len(raw) - 4 - hlen
    raw[:] = bytes(len(raw))  # the input is reused: the copies do not change
    assert torch.equal(out.key_cache[0], k[0]) and torch.equal(out.value_cache[1], v[1])


@pytest.mark.parametrize(
    ("shape", "b"),
    [([2**62, 2**62, 0], 0), ([10**30, 0], 0), ([2**62, 2**62, 2**62], 8), ([-1, 4], 0)],
)
def test_absurd_shapes_are_decode_errors(shape: list[int], b: int) -> None:
    _rejected_fast(_payload([_desc("key_cache_0", 0, b, shape)], 8), "td\\[0\\]")
    _rejected_fast(_payload([_desc("key_cache_0", 0, b, shape)], 8), "td\\[0\\]", decode)


def test_header_over_the_limit_is_rejected_before_parsing() -> None:
    meta = {"pad": "x" * (2 << 20)}
    body = json.dumps({"rid": "r", "bids": [], "meta": meta, "td": [], "nl": 0}).encode()
    raw = struct.pack(">I", len(body)) + body
    _rejected_fast(raw, "exceeds the limit of 1048576")
    assert decode_kv(raw, max_header_bytes=4 << 20).metadata == meta  # configurable
    with pytest.raises(DecodeError, match="exceeds the limit of 40 bytes"):
        decode_kv(_payload([], 0), max_header_bytes=40)


def test_misaligned_spans_in_an_aligned_payload_are_rejected() -> None:
    td = [_desc("key_cache_0", 2, 8, [2], "float32")]
    _rejected_fast(_payload(td, 16, al=64), "misaligned for float32")


def test_legacy_payload_with_odd_offsets_is_copied_out_not_refused() -> None:
    # the reference writes no alignment: an odd offset is legal there; the tensor is copied
    raw = _payload([_desc("key_cache_0", 1, 8, [2], "float32")], 9)
    out = decode_kv(raw)
    t = out.key_cache[0]
    assert t is not None and t.tolist() == [0.0, 0.0] and t.data_ptr() % 4 == 0


def test_spans_beyond_dl_are_rejected() -> None:
    td = [_desc("key_cache_0", 0, 16, [16])]
    _rejected_fast(_payload(td, 64, dl=8), "outside data section of 8 bytes")
    _rejected_fast(_payload(td, 8, dl=64), "dl=64 outside")


# --------------------------------------------------------------------------------------------
# Structured hostile payloads, generated on every run
# --------------------------------------------------------------------------------------------
dtypes = st.sampled_from(["uint8", "float16", "float32", "int64"])
_SIZES = {"uint8": 1, "float16": 2, "float32": 4, "int64": 8}


@STRUCTURED
@given(
    layers=st.integers(1, 6),
    dtype=dtypes,
    numel=st.integers(1, 64),
    victim=st.integers(0, 11),
    shift=st.integers(-63, 63),
    aligned=st.booleans(),
)
def test_overlapping_spans_are_always_rejected(
    layers: int, dtype: str, numel: int, victim: int, shift: int, aligned: bool
) -> None:
    size = numel * _SIZES[dtype]
    td = [_desc(f"key_cache_{i}", i * size, size, [numel], dtype) for i in range(layers)]
    td += [
        _desc(f"value_cache_{i}", (layers + i) * size, size, [numel], dtype) for i in range(layers)
    ]
    target = td[victim % len(td)]
    other = td[(victim + 1) % len(td)]
    # move one span so it starts inside another (by at least one element, within its bytes)
    step = _SIZES[dtype]
    delta = (shift % max(1, numel)) * step
    target["o"] = other["o"] + min(delta, size - step)
    extra = {"al": 64} if aligned else {}
    with pytest.raises(DecodeError, match=r"overlaps|duplicate"):
        decode_kv(_payload(td, (2 * layers + 1) * size, nl=layers, **extra))


@STRUCTURED
@given(
    shape=st.lists(
        st.one_of(st.integers(0, 4), st.integers(2**20, 2**70), st.integers(-(2**40), -1)),
        min_size=0,
        max_size=10,
    ),
    dtype=dtypes,
    b=st.one_of(st.integers(0, 64), st.integers(2**31, 2**66)),
)
def test_huge_or_negative_shapes_fail_cleanly(shape: list[int], dtype: str, b: int) -> None:
    raw = _payload([_desc("key_cache_0", 0, b, shape, dtype)], 64)

    def attempt() -> None:
        try:
            out = decode_kv(raw)
        except DecodeError:
            return
        t = out.key_cache[0]
        assert t is not None and t.numel() * t.element_size() == b <= 64

    assert _fastest(attempt, tries=2) < 0.05


def _nested_json(depth: int) -> str:
    return "[" * depth + "1" + "]" * depth


@STRUCTURED
@given(depth=st.integers(0, 5000))
@pytest.mark.slow
def test_deep_metadata_nesting_fails_cleanly(depth: int) -> None:
    body = (
        '{"rid":"r","bids":[],"meta":{"x":' + _nested_json(depth) + '},"td":[],"nl":0}'
    ).encode()
    try:
        out = decode_kv(struct.pack(">I", len(body)) + body)
    except DecodeError as exc:
        assert "nested too deeply" in str(exc)
    else:
        assert out.metadata["x"] == json.loads(_nested_json(depth))


def _frame_with_nesting(depth: int) -> torch.Tensor:
    value: Any = 1
    for _ in range(depth):
        value = (value,)
    frame = encode_frame({"t": torch.ones(2)})
    buf = torch.empty(frame.nbytes, dtype=torch.uint8)
    frame.pack_into(buf)
    return _replace_structure(buf, frame.region_offset, depth)


def _replace_structure(buf: torch.Tensor, region: int, depth: int) -> torch.Tensor:
    import msgpack

    inner: Any = 1
    for _ in range(depth):
        inner = msgpack.ExtType(3, msgpack.packb([inner]))
    structure = msgpack.packb({"x": inner})
    fixed = struct.Struct(">4sIQ")
    offset = (fixed.size + len(structure) + 63) // 64 * 64
    out = torch.zeros(offset + buf.numel() - region, dtype=torch.uint8)
    head = fixed.pack(b"OKVD", len(structure), offset) + structure
    out[: len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
    out[offset:] = buf[region:]
    return out


@STRUCTURED
@given(depth=st.integers(0, 400))
def test_deep_frame_nesting_is_bounded(depth: int) -> None:
    msg = _frame_with_nesting(depth)
    if depth <= 32:
        value = decode_frame(msg)["x"]
        for _ in range(depth):
            value = value[0]
        assert value == 1
    else:
        with pytest.raises(DecodeError, match="nested deeper"):
            decode_frame(msg)


@STRUCTURED
@given(size=st.integers(0, 3 << 20), limit=st.sampled_from([4096, 1 << 20, 2 << 20]))
def test_header_size_limit_holds_for_any_size(size: int, limit: int) -> None:
    base = '{"rid":"r","bids":[],"meta":{},"td":[],"nl":0}'
    body = (base + " " * max(0, size - len(base))).encode()
    raw = struct.pack(">I", len(body)) + body

    def attempt() -> None:
        if len(body) > limit:
            with pytest.raises(DecodeError, match="exceeds the limit"):
                decode_kv(raw, max_header_bytes=limit)
        else:
            assert decode_kv(raw, max_header_bytes=limit).num_layers == 0

    assert _fastest(attempt, tries=2) < 0.05


# --------------------------------------------------------------------------------------------
# Through the public receive path: a hostile payload is a `corrupt` outcome, quickly
# --------------------------------------------------------------------------------------------
HOSTILE = {
    "aliased": _payload(
        [_desc("key_cache_0", 0, 64, [64]), _desc("value_cache_0", 0, 64, [64])], 64
    ),
    "huge_zero": _payload([_desc("key_cache_0", 0, 0, [2**62, 2**62, 0])], 8),
    "huge_1e30": _payload([_desc("key_cache_0", 0, 0, [10**30, 0])], 8),
    "many_layers": _payload(
        [_desc(f"key_cache_{i}", 0, 64, [64]) for i in range(8192)], 64, nl=8192
    ),
}


@pytest.mark.parametrize("receive_copy", ["auto", "copy"])
@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_payload_is_a_corrupt_outcome(namespace: str, name: str, receive_copy: str) -> None:
    conn = {"type": "LocalConnector", "namespace": namespace}
    receiver = OmniKVTransferManager(
        OmniKVCacheConfig(
            connector_config=conn, from_stage="s1", stage_id="s2", need_recv_cache=True
        ),
        options=TransferOptions(receive_copy=receive_copy),
    )
    LocalConnector({"namespace": namespace}).put(
        "s1", "s2", f"omni_s1_to_s2_kv_cache_{name}", HOSTILE[name]
    )
    start = time.monotonic()
    assert receiver.receive_kv_cache_for_request(name) == (None, 0)
    assert time.monotonic() - start < 5.0  # not the 30 s receive timeout: refused at once
    result = receiver.get_receive_result(name)
    assert result is not None and result.status is ReceiveStatus.CORRUPT
