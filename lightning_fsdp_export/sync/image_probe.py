"""``verify="logprobs"`` for an engine that reads images: the same probe after a picture, scored by both sides.

A text probe never passes through a vision-language model's tower or projector, so a sync that left them stale (or
zeroed) would verify. Where the engine takes images (:meth:`ScoresLogprobs.image_checkpoint`), a fixed random picture
goes before the probe:

1. the checkpoint's own processor turns the picture into the model's inputs (the family's image tokens expanded,
   pixels, token types);
2. the engine gets the prompt with the family's one image placeholder and the picture, and expands it itself;
3. where both expansions agree token for token, the trainer scores the same sequence, and the probe's tokens after the
   picture are compared.

The trainer scores it with its own model where that reads images (its ``forward`` takes ``pixel_values``: a VLM
trained whole). A text model trained out of a VLM checkpoint (``pretrained=`` found parts it does not hold) cannot see
a picture; there the checkpoint's own VLM class, built with a one-layer text model and loaded from the checkpoint
(its tower and projector, which the engine must hold unchanged), turns the sequence into what it would feed its text
model (:func:`_tower_part`: the embeddings with the picture's rows, its position ids and masks), and the trainer's text
model scores the sequence with those rows in place of its own embeddings. Where that cannot be done (a family that
feeds its text model more than embeddings, such as Qwen3-VL's deepstack features), verify says so once and scores
text only.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import transformers
from lightning.pytorch.utilities import rank_zero_warn
from transformers import AutoProcessor

if TYPE_CHECKING:
    from lightning_fsdp_export.strategy_core import LazyExportCore
    from lightning_fsdp_export.targets.base import ScoresLogprobs

__all__ = ["image_probe_gap"]

_UNMATCHED: set[str] = set()  # checkpoints whose image probe did not line up (warned once)
_WRAPS = ("<|vision_start|>", "<|vision_end|>")  # Qwen-VL: an image's tokens between these (the model counts them)


def image_probe_gap(strategy: LazyExportCore, target: ScoresLogprobs,
                    probe: list[int]) -> tuple[float | None, str | None]:
    """The largest logprob gap on ``probe``'s tokens after a picture, engine vs trainer (``None`` where the engine or
    the model takes no image, or the two expand the picture differently), and a message if the engine failed."""
    module: Any = strategy.export_module  # (a transformers model: its forward takes the processor's inputs)
    path = target.image_checkpoint()
    whole = "pixel_values" in inspect.signature(module.forward).parameters
    if path is None or not (whole or strategy.checkpoint_format.parts_not_held):
        return None, None
    picture, placeholder, head, prepared = _probe(str(path))
    try:
        ids, engine = target.image_prompt_logprobs(placeholder + probe, picture)
    except Exception as err:  # noqa: BLE001 - reported through the ranks' agreement
        return None, f"the engine could not score the image probe ({type(err).__name__}: {err})"
    if ids != head + probe:  # a family whose prompt the engine builds otherwise: not comparable, said once
        return _text_only(str(path), f"the engine expanded the image probe to {len(ids)} tokens, the checkpoint's"
                                     f" processor to {len(head + probe)}")
    device = strategy.root_device
    if whole:
        inputs = _model_inputs(prepared, len(head), len(probe), device, module.dtype)
        with torch.no_grad(), strategy.params_on_device():
            logits = module(input_ids=torch.tensor([ids], device=device), **inputs).logits[0].float()
    else:
        part = _tower_part(str(path), tuple(ids), str(module.dtype).removeprefix("torch."))
        if isinstance(part, str):
            return _text_only(str(path), part)
        with torch.no_grad(), strategy.params_on_device(), part.in_place_of(module.get_input_embeddings(), device):
            logits = module(input_ids=torch.tensor([ids], device=device), **part.inputs(device)).logits[0].float()
    logp = torch.log_softmax(logits, -1)
    start = len(head)
    mine = [logp[t - 1, ids[t]].item() for t in range(start, len(ids))]
    return max(abs(a - b) for a, b in zip(engine[start - 1:], mine)), None


def _text_only(path: str, why: str) -> tuple[None, None]:
    """No image probe for the checkpoint in ``path`` (``why``), said once."""
    if path not in _UNMATCHED:
        _UNMATCHED.add(path)
        rank_zero_warn(f"verify='logprobs' scores text only for {path}: {why}, so the tower and projector are checked"
                       " only by exact_first_sync.")
    return None, None


def _model_inputs(prepared: dict[str, Any], head: int, probe: int, device: torch.device,
                  dtype: torch.dtype) -> dict[str, Any]:
    """The processor's other inputs for the picture, on ``device`` (floats in ``dtype``), token types extended over
    the probe's ``probe`` tokens after the picture's ``head``."""
    inputs = dict(prepared)
    for key, value in list(inputs.items()):
        if isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape[-1] == head:  # token types
            value = torch.cat([value, torch.zeros(1, probe, dtype=value.dtype)], 1)
        if isinstance(value, torch.Tensor):
            value = value.to(device, dtype if value.is_floating_point() else value.dtype)
        inputs[key] = value
    return inputs


@dataclass(frozen=True)
class _TowerPart:
    """What a checkpoint's VLM feeds its text model for the probe: its embeddings' rows that the picture fills
    (``rows`` at ``mask``), and the other inputs it passes (position ids: Qwen's 3-D ones; masks: Gemma 3's)."""

    rows: torch.Tensor
    mask: torch.Tensor
    kwargs: dict[str, Any]

    def inputs(self, device: torch.device) -> dict[str, Any]:
        """The position ids and masks, on ``device``."""
        def move(value: Any) -> Any:
            if isinstance(value, dict):
                return {k: move(v) for k, v in value.items()}
            return value.to(device) if isinstance(value, torch.Tensor) else value

        return {key: move(value) for key, value in self.kwargs.items()}

    @contextlib.contextmanager
    def in_place_of(self, embeddings: torch.nn.Module, device: torch.device) -> Iterator[None]:
        """Within the block, ``embeddings``' output has the picture's rows (a forward hook, removed after)."""
        rows, mask = self.rows.to(device), self.mask.to(device)

        def hook(module: torch.nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
            out = out.clone()
            out[0, mask] = rows.to(out.dtype)
            return out

        handle = embeddings.register_forward_hook(hook)
        try:
            yield
        finally:
            handle.remove()


class _Fed(Exception):
    """Raised by the hook on the VLM's text model with what the VLM passed it (its forward goes no further)."""


