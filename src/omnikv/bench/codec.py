"""``omnikv bench codec``: encode/decode of a realistic payload against this machine's ceiling.

Same run, same bytes (Qwen2.5-7B, 4096 tokens, fp16 = 224 MiB by default):

* memcpy of the packed size into a pre-faulted buffer (the ceiling);
* ``pack_into`` a pre-faulted buffer (target >= 0.7 x memcpy);
* ``to_bytes`` vs the reference's shape (per-tensor ``tobytes`` + ``b"".join``; target >= 2 x);
* decode of the 56 tensors (``decode_kv``, with every check in) vs the reference's ``from_bytes``
  on the same bytes (target: at least as fast), and the cost of the optional crc32 check;
* the vLLM connector's KV MAC (``auth_secret``): HMAC-SHA256 (what
  :func:`omnikv.integrations.vllm.binding.kv_mac` computes) vs keyed BLAKE2b (what it computed
  before) over the same bytes, each against memcpy (reported, no target: the ratio depends on
  the CPU's SHA extensions).

Every result is verified against the source tensors before timings are reported. Then the
optional wire codec's error and greedy-token agreement on real KV from a small Llama
(:mod:`omnikv.bench.codec_quality`; ``--quality-prompts``, skipped with ``--quick``).
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from omnikv.bench.common import measure, print_table, realistic_payload, write_json
from omnikv.bench.reference import ref_from_bytes, ref_to_bytes
from omnikv.wire.decode import decode, decode_kv

__all__ = ["main"]


def _verify(data: object, source: dict[str, list[torch.Tensor]]) -> None:
    assert isinstance(data, dict)
    for cache in ("key_cache", "value_cache"):
        for got, want in zip(data["layer_blocks"][cache], source[cache], strict=True):
            if not torch.equal(got, want):
                raise SystemExit(f"verification failed for {cache}")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the codec benchmark; returns 0 when all targets are met, 1 otherwise."""
    parser = argparse.ArgumentParser(
        prog="omnikv bench codec",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default="qwen2.5-7b", help="the model whose KV is coded")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens in the payload")
    parser.add_argument("--repeat", type=int, default=15, help="samples per case")
    parser.add_argument("--quick", action="store_true", help="fewer repeats (smoke run)")
    parser.add_argument("--json", help="write results to this file")
    parser.add_argument(
        "--no-targets",
        action="store_true",
        help="report the speed targets but exit 0 when one is missed (smoke runs on a busy "
        "machine); a verification failure still fails",
    )
    parser.add_argument(
        "--quality-prompts",
        type=int,
        default=50,
        help="prompts for the wire codec's error and token agreement on real KV (needs "
        "transformers; 0: skip)",
    )
    args = parser.parse_args(list(argv or []))
    repeat = 3 if args.quick else args.repeat
    torch.set_num_threads(max(1, torch.get_num_threads()))

    payload = realistic_payload(args.model, args.tokens)
    plan = payload.plan()
    n = plan.nbytes
    print(
        f"payload: {args.model}, {args.tokens} tokens, {n / 2**20:.1f} MiB, "
        f"{2 * len(payload.layer_blocks['key_cache'])} tensors; torch threads "
        f"{torch.get_num_threads()}; load average {os.getloadavg()[0]:.1f} on "
        f"{os.cpu_count()} CPUs"
    )

    dst = torch.empty(n, dtype=torch.uint8)
    dst.fill_(1)  # pre-fault
    src = torch.empty(n, dtype=torch.uint8)
    plan.pack_into(src)
    _verify(decode(src), payload.layer_blocks)

    memcpy = measure("memcpy (pre-faulted dst)", lambda: dst.copy_(src), repeat=repeat, nbytes=n)
    pack = measure("pack_into (pre-faulted)", lambda: plan.pack_into(dst), repeat=repeat, nbytes=n)
    _verify(decode(dst), payload.layer_blocks)
    keys = payload.layer_blocks["key_cache"]
    values = payload.layer_blocks["value_cache"]

    def ref_shape() -> bytes:
        return ref_to_bytes(payload.request_id, keys, values, payload.block_ids, payload.metadata)

    to_bytes = measure("to_bytes", payload.to_bytes, repeat=repeat, nbytes=n)
    ref = measure("reference to_bytes shape", ref_shape, repeat=repeat, nbytes=n)
    raw = payload.to_bytes()
    _verify(decode(raw), payload.layer_blocks)
    _verify(decode(ref_shape()), payload.layer_blocks)
    dec_repeat = max(repeat, 200)
    dec = measure("decode_kv (zero-copy views)", lambda: decode_kv(raw), repeat=dec_repeat)
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    _verify(ref_from_bytes(raw), payload.layer_blocks)
    ref_dec = measure("reference from_bytes", lambda: ref_from_bytes(raw), repeat=dec_repeat)

    ck_plan = payload.plan(checksum=True)
    ck_buf = torch.empty(ck_plan.nbytes, dtype=torch.uint8)
    ck_buf.fill_(1)
    enc_ck = measure(
        "pack_into + crc32", lambda: ck_plan.pack_into(ck_buf), repeat=repeat, nbytes=n
    )
    dec_ck = measure("decode + crc32 verify", lambda: decode(ck_buf), repeat=repeat, nbytes=n)
    _verify(decode(ck_buf), payload.layer_blocks)

    macs = _macs(raw, repeat)

    print_table([memcpy, pack, to_bytes, ref], baseline=memcpy, title="Encode (ratio = x memcpy)")
    print_table([ref_dec, dec, dec_ck], baseline=ref_dec, title="Decode (ratio = x reference)")
    print_table([pack, enc_ck], title="Integrity check cost (encode)")
    print_table([memcpy, *macs], baseline=memcpy, title="KV MAC (auth_secret; ratio = x memcpy)")

    pack_ratio = memcpy.median / pack.median
    bytes_ratio = ref.median / to_bytes.median
    dec_ratio = ref_dec.median / dec.median
    ck_cost = (enc_ck.median + dec_ck.median) / (pack.median + dec.median) - 1
    targets = [
        ("pack_into >= 0.7 x memcpy", pack_ratio, pack_ratio >= 0.7),
        ("to_bytes >= 2 x reference shape", bytes_ratio, bytes_ratio >= 2.0),
        ("decode of all tensors < 1 ms (median, ms)", dec.median * 1e3, dec.median < 1e-3),
        ("decode >= 1 x reference from_bytes", dec_ratio, dec_ratio >= 1.0),
    ]
    print("\nTargets")
    for label, value, ok in targets:
        print(f"  {'PASS' if ok else 'MISS'}  {label}: {value:.3f}")
    print(f"  info  crc32 adds {ck_cost * 100:.0f}% to encode+decode (off by default: > 10%)")
    mac_speedup = macs[1].median / macs[0].median
    print(f"  info  HMAC-SHA256 is {mac_speedup:.2f} x as fast as keyed BLAKE2b here")
    quality = _codec_quality(0 if args.quick else args.quality_prompts)
    write_json(
        args.json,
        {
            "bench": "codec",
            "nbytes": n,
            "results": [
                s.as_dict()
                for s in (memcpy, pack, to_bytes, ref, dec, ref_dec, enc_ck, dec_ck, *macs)
            ],
            "ratios": {
                "pack_vs_memcpy": pack_ratio,
                "to_bytes_vs_reference": bytes_ratio,
                "decode_vs_reference": dec_ratio,
                "mac_sha256_vs_blake2b": mac_speedup,
            },
            "checksum_overhead": ck_cost,
            "wire_codec_quality": [q.as_dict() for q in quality],
        },
    )
    return 0 if args.no_targets or all(ok for _, _, ok in targets) else 1


