"""A gloo worker's staged rounds (``Gloo(background=True)``): what a thread received while the engine went on
generating, until a swap round loads it (:class:`~lightning_fsdp_export.backend.worker.GlooWeightTransferEngine`)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta

import torch

__all__ = ["Staging", "digest_mismatch", "staged"]


@dataclass
class Staging:
    """A staged round (``stage_as``): received by a thread while the engine generates; loaded by a swap round.

    ``tensors`` maps each name to its tensor, or to ``None`` where it is read from ``base`` (the host copy a
    ``keep_as`` round keeps: the staging is that copy, never a second one)."""

    id: str
    base: dict[str, torch.Tensor]
    tensors: dict[str, torch.Tensor | None] = field(default_factory=dict)
    thread: threading.Thread | None = None
    error: BaseException | None = None
    complete: bool = False  # every member checked the digests and nobody failed

    @property
    def nbytes(self) -> int:
        return sum((t if t is not None else self.base[n]).nbytes for n, t in self.tensors.items())

    def pairs(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.tensors.items():
            yield name, tensor if tensor is not None else self.base[name].clone()  # the copy stays ours


def staged(staging: Staging | None, stage_id: str, timeout: timedelta) -> Staging:
    """The staged round ``stage_id``, complete (its thread joined), or why a swap to it cannot run."""
    if staging is None or staging.id != stage_id:
        held = "none" if staging is None else repr(staging.id)
        raise RuntimeError(f"swap to the staged round {stage_id!r}, but this worker holds {held} (restarted, or a"
                           " newer round replaced it); the next sync pushes every tensor whole.")
    if staging.thread is not None:
        staging.thread.join(timeout.total_seconds())
    if not staging.complete:
        why = "is still being received" if staging.error is None else f"failed: {staging.error}"
        raise RuntimeError(f"swap to the staged round {stage_id!r}, which {why}; the served weights are unchanged.")
    return staging


def digest_mismatch(sent: list[tuple[int, int]], received: list[list[int]]) -> RuntimeError | None:
    """The first trainer rank whose ``(bytes, checksum)`` differs from what this worker received, as an error."""
    for rank, ((nbytes, crc), (got, got_crc)) in enumerate(zip(sent, received)):
        if (nbytes, crc) != (got, got_crc):
            return RuntimeError(f"staged round: trainer rank {rank} sent {nbytes} bytes (checksum {crc:#010x}) but this"
                                f" worker received {got} (checksum {got_crc:#010x}); the round is dropped.")
    return None
