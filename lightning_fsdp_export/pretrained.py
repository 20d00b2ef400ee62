"""Loading a Hugging Face safetensors checkpoint straight into FSDP2 shards.

Each rank reads only the slices its shards hold (``torch.distributed.checkpoint`` with
``HuggingFaceStorageReader``), so no rank ever holds a full copy of the model. Names go through the
same mapping the export uses (:func:`~lightning_fsdp_export.names.export_name`), so a checkpoint
written by ``save_pretrained`` (or by this package's ``DirectoryTarget``) loads back into the model it
came from; a tied tensor is read once, under whichever of its names the checkpoint holds.
"""

from __future__ import annotations

import os
from pathlib import Path

from torch import Tensor, nn

from lightning_fsdp_export.export import plan_export
from lightning_fsdp_export.names import is_lora_name

__all__ = ["checkpoint_shapes", "load_hf_checkpoint"]


def checkpoint_shapes(path: str | os.PathLike[str]) -> dict[str, tuple[int, ...]]:
    """``{tensor name: shape}`` of every ``*.safetensors`` file in ``path``, from the headers only."""
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"pretrained={str(path)!r} holds no *.safetensors file. Point it at a directory written by"
            " `save_pretrained` (safetensors weights, sharded or not)."
        )
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                shapes[key] = tuple(f.get_slice(key).get_shape())
    return shapes


def load_hf_checkpoint(module: nn.Module, path: str | os.PathLike[str]) -> list[Tensor]:
    """Copy the checkpoint in ``path`` into ``module``'s (sharded) tensors in place; a collective.

    Every rank of the module's mesh must call it. Tensors are cast to the module's own dtype. peft
    adapter tensors (``lora_A``/``lora_B``) are not looked for: a base checkpoint has none.

    Returns:
        The module's tensors that were filled (once per tied group).

    Raises:
        ValueError: naming the tensors the checkpoint lacks or holds with another shape.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    from torch.distributed.fsdp import FSDPModule

    available = checkpoint_shapes(path)
    model_name = type(module).__name__
    if isinstance(module, FSDPModule):  # fully_shard swaps the class for "FSDP<name>"
        model_name = type(module).__mro__[2].__name__
    state: dict[str, Tensor] = {}
    missing: list[str] = []
    wrong: list[str] = []
    for names, tensor in plan_export(module, keep=lambda name: not is_lora_name(name)):
        found = next((n for n in names if n in available), None)
        if found is None:
            missing.append(" = ".join(names))
        elif available[found] != tuple(tensor.shape):
            wrong.append(f"{found}: checkpoint {list(available[found])}, model {list(tensor.shape)}")
        else:
            state[found] = tensor
    if missing or wrong:
        raise ValueError(
            f"pretrained={str(path)!r} does not match {model_name}:"
            + (f" missing {len(missing)} tensor(s) {missing[:8]}" if missing else "")
            + (f"; other shapes: {wrong[:8]}" if wrong else "")
            + ". Build the model from the checkpoint's own config.json (`AutoConfig.from_pretrained(dir)`) so"
            " names and shapes agree."
        )
    dcp.load(state, storage_reader=HuggingFaceStorageReader(str(path)))
    return list(state.values())
