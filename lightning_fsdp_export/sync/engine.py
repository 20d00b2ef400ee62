"""The sync engine: a sync's path through the rooms, whoever decides when it runs (``docs/architecture.md``).

A sync reads: the ranks agree on the sources' metadata -> the target consumes the sources -> verify -> report. The
sources come from the strategy (:mod:`~lightning_fsdp_export.sync.pushes` chooses their kinds once), the agreement
from :mod:`~lightning_fsdp_export.sync.agreement`, the checks from :mod:`~lightning_fsdp_export.sync.verify` and
:mod:`~lightning_fsdp_export.sync.exact`. Two adapters decide when: the Trainer's callback
(:class:`~lightning_fsdp_export.sync.callback.VLLMWeightSync`) and the loop's own calls
(:class:`~lightning_fsdp_export.fabric.WeightSync`).
"""

from __future__ import annotations

import shutil
import time
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_fsdp_export._common import EngineNotRestored, SyncGroup, WeightSyncError
from lightning_fsdp_export.export.source import ExportSource
from lightning_fsdp_export.strategy_core import LazyExportCore
from lightning_fsdp_export.sync.agreement import FAILED, agree_after, agree_arrived, agree_before
from lightning_fsdp_export.sync.exact import (
    EXACT_FAILED,
    ExactCheck,
    check_precondition,
    exact_verdict,
    restore_after_failure,
)
from lightning_fsdp_export.sync.options import OnError, SyncLora, SyncOptions, WhenBusy
from lightning_fsdp_export.sync.pushes import Push, consume, plan_pushes, refusals, temporary_adapter_dir
from lightning_fsdp_export.sync.verify import check_logprobs
from lightning_fsdp_export.targets.base import (
    ExactCheckable,
    LoadsAdapters,
    PushesDrafts,
    ScoresLogprobs,
    SendsPatches,
    SleepsDuringCompute,
    SyncRun,
    WeightTarget,
)

__all__ = ["SyncEngine", "SyncRun"]  # (SyncRun: what a target's setup reads too, declared beside WeightTarget)


class SyncEngine:
    """A weight sync's state and path, for every rank: :meth:`start` once a run has its ranks, :meth:`push` for each
    version, :meth:`end` when the run ends. The Trainer's ``VLLMWeightSync`` and Fabric's ``WeightSync`` each hold one
    (``sync.engine``) and decide when it pushes.

    Args:
        target: where the weights go.
        options: what a sync does (:class:`~lightning_fsdp_export.sync.options.SyncOptions`; documented for users on
            ``VLLMWeightSync``); checked against ``target`` here.
        owner: the class the user built, named in errors.
    """

    def __init__(self, target: WeightTarget, options: SyncOptions | None = None, *, owner: str | None = None) -> None:
        owner = owner or type(self).__name__
        self._owner = owner
        """The class a user built, named in messages (``VLLMWeightSync`` or ``WeightSync``, each holding an engine)."""
        self.options = options if options is not None else SyncOptions(owner=owner)
        """What this sync does (each field parsed once); ``VLLMWeightSync`` and ``WeightSync`` document them."""
        _validate_target(target, self.options, owner)
        self.target = target
        self._name = target.state_name if self.options.name is None else self.options.name
        self.skipped = 0
        """Pushes skipped because the previous version was still travelling (``when_busy="skip"``)."""
        self._group: SyncGroup | None = None  # built with the target, when the run starts
        self._adapter_dir = None if self.options.adapter_dir is None else Path(self.options.adapter_dir)
        self._adapter_dir_is_ours = False  # a temporary adapter directory, removed at the run's end
        self._base_pushed = False
        self.last_verify_diff: float | None = None
        self._exact_pending = bool(self.options.exact_first_sync)
        self.last_exact_check: ExactCheck | None = None
        """What the exact check compared on this rank (``exact_first_sync=True``), once it ran."""
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
    def exact_pending(self) -> bool:
        """Whether the exact check (``exact_first_sync=True``) still waits for its push."""
        return self._exact_pending

    @property
    def target_ready(self) -> bool:
        """Whether the target is set up for this run (the first push or the run's start did it)."""
        return self._target_ready

    @property
    def lora(self) -> SyncLora:
        """The mode: ``"merged"``, or ``"adapter"`` (the target serves the trained adapter, e.g. under
        ``RemoteVLLM.adapter_name``)."""
        return self.options.lora

    # -- the run's start and end ---------------------------------------------------------------------------

    def start(self, run: SyncRun) -> None:
        """Every rank, before the first push: the target set up, the exact check's precondition, the phase listener."""
        strategy = _require_strategy(run.strategy, self._owner)
        strategy.export_module  # noqa: B018 - no or several models to export: fail before the first step
        if self.options.drafter is not None:  # no such module: fail before the first step too
            strategy.module_source(self.options.drafter.module, prefix=self.options.drafter.prefix)
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

    def end(self, strategy: Any) -> None:
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

    def push(self, run: SyncRun) -> dict[str, float] | None:
        """Every rank: push the current weights as the next version; its metrics, or None when it failed and
        ``on_error="warn"`` (the target is then stale and the next sync pushes everything) or was skipped
        (``when_busy="skip"`` while the previous version still travels)."""
        strategy = _require_strategy(run.strategy, self._owner)
        self._ensure_target(run, strategy)
        if self.options.when_busy is WhenBusy.SKIP and self._in_flight is not None \
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
        if self.options.when_busy is WhenBusy.SKIP:
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
        if self.options.on_error is OnError.RAISE or isinstance(err, EngineNotRestored):
            raise err
        rank_zero_warn(f"{err} Training goes on (on_error='warn'); the next sync pushes every tensor again.")

    def _sync(self, run: SyncRun, strategy: LazyExportCore) -> list[ExportSource]:
        while True:  # (a push redone without the servers that failed it: each try sets at least one aside)
            self.target.agree(self._ranks)  # (RemoteVLLM's pool: which servers serve, on every rank)
            pushes = plan_pushes(strategy, self.target, lora=self.lora, base_pushed=self._base_pushed,
                                 dtype=self.options.dtype or self.target.dtype, version=self.version,
                                 rank=run.global_rank, adapter_dir=self._adapter_root,
                                 show_progress=run.is_global_zero, drafter=self.options.drafter)
            agree_before(self._ranks, self.version, [p.source for p in pushes], partial(refusals, self.target),
                         check_finite=self.options.check_finite)
            exact, self._exact_pending = self._exact_pending, False
            if exact:
                self._exact_sync(strategy, pushes)
                break
            _, _, mine = consume(pushes, None)
            try:
                agree_after(self._ranks, self.version, mine, FAILED)
            except WeightSyncError as err:
                if not self.target.redo_without_failed(self._ranks):
                    raise
                rank_zero_warn(f"{err} The servers that went silent are set aside; version {self.version} is pushed"
                               " again, now, to the others.")
                continue
            if self.options.verify and self.target.pushes_in_background:  # verify reads what arrived
                agree_arrived(self._ranks, self.version, self.target)
            break
        if self.options.verify:
            assert isinstance(self.target, ScoresLogprobs)
            diff, mine = check_logprobs(strategy, self.target, self.options.verify_tolerance)
            self.last_verify_diff = diff if diff is not None else self.last_verify_diff
            agree_after(self._ranks, self.version, mine, "Weight sync of version {version} did not verify ({lines}).")
        return [p.source for p in pushes]

    def _exact_sync(self, strategy: LazyExportCore, pushes: list[Push]) -> None:
        """Every rank, the first sync with ``exact_first_sync=True``: checksums, zero, push, compare (sync/exact.py).
        A check that fails leaves no engine zeroed: each reloads its checkpoint (or the error says it could not)."""
        target = self.target
        assert isinstance(target, ExactCheckable)
        not_held = strategy.checkpoint_format.parts_not_held  # (a text model of the engine's VLM checkpoint)
        baseline: dict[str, dict[str, str]] = {}
        try:
            baseline, zeroed, mine = consume(pushes, target, part=bool(not_held))
            agree_after(self._ranks, self.version, mine, FAILED)
            if target.pushes_in_background:  # the check reads what arrived
                agree_arrived(self._ranks, self.version, target)
            self.last_exact_check, mine = exact_verdict(target, baseline, zeroed, not_held)
            agree_after(self._ranks, self.version, mine, EXACT_FAILED)
        except WeightSyncError as failure:
            raise restore_after_failure(self._ranks, target, baseline, failure) from failure
        check = self.last_exact_check
        assert check is not None
        kept = f", {check.kept} not the trainer's (reloaded from the checkpoint)" if check.kept else ""
        rank_zero_info(f"{self._owner} exact check passed: {check.compared} engine parameter(s) restored"
                       f" bit for bit, {check.not_comparable} not comparable (repacked by the engine){kept}.")

    def _ensure_target(self, run: SyncRun, strategy: LazyExportCore) -> None:
        if self._target_ready:
            return
        self.target.setup(run)
        self._group = SyncGroup(self.options.timeout or strategy.collective_timeout or timedelta(minutes=30))
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


