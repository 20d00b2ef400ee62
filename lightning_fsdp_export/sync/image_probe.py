"""``verify="logprobs"`` for an engine that reads images: the same probe after a picture, scored by both sides.

A text probe never passes through a vision-language model's tower or projector, so a sync that left them stale (or
zeroed) would verify. Where the engine takes images (:meth:`ScoresLogprobs.image_checkpoint`) and the trainer's model
does too (its ``forward`` takes ``pixel_values``: a VLM trained whole), a fixed random picture goes before the probe:

1. the checkpoint's own processor turns the picture into the model's inputs (the family's image tokens expanded,
   pixels, token types);
2. the engine gets the prompt with the family's one image placeholder and the picture, and expands it itself;
3. where both expansions agree token for token, the trainer's forward scores the same sequence, and the probe's
   tokens after the picture are compared.

A text model trained out of a VLM checkpoint (its tower the engine's own) keeps the text probe only.
"""

from __future__ import annotations

import functools
import inspect
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
from transformers import AutoProcessor

if TYPE_CHECKING:
    from lightning_fsdp_export.strategy import LazyExportFSDP2
    from lightning_fsdp_export.targets.base import ScoresLogprobs

__all__ = ["image_probe_gap"]

_UNMATCHED: set[str] = set()  # checkpoints whose image probe did not line up (warned once)
_WRAPS = ("<|vision_start|>", "<|vision_end|>")  # Qwen-VL: an image's tokens between these (the model counts them)


def image_probe_gap(strategy: LazyExportFSDP2, target: ScoresLogprobs,
                    probe: list[int]) -> tuple[float | None, str | None]:
    """The largest logprob gap on ``probe``'s tokens after a picture, engine vs trainer (``None`` where the engine or
    the model takes no image, or the two expand the picture differently), and a message if the engine failed."""
    module = strategy.export_module
    path = target.image_checkpoint()
    if path is None or "pixel_values" not in inspect.signature(module.forward).parameters:
        return None, None
    picture, placeholder, head, prepared = _probe(str(path))
    inputs = dict(prepared)
    try:
        ids, engine = target.image_prompt_logprobs(placeholder + probe, picture)
    except Exception as err:  # noqa: BLE001 - reported through the ranks' agreement
        return None, f"the engine could not score the image probe ({type(err).__name__}: {err})"
    if ids != head + probe:  # a family whose prompt the engine builds otherwise: not comparable, said once
        if str(path) not in _UNMATCHED:
            _UNMATCHED.add(str(path))
            rank_zero_warn(f"verify='logprobs' scores text only for {path}: the engine expanded the image probe to"
                           f" {len(ids)} tokens, the checkpoint's processor to {len(head + probe)}, so the tower and"
                           " projector are checked only by exact_first_sync.")
        return None, None
    device = strategy.root_device
    for key, value in list(inputs.items()):
        if isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape[-1] == len(head):  # token types
            value = torch.cat([value, torch.zeros(1, len(probe), dtype=value.dtype)], 1)
        if isinstance(value, torch.Tensor):
            value = value.to(device, module.dtype if value.is_floating_point() else value.dtype)
        inputs[key] = value
    with torch.no_grad(), strategy.params_on_device():
        logits = module(input_ids=torch.tensor([ids], device=device), **inputs).logits[0].float()
    logp = torch.log_softmax(logits, -1)
    start = len(head)
    mine = [logp[t - 1, ids[t]].item() for t in range(start, len(ids))]
    return max(abs(a - b) for a, b in zip(engine[start - 1:], mine)), None


@functools.lru_cache(maxsize=4)
def _probe(path: str) -> tuple[Any, list[int], list[int], dict[str, Any]]:
    """What every sync's image probe of the checkpoint in ``path`` reuses (its processor runs once): a fixed random
    64x64 RGB picture as an ``(H, W, 3)`` uint8 array (vLLM and every family's processor take it and resize it), the
    prompt tokens standing for it, their expansion by the processor, and the model's other inputs for it."""
    processor = AutoProcessor.from_pretrained(path)
    g = torch.Generator().manual_seed(20260)
    picture = torch.randint(0, 256, (64, 64, 3), generator=g, dtype=torch.uint8).numpy()
    lead = _image_lead(processor)
    inputs = dict(processor(text=[lead], images=[[picture]], return_tensors="pt", add_special_tokens=False))
    head = inputs.pop("input_ids")[0].tolist()
    inputs.pop("attention_mask", None)
    return picture, processor.tokenizer(lead, add_special_tokens=False)["input_ids"], head, inputs


def _image_lead(processor: Any) -> str:
    """The text that stands for one image in a prompt: the processor's image token, between Qwen-VL's vision marks
    where its tokenizer has them."""
    token = processor.image_token
    vocab = processor.tokenizer.get_vocab()
    return f"{_WRAPS[0]}{token}{_WRAPS[1]}" if all(w in vocab for w in _WRAPS) else token
