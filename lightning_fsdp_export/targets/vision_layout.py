"""Vision-language checkpoints in the layout vLLM loads.

``save_pretrained`` of transformers 5 (5.19 checked) writes two vision-language families otherwise than their published
checkpoints, and vLLM 0.32 reads only the published layout (an engine built on ``save_pretrained``'s files fails at
build):

- a CLIP or SigLIP vision tower (LLaVA-style models, Gemma 3) as ``vision_tower.*``, published (and vLLM)
  ``vision_tower.vision_model.*`` ("There is no module or parameter named 'vision_tower.embeddings'");
- Qwen3-VL-MoE's fused experts in the memory orientation (``gate_up_proj`` ``(E, 2I, H)``), published transposed
  (``(E, H, 2I)``; vLLM's ``is_fused_checkpoint_transposed``); its config also lacks ``norm_topk_prob``, which vLLM's
  Qwen3-VL-MoE reads.

:func:`vision_layout_problem` says so before an engine is built; :func:`write_vllm_layout` rewrites the checkpoint in
place. A trainer reads the published layout (``pretrained=``; the export writes it too), so the same directory serves
both sides once rewritten.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from safetensors.torch import load_file, save_file

from lightning_fsdp_export.prepare.pretrained import checkpoint_shapes

__all__ = ["vision_layout_problem", "write_vllm_layout"]

_TOWERS = ("clip_vision_model", "siglip_vision_model")  # towers whose vLLM module nests them under vision_model
_BARE, _NESTED = "vision_tower.", "vision_tower.vision_model."
_FUSED = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def _config(path: Path) -> dict:
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


def vision_layout_problem(path: str | os.PathLike[str]) -> str | None:
    """Why vLLM 0.32 cannot build an engine on the checkpoint in ``path`` (a CLIP/SigLIP tower written as
    ``vision_tower.*``, Qwen3-VL-MoE's experts untransposed), with the fix; ``None`` when it can, or ``path`` is not a
    local checkpoint."""
    path = Path(path)
    if not path.is_dir():
        return None
    bare, flat = list(_renames(path)), _untransposed(path)
    if not bare and not flat:
        return None
    what = (f"its vision tower as vision_tower.* ({len(bare)} tensor(s), e.g. {bare[0]!r}), where vLLM 0.32 loads a"
            " CLIP/SigLIP tower only as vision_tower.vision_model.*" if bare else
            f"Qwen3-VL-MoE's fused experts untransposed ({len(flat)} tensor(s), e.g. {flat[0]!r}), where vLLM 0.32"
            " reads them transposed")
    return (f"{str(path)!r} holds {what} (the published layout), as transformers 5's save_pretrained writes it; the"
            " engine would fail at build. Rewrite it once with `lightning_fsdp_export.targets.write_vllm_layout(dir)`"
            " (in place; the trainer's pretrained= reads the published layout).")


def write_vllm_layout(path: str | os.PathLike[str]) -> int:
    """Rewrite the checkpoint in ``path`` in the published layout vLLM 0.32 loads, in place (every safetensors file,
    and the index's weight map if sharded): a CLIP/SigLIP tower's ``vision_tower.*`` renamed
    ``vision_tower.vision_model.*``; Qwen3-VL-MoE's fused experts transposed (dims 1 and 2) and ``norm_topk_prob``
    set in its text config (``true``, as published) where missing. Returns how many tensors changed (0: nothing to do).

    Args:
        path: a directory written by ``save_pretrained`` of a LLaVA-style, Gemma 3 or Qwen3-VL-MoE model.
    """
    path = Path(path)
    renames, flat = _renames(path), set(_untransposed(path))
    config = _config(path)
    if config.get("model_type") == "qwen3_vl_moe" and "norm_topk_prob" not in (config.get("text_config") or {}):
        config["text_config"]["norm_topk_prob"] = True
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
