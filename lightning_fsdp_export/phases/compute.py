"""The compute phases of a run: when the trainer holds the device, and where the shards are meanwhile.

A training step's *compute phase* starts at its first forward through a sharded module (a
``prepend=True`` pre-forward hook on every top-level FSDP module, before FSDP2 gathers) and ends after
the optimizer step; validation is one too. Between two compute phases is the *rollout phase*. This
module owns that state machine:

- the listeners (``before_compute`` / ``after_compute``: a colocated engine sleeps through the phase);
- ``offload="params"``: the sharded parameters (and, with ``offload_optimizer``, the optimizer state)
  move to the host at the end of every compute phase and back at its start, through a pinned host
  pool on CUDA (one buffer per shard, reused);
- "load the shards for me" (:meth:`ComputePhases.stage`, :meth:`ComputePhases.on_device`) for work
  that needs them on the device without starting a phase (the staged LoRA export, verify's forward).

It knows nothing of vLLM or of the export; the strategy calls it from its Lightning hooks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from lightning_fsdp_export.phases.offload import HostPool, OffloadMode, move_module, move_optimizer_state

__all__ = ["ComputePhases", "PhaseListener"]


class PhaseListener(Protocol):
    """What :meth:`LazyExportFSDP2.add_phase_listener` calls (``VLLMWeightSync`` is one)."""

    def before_compute(self) -> None:
        """The trainer is about to take the device: load shards, forward, backward, optimizer step."""

    def after_compute(self) -> None:
        """The trainer gave the device back (shards offloaded with ``offload="params"``)."""


class ComputePhases:
    """The rollout/compute state of one strategy, its shard moves and its listeners.

    Args:
        mode: the strategy's ``offload`` mode (only ``PARAMS`` moves anything here).
        offload_optimizer: move the optimizer state with the parameters.
        model: the wrapped model, once the strategy set it up.
        device: the device computing happens on (the strategy's ``root_device``).
        optimizers: the strategy's optimizers.
    """

    def __init__(self, mode: OffloadMode, *, offload_optimizer: bool, model: Callable[[], nn.Module | None],
                 device: Callable[[], torch.device], optimizers: Callable[[], Sequence[Any]]) -> None:
        self.mode = mode
        self._offload_optimizer = offload_optimizer
        self._model = model
        self._device = device
        self._optimizers = optimizers
        self.offloaded = False
        self.pool: HostPool | None = None  # offload="params" on CUDA: pinned host buffers reused every step
        self.in_compute = False
        self._quiet = 0  # > 0 while work that is no compute phase runs a forward (verify)
        self.listeners: list[PhaseListener] = []
        self.moves = 0
        """Model-wide moves made by ``offload="params"`` around training steps (host and back count 1 each)."""

    # -- shards: on the host outside the compute phase -------------------------------------------------

    def offload(self) -> None:
        """Sharded parameters to the host (``offload="params"``); a no-op otherwise or when already there."""
        if self.mode is not OffloadMode.PARAMS or self.offloaded:
            return
        self.move(torch.device("cpu"))
        self.offloaded = True

    def load(self) -> None:
        """Offloaded parameters back to the device."""
        if not self.offloaded:
            return
        self.move(self._device())
        self.offloaded = False

    def move(self, device: torch.device) -> None:
        """One model-wide move of the shards (and optimizer state) to ``device``."""
        model = self._model()
        assert model is not None
        if self.pool is None and self._device().type == "cuda":
            self.pool = HostPool(pin=True)
        if self.pool is not None and device.type == "cpu":
            self.pool.offload(model)
        elif self.pool is not None:
            self.pool.load(model, device)
        else:
            move_module(model, device, pin_memory=device.type == "cpu")
        if self._offload_optimizer:
            for optimizer in self._optimizers():
                move_optimizer_state(optimizer, device)
        self.moves += 1

    def stage(self) -> bool:
        """Bring offloaded shards to the device for a staged export; whether anything moved."""
        if not self.offloaded:
            return False
        self.load()
        return True

    @contextmanager
    def on_device(self) -> Iterator[None]:
        """Within the block the shards are on the device (and go back after); a forward in it starts no phase."""
        was_offloaded = self.offloaded
        self.load()
        self._quiet += 1
        try:
            yield
        finally:
            self._quiet -= 1
            if was_offloaded:
                self.offload()

    # -- phases ----------------------------------------------------------------------------------------

    def hook_first_forward(self, model: nn.Module) -> None:
        """A ``prepend=True`` pre-forward hook on every FSDP module: it runs before FSDP2's own (which gathers the
        parameters), so the shards are back on the device before any gather, whichever module the loop calls first
        (Fabric's module, or a model inside it: a policy and a reference model side by side)."""
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.register_forward_pre_hook(self._on_forward, prepend=True)

    def _on_forward(self, module: nn.Module, args: Any) -> None:
        if not self._quiet:
            self.enter()

    def enter(self) -> None:
        """The one place that loads shards for computing: listeners first (an engine goes to sleep)."""
        if self.in_compute:
            return
        for listener in list(self.listeners):
            listener.before_compute()
        self.load()
        self.in_compute = True

    def leave(self) -> None:
        """The compute phase ends: shards offloaded, then the listeners told."""
        if not self.in_compute:
            return
        self.offload()
        self.in_compute = False
        for listener in list(self.listeners):
            listener.after_compute()

    def start_run(self) -> None:
        """A new run (fit, validate, ...) starts in the rollout phase, shards offloaded."""
        self.in_compute = False
        self.offload()
