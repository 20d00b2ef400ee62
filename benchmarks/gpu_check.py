"""Staged vs lazy export with offloaded shards on one CUDA GPU (falls back to CPU to stay testable).

    python benchmarks/gpu_check.py                      # Qwen2.5-7B shape, bf16 (run by gpu_check.sh)
    python benchmarks/gpu_check.py --preset tiny        # seconds, on any machine
    python benchmarks/gpu_check.py --fp32-master --preset 1b   # fp32 shards exported as bf16

Builds the model on the meta device, materialises it on the GPU with random weights, shards it with
``fully_shard`` on a 1-rank mesh and offloads the shards to pinned host memory, as
``LazyExportFSDP2(offload="params")`` does between steps. Each export feeds a sink that copies every
tensor into preallocated GPU buffers (what an engine's weight load does). Alternating, a few repeats:

- ``staged``: the pre-verl-#7005 path: whole module to the GPU, export, whole module back to the host;
- ``lazy``: ours: each tensor staged and gathered alone while the module stays on the host;
- ``lazy_b64``: the same with consecutive shards gathered together, 64 MiB per all-gather;
- ``floor``: one pinned host-to-device copy of the same bytes (the physical floor of an offloaded sync).

Prints a short table last, with the goals: lazy >= 2x faster than staged, lazy <= 1.25x the floor,
first tensor <= 10 ms.

With ``--fp32-master`` the shards are fp32 (RL's masters) and every method exports bf16:
``cast_after`` (gather fp32, then cast: the lazy loop before cast-before), ``lazy`` (cast before the
gather, no prefetch), ``prefetch`` (one all-gather in flight, the default), ``grouped_prefetch``
(64 MiB buckets, one in flight), and the floor for the bf16 bytes.
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
from lightning_fsdp_export.export.lazy import lazy_export
from lightning_fsdp_export.phases.offload import move_module

PRESETS = {  # hidden, intermediate, layers, heads, kv heads, vocab, tied
    "qwen2.5-7b": (3584, 18944, 28, 28, 4, 152064, False),
    "1b": (2048, 5632, 16, 16, 4, 32000, False),
    "tiny": (256, 704, 2, 4, 1, 512, False),
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def export_into(model: torch.nn.Module, sinks: dict[str, torch.Tensor], device: torch.device,
                bucket_bytes: int = 0, prefetch: int = 0, dtype: torch.dtype | None = None) -> float:
    """Drain the lazy export into ``sinks``; return the seconds to the first tensor."""
    start = time.perf_counter()
    first = None
    for name, tensor in lazy_export(model, device=device, bucket_bytes=bucket_bytes, prefetch=prefetch, dtype=dtype):
        sinks[name].copy_(tensor, non_blocking=True)
        if first is None:
            sync(device)
            first = time.perf_counter() - start
    sync(device)
    return first or 0.0


def cast_after_into(model: torch.nn.Module, sinks: dict[str, torch.Tensor], device: torch.device) -> float:
    """The export before cast-before: each fp32 shard gathered whole, then cast to bf16."""
    start = time.perf_counter()
    first = None
    for name, tensor in model.state_dict().items():
        full = tensor.to(device).full_tensor() if hasattr(tensor, "full_tensor") else tensor.to(device)
        sinks[name].copy_(full.to(torch.bfloat16), non_blocking=True)
        if first is None:
            sync(device)
            first = time.perf_counter() - start
    sync(device)
    return first or 0.0


def build(preset: str, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    hidden, inter, layers, heads, kv, vocab, tied = PRESETS[preset]
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, tie_word_embeddings=tied)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(cfg).to(dtype)
    model.to_empty(device=device)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    mesh = dist.device_mesh.init_device_mesh(device.type, (1,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def floor_copy(nbytes: int, device: torch.device) -> float:
    """Seconds for one pinned host-to-device copy of ``nbytes`` (CPU: a plain copy)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dest = torch.empty(nbytes, dtype=torch.uint8, device=device)
    sync(device)
    start = time.perf_counter()
    dest.copy_(host, non_blocking=True)
    sync(device)
    seconds = time.perf_counter() - start
    del host, dest
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", choices=sorted(PRESETS), default="qwen2.5-7b")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--fp32-master", action="store_true", help="fp32 shards exported as bf16")
    args = parser.parse_args()
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    t0 = time.perf_counter()
    model = build(args.preset, device, torch.float32 if args.fp32_master else torch.bfloat16)
    sinks = {name: torch.empty(t.shape, dtype=torch.bfloat16, device=device) for name, t in model.state_dict().items()}
    nbytes = sum(t.numel() * t.element_size() for t in sinks.values())
    host = torch.device("cpu")
    move_module(model, host, pin_memory=True)
    print(f"built and offloaded in {time.perf_counter() - t0:.1f} s", flush=True)

    def staged() -> float:
        move_module(model, device)
        first = export_into(model, sinks, device)
        move_module(model, host, pin_memory=True)
        sync(device)
        return first

    methods = {"staged": staged, "lazy": lambda: export_into(model, sinks, device),
               "lazy_b64": lambda: export_into(model, sinks, device, bucket_bytes=64 * 2**20), "floor": lambda: 0.0}
    if args.fp32_master:
        bf16 = torch.bfloat16
        methods = {"cast_after": lambda: cast_after_into(model, sinks, device),
                   "lazy": lambda: export_into(model, sinks, device, dtype=bf16),
                   "prefetch": lambda: export_into(model, sinks, device, dtype=bf16, prefetch=1),
                   "grouped_prefetch": lambda: export_into(model, sinks, device, dtype=bf16, prefetch=1,
                                                           bucket_bytes=64 * 2**20),
                   "floor": lambda: 0.0}
    times: dict[str, list[float]] = {m: [] for m in methods}
    firsts: dict[str, list[float]] = {m: [] for m in methods}
    peaks: dict[str, int] = {}
    for _ in range(args.repeats):
        for name, run in methods.items():
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            start = time.perf_counter()
            firsts[name].append(run())
            times[name].append(time.perf_counter() - start if name != "floor" else floor_copy(nbytes, device))
            peaks[name] = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    report(args, device, model, nbytes, times, firsts, peaks)
    if not args.fp32_master:
        offload_rounds(model, device, args.repeats)
    dist.destroy_process_group()


