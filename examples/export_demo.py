"""Export demo: 2 CPU ranks fit a tiny Qwen2 with ``LazyExportFSDP2(offload="params")`` and export each step.

    python examples/export_demo.py

Lightning starts the second rank itself. Each step, every rank drains ``export_weights()``; rank 0
prints the export report (lazy path, no model-wide moves although the shards are offloaded).
"""

from __future__ import annotations

import os
import sys

import lightning.pytorch as pl
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from lightning_fsdp_export import LazyExportFSDP2
from lightning_fsdp_export.testing import VOCAB, tiny_qwen2


class TinyLM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = tiny_qwen2()

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss

    def on_train_batch_end(self, outputs: dict, batch: object, batch_idx: int) -> None:
        weights = dict(self.trainer.strategy.export_weights(dtype=torch.bfloat16))  # every rank
        report = self.trainer.strategy.last_export
        if self.global_rank == 0:
            print(f"step {self.global_step}: loss {outputs['loss'].item():.3f}, exported {report.tensors} tensors,"
                  f" {report.bytes / 1e6:.1f} MB in {report.seconds * 1e3:.1f} ms via {report.path} path,"
                  f" module moves {report.module_moves}, lm_head tied: "
                  f"{torch.equal(weights['lm_head.weight'], weights['model.embed_tokens.weight'])}")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    pl.seed_everything(0)
    data = torch.randint(0, VOCAB, (16, 32))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=4)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=LazyExportFSDP2(offload="params"), max_steps=4,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(TinyLM(), loader)


if __name__ == "__main__":
    main()
