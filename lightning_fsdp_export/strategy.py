"""``LazyExportFSDP2``: Lightning's FSDP2 strategy that owns a lazy, collective weight export.

The Lightning glue (options, the set-up order, the Trainer's hooks) over the parts that
:class:`~lightning_fsdp_export.strategy_core.LazyExportCore` builds and exposes (``docs/architecture.md``); Fabric's
strategy (:mod:`lightning_fsdp_export.fabric`) is the same glue for a loop the user writes.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.constants import default_pg_timeout
from typing_extensions import Unpack, override

from lightning_fsdp_export._common import options_signature
from lightning_fsdp_export.phases.compute import PhaseListener
from lightning_fsdp_export.phases.offload import move_optimizer_state
from lightning_fsdp_export.strategy_core import LazyExportArgs, LazyExportCore, LazyExportOptions

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

    Beside Lightning's own keywords it takes the options both strategies take
    (:class:`~lightning_fsdp_export.strategy_core.LazyExportArgs`: keywords declared once, for this class and
    Fabric's), listed below after Lightning's.

    Args:
        data_parallel_size: ranks to shard over. Default: the whole world (pure FSDP).
        tensor_parallel_size: tensor-parallel ranks, applied by your own ``configure_model``. Default 1.
        save_distributed_checkpoint: as in ``ModelParallelStrategy``.
        process_group_backend: as in ``ModelParallelStrategy`` (``"gloo"`` on CPU, ``"nccl"`` on CUDA).
        timeout: as in ``ModelParallelStrategy``; also bounds every collective of an export.
    """

    @options_signature(LazyExportArgs, LazyExportOptions)
    def __init__(self, *, data_parallel_size: Literal["auto"] | int = "auto", tensor_parallel_size: int = 1,
                 save_distributed_checkpoint: bool = True, process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout, **options: Unpack[LazyExportArgs]) -> None:
        super().__init__(data_parallel_size=data_parallel_size, tensor_parallel_size=tensor_parallel_size,
                         save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout)
        self._build_parts(LazyExportOptions.of(options, type(self).__name__), tensor_parallel_size=tensor_parallel_size,
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
