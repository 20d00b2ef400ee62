"""The Compute phases room: rollout vs compute phase, ``offload="params"`` moves, the pinned host pool, phase
listeners (``docs/architecture.md``): :mod:`.compute` (``ComputePhases``) and :mod:`.offload`."""

from lightning_fsdp_export.phases.compute import ComputePhases, PhaseListener

__all__ = ["ComputePhases", "PhaseListener"]

