"""Staged vs lazy export with ``offload="params"`` on one CUDA GPU (falls back to CPU to stay testable).

Builds a random Qwen2-shaped model on the meta device (~1B parameters by default, bf16), materialises
it, shards it with ``fully_shard`` on a 1-rank mesh and offloads the shards to pinned host memory, as
``LazyExportFSDP2(offload="params")`` does between steps. Then, alternating, several repeats:

- ``staged``: the pre-verl-#7005 path: whole module to the GPU, export, whole module back to the host;
- ``lazy``: ours: each tensor staged and gathered alone while the module stays on the host.

Each exported tensor is copied into a preallocated device buffer (what an engine's load does).
Prints a short table last. Run by ``benchmarks/gpu_check.sh``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from transformers import Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from lightning_fsdp_export.export import lazy_export  # noqa: E402
from lightning_fsdp_export.offload import move_module  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def export_into(model: torch.nn.Module, sinks: dict[str, torch.Tensor], device: torch.device) -> float:
    """Drain the lazy export into ``sinks``; return the seconds to the first tensor."""
    start = time.perf_counter()
    first = None
    for name, tensor in lazy_export(model, device=device):
        sinks[name].copy_(tensor, non_blocking=True)
        if first is None:
            sync(device)
            first = time.perf_counter() - start
    sync(device)
    return first or 0.0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    cfg = Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                      num_hidden_layers=args.layers, num_attention_heads=args.hidden // 128,
                      num_key_value_heads=max(1, args.hidden // 512), tie_word_embeddings=False)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    model.to_empty(device=device)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    mesh = dist.device_mesh.init_device_mesh(device.type, (1,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sinks = {name: torch.empty_like(t.full_tensor(), device=device) for name, t in model.state_dict().items()}
    nbytes = sum(t.numel() * t.element_size() for t in sinks.values())
    host = torch.device("cpu")
    move_module(model, host, pin_memory=True)

    def staged() -> float:
        move_module(model, device)
        first = export_into(model, sinks, device)
        move_module(model, host, pin_memory=True)
        sync(device)
        return first

    def lazy() -> float:
        return export_into(model, sinks, device)

    times: dict[str, list[float]] = {"staged": [], "lazy": []}
    firsts: dict[str, list[float]] = {"staged": [], "lazy": []}
    peaks: dict[str, int] = {}
    for _ in range(args.repeats):
        for name, run in (("staged", staged), ("lazy", lazy)):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            start = time.perf_counter()
            firsts[name].append(run())
            times[name].append(time.perf_counter() - start)
            peaks[name] = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    params = sum(p.numel() for p in model.parameters())
    print(f"\ndevice {device}, {params / 1e9:.2f}B params, {nbytes / 2**30:.2f} GiB bf16, {args.repeats} repeats")
    print(f"{'method':<8} {'median s':>9} {'first tensor ms':>16} {'peak GPU GiB':>13} {'x lazy':>7}")
    base = statistics.median(times["lazy"])
    for name in times:
        med = statistics.median(times[name])
        print(f"{name:<8} {med:>9.3f} {1e3 * statistics.median(firsts[name]):>16.1f}"
              f" {peaks[name] / 2**30:>13.2f} {med / base:>7.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
