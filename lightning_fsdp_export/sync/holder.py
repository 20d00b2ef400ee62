"""What the Trainer's ``VLLMWeightSync`` and Fabric's ``WeightSync`` share: each holds a
:class:`~lightning_fsdp_export.sync.engine.SyncEngine` (``sync.engine``) and shows its state, the same way."""

from __future__ import annotations

from typing import Any

from lightning_fsdp_export.sync.engine import SyncEngine
from lightning_fsdp_export.sync.exact import ExactCheck
from lightning_fsdp_export.sync.options import SyncLora, SyncOptions
from lightning_fsdp_export.targets.base import WeightTarget

__all__ = ["HoldsSyncEngine"]


class HoldsSyncEngine:
    """A sync the user built (``VLLMWeightSync``, ``WeightSync``): the engine's state, read from ``self.engine``, and
    its checkpoint state. ``AsyncRollouts`` takes either by this base."""

    engine: SyncEngine
    """The sync's path and state (:meth:`SyncEngine.start`, :meth:`SyncEngine.push`, :meth:`SyncEngine.end`)."""

    @property
    def target(self) -> WeightTarget:
        """Where the weights go."""
        return self.engine.target

    @property
    def options(self) -> SyncOptions:
        """The sync's options, parsed once."""
        return self.engine.options

    @property
    def version(self) -> int:
        """The last version pushed (0: none yet)."""
        return self.engine.version

    @property
    def served_version(self) -> int | None:
        """The version the target serves as every rank agreed (see ``SyncEngine.served_version``)."""
        return self.engine.served_version

    @served_version.setter
    def served_version(self, version: int | None) -> None:
        self.engine.served_version = version

    @property
    def stale(self) -> bool:
        """The target does not hold the trainer's last pushed weights (before the first sync, after a failure)."""
        return self.engine.stale

    @stale.setter
    def stale(self, value: bool) -> None:
        self.engine.stale = value

    @property
    def resumed(self) -> bool:
        """Whether the state came from a checkpoint (the next push is full and continues its versions)."""
        return self.engine.resumed

    @property
    def lora(self) -> SyncLora:
        """The mode: ``"merged"`` or ``"adapter"``."""
        return self.engine.lora

    @property
    def last_synced_step(self) -> int:
        """The step of the last sync that succeeded (-1: none)."""
        return self.engine.last_synced_step

    @property
    def last_metrics(self) -> dict[str, float]:
        """The last sync's metrics (``weight_sync/...``)."""
        return self.engine.last_metrics

    @property
    def last_verify_diff(self) -> float | None:
        """The last ``verify="logprobs"`` check's largest logprob difference."""
        return self.engine.last_verify_diff

    @property
    def last_exact_check(self) -> ExactCheck | None:
        """What the exact check compared on this rank (``exact_first_sync=True``), once it ran."""
        return self.engine.last_exact_check

    @property
    def skipped(self) -> int:
        """Pushes skipped because the previous version was still travelling (``when_busy="skip"``)."""
        return self.engine.skipped

    def settle(self) -> bool:
        """Every rank: end the push still in the background, if any, and agree on it (see ``SyncEngine.settle``)."""
        return self.engine.settle()

    def state_dict(self) -> dict[str, Any]:
        """The version and the last synced step (a resumed run continues the versions)."""
        return self.engine.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from a checkpoint's state: the next push is full."""
        self.engine.load_state_dict(state_dict)
