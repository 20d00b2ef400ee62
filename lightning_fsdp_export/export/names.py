"""The one place where exported tensor names are fixed up (HF names, and peft's adapter file names).

Every exporter (the lazy path, the staged LoRA path, the targets' checks) maps module names to the
names a Hugging Face checkpoint of the same model uses, through :func:`export_name`, so that vLLM's
``load_weights`` recognises them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeGuard

if TYPE_CHECKING:
    from peft import PeftModel

# Parts that wrappers insert into parameter names; none of them exists in an HF checkpoint.
_WRAPPER_PARTS = (
    "_checkpoint_wrapped_module.",  # torch.distributed.algorithms._checkpoint.checkpoint_wrapper
    "_orig_mod.",  # torch.compile's OptimizedModule
    "_fsdp_wrapped_module.",  # FSDP1 (refused elsewhere, stripped here for safety)
)
# peft's LoRA wrappers: PeftModel.base_model (LoraModel).model, and each LoraLayer's base_layer.
_PEFT_PREFIX = "base_model.model."
_PEFT_BASE_LAYER = ".base_layer"


def export_name(name: str) -> str:
    """Return the Hugging Face checkpoint name of a module's state-dict entry.

    Removes wrapper parts (activation checkpointing, ``torch.compile``, FSDP1) wherever they occur,
    peft's leading ``base_model.model.`` and its ``.base_layer`` infix, so that
    ``base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight`` becomes
    ``model.layers.0.self_attn.q_proj.weight``.

    Args:
        name: a key of ``module.state_dict()`` of the exported module.
    """
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    if name.startswith(_PEFT_PREFIX):
        name = name[len(_PEFT_PREFIX) :]
    return name.replace(_PEFT_BASE_LAYER + ".", ".")


def is_lora_name(name: str) -> bool:
    """Whether a state-dict key belongs to a LoRA adapter (``lora_A``/``lora_B``/embedding adapters)."""
    return any(f".{part}." in f".{name}" for part in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B"))


def adapter_file_name(name: str, adapter: str = "default") -> str:
    """peft's file name of an adapter tensor: the adapter's own name removed.

    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight`` becomes
    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``, as ``save_pretrained`` writes it.
    """
    return name.replace(f".{adapter}.", ".")


def is_peft_model(module: Any) -> TypeGuard[PeftModel]:
    """Whether ``module`` is a peft ``PeftModel`` (here, a leaf module, so every room can ask without a cycle)."""
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is a dependency
        return False
    return isinstance(module, PeftModel)
