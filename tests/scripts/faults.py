"""Run under ``torchrun --nproc-per-node 2``: faults and bad input during a sync, on 2 gloo ranks.

Every scenario must end in a clear error (or a warning with ``on_error="warn"``) on every rank,
never a hang. Each rank writes its own JSON (``--out`` and ``--out.rank1``) with the messages and
the seconds from the failing sync's start to the error.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from lightning_fsdp_export import ColocatedVLLM, InMemoryTarget, LazyExportFSDP2, RemoteVLLM, VLLMWeightSync
from lightning_fsdp_export.targets import Directory
from lightning_fsdp_export.testing import VOCAB, tiny_qwen2
from tests.scripts.common import end_script, run_scenarios, start_script
from tests.scripts.sync import LM, loader


class FailingTarget(InMemoryTarget):
    """Raises on one rank after ``after`` tensors of version ``version`` (a target failing mid-sync)."""

    def __init__(self, *, rank: int, version: int, after: int = 5) -> None:
        super().__init__()
        self.fail_rank, self.fail_version, self.after = rank, version, after
        self.started: float | None = None

    def push(self, weights: Any, *, version: int) -> None:
        self.started = time.perf_counter()
        if version == self.fail_version and self._rank == self.fail_rank:
            for i, _ in enumerate(weights):
                if i + 1 == self.after:
                    raise OSError("disk full while writing the engine's weights (injected)")
        super().push(weights, version=version)


def trainer_for(callbacks: list[pl.Callback], steps: int, **kwargs: Any) -> Trainer:
    return Trainer(accelerator="cpu", devices=2, strategy=LazyExportFSDP2(), max_steps=steps, logger=False,
                   enable_checkpointing=kwargs.pop("enable_checkpointing", False), enable_progress_bar=False,
                   enable_model_summary=False, callbacks=callbacks, **kwargs)


def fit_catching(trainer: Trainer, module: pl.LightningModule, **kwargs: Any) -> dict[str, Any]:
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(module, loader(), **kwargs)
            error = None
        except Exception as err:  # noqa: BLE001 - recorded for the test
            error = f"{type(err).__name__}: {err}"
    warned = [str(w.message) for w in caught if "Weight sync" in str(w.message)]
    return {"error": error, "warnings": warned, "fit_seconds": time.perf_counter() - start}


def scenario_mid_push(on_error: str) -> dict[str, Any]:
    seed_everything(0)
    target = FailingTarget(rank=1, version=2)
    sync = VLLMWeightSync(target, on_error=on_error)  # type: ignore[arg-type]
    module = LM()
    result = fit_catching(trainer_for([sync], steps=3), module)
    result.update(versions=target.versions, stale=sync.stale, tensors_last=len(target.weights),
                  seconds_to_error=time.perf_counter() - (target.started or 0), steps_trained=len(module.losses))
    return result


class InjectNaN(pl.Callback):
    """Before the sync of step 1 (this callback runs first), poison one element of a local shard on rank 0."""

    def on_train_batch_end(self, trainer: Trainer, pl_module: LM, *args: Any) -> None:
        if trainer.global_step == 1 and trainer.global_rank == 0:
            param = pl_module.model.model.layers[1].mlp.up_proj.weight
            local = param.to_local() if isinstance(param, DTensor) else param
            with torch.no_grad():
                local.view(-1)[0] = float("nan")


def fit_with_fault(fault: pl.Callback, steps: int) -> dict[str, Any]:
    """Fit with ``fault`` running before the sync of an in-memory target; the error and the versions received."""
    seed_everything(0)
    target = InMemoryTarget()
    result = fit_catching(trainer_for([fault, VLLMWeightSync(target)], steps=steps), LM())
    result["versions"] = target.versions
    return result


class Reorder(pl.Callback):
    """Rank 1 exports in another order than rank 0 (as if its model were built differently)."""

    def on_fit_start(self, trainer: Trainer, pl_module: LM) -> None:
        if trainer.global_rank == 1:
            original = trainer.strategy.export_source

            def reordered(**kwargs: Any) -> Any:
                source = original(**kwargs)
                shapes = source.shapes
                source.shapes = lambda: list(reversed(shapes()))  # what the ranks agree on before any gather
                return source

            trainer.strategy.export_source = reordered  # type: ignore[method-assign]


class SyncOnRankZeroOnly(pl.Callback):
    def __init__(self, sync: VLLMWeightSync) -> None:
        self.sync = sync
        self.result: dict[str, Any] = {}

    def on_train_end(self, trainer: Trainer, pl_module: LM) -> None:
        if trainer.global_rank != 0:
            return
        start = time.perf_counter()
        try:
            self.sync.sync(trainer)
            self.result = {"error": None}
        except Exception as err:  # noqa: BLE001
            self.result = {"error": f"{type(err).__name__}: {err}"}
        self.result["seconds_to_error"] = time.perf_counter() - start


def scenario_skipped() -> dict[str, Any]:
    seed_everything(0)
    sync = VLLMWeightSync(InMemoryTarget(), sync_on_train_start=False, every_n_epochs=100, timeout=5)
    probe = SyncOnRankZeroOnly(sync)
    fit_catching(trainer_for([sync, probe], steps=1), LM())
    return probe.result


def scenario_remote_down() -> dict[str, Any]:
    """A server that accepts connections and never answers: errors within the timeout, training goes on."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    url = f"http://127.0.0.1:{silent.getsockname()[1]}"
    seed_everything(0)
    baseline = LM()
    fit_catching(trainer_for([], steps=3), baseline)
    seed_everything(0)
    module = LM()
    target = RemoteVLLM(url, transport=Directory(Path(os.environ["FAULT_ROOT"]) / "remote"), timeout=2)
    sync = VLLMWeightSync(target, on_error="warn")
    result = fit_catching(trainer_for([sync], steps=3), module)
    silent.close()
    result.update(url=url, losses=[float(x) for x in module.losses],
                  baseline_losses=[float(x) for x in baseline.losses], stale=sync.stale, version=sync.version)
    return result


