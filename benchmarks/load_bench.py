"""Loading a pretrained checkpoint into FSDP2 shards on 2 CPU ranks: peak RSS per rank, side by side.

    python benchmarks/load_bench.py                                   # ~200M Qwen2, bf16 checkpoint
    python benchmarks/load_bench.py --vocab 512 --hidden 256 --layers 2 --repeats 1   # tiny, seconds

Re-launches itself under ``torch.distributed.run`` with 2 processes unless started by torchrun. Rank 0
writes a bf16 safetensors checkpoint once; then, alternating, every rank builds an fp32 model (RL keeps
fp32 masters) sharded over both ranks, and rank 0 reports wall seconds and its peak extra RSS
(``VmHWM`` reset before each method):

- ``whole_then_shard``: ``from_pretrained(dir)`` on every rank (the whole model), then ``fully_shard``,
  the only way before ``LazyExportFSDP2(pretrained=)``;
- ``meta_pretrained``: what ``trainer.init_module(empty_init=True)`` + ``LazyExportFSDP2(pretrained=dir)``
  run: the model built on the meta device, sharded, allocated shard by shard, and the checkpoint read
  slice by slice into the shards (``materialize_meta`` + ``load_hf_checkpoint``), no random init.

Both end with the same shards (checked: bit-identical exports).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import Qwen2ForCausalLM

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from export_bench import describe, qwen2, run_all, shard, start_two_ranks, table

from lightning_fsdp_export.export.lazy import lazy_export
from lightning_fsdp_export.prepare.materialize import materialize_meta
from lightning_fsdp_export.prepare.pretrained import load_hf_checkpoint


def whole_then_shard(path: Path) -> torch.nn.Module:
    return shard(Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32))


def meta_pretrained(path: Path, config: Any) -> torch.nn.Module:
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config).to(torch.float32)
    shard(model)
    materialize_meta(model, torch.device("cpu"), load=lambda: load_hf_checkpoint(model, path))
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--workdir", default="runs/load_bench")
    parser.add_argument("--json", default=None, help="write the results to this path (rank 0)")
    args = parser.parse_args()
    start_two_ranks(__file__)
    path = Path(args.workdir) / f"qwen2_{args.vocab}_{args.hidden}_{args.layers}"
    if dist.get_rank() == 0 and not (path / "config.json").exists():
        model = qwen2(args.vocab, args.hidden, args.layers)
        model.lm_head.weight = model.model.embed_tokens.weight  # export_bench's to_empty untied them
        model.save_pretrained(path)  # bf16, tied: no lm_head.weight in the file
    dist.barrier()
    config = Qwen2ForCausalLM.config_class.from_pretrained(path)
    made: dict[str, torch.nn.Module] = {}

    def method(name: str, build: Any) -> Any:
        def run() -> tuple[int, int, int]:
            made.pop(name, None)
            model = made[name] = build()
            return describe(model)["bytes"] // dist.get_world_size(), sum(1 for _ in model.parameters()), 0
        return run

    samples = run_all({"whole_then_shard": method("whole_then_shard", lambda: whole_then_shard(path)),
                       "meta_pretrained": method("meta_pretrained", lambda: meta_pretrained(path, config))},
                      args.repeats)
    exports = {name: list(lazy_export(model)) for name, model in made.items()}
    same = all(torch.equal(a, b) for (_, a), (_, b) in zip(exports["whole_then_shard"], exports["meta_pretrained"]))
    if dist.get_rank() == 0:
        m = describe(made["meta_pretrained"])
        title = (f"load a bf16 checkpoint into fp32 shards: Qwen2 vocab {args.vocab}, hidden {args.hidden},"
                 f" {args.layers} layers, {m['params'] / 1e6:.1f}M params, 2 ranks, {args.repeats} repeats, rank 0"
                 " (MB = this rank's shard bytes)")
        result = {"world_size": dist.get_world_size(), "model": m, "identical": same,
                  "methods": table(title, samples, "whole_then_shard")}
        print(f"identical shards: {same}   ('x lazy' columns above are x whole_then_shard)")
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
