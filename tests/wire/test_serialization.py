"""omnikv.wire.serializer: OmniSerializer (the reference's name and calls) and object framing."""

from __future__ import annotations

import dataclasses
import time
import types

import msgpack
import numpy as np
import pytest
import torch

from omnikv.errors import DecodeError
from omnikv.wire.serializer import MAGIC, OmniSerializer, decode_object, encode_object, is_object


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


# -- hostile input: amplification and foreign exceptions (issue 26, item 4) ----------------------
_AMPLIFY_CHILD = r"""
import json, resource, struct, sys, time
import msgpack
from omnikv.errors import DecodeError
from omnikv.wire.serializer import OmniSerializer

def nested_empty_lists(nbytes):
    # 16 MB of 4096 arrays of 4096 empty arrays (no single array is large)
    row = b"\xdc\x10\x00" + b"\x90" * 4096
    return b"\xdc" + struct.pack(">H", nbytes // len(row)) + row * (nbytes // len(row))

def wide_empty_lists(nbytes):
    return b"\xdd" + struct.pack(">I", nbytes) + b"\x90" * nbytes

def tensor_extensions(count):
    ext = msgpack.packb(msgpack.ExtType(1, msgpack.packb(["uint8", [1], b"\x07"])))
    return b"\xdd" + struct.pack(">I", count) + ext * count

attacks = {
    "nested": lambda: nested_empty_lists(16 << 20),
    "wide": lambda: wide_empty_lists(16 << 20),
    "tensors": lambda: tensor_extensions(400_000),
}
results = {}
for name, make in attacks.items():
    data = make()
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times, outcome = [], None
    for _ in range(3):
        t0 = time.perf_counter()
        try:
            OmniSerializer.deserialize(data)
            outcome = "decoded"
        except DecodeError as exc:
            outcome = "DecodeError: " + str(exc)
        times.append(time.perf_counter() - t0)
        if times[-1] > 1.0:
            break
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base
    results[name] = {"bytes": len(data), "outcome": outcome, "best_s": min(times),
                     "grown_kib": grown}
    del data
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def amplification() -> dict[str, dict[str, object]]:
    """Each attack decoded (three times, stopping after a slow one) in one fresh interpreter,
    killed at 90 s: its outcome, best time and peak memory growth."""
    import json
    import subprocess
    import sys

    try:
        proc = subprocess.run(
            [sys.executable, "-c", _AMPLIFY_CHILD],
            capture_output=True,
            text=True,
            timeout=90,
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("decoding the amplification attacks ran past 90 s")
    assert proc.returncode == 0, proc.stderr[-2000:]
    result: dict[str, dict[str, object]] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize("attack", ["nested", "wide", "tensors"])
@pytest.mark.slow
def test_amplifying_input_is_refused_fast_with_bounded_memory(
    amplification: dict[str, dict[str, object]], attack: str
) -> None:
    """16 MB of (nested or wide) empty lists and 400,000 tiny tensor extensions in ~6 MB are
    refused with a DecodeError naming the budget in under 50 ms (best of three), growing the
    decoding process's peak memory by under 64 MiB."""
    res = amplification[attack]
    assert str(res["outcome"]).startswith("DecodeError") and "budget" in str(res["outcome"]), res
    assert float(res["best_s"]) < 0.05, res  # type: ignore[arg-type]
    assert int(res["grown_kib"]) < 64 * 1024, res  # type: ignore[call-overload]


def test_a_decoder_budget_is_proportional_to_the_input() -> None:
    from omnikv.wire.serializer import object_budget

    small, large = object_budget(0), object_budget(16 << 20)
    assert small >= 4096 and large > small
    assert object_budget(1 << 30) - object_budget(1 << 29) == (1 << 29) // 512
    # an object of many containers within the budget of its size still decodes
    obj = [[i] for i in range(small - 1)]
    assert OmniSerializer.deserialize(OmniSerializer.serialize(obj)) == obj
    # so do 500 small tensors in a small object
    tensors = [torch.full((4,), float(i)) for i in range(500)]
    out = OmniSerializer.deserialize(OmniSerializer.serialize(tensors))
    assert isinstance(out, list) and len(out) == len(tensors)
    assert all(torch.equal(a, b) for a, b in zip(out, tensors, strict=True))


@pytest.mark.parametrize(
    "shape",
    [[1 << 62, 1 << 62, 0], [(1 << 64) - 1, 0], [1 << 40, 1 << 40, 1 << 40, 0]],
)
def test_foreign_exceptions_from_decoding_become_decode_errors(shape: list[int]) -> None:
    """torch refuses these (zero-element) shapes with its own exception types."""
    with pytest.raises(DecodeError):
        OmniSerializer.deserialize(_ext(1, ["float32", shape, b""]))


def test_unhashable_and_nested_garbage_is_a_decode_error() -> None:
    key_is_list = b"\x81\x91\x01\x02"  # {[1]: 2}
    deep = b"\x91" * 100_000 + b"\x90"
    for bad in (key_is_list, deep, _ext(3, [1, 2, "x"]), _ext(2, ["float32", [2], b"\x00"])):
        with pytest.raises(DecodeError):
            OmniSerializer.deserialize(bad)