def _validate_target(target: Any, options: SyncOptions, owner: str) -> None:
    """Refuse a target that is not one, or an option it cannot serve (each named, with the fix)."""
    if not isinstance(target, WeightTarget):
        raise TypeError(
            f"{owner}(target={target!r}) is not a weight target: subclass"
            " lightning_fsdp_export.targets.WeightTarget and write its push(), or use one of the targets there"
            " (e.g. ColocatedVLLM(model=PATH))."
        )
    name = type(target).__name__
    if options.verify is not None and not isinstance(target, ScoresLogprobs):
        raise TypeError(f"{owner}(verify='logprobs') needs a target with prompt_logprobs() (a ScoresLogprobs);"
                        f" {name} has none (ColocatedVLLM and RemoteVLLM have).")
    if options.lora is SyncLora.ADAPTER:
        if not isinstance(target, LoadsAdapters):
            raise TypeError(f"{owner}(lora='adapter') needs a target with push_adapter() (a LoadsAdapters);"
                            f" {name} has none (ColocatedVLLM built with enable_lora=True has).")
        if why := target.cannot_load_adapters():
            raise ValueError(f"{owner}(lora='adapter') with {name}: {why}. Or use lora='merged'.")
    if options.exact_first_sync and not isinstance(target, ExactCheckable):
        raise TypeError(f"{owner}(exact_first_sync=True) needs a target with weight_checksums and"
                        f" reset_weights() (an ExactCheckable); {name} has none (ColocatedVLLM and"
                        " RemoteVLLM have).")
    if options.drafter is not None:
        if not isinstance(target, PushesDrafts):
            raise TypeError(f"{owner}(drafter=...) needs a target that loads a drafter into its engine's draft model"
                            f" (a PushesDrafts: ColocatedVLLM, RemoteVLLM over Gloo); {name} cannot.")
        if why := target.cannot_push_drafts():
            raise ValueError(f"{owner}(drafter=...) with {name}: {why}.")
    if options.when_busy is WhenBusy.SKIP and not target.pushes_in_background:
        raise ValueError(f"{owner}(when_busy='skip') skips a push while the previous one still travels, which"
                         f" only a target that pushes in the background does; {name} never does"
                         " (use RemoteVLLM(urls, transport=Gloo(shard_direct=True, background=True)), or drop"
                         " when_busy).")
