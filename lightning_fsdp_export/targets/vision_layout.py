"""Vision-language checkpoints in the layout vLLM loads.

transformers 5 (5.19 checked) writes a CLIP or SigLIP vision tower (LLaVA-style models, Gemma 3) as
``vision_tower.*``; published checkpoints hold it as ``vision_tower.vision_model.*``, and vLLM 0.32's loaders read only
that: an engine built on ``save_pretrained``'s files fails at build ("There is no module or parameter named
'vision_tower.embeddings' in LlavaForConditionalGeneration"). :func:`vision_layout_problem` says so before an engine
is built; :func:`write_vllm_layout` renames the tensors in place. A trainer reads either layout (``pretrained=``
relocates), so the same directory serves both sides once rewritten.
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


def _bare_tower_names(path: Path) -> list[str]:
    """The checkpoint's tower tensors without ``vision_model.``, where its tower is one vLLM nests (else none)."""
    config = path / "config.json"
    if not config.is_file():
        return []
    vision = json.loads(config.read_text()).get("vision_config") or {}
    if vision.get("model_type") not in _TOWERS:
        return []
    return [n for n in checkpoint_shapes(path) if n.startswith(_BARE) and not n.startswith(_NESTED)]


def vision_layout_problem(path: str | os.PathLike[str]) -> str | None:
    """Why vLLM 0.32 cannot build an engine on the checkpoint in ``path`` (a CLIP/SigLIP tower written as
    ``vision_tower.*``), with the fix; ``None`` when it can, or ``path`` is not a local checkpoint."""
    path = Path(path)
    bare = _bare_tower_names(path) if path.is_dir() else []
    if not bare:
        return None
    return (f"{str(path)!r} holds its vision tower as vision_tower.* ({len(bare)} tensor(s), e.g. {bare[0]!r}), as"
            " transformers 5's save_pretrained writes it; vLLM 0.32 loads a CLIP/SigLIP tower only as"
            " vision_tower.vision_model.* (the published layout) and fails at engine build. Rewrite it once with"
            " `lightning_fsdp_export.targets.write_vllm_layout(dir)` (renames the tensors in place; the trainer's"
            " pretrained= reads both layouts).")


def write_vllm_layout(path: str | os.PathLike[str]) -> int:
    """Rename a CLIP/SigLIP vision tower's tensors in the checkpoint in ``path`` from ``vision_tower.*`` to
    ``vision_tower.vision_model.*``, in place (every safetensors file, and the index's weight map if sharded), so vLLM
    0.32 builds an engine on it. Returns how many tensors were renamed (0: nothing to do).

    Args:
        path: a directory written by ``save_pretrained`` of a LLaVA-style or Gemma 3 model.
    """
    path = Path(path)
    bare = set(_bare_tower_names(path))
    if not bare:
        return 0

    def nested(name: str) -> str:
        return _NESTED + name[len(_BARE):] if name in bare else name

    for file in sorted(path.glob("*.safetensors")):
        tensors = load_file(str(file))
        if bare & tensors.keys():
            save_file({nested(k): v for k, v in tensors.items()}, str(file), metadata={"format": "pt"})
    index = path / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"] = {nested(k): v for k, v in data.get("weight_map", {}).items()}
        index.write_text(json.dumps(data, indent=2))
    return len(bare)
