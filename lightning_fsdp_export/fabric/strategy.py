"""``LazyExportFSDP2`` for Lightning Fabric: the Trainer strategy's preparation and export in a loop the user writes.

The same parts as the Trainer's :class:`lightning_fsdp_export.LazyExportFSDP2`
(:class:`~lightning_fsdp_export.strategy_core.LazyExportCore`); only the glue differs: Fabric hands the model over in
``setup_module`` (where the Trainer calls ``setup``), and a step's compute phase ends at ``optimizer.step()`` (Fabric
calls the strategy's ``optimizer_step``), where the Trainer has hooks.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal

from lightning.fabric.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.constants import default_pg_timeout
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.optim import Optimizer
from typing_extensions import Unpack, override

from lightning_fsdp_export._common import options_signature
from lightning_fsdp_export._fsdp import unsharded_class
from lightning_fsdp_export.phases.offload import move_optimizer_state
from lightning_fsdp_export.strategy_core import LazyExportArgs, LazyExportCore, LazyExportOptions

__all__ = ["LazyExportFSDP2"]


class LazyExportFSDP2(LazyExportCore, ModelParallelStrategy):
    """Fabric's FSDP2 (``fully_shard``) strategy with optional CPU offload and the lazy, per-tensor weight export.

    Example::

        fabric = Fabric(strategy=LazyExportFSDP2(pretrained="ckpt/"), devices=2)
        fabric.launch()
        with fabric.init_module(empty_init=True):  # meta: the shards are allocated and loaded from ckpt/ in setup
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained("ckpt/"))
        model = fabric.setup_module(model)  # sharded here when parallelize_fn is None
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters()))
        for name, tensor in fabric.strategy.export_weights(dtype=torch.bfloat16):  # on every rank
            ...

    The export (``export_weights()``, ``export_source()``, ``weight_source()``), the phases, the offload and the
    options (:class:`~lightning_fsdp_export.strategy_core.LazyExportArgs`, listed below) are the Trainer strategy's
    (:class:`lightning_fsdp_export.LazyExportFSDP2`); a
    step's compute phase runs from its first forward through a sharded module to the end of ``optimizer.step()``.
    One module per strategy is prepared and exported: the module given to ``fabric.setup_module`` (or
    ``fabric.setup``), or the model ``export_module=`` names inside it.

    Args:
        parallelize_fn: Fabric's ``(module, device_mesh) -> module`` applying your own ``fully_shard`` (and tensor
            parallelism on ``device_mesh["tensor_parallel"]``). Default ``None``: the strategy shards the model as
            the Trainer's does (``shard_modules``, then the root).
        data_parallel_size: ranks to shard over. Default: the world divided by ``tensor_parallel_size`` (pure FSDP;
            Fabric's own ``ModelParallelStrategy`` defaults to the number of nodes).
        tensor_parallel_size: tensor-parallel ranks, applied by your ``parallelize_fn``. Default 1.
        save_distributed_checkpoint: as in ``ModelParallelStrategy``.
        process_group_backend: as in ``ModelParallelStrategy`` (``"gloo"`` on CPU, ``"nccl"`` on CUDA).
        timeout: as in ``ModelParallelStrategy``; also bounds every collective of an export.
    """

    @options_signature(LazyExportArgs, LazyExportOptions)
    def __init__(self, *, parallelize_fn: Callable[[nn.Module, DeviceMesh], nn.Module] | None = None,
                 data_parallel_size: Literal["auto"] | int = "auto", tensor_parallel_size: int = 1,
                 save_distributed_checkpoint: bool = True, process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout, **options: Unpack[LazyExportArgs]) -> None:
        if parallelize_fn is not None and not callable(parallelize_fn):
            raise TypeError(f"LazyExportFSDP2(parallelize_fn={parallelize_fn!r}) must be a function (module,"
                            " device_mesh) -> module, or None to let the strategy shard the model.")
        super().__init__(parallelize_fn=parallelize_fn or _as_given, data_parallel_size=data_parallel_size,
                         tensor_parallel_size=tensor_parallel_size,
                         save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout)
        self._module: nn.Module | None = None
        self._optimizers: list[Optimizer] = []
        self._build_parts(LazyExportOptions.of(options, type(self).__name__), tensor_parallel_size=tensor_parallel_size,
                          model=lambda: self._module, optimizers=lambda: self._optimizers)

    @override
    def setup_environment(self) -> None:
        self._before_process_group()
        super().setup_environment()

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        """Your ``parallelize_fn`` (if any), then the Trainer strategy's preparation: shard what is not sharded,
        allocate meta tensors, load ``pretrained=`` into the shards, init the rest, move plain tensors."""
        if self._module is not None:
            raise ValueError(f"{type(self).__name__} prepares and exports one module, and already holds"
                             f" {unsharded_class(self._module).__name__}. Put the other models (a reference model, a"
                             " critic) inside one module with the policy, set that up once, and name the exported one:"
                             " LazyExportFSDP2(export_module='policy'); the loop may call each model directly.")
        if any(isinstance(m, FullyShardedDataParallel) for m in module.modules()):  # before any use of the mesh
            raise TypeError(f"{type(self).__name__} only supports the new FSDP2 APIs in PyTorch >= 2.4 (`fully_shard`),"
                            " but modules wrapped with FSDP1 `FullyShardedDataParallel` were found. Apply `fully_shard`"
                            " in your parallelize_fn instead, or leave the sharding to the strategy.")
        parallelize: Any = self._parallelize_fn  # (Lightning types it over its class's TypeVar, unbound here)
        module = parallelize(module, self.device_mesh)
        if not isinstance(module, nn.Module):
            raise TypeError("LazyExportFSDP2(parallelize_fn=...) must return the nn.Module, got"
                            f" {type(module).__name__}.")
        self._module = module
        self._prepare(module, module, called=True)
        self._place(module, lambda: module.to(self.root_device))
        self.barrier()
        self._phases.start_run()  # the loop starts in the rollout phase
        return module

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        move_optimizer_state(optimizer, None)  # next to each parameter, wherever it lives
        self._optimizers.append(optimizer)
        return super().setup_optimizer(optimizer)

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        self._phases.enter()  # a step that ran no sharded forward still steps on the device
        output = super().optimizer_step(optimizer, **kwargs)
        self._phases.leave()  # the step's compute phase ends: listeners wake, offload="params" moves the shards
        return output

    @override
    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Fabric's ``load_checkpoint``, and every object of ``state`` with ``load_state_dict`` (a ``WeightSync``, an
        ``AsyncRollouts``) restored in place from a distributed checkpoint too: Lightning's own sharded path puts the
        saved dict in its place instead (its single-file path calls ``load_state_dict``)."""
        stateful = {key: obj for key, obj in state.items() if _restores_itself(obj)} if isinstance(state, dict) else {}
        remainder = super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        for key, obj in stateful.items():
            if key in state and state[key] is not obj:
                obj.load_state_dict(state[key])
                state[key] = obj
        return remainder

    @override
    def teardown(self) -> None:
        self._phases.leave()
        super().teardown()


def _restores_itself(obj: Any) -> bool:
    return not isinstance(obj, (nn.Module, Optimizer)) and callable(getattr(obj, "state_dict", None)) \
        and callable(getattr(obj, "load_state_dict", None))


def _as_given(module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
    """No ``parallelize_fn``: the strategy's preparation shards the module."""
    return module
