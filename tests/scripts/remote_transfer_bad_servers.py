"""Run under ``torchrun --nproc-per-node 2``: a fit against a server that cannot take the pushes, one per scenario.

``--server kind=URL,...``: ``no_dev_mode`` (started without ``VLLM_SERVER_DEV_MODE=1``), ``no_backend`` (dev mode,
no ``--weight-transfer-config``), ``other_vocab_directory`` (a model of another vocabulary, its checkpoint not
readable here, so only the server's loader can refuse); a kind ending in ``_directory`` uses the directory transport
instead, one ending in ``_plain`` gloo without shard-direct (rank 0 alone talks to the servers and sends). Each rank
fits one step with ``RemoteVLLM(url, transport=Gloo(shard_direct=True), timeout=60)`` (or
``RemoteVLLM(url, transport=Directory(...))``) and records the error and the seconds from the fit's start to it; each
rank
writes its own JSON (``--out`` and ``--out.rank1``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist
from lightning.pytorch import Trainer, seed_everything

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from lightning_fsdp_export import LazyExportFSDP2, RemoteVLLM, VLLMWeightSync
from lightning_fsdp_export.targets import Directory, Gloo
from tests.scripts.common import CausalLM, end_script, run_scenarios, start_script, token_loader


def scenario(url: str, directory: Path | None = None, plain: bool = False) -> dict[str, Any]:
    seed_everything(0)
    target = (RemoteVLLM(url, transport=Directory(directory), timeout=60) if directory is not None else
              RemoteVLLM(url, transport=Gloo(shard_direct=not plain), timeout=60))
    sync = VLLMWeightSync(target)
    trainer = Trainer(accelerator="cpu", devices=2, strategy=LazyExportFSDP2(), max_steps=1, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[sync])
    start = time.monotonic()
    try:
        trainer.fit(CausalLM(), token_loader(n=2))
        error = None
    except Exception as err:  # noqa: BLE001 - recorded for the test
        error = f"{type(err).__name__}: {err}"
    return {"error": error, "seconds": time.monotonic() - start}


def main() -> None:
    args, root = start_script("", "bad_servers")
    servers = dict(item.split("=", 1) for item in args.server.split(","))
    runs = {kind: (lambda url=url, kind=kind: scenario(url, root / kind if kind.endswith("_directory") else None,
                                                        plain=kind.endswith("_plain")))
            for kind, url in servers.items()}
    results = run_scenarios(runs, list(servers))
    out = args.out if dist.get_rank() == 0 else f"{args.out}.rank{dist.get_rank()}"
    Path(out).write_text(json.dumps(results, indent=1, default=str))
    end_script()


if __name__ == "__main__":
    main()
