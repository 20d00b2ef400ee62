"""When :class:`~lightning_fsdp_export.sync.callback.VLLMWeightSync` pushes: Lightning's hooks that call its ``sync()``
(after optimizer steps or epochs, at train start, after a phase that dropped a sleeping engine's weights) and what
ends a fit's pushes (``settle()`` at train end)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_fsdp_export.targets.base import SleepsDuringCompute, WeightTarget

__all__ = ["SyncTriggers"]


class SyncTriggers(Callback):
    """The hooks of a sync callback that decide when it pushes; the subclass has ``sync(trainer)`` and ``settle()``
    (``VLLMWeightSync``: the engine's)."""

    sync: Callable[[pl.Trainer], None]
    settle: Callable[[], bool]

    target: WeightTarget
    last_synced_step: int
    _every_n_steps: int | None
    _every_n_epochs: int | None
    _sync_on_train_start: bool
    _resumed: bool
    _fit_start_step: int | None
    _target_ready: bool

    @property
    def every_n_train_steps(self) -> int | None:
        """Steps between syncs (None when syncing by epochs)."""
        return self._every_n_steps

    @property
    def syncs_on_train_start(self) -> bool:
        """Whether the fit's first push happens at train start (``sync_on_train_start``, or a resumed run)."""
        return self._sync_on_train_start or self._resumed

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        # sleep_level=2 dropped the engine's weights in a phase no trigger follows (validation): push now,
        # before this step's rollouts.
        if isinstance(self.target, SleepsDuringCompute) and self.target.weights_discarded \
                and not trainer.sanity_checking:
            self.sync(trainer)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._fit_start_step = trainer.global_step
        if self._sync_on_train_start or self._resumed:
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
        if self._target_ready:
            self.settle()  # the last push in the background arrived (or the fit ends with its failure)

    def _should_skip(self, trainer: pl.Trainer) -> bool:
        # global_step counts optimizer steps: while it equals the fit's first step (the micro-batches of an
        # accumulation before the first step) or the last synced one, the weights are what the target holds
        return (trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING
                or trainer.global_step in (self.last_synced_step, self._fit_start_step))
