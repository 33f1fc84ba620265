"""The MACs that bind KV to its transfer key: the pinned construction of ``kv_mac`` and the checks
of a streamed finish's sealed ranges and layer groups.
"""

from __future__ import annotations

from importlib.util import find_spec
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.skipif(
    find_spec("vllm") is None, reason="vLLM not installed (make test-vllm builds .venv-vllm)"
)


def _sealed_kv(tokens: int, layers: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [
        (torch.randn(tokens, 2, 4, generator=g), torch.randn(tokens, 2, 4, generator=g))
        for _ in range(layers)
    ]


_KV = list[tuple[torch.Tensor, torch.Tensor]]


def _field(value: bytes) -> bytes:
    return len(value).to_bytes(8, "little") + value


def _message(domain: bytes, key: str, start: int, kv: _KV, *, wire_order: bool = True) -> bytes:
    """The MAC's message: every K then every V (v4: the payload's wire order), or each layer's
    K then V (v3)."""
    import json

    msg = domain + _field(key.encode()) + _field(str(start).encode()) + _field(b"0")
    order = [k for k, _ in kv] + [v for _, v in kv] if wire_order else [t for p in kv for t in p]
    for t in order:
        msg += _field(json.dumps([str(t.dtype), list(t.shape)]).encode())
        msg += t.contiguous().view(torch.uint8).numpy().tobytes()
    return msg


def _v3_mac(
    secret: bytes, key: str, kv: list[tuple[torch.Tensor, torch.Tensor]], start: int
) -> str:
    """The construction of omnikv-kv-v3 (the version before), as its producers computed it and
    its consumers checked it: bare hex of HMAC-SHA256 under BLAKE2b(secret, ``omnikv-key-v1``)."""
    import hashlib
    import hmac

    derived = hashlib.blake2b(secret, digest_size=32, person=b"omnikv-key-v1").digest()
    msg = _message(b"omnikv-kv-v3\x00", key, start, kv, wire_order=False)
    return hmac.new(derived, msg, hashlib.sha256).hexdigest()[:32]


def test_the_kv_mac_is_keyed_blake3_over_key_start_shapes_and_bytes() -> None:
    """``kv_mac``'s construction is pinned (producer and consumer of two omnikv builds must
    agree): ``omnikv-kv-v4:`` then 32 hex of BLAKE3 keyed with the key BLAKE3 derives from the
    secret under its context, over its domain, then length-prefixed key, start, first layer
    and each tensor's dtype and shape before its bytes, every K then every V (the payload's
    wire order, in which the encoder computes it). Every input it covers changes it."""
    import blake3

    from omnikv.integrations.vllm.binding import kv_mac
    from omnikv.wire.mac import KV_MAC_KEY_CONTEXT

    secret, key = b"s3cret", "tid.binding"
    kv = _sealed_kv(6, layers=2)
    derived = blake3.blake3(secret, derive_key_context=KV_MAC_KEY_CONTEXT).digest()
    assert KV_MAC_KEY_CONTEXT == "omnikv 2026-12-07 vLLM connector KV MAC v4"
    msg = _message(b"omnikv-kv-v4\x00", key, 3, kv)
    want = "omnikv-kv-v4:" + blake3.blake3(msg, key=derived).hexdigest(length=16)
    assert kv_mac(secret, key, kv, 3) == want
    flipped = [(k.clone(), v.clone()) for k, v in kv]
    flipped[0][1].view(torch.uint8)[-1] ^= 1  # one bit of the last V byte
    others = {
        kv_mac(b"other", key, kv, 3),
        kv_mac(secret, "tid.other", kv, 3),
        kv_mac(secret, key, kv, 4),
        kv_mac(secret, key, kv, 3, first_layer=1),
        kv_mac(secret, key, flipped, 3),
        kv_mac(secret, key, [(k.reshape(6, 8), v.reshape(6, 8)) for k, v in kv], 3),
        kv_mac(secret, key, [(k.to(torch.float64), v.to(torch.float64)) for k, v in kv], 3),
    }
    assert want not in others and len(others) == 7


def test_a_mac_of_another_construction_is_refused_both_ways() -> None:
    """Versioned on the wire: a consumer of this version refuses an older producer's MAC (the
    v3 HMAC-SHA256 hex, even computed right) by its construction, before hashing, and checks
    no unknown version; an older consumer, checking the v3 construction, finds this
    version's MAC unequal to its own (its load fails, vLLM recomputes). Neither is ever
    taken for the other."""
    import hmac

    from omnikv.integrations.vllm.binding import (
        check_sealed_ranges,
        kv_mac,
        kv_mac_matches,
        kv_mac_refusal,
    )

    secret, key = b"s3cret", "tid.binding"
    kv = _sealed_kv(6)
    old = _v3_mac(secret, key, kv, 0)
    why = kv_mac_refusal(old, secret, key, kv)
    assert why is not None and "omnikv-kv-v3" in why and "omnikv-kv-v4" in why, why
    assert not kv_mac_matches(old, secret, key, kv)
    for other in ("omnikv-kv-v5:" + old, "omnikv-kv-v3:" + old, "", ":" + old):
        assert "construction" in (kv_mac_refusal(other, secret, key, kv) or ""), other
    assert kv_mac_refusal(None, secret, key, kv) == "the payload carries no MAC"
    why = check_sealed_ranges(secret, key, kv, [[0, 6, old]])
    assert why is not None and "omnikv-kv-v3" in why, why
    # the other direction: what a v3 consumer compares (its own MAC of the same tokens)
    new = kv_mac(secret, key, kv)
    assert kv_mac_refusal(new, secret, key, kv) is None
    assert not hmac.compare_digest(new, old) and len(new) != len(old)


def test_sealed_ranges_check_each_piece_and_refuse_hostile_lists() -> None:
    """A streamed finish's ``[start, stop, mac]`` list: a whole payload is checked range by
    range; a tail (``offset``) only from its own range on; anything malformed is refused."""
    from omnikv.integrations.vllm.binding import MAX_SEALED_RANGES, check_sealed_ranges, kv_mac

    secret, key = b"s3cret", "tid.binding"
    kv = _sealed_kv(10)

    def seal(a: int, b: int) -> list[Any]:
        return [a, b, kv_mac(secret, key, [(k[a:b], v[a:b]) for k, v in kv], a)]

    good = [seal(0, 4), seal(4, 8), seal(8, 10)]
    assert check_sealed_ranges(secret, key, kv, good) is None
    tail = [(k[8:], v[8:]) for k, v in kv]
    assert check_sealed_ranges(secret, key, tail, good, offset=8) is None
    # the chunks' MACs are not looked at for a tail: they were checked as the chunks came
    assert check_sealed_ranges(secret, key, tail, [[0, 8, "x"], seal(8, 10)], offset=8) is None
    bad_mac = [seal(0, 4), [4, 8, "0" * 32], seal(8, 10)]
    assert "tokens [4, 8)" in (check_sealed_ranges(secret, key, kv, bad_mac) or "")
    assert "MAC" in (check_sealed_ranges(b"other", key, kv, good) or "")
    assert "MAC" in (check_sealed_ranges(secret, "tid.other", kv, good) or "")
    hostile: list[Any] = [
        None,
        [],
        "0,4,x",
        [seal(0, 4), seal(8, 10)],  # a gap
        [seal(0, 4), [4, 8.0, "x"], seal(8, 10)],  # not ints
        [[1, 4, "x"], seal(4, 8), seal(8, 10)],  # not from 0
        [seal(0, 4), seal(4, 8)],  # ends before the KV does
        [seal(0, 10)] * (MAX_SEALED_RANGES + 1),  # too many
        [[0, 4, "x", 1], seal(4, 8), seal(8, 10)],
    ]
    for sealed in hostile:
        assert check_sealed_ranges(secret, key, kv, sealed) is not None, sealed
    # a tail that does not start where a sealed range does
    off = [(k[6:], v[6:]) for k, v in kv]
    assert "no sealed range starts at" in (check_sealed_ranges(secret, key, off, good, 6) or "")


def test_sealed_layer_groups_are_checked_group_by_group() -> None:
    """A stream shipped layer by layer seals each group: ``[start, stop, mac, first, end]``,
    the MAC over those layers bound to the first; a whole payload is checked group by group,
    and a group list out of layer order or missing a range's last layers is refused."""
    from omnikv.integrations.vllm.binding import check_sealed_ranges, kv_mac

    secret, key = b"s3cret", "tid.binding"
    g = torch.Generator().manual_seed(5)
    kv = [(torch.randn(10, 2, 4, generator=g), torch.randn(10, 2, 4, generator=g)) for _ in "abc"]

    def group(a: int, b: int, first: int, end: int) -> list[Any]:
        tokens = [(k[a:b], v[a:b]) for k, v in kv[first:end]]
        return [a, b, kv_mac(secret, key, tokens, a, first), first, end]

    def whole(a: int, b: int) -> list[Any]:
        return [a, b, kv_mac(secret, key, [(k[a:b], v[a:b]) for k, v in kv], a)]

    good = [group(0, 4, 0, 1), group(0, 4, 1, 3), group(4, 8, 0, 2), group(4, 8, 2, 3)]
    good.append(whole(8, 10))
    assert check_sealed_ranges(secret, key, kv, good) is None
    tail = [(k[8:], v[8:]) for k, v in kv]
    assert check_sealed_ranges(secret, key, tail, good, offset=8) is None
    swapped = [[*good[0][:2], good[1][2], *good[0][3:]], [*good[1][:2], good[0][2], *good[1][3:]]]
    assert "MAC" in (check_sealed_ranges(secret, key, kv, swapped + good[2:]) or "")
    hostile: list[Any] = [
        [good[1], good[0], *good[2:]],  # layers out of order
        [good[0], *good[2:]],  # a range missing its last layers
        [good[0], group(0, 4, 1, 2), *good[2:]],  # one layer short
        [good[0], [*good[1][:3], 1, 4], *good[2:]],  # past the last layer
        [*good[:3], whole(8, 10)],  # the last group of [4, 8) missing
        [good[0], [0, 5, good[1][2], 1, 3], *good[2:]],  # a group of another range
    ]
    for sealed in hostile:
        assert check_sealed_ranges(secret, key, kv, sealed) is not None, sealed
    assert "not in order" in (check_sealed_ranges(secret, key, kv, hostile[0]) or "")
