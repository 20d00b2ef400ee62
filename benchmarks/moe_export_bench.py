"""What the checkpoint-format mapping costs: a Qwen3-MoE export with and without splitting the experts.

    python benchmarks/moe_export_bench.py [--experts 64] [--hidden 1024] [--layers 4] [--repeats 3]

Builds a Qwen3-MoE (bf16, random weights) sharded with ``fully_shard`` per decoder layer on 2 gloo ranks
(re-launched under torchrun), then alternates, after a warm-up round:

- ``memory_layout``: the lazy export of transformers' in-memory tensors, fused experts left fused (what
  the sync sent before the mapping; vLLM could not load it);
- ``checkpoint``: the same export in checkpoint format (``CheckpointFormat``, the default): fused experts
  split per expert, a block of whole experts (<= 32M elements) at a time;
- ``checkpoint_whole``: the mapping with one block per tensor (the whole fused tensor split at once),
  to show what the blocks save;
- ``checkpoint_shards``: the shard-direct pass (``export_source(layout="shards")``'s): every rank yields
  its own rows, and its own experts' checkpoint pieces, with no gather (what one rank holds, not the whole).

Prints median seconds and rank 0's peak extra RSS per method, and their ratios to ``memory_layout``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks.export_bench import drain, measure, start_two_ranks
from lightning_fsdp_export.export.checkpoint_format import CheckpointFormat
from lightning_fsdp_export.export.lazy import lazy_export, plan_export
from lightning_fsdp_export.export.shards import row_bounds, shard_export


def qwen3_moe(experts: int, hidden: int, layers: int) -> torch.nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=8192, hidden_size=hidden, intermediate_size=hidden * 2,
                         moe_intermediate_size=hidden // 2, num_experts=experts, num_experts_per_tok=2,
                         num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=2,
                         head_dim=64, max_position_embeddings=256)
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(cfg)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    model = model.to(torch.bfloat16)
    mesh = dist.device_mesh.init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in [m for m in model.modules() if type(m).__name__ == "Qwen3MoeDecoderLayer"]:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    start_two_ranks(__file__)
    model = qwen3_moe(args.experts, args.hidden, args.layers)
    params = sum(p.numel() for p in model.parameters())
    fused = max(p.numel() for n, p in model.named_parameters() if "experts" in n)
    device = torch.device("cpu")
    fmt = CheckpointFormat.of(model)
    methods = {
        "memory_layout": lambda: drain(lazy_export(model, device=device, checkpoint_format=CheckpointFormat(None))),
        "checkpoint": lambda: drain(lazy_export(model, device=device)),
        "checkpoint_whole": lambda: drain(lazy_export(model, device=device, checkpoint_format=CheckpointFormat(
            model, block_elements=fused))),
        "checkpoint_shards": lambda: drain(shard_export(
            plan_export(model), fmt=fmt, dtype=None, device=None, gather_device=device,
            layout=lambda names, tensor: row_bounds(names, tensor, fmt, dist.get_world_size()))),
    }
    samples: dict[str, list] = {name: [] for name in methods}
    for round_ in range(args.repeats + 1):
        for name, run in methods.items():
            sample = measure(run)
            if round_:
                samples[name].append(sample)
    if dist.get_rank() == 0:
        print(f"Qwen3-MoE {args.experts} experts, hidden {args.hidden}, {args.layers} layers:"
              f" {params / 1e6:.1f}M params bf16,"
              f" largest fused expert tensor {fused * 2 / 2**20:.1f} MiB, 2 ranks, {args.repeats} repeats, rank 0")
        base_t = statistics.median(s[0] for s in samples["memory_layout"])
        base_m = statistics.median(s[1] for s in samples["memory_layout"])
        print(f"{'method':<18}{'median s':>10}{'peak extra MiB':>16}{'tensors':>9}{'x time':>8}{'x mem':>7}")
        for name, rows in samples.items():
            t = statistics.median(s[0] for s in rows)
            m = statistics.median(s[1] for s in rows)
            print(f"{name:<18}{t:>10.3f}{m / 2**20:>16.1f}{rows[0][3]:>9}{t / base_t:>8.2f}{m / base_m:>7.2f}")
    methods.clear()  # the lambdas held the model: free it before the barrier
    dist.barrier()
    dist.destroy_process_group()
    # Seen here after the large async gathers: gloo's threads abort the interpreter's teardown
    # ("terminate called without an active exception"); everything is printed, so leave at once.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
