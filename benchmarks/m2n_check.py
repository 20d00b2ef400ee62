"""GPU check of ``RemoteVLLM(transport="nccl_m2n")`` (vLLM's M2N engine fed by ``strategy.weight_source(layout="m2n")``)
or, with ``--transport sparse_nccl``, of ``SparseNCCL()`` (vLLM 0.33's sparse engine fed our patch lists).

    torchrun --nproc-per-node N benchmarks/m2n_check.py [--transport sparse_nccl]  # N trainer GPUs, the server on GPU N

Needs N + 1 GPUs, vLLM (CUDA) and, for m2n, NVIDIA's ``nccl-extensions`` (``import nccl.m2n``); for
``sparse_nccl`` vLLM 0.33 or newer. No network. Rank 0 writes a tiny Qwen2 checkpoint (head_dim 64, untied and tied
lm_head alike), starts one
vLLM server on GPU N with ``--weight-transfer-config '{"backend": "nccl_m2n"}'``, then every rank runs a
3-step fit on its GPU syncing every step with ``verify="logprobs"`` (the server's prompt and greedy
continuation scored by the trainer's model) and, for comparison, the same syncs through ``nccl``. It
prints ``RESULT`` lines: per transport the median sync seconds and the largest verify gap, and what the
export gathered (0 bytes for a dense model sent shard-direct); with ``sparse_nccl`` also the bytes of its last
sync and whether both servers' weight checksums are equal after the last step (exact). Not yet run: no
multi-GPU machine so far.
"""

from __future__ import annotations

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
from lightning_fsdp_export import LazyExportFSDP2, RemoteVLLM, VLLMWeightSync
from lightning_fsdp_export.testing import tiny_qwen2
from tests.scripts.common import CausalLM, start_server, stop_server, token_loader, wait_for_server


class Record(pl.Callback):
    def __init__(self, syncs: dict[str, VLLMWeightSync]) -> None:
        self.syncs = syncs
        self.seconds: dict[str, list[float]] = {name: [] for name in syncs}
        self.gaps: dict[str, list[float]] = {name: [] for name in syncs}
        self.gathered: dict[str, int] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        for name, sync in self.syncs.items():
            sync.sync(trainer)
            self.seconds[name].append(sync.last_metrics["weight_sync/seconds"])
            self.gaps[name].append(float(sync.last_verify_diff or 0.0))
            self.gathered[name] = trainer.strategy.last_export.gathered_bytes


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--transport", default="nccl_m2n", choices=["nccl_m2n", "sparse_nccl"])
    transport = parser.parse_args().transport
    rank = int(os.environ.get("RANK", "0"))
    trainers = int(os.environ.get("WORLD_SIZE", "1"))
    if torch.cuda.device_count() < trainers + 1:
        print(f"RESULT m2n skipped: {torch.cuda.device_count()} GPU(s), {trainers} trainer rank(s) need {trainers + 1}")
        return
    work = Path(tempfile.gettempdir()) / "m2n_check"
    ckpt = work / "ckpt"
    port = 8471
    url = f"http://127.0.0.1:{port}"
    if rank == 0:
        work.mkdir(parents=True, exist_ok=True)
        tiny_qwen2(seed=5, tie_word_embeddings=False).to(torch.bfloat16).save_pretrained(ckpt)
        from lightning_fsdp_export.testing import save_word_tokenizer

        save_word_tokenizer(str(ckpt))
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        os.environ["CUDA_VISIBLE_DEVICES"] = str(trainers)
        start_server(ckpt, port, backend=transport)
        start_server(ckpt, port + 1, backend="nccl")
        if visible is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible
        for p in (port, port + 1):
            wait_for_server(f"http://127.0.0.1:{p}", ckpt / f"server{p}.log")
    pl.seed_everything(0)
    syncs = {transport: VLLMWeightSync(RemoteVLLM(url, transport=transport), verify="logprobs"),
             "nccl": VLLMWeightSync(RemoteVLLM(f"http://127.0.0.1:{port + 1}", transport="nccl"), verify="logprobs")}
    record = Record(syncs)
    trainer = pl.Trainer(accelerator="cuda", devices=trainers, strategy=LazyExportFSDP2(), max_steps=3,
                         callbacks=[record], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    start = time.monotonic()
    try:
        trainer.fit(CausalLM(lambda: tiny_qwen2(seed=5, tie_word_embeddings=False), lr=3e-3), token_loader(6))
        sums = {name: sync.target.weight_checksums() for name, sync in syncs.items()}  # after the last syncs
    finally:
        if rank == 0:
            for p in (port, port + 1):
                stop_server(ckpt, p)
    if trainer.is_global_zero:
        if transport == "sparse_nccl":
            a, b = (next(iter(sums[n].values())) for n in syncs)
            same = [n for n, h in a.items() if h and b.get(n) == h]
            print(f"RESULT sparse_nccl last_sync_bytes={syncs[transport].target.last_patch['sent_bytes']}"
                  f" exact={len(same) == len([n for n, h in a.items() if h])} compared={len(same)}")
        for name in syncs:
            print(f"RESULT {name} trainers={trainers} median_sync_s={statistics.median(record.seconds[name]):.3f}"
                  f" max_verify_gap={max(record.gaps[name]):.4f} gathered_bytes={record.gathered[name]}"
                  f" fit_s={time.monotonic() - start:.0f}")


if __name__ == "__main__":
    main()
