"""Moving sharded parameters and optimizer state between the device and the host.

``offload="params"`` keeps the sharded parameters (and, optionally, the optimizer state) on the CPU
outside the training step, as verl does, so a colocated vLLM engine can use the accelerator memory in
between. The moves below are model-wide: the strategy performs them around each training step and the
staged (LoRA) export path performs them around an export; the lazy export path performs none.
"""

from __future__ import annotations

import enum

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

__all__ = ["OffloadMode", "move_module", "move_optimizer_state"]


class OffloadMode(enum.Enum):
    """Where sharded parameters live between training steps; parsed once by :meth:`parse`."""

    NONE = None
    PARAMS = "params"
    POLICY = "policy"

    @classmethod
    def parse(cls, value: str | None) -> OffloadMode:
        """Turn the user's ``offload=`` argument into a mode, or raise a ``ValueError`` naming it."""
        for mode in cls:
            if mode.value == value:
                return mode
        accepted = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"Unknown offload={value!r}; accepted values are {accepted}.")


def _to_pinned_host(tensor: Tensor) -> Tensor:
    """``tensor`` copied once into pinned host memory (DTensor-aware: its local shard)."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    if local.device.type == "cpu" and local.is_pinned():
        return tensor
    host = torch.empty(local.shape, dtype=local.dtype, pin_memory=True).copy_(local)
    if isinstance(tensor, DTensor):
        return DTensor.from_local(host, tensor.device_mesh, tensor.placements, shape=tensor.shape,
                                  stride=tensor.stride())
    return host


def move_module(module: nn.Module, device: torch.device, *, pin_memory: bool = False) -> None:
    """Move every parameter, gradient and buffer of ``module`` to ``device`` in place.

    FSDP2 modules re-register their sharded parameters after ``Module._apply`` (``FSDPModule._apply``),
    so this is safe between steps. With ``pin_memory``, a CPU ``device`` and CUDA present, each tensor
    is copied once straight into pinned host memory, which makes the next host-to-device copy several
    times faster (verl #7347: 1.49 s -> 0.38 s). FSDP2 re-pads unevenly sharded parameters into new,
    unpinned memory; those stay pageable.
    """
    if pin_memory and device.type == "cpu" and torch.cuda.is_available():
        module._apply(_to_pinned_host)  # the entry point Module.to uses; FSDPModule overrides it
    else:
        module.to(device)


def move_optimizer_state(optimizer: Optimizer, device: torch.device | None) -> None:
    """Move every tensor of the optimizer's state to ``device``, or to its parameter's device if ``None``.

    Scalar ``step`` counters stay where they are (Adam keeps them on the CPU on purpose).
    """
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param)
            if not state:
                continue
            target = device if device is not None else param.device
            for key, value in state.items():
                if isinstance(value, Tensor) and key != "step" and value.device != target:
                    state[key] = value.to(target)
