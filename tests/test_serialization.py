"""omnikv.serialization: OmniSerializer (the reference's name and calls) and object framing."""

from __future__ import annotations

import dataclasses
import time
import types

import msgpack
import numpy as np
import pytest
import torch

from omnikv.errors import DecodeError
from omnikv.serialization import MAGIC, OmniSerializer, decode_object, encode_object, is_object


def _round(obj: object) -> object:
    return OmniSerializer.deserialize(OmniSerializer.serialize(obj))


def test_importable_where_the_reference_has_it() -> None:
    from omnikv.connectors import OmniSerializer as FromConnectors

    assert FromConnectors is OmniSerializer


def test_dicts_and_scalars_round_trip() -> None:
    obj = {"a": [1, 2.5, "s", None, True], "b": {"nested": b"\x00\x01"}, 3: "int key"}
    assert _round(obj) == obj


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.int64])
def test_tensors_round_trip_with_dtype_and_shape(dtype: torch.dtype) -> None:
    t = torch.arange(24).reshape(2, 3, 4).to(dtype)
    out = _round({"t": t})["t"]  # type: ignore[index]
    assert out.dtype == dtype and out.shape == t.shape and torch.equal(out, t)


def test_non_contiguous_tensors_round_trip_by_value() -> None:
    base = torch.arange(60, dtype=torch.float32).reshape(3, 4, 5)
    for t in (base.transpose(0, 2), base[:, ::2, 1:], base.expand(2, 3, 4, 5)[1]):
        out = _round(t)
        assert isinstance(out, torch.Tensor) and torch.equal(out, t) and out.is_contiguous()


def test_empty_and_zero_dim_tensors_round_trip() -> None:
    for t in (torch.empty(0, 4), torch.tensor(3.5)):
        out = _round(t)
        assert isinstance(out, torch.Tensor) and out.shape == t.shape and torch.equal(out, t)


def test_numpy_arrays_round_trip() -> None:
    a = np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2]
    out = _round({"a": a, "s": np.int64(5)})
    assert np.array_equal(out["a"], a) and out["a"].dtype == np.float32  # type: ignore[index]
    assert out["s"] == 5  # type: ignore[index]


def test_dataclasses_travel_as_maps_and_slices_as_slices() -> None:
    @dataclasses.dataclass
    class Params:
        n: int
        window: slice

    assert _round(Params(2, slice(1, 9, 2))) == {"n": 2, "window": slice(1, 9, 2)}


def test_what_cannot_travel_without_pickle_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="SimpleNamespace"):
        OmniSerializer.serialize(types.SimpleNamespace(a=1))
    with pytest.raises(TypeError, match="allowlist"):
        OmniSerializer.serialize(np.array([object()], dtype=object))


def _ext(code: int, parts: list[object]) -> bytes:
    inner = msgpack.packb(parts, use_bin_type=True)
    return msgpack.packb(msgpack.ExtType(code, inner), use_bin_type=True)


def test_dtypes_outside_the_allowlist_are_refused() -> None:
    with pytest.raises(DecodeError, match="allowlist"):
        OmniSerializer.deserialize(_ext(1, ["Tensor", [1], b"\x00"]))
    with pytest.raises(DecodeError, match="allowlist"):
        OmniSerializer.deserialize(_ext(2, ["object", [1], b"\x00" * 8]))


def test_claimed_sizes_must_match_the_bytes_present() -> None:
    t0 = time.perf_counter()
    with pytest.raises(DecodeError, match="needs"):
        OmniSerializer.deserialize(_ext(1, ["float32", [1 << 20, 1 << 20], b"\x00" * 16]))
    assert time.perf_counter() - t0 < 0.05  # nothing of the claimed size was allocated
    with pytest.raises(DecodeError, match="shape"):
        OmniSerializer.deserialize(_ext(1, ["float32", [-1], b""]))


def test_malformed_input_is_a_decode_error() -> None:
    for bad in (b"\xc1", _ext(9, [1]), _ext(1, ["float32"]), b"\x92\x01"):
        with pytest.raises(DecodeError):
            OmniSerializer.deserialize(bad)


def test_object_framing_is_told_apart_from_kv_payloads() -> None:
    framed = encode_object({"k": [1]})
    assert framed.startswith(MAGIC) and is_object(framed)
    assert decode_object(torch.frombuffer(bytearray(framed), dtype=torch.uint8)) == {"k": [1]}
    assert not is_object(b"\x00\x00\x00\x10{}")
    with pytest.raises(DecodeError, match="magic"):
        decode_object(b"\x00\x00\x00\x10{}")
