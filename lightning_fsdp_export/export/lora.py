"""LoRA (peft) models: the staged export path and the adapter-only export.

Merging adapters does real weight math on the module, so a peft model does not take the lazy path:

1. with offloaded shards, the whole module is staged on the device once (``module_moves`` += 1);
2. every FSDP2 module is resharded, and the local shards that merging touches (each LoRA layer's
   base layer) are snapshotted;
3. ``merge_adapter()`` (peft's own math, which works on DTensor parameters) merges in place;
4. the merged base weights are gathered one by one, as the lazy path does, under the base model's
   HF names (:func:`~lightning_fsdp_export.export.names.export_name`), adapter tensors left out;
5. ``unmerge_adapter()`` resets peft's merge state and the snapshots are copied back, because merge
   then unmerge is not exact in floating point (measured: bf16 up to 4.9e-4 per round trip). The
   module ends bit-identical to before;
6. the shards go back to the host (``module_moves`` += 1).

Sharding: adapters are sharded with their layer (the automatic sharding wraps decoder layers, which
contain the LoRA modules), as verl does.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

import torch
from safetensors.torch import save_file
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lightning_fsdp_export.export.checkpoint_format import CheckpointFormat
from lightning_fsdp_export.export.lazy import ExportReport, lazy_export, plan_export
from lightning_fsdp_export.export.names import adapter_file_name, export_name, is_lora_name, is_peft_model

if TYPE_CHECKING:
    from peft.tuners.tuners_utils import BaseTunerLayer

__all__ = ["LoraMode", "check_adapters_loadable", "entries_for", "is_peft_model", "staged_merged_export",
           "write_adapter"]

LoraMode = Literal["merged", "adapter", "base"]
_LORA_MODES = ("merged", "adapter", "base")


def parse_lora_mode(value: str) -> LoraMode:
    """Validate a ``lora=`` argument once; raise a ``ValueError`` listing the accepted values."""
    if value not in _LORA_MODES:
        raise ValueError(f"lora={value!r} is not one of {', '.join(map(repr, _LORA_MODES))}.")
    return cast(LoraMode, value)  # (one of them: checked above)


def _lora_layers(module: nn.Module) -> list[BaseTunerLayer]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in module.modules() if isinstance(m, BaseTunerLayer)]


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@contextmanager
def merged_in_place(module: Any) -> Iterator[None]:  # (a peft model: merge_adapter, unmerge_adapter)
    """Within the block, the adapters are merged into the base weights; afterwards the module is exact again."""
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.reshard()  # the registered parameters are the sharded ones
    snapshots: list[tuple[Tensor, Tensor]] = []
    for layer in _lora_layers(module):
        for param in layer.get_base_layer().parameters(recurse=False):
            local = _local(param.data)
            snapshots.append((local, local.clone()))
    try:
        with torch.no_grad():
            module.merge_adapter()
        yield
    finally:
        with torch.no_grad():
            module.unmerge_adapter()
            for live, saved in snapshots:
                live.copy_(saved)


def entries_for(module: nn.Module, mode: LoraMode) -> list[tuple[list[str], Tensor]]:
    """What an export of ``module`` in ``mode`` yields, as :func:`plan_export` entries (no collective).

    Non-peft modules export everything; peft ones export the base weights (``"merged"``, ``"base"``)
    under HF names, or the adapter tensors (``"adapter"``) under peft's file names.
    """
    if not is_peft_model(module):
        return plan_export(module)
    if mode == "adapter":
        adapter = getattr(module, "active_adapter", "default")
        return plan_export(module, keep=is_lora_name, rename=lambda n: adapter_file_name(n, adapter))
    return plan_export(module, keep=lambda n: not is_lora_name(n), rename=export_name)


def check_adapters_loadable(base: list[tuple[list[str], Tensor]], adapters: list[tuple[list[str], Tensor]],
                            fmt: CheckpointFormat) -> None:
    """Refuse adapter tensors on a module whose base weight changes layout on disk (a fused MoE expert
    tensor): peft's file would hold them against the in-memory layout, which vLLM cannot load.

    Raises:
        ValueError: naming the adapter tensors and the base tensors they adapt.
    """
    converted = {name.rsplit(".", 1)[0] + "." for names, tensor in base for name in names
                 if fmt.converts(name, tensor)}
    if not converted:
        return
    bad = [name for names, _ in adapters for name in names if export_name(name).startswith(tuple(converted))]
    if bad:
        raise ValueError(
            f"LoRA adapter tensors {bad[:4]} adapt weights that the checkpoint stores in another layout than"
            f" memory ({sorted(converted)[:4]}: fused MoE experts), so vLLM cannot load them as an adapter. Push"
            " merged weights instead (VLLMWeightSync(lora='merged')), or leave the experts out of"
            " LoraConfig(target_modules/target_parameters)."
        )


def staged_merged_export(module: nn.Module, *, device: torch.device, dtype: torch.dtype | None,
                         stage: Callable[[], bool], unstage: Callable[[], None],
                         on_finish: Callable[[ExportReport], None],
                         bucket_bytes: int = 0, prefetch: int = 0,
                         reorder: Callable[[list[tuple[list[str], Tensor]]], list[tuple[list[str], Tensor]]]
                         | None = None,
                         checkpoint_format: CheckpointFormat | None = None,
                         ) -> Iterator[tuple[str, Tensor]]:
    """Yield the merged base weights of a peft model under HF names; a collective generator.

    Args:
        module: the ``PeftModel`` (FSDP2-sharded).
        device: where each tensor is gathered.
        dtype: cast floating tensors to this dtype.
        stage: moves offloaded shards to the device; returns whether it moved anything.
        unstage: moves them back (called only if ``stage`` moved them).
        on_finish: receives the :class:`ExportReport` once the generator is exhausted.
        bucket_bytes: as in :func:`~lightning_fsdp_export.export.lazy.lazy_export`.
        prefetch: as in :func:`~lightning_fsdp_export.export.lazy.lazy_export`.
        reorder: rearranges the merged entries (``entries_for(module, "merged")``, planned after the
            shards are staged) before the pass, e.g. into vLLM's layerwise order.
        checkpoint_format: maps merged base tensors to the checkpoint's layout (default: the base model's).
    """
    reports: list[ExportReport] = []
    start = time.perf_counter()
    moved = stage()
    seconds = 0.0
    try:
        with merged_in_place(module):
            seconds += time.perf_counter() - start
            for name, tensor in lazy_export(module, device=device, dtype=dtype, on_finish=reports.append,
                                            entries=(reorder or list)(entries_for(module, "merged")),
                                            bucket_bytes=bucket_bytes, prefetch=prefetch,
                                            checkpoint_format=checkpoint_format):
                yield name, tensor
            start = time.perf_counter()
    finally:
        if moved:
            unstage()
    seconds += time.perf_counter() - start
    (lazy,) = reports
    on_finish(ExportReport("staged", lazy.tensors, lazy.bytes, seconds + lazy.seconds, module_moves=2 if moved else 0,
                           gathered_bytes=lazy.gathered_bytes))


def write_adapter(weights: Iterator[tuple[str, Tensor]], module: Any, directory: str) -> None:  # (a peft model)
    """Write a peft-format adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``)."""
    tensors = {name: tensor.contiguous() for name, tensor in weights}
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    adapter = getattr(module, "active_adapter", "default")
    module.peft_config[adapter].save_pretrained(str(path))
    save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
