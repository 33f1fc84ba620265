"""A tiny decoder-only transformer with a vLLM-style paged KV block pool.

Who uses it: :mod:`omnikv.demo.pipeline` (stage 0 prefills into the pool and sends the blocks;
stage 1 writes the received KV into its own pool under other block ids and decodes on). The model
is deterministic (weights from a fixed seed, greedy sampling, fp32 on CPU), so a run that gets the
KV bit for bit produces exactly the tokens of a single-process run: that is what the demo checks.

KV pool per layer: ``[2 (K, V), num_blocks, block_size, kv_heads, head_dim]`` as in vLLM. Attention
reads K and V back through the request's block table, so the block ids a stage uses do not matter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

__all__ = ["BlockPool", "ModelConfig", "TinyPagedLM"]


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the tiny model (GQA: ``kv_heads`` divides ``heads``)."""

    vocab: int = 512
    dim: int = 128
    layers: int = 4
    heads: int = 8
    kv_heads: int = 2
    block_size: int = 16
    num_blocks: int = 256
    seed: int = 1234

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


@dataclass
class BlockPool:
    """Paged KV storage of one stage plus a trivial free-list allocator."""

    cfg: ModelConfig
    caches: list[torch.Tensor] = field(init=False)
    free: list[int] = field(init=False)

    def __post_init__(self) -> None:
        c = self.cfg
        shape = (2, c.num_blocks, c.block_size, c.kv_heads, c.head_dim)
        self.caches = [torch.zeros(shape) for _ in range(c.layers)]
        self.free = list(range(c.num_blocks))

    def allocate(self, tokens: int, *, reverse: bool = False) -> list[int]:
        """Blocks for ``tokens`` positions; ``reverse`` takes them from the other end (stage 1)."""
        n = -(-tokens // self.cfg.block_size)
        if n > len(self.free):
            raise RuntimeError(f"block pool exhausted: need {n}, have {len(self.free)}")
        taken = self.free[-n:][::-1] if reverse else self.free[:n]
        self.free = [b for b in self.free if b not in set(taken)]
        return taken

    def write(
        self, layer: int, block_ids: list[int], start: int, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store ``k``/``v`` ``[n, kv_heads, head_dim]`` at positions ``start..start+n``."""
        bs = self.cfg.block_size
        for i in range(k.shape[0]):
            pos = start + i
            blk, off = block_ids[pos // bs], pos % bs
            self.caches[layer][0, blk, off] = k[i]
            self.caches[layer][1, blk, off] = v[i]

    def read(
        self, layer: int, block_ids: list[int], length: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[length, kv_heads, head_dim]`` gathered through the block table."""
        kv = self.caches[layer][:, block_ids].flatten(1, 2)[:, :length]
        return kv[0], kv[1]


class TinyPagedLM:
    """Pre-norm decoder with GQA attention over a :class:`BlockPool`; greedy decoding."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.cfg = cfg
        g = torch.Generator().manual_seed(cfg.seed)

        def w(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g) / math.sqrt(shape[0])

        d, hd = cfg.dim, cfg.head_dim
        self.embed = torch.randn(cfg.vocab, d, generator=g)
        self.layers = [
            {
                "wq": w(d, cfg.heads * hd),
                "wk": w(d, cfg.kv_heads * hd),
                "wv": w(d, cfg.kv_heads * hd),
                "wo": w(cfg.heads * hd, d),
                "w1": w(d, 4 * d),
                "w2": w(4 * d, d),
            }
            for _ in range(cfg.layers)
        ]
        self.unembed = w(d, cfg.vocab)

    def _positions(self, start: int, n: int) -> torch.Tensor:
        pos = torch.arange(start, start + n, dtype=torch.float32)[:, None]
        freq = torch.exp(-math.log(10000.0) * torch.arange(0, self.cfg.dim, 2) / self.cfg.dim)
        out = torch.zeros(n, self.cfg.dim)
        out[:, 0::2] = torch.sin(pos * freq)
        out[:, 1::2] = torch.cos(pos * freq)
        return out

    @torch.no_grad()
    def forward(self, pool: BlockPool, block_ids: list[int], tokens: list[int], start: int) -> int:
        """Run ``tokens`` at positions ``start..``, writing their KV into the pool; next token.

        Prefill is ``start=0`` with the whole prompt; a decode step is one token at ``start``.
        """
        c = self.cfg
        n = len(tokens)
        x = self.embed[torch.tensor(tokens)] + self._positions(start, n)
        rep = c.heads // c.kv_heads
        total = start + n
        mask = torch.ones(n, total, dtype=torch.bool).tril(diagonal=start)
        for li, p in enumerate(self.layers):
            h = torch.nn.functional.layer_norm(x, (c.dim,))
            q = (h @ p["wq"]).view(n, c.heads, c.head_dim)
            k = (h @ p["wk"]).view(n, c.kv_heads, c.head_dim)
            v = (h @ p["wv"]).view(n, c.kv_heads, c.head_dim)
            pool.write(li, block_ids, start, k, v)
            ks, vs = pool.read(li, block_ids, total)
            ks = ks.repeat_interleave(rep, dim=1)
            vs = vs.repeat_interleave(rep, dim=1)
            att = torch.einsum("qhd,khd->hqk", q, ks) / math.sqrt(c.head_dim)
            att = att.masked_fill(~mask, float("-inf")).softmax(-1)
            o = torch.einsum("hqk,khd->qhd", att, vs).reshape(n, c.heads * c.head_dim)
            x = x + o @ p["wo"]
            h = torch.nn.functional.layer_norm(x, (c.dim,))
            x = x + torch.nn.functional.gelu(h @ p["w1"]) @ p["w2"]
        logits = torch.nn.functional.layer_norm(x[-1], (c.dim,)) @ self.unembed
        return int(logits.argmax())

    def generate(
        self, pool: BlockPool, block_ids: list[int], first: int, start: int, new_tokens: int
    ) -> list[int]:
        """Greedy decode ``new_tokens`` tokens after ``first`` (already sampled) at ``start``."""
        out = [first]
        tok, pos = first, start
        while len(out) < new_tokens:
            tok = self.forward(pool, block_ids, [tok], pos)
            out.append(tok)
            pos += 1
        return out
