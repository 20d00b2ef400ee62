"""An in-memory target for tests: keeps the last pushed weights on rank 0."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from typing_extensions import override

from lightning_fsdp_export.targets.base import SyncRun, WeightTarget

if TYPE_CHECKING:
    pass


class InMemoryTarget(WeightTarget):
    """Keeps ``{name: tensor}`` of the latest push on rank 0, and the versions pushed.

    Args:
        dtype: the dtype to ask the export for (``None``: the trainer's own).
        keep_on_all_ranks: keep the tensors on every rank, not only rank 0.
    """

    def __init__(self, *, dtype: torch.dtype | None = None, keep_on_all_ranks: bool = False) -> None:
        self._dtype = dtype
        self._keep_all = keep_on_all_ranks
        self._rank = 0
        self.weights: dict[str, Tensor] = {}
        self.versions: list[int] = []
        self.steps: list[int] = []
        self._trainer: SyncRun | None = None

    @property
    @override
    def dtype(self) -> torch.dtype | None:
        return self._dtype

    @override
    def setup(self, trainer: SyncRun) -> None:
        self._rank = trainer.global_rank
        self._trainer = trainer

    @override
    def push(self, weights: Iterator[tuple[str, Tensor]], *, version: int) -> None:
        keep = self._rank == 0 or self._keep_all
        received = {name: tensor for name, tensor in weights if keep}
        self.weights = received
        self.versions.append(version)
        self.steps.append(self._trainer.global_step if self._trainer is not None else -1)

    @override
    def teardown(self) -> None:
        pass
