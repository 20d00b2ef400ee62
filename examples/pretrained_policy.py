"""The large-model recipe, end to end on 2 CPU ranks: meta-device init, ``pretrained=``, the same checkpoint in vLLM.

    python examples/pretrained_policy.py [--steps 4] [--workdir runs/pretrained_policy] [--arch qwen3_moe]
                                         [--target shard-direct | sparse]

A "pretrained" tiny Qwen2 checkpoint (or, with ``--arch``, any family of ``testing.tiny_family``: an MoE
model's experts are fused in memory and per expert on disk) is written locally (nothing downloaded).
Then, as for a model too big for one rank:

- the policy and a frozen reference model are built under ``trainer.init_module(empty_init=True)``
  (meta device: no memory, no random init);
- ``LazyExportFSDP2(pretrained={"policy": ckpt, "reference": ckpt})`` shards both and reads the
  checkpoint straight into the shards;
- ``ColocatedVLLM(model=ckpt)`` starts every rank's engine from the same directory, and the first
  sync, checked bit for bit (``exact_first_sync=True``: vLLM's weight checker) and with
  ``verify="logprobs"``, shows trainer and engine agree before any step;
- training uses Lightning's usual flows: ``precision="bf16-mixed"``, ``accumulate_grad_batches=2``,
  validation, a checkpoint, and a second fit resumed from it (the sync resumes with its version).

The loss is a sequence likelihood on engine rollouts plus a KL term to the reference; the KL
printed at the first step is 0 exactly because both models came from the same checkpoint.

``--target shard-direct`` replaces the colocated engines with one vLLM server (started here from the same
checkpoint, ``gloo`` backend) fed by ``RemoteVLLM(transport=Gloo(shard_direct=True))``: every rank sends
its own shards; rollouts come from the server's ``/v1/completions``. ``--target sparse`` adds ``sparse=True``:
after each dense sync (the first, and the first after the resume) every rank sends only the elements of its
shards that changed.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from lightning_fsdp_export import ColocatedVLLM, LazyExportFSDP2, RemoteVLLM, VLLMWeightSync
from lightning_fsdp_export.targets import Gloo
from lightning_fsdp_export.testing import VOCAB, save_word_tokenizer, tiny_family, tiny_qwen2
from tests.scripts.common import start_server, stop_server, wait_for_server


class PolicyWithReference(pl.LightningModule):
    def __init__(self, sync: VLLMWeightSync, ckpt: Path) -> None:
        super().__init__()
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(ckpt)  # the checkpoint's own config: names and shapes agree
        self.policy = AutoModelForCausalLM.from_config(config)
        self.reference = AutoModelForCausalLM.from_config(config).requires_grad_(False)
        self.sync = sync

    def rollouts(self) -> torch.Tensor:
        from vllm import SamplingParams

        g = torch.Generator().manual_seed(1000 * self.global_step + self.global_rank)
        prompts = [torch.randint(0, VOCAB, (8,), generator=g).tolist() for _ in range(4)]
        if isinstance(self.sync.target, RemoteVLLM):  # a server: its OpenAI route, token ids in and out
            model = self.sync.target.request("GET", "/v1/models")["data"][0]["id"]
            body = {"model": model, "prompt": prompts, "max_tokens": 8, "temperature": 1.0, "ignore_eos": True,
                    "return_token_ids": True, "seed": self.global_step}
            choices = sorted(self.sync.target.request("POST", "/v1/completions", body)["choices"],
                             key=lambda c: c["index"])
            return torch.tensor([p + c["token_ids"] for p, c in zip(prompts, choices)])
        params = SamplingParams(temperature=1.0, max_tokens=8, detokenize=False, ignore_eos=True,
                                seed=self.global_step)
        outs = self.sync.target.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return torch.tensor([p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        seqs = self.rollouts()
        logp = torch.log_softmax(self.policy(input_ids=seqs[:, :-1]).logits.float(), -1)
        with torch.no_grad():
            ref = torch.log_softmax(self.reference(input_ids=seqs[:, :-1]).logits.float(), -1)
        kl = (logp.exp() * (logp - ref)).sum(-1).mean()
        loss = -logp.gather(-1, seqs[:, 1:, None]).mean() + 0.1 * kl
        if self.global_rank == 0:
            print(f"step {self.global_step} batch {batch_idx}  loss {loss.item():.4f}  kl {kl.item():.6f}", flush=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        seqs = torch.arange(16)[None] % VOCAB
        self.log("val_loss", self.policy(input_ids=seqs, labels=seqs).loss, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.policy.parameters(), lr=1e-3)


def fit(ckpt: Path, workdir: Path, steps: int, resume: str | None, url: str | None = None, sparse: bool = False
        ) -> tuple[pl.Trainer, VLLMWeightSync]:
    engine: Any = (RemoteVLLM(url, transport=Gloo(shard_direct=True, sparse=sparse)) if url else
                   ColocatedVLLM(model=ckpt, dtype="bfloat16", max_model_len=128, enforce_eager=True))
    sync = VLLMWeightSync(engine, every_n_train_steps=1, sync_on_train_start=True, verify="logprobs",
                          exact_first_sync=True)
    strategy = LazyExportFSDP2(export_module="policy", pretrained={"policy": ckpt, "reference": ckpt},
                               offload="params")
    checkpoints = ModelCheckpoint(dirpath=workdir / "checkpoints", save_last=True)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, precision="bf16-mixed",
                         max_steps=steps, accumulate_grad_batches=2, limit_val_batches=1, val_check_interval=2,
                         callbacks=[sync, checkpoints], logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=workdir)
    with trainer.init_module(empty_init=True):
        module = PolicyWithReference(sync, ckpt)
    assert all(p.is_meta for p in module.parameters()), "the model was meant to be built on the meta device"
    trainer.fit(module, torch.utils.data.DataLoader(range(64), batch_size=1),
                torch.utils.data.DataLoader(range(2), batch_size=1), ckpt_path=resume)
    check = sync.last_exact_check
    if trainer.global_rank == 0 and check is not None:
        print(f"exact first sync: {check.compared} engine parameters restored bit for bit, {check.not_comparable}"
              " not comparable", flush=True)
    return trainer, sync


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--workdir", default="runs/pretrained_policy")
    parser.add_argument("--arch", default="qwen2", help="qwen2, or a family of testing.tiny_family (qwen3_moe, ...)")
    parser.add_argument("--target", default="colocated", choices=["colocated", "shard-direct", "sparse"])
    parser.add_argument("--port", type=int, default=8431)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    workdir = Path(args.workdir)
    ckpt = (workdir / "pretrained").resolve()
    rank0 = os.environ.get("LOCAL_RANK", "0") == "0"
    if rank0 and not (ckpt / "config.json").exists():
        model = tiny_qwen2(seed=42) if args.arch == "qwen2" else tiny_family(args.arch, seed=42)
        model.to(torch.bfloat16).save_pretrained(ckpt)  # stands in for a hub checkpoint
        save_word_tokenizer(str(ckpt))  # a server returns logprobs (verify) only with a tokenizer
    url = None
    if args.target != "colocated":
        url = f"http://127.0.0.1:{args.port}"
        if rank0:  # before Lightning starts rank 1
            start_server(ckpt, args.port)
            wait_for_server(url, ckpt / f"server{args.port}.log")
    try:
        pl.seed_everything(0)
        sparse = args.target == "sparse"
        trainer, sync = fit(ckpt, workdir, args.steps, resume=None, url=url, sparse=sparse)
        if trainer.global_rank == 0:
            print(f"first fit: {trainer.global_step} optimizer steps, sync version {sync.version}", flush=True)
        last = str(workdir / "checkpoints" / "last.ckpt")
        trainer, sync = fit(ckpt, workdir, args.steps + 2, resume=last, url=url, sparse=sparse)
        if trainer.global_rank == 0:
            print(f"resumed fit: {trainer.global_step} optimizer steps, sync version {sync.version}", flush=True)
            if url:
                print(f"shard-direct: last export {trainer.strategy.last_export.path}, gathered"
                      f" {trainer.strategy.last_export.gathered_bytes} bytes on rank 0", flush=True)
                patch = sync.target.last_patch
                if patch is not None:
                    print(f"sparse: last sync {'patches' if patch['sparse'] else 'dense'}, rank 0 sent"
                          f" {patch['sent_bytes']} of {patch['dense_bytes']} bytes ({patch['changed']} of"
                          f" {patch['elements']} elements changed)", flush=True)
    finally:
        if url and rank0:
            stop_server(ckpt, args.port)


if __name__ == "__main__":
    main()
