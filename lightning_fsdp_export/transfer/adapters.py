"""LoRA adapters into vLLM servers: the checks before a push, the load, and an adapter as a transfer source.

vLLM's OpenAI server loads adapters at run time (``POST /v1/load_lora_adapter`` with ``lora_name``,
``lora_path``, ``load_inplace``) when started with ``--enable-lora --max-lora-rank R`` and the environment
variable ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``. ``RemoteVLLM`` loads every version under one stable name
(clients keep asking for ``model=<that name>``), from a new path per version: vLLM's prefix cache keys an
adapter's blocks by its path, so no cached prompt of an older adapter is reused.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import Tensor

from lightning_fsdp_export.backend.adapter_dirs import SERVER_ADAPTER_ROOT, prune_versions

__all__ = ["SERVER_ADAPTER_ROOT", "AdapterFiles", "AdapterTensors", "adapter_rank",
           "prune_versions"]

@dataclass(frozen=True)
class AdapterFiles:
    """One version of a peft adapter directory as the sync wrote it on this rank."""

    path: Path

    @property
    def config(self) -> str:
        """``adapter_config.json``'s text."""
        return (self.path / "adapter_config.json").read_text()

    def tensors(self) -> list[tuple[str, Tensor]]:
        """``adapter_model.safetensors``' tensors, in name order."""
        return sorted(load_file(str(self.path / "adapter_model.safetensors")).items())


@dataclass(frozen=True)
class _Meta:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


class AdapterTensors:
    """An adapter's tensors as a transfer source (what ``FSDP2WeightSource`` wraps): no collective, every rank
    holds the same tensors, so every pass yields them all."""

    def __init__(self, tensors: Sequence[tuple[str, Tensor]]) -> None:
        self._tensors = list(tensors)

    def metadata(self) -> list[_Meta]:
        return [_Meta(name, t.dtype, tuple(t.shape)) for name, t in self._tensors]

    def __iter__(self) -> Iterator[tuple[str, Tensor]]:
        return iter(self._tensors)

    def drain(self) -> None:
        """Nothing to finish: no pass holds a collective."""


def adapter_rank(shapes: Sequence[tuple[str, tuple[int, ...]]]) -> int:
    """The adapter's LoRA rank: the largest first dimension of its ``lora_A`` tensors (0: none)."""
    return max((shape[0] for name, shape in shapes if ".lora_A." in name and shape), default=0)
