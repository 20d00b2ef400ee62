"""Loading a Hugging Face safetensors checkpoint straight into FSDP2 shards.

Each rank reads only the slices its shards hold (``torch.distributed.checkpoint`` with
``HuggingFaceStorageReader``), so no rank ever holds a full copy of the model. Names go through the
same mapping the export uses (:func:`~lightning_fsdp_export.export.names.export_name`, then the model's
:class:`~lightning_fsdp_export.export.checkpoint_format.CheckpointFormat`), so a checkpoint written by
``save_pretrained`` (or by this package's ``DirectoryTarget``) loads back into the model it came from; a
tied tensor is read once, under whichever of its names the checkpoint holds. A tensor kept in another
layout in memory (fused MoE experts) is assembled on each rank from the checkpoint tensors of its own
rows (its experts) only. A text model read out of a vision-language checkpoint (Qwen3.5's ``model.language_model.*``)
is found under its prefix, and its export then names its tensors so (:meth:`CheckpointFormat.relocate`).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from lightning_fsdp_export._common import find_relocation
from lightning_fsdp_export.export.checkpoint_format import CheckpointFormat, parts_not_held
from lightning_fsdp_export.export.lazy import plan_export
from lightning_fsdp_export.export.names import is_lora_name
from lightning_fsdp_export.prepare.sharding import chunk_bounds, unsharded_class

__all__ = ["checkpoint_shapes", "load_hf_checkpoint"]

_log = logging.getLogger(__name__)


def checkpoint_shapes(path: str | os.PathLike[str]) -> dict[str, tuple[int, ...]]:
    """``{tensor name: shape}`` of every ``*.safetensors`` file in ``path``, from the headers only."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"pretrained={str(path)!r} holds no *.safetensors file. Point it at a directory written by"
            " `save_pretrained` (safetensors weights, sharded or not)."
        )
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safetensors' safe_open is no dict
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


    available = checkpoint_shapes(path)
    model_name = unsharded_class(module).__name__
    fmt = CheckpointFormat.of(module)
    plan = plan_export(module, keep=lambda name: not is_lora_name(name))
    if fmt.relocation is None:  # the text model of a vision-language checkpoint: its names as that checkpoint's
        wanted = [p.name for names, tensor in plan for p in fmt.pieces(names[0], tensor)]
        fmt.relocate(find_relocation(wanted, available))
        if fmt.relocation is not None:
            _log.info("pretrained=%r holds %s under other prefixes (%s): the export names its tensors so too, for"
                      " the engine serving that checkpoint.", str(path), model_name,
                      ", ".join(f"{old!r} as {new!r}" for old, new in fmt.relocation))
    held = {p.name for names, tensor in plan for name in names for p in fmt.pieces(name, tensor)}
    fmt.parts_not_held = parts_not_held(held, available)  # what an exact check may count as the engine's own
    state: dict[str, Tensor] = {}  # checkpoint name -> tensor, read by DCP (same layout on both sides)
    converted: list[tuple[str, Tensor]] = []  # read piece by piece, this rank's rows only
    missing: list[str] = []
    wrong: list[str] = []
    for names, tensor in plan:
        options = [(name, fmt.pieces(name, tensor)) for name in names]
        found = next(((name, pieces) for name, pieces in options if all(p.name in available for p in pieces)), None)
        if found is None:
            missing.append(" = ".join(p.name for p in options[0][1][:3]) + (" ..." if len(options[0][1]) > 3 else ""))
            continue
        name, pieces = found
        shapes_off = [f"{p.name}: checkpoint {list(available[p.name])}, model {list(p.shape)}"
                      for p in pieces if available[p.name] != p.shape]
        if shapes_off:
            wrong += shapes_off
        elif len(pieces) == 1 and pieces[0].shape == tuple(tensor.shape):
            state[pieces[0].name] = tensor  # the same tensor, maybe under another name
        else:
            converted.append((name, tensor))
    if missing or wrong:
        hint = (" The model converts some tensors on their way to disk (transformers' conversion rules); the names"
                " above are the checkpoint names it expects." if fmt.has_rules else "")
        raise ValueError(
            f"pretrained={str(path)!r} does not match {model_name}:"
            + (f" missing {len(missing)} tensor(s) {missing[:8]}" if missing else "")
            + (f"; other shapes: {wrong[:8]}" if wrong else "")
            + ". Build the model from the checkpoint's own config.json (`AutoConfig.from_pretrained(dir)`) so"
            " names and shapes agree." + hint
        )
    if state:
        dcp.load(state, storage_reader=HuggingFaceStorageReader(str(path)))
    if converted:
        _load_converted(converted, fmt, Path(path))
    return list(state.values()) + [tensor for _, tensor in converted]


def _load_converted(converted: list[tuple[str, Tensor]], fmt: CheckpointFormat, path: Path) -> None:
    """Fill each converted tensor's local shard from the checkpoint pieces of its own rows."""
    files: dict[str, Path] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            files.update(dict.fromkeys(f.keys(), file))
    handles: dict[Path, Any] = {}  # safetensors' safe_open handles (untyped)

    def read(name: str) -> Tensor:
        file = files[name]
        if file not in handles:
            handles[file] = safe_open(str(file), framework="pt")
        return handles[file].get_tensor(name)

    with torch.no_grad():
        for name, tensor in converted:
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            lo, hi = _local_rows(name, tensor)
            if hi > lo:
                local.copy_(fmt.read_local(name, tensor, (lo, hi), read))


def _local_rows(name: str, tensor: Tensor) -> tuple[int, int]:
    """The rows ``[lo, hi)`` of dim 0 this rank holds: FSDP2's ``Shard(0)`` split, or all (replicated/plain)."""
    if not isinstance(tensor, DTensor):
        return 0, tensor.shape[0]
    placements = tuple(tensor.placements)
    if all(isinstance(p, Replicate) for p in placements):
        return 0, tensor.shape[0]
    if placements != (Shard(0),):
        raise ValueError(
            f"pretrained=: {name!r} is laid out as {placements} on its mesh, and its checkpoint stores it in another"
            " layout (transformers converts it); only FSDP2's Shard(0) or replicated tensors can be read that way."
        )
    world, rank = tensor.device_mesh.size(), tensor.device_mesh.get_local_rank()
    bounds = chunk_bounds(tensor.shape[0], world)
    return bounds[rank], bounds[rank + 1]
