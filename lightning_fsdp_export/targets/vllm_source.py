"""The lazy FSDP2 export as a vLLM ``WeightSource``, and the shard-direct one as an ``M2NWeightSource``;
this module imports vLLM.

``LazyExportFSDP2.weight_source()`` / ``m2n_source()`` build them; ``RemoteVLLM``'s weight-transfer
transports wrap the callback's sources with them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from torch import Tensor
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
from vllm.distributed.weight_transfer.m2n_common import REPLICATE, REPLICATED, M2NMesh, M2NParamMeta
from vllm.distributed.weight_transfer.m2n_source import M2NWeightSource

from lightning_fsdp_export.shards import ShardSource
from lightning_fsdp_export.source import ExportSource

__all__ = ["FSDP2M2NSource", "FSDP2WeightSource", "RowShardMeta"]


@dataclass(frozen=True)
class RowShardMeta(ParamMeta):
    """``ParamMeta`` with the trainer ranks' rows: ``None`` (rank 0 sends it whole) or ``world + 1`` row offsets."""

    bounds: tuple[int, ...] | None


class FSDP2WeightSource(WeightSource):
    """A vLLM ``WeightSource`` over :class:`~lightning_fsdp_export.source.ExportSource`.

    ``metadata()`` is the export plan (no collective); each ``iter()`` is a fresh collective export
    pass in the same, layerwise order. vLLM's trainer engines iterate it inside ``send_weights()``; if
    that raises on one rank, call :meth:`drain` there so the other ranks' gathers complete. Every rank
    must run the same number of passes: ``export.passes`` counts this rank's.

    ``export`` may be repointed between rounds (``RemoteVLLM`` builds its trainer engine with one
    source at setup and gives it each sync's export).
    """

    def __init__(self, export: ExportSource | None) -> None:
        self.export = export

    def metadata(self) -> list[ParamMeta]:
        """``ParamMeta`` per tensor; over a :class:`~lightning_fsdp_export.shards.ShardSource` a :class:`RowShardMeta`
        (with each rank's rows, for the gloo backend's shard-direct mode)."""
        if isinstance(self.export, ShardSource):
            return [RowShardMeta(m.name, m.dtype, m.shape, m.bounds) for m in self.export.metadata()]
        return [ParamMeta(m.name, m.dtype, m.shape) for m in self.export.metadata()]

    def __iter__(self) -> Iterator[tuple[str, Tensor]]:
        return iter(self.export)

    def drain(self) -> None:
        """After a failure: finish the live pass (its remaining gathers run), or run a whole one if this
        source never started any."""
        self.export.drain()


class FSDP2M2NSource(M2NWeightSource):
    """vLLM's ``M2NWeightSource`` (``nccl_m2n``) over a :class:`~lightning_fsdp_export.shards.ShardSource`.

    ``mesh()`` is the trainer's ranks as one FSDP axis, ``(world, 1)``; ``metadata()`` gives each tensor's
    checkpoint name, wire dtype, full shape and placement: ``(0, REPLICATE)`` (rows over the ranks) for a
    shard sent as it is, ``REPLICATED`` for one sent whole (split by the checkpoint format, not a row shard,
    or rows that do not divide by the ranks: vLLM's m2n needs even ones). Iteration yields each rank's rows
    (or the whole tensor), cast on the rank and staged on the source's device per tensor. Like
    :class:`FSDP2WeightSource`, ``export`` may be repointed between rounds.
    """

    def __init__(self, export: ShardSource | None) -> None:
        self.export = export

    def mesh(self) -> M2NMesh:
        return M2NMesh((self.export.world, 1), 0)

    def metadata(self) -> list[ParamMeta]:
        return [M2NParamMeta(m.name, m.dtype, m.shape, REPLICATED if m.bounds is None else (0, REPLICATE))
                for m in self.export.metadata()]

    def __iter__(self) -> Iterator[tuple[str, Tensor]]:
        return iter(self.export)

    def drain(self) -> None:
        """As :meth:`FSDP2WeightSource.drain`."""
        self.export.drain()
