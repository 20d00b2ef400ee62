"""``VLLMWeightSync``: the Trainer's adapter of the sync engine: a callback that decides when to sync.

A sync's path through the rooms is the engine's (:class:`~lightning_fsdp_export.sync.engine.SyncEngine`, shared with
Fabric's :class:`~lightning_fsdp_export.fabric.WeightSync`), which the callback holds (``sync.engine``); the hooks that
call it are :class:`~lightning_fsdp_export.sync.triggers.SyncTriggers`. This module adds the triggers' options, the
Trainer's loggers, the engine's public state on the callback and the callback's checkpoint state.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from typing_extensions import Unpack, override

from lightning_fsdp_export._common import WeightSyncError, options_signature
from lightning_fsdp_export.strategy import LazyExportFSDP2
from lightning_fsdp_export.sync.engine import SyncEngine
from lightning_fsdp_export.sync.holder import HoldsSyncEngine
from lightning_fsdp_export.sync.options import OnError, SyncArgs, SyncLora, SyncOptions
from lightning_fsdp_export.sync.triggers import SyncTriggers
from lightning_fsdp_export.targets.base import SleepsDuringCompute, WeightTarget

__all__ = ["VLLMWeightSync", "WeightSyncError"]


class VLLMWeightSync(HoldsSyncEngine, SyncTriggers):
    """Push the trainer's weights into a vLLM target after optimizer steps or epochs.

    Example::

        sync = VLLMWeightSync(ColocatedVLLM(model="ckpt/", dtype="bfloat16"), every_n_train_steps=1)
        trainer = Trainer(strategy=LazyExportFSDP2(offload="params"), callbacks=[sync])
        # rollouts in the LightningModule: sync.target.llm.generate(...)

    Each sync bumps ``version``, hands ``strategy.export_source(dtype=...)`` to the target's ``push_source()`` (one
    pass), and logs ``weight_sync/{seconds,gigabytes,tensors,version}`` from rank 0 to the Trainer's loggers. A sync
    follows an optimizer step: the micro-batches of a gradient accumulation before it push nothing.
    ``state_dict()`` keeps the version and the last synced step, under a key naming the mode and the target (see
    ``name``); a run resumed from a checkpoint syncs before its first step (a new engine holds the initial weights).
    A target that sends patches (``SendsPatches``: ``RemoteVLLM`` with ``Gloo(sparse=True)`` or ``SparseNCCL()``) is
    told before each sync the version every rank agreed it holds (none after a failure, a failed verify or a resume:
    that push is dense).

    Beside the target and the triggers it takes the options every sync takes
    (:class:`~lightning_fsdp_export.sync.options.SyncArgs`: keywords declared once, for this class and Fabric's
    ``WeightSync``), listed below after the triggers.

    Args:
        target: where the weights go (:class:`~lightning_fsdp_export.targets.ColocatedVLLM`,
            :class:`~lightning_fsdp_export.targets.RemoteVLLM`, ...).
        every_n_train_steps: sync after every N optimizer steps. With neither trigger: 1.
        every_n_epochs: sync after every N training epochs instead.
        sync_on_train_start: sync once before the first step, so the engine starts from exactly the
            trainer's weights (not the checkpoint it was built from).
    """

    @options_signature(SyncArgs, SyncOptions)
    def __init__(self, target: WeightTarget, *, every_n_train_steps: int | None = None,
                 every_n_epochs: int | None = None, sync_on_train_start: bool = True,
                 **options: Unpack[SyncArgs]) -> None:
        _validate_triggers(every_n_train_steps, every_n_epochs)
        parsed = SyncOptions.of(options, "VLLMWeightSync")
        _validate_sleep(target, every_n_train_steps, every_n_epochs, parsed)
        if parsed.exact_first_sync and not sync_on_train_start:
            raise ValueError("VLLMWeightSync(exact_first_sync=True) checks the sync at train start, where the trainer"
                             " still holds the engine's checkpoint: it needs sync_on_train_start=True.")
        engine = SyncEngine(target, parsed, owner="VLLMWeightSync")
        super().__init__(engine, every_n_train_steps=every_n_train_steps, every_n_epochs=every_n_epochs,
                         sync_on_train_start=sync_on_train_start)
        self._in_trainer = False  # set at setup(): from then on state_key is the checkpoint's key

    @property
    def checkpoint_key(self) -> str:
        """The key of this sync's state in a checkpoint's callback states: the mode and the kind of target (or
        ``name=``). Stable across a resume, even one that swaps the target for another of its kind (a new server)."""
        return self._generate_state_key(lora=self.engine.lora.value, target=self.engine.name)

    @property
    @override
    def state_key(self) -> str:
        # checkpoint_key once in a Trainer (setup). Before, this instance's own: Lightning's duplicate check at
        # Trainer() would stop two unnamed syncs of one kind with a message that cannot name the fix; setup() checks
        # them instead, naming name= (_require_distinct_keys).
        return self.checkpoint_key if self._in_trainer else f"{self.checkpoint_key}#{id(self):x}"

    # -- when -------------------------------------------------------------------------------------------

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        _require_strategy(trainer)
        self._in_trainer = True
        _require_distinct_keys(trainer)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _require_strategy(trainer)
        self.engine.start(trainer)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self.engine.end(trainer.strategy)
        elif isinstance(trainer.strategy, LazyExportFSDP2):
            trainer.strategy.remove_phase_listener(self.engine)

    def sync(self, trainer: pl.Trainer) -> None:
        """Push the current weights now; every rank must call it (the export is collective).

        On failure every rank raises :class:`WeightSyncError` (``on_error="raise"``) or warns and goes
        on (``"warn"``); either way the target is marked stale and the next sync pushes everything.
        """
        _require_strategy(trainer)
        metrics = self.engine.push(trainer)
        if metrics is not None and trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)


def _require_strategy(trainer: pl.Trainer) -> LazyExportFSDP2:
    strategy = trainer.strategy
    if not isinstance(strategy, LazyExportFSDP2):
        raise TypeError(
            f"VLLMWeightSync needs the LazyExportFSDP2 strategy, but the Trainer uses {type(strategy).__name__}."
            " Use Trainer(strategy=LazyExportFSDP2(...)) or Trainer(strategy='lazy_fsdp2')."
        )
    return strategy


def trainer_callbacks(trainer: pl.Trainer) -> list[pl.Callback]:
    """``trainer.callbacks``: Lightning's callback connector sets it on every Trainer; the class does not declare it."""
    callbacks: list[pl.Callback] = trainer.callbacks  # type: ignore[attr-defined]  # (set, never declared)
    return callbacks


