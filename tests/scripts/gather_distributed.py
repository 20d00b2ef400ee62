"""Run under ``torchrun --nproc-per-node 2``: every gather mode of the export is bit-identical to the plain loop.

The reference is the export as it was first written: ``tensor.full_tensor()`` per DTensor, cast after.
Each mode (cast before the gather, layer-grouped buckets, row-block chunks, prefetch) must yield the
same names, dtypes and bits, on models with uneven rows, a rank holding no rows, mixed dtypes, tied
weights, and a peft LoRA model's staged merged path; plus DTensor layouts FSDP2 does not make
(``Shard(1)``, ``Replicate``, ``Partial``). Rank 0 writes the results as JSON to ``--out``.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from lightning_fsdp_export.export.lazy import ExportReport, gather_full, lazy_export, plan_export
from lightning_fsdp_export.export.lora import merged_in_place, staged_merged_export
from lightning_fsdp_export.testing import tiny_llama, tiny_lora_qwen2, tiny_qwen2
from tests.scripts.common import OddNet, end_script, start_script

MODES = [dict(bucket_bytes=b, prefetch=p) for b, p in itertools.product([0, 1 << 10, 1 << 20], [0, 1])]


class OddNetPlus(OddNet):
    """OddNet, plus two layers (names with a layer index: grouped gathers) and an int buffer (a plain tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(6, 5), nn.Linear(5, 9)])
        self.register_buffer("steps", torch.arange(4))


def shard(model: nn.Module, mesh: Any) -> nn.Module:
    for layer in [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def reference(module: nn.Module, dtype: torch.dtype | None, entries: Any = None) -> list[tuple[str, torch.Tensor]]:
    out = []
    for names, tensor in entries or plan_export(module):
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach().clone()
        if dtype is not None and full.is_floating_point():
            full = full.to(dtype)
        out += [(name, full) for name in names]
    return out


def compare(got: list[tuple[str, torch.Tensor]], want: list[tuple[str, torch.Tensor]]) -> list[str]:
    if [n for n, _ in got] != [n for n, _ in want]:
        return ["<names differ>"]
    return [n for (n, a), (_, b) in zip(got, want) if a.dtype != b.dtype or not torch.equal(a, b)]


def check_model(module: nn.Module) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for dtype in (None, torch.bfloat16):
        want = reference(module, dtype)
        for mode in MODES:
            reports: list[ExportReport] = []
            got = list(lazy_export(module, dtype=dtype, on_finish=reports.append, **mode))
            key = f"{dtype}/{mode['bucket_bytes']}/{mode['prefetch']}"
            out[key] = {"mismatched": compare(got, want), "gathered": reports[0].gathered_bytes,
                        "bytes": reports[0].bytes}
    return out


def check_closed_early(module: nn.Module) -> dict[str, Any]:
    """A consumer that stops after one tensor with a gather in flight: the next export is still right."""
    stream = lazy_export(module, dtype=torch.bfloat16, prefetch=1)
    next(stream)
    stream.close()  # the issued all-gathers complete on every rank; none is left to mismatch the next one
    return {"mismatched_after": compare(list(lazy_export(module, dtype=torch.bfloat16, prefetch=1)),
                                        reference(module, torch.bfloat16))}


def check_lora(module: nn.Module) -> dict[str, Any]:
    from lightning_fsdp_export.export.lora import entries_for

    with merged_in_place(module):
        want = reference(module, torch.bfloat16, entries_for(module, "merged"))
    out = {}
    for mode in MODES:
        got = list(staged_merged_export(module, device=torch.device("cpu"), dtype=torch.bfloat16,
                                        stage=lambda: False, unstage=lambda: None, on_finish=lambda r: None,
                                        **mode))
        out[f"{mode['bucket_bytes']}/{mode['prefetch']}"] = compare(got, want)
    return out


def check_layouts(mesh: Any) -> dict[str, Any]:
    """Layouts FSDP2 does not make: cast-before where exact (Shard(1), Replicate), cast-after for Partial."""
    torch.manual_seed(11)
    full = torch.randn(6, 5) * 3
    out = {}
    for name, placements in [("shard1", [Shard(1)]), ("replicate", [Replicate()])]:
        t = distribute_tensor(full, mesh, placements)
        out[name] = torch.equal(gather_full(t, device=torch.device("cpu"), dtype=torch.bfloat16),
                                full.to(torch.bfloat16))
    local = torch.randn(6, 5, generator=torch.Generator().manual_seed(20 + dist.get_rank()))
    partial = DTensor.from_local(local, mesh, [Partial()], run_check=False)
    summed = partial.full_tensor()
    got = gather_full(partial, device=torch.device("cpu"), dtype=torch.bfloat16)
    out["partial_max_diff"] = (got.float() - summed.to(torch.bfloat16).float()).abs().max().item()
    # what cast-before would have given for Partial: not the same bits (why it is refused there)
    cast_first = DTensor.from_local(local.to(torch.bfloat16), mesh, [Partial()], run_check=False).full_tensor()
    out["partial_cast_first_max_diff"] = (cast_first.float() - summed.to(torch.bfloat16).float()).abs().max().item()
    return out


def main() -> None:
    args, _ = start_script("", "gather")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    results: dict[str, Any] = {
        "odd": check_model(shard(OddNetPlus(), mesh)),
        "qwen2_tied": check_model(shard(tiny_qwen2(), mesh)),
        "llama_untied": check_model(shard(tiny_llama(), mesh)),
        "closed_early": check_closed_early(shard(tiny_qwen2(), mesh)),
        "lora_merged": check_lora(shard(tiny_lora_qwen2(), mesh)),
        "layouts": check_layouts(mesh),
    }
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    end_script()


if __name__ == "__main__":
    main()
