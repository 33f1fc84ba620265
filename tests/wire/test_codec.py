"""The optional wire codec (omnikv.wire.codec): error bounds, the format it travels in, refusals,
and a send through two managers with it on."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from conftest import make_paged_caches
from omnikv.errors import DecodeError, EncodeError
from omnikv.wire.codec import CODECS, Coded, decode_rows, encode_rows
from omnikv.wire.decode import decode_kv
from omnikv.wire.encode import PackedPayload

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: The original dtype's rounding of a decoded value, relative (half an ulp at 1).
ROUNDING = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24}


def _rows(dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(33, 4, 64, generator=g) * torch.rand(33, 4, 1, generator=g) * 8
    x[3, 1] = 0.0  # a row of zeros
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("codec", CODECS)
def test_round_trip_stays_within_the_documented_bound(codec: str, dtype: torch.dtype) -> None:
    x = _rows(dtype)
    coded = encode_rows(x, codec)
    assert tuple(coded.shape) == (33, 4, 68) and coded.element_size() == 1
    y = decode_rows(coded, codec, dtype)
    assert y.dtype == dtype and y.shape == x.shape
    xf, yf = x.float(), y.float()
    err = (yf - xf).abs()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    rounding = ROUNDING[dtype] * yf.abs()
    if codec == "int8":
        bound = amax / 254 + rounding
    else:
        scale = amax / 448
        bound = torch.maximum(xf.abs() * 2.0**-4, scale * 2.0**-10) + rounding
    assert bool((err <= bound * (1 + 1e-5) + 1e-12).all()), float((err - bound).max())
    assert bool((y[3, 1] == 0).all())


def test_codec_refuses_what_it_does_not_code() -> None:
    with pytest.raises(EncodeError, match="unknown wire codec"):
        encode_rows(torch.zeros(2, 2, 8), "int4")
    with pytest.raises(EncodeError, match=r"not torch\.int32"):
        encode_rows(torch.zeros(2, 2, 8, dtype=torch.int32), "int8")
    with pytest.raises(DecodeError, match=r"\[\.\.\., head_size \+ 4\]"):
        decode_rows(torch.zeros(2, 2, 4, dtype=torch.int8), "int8", torch.float16)
    with pytest.raises(DecodeError, match="head_size"):
        decode_rows(torch.zeros(2, 2, 12, dtype=torch.uint8), "int8", torch.float16)
    bad = encode_rows(torch.ones(1, 1, 8), "int8").view(torch.uint8).clone()
    bad[0, 0, 8:] = torch.tensor([float("nan")]).view(torch.uint8)
    with pytest.raises(DecodeError, match="not finite"):
        decode_rows(bad.view(torch.int8), "int8", torch.float32)


def _payload(codec: str | None, dtype: torch.dtype = torch.bfloat16) -> tuple[bytes, list[Any]]:
    k = [_rows(dtype, 1), None]
    v = [_rows(dtype, 2), _rows(dtype, 3)]
    if codec is None:
        return PackedPayload("r", k, v, [1, 2], {"seq_len": 33}).to_bytes(), k + v
    coded: Callable[[Any], Any] = lambda t: None if t is None else encode_rows(t, codec)  # noqa: E731
    plan = PackedPayload(
        "r",
        [coded(t) for t in k],
        [coded(t) for t in v],
        [1, 2],
        {"seq_len": 33},
        coded=Coded(codec, "bfloat16"),
    )
    return plan.to_bytes(), k + v


@pytest.mark.parametrize("codec", CODECS)
def test_a_coded_payload_decodes_to_the_original_dtype_and_shapes(codec: str) -> None:
    raw, want = _payload(codec)
    plain, _ = _payload(None)
    assert len(raw) < 0.6 * len(plain)  # half the bytes, plus a scale per row
    out = decode_kv(raw)
    got = [*out.key_cache, *out.value_cache]
    assert got[1] is None
    for g, w in zip(got, want, strict=True):
        if w is None:
            continue
        assert g is not None and g.dtype == torch.bfloat16 and g.shape == w.shape
        assert float((g.float() - w.float()).abs().max()) < 0.1 * float(w.float().abs().max())


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        (b'"cx":"int8"', b'"cx":"int4"', "unknown wire codec"),
        (b'"od":"bfloat16"', b'"od":"int64"   ', "original dtype"),
        (b'"v":2', b'"v":1', "format version 1 with wire codec"),
        (b'"v":2', b'"v":3', "unsupported format version 3"),
    ],
)
def test_a_forged_codec_header_is_refused(old: bytes, new: bytes, message: str) -> None:
    raw, _ = _payload("int8")
    head = raw[:2000]
    assert old in head, head[:400]
    forged = head.replace(old, new, 1) + raw[2000:]
    if len(new) != len(old):  # keep the header length: pad or trim the JSON's trailing spaces
        forged = raw[:2000].replace(old, new, 1).replace(b" " * 3, b"", 1) + raw[2000:]
    with pytest.raises(DecodeError, match=message):
        decode_kv(forged)


def test_a_payload_that_claims_a_codec_but_is_not_coded_is_refused() -> None:
    x = _rows(torch.bfloat16)
    plan = PackedPayload("r", [x], [x], [0], {}, coded=Coded("int8", "bfloat16"))
    with pytest.raises(DecodeError, match=r"head_size \+ 4"):
        decode_kv(plan.to_bytes())


@pytest.mark.parametrize("codec", CODECS)
def test_two_managers_hand_off_coded_kv(make_manager: Callable[..., Any], codec: str) -> None:
    """The sender codes (``wire_codec``), the receiver decodes whatever its own setting; the
    payload is about half the plain one and the KV is within the codec's bound."""
    caches = make_paged_caches(layers=2, blocks=8, block_size=8, heads=4, dim=16)
    caches = [c.to(torch.bfloat16) for c in caches]
    plain_tx = make_manager("sender")
    coded_tx = make_manager("sender", wire_codec=codec)
    rx = make_manager("receiver")
    meta = {"block_ids": [2, 5, 1], "seq_len": 20}
    plain_tx.handle_finished_requests_kv_transfer({"plain": meta}, caches, 8, "bfloat16")
    coded_tx.handle_finished_requests_kv_transfer({"coded": meta}, caches, 8, "bfloat16")
    plain, coded = plain_tx.get_send_result("plain"), coded_tx.get_send_result("coded")
    assert plain is not None and plain.ok and coded is not None and coded.ok, coded
    assert coded.nbytes < 0.75 * plain.nbytes
    want = rx.receive_kv_cache_result("plain")
    got = rx.receive_kv_cache_result("coded")
    assert want.ok and got.ok and want.kv is not None and got.kv is not None, got.reason
    for w, g in zip(want.kv.key_cache, got.kv.key_cache, strict=True):
        assert g.dtype == torch.bfloat16 and g.shape == w.shape
        amax = w.float().abs().amax(dim=-1, keepdim=True)
        assert bool(((g.float() - w.float()).abs() <= amax * 0.07).all())


def test_an_unknown_codec_is_a_config_error(make_manager: Callable[..., Any]) -> None:
    from omnikv.errors import ConfigError

    with pytest.raises(ConfigError, match="wire_codec"):
        make_manager("sender", wire_codec="zstd")


def test_quality_on_real_kv_stays_within_the_bounds() -> None:
    """``omnikv bench codec``'s quality section on a few prompts: real KV of a small Llama
    (bf16) coded both ways, the errors within the documented bounds, decoding continued."""
    pytest.importorskip("transformers")
    from omnikv.bench.codec_quality import measure_codec_quality

    rows = {q.codec: q for q in measure_codec_quality(3, new_tokens=4)}
    assert set(rows) == set(CODECS) and all(q.prompts == 3 for q in rows.values())
    assert rows["int8"].max_rel_to_row <= 1 / 254 + ROUNDING[torch.bfloat16] + 1e-6
    assert rows["fp8_e4m3"].max_rel_to_row <= 2.0**-4 + ROUNDING[torch.bfloat16] + 1e-6
    assert all(0 < q.mean_abs < q.max_abs for q in rows.values())
