"""What the rollouts produce: samples with a weight version per token, their groups and batches, and the
off-policy helpers a loss uses (truncated importance weights, the staleness mask)."""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_fsdp_export.servers.http import GENERATE_ROUTE

__all__ = ["GENERATE_ROUTE", "UNKNOWN_VERSION", "Prompt", "RolloutBatch", "RolloutError", "Sample", "SampleGroup",
           "image_parts", "split_prompt", "staleness_mask", "truncated_importance_weights"]

Prompt = list[int] | dict[str, Any]
"""A rollout prompt: token ids, or vLLM's ``{"prompt_token_ids": [...], "multi_modal_data": {"image": ...}}``."""
UNKNOWN_VERSION = -1
"""A token's version when the server's label is not one of the sync's (``"default"``: a server that restarted
from its checkpoint): older than any pushed version, so it counts as maximally stale."""


class RolloutError(RuntimeError):
    """The rollouts cannot go on: every server failed, or no batch came within ``batch_timeout``."""


@dataclass
class Sample:
    """One completion, as the server produced it.

    ``versions[i]`` is the weight version that sampled ``tokens[i]`` (from vLLM's spans); ``logprobs[i]`` is
    vLLM's logprob of that token when it was sampled (the behaviour policy).
    """

    prompt_index: int
    prompt: list[int]
    tokens: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    server: str
    reward: float = 0.0
    multi_modal_data: dict[str, Any] | None = None
    """The prompt's images as given (``{"image": [...]}``), for the trainer's processor; ``prompt`` then holds the
    family's placeholder token once per image, not the tokens the image expands to."""

    @property
    def min_version(self) -> int:
        return min(self.versions, default=UNKNOWN_VERSION)

    @property
    def max_version(self) -> int:
        return max(self.versions, default=UNKNOWN_VERSION)

    def staleness(self, version: int) -> int:
        """``version`` (the trainer's) minus this sample's oldest token version."""
        return version - self.min_version


@dataclass
class SampleGroup:
    """The ``group_size`` samples of one prompt, kept together (their rewards normalise each other)."""

    prompt_index: int
    samples: list[Sample]
    admitted_version: int
    admitted_at: float
    finished_at: float = 0.0

    @property
    def min_version(self) -> int:
        return min(s.min_version for s in self.samples)


class RolloutBatch:
    """This rank's share of one step: ``groups``, filled just before ``training_step``.

    ``version`` is the trainer's version when the batch was filled; ``waited`` the seconds the trainer
    waited for it. (A plain class, not a dataclass: Lightning moves dataclass batches by copying them.)
    """

    def __init__(self) -> None:
        self.groups: list[SampleGroup] = []
        self.version = 0
        self.waited = 0.0

    @property
    def samples(self) -> list[Sample]:
        return [s for g in self.groups for s in g.samples]

    def staleness(self) -> list[int]:
        """Per sample: the trainer's version minus the sample's oldest token version."""
        return [s.staleness(self.version) for s in self.samples]

    def advantages(self, eps: float = 1e-6) -> Tensor:
        """Per sample: its reward minus its group's mean, over the group's standard deviation (GRPO)."""
        out = []
        for group in self.groups:
            rewards = torch.tensor([s.reward for s in group.samples], dtype=torch.float32)
            std = rewards.std() if len(rewards) > 1 else torch.tensor(0.0)
            out.append((rewards - rewards.mean()) / (std + eps))
        return torch.cat(out) if out else torch.zeros(0)

    def tensors(self, *, pad_id: int = 0, device: torch.device | str | None = None) -> dict[str, Tensor]:
        """The batch as right-padded tensors, one row per sample (prompt then completion).

        ``input_ids``, ``attention_mask`` ``[N, L]``; ``completion_mask`` (1 on completion tokens);
        ``behaviour_logprobs`` and ``versions`` aligned with ``input_ids`` (the logprob and version of the token
        at that position; 0 and -1 elsewhere); ``advantages`` and ``rewards`` ``[N]``.
        """
        samples = self.samples
        length = max((len(s.prompt) + len(s.tokens) for s in samples), default=0)
        n = len(samples)
        ids = torch.full((n, length), pad_id, dtype=torch.long)
        attention = torch.zeros(n, length, dtype=torch.long)
        completion = torch.zeros(n, length, dtype=torch.long)
        behaviour = torch.zeros(n, length)
        versions = torch.full((n, length), UNKNOWN_VERSION, dtype=torch.long)
        for row, s in enumerate(samples):
            p, c = len(s.prompt), len(s.tokens)
            ids[row, : p + c] = torch.tensor(s.prompt + s.tokens)
            attention[row, : p + c] = 1
            completion[row, p : p + c] = 1
            behaviour[row, p : p + c] = torch.tensor(s.logprobs)
            versions[row, p : p + c] = torch.tensor(s.versions)
        out = {"input_ids": ids, "attention_mask": attention, "completion_mask": completion,
               "behaviour_logprobs": behaviour, "versions": versions, "advantages": self.advantages(),
               "rewards": torch.tensor([s.reward for s in samples])}
        return {k: v.to(device) for k, v in out.items()} if device is not None else out


def truncated_importance_weights(trainer_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, *,
                                 cap: float = 2.0) -> Tensor:
    """Per-token ``min(exp(trainer - behaviour), cap)``, zero where ``mask`` is 0 (truncated importance
    sampling: the off-policy correction of the loss; the weights carry no gradient)."""
    ratio = torch.exp((trainer_logprobs - behaviour_logprobs).detach()).clamp(max=cap)
    return ratio * mask


def staleness_mask(versions: Tensor, trainer_version: int, max_staleness: int) -> Tensor:
    """1 on tokens sampled by a version at most ``max_staleness`` older than ``trainer_version``, else 0
    (padding, labelled -1, is masked unless the bound allows it)."""
    return (trainer_version - versions <= max_staleness).to(torch.long)


def split_prompt(prompt: Any, index: int) -> tuple[list[int], dict[str, Any] | None]:
    """A prompt of ``AsyncRollouts`` as ``(token ids, multi_modal_data or None)``: a list of token ids, or vLLM's
    ``{"prompt_token_ids": [...], "multi_modal_data": {"image": picture or [pictures]}}``."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" not in prompt:
            raise ValueError(f"AsyncRollouts: prompt {index} is a dict without 'prompt_token_ids' (keys"
                             f" {sorted(prompt)}); give {{'prompt_token_ids': [...], 'multi_modal_data': {{'image':"
                             " ...}}}.")
        media = prompt.get("multi_modal_data") or None
        if media is not None and set(media) - {"image"}:
            raise ValueError(f"AsyncRollouts: prompt {index}'s multi_modal_data holds {sorted(media)}; only 'image'"
                             " is sent to the servers.")
        return list(prompt["prompt_token_ids"]), media
    return list(prompt), None


def image_parts(media: dict[str, Any]) -> list[dict[str, str]]:
    """``multi_modal_data``'s images as the ``content_parts`` of vLLM's ``/inference/v1/generate`` (one
    ``image_url`` each, in order): a URL string as is (``data:``, ``http(s):``), a PIL image or an ``(H, W, 3)`` uint8
    array as a PNG ``data:`` URL."""
    images = media.get("image")
    images = images if isinstance(images, (list, tuple)) else [images]
    return [{"type": "image_url", "url": image if isinstance(image, str) else _png_url(image)} for image in images]


def _png_url(image: Any) -> str:
    from PIL import Image  # (pillow: a dependency of vLLM, and of every processor that reads images)

    picture = image if hasattr(image, "save") else Image.fromarray(torch.as_tensor(image).to(torch.uint8).numpy())
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()

