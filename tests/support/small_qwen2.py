"""A small randomly initialised Hugging Face Qwen2 (RoPE, RMSNorm, grouped-query attention),
the real architecture at test size, for the equivalence test and the tree benchmark."""

from __future__ import annotations

from typing import Any


def small_qwen2(
    attention: str,
    vocab: int,
    hidden: int,
    intermediate: int,
    positions: int,
    heads: int = 4,
    kv_heads: int = 2,
    layers: int = 2,
) -> Any:
    """A Qwen2 (by default 2 layers, 4 query heads over 2 key-value heads), seeded: the same
    weights for every attention implementation. transformers and torch: the `train` extra."""
    import torch
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=positions,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM._from_config(
        config, attn_implementation=attention, dtype=torch.float32
    )
