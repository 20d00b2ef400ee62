"""The lazy FSDP2 export as a vLLM ``WeightSource`` (full tensors) and as the shard-direct source ``nccl_m2n``
takes; this module imports vLLM.

``LazyExportFSDP2.weight_source(layout=...)`` builds them; ``RemoteVLLM``'s weight-transfer
transports wrap the callback's sources with them.

One code base for vLLM's two source contracts, chosen by its API (``_compat.weight_source_contract``):

* vLLM 0.32: ``metadata()`` is a method, engines iterate the source (``iter(source)``), and ``nccl_m2n``
  takes an ``M2NWeightSource`` (``mesh()`` plus ``M2NParamMeta`` placements);
* vLLM 0.33: ``metadata`` is a ``functools.cached_property`` (a plain method is refused when the class is
  defined), engines call ``iter_full()`` (broadcast, IPC) or ``iter_local()`` (``nccl_m2n``), and ownership
  lives in ``ParamMeta`` (``owners``, ``mesh_shape``, ``placements=(Shard(0),)``): ``M2NWeightSource`` is gone.

Both sources may be repointed at another export (``source.export = ...``); on 0.33 that also drops the cached
``metadata``, so an engine never plans from the previous sync's tensors.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from torch import Tensor
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

from lightning_fsdp_export._compat import weight_source_contract
from lightning_fsdp_export.export.shards import ShardSource
from lightning_fsdp_export.export.source import ExportSource

__all__ = ["FSDP2M2NSource", "FSDP2WeightSource", "RowShardMeta"]

_CONTRACT = weight_source_contract()  # "0.32" (metadata() method) or "0.33" (cached metadata, iter_full/local)
VLLM_033 = _CONTRACT == "0.33"
"""vLLM 0.33's source contract (chosen by its API). mypy checks the branch of the vLLM it runs beside: the main venv's
0.32 (pyproject.toml: ``always_false``); the 0.33 branch runs under ``tests/test_vllm_contracts.py`` with vLLM 0.33."""


@dataclass(frozen=True)
class RowShardMeta(ParamMeta):
    """``ParamMeta`` with the trainer ranks' rows: ``None`` (rank 0 sends it whole) or ``world + 1`` row offsets."""

    bounds: tuple[int, ...] | None


class _Repointable:
    """A source over one sync's export at a time; repointing drops the cached metadata (vLLM 0.33)."""

    _export: Any = None

    @property
    def export(self) -> Any:
        return self._export

    @export.setter
    def export(self, export: Any) -> None:
        self._export = export
        self.__dict__.pop("metadata", None)  # cached_property's cache (vLLM 0.33)

    def _metadata(self) -> list[ParamMeta]:
        raise NotImplementedError

    def _declared(self) -> list[ParamMeta]:
        return self._metadata()  # the subclass's, looked up per instance

    if VLLM_033:
        metadata = cached_property(_declared)
    else:
        metadata = _declared

    def __iter__(self) -> Iterator[tuple[str, Tensor]]:
        return iter(self._export)

    def drain(self) -> None:
        """After a failure: finish the live pass (its remaining gathers run), or run a whole one if this
        source never started any."""
        self._export.drain()


class FSDP2WeightSource(_Repointable, WeightSource):
    """A vLLM ``WeightSource`` over :class:`~lightning_fsdp_export.export.source.ExportSource`.

    ``metadata`` is the export plan (no collective); each iteration (``iter(source)`` on vLLM 0.32,
    ``iter_full()`` on 0.33) is a fresh collective export pass in the same, layerwise order. vLLM's trainer
    engines iterate it inside ``send_weights()``; if that raises on one rank, call :meth:`drain` there so the
    other ranks' gathers complete. Every rank must run the same number of passes: ``export.passes`` counts
    this rank's. Every rank yields every tensor (every rank owns every name).

    ``RemoteVLLM`` makes one per round over that push's export and gives it to its trainer engine
    (:mod:`lightning_fsdp_export.transfer.pipeline`); ``export`` may still be repointed (the metadata follows).
    """

    def __init__(self, export: ExportSource | None) -> None:
        self.export = export

    def _metadata(self) -> list[ParamMeta]:
        """``ParamMeta`` per tensor; over a :class:`~lightning_fsdp_export.export.shards.ShardSource` a
        :class:`RowShardMeta`
        (with each rank's rows, for the gloo backend's shard-direct mode)."""
        if isinstance(self.export, ShardSource):
            return [RowShardMeta(m.name, m.dtype, m.shape, m.bounds) for m in self.export.metadata()]
        return [ParamMeta(m.name, m.dtype, m.shape) for m in self.export.metadata()]

    def iter_full(self) -> Iterator[tuple[str, Tensor]]:
        """vLLM 0.33's full-tensor mode: the same pass as ``iter(source)``."""
        return iter(self._export)


if VLLM_033:
    from vllm.distributed.weight_transfer.base import Shard

    class FSDP2M2NSource(_Repointable, WeightSource):
        """The source ``nccl_m2n`` takes on vLLM 0.33: a plain ``WeightSource`` over a
        :class:`~lightning_fsdp_export.export.shards.ShardSource` whose ``ParamMeta`` says the layout.

        A row shard sent as it is: ``owners`` every trainer rank, ``mesh_shape=(world,)``,
        ``placements=(Shard(0),)`` (FSDP2's rows follow ``torch.chunk``, vLLM's rule); a tensor sent whole
        (split by the checkpoint format, not a row shard, or rows that do not divide by the ranks: m2n needs
        even ones) is owned by every rank and replicated. ``iter_local()`` yields each rank's rows (or the whole
        tensor), cast on the rank and staged on the source's device per tensor.
        """

        def __init__(self, export: ShardSource | None) -> None:
            self.export = export

        def _metadata(self) -> list[ParamMeta]:
            world = self.export.world
            everyone = tuple(range(world))
            return [ParamMeta(m.name, m.dtype, m.shape) if m.bounds is None else
                    ParamMeta(m.name, m.dtype, m.shape, owners=everyone, mesh_shape=(world,), placements=(Shard(0),))
                    for m in self.export.metadata()]

        def iter_local(self) -> Iterator[tuple[str, Tensor]]:
            return iter(self._export)

else:
    from vllm.distributed.weight_transfer.m2n_common import REPLICATE, REPLICATED, M2NMesh, M2NParamMeta
    from vllm.distributed.weight_transfer.m2n_source import M2NWeightSource

    class FSDP2M2NSource(_Repointable, M2NWeightSource):
        """vLLM 0.32's ``M2NWeightSource`` (``nccl_m2n``) over a
        :class:`~lightning_fsdp_export.export.shards.ShardSource`.

        ``mesh()`` is the trainer's ranks as one FSDP axis, ``(world, 1)``; ``metadata()`` gives each tensor's
        checkpoint name, wire dtype, full shape and placement: ``(0, REPLICATE)`` (rows over the ranks) for a
        shard sent as it is, ``REPLICATED`` for one sent whole (split by the checkpoint format, not a row shard,
        or rows that do not divide by the ranks: vLLM's m2n needs even ones). Iteration yields each rank's rows
        (or the whole tensor), cast on the rank and staged on the source's device per tensor.
        """

        def __init__(self, export: ShardSource | None) -> None:
            self.export = export

        def mesh(self) -> M2NMesh:
            return M2NMesh((self.export.world, 1), 0)

        def _metadata(self) -> list[ParamMeta]:
            return [M2NParamMeta(m.name, m.dtype, m.shape, REPLICATED if m.bounds is None else (0, REPLICATE))
                    for m in self.export.metadata()]
