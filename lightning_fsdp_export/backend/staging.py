"""A gloo worker's staged rounds (``Gloo(background=True)``): what a thread received while the engine went on
generating, until a swap round loads it (:class:`~lightning_fsdp_export.backend.worker.GlooWeightTransferEngine`)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from lightning_fsdp_export._compat import load_naming_refusals
from lightning_fsdp_export.backend.inplace import Deferred

if TYPE_CHECKING:
    from lightning_fsdp_export.backend.infos import GlooWeightTransferUpdateInfo
    from lightning_fsdp_export.backend.inplace import InPlace

__all__ = ["StagedRounds", "Staging", "digest_mismatch", "logger", "staged"]


def logger() -> Any:
    """A child of vLLM's logger, so a server prints the gloo worker's lines with its own."""
    from vllm.logger import init_logger

    return init_logger("vllm.lightning_fsdp_export.gloo")


@dataclass
class Staging:
    """A staged round (``stage_as``): received by a thread while the engine generates; loaded by a swap round.

    ``tensors`` maps each name to its tensor, or to ``None`` where it is read from ``base`` (the host copy a
    ``keep_as`` round keeps: the staging is that copy, never a second one). A sparse round in place (``inplace``)
    keeps no tensors: what it writes into each placed tensor (``deferred``), the copy it patched, and which tensors
    changed (``changed``: the swap reloads only their layers)."""

    id: str
    base: dict[str, torch.Tensor]
    tensors: dict[str, torch.Tensor | None] = field(default_factory=dict)
    thread: threading.Thread | None = None
    error: BaseException | None = None
    complete: bool = False  # every member checked the digests and nobody failed
    inplace: InPlace | None = None  # a sparse round in place: where the engine holds each placed tensor
    deferred: dict[str, Deferred] = field(default_factory=dict)
    changed: set[str] = field(default_factory=set)
    trace_ties: dict[str, str] | None = None  # a dense round that keeps a copy: traced once swapped in (its ties)

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


class StagedRounds:
    """A gloo worker's staged rounds (``stage_as``; ``GlooWeightTransferEngine`` is one): received by a thread into a
    :class:`Staging` while the engine generates, swapped in by a later round under the pause. ``staged_nccl``'s engine
    overrides where the thread receives (:meth:`_receiving`) and where it keeps the parts (:meth:`_on_host`)."""

    group: Any  # the transfer group (``None`` until joined)
    model: Any
    _base: dict[str, torch.Tensor]  # the host copy a sparse round patches
    _inplace: InPlace | None  # where sparse rounds write in place
    _trace_ties: dict[str, str] | None  # a kept dense round's ties: traced once it loaded
    _reloading: bool  # vLLM's layerwise reload is open
    _staging: Staging | None  # the last staged round, until a swap loads it

    def receive_weights(self, update_info: GlooWeightTransferUpdateInfo, staging: Staging | None = None) -> None:
        raise NotImplementedError

    def _stage(self, info: GlooWeightTransferUpdateInfo) -> None:
        """Start receiving ``info``'s round in a thread into a fresh staging area (the previous one is dropped)."""
        assert info.stage_as is not None
        old = self._staging
        if old is not None and old.thread is not None and old.thread.is_alive():
            raise RuntimeError(f"staged round {old.id!r} is still being received; a new staged round can start only"
                               " when it ended (the trainer waits for its round before the next one).")
        if self.group is None:
            raise RuntimeError("gloo weight transfer is not initialized: call init_weight_transfer_engine first.")
        staging = Staging(info.stage_as, self._base)
        if info.keep_as is not None and info.patch_of is None:
            self._base, self._inplace = {}, None  # a dense round that keeps a copy: the staging is that copy
            staging.base, staging.trace_ties = self._base, dict(info.same_as or {})
        elif info.patch_of is not None and self._inplace is not None:  # in place, at the swap
            staging.inplace = self._inplace
            staging.deferred = {name: Deferred(placed) for name, placed in self._inplace.placed.items()}
        staging.thread = threading.Thread(target=self._receive_staged, args=(info, staging), daemon=True,
                                          name=f"gloo-staged-{info.stage_as[:8]}")
        self._staging = staging
        staging.thread.start()

    def _receive_staged(self, info: GlooWeightTransferUpdateInfo, staging: Staging) -> None:
        try:
            with self._receiving():
                self.receive_weights(info, staging)
            staging.complete = True
        except BaseException as err:  # noqa: BLE001 - the swap round (or the trainer's status) reports it
            staging.error = err
            staging.tensors.clear()
            logger().warning("gloo staged round %s failed; the served weights are unchanged: %s", staging.id, err)

    def _receiving(self) -> contextlib.AbstractContextManager[None]:
        """Where a staged round's thread runs its receives: the host for gloo (the NCCL engine: a side stream)."""
        return contextlib.nullcontext()

    def _on_host(self, part: torch.Tensor | None) -> torch.Tensor | None:
        """``part`` where a staged round keeps it: as received for gloo (the NCCL engine: on the device, or copied
        to pinned host memory where the staging is on the host)."""
        return part

    def _swap(self, staging: Staging) -> None:
        """Load ``staging`` into the model (the layerwise reload is open; ``finish_weight_update`` closes it)."""
        self._staging = None
        start = time.perf_counter()
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        with disable_mtp_completeness_check():
            if staging.inplace is not None:
                said = self._swap_in_place(staging, staging.inplace)
            else:
                load_naming_refusals(self.model.load_weights, self.model, staging.pairs())
                said = f"{len(staging.tensors)} tensors, {staging.nbytes / 1e6:.1f} MB"
        if staging.trace_ties is not None:  # (the trace runs once the reload finished)
            self._trace_ties = staging.trace_ties
        logger().info("gloo weight update: swapped in the staged round %s (%s) in %.3f s", staging.id, said,
                       time.perf_counter() - start)

    def _swap_in_place(self, staging: Staging, inplace: InPlace) -> str:
        """A staged sparse round in place: its writes into the placed tensors, then a reload of only the layers its
        changes reach, from the copy it patched (the layerwise reload opens here, not before)."""
        if inplace is not self._inplace:
            raise RuntimeError(f"swap to the staged round {staging.id!r}, staged in place before another round"
                               " changed where the engine holds its tensors; the next sync pushes every tensor whole.")
        written = sum(deferred.apply() > 0 for deferred in staging.deferred.values())
        try:
            return f"{written} tensor(s) written in place, " + inplace.reload(self.model, staging.changed,
                                                                                staging.base)
        finally:
            self._reloading = inplace.open
