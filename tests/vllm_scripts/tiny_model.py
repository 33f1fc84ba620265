"""A tiny random-weight Llama and a locally trained tokenizer, saved with ``save_pretrained``.

Shapes chosen so that nothing can be confused: 8 query heads, 4 KV heads (not 2, the K/V axis),
head size 64 (a size vLLM's CPU backend supports), 2 layers. No hub access.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

VOCAB = 512
LAYERS = 2
KV_HEADS = 4
HEAD_SIZE = 64


def build(folder: str | Path, dtype: str = "float32", max_positions: int = 8192) -> Path:
    """Write the model and tokenizer into ``folder`` (created) and return it."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=LAYERS,
        num_attention_heads=8,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_SIZE,
        max_position_embeddings=max_positions,
        initializer_range=0.2,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(out)
    words = [f"w{i}" for i in range(VOCAB * 2)]
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(
        vocab_size=VOCAB, special_tokens=["<pad>", "<s>", "</s>", "<unk>"]
    )
    tok.train_from_iterator([" ".join(words)] * 2, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
    )
    fast.save_pretrained(out)
    return out


if __name__ == "__main__":
    args = json.loads(sys.argv[1])
    print(build(**args))
