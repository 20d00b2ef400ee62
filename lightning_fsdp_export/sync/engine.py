"""The sync engine: a sync's path through the rooms, whoever decides when it runs (``docs/architecture.md``).

A sync reads: the ranks agree on the sources' metadata -> the target consumes the sources -> verify -> report. The
sources come from the strategy (:mod:`~lightning_fsdp_export.sync.pushes` chooses their kinds once), the agreement
from :mod:`~lightning_fsdp_export.sync.agreement`, the checks from :mod:`~lightning_fsdp_export.sync.verify` and
:mod:`~lightning_fsdp_export.sync.exact`. Two adapters decide when: the Trainer's callback
(:class:`~lightning_fsdp_export.sync.callback.VLLMWeightSync`) and the loop's own calls
(:class:`~lightning_fsdp_export.fabric.WeightSync`).
"""

from __future__ import annotations

import os
import shutil
import time
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any, Literal, Protocol

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_fsdp_export._common import SyncGroup, WeightSyncError
from lightning_fsdp_export.export.source import ExportSource
from lightning_fsdp_export.strategy_core import LazyExportCore
from lightning_fsdp_export.sync.agreement import FAILED, agree_after, agree_arrived, agree_before
from lightning_fsdp_export.sync.exact import EXACT_FAILED, ExactCheck, check_precondition, exact_verdict
from lightning_fsdp_export.sync.options import Drafter, OnError, SyncLora, Verify, WhenBusy, parse_option
from lightning_fsdp_export.sync.pushes import consume, plan_pushes, refusals, temporary_adapter_dir
from lightning_fsdp_export.sync.verify import check_logprobs
from lightning_fsdp_export.targets.base import (
    ExactCheckable,
    LoadsAdapters,
    PushesDrafts,
    ScoresLogprobs,
    SendsPatches,
    SleepsDuringCompute,
    WeightTarget,
)

__all__ = ["SyncEngine", "SyncRun"]


class SyncRun(Protocol):
    """What a sync and its target read of the run: a ``lightning.pytorch.Trainer`` is one; a Fabric loop's is
    :class:`~lightning_fsdp_export.fabric.sync.FabricRun`."""

    strategy: Any
    global_rank: int
    local_rank: int
    world_size: int
    is_global_zero: bool
    global_step: int
    accumulate_grad_batches: int


