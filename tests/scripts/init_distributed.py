"""Run under ``torchrun --nproc-per-node 2``: meta-device init, ``pretrained=`` loading, models without HF.

Rank 0 writes ``{scenario: result}`` as JSON to ``--out``; ``tests/test_init_distributed.py`` asserts
on it. Each scenario is one ``Trainer.fit`` on 2 gloo ranks, the model built the way a user scaling
up would: ``with trainer.init_module(empty_init=True): module = LM(...)``.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch import Trainer, seed_everything
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from lightning_fsdp_export import LazyExportFSDP2
from lightning_fsdp_export.testing import tiny_llama, tiny_qwen2
from tests.scripts.common import CausalLM, end_script, name_diff, run_scenarios, start_script, token_loader

STEPS = 3


def trainer_for(strategy: LazyExportFSDP2, callbacks: list[pl.Callback], steps: int = STEPS) -> Trainer:
    return Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, logger=False,
                   enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                   callbacks=callbacks)


class Capture(pl.Callback):
    """Exports right after setup, and looks at the model's state before any step."""

    def __init__(self) -> None:
        self.start: list[tuple[str, torch.Tensor]] = []
        self.inv_freq: torch.Tensor | None = None

    def on_train_start(self, trainer: Trainer, pl_module: CausalLM) -> None:
        self.start = list(trainer.strategy.export_weights())
        rotary = getattr(pl_module.model.model, "rotary_emb", None)
        self.inv_freq = None if rotary is None else rotary.inv_freq.detach().clone()


def fit_recording_warnings(trainer: Trainer, module: pl.LightningModule) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, token_loader(n=8))
    return [str(w.message) for w in caught if "initialization incomplete" in str(w.message)]


