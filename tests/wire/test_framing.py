"""Intra-stage message framing: round trips, shared tensors, and hostile messages."""

from __future__ import annotations

import struct
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import msgpack
import pytest
import torch

from omnikv.errors import DecodeError, EncodeError
from omnikv.wire.frames import MAGIC, decode_frame, encode_frame

_FIXED = struct.Struct(">4sIQ")


def _packed(payload: dict) -> torch.Tensor:
    frame = encode_frame(payload)
    buf = torch.empty(frame.nbytes, dtype=torch.uint8)
    assert frame.pack_into(buf) == frame.nbytes
    return buf


def _with_structure(structure: bytes) -> torch.Tensor:
    """A message whose tensor region is a valid payload and whose structure is ``structure``."""
    good = encode_frame({"t": torch.ones(4)})
    buf = torch.empty(good.nbytes, dtype=torch.uint8)
    good.pack_into(buf)
    region = buf[good.region_offset :]
    offset = (_FIXED.size + len(structure) + 63) // 64 * 64
    out = torch.zeros(offset + region.numel(), dtype=torch.uint8)
    head = _FIXED.pack(MAGIC, len(structure), offset) + structure
    out[: len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
    out[offset:] = region
    return out


def _nested_tuples(depth: int) -> bytes:
    inner: object = 1
    for _ in range(depth):
        inner = msgpack.ExtType(3, msgpack.packb([inner]))
    return msgpack.packb({"x": inner})


def test_round_trip_namespaces_tuples_and_shared_tensors() -> None:
    k, v = torch.arange(6.0).view(2, 3), torch.ones(2, 3, dtype=torch.bfloat16)
    kv = SimpleNamespace(key_cache=[k], value_cache=[v])
    payload = {"past_key_values": kv, "sp.past_key_values": kv, "meta": {"rope": (1, "x")}}
    out = decode_frame(_packed(payload))
    assert torch.equal(out["past_key_values"].key_cache[0], k)
    assert out["past_key_values"].value_cache[0].dtype == torch.bfloat16
    assert out["meta"] == {"rope": (1, "x")}
    shared = out["sp.past_key_values"].key_cache[0]
    assert shared.data_ptr() == out["past_key_values"].key_cache[0].data_ptr()


def test_decoded_tensors_are_views_of_the_message() -> None:
    buf = _packed({"t": torch.zeros(8)})
    out = decode_frame(buf)
    start, end = buf.data_ptr(), buf.data_ptr() + buf.numel()
    assert start <= out["t"].data_ptr() < end


def test_unframeable_values_are_encode_errors() -> None:
    with pytest.raises(EncodeError, match="cannot frame"):
        encode_frame({"x": object()})
    deep: object = 1
    for _ in range(40):
        deep = [deep]
    with pytest.raises(EncodeError, match="deeper"):
        encode_frame({"x": deep})


def test_nesting_up_to_the_bound_decodes() -> None:
    out = decode_frame(_with_structure(_nested_tuples(30)))
    value = out["x"]
    for _ in range(30):
        assert isinstance(value, tuple)
        value = value[0]
    assert value == 1


@pytest.mark.slow
def test_deep_extension_nesting_is_a_decode_error_not_a_crash(tmp_path: Path) -> None:
    # The reported attack: a ~1 KB message of 200 nested tuple extensions crashed the
    # interpreter (C recursion). Decode it in a child so a crash fails this test, not the suite.
    msg = _with_structure(_nested_tuples(200))
    path = tmp_path / "deep.bin"
    path.write_bytes(msg.numpy().tobytes())
    code = (
        "import sys, torch\n"
        "from omnikv.errors import DecodeError\n"
        "from omnikv.wire.frames import decode_frame\n"
        "raw = bytearray(open(sys.argv[1], 'rb').read())\n"
        "try:\n"
        "    decode_frame(torch.frombuffer(raw, dtype=torch.uint8))\n"
        "except DecodeError as exc:\n"
        "    print('DecodeError', exc)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "nested deeper than" in proc.stdout


def test_deep_nesting_is_rejected_quickly_in_process() -> None:
    msg = _with_structure(_nested_tuples(200))
    times = []
    for _ in range(3):  # the fastest of three: the cost, not the load of a shared machine
        start = time.monotonic()
        with pytest.raises(DecodeError, match="nested deeper"):
            decode_frame(msg)
        times.append(time.monotonic() - start)
    assert min(times) < 0.05


@pytest.mark.parametrize(
    ("structure", "match"),
    [
        (msgpack.packb([1, 2]), "top level is not a map"),
        (msgpack.packb({"t": msgpack.ExtType(1, msgpack.packb(7))}), "bad tensor reference"),
        (msgpack.packb({"t": msgpack.ExtType(9, b"")}), "unknown extension type"),
        (msgpack.packb({"t": msgpack.ExtType(2, msgpack.packb([1]))}), "namespace"),
        (msgpack.packb({"t": msgpack.ExtType(3, msgpack.packb({"a": 1}))}), "tuple is not"),
        (b"\xc1", "corrupt distribution message"),
        (b"\x91" * 5000 + b"\x01", "corrupt distribution message"),
    ],
)
def test_malformed_structures(structure: bytes, match: str) -> None:
    with pytest.raises(DecodeError, match=match):
        decode_frame(_with_structure(structure))


def test_malformed_fixed_header() -> None:
    buf = _packed({"t": torch.ones(2)})
    bad = buf.clone()
    bad[0] = 0
    with pytest.raises(DecodeError, match="magic"):
        decode_frame(bad)
    with pytest.raises(DecodeError, match="no fixed header"):
        decode_frame(buf[:10].clone())
    with pytest.raises(DecodeError, match="do not fit"):
        decode_frame(_truncated_region(buf))
    with pytest.raises(DecodeError, match="1-D uint8"):
        decode_frame(torch.zeros(4, dtype=torch.float32))


def _truncated_region(buf: torch.Tensor) -> torch.Tensor:
    magic, slen, _ = _FIXED.unpack(buf[: _FIXED.size].numpy().tobytes())
    out = buf.clone()
    out[: _FIXED.size] = torch.frombuffer(
        bytearray(_FIXED.pack(magic, slen, buf.numel() + 1)), dtype=torch.uint8
    )
    return out