class SyncEngine:
    """A weight sync's state and path, for every rank; the adapters decide when :meth:`_push` runs.

    Every option is documented on :class:`~lightning_fsdp_export.sync.callback.VLLMWeightSync`.
    """

    def __init__(self, target: WeightTarget, *, dtype: torch.dtype | None = None,
                 verify: Literal["logprobs"] | None = None, verify_tolerance: float = 1.0,
                 lora: Literal["merged", "adapter"] = "merged", adapter_dir: str | os.PathLike[str] | None = None,
                 on_error: Literal["raise", "warn"] = "raise", check_finite: bool = True,
                 timeout: timedelta | float | None = None, exact_first_sync: bool = False,
                 name: str | None = None, when_busy: Literal["wait", "skip"] = "wait",
                 drafter: Drafter | None = None, owner: str | None = None) -> None:
        owner = owner or type(self).__name__
        self._owner = owner
        """The class a user built, named in messages (``VLLMWeightSync`` holds an engine; ``WeightSync`` is one)."""
        _validate_target(target, dtype, owner)
        mode, errors = parse_option(SyncLora, lora, "lora", owner), parse_option(OnError, on_error, "on_error", owner)
        check = None if verify is None else parse_option(Verify, verify, "verify", owner)
        _validate_checks(target, verify=check, verify_tolerance=verify_tolerance, lora=mode,
                         exact_first_sync=exact_first_sync, owner=owner)
        _validate_drafter(target, drafter, owner)
        busy = parse_option(WhenBusy, when_busy, "when_busy", owner)
        if busy is WhenBusy.SKIP and not target.pushes_in_background:
            raise ValueError(f"{owner}(when_busy='skip') skips a push while the previous one still travels, which"
                             f" only a target that pushes in the background does; {type(target).__name__} never does"
                             " (use RemoteVLLM(urls, transport=Gloo(shard_direct=True, background=True)), or drop"
                             " when_busy).")
        if name is not None and (not isinstance(name, str) or not name):
            raise ValueError(f"{owner}(name={name!r}) must be a non-empty string (it keys the sync's state in"
                             " checkpoints), or None for the target's own name.")
        self.target = target
        self._name = target.state_name if name is None else name
        self._lora = mode
        self._on_error = errors
        self._when_busy = busy
        self._drafter = drafter
        self.skipped = 0
        """Pushes skipped because the previous version was still travelling (``when_busy="skip"``)."""
        self._check_finite = bool(check_finite)
        self._timeout = _as_timedelta(timeout, owner)
        self._group: SyncGroup | None = None  # built with the target, when the run starts
        self._adapter_dir = Path(adapter_dir) if adapter_dir is not None else None
        self._adapter_dir_is_ours = False  # a temporary adapter directory, removed at the run's end
        self._base_pushed = False
        self._verify = check
        self._verify_tolerance = verify_tolerance
        self.last_verify_diff: float | None = None
        self._exact_pending = bool(exact_first_sync)
        self.last_exact_check: ExactCheck | None = None
        """What the exact check compared on this rank (``exact_first_sync=True``), once it ran."""
        self._dtype = dtype
        self.version = 0
        self._in_flight: int | None = None  # a version pushed in the background, not yet settled
        self._served: int | None = None  # see served_version
        self.last_synced_step = -1
        self.stale = True
        self._resumed = False
        self._target_ready = False
        self.last_metrics: dict[str, float] = {}

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
    def name(self) -> str:
        """The sync's name in checkpoints (``name=``, else the target's ``state_name``)."""
        return self._name

    @property
    def resumed(self) -> bool:
        """Whether the state came from a checkpoint: the next push is full."""
        return self._resumed

    @property
    def target_ready(self) -> bool:
        """Whether the target is set up for this run (the first push or the run's start did it)."""
        return self._target_ready

    @property
    def lora(self) -> SyncLora:
        """The mode: ``"merged"``, or ``"adapter"`` (the target serves the trained adapter, e.g. under
        ``RemoteVLLM.adapter_name``)."""
        return self._lora

    # -- the run's start and end ---------------------------------------------------------------------------

    def _start(self, run: SyncRun) -> None:
        """Every rank, before the first push: the target set up, the exact check's precondition, the phase listener."""
        strategy = _require_strategy(run.strategy, self._owner)
        strategy.export_module  # noqa: B018 - no or several models to export: fail before the first step
        if self._drafter is not None:  # no such module: fail before the first step too
            strategy.module_source(self._drafter.module, prefix=self._drafter.prefix)
        self._ensure_target(run, strategy)
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

    def _end(self, strategy: Any) -> None:
        """Every rank, at the run's end: the target torn down (a push in flight ends with it), temporary adapters
        removed; a later run (a resume) sets the target up again."""
        if isinstance(strategy, LazyExportCore):
            strategy.remove_phase_listener(self)
        if self._target_ready:
            self._in_flight = None  # the target's teardown ends it (a run that failed: not agreed on)
            self.target.teardown()
            self._target_ready = False
        if self._adapter_dir_is_ours and self._adapter_dir is not None:
            shutil.rmtree(self._adapter_dir, ignore_errors=True)  # the engines hold the loaded adapter in memory
            self._adapter_dir, self._adapter_dir_is_ours = None, False

    # -- a sync -------------------------------------------------------------------------------------------

    def _push(self, run: SyncRun) -> dict[str, float] | None:
        """Every rank: push the current weights as the next version; its metrics, or None when it failed and
        ``on_error="warn"`` (the target is then stale and the next sync pushes everything) or was skipped
        (``when_busy="skip"`` while the previous version still travels)."""
        strategy = _require_strategy(run.strategy, self._owner)
        self._ensure_target(run, strategy)
        if self._when_busy is WhenBusy.SKIP and self._in_flight is not None \
                and not all(self._ranks.gather(self.target.push_arrived())):  # every rank skips, or none
            self.skipped += 1
            return None
        self.settle()  # the push still in the background, if any (failed, with on_error="warn": this one is full)
        if isinstance(self.target, SendsPatches):  # a sparse sync patches only what every rank agreed is served
            self.target.confirm(None if self.stale else self.served_version)
        if self._resumed and not self._base_pushed:  # a resumed run's first push: past what the engine holds
            self._continue_past_held()
        self.version += 1
        if not self.target.serves_during_push:  # else the servers serve it until the push's swap
            self.served_version = None
        start = time.perf_counter()
        try:
            sources = self._sync(run, strategy)
        except WeightSyncError as err:
            self._failed(err)
            return None
        self.stale = False
        self._base_pushed = True
        if self.target.pushes_in_background:  # served once it arrived, as every rank agrees at the next settle()
            self._in_flight = self.version
        else:
            self.served_version = self.version
        self.last_synced_step = run.global_step
        self.last_metrics = _metrics(time.perf_counter() - start, sources, self.version)
        self.last_metrics.update(self.target.sync_metrics())
        if self._when_busy is WhenBusy.SKIP:
            self.last_metrics["weight_sync/skipped"] = float(self.skipped)
        return self.last_metrics

    def _continue_past_held(self) -> None:
        """Every rank: the versions go on past the highest one the target holds (``target.held_version()``, rank
        0's word): servers that outlived the run before a resume may hold versions the checkpoint never saw, and no
        two pushes may share a version (rollouts label tokens with it)."""
        held = self._ranks.gather(self.target.held_version() if self._ranks.rank == 0 else None)[0]
        if held is not None and held > self.version:
            rank_zero_info(f"{self._owner}: resumed at version {self.version} (the checkpoint's); the target holds"
                           f" version {held} from the run before the resume, so this push is version {held + 1}.")
            self.version = held

    def settle(self) -> bool:
        """Every rank: end the push in the background, if any (``target.pushes_in_background``), and agree on it: its
        version is served, or the sync failed (as a push's failures do). Runs before each push and at the run's end."""
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

    def _sync(self, run: SyncRun, strategy: LazyExportCore) -> list[ExportSource]:
        self.target.agree(self._ranks)  # (RemoteVLLM's pool: which servers serve, on every rank)
        pushes = plan_pushes(strategy, self.target, lora=self._lora, base_pushed=self._base_pushed,
                             dtype=self._dtype or self.target.dtype, version=self.version, rank=run.global_rank,
                             adapter_dir=self._adapter_root, show_progress=run.is_global_zero,
                             drafter=self._drafter)
        agree_before(self._ranks, self.version, [p.source for p in pushes], partial(refusals, self.target),
                     check_finite=self._check_finite)
        exact, self._exact_pending = self._exact_pending, False
        not_held = strategy.checkpoint_format.parts_not_held  # (a text model of the engine's VLM checkpoint)
        baseline, zeroed, mine = consume(pushes, self.target if exact else None,  # type: ignore[arg-type]
                                         part=bool(not_held))
        agree_after(self._ranks, self.version, mine, FAILED)
        if (exact or self._verify) and self.target.pushes_in_background:  # the checks read what arrived: wait for it
            agree_arrived(self._ranks, self.version, self.target)
        if exact:
            assert isinstance(self.target, ExactCheckable)
            self.last_exact_check, mine = exact_verdict(self.target, baseline, zeroed, not_held)
            agree_after(self._ranks, self.version, mine, EXACT_FAILED)
            check = self.last_exact_check
            kept = f", {check.kept} not the trainer's (reloaded from the checkpoint)" if check.kept else ""
            rank_zero_info(f"{self._owner} exact check passed: {check.compared} engine parameter(s) restored"
                           f" bit for bit, {check.not_comparable} not comparable (repacked by the engine){kept}.")
        if self._verify:
            assert isinstance(self.target, ScoresLogprobs)
            diff, mine = check_logprobs(strategy, self.target, self._verify_tolerance)
            self.last_verify_diff = diff if diff is not None else self.last_verify_diff
            agree_after(self._ranks, self.version, mine, "Weight sync of version {version} did not verify ({lines}).")
        return [p.source for p in pushes]

    def _ensure_target(self, run: SyncRun, strategy: LazyExportCore) -> None:
        if self._target_ready:
            return
        self.target.setup(run)
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

    # -- state ---------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The version and the last synced step (a resumed run's first push continues the versions)."""
        return {"version": self.version, "last_synced_step": self.last_synced_step, "stale": self.stale}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from a checkpoint's state: the next push is full (a new engine holds what it was built from)."""
        self.version = state_dict["version"]
        self.last_synced_step = state_dict["last_synced_step"]
        self.stale = True  # a restored run's engine holds whatever it was built from
        self._resumed = True
        self._base_pushed = False
        if self._exact_pending:  # the trainer resumes from trained weights, not the engine's checkpoint
            self._exact_pending = False
            rank_zero_info(f"{self._owner}(exact_first_sync=True): skipped in a resumed run (the trainer's"
                           " weights are no longer the engine's checkpoint); syncs are checked by verify='logprobs'"
                           " only.")


