"""``AsyncRollouts`` in a loop you write (Lightning Fabric): start, a filled batch per ``next()``, close."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from lightning_fsdp_export.rollouts.samples import RolloutBatch

if TYPE_CHECKING:
    from lightning_fsdp_export.rollouts.pacing import Pacing

__all__ = ["FabricLoop"]


class FabricLoop(ABC):
    """The loop side of :class:`~lightning_fsdp_export.rollouts.AsyncRollouts` (no Trainer): :meth:`start`, then
    iterate (each ``next()`` fills a batch on every rank, a collective), then :meth:`close` (or a ``with`` block).

    The documented loop iterates the rollouts object itself (``with rollouts.start(fabric): for batch in rollouts``),
    so this stays a base of ``AsyncRollouts``; what it needs of it is declared here, abstract."""

    pacing: Pacing
    metrics: dict[str, float]
    history: list[dict[str, Any]]
    _fabric: Any

    @abstractmethod
    def _begin(self, rank: int, world: int) -> None:
        """Every rank, at the start of a run: positions, pacing, client threads."""

    @abstractmethod
    def _fill_everywhere(self, batch: RolloutBatch) -> None:
        """Every rank: fill ``batch`` within the staleness bound (a collective)."""

    @abstractmethod
    def _metrics_of(self, batch: RolloutBatch) -> dict[str, float]:
        """The ``rollouts/*`` metrics of a filled batch."""

    @abstractmethod
    def stop(self) -> None:
        """Stop admitting, abort what is in flight, join the client threads."""

    def start(self, fabric: Any) -> FabricLoop:
        """Every rank, after the sync's first push: start the client threads (admitting requests now); returns
        ``self``, a context manager that closes it. ``fabric``: the loop's ``lightning.fabric.Fabric``."""
        if self._fabric is not None:
            raise RuntimeError("AsyncRollouts.start(fabric): already started; close() it first.")
        if self.pacing.versions_every is None:
            self.pacing.versions_every = 1  # the loop pushes after every batch unless told otherwise
        self._begin(fabric.global_rank, fabric.world_size)
        self._fabric = fabric
        return self

    def next_batch(self) -> RolloutBatch:
        """Every rank: the next batch, filled within the staleness bound (:class:`RolloutError` on every rank when one
        rank's fill failed or timed out); its ``rollouts/*`` metrics logged through ``fabric.log_dict``."""
        if self._fabric is None:
            raise RuntimeError("AsyncRollouts: call start(fabric) before asking for batches.")
        batch = RolloutBatch()
        self._fill_everywhere(batch)
        self.metrics = self._metrics_of(batch)
        self._fabric.log_dict(self.metrics, step=len(self.history))
        return batch

    def __iter__(self) -> FabricLoop:
        return self

    def __next__(self) -> RolloutBatch:
        return self.next_batch()

    def close(self) -> None:
        """Stop admitting, abort what is in flight on every server, join every client thread (idempotent)."""
        self.stop()
        self._fabric = None

    def __enter__(self) -> FabricLoop:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
