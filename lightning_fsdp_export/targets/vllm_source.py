"""The lazy FSDP2 export as a vLLM ``WeightSource``; this module imports vLLM.

``LazyExportFSDP2.weight_source()`` builds it; ``RemoteVLLM``'s weight-transfer transports wrap the
callback's :class:`~lightning_fsdp_export.source.ExportSource` with it.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import Tensor
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

from lightning_fsdp_export.source import ExportSource

__all__ = ["FSDP2WeightSource"]


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
        return [ParamMeta(m.name, m.dtype, m.shape) for m in self.export.metadata()]

    def __iter__(self) -> Iterator[tuple[str, Tensor]]:
        return iter(self.export)

    def drain(self) -> None:
        """After a failure: finish the live pass (its remaining gathers run), or run a whole one if this
        source never started any."""
        self.export.drain()
