"""Lightning's 2-D recipe on 4 CPU ranks, TP 2 x DP 2 (``tests/test_tensor_parallel.py``).

As a user writes it: the model built on meta (``trainer.init_module(empty_init=True)``), ``configure_model``
applies ``ColwiseParallel`` / ``RowwiseParallel`` to every decoder layer on the ``tensor_parallel`` mesh, then
``fully_shard`` on ``data_parallel``; ``LazyExportFSDP2(pretrained=ckpt, tensor_parallel_size=2)`` loads the
checkpoint into the 2-D shards. At train start ``export_weights()`` is compared with the checkpoint, bit
for bit, in fp32 and bf16, and a shard-direct source (``layout="shards"``) is drained to see which tensors it
can send as rows. One training step later, a sync into ``InMemoryTarget`` must equal ``export_weights()``.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import lightning.pytorch as pl
from safetensors.torch import load_file
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from lightning_fsdp_export import InMemoryTarget, LazyExportFSDP2, VLLMWeightSync
from lightning_fsdp_export.testing import qwen2_config, tiny_qwen2
from tests.scripts.common import end_script, name_diff, token_loader

PLAN = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}


class TensorParallelLM(pl.LightningModule):
    def __init__(self, checkpoint: dict[str, torch.Tensor]) -> None:
        super().__init__()
        from transformers import Qwen2ForCausalLM

        self.model = Qwen2ForCausalLM(qwen2_config())
        self.checkpoint = checkpoint
        self.report: dict[str, Any] = {}

    def configure_model(self) -> None:
        tp, dp = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
        for layer in self.model.model.layers:
            parallelize_module(layer, tp, PLAN)
            fully_shard(layer, mesh=dp)
        fully_shard(self.model, mesh=dp)

    def on_train_start(self) -> None:
        strategy = self.trainer.strategy
        for dtype in (torch.float32, torch.bfloat16):
            got = dict(strategy.export_weights(dtype=dtype))
            if dtype == torch.float32:
                self.start_export = got  # Fabric's export of the same model on the same mesh must equal it
            want = {name: t.to(dtype) for name, t in self.checkpoint.items()}
            self.report[f"names_{dtype}"] = name_diff(got, want)
            self.report[f"unequal_{dtype}"] = [n for n in want if n in got and not torch.equal(got[n], want[n])]
            self.report[f"dtypes_{dtype}"] = sorted({str(t.dtype) for t in got.values()})
        whole = rows = 0
        for name, tensor in strategy.export_source(dtype=torch.bfloat16, layout="shards"):
            if tuple(tensor.shape) == tuple(self.checkpoint[name].shape):
                whole += 1
                assert torch.equal(tensor, self.checkpoint[name].to(torch.bfloat16)), name
            else:
                rows += 1
        self.report["shards_layout"] = {"whole": whole, "rows": rows}

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def parallelize(model: torch.nn.Module, mesh: Any) -> torch.nn.Module:
    """The 2-D recipe as Fabric's ``parallelize_fn``: TP on every decoder layer, then ``fully_shard`` on DP."""
    tp, dp = mesh["tensor_parallel"], mesh["data_parallel"]
    for layer in model.model.layers:
        parallelize_module(layer, tp, PLAN)
        fully_shard(layer, mesh=dp)
    fully_shard(model, mesh=dp)
    return model


def fabric_run(ckpt: Path, checkpoint: dict[str, torch.Tensor],
               trainer_start: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The same recipe in a Fabric loop: meta init, ``parallelize_fn``, ``pretrained=``; its export against the
    checkpoint and against the Trainer strategy's export of the same model on the same mesh; a push after a step."""
    from lightning.fabric import Fabric
    from transformers import Qwen2ForCausalLM

    from lightning_fsdp_export.fabric import LazyExportFSDP2 as FabricStrategy
    from lightning_fsdp_export.fabric import WeightSync

    fabric = Fabric(accelerator="cpu", devices=4, strategy=FabricStrategy(
        parallelize_fn=parallelize, pretrained=str(ckpt), tensor_parallel_size=2))
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = Qwen2ForCausalLM(qwen2_config())
    model = fabric.setup_module(model)
    got = dict(fabric.strategy.export_weights(dtype=torch.float32))
    report = {"mesh": dict(zip(fabric.strategy.device_mesh.mesh_dim_names, fabric.strategy.device_mesh.shape)),
              "names": name_diff(got, checkpoint),
              "unequal": [n for n in checkpoint if n in got and not torch.equal(got[n], checkpoint[n])],
              "unequal_to_trainer": [n for n in trainer_start if not torch.equal(got.get(n, torch.empty(0)),
                                                                                  trainer_start[n])]}
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    fabric.backward(model(input_ids=ids, labels=ids).loss)
    optimizer.step()
    sync = WeightSync(InMemoryTarget(dtype=torch.float32))
    sync.push(fabric, step=1)
    after = dict(fabric.strategy.export_weights(dtype=torch.float32))
    report.update(synced_versions=sync.target.versions,
                  sync_not_equal=[n for n in after if n in sync.target.weights
                                  and not torch.equal(sync.target.weights[n], after[n])],
                  trained=len([n for n in after if not torch.equal(after[n], checkpoint[n])]))
    sync.teardown()
    return report


def main() -> None:
    out = Path(sys.argv[sys.argv.index("--out") + 1])
    ckpt = out.parent / "tp_ckpt"
    dist.init_process_group("gloo")
    if dist.get_rank() == 0:
        tiny_qwen2(seed=5).save_pretrained(str(ckpt))
    dist.barrier()
    checkpoint = load_file(str(ckpt / "model.safetensors"))
    if "lm_head.weight" not in checkpoint:  # tied: the export names the head too
        checkpoint["lm_head.weight"] = checkpoint["model.embed_tokens.weight"]
    report: dict[str, Any] = {}
    try:
        target = InMemoryTarget(dtype=torch.float32)
        trainer = pl.Trainer(accelerator="cpu", devices=4, max_steps=1, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False,
                             strategy=LazyExportFSDP2(pretrained=str(ckpt), tensor_parallel_size=2),
                             callbacks=[VLLMWeightSync(target, sync_on_train_start=False)])
        with trainer.init_module(empty_init=True):
            module = TensorParallelLM(checkpoint)
        trainer.fit(module, token_loader(n=8, batch_size=2))
        after = dict(trainer.strategy.export_weights(dtype=torch.float32))
        report = {**module.report, "mesh": dict(zip(trainer.strategy.device_mesh.mesh_dim_names,
                                                    trainer.strategy.device_mesh.shape)),
                  "synced_versions": target.versions,
                  # rank 0's target holds the pushed tensors; other ranks push nothing of their own
                  "sync_names_diff": name_diff(target.weights, after) if dist.get_rank() == 0 else None,
                  "sync_not_equal": [n for n in after if n in target.weights
                                     and not torch.equal(target.weights[n], after[n])],
                  "trained": [n for n in after if not torch.equal(after[n], checkpoint[n])]}
        report["fabric"] = fabric_run(ckpt, checkpoint, module.start_export)
    except Exception:  # noqa: BLE001 - reported to the test
        report = {"crash": traceback.format_exc()}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, report)
    if dist.get_rank() == 0:
        out.write_text(json.dumps(everyone, default=str))
    end_script()


if __name__ == "__main__":
    main()
