"""When :class:`~lightning_fsdp_export.sync.callback.VLLMWeightSync` pushes: Lightning's hooks that call its ``sync()``
(after optimizer steps or epochs, at train start, after a phase that dropped a sleeping engine's weights) and what
ends a fit's pushes (``settle()`` at train end)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_fsdp_export.sync.engine import SyncEngine
from lightning_fsdp_export.targets.base import SleepsDuringCompute

__all__ = ["SyncTriggers"]


class SyncTriggers(Callback, ABC):
    """The hooks of a sync callback that decide when it pushes: its triggers' state here, the sync itself in the
    ``engine`` it holds (``VLLMWeightSync``), and :meth:`sync` (the subclass's: the push and its logging).

    Args:
        engine: the sync engine every trigger pushes with.
        every_n_train_steps: see ``VLLMWeightSync``.
        every_n_epochs: see ``VLLMWeightSync``.
        sync_on_train_start: see ``VLLMWeightSync``.
    """

    def __init__(self, engine: SyncEngine, *, every_n_train_steps: int | None, every_n_epochs: int | None,
                 sync_on_train_start: bool) -> None:
        self.engine = engine
        self._every_n_steps = every_n_train_steps if every_n_epochs is None else None
        if self._every_n_steps is None and every_n_epochs is None:
            self._every_n_steps = 1
        self._every_n_epochs = every_n_epochs
        self._sync_on_train_start = sync_on_train_start
        self._fit_start_step: int | None = None  # the global step this fit started at: no optimizer step yet there

    @abstractmethod
    def sync(self, trainer: pl.Trainer) -> None:
        """Push the current weights now (every rank)."""

    @property
    def every_n_train_steps(self) -> int | None:
        """Steps between syncs (None when syncing by epochs)."""
        return self._every_n_steps

    @property
    def syncs_on_train_start(self) -> bool:
        """Whether the fit's first push happens at train start (``sync_on_train_start``, or a resumed run)."""
        return self._sync_on_train_start or self.engine.resumed

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        # sleep_level=2 dropped the engine's weights in a phase no trigger follows (validation): push now,
        # before this step's rollouts.
        target = self.engine.target
        if isinstance(target, SleepsDuringCompute) and target.weights_discarded \
                and not trainer.sanity_checking:
            self.sync(trainer)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._fit_start_step = trainer.global_step
        if self.syncs_on_train_start:
            self.sync(trainer)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        n = self._every_n_steps
        if n and not self._should_skip(trainer) and trainer.global_step % n == 0:
            self.sync(trainer)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        n = self._every_n_epochs
        if n and not trainer.sanity_checking and (trainer.current_epoch + 1) % n == 0:
            self.sync(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.engine.target_ready:
            self.engine.settle()  # the last push in the background arrived (or the fit ends with its failure)

    def _should_skip(self, trainer: pl.Trainer) -> bool:
        # global_step counts optimizer steps: while it equals the fit's first step (the micro-batches of an
        # accumulation before the first step) or the last synced one, the weights are what the target holds
        return (trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING
                or trainer.global_step in (self.engine.last_synced_step, self._fit_start_step))
