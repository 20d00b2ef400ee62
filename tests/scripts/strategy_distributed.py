"""Run under ``torchrun --nproc-per-node 2``: every LazyExportFSDP2 check that needs real ranks.

Rank 0 writes ``{scenario: result}`` as JSON to ``--out``; ``tests/test_strategy_distributed.py``
asserts on it. Each scenario is one ``Trainer.fit`` on 2 gloo ranks with a tiny real HF model.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch import Trainer, seed_everything
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from lightning_fsdp_export import LazyExportFSDP2
from lightning_fsdp_export.testing import tiny_llama, tiny_qwen2
from tests.scripts.common import CausalLM, OddNet, end_script, name_diff, run_scenarios, token_loader


def batches() -> torch.utils.data.DataLoader:
    return token_loader(n=8)


class LM(CausalLM):
    """A causal LM; optionally applies activation checkpointing or its own sharding in configure_model."""

    def __init__(self, build: Any = tiny_qwen2, *, checkpointing: bool = False, own_sharding: str | None = None,
                 export_each_step: bool = False) -> None:
        super().__init__(build, export_each_step=export_each_step)
        self.checkpointing = checkpointing
        self.own_sharding = own_sharding

    def configure_model(self) -> None:
        if self.checkpointing:
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

            apply_activation_checkpointing(self.model, check_fn=lambda m: type(m).__name__.endswith("DecoderLayer"))
        if self.own_sharding == "layers_only":  # leaves root params (embeddings, norm, extra) plain
            for layer in self.model.model.layers:
                fully_shard(layer, mesh=self.device_mesh["data_parallel"])
        elif self.own_sharding == "fsdp1":
            from torch.distributed.fsdp import FullyShardedDataParallel

            self.model.model.layers[0] = FullyShardedDataParallel(self.model.model.layers[0],
                                                                  device_id=torch.device("cpu"))


class WithExtras(LM):
    """A model with a plain (never sharded) parameter and a persistent buffer beside the HF model."""

    def __init__(self) -> None:
        super().__init__(own_sharding="layers_only")
        torch.manual_seed(1)
        self.model.register_parameter("extra_scale", nn.Parameter(torch.randn(4)))
        self.model.register_buffer("extra_buffer", torch.arange(3.0), persistent=True)


def fit(module: LM, strategy: LazyExportFSDP2, steps: int, capture_start: bool = True) -> dict[str, Any]:
    """Fit for ``steps``; export right after sharding (on_train_start) and at the end."""
    out: dict[str, Any] = {}

    class Capture(pl.Callback):
        def on_train_start(self, trainer: Trainer, pl_module: LM) -> None:
            if capture_start:
                out["start"] = list(trainer.strategy.export_weights())

    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[Capture()])
    trainer.fit(module, batches())
    out["end"] = list(strategy.export_weights())
    out["report"] = strategy.last_export
    out["full_state"] = get_model_state_dict(strategy.export_module, options=StateDictOptions(full_state_dict=True))
    return out


def same(exported: list[tuple[str, torch.Tensor]], reference: dict[str, torch.Tensor]) -> dict[str, Any]:
    names = [n for n, _ in exported]
    mismatched = [n for n, t in exported if n not in reference or not torch.equal(t, reference[n])]
    # Same names; order is the state dict's except that a tied tensor's names come together.
    return {"names_diff": name_diff(names, reference),
            "names": names, "ref_names": list(reference),
            "mismatched": mismatched, "all_dtypes": sorted({str(t.dtype) for _, t in exported})}


def scenario_right_after_sharding(build: Any, **strategy_kwargs: Any) -> dict[str, Any]:
    seed_everything(0)
    got = fit(LM(build), LazyExportFSDP2(**strategy_kwargs), steps=1)
    return same(got["start"], build().state_dict())


def scenario_checkpointing() -> dict[str, Any]:
    seed_everything(0)
    got = fit(LM(tiny_qwen2, checkpointing=True), LazyExportFSDP2(), steps=1)
    return same(got["start"], tiny_qwen2().state_dict())


def scenario_extras() -> dict[str, Any]:
    seed_everything(0)
    module = WithExtras()
    got = fit(module, LazyExportFSDP2(export_module="model"), steps=2)
    ref = WithExtras().model.state_dict()
    result = same(got["start"], ref)
    result["extra_is_dtensor"] = type(module.model.extra_scale).__name__ == "DTensor"
    result["after_steps"] = same(got["end"], got["full_state"])
    return result


def scenario_training(offload: str | None, export_each_step: bool) -> dict[str, Any]:
    seed_everything(0)
    module = LM(tiny_qwen2, export_each_step=export_each_step)
    strategy = LazyExportFSDP2(offload=offload, offload_optimizer=offload == "params")
    got = fit(module, strategy, steps=4, capture_start=False)
    report = got["report"]
    return {"losses": module.losses, "after_steps": same(got["end"], got["full_state"]),
            "exports_per_step": len(module.exports), "module_moves": report.module_moves, "path": report.path,
            "tensors": report.tensors, "bytes": report.bytes, "offload_moves": strategy.offload_moves,
            "exports_changed": len(module.exports) > 1 and not all(
                torch.equal(module.exports[0][k], module.exports[-1][k]) for k in module.exports[0])}


def scenario_pool(pool: bool) -> dict[str, Any]:
    """offload='params' with uneven shards (513 MLP rows over 2 ranks), with and without the host pool.

    CPU torch cannot pin, so the pool runs with pin=False: every offload really copies into its buffer
    and swaps the shard's storage (through the FSDP2 internals in _compat), every load copies back.
    """
    from lightning_fsdp_export._compat import fsdp_params, sharded_storage
    from lightning_fsdp_export.phases.offload import HostPool

    seed_everything(0)
    build = lambda: tiny_qwen2(intermediate_size=513)  # noqa: E731
    module = LM(build, export_each_step=True)
    strategy = LazyExportFSDP2(offload="params", offload_optimizer=True)
    if pool:
        strategy._phases.pool = HostPool(pin=False)
    got = fit(module, strategy, steps=4, capture_start=False)
    out: dict[str, Any] = {"losses": module.losses, "after_steps": same(got["end"], got["full_state"]),
                           "offload_moves": strategy.offload_moves}
    if pool:
        params = fsdp_params(strategy.model)
        out["allocations"] = strategy._phases.pool.allocations
        out["fsdp_params"] = len(params)
        out["storage_is_pool_buffer"] = all(
            sharded_storage(p).data_ptr() == strategy._phases.pool._buffer_ptr(p) for p in params)
        out["uneven"] = any(p.sharded_param.shape[0] % 2 for p in params)  # 513 rows over 2 ranks
    return out


def scenario_error(make: Any) -> dict[str, Any]:
    seed_everything(0)
    try:
        module, strategy = make()
        fit(module, strategy, steps=1, capture_start=False)
    except Exception as err:  # noqa: BLE001 - recorded for the test to check
        return {"error": type(err).__name__, "message": str(err)}
    return {"error": None}


class OddLM(LM):
    def __init__(self) -> None:
        super().__init__()
        self.net = OddNet()

    # The net is only exported, never run: FSDP2 refuses mixed dtypes in one group at forward time.


def scenario_odd_shapes() -> dict[str, Any]:
    from lightning_fsdp_export import lazy_export

    seed_everything(0)
    module = OddLM()
    out: dict[str, Any] = {}

    class Capture(pl.Callback):
        def on_train_start(self, trainer: Trainer, pl_module: OddLM) -> None:
            bucketed = list(lazy_export(pl_module.net, bucket_bytes=1 << 20))
            single = list(lazy_export(pl_module.net, bucket_bytes=0))
            out["result"] = same(bucketed, OddNet().state_dict())
            out["unbucketed_differ"] = ([n for (n, a), (_, b) in zip(bucketed, single) if not torch.equal(a, b)]
                                        if len(bucketed) == len(single) else [f"{len(bucketed)} vs {len(single)}"])
            out["dtypes"] = [str(t.dtype) for _, t in bucketed]

    trainer = Trainer(accelerator="cpu", devices=2, strategy=LazyExportFSDP2(export_module="net"), max_steps=1,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[Capture()])
    trainer.fit(module, batches())
    return {**out["result"], "unbucketed_differ": out["unbucketed_differ"], "dtypes": out["dtypes"]}


class AsksForAdapters(LM):
    def on_train_start(self) -> None:
        list(self.trainer.strategy.export_weights(lora="adapter"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    scenarios = {
        "qwen2_tied": lambda: scenario_right_after_sharding(tiny_qwen2),
        "llama_untied": lambda: scenario_right_after_sharding(tiny_llama),
        "mixed_precision": lambda: scenario_right_after_sharding(
            tiny_qwen2, mixed_precision=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)),
        "policy_offload": lambda: scenario_right_after_sharding(tiny_qwen2, offload="policy"),
        "checkpointing": scenario_checkpointing,
        "extras": scenario_extras,
        "train_plain": lambda: scenario_training(None, False),
        "train_exporting": lambda: scenario_training(None, True),
        "train_offload_params": lambda: scenario_training("params", True),
        "train_offload_policy": lambda: scenario_training("policy", False),
        "odd_shapes": scenario_odd_shapes,
        "pool_off": lambda: scenario_pool(False),
        "pool_on": lambda: scenario_pool(True),
        "err_fsdp1": lambda: scenario_error(lambda: (LM(own_sharding="fsdp1"), LazyExportFSDP2())),
        "err_export_module": lambda: scenario_error(lambda: (LM(), LazyExportFSDP2(export_module="policy"))),
        "err_lora_mode": lambda: scenario_error(lambda: (AsksForAdapters(), LazyExportFSDP2())),
    }
    only = os.environ.get("ONLY")
    results = run_scenarios(scenarios, only.split(",") if only else list(scenarios))
    if int(os.environ.get("RANK", "0")) == 0:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1, default=str)
    end_script()


if __name__ == "__main__":
    main()
