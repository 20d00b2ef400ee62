"""``LazyExportFSDP2``: Lightning's FSDP2 strategy that owns a lazy, collective weight export.

The Lightning glue (options, the set-up order, the Trainer's hooks) over the parts that
:class:`~lightning_fsdp_export.strategy_core.LazyExportCore` builds and exposes (``docs/architecture.md``); Fabric's
strategy (:mod:`lightning_fsdp_export.fabric`) is the same glue for a loop the user writes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.distributed.constants import default_pg_timeout
from torch.distributed.fsdp import MixedPrecisionPolicy
from typing_extensions import override

from lightning_fsdp_export.export.lazy import DEFAULT_BUCKET_BYTES, DEFAULT_PREFETCH
from lightning_fsdp_export.phases.compute import PhaseListener
from lightning_fsdp_export.phases.offload import move_optimizer_state
from lightning_fsdp_export.strategy_core import LazyExportCore, LazyExportOptions

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["LazyExportFSDP2", "PhaseListener"]


class LazyExportFSDP2(LazyExportCore, ModelParallelStrategy):
    """FSDP2 (``fully_shard``) with optional CPU offload and a lazy, per-tensor weight export.

    Example::

        trainer = Trainer(strategy=LazyExportFSDP2(offload="params"), callbacks=[VLLMWeightSync(...)])
        for name, tensor in trainer.strategy.export_weights(dtype=torch.bfloat16):  # on every rank
            ...

    Unlike :class:`~lightning.pytorch.strategies.ModelParallelStrategy`, the LightningModule need not
    override ``configure_model``: a model that ``configure_model`` did not shard is sharded here.

    Args:
        shard_modules: classes (or class names) whose instances are ``fully_shard``-ed one by one
            before the root. Default: every Hugging Face model's ``_no_split_modules`` (for Qwen2,
            ``Qwen2DecoderLayer``). Ignored when ``configure_model`` applied ``fully_shard`` itself.
        export_module: dotted name of the submodule of the LightningModule that ``export_weights``
            exports (say ``"policy"``). Default: the single ``transformers.PreTrainedModel`` (or peft
            model) found inside it. Any LightningModule trains; with none or several candidates,
            ``export_weights()`` (and a sync) raises and lists them.
        pretrained: a ``save_pretrained`` directory (safetensors) loaded into the exported model's shards
            right after sharding, each rank reading only its slices, cast to the model's dtype; under
            ``trainer.init_module(empty_init=True)`` nothing it holds is randomly initialised first (peft
            adapters keep their init). ``{"policy": dir, "reference": dir}`` loads submodules by name.
        mixed_precision: FSDP2's ``MixedPrecisionPolicy`` for the automatic sharding.
        reshard_after_forward: FSDP2's ``reshard_after_forward`` for the automatic sharding.
        offload: ``None`` keeps shards on the device; ``"params"`` moves sharded parameters to the host (a
            pinned buffer per shard, reused, on CUDA) outside each step's compute phase (its first forward through
            a sharded module to the optimizer step; :meth:`add_phase_listener`) and back for it. ``"policy"`` uses
            FSDP2's ``CPUOffloadPolicy`` (shards always on the host, gathered to the device per layer).
        offload_optimizer: with ``offload="params"``, move the optimizer state along with the parameters.
        export_bucket_bytes: the most bytes (full tensors, after the cast) one all-gather moves: consecutive
            shards of one decoder layer share a gather, a larger tensor is gathered in row blocks of it
            (bit-identical either way; bounds the export's transient memory). 0 (default): each tensor alone.
        export_prefetch: all-gathers kept in flight (``async_op=True``) while the consumer takes the current
            tensor (each costs one more tensor of memory). Default 1; 0: none. Measured: BENCHMARKS.md.
        data_parallel_size: ranks to shard over. Default: the whole world (pure FSDP).
        tensor_parallel_size: tensor-parallel ranks, applied by your own ``configure_model``. Default 1.
        save_distributed_checkpoint: as in ``ModelParallelStrategy``.
        process_group_backend: as in ``ModelParallelStrategy`` (``"gloo"`` on CPU, ``"nccl"`` on CUDA).
        timeout: as in ``ModelParallelStrategy``; also bounds every collective of an export.
    """

    def __init__(self, *, shard_modules: Sequence[type[nn.Module] | str] | None = None,
                 export_module: str | None = None,
                 pretrained: str | os.PathLike[str] | Mapping[str, str | os.PathLike[str]] | None = None,
                 mixed_precision: MixedPrecisionPolicy | None = None, reshard_after_forward: bool = True,
                 offload: Literal["params", "policy"] | None = None, offload_optimizer: bool = False,
                 export_bucket_bytes: int = DEFAULT_BUCKET_BYTES, export_prefetch: int = DEFAULT_PREFETCH,
                 data_parallel_size: Literal["auto"] | int = "auto", tensor_parallel_size: int = 1,
                 save_distributed_checkpoint: bool = True, process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout) -> None:
        super().__init__(data_parallel_size=data_parallel_size, tensor_parallel_size=tensor_parallel_size,
                         save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout)
        self._build_parts(LazyExportOptions.of(locals()), tensor_parallel_size=tensor_parallel_size,
                          model=lambda: self.model, optimizers=lambda: self.optimizers)

    # -- the set-up order ----------------------------------------------------------------------------

    @override
    def setup_environment(self) -> None:
        self._before_process_group()
        super().setup_environment()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None and self.accelerator is not None and self.lightning_module is not None
        self.accelerator.setup(trainer)
        self._prepare(self.model, self.lightning_module)  # shard, allocate, load, init; hook the first forward
        self.model = self.precision_plugin.convert_module(self.model)
        self._place(self.model, self.model_to_device)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            for optimizer in self.optimizers:
                move_optimizer_state(optimizer, None)  # next to each parameter, wherever it lives
        self._phases.start_run()  # a new run starts in the rollout phase (even after a validate/predict)

    # -- Lightning hooks: where phases start and end ----------------------------------------------------

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # Accumulating gradients: the previous micro-batch ran no optimizer step. Give the device back
        # before this batch's rollouts (one more offload/load round per micro-batch).
        self._phases.leave()
        super().on_train_batch_start(batch, batch_idx)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().training_step(*args, **kwargs)
        assert self.lightning_module is not None  # (a step runs with its module)
        if not self.lightning_module.automatic_optimization:  # manual: the step ran inside training_step
            self._phases.leave()
        return output

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], *args: Any, **kwargs: Any) -> Any:
        def step_closure() -> Any:  # the closure runs training_step: rollouts first, so load only after it
            output = closure()
            self._phases.enter()  # a training_step that ran no sharded forward still steps on the device
            return output

        output = super().optimizer_step(optimizer, step_closure, *args, **kwargs)
        assert self.lightning_module is not None
        if self.lightning_module.automatic_optimization:
            self._phases.leave()
        return output

    @override
    def on_train_end(self) -> None:
        self._phases.leave()
        super().on_train_end()

    @override
    def on_validation_start(self) -> None:
        self._phases.enter()
        super().on_validation_start()

    @override
    def on_validation_end(self) -> None:
        super().on_validation_end()
        assert self.lightning_module is not None
        if self.lightning_module.trainer.state.fn == TrainerFn.FITTING:
            self._phases.leave()

    @override
    def on_test_start(self) -> None:
        self._phases.load()
        super().on_test_start()

    @override
    def on_predict_start(self) -> None:
        self._phases.load()
        super().on_predict_start()