def _metrics(seconds: float, sources: list[ExportSource], version: int) -> dict[str, float]:
    """A sync's metrics: its seconds, the gigabytes and tensors its sources yielded (at full size), its version."""
    return {"weight_sync/seconds": seconds, "weight_sync/gigabytes": sum(s.pass_bytes() for s in sources) / 1e9,
            "weight_sync/tensors": float(sum(s.tensors for s in sources)), "weight_sync/version": float(version)}


def _require_strategy(strategy: Any, owner: str) -> LazyExportCore:
    if not isinstance(strategy, LazyExportCore):
        raise TypeError(
            f"{owner} needs the LazyExportFSDP2 strategy, but the run uses {type(strategy).__name__}. Use"
            " Trainer(strategy=lightning_fsdp_export.LazyExportFSDP2(...)), or"
            " Fabric(strategy=lightning_fsdp_export.fabric.LazyExportFSDP2(...))."
        )
    return strategy


def _validate_target(target: Any, dtype: Any, owner: str) -> None:
    if not isinstance(target, WeightTarget):
        raise TypeError(
            f"{owner}(target={target!r}) is not a weight target: subclass"
            " lightning_fsdp_export.targets.WeightTarget and write its push(), or use one of the targets there"
            " (e.g. ColocatedVLLM(model=PATH))."
        )
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"{owner}(dtype={dtype!r}) must be a torch.dtype such as torch.bfloat16, or None.")