def _require_distinct_keys(trainer: pl.Trainer) -> None:
    """Two syncs in one Trainer must keep their states under different checkpoint keys: name the ones that would not."""
    syncs = [cb for cb in trainer_callbacks(trainer) if isinstance(cb, VLLMWeightSync)]
    keys = [sync.checkpoint_key for sync in syncs]
    twice = sorted({key for key in keys if keys.count(key) > 1})
    if twice:
        names = ", ".join(repr(sync.engine.name) for sync, key in zip(syncs, keys) if key in twice)
        raise ValueError(f"The Trainer holds {len(syncs)} VLLMWeightSync callbacks, and some would keep their state"
                         f" under one checkpoint key ({', '.join(twice)}; target names {names}): give each a name of"
                         " its own, e.g. VLLMWeightSync(target, name='rollouts') and VLLMWeightSync(eval_target,"
                         " name='eval'), and keep the names across a resume.")


def _validate_sleep(target: WeightTarget, every_n_train_steps: Any, every_n_epochs: Any, options: SyncOptions) -> None:
    """``sleep_level=2`` drops the engine's weights at every step: only a full push after every step restores them."""
    if not isinstance(target, SleepsDuringCompute) or target.sleep_level != 2:
        return
    why = ("ColocatedVLLM(sleep_level=2) drops the engine's weights at every step and only a full push brings them"
           " back, so VLLMWeightSync must push all weights after every optimizer step and never give up on one")
    for bad, fix in ((every_n_train_steps not in (None, 1), f"every_n_train_steps={every_n_train_steps}"),
                     (every_n_epochs is not None, f"every_n_epochs={every_n_epochs}"),
                     (options.lora is SyncLora.ADAPTER, "lora='adapter' (base weights pushed once)"),
                     (options.on_error is OnError.WARN, "on_error='warn'")):
        if bad:
            raise ValueError(f"{why}; {fix} would leave it without weights. Use sleep_level=1 for that, or drop it.")


def _validate_triggers(every_n_train_steps: Any, every_n_epochs: Any) -> None:
    if every_n_train_steps is not None and every_n_epochs is not None:
        raise ValueError(
            f"VLLMWeightSync got every_n_train_steps={every_n_train_steps} and every_n_epochs={every_n_epochs}:"
            " choose one trigger."
        )
    for name, value in (("every_n_train_steps", every_n_train_steps), ("every_n_epochs", every_n_epochs)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"VLLMWeightSync({name}={value!r}) must be a positive integer or None.")