def scenario_meta(build: Any) -> dict[str, Any]:
    seed_everything(0)
    capture = Capture()
    trainer = trainer_for(LazyExportFSDP2(), [capture])
    with trainer.init_module(empty_init=True):
        module = CausalLM(build)
    was_meta = all(p.is_meta for p in module.parameters())
    init_warnings = fit_recording_warnings(trainer, module)
    weights = dict(capture.start)
    fresh = build()
    std = fresh.config.initializer_range
    matrices = {n: t for n, t in weights.items() if t.ndim == 2}
    return {
        "was_meta": was_meta,
        "warnings": init_warnings,
        "norms": {n: [t.min().item(), t.max().item()] for n, t in weights.items() if "norm" in n},
        "inv_freq_max_diff": None if capture.inv_freq is None
        else (capture.inv_freq - fresh.model.rotary_emb.inv_freq).abs().max().item(),
        "initializer_range": std,
        "stds": {n: t.float().std().item() for n, t in matrices.items()},
        # rank 1's rows are not a copy of rank 0's (DTensor random ops on CPU would repeat them)
        "halves_differ": {n: not torch.equal(t[: t.shape[0] // 2], t[t.shape[0] // 2 : 2 * (t.shape[0] // 2)])
                          for n, t in matrices.items()},
        # tied (Qwen2) still tied after init; untied (Llama) not made equal by it
        "tied": bool(fresh.config.tie_word_embeddings),
        "head_vs_embedding_max_diff": (weights["lm_head.weight"].float()
                                       - weights["model.embed_tokens.weight"].float()).abs().max().item(),
        "losses": [float(x) for x in module.losses],
    }


class WithOddParts(CausalLM):
    """A value head (``nn.Linear``: has ``reset_parameters``) and a bare parameter holder (has none)."""

    def __init__(self) -> None:
        super().__init__(tiny_qwen2)
        self.value_head = nn.Linear(256, 1)
        self.bare = Bare()


class Bare(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale.sum()


def scenario_meta_warns() -> dict[str, Any]:
    seed_everything(0)
    trainer = trainer_for(LazyExportFSDP2(export_module="model"), [], steps=1)
    with trainer.init_module(empty_init=True):
        module = WithOddParts()
    init_warnings = fit_recording_warnings(trainer, module)
    head = module.value_head.weight
    local = head.to_local() if hasattr(head, "to_local") else head
    return {"warnings": init_warnings, "head_nonfinite": int((~torch.isfinite(local)).sum()),
            "head_std": local.float().std().item()}


def save_checkpoints(root: str) -> dict[str, str]:
    """Rank 0 writes the checkpoints the pretrained scenarios load; the other rank waits."""
    from safetensors.torch import save_file

    dirs = {name: os.path.join(root, name) for name in ("qwen2_bf16", "llama_sharded", "qwen2_missing")}
    if dist.get_rank() == 0:
        tiny_qwen2(seed=5).to(torch.bfloat16).save_pretrained(dirs["qwen2_bf16"])  # tied: no lm_head.weight
        tiny_llama(seed=6).save_pretrained(dirs["llama_sharded"], max_shard_size="300KB")
        model = tiny_qwen2(seed=7)
        model.save_pretrained(dirs["qwen2_missing"])
        state = {k: v.contiguous() for k, v in model.state_dict().items()
                 if k not in ("model.norm.weight", "lm_head.weight")}
        save_file(state, os.path.join(dirs["qwen2_missing"], "model.safetensors"), metadata={"format": "pt"})
    dist.barrier()
    return dirs


def scenario_pretrained(build: Any, path: str, *, meta: bool) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    seed_everything(0)
    capture = Capture()
    trainer = trainer_for(LazyExportFSDP2(pretrained=path), [capture], steps=2)
    if meta:
        with trainer.init_module(empty_init=True):
            module = CausalLM(build)
    else:
        module = CausalLM(build)
    init_warnings = fit_recording_warnings(trainer, module)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    got = dict(capture.start)
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    return {
        "files": len(files),
        "names_diff": name_diff(got, reference),
        "mismatched": [n for n, t in got.items() if n not in reference or not torch.equal(t, reference[n])],
        "dtypes": sorted({str(t.dtype) for t in got.values()}),
        "inv_freq_max_diff": None if capture.inv_freq is None
        else (capture.inv_freq - build().model.rotary_emb.inv_freq).abs().max().item(),
        "warnings": init_warnings,
        "losses": [float(x) for x in module.losses],
    }


def scenario_error(make: Any) -> dict[str, Any]:
    seed_everything(0)
    try:
        trainer, module = make()
        trainer.fit(module, token_loader(n=8))
    except Exception as err:  # noqa: BLE001 - recorded for the test to check
        return {"error": type(err).__name__, "message": str(err)}
    return {"error": None}


class Plain(pl.LightningModule):
    """No Hugging Face model anywhere: a small MLP language model of its own."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Embedding(512, 64), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 512))
        self.losses: list[float] = []

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        logits = self.net(ids[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, 512), ids[:, 1:].reshape(-1))
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def scenario_plain_module() -> dict[str, Any]:
    seed_everything(0)
    module = Plain()
    strategy = LazyExportFSDP2()
    trainer_for(strategy, []).fit(module, token_loader(n=8))
    out: dict[str, Any] = {"losses": module.losses, "sharded": type(module.net[1].weight).__name__}
    try:
        list(strategy.export_weights())
    except ValueError as err:
        out["export_error"] = str(err)
    named = LazyExportFSDP2(export_module="net")
    trainer_for(named, [], steps=1).fit(Plain(), token_loader(n=8))
    out["named_export"] = [name for name, _ in named.export_weights()]
    return out


class PolicyAndReference(CausalLM):
    """A policy and a frozen reference model beside it (RL's usual pair), with no ``export_module``."""

    def __init__(self) -> None:
        super().__init__(tiny_qwen2)
        self.reference = tiny_qwen2(seed=1).requires_grad_(False)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        with torch.no_grad():
            self.reference(input_ids=ids)
        return super().training_step(batch, batch_idx)


def scenario_several_models() -> dict[str, Any]:
    seed_everything(0)
    module = PolicyAndReference()
    strategy = LazyExportFSDP2()
    trainer_for(strategy, []).fit(module, token_loader(n=8))
    try:
        list(strategy.export_weights())
        message = None
    except ValueError as err:
        message = str(err)
    return {"losses": module.losses, "export_error": message}


def scenario_policy_and_reference_pretrained(path: str) -> dict[str, Any]:
    """RL's pair, both from the same checkpoint, both built on the meta device."""
    from transformers import AutoModelForCausalLM

    from lightning_fsdp_export import lazy_export

    seed_everything(0)
    capture = Capture()
    strategy = LazyExportFSDP2(export_module="model", pretrained={"model": path, "reference": path})
    trainer = trainer_for(strategy, [capture], steps=1)
    with trainer.init_module(empty_init=True):
        module = PolicyAndReference()
    init_warnings = fit_recording_warnings(trainer, module)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    ref_export = dict(lazy_export(module.reference))
    return {"policy_mismatched": [n for n, t in capture.start if not torch.equal(t, reference[n])],
            "reference_mismatched": [n for n, t in ref_export.items() if not torch.equal(t, reference[n])],
            "tensors": [len(capture.start), len(ref_export)], "warnings": init_warnings}


class HeadCapture(pl.Callback):
    """The head's export before any step (every rank: a collective), and the drafter-like source of it."""

    error: str | None = None

    def on_train_start(self, trainer: Trainer, pl_module: pl.LightningModule) -> None:
        from lightning_fsdp_export import lazy_export

        self.head = dict(lazy_export(pl_module.head))
        self.named = [name for name, _ in trainer.strategy.module_source("head", prefix="value_head.")]
        try:
            trainer.strategy.module_source("heads.value")
        except ValueError as err:
            self.error = str(err)


def scenario_meta_policy_beside_a_built_head(path: str) -> dict[str, Any]:
    """The policy on the meta device (``pretrained=``), a head built with its values beside it after
    ``init_module(empty_init=True)`` (a drafter or value head loaded from a checkpoint): it keeps them."""
    seed_everything(0)
    capture = HeadCapture()
    trainer = trainer_for(LazyExportFSDP2(pretrained=path), [capture], steps=1)
    with trainer.init_module(empty_init=True):
        module = CausalLM(tiny_qwen2)
    head = torch.nn.Sequential(torch.nn.Linear(64, 8), torch.nn.LayerNorm(8))
    with torch.no_grad():
        for i, p in enumerate(head.parameters()):
            p.copy_(torch.arange(p.numel(), dtype=torch.float32).view_as(p) / 100 + i)
    built = {name: p.detach().clone() for name, p in head.state_dict().items()}
    module.head = head
    init_warnings = fit_recording_warnings(trainer, module)
    return {"head_mismatched": [n for n, t in built.items() if not torch.equal(capture.head[n], t)],
            "named": capture.named, "error": capture.error, "warnings": init_warnings}


def main() -> None:
    args, root = start_script("", "init")
    dirs = save_checkpoints(str(root))
    scenarios = {
        "meta_qwen2": lambda: scenario_meta(tiny_qwen2),
        "meta_llama": lambda: scenario_meta(tiny_llama),
        "meta_warns": scenario_meta_warns,
        "pretrained_qwen2_meta": lambda: scenario_pretrained(lambda: tiny_qwen2(seed=5), dirs["qwen2_bf16"], meta=True),
        "pretrained_qwen2_built": lambda: scenario_pretrained(lambda: tiny_qwen2(seed=9), dirs["qwen2_bf16"],
                                                              meta=False),
        "pretrained_llama_sharded_meta": lambda: scenario_pretrained(tiny_llama, dirs["llama_sharded"], meta=True),
        "pretrained_missing": lambda: scenario_error(lambda: (
            trainer_for(LazyExportFSDP2(pretrained=dirs["qwen2_missing"]), [], steps=1), CausalLM(tiny_qwen2))),
        "pretrained_policy_and_reference": lambda: scenario_policy_and_reference_pretrained(dirs["qwen2_bf16"]),
        "plain_module": scenario_plain_module,
        "several_models": scenario_several_models,
        "meta_policy_beside_a_built_head": lambda: scenario_meta_policy_beside_a_built_head(dirs["qwen2_bf16"]),
    }
    names = args.only.split(",") if args.only else list(scenarios)
    results = run_scenarios(scenarios, names)
    if dist.get_rank() == 0:
        import json

        with open(args.out, "w") as f:
            json.dump(results, f, indent=1, default=str)
    end_script()


if __name__ == "__main__":
    main()
