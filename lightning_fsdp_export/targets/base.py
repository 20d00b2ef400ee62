"""The one small protocol every weight target follows."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch
from torch import Tensor

if TYPE_CHECKING:
    import lightning.pytorch as pl


@runtime_checkable
class WeightTarget(Protocol):
    """Where :class:`~lightning_fsdp_export.VLLMWeightSync` sends weights.

    The calling loop, on every rank::

        target.setup(trainer)                      # once, at fit start
        source = strategy.export_source(dtype=target.dtype)                   # each sync:
        target.push(iter(source), version=v)       # or target.push_source(source, version=v) if it has one
        target.teardown()                          # at fit end

    ``push_source(source, *, version)`` is optional: a target that needs the source's ``metadata()``
    before the stream (``RemoteVLLM``'s network transports) defines it and gets the
    :class:`~lightning_fsdp_export.source.ExportSource` instead of one pass over it.
    """

    @property
    def dtype(self) -> torch.dtype | None:
        """The dtype the receiver wants (an engine's own), or ``None`` to keep the trainer's."""
        ...

    def setup(self, trainer: pl.Trainer) -> None:
        """Prepare on every rank (build an engine, check a server) before the first push."""
        ...

    def push(self, weights: Iterator[tuple[str, Tensor]], *, version: int) -> None:
        """Send one full set of weights as version ``version``; called on every rank with the same stream."""
        ...

    def teardown(self) -> None:
        """Release what ``setup`` created."""
        ...
