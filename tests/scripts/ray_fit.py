"""A Lightning fit inside Ray Train syncing into vLLM servers that Ray places and restarts (issue 56).

Run on a node of a running Ray cluster (``tests/test_ray.py``: host ``a`` the head, with the ``trainer`` resource;
host ``b`` a worker node, with the ``server`` resource), as a user's driver would:

    python tests/scripts/ray_fit.py --model-dir DIR --out OUT.json

What it does: :class:`~lightning_fsdp_export.ray.VLLMServers` starts one server on a ``server`` node; Ray Train's
``TorchTrainer`` runs 2 workers on ``trainer`` nodes, each a Lightning ``Trainer`` with ``RayLazyExportFSDP2`` and
``RayLightningEnvironment``, ``RayTrainReportCallback`` reporting a checkpoint each epoch (3 steps), and
``VLLMWeightSync(RemoteVLLM(servers.urls, min_servers=1))`` syncing every step. Rank 0 of the first attempt, at the
end of: step 1, scales the servers to 2 and waits for the second to answer (it joins at the next sync); step 3, kills
the first server's actor (Ray restarts it; its server comes back at its URL); step 4, waits for it to answer (it
rejoins at the next sync with every tensor); step 7, rank 1 exits (Ray Train restarts both workers from the checkpoint
of step 6, ``FailureConfig(max_failures=1)``). Each step, rank 0 appends what the pool and the servers say to a
JSON-lines file; the driver writes the result and every server's state at the end to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import ray

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

STEPS_PER_EPOCH, EPOCHS = 3, 4


def train_func(config: dict[str, Any]) -> None:
    import lightning.pytorch as pl
    import ray.train
    from lightning.pytorch import Trainer, seed_everything
    from ray.train.lightning import RayLightningEnvironment, RayTrainReportCallback
    from transformers import AutoConfig, AutoModelForCausalLM

    from lightning_fsdp_export import RemoteVLLM, VLLMWeightSync
    from lightning_fsdp_export.ray import RayLazyExportFSDP2, VLLMServers
    from lightning_fsdp_export.targets import Gloo
    from lightning_fsdp_export.transfer.http import Server
    from tests.scripts.common import CausalLM, token_loader

    servers: VLLMServers = config["servers"]
    work, model_dir = Path(config["work"]), Path(config["model_dir"])
    rank = ray.train.get_context().get_world_rank()
    first_attempt = not (work / "attempt1").exists()
    seed_everything(0)
    target = RemoteVLLM(servers.urls, transport=Gloo(), timeout=60, min_servers=1)
    sync = VLLMWeightSync(target, verify="logprobs", verify_tolerance=0.1)

    class Events(pl.Callback):
        def __init__(self) -> None:
            self.killed_at: float | None = None

        def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
            step = trainer.global_step
            if rank == 1 and first_attempt and step == 7:
                (work / "attempt1").write_text("rank 1 exits at step 7")
                os._exit(1)  # a trainer worker dies: Ray Train restarts the group from the last checkpoint
            if rank != 0:
                return
            record = {"step": step, "attempt": 1 if first_attempt else 2, "version": sync.version,
                      "verify_diff": sync.last_verify_diff, "stale": sync.stale,
                      "updated": [s.url for s in target.servers], "out": list(target.servers_out),
                      "servers_out_metric": sync.last_metrics.get("weight_sync/servers_out"),
                      "holds": {url: held(url) for url in servers.urls()}}
            if first_attempt and step == 5 and self.killed_at is not None:  # the restarted server just rejoined
                record["death_to_every_tensor_s"] = time.monotonic() - self.killed_at
                sums = target.weight_checksums()  # vLLM's checker on each server: the same tensors, bit for bit
                record["servers_equal"] = len(sums) == 2 and len({json.dumps(v, sort_keys=True)
                                                                  for v in sums.values()}) == 1
            with (work / "steps.jsonl").open("a") as out:
                out.write(json.dumps(record) + "\n")
            if not first_attempt:
                return
            if step == 1:  # a second server, placed by Ray on a node with the "server" resource
                servers.scale(2)
                servers.wait(2, timeout=300)
            elif step == 3:  # the first server's actor dies (as a node's OOM killer would end it); Ray restarts it
                self.killed_at = time.monotonic()
                ray.kill(servers.actors()[0], no_restart=False)
            elif step == 4:
                servers.wait(2, timeout=300)

    def held(url: str) -> str | None:
        try:
            return Server(url, api_key=None, timeout=5).request("GET", "/weight_info")["weight_version"]
        except Exception:  # noqa: BLE001 - down (restarting)
            return None

    hf_config = AutoConfig.from_pretrained(model_dir)
    trainer = Trainer(accelerator="cpu", devices="auto", max_epochs=EPOCHS, limit_train_batches=STEPS_PER_EPOCH,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, strategy=RayLazyExportFSDP2(pretrained=model_dir),
                      plugins=[RayLightningEnvironment()], callbacks=[sync, Events(), RayTrainReportCallback()])
    with trainer.init_module(empty_init=True):
        module = CausalLM(lambda: AutoModelForCausalLM.from_config(hf_config), lr=1e-3)
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        trainer.fit(module, token_loader(n=4 * STEPS_PER_EPOCH))  # (2 ranks, batches of 2)
    else:
        with checkpoint.as_directory() as path:
            trainer.fit(module, token_loader(n=4 * STEPS_PER_EPOCH),
                        ckpt_path=os.path.join(path, RayTrainReportCallback.CHECKPOINT_NAME))
    if rank == 0:
        (work / "final_version").write_text(str(sync.version))


def main() -> None:
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from lightning_fsdp_export.ray import VLLMServers
    from lightning_fsdp_export.transfer.http import Server

    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    work = Path(args.out).parent / "ray_fit"
    work.mkdir(parents=True, exist_ok=True)
    ray.init(address="auto", runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    server_env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    servers = VLLMServers(args.model_dir, 1, env=server_env, log_dir=work,
                          args=["--dtype", "bfloat16", "--max-model-len", "256", "--enforce-eager", "--max-logprobs",
                                "1"], actor_options={"num_cpus": 0, "resources": {"server": 1}})
    start = time.monotonic()
    servers.wait(1, timeout=300)
    first_up = time.monotonic() - start
    trainer = TorchTrainer(train_func, train_loop_config={"servers": servers, "work": str(work),
                                                          "model_dir": args.model_dir},
                           torch_config=TorchConfig(backend="gloo"),
                           scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1, "trainer": 1}),
                           run_config=RunConfig(storage_path=str(work / "results"), name="ray_fit",
                                                failure_config=FailureConfig(max_failures=1)))
    result = trainer.fit()
    urls = servers.urls()
    states = []
    for url in urls:
        server = Server(url, api_key=None, timeout=10)
        states.append({"url": url, "version": server.request("GET", "/weight_info")["weight_version"],
                       "paused": server.request("GET", "/is_paused")["is_paused"]})
    steps = [json.loads(line) for line in (work / "steps.jsonl").read_text().splitlines()]
    Path(args.out).write_text(json.dumps({
        "error": repr(result.error) if result.error else None, "first_server_up_s": first_up, "steps": steps,
        "servers": states, "server_hosts": sorted({u.split("//")[1].split(":")[0] for u in urls}), "final_version": int(
            (work / "final_version").read_text()), "checkpoint": str(result.checkpoint)}, indent=1))
    servers.shutdown()


if __name__ == "__main__":
    main()
