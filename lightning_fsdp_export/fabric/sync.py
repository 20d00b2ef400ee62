"""``WeightSync``: the sync engine a Fabric loop calls, where the Trainer has ``VLLMWeightSync``'s hooks."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning.fabric import Fabric
from typing_extensions import Unpack

from lightning_fsdp_export._common import options_signature
from lightning_fsdp_export.sync.engine import SyncEngine
from lightning_fsdp_export.sync.holder import HoldsSyncEngine
from lightning_fsdp_export.sync.options import SyncArgs, SyncOptions

if TYPE_CHECKING:
    from lightning_fsdp_export.targets.base import WeightTarget

__all__ = ["FabricRun", "WeightSync"]


class FabricRun:
    """What a sync and its target read of a Fabric loop (a :class:`~lightning_fsdp_export.sync.engine.SyncRun`):
    the ranks and the strategy from ``fabric``, the step from the loop's last ``push(step=...)``."""

    accumulate_grad_batches = 1  # a loop accumulates gradients itself: every push follows an optimizer step

    def __init__(self, fabric: Fabric) -> None:
        self.fabric = fabric
        self.strategy = fabric.strategy
        self.global_rank, self.local_rank = fabric.global_rank, fabric.local_rank
        self.world_size, self.is_global_zero = fabric.world_size, fabric.is_global_zero
        self.global_step = 0


class WeightSync(HoldsSyncEngine):
    """Push the trainer's weights into a vLLM target from a loop you write with Lightning Fabric.

    Example::

        fabric = Fabric(strategy=LazyExportFSDP2(pretrained="ckpt/"), devices=2)
        ...  # fabric.launch(), model = fabric.setup_module(model), optimizer = fabric.setup_optimizers(...)
        sync = WeightSync(RemoteVLLM(urls, transport=Gloo()), verify="logprobs")
        sync.setup(fabric)  # every rank
        sync.push(fabric)  # the servers start from the trainer's weights
        for step in range(1, steps + 1):
            ...  # rollouts, loss, fabric.backward(loss), optimizer.step(), optimizer.zero_grad()
            sync.push(fabric, step=step)  # every rank, after the optimizer step
        fabric.save("ckpt.pt", {"model": model, "optimizer": optimizer, "sync": sync})
        sync.teardown()

    The engine of :class:`~lightning_fsdp_export.VLLMWeightSync` (held the same way: ``sync.engine``) without its
    Trainer hooks: the same targets and transports, LoRA modes, checks (the ranks' agreement, ``exact_first_sync``,
    ``verify``), errors and metrics; every option is documented there (the triggers aside: the loop pushes).
    ``push()`` returns the metrics and logs them with ``fabric.log_dict`` (to Fabric's loggers, if any). Its state
    goes into ``fabric.save`` and back with ``fabric.load``: a resumed loop's next push is version ``N + 1`` and full
    (a new server holds its checkpoint). ``exact_first_sync=True`` checks the first push, which must come before the
    first optimizer step.
    """

    @options_signature(SyncArgs, SyncOptions)
    def __init__(self, target: WeightTarget, **options: Unpack[SyncArgs]) -> None:
        self.engine = SyncEngine(target, SyncOptions.of(options, "WeightSync"), owner="WeightSync")
        self._run: FabricRun | None = None

    def setup(self, fabric: Fabric) -> None:
        """Every rank, after ``fabric.setup_module(model)``: set the target up (build an engine, reach the servers),
        check the exact check's precondition, sleep a colocated engine during the steps' compute phases."""
        if not isinstance(fabric, Fabric):
            raise TypeError("WeightSync.setup(fabric) takes the loop's lightning.fabric.Fabric, got"
                            f" {type(fabric).__name__}.")
        if self._run is not None and self._run.fabric is fabric:
            return
        self._run = FabricRun(fabric)
        self.engine.start(self._run)

    def push(self, fabric: Fabric, *, step: int | None = None) -> dict[str, float] | None:
        """Every rank: push the current weights as the next version (``self.version + 1``); a collective.

        Args:
            fabric: the loop's ``Fabric`` (set up on the first call if :meth:`setup` was not called).
            step: the loop's step, for the metrics and ``last_synced_step``; default: the new version.

        Returns:
            The sync's metrics (``weight_sync/{seconds,gigabytes,tensors,version}``), or ``None`` when it failed
            with ``on_error="warn"`` (the next push is full).

        Raises:
            WeightSyncError: on every rank, when the sync failed (``on_error="raise"``), naming the ranks or servers.
            EngineNotRestored: on every rank, whatever ``on_error`` says, when an exact check failed and the engine
                could not be reloaded from its checkpoint (it may serve zeroed parameters).
        """
        self.setup(fabric)
        assert self._run is not None
        if self.engine.exact_pending and any(opt.state for opt in getattr(fabric.strategy, "_optimizers", ())):
            raise ValueError("WeightSync(exact_first_sync=True) checks the first push against the engine's checkpoint:"
                             " push once before the first optimizer step (or drop exact_first_sync).")
        self._run.global_step = self.version + 1 if step is None else step
        metrics = self.engine.push(self._run)
        if metrics is not None:
            fabric.log_dict(metrics, step=self._run.global_step)
        return metrics

    def teardown(self) -> None:
        """Every rank, when the loop ends: wait for a push still in the background (its failure raises as a push's
        would), then tear the target down (stop colocated engines, close the servers' transfer groups)."""
        if self._run is None:
            return
        try:
            if self.engine.target_ready:
                self.settle()
        finally:
            self.engine.end(self._run.strategy)
            self._run = None