def _validate_checks(target: WeightTarget, *, verify: Verify | None, verify_tolerance: float, lora: SyncLora,
                     exact_first_sync: bool, owner: str) -> None:
    if verify is not None and not isinstance(target, ScoresLogprobs):
        raise TypeError(f"{owner}(verify='logprobs') needs a target with prompt_logprobs() (a ScoresLogprobs);"
                        f" {type(target).__name__} has none (ColocatedVLLM and RemoteVLLM have).")
    if verify_tolerance <= 0:
        raise ValueError(f"{owner}(verify_tolerance={verify_tolerance}) must be positive.")
    if lora is SyncLora.ADAPTER and not isinstance(target, LoadsAdapters):
        raise TypeError(f"{owner}(lora='adapter') needs a target with push_adapter() (a LoadsAdapters);"
                        f" {type(target).__name__} has none (ColocatedVLLM built with enable_lora=True has).")
    if lora is SyncLora.ADAPTER and (why := target.cannot_load_adapters()):  # type: ignore[union-attr]
        raise ValueError(f"{owner}(lora='adapter') with {type(target).__name__}: {why}. Or use lora='merged'.")
    if exact_first_sync and not isinstance(target, ExactCheckable):
        raise TypeError(f"{owner}(exact_first_sync=True) needs a target with weight_checksums and"
                        f" reset_weights() (an ExactCheckable); {type(target).__name__} has none (ColocatedVLLM and"
                        " RemoteVLLM have).")


def _validate_drafter(target: WeightTarget, drafter: Any, owner: str) -> None:
    if drafter is None:
        return
    if not isinstance(drafter, Drafter):
        raise TypeError(f"{owner}(drafter={drafter!r}) must be a lightning_fsdp_export.sync.options.Drafter, e.g."
                        " Drafter('mtp', prefix='model.layers.46.'), or None.")
    if not isinstance(target, PushesDrafts):
        raise TypeError(f"{owner}(drafter=...) needs a target that loads a drafter into its engine's draft model (a"
                        f" PushesDrafts: ColocatedVLLM, RemoteVLLM over Gloo); {type(target).__name__} cannot.")
    if why := target.cannot_push_drafts():
        raise ValueError(f"{owner}(drafter=...) with {type(target).__name__}: {why}.")


def _as_timedelta(timeout: timedelta | float | None, owner: str) -> timedelta | None:
    given = timeout
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        timeout = timedelta(seconds=timeout)
    if timeout is not None and (not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0):
        raise ValueError(f"{owner}(timeout={given!r}) must be a positive timedelta or number of seconds.")
    return timeout