def _macs(data: bytes, repeat: int) -> list[Any]:
    """HMAC-SHA256 and keyed BLAKE2b (16-byte digests, as the KV MAC) over ``data``, timed;
    each is first checked against a one-shot digest of the same bytes."""
    key = hashlib.sha256(b"omnikv bench codec").digest()
    view = memoryview(data)
    step = 8 << 20  # fed in pieces, as the MAC takes a payload tensor by tensor

    def fed(h: Any) -> bytes:
        for at in range(0, len(view), step):
            h.update(view[at : at + step])
        return bytes(h.digest()[:16])

    def sha() -> bytes:
        return fed(hmac.new(key, digestmod=hashlib.sha256))

    def blake() -> bytes:
        return fed(hashlib.blake2b(key=key, digest_size=16))

    if sha() != hmac.new(key, data, hashlib.sha256).digest()[:16]:
        raise SystemExit("verification failed for HMAC-SHA256")
    if blake() != hashlib.blake2b(data, key=key, digest_size=16).digest():
        raise SystemExit("verification failed for keyed BLAKE2b")
    n = len(data)
    return [
        measure("HMAC-SHA256 (kv_mac)", sha, repeat=repeat, nbytes=n),
        measure("keyed BLAKE2b (before)", blake, repeat=repeat, nbytes=n),
    ]


def _codec_quality(prompts: int) -> list[Any]:
    """The wire codec's error and token agreement (:mod:`omnikv.bench.codec_quality`); empty
    when skipped or without transformers (said so)."""
    if prompts <= 0:
        return []
    try:
        from omnikv.bench.codec_quality import measure_codec_quality, print_codec_quality

        rows = measure_codec_quality(prompts)
    except ImportError as exc:
        print(f"\nwire codec quality skipped: {exc}")
        return []
    print_codec_quality(rows, 16)
    return rows
