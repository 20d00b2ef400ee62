"""The Compute phases room: rollout vs compute phase, ``offload="params"`` moves, the pinned host pool, phase
listeners (``docs/architecture.md``): :mod:`.compute` (``ComputePhases``) and :mod:`.offload`."""

from typing import Any

from lightning_fsdp_export._moved import forward_old_attribute
from lightning_fsdp_export.phases.compute import ComputePhases, PhaseListener

__all__ = ["ComputePhases", "PhaseListener"]


def __getattr__(name: str) -> Any:
    # lightning_fsdp_export.phases was the module now at phases.compute: its other names, for one more minor
    return forward_old_attribute(__name__, "lightning_fsdp_export.phases.compute", name)
