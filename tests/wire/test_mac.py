"""The KV MAC computed by the encoder from the one coding it makes (:class:`PayloadSeal`): the
MAC written into the header is :func:`kv_mac` of the tensors a receiver decodes (plain or
wire-coded, whole or in a list of sealed ranges, host or any buffer), it never carries the
secret, and a payload carries at most one."""

from __future__ import annotations

import json

import pytest
import torch

from omnikv.errors import EncodeError
from omnikv.wire.codec import Coded, encode_rows
from omnikv.wire.decode import decode_kv
from omnikv.wire.encode import PackedPayload
from omnikv.wire.mac import PayloadSeal, kv_mac

SECRET = b"s3cret"


def _kv(layers: int = 3, tokens: int = 6) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    keys = [torch.randn(tokens, 2, 8, generator=g).to(torch.bfloat16) for _ in range(layers)]
    values = [torch.randn(tokens, 2, 8, generator=g).to(torch.bfloat16) for _ in range(layers)]
    return keys, values


def _decoded_mac(raw: bytes, key: str, start: int, first: int = 0) -> tuple[str, dict]:
    kv = decode_kv(raw)
    pairs = [(k, v) for k, v in zip(kv.key_cache, kv.value_cache, strict=True) if k is not None]
    return kv_mac(SECRET, key, pairs, start, first), kv.metadata


def test_the_encoders_mac_is_kv_mac_of_what_the_receiver_decodes() -> None:
    keys, values = _kv()
    seal = PayloadSeal(SECRET, "tid.bind", start=16, first_layer=2)
    plan = PackedPayload("tid.bind", keys, values, metadata={"omnikv_mac": seal, "n": 1})
    raw = plan.to_bytes()
    want, meta = _decoded_mac(raw, "tid.bind", 16, 2)
    assert meta["omnikv_mac"] == want == seal.value
    assert want == kv_mac(SECRET, "tid.bind", list(zip(keys, values, strict=True)), 16, 2)
    assert want.startswith("omnikv-kv-v4:") and seal.placeholder not in raw.decode("latin-1")
    # the same plan into a tensor at an odd offset (torch copies): the same MAC
    buf = torch.zeros(plan.nbytes + 3, dtype=torch.uint8)
    plan.pack_into(buf, 3)
    assert _decoded_mac(buf[3:].numpy().tobytes(), "tid.bind", 16, 2)[0] == want
    assert seal.value == want


def test_a_seal_inside_sealed_ranges_is_filled_in_its_place() -> None:
    keys, values = _kv(tokens=4)
    seal = PayloadSeal(SECRET, "tid.bind", start=8)
    sealed = [[0, 8, "omnikv-kv-v4:" + "1" * 32], [8, 12, seal]]
    raw = PackedPayload("k", keys, values, metadata={"omnikv_sealed": sealed}).to_bytes()
    want, meta = _decoded_mac(raw, "tid.bind", 8)
    assert meta["omnikv_sealed"] == [[0, 8, "omnikv-kv-v4:" + "1" * 32], [8, 12, want]]


@pytest.mark.parametrize("codec", ["int8", "fp8_e4m3"])
def test_with_a_wire_codec_the_mac_covers_the_decoded_kv(codec: str) -> None:
    """The encoder codes once; the MAC is over the tensors decoded from that coding, which is
    what the receiver's decoder returns (so coded KV is verified, not trusted)."""
    keys, values = _kv()
    seal = PayloadSeal(SECRET, "tid.bind")
    coded_k = [encode_rows(k, codec) for k in keys]
    coded_v = [encode_rows(v, codec) for v in values]
    raw = PackedPayload(
        "k", coded_k, coded_v, metadata={"omnikv_mac": seal}, coded=Coded(codec, "bfloat16")
    ).to_bytes()
    want, meta = _decoded_mac(raw, "tid.bind", 0)
    assert meta["omnikv_mac"] == want == seal.value
    plain = kv_mac(SECRET, "tid.bind", list(zip(keys, values, strict=True)))
    assert want != plain  # the lossy codec changed the values: the MAC is of what arrives


def test_a_damaged_tensor_fails_the_consumers_mac() -> None:
    keys, values = _kv()
    raw = bytearray(
        PackedPayload(
            "k", keys, values, metadata={"omnikv_mac": PayloadSeal(SECRET, "tid.bind")}
        ).to_bytes()
    )
    raw[-1] ^= 1
    kv = decode_kv(bytes(raw), verify=False)  # past the data check: the MAC still refuses
    pairs = list(zip(kv.key_cache, kv.value_cache, strict=True))
    assert kv_mac(SECRET, "tid.bind", pairs) != kv.metadata["omnikv_mac"]


def test_one_seal_per_payload_no_secret_in_sight_and_no_one_mac_for_different_bytes() -> None:
    keys, values = _kv()
    seal = PayloadSeal(SECRET, "tid.bind")
    assert "s3cret" not in repr(seal) and "s3cret" not in json.dumps(seal.placeholder)
    with pytest.raises(EncodeError, match="at most one MAC seal"):
        PackedPayload("k", keys, values, metadata={"a": seal, "b": [PayloadSeal(SECRET, "x")]})
    PackedPayload("k", keys, values, metadata={"m": seal}).to_bytes()
    first = seal.value
    assert first is not None
    PackedPayload("k", keys, values, metadata={"m": seal}).to_bytes()
    assert seal.value == first  # the same bytes again: the same MAC
    PackedPayload("k", keys[:1], values[:1], metadata={"m": seal}).to_bytes()
    assert seal.value is None  # two payloads of different bytes: no one MAC


def test_threads_change_the_speed_never_the_mac() -> None:
    import blake3

    g = torch.Generator().manual_seed(9)
    big = [(torch.randn(2048, 4, 64, generator=g).half(), torch.randn(2048, 4, 64).half())]
    macs = {kv_mac(SECRET, "k", big, threads=t) for t in (1, 2, blake3.blake3.AUTO)}
    assert len(macs) == 1
