"""The wire codec's error on real KV, and what it changes in the tokens a model generates.

Called by ``omnikv bench codec`` (``--quality-prompts``; needs transformers). The KV is a real
prefill of a small seeded Llama (:func:`omnikv.demo.hf.tiny_llama`, bfloat16, 4 layers, 2 KV
heads of 32) over random prompts of 32..256 tokens; each layer's K and V go through
:func:`omnikv.wire.codec.encode_rows` and back, and greedy decoding continues once from the
original cache and once from the decoded one. Reported per codec: max and mean absolute error,
the largest error relative to its row's max, and token agreement (first token, and all
``new_tokens`` tokens identical) over the prompts.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import torch

from omnikv.wire.codec import CODECS, round_trip

__all__ = ["CodecQuality", "measure_codec_quality", "print_codec_quality"]


@dataclass
class CodecQuality:
    codec: str
    max_abs: float = 0.0
    sum_abs: float = 0.0
    count: int = 0
    max_rel_to_row: float = 0.0
    first_same: int = 0
    all_same: int = 0
    prompts: int = 0
    common_prefix: list[int] = field(default_factory=list)

    @property
    def mean_abs(self) -> float:
        return self.sum_abs / self.count if self.count else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "codec": self.codec,
            "max_abs": self.max_abs,
            "mean_abs": self.mean_abs,
            "max_rel_to_row_max": self.max_rel_to_row,
            "first_token_agreement": self.first_same / max(1, self.prompts),
            "all_tokens_agreement": self.all_same / max(1, self.prompts),
            "prompts": self.prompts,
        }


def _coded(t: torch.Tensor, codec: str, stats: CodecQuality) -> torch.Tensor:
    """``t`` ``[1, heads, seq, dim]`` through the codec and back; errors recorded."""
    rows = t[0].transpose(0, 1)  # [seq, heads, dim]
    back = round_trip(rows, codec)
    err = (back.float() - rows.float()).abs()
    amax = rows.float().abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
    stats.max_abs = max(stats.max_abs, float(err.max()))
    stats.sum_abs += float(err.sum())
    stats.count += err.numel()
    stats.max_rel_to_row = max(stats.max_rel_to_row, float((err / amax).max()))
    return back.transpose(0, 1).unsqueeze(0).contiguous()


def measure_codec_quality(prompts: int, new_tokens: int = 16, seed: int = 0) -> list[CodecQuality]:
    """Each codec's error and token agreement over ``prompts`` random prompts (see the module
    docstring). Raises ``ImportError`` without transformers."""
    from transformers import DynamicCache

    from omnikv.demo.hf import greedy, tiny_llama
    from omnikv.integrations.transformers import cache_to_pairs

    model = tiny_llama(torch.bfloat16)
    rnd = random.Random(seed)
    out = [CodecQuality(c) for c in CODECS]
    with torch.no_grad():
        for _ in range(prompts):
            ids = torch.tensor([[rnd.randrange(1, 512) for _ in range(rnd.randrange(32, 257))]])
            prefill = model(ids[:, :-1], use_cache=True).past_key_values
            pairs = [(k.clone(), v.clone()) for k, v in cache_to_pairs(prefill)]
            want = greedy(model, ids, new_tokens, cache=DynamicCache(pairs, config=model.config))
            for q in out:
                coded = [(_coded(k, q.codec, q), _coded(v, q.codec, q)) for k, v in pairs]
                got = greedy(model, ids, new_tokens, cache=DynamicCache(coded, config=model.config))
                q.prompts += 1
                q.first_same += int(got[0] == want[0])
                q.all_same += int(got == want)
                same = next(
                    (i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), len(want)
                )
                q.common_prefix.append(same)
    return out


def print_codec_quality(rows: list[CodecQuality], new_tokens: int) -> None:
    """The table ``omnikv bench codec`` prints."""
    print(
        f"\nWire codec on real KV (tiny Llama, bfloat16, {rows[0].prompts} prompts of 32..256 "
        f"tokens, {new_tokens} greedy tokens each)"
    )
    print(
        f"{'codec':10} {'max abs err':>12} {'mean abs err':>13} {'max err / row max':>18} "
        f"{'1st token same':>15} {'all tokens same':>16} {'mean common prefix':>19}"
    )
    for q in rows:
        prefix = sum(q.common_prefix) / max(1, len(q.common_prefix))
        print(
            f"{q.codec:10} {q.max_abs:12.4f} {q.mean_abs:13.5f} {q.max_rel_to_row:18.4f} "
            f"{q.first_same / max(1, q.prompts):15.1%} {q.all_same / max(1, q.prompts):16.1%} "
            f"{prefix:19.2f}"
        )