def offload_rounds(model: torch.nn.Module, device: torch.device, repeats: int) -> None:
    """One offload + load round of ``offload="params"``: per-step pinned allocation vs the host pool."""
    from lightning_fsdp_export.phases.offload import HostPool

    host = torch.device("cpu")
    pool = HostPool(pin=device.type == "cuda")
    ways = {"alloc_each_step": (lambda: move_module(model, host, pin_memory=True), lambda: move_module(model, device)),
            "host_pool": (lambda: pool.offload(model), lambda: pool.load(model, device))}
    move_module(model, device)
    rows = {}
    for name, (offload, load) in ways.items():
        offload(), load()  # warm-up (the pool allocates its buffers here)
        secs, peaks = [], {}
        for _ in range(repeats):
            sync(device)
            start = time.perf_counter()
            offload()
            sync(device)
            peaks["offloaded"] = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
            load()
            sync(device)
            secs.append(time.perf_counter() - start)
            peaks["loaded"] = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        rows[name] = (statistics.median(secs), peaks)
    print(f"\noffload='params': one offload + load round of the shards, {repeats} repeats")
    print(f"{'method':<16} {'median s':>9} {'GPU GiB offloaded':>18} {'GPU GiB loaded':>15}")
    for name, (sec, peaks) in rows.items():
        print(f"{name:<16} {sec:>9.3f} {peaks['offloaded'] / 2**30:>18.2f} {peaks['loaded'] / 2**30:>15.2f}")
    print(f"goal: host_pool/alloc_each_step {rows['host_pool'][0] / rows['alloc_each_step'][0]:.2f} (< 1)"
          f"; pool buffers allocated once: {pool.allocations}")


def report(args: argparse.Namespace, device: torch.device, model: torch.nn.Module, nbytes: int,
           times: dict[str, list[float]], firsts: dict[str, list[float]], peaks: dict[str, int]) -> None:
    params = sum(p.numel() for p in model.parameters())
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    masters = "fp32 masters exported as bf16" if args.fp32_master else "bf16"
    print(f"\n{name}, torch {torch.__version__}, preset {args.preset}: {params / 1e9:.2f}B params,"
          f" {nbytes / 2**30:.2f} GiB {masters}, shards offloaded to pinned host memory, {args.repeats} repeats")
    print(f"{'method':<16} {'median s':>9} {'min s':>7} {'first tensor ms':>16} {'peak GPU GiB':>13} {'x lazy':>7}")
    base = statistics.median(times["lazy"])
    for method in times:
        med = statistics.median(times[method])
        first = "" if method == "floor" else f"{1e3 * statistics.median(firsts[method]):.1f}"
        print(f"{method:<16} {med:>9.3f} {min(times[method]):>7.3f} {first:>16} {peaks[method] / 2**30:>13.2f}"
              f" {med / base:>7.2f}")
    floor = statistics.median(times["floor"])
    first = 1e3 * statistics.median(firsts["lazy"])
    if args.fp32_master:
        after = statistics.median(times["cast_after"])
        print(f"goals: lazy/cast_after {base / after:.2f} (<= 0.6), prefetch/lazy"
              f" {statistics.median(times['prefetch']) / base:.2f}, lazy/floor {base / max(floor, 1e-9):.2f}")
        return
    staged = statistics.median(times["staged"])
    print(f"goals: staged/lazy {staged / base:.2f} (>= 2), lazy/floor {base / max(floor, 1e-9):.2f} (<= 1.25),"
          f" first tensor {first:.1f} ms (<= 10)")


if __name__ == "__main__":
    main()