_PASSED = ("position_ids", "attention_mask")  # what the trainer's text model is given of the VLM's call
_IGNORED = ("inputs_embeds", "input_ids", "past_key_values", "use_cache", "return_dict", "cache_position")


@functools.lru_cache(maxsize=4)
def _tower_part(path: str, ids: tuple[int, ...], dtype: str) -> _TowerPart | str:
    """What the VLM of the checkpoint in ``path`` feeds its text model for ``ids`` and the probe's picture: built with
    a one-layer text model (transient: the tower, the projector and one decoder layer from the checkpoint), run up to
    its text model. A string says why it cannot be done."""
    _, _, head, prepared = _probe(path)
    config = transformers.AutoConfig.from_pretrained(path)
    cls = getattr(transformers, (getattr(config, "architectures", None) or [""])[0], None)
    if cls is None:
        return f"its class {getattr(config, 'architectures', None)} is not one of transformers'"
    text = config.get_text_config()
    layers = text.num_hidden_layers
    text.num_hidden_layers = 1
    for key, value in list(vars(text).items()):  # (per-layer lists: layer_types, ...)
        if isinstance(value, list) and len(value) == layers:
            setattr(text, key, value[:1])
    quiet = logging.getLogger("transformers")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # (the checkpoint's other layers: "unused weights")
    try:
        vlm = cls.from_pretrained(path, config=config, dtype=getattr(torch, dtype))
    except Exception as err:  # noqa: BLE001 - said once, then text only
        return f"its {cls.__name__} could not be built with one text layer ({type(err).__name__}: {err})"
    finally:
        quiet.setLevel(level)
    decoder = vlm.get_decoder()

    def stop(module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        raise _Fed(kwargs)

    handle = decoder.register_forward_pre_hook(stop, with_kwargs=True)
    inputs = _model_inputs(prepared, len(head), len(ids) - len(head), torch.device("cpu"), getattr(torch, dtype))
    tokens = torch.tensor([ids])
    try:
        with torch.no_grad():
            vlm(input_ids=tokens, **inputs)
        return f"its {cls.__name__} never called its text model"
    except _Fed as fed:
        kwargs = fed.args[0]
    finally:
        handle.remove()
    other = sorted(k for k, v in kwargs.items()  # (flags such as output_router_logits are no inputs)
                   if isinstance(v, torch.Tensor | list | tuple | dict) and k not in _PASSED + _IGNORED)
    if other:
        return f"its {cls.__name__} feeds its text model more than embeddings ({', '.join(other)})"
    with torch.no_grad():
        embeds, plain = kwargs["inputs_embeds"], vlm.get_input_embeddings()(tokens)
    mask = (embeds != plain).any(-1)[0]
    return _TowerPart(embeds[0, mask].clone(), mask, {k: kwargs[k] for k in _PASSED if kwargs.get(k) is not None})


@functools.lru_cache(maxsize=4)
def _probe(path: str) -> tuple[Any, list[int], list[int], dict[str, Any]]:
    """What every sync's image probe of the checkpoint in ``path`` reuses (its processor runs once): a fixed random
    64x64 RGB picture as an ``(H, W, 3)`` uint8 array (vLLM and every family's processor take it and resize it), the
    prompt tokens standing for it, their expansion by the processor, and the model's other inputs for it."""
    processor: Any = AutoProcessor.from_pretrained(path)
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
