"""Side-by-side export benchmark on 2 CPU ranks: ``lazy`` (ours) against Lightning's full state dict.

    python benchmarks/export_bench.py                 # ~200M-parameter Qwen2 shape, bf16
    python benchmarks/export_bench.py --layers 2 --hidden 256 --vocab 512   # tiny, seconds

Re-launches itself under ``torch.distributed.run`` with 2 processes when not started by torchrun.
Methods alternate, several repeats; rank 0 prints wall seconds (median, min, max) and its peak extra
RSS (``VmHWM`` reset through ``/proc/self/clear_refs`` before each method), with ratios against lazy.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from transformers import Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from lightning_fsdp_export.export import lazy_export  # noqa: E402


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def measure(run: Callable[[], int]) -> tuple[float, int, int]:
    """Run once; return (seconds, peak extra RSS bytes on this rank, bytes exported)."""
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    before = _status_kib("VmRSS")
    start = time.perf_counter()
    nbytes = run()
    seconds = time.perf_counter() - start
    peak = _status_kib("VmHWM")
    dist.barrier()
    return seconds, (peak - before) * 1024, nbytes


def drain(pairs: Iterable[tuple[str, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for _, t in pairs)


def build(args: argparse.Namespace) -> torch.nn.Module:
    cfg = Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                      num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                      num_key_value_heads=max(1, args.hidden // 256), tie_word_embeddings=True)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(cfg)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    model.to(torch.bfloat16)
    mesh = dist.device_mesh.init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None, help="write the results to this path (rank 0)")
    args = parser.parse_args()
    if "LOCAL_RANK" not in os.environ:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", __file__, *sys.argv[1:]]
        raise SystemExit(subprocess.call(cmd))
    dist.init_process_group("gloo")
    model = build(args)
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    methods: dict[str, Callable[[], int]] = {
        "lazy": lambda: drain(lazy_export(model)),
        "full_state_dict": lambda: drain(get_model_state_dict(model, options=full).items()),
    }
    samples: dict[str, list[tuple[float, int, int]]] = {m: [] for m in methods}
    for _ in range(args.repeats):
        for name, run in methods.items():
            samples[name].append(measure(run))
    if dist.get_rank() == 0:
        report(model, samples, args)
    dist.destroy_process_group()


def report(model: torch.nn.Module, samples: dict[str, list[tuple[float, int, int]]], args: argparse.Namespace) -> None:
    params = sum(p.numel() for p in model.parameters())
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    print(f"\nmodel: {params / 1e6:.1f}M params, largest tensor {largest / 2**20:.1f} MiB, world size 2, "
          f"{args.repeats} repeats (rank 0; full_state_dict holds tensors on rank 0 only)")
    print(f"{'method':<16} {'median s':>9} {'min s':>7} {'max s':>7} {'peak extra MiB':>15} {'x lazy time':>12} {'x lazy mem':>11}")
    base_t = statistics.median(s[0] for s in samples["lazy"])
    base_m = max(max(s[1] for s in samples["lazy"]), 1)
    out = {"world_size": 2, "model": {"params": params, "largest_tensor_bytes": largest}, "methods": {}}
    for name, runs in samples.items():
        secs = [r[0] for r in runs]
        peak = max(r[1] for r in runs)
        med = statistics.median(secs)
        print(f"{name:<16} {med:>9.3f} {min(secs):>7.3f} {max(secs):>7.3f} {peak / 2**20:>15.1f}"
              f" {med / base_t:>12.2f} {peak / base_m:>11.2f}")
        out["methods"][name] = {"seconds_median": med, "peak_extra_bytes": peak, "module_moves": 0,
                                "bytes": runs[0][2]}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
