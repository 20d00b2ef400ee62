"""A trainer rank whose process dies during a sync, on 2 real gloo ranks started here (not by torchrun, whose agent
would end the survivor at once): the survivor's sync must end in a ``WeightSyncError`` that names the rank gone,
within seconds, not gloo's bare "Connection closed by peer" or a hang.

    python tests/scripts/rank_gone.py --out results.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def run(rank: int, port: int, out: str) -> None:
    from lightning_fsdp_export._common import SyncGroup
    from lightning_fsdp_export.sync.agreement import FAILED, agree_after

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    group = SyncGroup(timedelta(seconds=20))
    group.arrive("start")
    if rank == 1:
        os._exit(1)  # as a rank killed while its push was under way
    time.sleep(0.5)
    start = time.perf_counter()
    result: dict[str, object] = {}
    try:  # rank 0's push failed when its peer vanished; now the ranks must agree on the outcome
        agree_after(group, 4, "RuntimeError: Connection closed by peer [127.0.0.1]:1234", FAILED)
        result["error"] = None
    except Exception as err:  # noqa: BLE001 - recorded for the test
        result["error"] = f"{type(err).__name__}: {err}"
        result["traceback"] = traceback.format_exc()[-2000:]
    result["seconds"] = time.perf_counter() - start
    Path(out).write_text(json.dumps(result))
    os._exit(0)  # the default group's peer is gone: no clean teardown


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    from tests.conftest import free_port

    context = mp.get_context("spawn")
    port = free_port()
    procs = [context.Process(target=run, args=(rank, port, args.out)) for rank in (0, 1)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(120)
        if proc.is_alive():
            proc.kill()


if __name__ == "__main__":
    main()