def scenario_resume_after_failure(root: Path) -> dict[str, Any]:
    seed_everything(0)
    target = FailingTarget(rank=0, version=3)  # fails at the last step: the checkpoint is taken while stale
    ckpt = ModelCheckpoint(dirpath=str(root / "ckpt"), save_last=True)
    first = fit_catching(trainer_for([VLLMWeightSync(target, on_error="warn"), ckpt], steps=2,
                                     enable_checkpointing=True), LM())
    meta = root / "ckpt" / "last.ckpt" / "meta.pt"  # a distributed checkpoint: a folder, metadata beside the shards
    state = torch.load(meta, weights_only=False)["callbacks"]
    sync_state = next(v for k, v in state.items() if k.startswith("VLLMWeightSync"))
    seed_everything(0)
    second = InMemoryTarget()
    resumed = fit_catching(trainer_for([VLLMWeightSync(second, sync_on_train_start=False)], steps=3), LM(),
                           ckpt_path=str(root / "ckpt" / "last.ckpt"))
    return {"first": first, "saved_state": sync_state, "resumed": resumed, "second_steps": second.steps,
            "second_versions": second.versions, "second_tensors": len(second.weights)}


def scenario_engine_mismatch(root: Path) -> dict[str, Any]:
    """The engine was built from another model (vocab 640, not 512): refused before any tensor is applied."""
    from vllm import SamplingParams

    other = root / "other_vocab"
    if dist.get_rank() == 0 and not (other / "config.json").exists():
        tiny_qwen2(seed=5, vocab_size=640).to(torch.bfloat16).save_pretrained(other)
    dist.barrier()
    seed_everything(0)
    target = ColocatedVLLM(model=other, dtype="bfloat16", max_model_len=128, enforce_eager=True)
    sync = VLLMWeightSync(target, on_error="warn")
    probe = [(7 * j) % VOCAB for j in range(24)]
    seen: dict[str, Any] = {}

    def logprobs() -> list[float]:
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        (out,) = target.llm.generate([{"prompt_token_ids": probe}], params, use_tqdm=False)
        return [d[t].logprob for d, t in zip(out.prompt_logprobs[1:], probe[1:])]

    class Watch(pl.Callback):
        def on_fit_start(self, trainer: Trainer, pl_module: LM) -> None:  # after the engine is built
            seen["before"] = logprobs()

        def on_train_end(self, trainer: Trainer, pl_module: LM) -> None:
            seen["after"] = logprobs()

    result = fit_catching(trainer_for([sync, Watch()], steps=1), LM())
    result.update(engine_untouched=seen.get("before") == seen.get("after"), stale=sync.stale)
    return result


def main() -> None:
    args, root = start_script("mid_push_raise,mid_push_warn,nan,order,remote_down,resume,engine,skipped",
                              "fault_work")
    os.environ["FAULT_ROOT"] = str(root)
    runs = {"mid_push_raise": lambda: scenario_mid_push("raise"), "mid_push_warn": lambda: scenario_mid_push("warn"),
            "nan": lambda: fit_with_fault(InjectNaN(), steps=2),
            "order": lambda: fit_with_fault(Reorder(), steps=1), "remote_down": scenario_remote_down,
            "resume": lambda: scenario_resume_after_failure(root), "engine": lambda: scenario_engine_mismatch(root),
            "skipped": scenario_skipped}
    results = run_scenarios(runs, args.only.split(","))
    out = args.out if dist.get_rank() == 0 else f"{args.out}.rank{dist.get_rank()}"
    Path(out).write_text(json.dumps(results, indent=1, default=str))
    end_script()


if __name__ == "__main__":
    main()
