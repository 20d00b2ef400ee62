"""Vision-language checkpoints in the layout vLLM loads.

``save_pretrained`` of transformers 5 (5.19 checked) writes two vision-language families otherwise than their published
checkpoints, and vLLM 0.32 reads only the published layout (an engine built on ``save_pretrained``'s files fails at
build):

- a CLIP or SigLIP vision tower (LLaVA-style models, Gemma 3) as ``vision_tower.*``, published (and vLLM)
  ``vision_tower.vision_model.*`` ("There is no module or parameter named 'vision_tower.embeddings'");
- Qwen3-VL-MoE's fused experts in the memory orientation (``gate_up_proj`` ``(E, 2I, H)``), published transposed
  (``(E, H, 2I)``; vLLM's ``is_fused_checkpoint_transposed``);
- a text config without a field vLLM's loader of the family reads and transformers' config class of the vision-language
  family omits (:data:`PUBLISHED_FIELDS`: Qwen3-VL-MoE's ``norm_topk_prob``, GLM-4.5V's ``use_qk_norm``). The values
  are the published checkpoints', by family: transformers' text-only sibling's default is no rule to copy
  (``Qwen3MoeConfig.norm_topk_prob`` defaults to ``False``, Qwen3-VL-MoE publishes ``true``, and a wrong value would
  change the routing silently).

:func:`vision_layout_problem` says so before an engine is built; :func:`write_vllm_layout` rewrites the checkpoint in
place. A trainer reads the published layout (``pretrained=``; the export writes it too), so the same directory serves
both sides once rewritten.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file

from lightning_fsdp_export.prepare.pretrained import checkpoint_shapes

__all__ = ["PUBLISHED_FIELDS", "vision_layout_problem", "write_vllm_layout"]

_TOWERS = ("clip_vision_model", "siglip_vision_model")  # towers whose vLLM module nests them under vision_model
_BARE, _NESTED = "vision_tower.", "vision_tower.vision_model."
_FUSED = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")

PUBLISHED_FIELDS: dict[str, dict[str, object]] = {
    "qwen3_vl_moe": {"norm_topk_prob": True},  # vLLM's Qwen3MoeSparseMoeBlock reads it
    "glm4v_moe": {"use_qk_norm": False},  # vLLM's Glm4MoeAttention (GLM-4.5V's text model is GLM-4.5's) reads it
}
"""Text-config fields vLLM 0.32 reads that transformers 5.19's config of the family (``model_type``) lacks, with the
value its published checkpoints hold."""


def _config(path: Path) -> dict[str, Any]:
    config = path / "config.json"
    return json.loads(config.read_text()) if config.is_file() else {}


def _renames(path: Path) -> dict[str, str]:
    """The checkpoint's tower tensors without ``vision_model.``, and their new names (a tower vLLM nests only)."""
    vision = _config(path).get("vision_config") or {}
    if vision.get("model_type") not in _TOWERS:
        return {}
    return {n: _NESTED + n[len(_BARE):] for n in checkpoint_shapes(path)
            if n.startswith(_BARE) and not n.startswith(_NESTED)}


def _untransposed(path: Path) -> list[str]:
    """Qwen3-VL-MoE's fused expert tensors held in the memory orientation (``gate_up_proj``'s dim 1 = 2 x the
    experts' intermediate size, ``down_proj``'s = the hidden size)."""
    config = _config(path)
    if config.get("model_type") != "qwen3_vl_moe":
        return []
    text = config.get("text_config") or {}
    memory = {_FUSED[0]: 2 * text.get("moe_intermediate_size", -1), _FUSED[1]: text.get("hidden_size", -1)}
    return [n for n, shape in checkpoint_shapes(path).items()
            if n.endswith(_FUSED) and len(shape) == 3 and shape[1] == memory[next(f for f in _FUSED if n.endswith(f))]
            and shape[1] != shape[2]]


def _missing_fields(config: dict[str, Any]) -> dict[str, object]:
    """The :data:`PUBLISHED_FIELDS` of ``config``'s family its text config lacks, with their published values."""
    text = config.get("text_config") or {}
    return {k: v for k, v in PUBLISHED_FIELDS.get(config.get("model_type", ""), {}).items() if k not in text}


def vision_layout_problem(path: str | os.PathLike[str]) -> str | None:
    """Why vLLM 0.32 cannot build an engine on the checkpoint in ``path`` (a CLIP/SigLIP tower written as
    ``vision_tower.*``, Qwen3-VL-MoE's experts untransposed, a text config without a :data:`PUBLISHED_FIELDS` field),
    with the fix; ``None`` when it can, or ``path`` is not a local checkpoint."""
    path = Path(path)
    if not path.is_dir():
        return None
    bare, flat, fields = list(_renames(path)), _untransposed(path), _missing_fields(_config(path))
    if not bare and not flat and not fields:
        return None
    published = ", ".join(f"{k}={v!r}" for k, v in fields.items())
    what = (f"its vision tower as vision_tower.* ({len(bare)} tensor(s), e.g. {bare[0]!r}), where vLLM 0.32 loads a"
            " CLIP/SigLIP tower only as vision_tower.vision_model.* (the published layout)" if bare else
            f"Qwen3-VL-MoE's fused experts untransposed ({len(flat)} tensor(s), e.g. {flat[0]!r}), where vLLM 0.32"
            " reads them transposed (the published layout)" if flat else
            f"a text config without {', '.join(fields)}, which vLLM 0.32's loader of this family reads (published:"
            f" {published})")
    return (f"{str(path)!r} holds {what}, as transformers 5's save_pretrained writes it; the engine would fail at"
            " build. Rewrite it once with `lightning_fsdp_export.targets.write_vllm_layout(dir)` (in place; the"
            " trainer's pretrained= reads the published layout).")


def write_vllm_layout(path: str | os.PathLike[str]) -> int:
    """Rewrite the checkpoint in ``path`` in the published layout vLLM 0.32 loads, in place (every safetensors file,
    and the index's weight map if sharded): a CLIP/SigLIP tower's ``vision_tower.*`` renamed
    ``vision_tower.vision_model.*``; Qwen3-VL-MoE's fused experts transposed (dims 1 and 2); the text config's
    :data:`PUBLISHED_FIELDS` set where missing (Qwen3-VL-MoE's ``norm_topk_prob``, GLM-4.5V's ``use_qk_norm``, as
    published). Returns how many tensors changed (0: no tensor, though the config may have been completed).

    Args:
        path: a directory written by ``save_pretrained`` of a LLaVA-style, Gemma 3, Qwen3-VL-MoE or GLM-4.5V model.
    """
    path = Path(path)
    renames, flat = _renames(path), set(_untransposed(path))
    config = _config(path)
    if fields := _missing_fields(config):
        config.setdefault("text_config", {}).update(fields)
        (path / "config.json").write_text(json.dumps(config, indent=2))
    if not renames and not flat:
        return 0
    for file in sorted(path.glob("*.safetensors")):
        tensors = load_file(str(file))
        if (renames.keys() | flat) & tensors.keys():
            save_file({renames.get(k, k): v.transpose(1, 2).contiguous() if k in flat else v
                       for k, v in tensors.items()}, str(file), metadata={"format": "pt"})
    index = path / "model.safetensors.index.json"
    if index.is_file() and renames:
        data = json.loads(index.read_text())
        data["weight_map"] = {renames.get(k, k): v for k, v in data.get("weight_map", {}).items()}
        index.write_text(json.dumps(data, indent=2))
    return len(renames) + len(flat)
