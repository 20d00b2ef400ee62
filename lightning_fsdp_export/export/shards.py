"""Shard-direct export: every rank yields its own rows of each FSDP2 shard, no gather; torch only.

A full export gathers every tensor on every rank (an all-gather each) so that one rank can send it. A
shard-direct consumer (vLLM's ``nccl_m2n``, the shard-direct mode of this package's ``gloo`` backend)
instead has every trainer rank send its own part, and the receivers assemble the full tensors. For
each state-dict entry, :func:`row_bounds` decides how it goes:

* **rows**: an FSDP2 shard (``Shard(0)`` over the 1-D mesh of all trainer ranks, in rank order) whose
  checkpoint tensor is itself, or itself under another name (a VLM prefix): every rank yields its local
  rows, cast to the wire dtype on the rank; ``bounds[r]:bounds[r + 1]`` are rank ``r``'s rows of the full
  tensor (``torch.chunk`` rows, as FSDP2 shards: uneven shards leave the last ranks fewer or none);
* **owned pieces**: such a shard that the checkpoint format splits by rows (fused MoE experts: FSDP2
  shards them by experts) where every checkpoint piece comes from one rank's rows: that rank converts its
  rows and yields its pieces whole, the others an empty ``(0, ...)`` tensor in their place (a piece's
  ``bounds`` give its owner all its rows); not with ``even=True`` (vLLM's m2n has no such placement);
* **full**: anything else (a plain or replicated tensor; another mesh; a split whose pieces span ranks;
  with ``even=True`` also split tensors and shards whose rows do not divide by the ranks) is gathered as
  the full export does and yielded whole, in checkpoint format, on every rank.

A tied tensor yields its rows (or its full pieces) under every one of its names.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from lightning_fsdp_export._fsdp import chunk_bounds
from lightning_fsdp_export.export.buckets import bucketable
from lightning_fsdp_export.export.checkpoint_format import CheckpointFormat
from lightning_fsdp_export.export.lazy import ExportReport, _converted, gather_full
from lightning_fsdp_export.export.source import Entries, ExportSource, TensorMeta, wire_dtype

__all__ = ["Layout", "ShardMeta", "ShardSnapshot", "ShardSource", "owner_bounds", "row_bounds", "shard_export",
           "trainer_world"]

# How an entry goes: its rows' offsets over the ranks, each checkpoint piece's owner rank, or None (whole).
Layout = tuple[int, ...] | dict[str, int] | None


@dataclass(frozen=True)
class ShardMeta(TensorMeta):
    """One tensor of a shard-direct pass: vLLM's ``ParamMeta`` fields and how the ranks hold it.

    Attributes:
        bounds: ``None`` when every rank yields the whole tensor (rank 0's copy is the one to send);
            else ``world + 1`` row offsets, rank ``r`` yielding rows ``bounds[r]:bounds[r + 1]``.
    """

    bounds: tuple[int, ...] | None


def trainer_world() -> tuple[int, int]:
    """``(rank, world size)`` of the default process group (``(0, 1)`` without one)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def row_bounds(names: list[str], tensor: Tensor, fmt: CheckpointFormat, world: int, *,
               even: bool = False) -> Layout:
    """How the entry goes (see the module doc): rank ``r``'s rows are ``bounds[r]:bounds[r + 1]`` when every
    rank can send its own rows as the checkpoint tensors of ``names``; ``{piece: owner rank}`` when the
    checkpoint format splits it into pieces each made by one rank's rows; ``None`` when it goes whole."""
    if not bucketable(tensor) or world < 1:
        return None
    assert isinstance(tensor, DTensor)
    if _mesh_ranks(tensor.device_mesh) != tuple(range(world)):
        return None  # a sub-mesh (HSDP, a group of ranks): the receivers could not tell whose rows are whose
    for name in names:
        pieces = fmt.pieces(name, tensor)
        if len(pieces) != 1 or pieces[0].shape != tuple(tensor.shape):
            if even or len(names) != 1:
                return None  # split or reshaped on the way to the checkpoint: only the full tensor converts
            return fmt.owners(name, tensor, world)
    if even and tensor.shape[0] % world:
        return None
    return chunk_bounds(tensor.shape[0], world)


_MESH_RANKS: weakref.WeakKeyDictionary[DeviceMesh, tuple[int, ...]] = weakref.WeakKeyDictionary()


def _mesh_ranks(mesh: DeviceMesh) -> tuple[int, ...]:
    """The global ranks of ``mesh``, flattened in its order; read once per mesh (``DeviceMesh.mesh`` builds a new
    tensor at each call, 33 us here, and a sync asked it twice per state-dict entry, in the trainer's blocked time)."""
    ranks = _MESH_RANKS.get(mesh)
    if ranks is None:
        ranks = _MESH_RANKS[mesh] = tuple(mesh.mesh.flatten().tolist())
    return ranks


def owner_bounds(owner: int, rows: int, world: int) -> tuple[int, ...]:
    """The ``bounds`` of a piece that rank ``owner`` sends whole (``rows`` rows): every other rank has none."""
    return tuple(0 if rank <= owner else rows for rank in range(world + 1))


def shard_export(entries: Entries, *, fmt: CheckpointFormat, dtype: torch.dtype | None,
                 layout: Callable[[list[str], Tensor], Layout], device: torch.device | str | None,
                 gather_device: torch.device, on_finish: Callable[[ExportReport], None] | None = None
                 ) -> Iterator[tuple[str, Tensor]]:
    """One shard-direct pass over ``entries`` (a collective generator: the full entries are gathered).

    Yields ``(checkpoint name, tensor)``: this rank's rows for entries ``layout`` gives bounds, the full
    checkpoint tensors otherwise. Rows are cast to ``dtype`` here and moved to ``device`` (``None``: they
    stay where the shard lives, the host when offloaded); with no cast they are the module's own storage,
    valid until the weights change. ``ExportReport.gathered_bytes`` counts only the full entries.
    """
    rank, _ = trainer_world()
    stats = [0, 0, 0.0]
    gathered = [0]
    start = time.perf_counter()
    for names, tensor in entries:
        bounds = layout(names, tensor)
        if bounds is None:
            full = gather_full(tensor, device=gather_device, dtype=dtype, stats=gathered)
            pairs: Iterator[tuple[str, Tensor]] = _converted(fmt, names, full)
            del full
        elif isinstance(bounds, dict):
            assert isinstance(tensor, DTensor)  # (pieces by owner: a sharded tensor's layout)
            pairs = _owned_pieces(names[0], tensor, rank, fmt, dtype, device)
        else:
            pairs = iter(_local_rows(names, tensor, bounds, rank, fmt, dtype, device))
        for name, out in pairs:
            stats[0] += 1
            stats[1] += out.numel() * out.element_size()
            stats[2] += time.perf_counter() - start
            yield name, out
            del out
            start = time.perf_counter()
        del pairs
    if on_finish is not None:
        on_finish(ExportReport("shards", int(stats[0]), int(stats[1]), float(stats[2]), module_moves=0,
                               gathered_bytes=gathered[0]))


def _local_rows(names: list[str], tensor: Tensor, bounds: tuple[int, ...], rank: int, fmt: CheckpointFormat,
                dtype: torch.dtype | None, device: torch.device | str | None) -> list[tuple[str, Tensor]]:
    local = _local_cast(tensor, dtype, device)
    want = bounds[rank + 1] - bounds[rank]
    if local.shape[0] != want:
        raise RuntimeError(f"{names[0]!r}: rank {rank} holds {local.shape[0]} rows of its FSDP2 shard where the"
                           f" chunk rule gives rows {bounds[rank]}:{bounds[rank + 1]} of {tensor.shape[0]};"
                           " shard-direct transfer needs torch.chunk row shards (as fully_shard makes them).")
    return [(fmt.pieces(name, tensor)[0].name, local) for name in names]


def _owned_pieces(name: str, tensor: DTensor, rank: int, fmt: CheckpointFormat, dtype: torch.dtype | None,
                  device: torch.device | str | None) -> Iterator[tuple[str, Tensor]]:
    """The checkpoint pieces of ``name`` in order: those this rank's rows make, converted here (cast first: the
    rules only copy and transpose), an empty ``(0, ...)`` tensor for each of the others."""
    local = _local_cast(tensor, dtype, device)
    lo = chunk_bounds(tensor.shape[0], tensor.device_mesh.size())[rank]
    shapes = {p.name: p.shape for p in fmt.pieces(name, tensor)}
    with torch.no_grad():
        for piece, converted in fmt.convert_local(name, tensor, local, lo):
            yield piece, (converted if converted is not None else
                          torch.empty((0, *shapes[piece][1:]), dtype=local.dtype, device=local.device))


def _local_cast(tensor: Tensor, dtype: torch.dtype | None, device: torch.device | str | None) -> Tensor:
    """This rank's shard of ``tensor``, cast to the wire dtype and on ``device`` (``None``: where it lives)."""
    assert isinstance(tensor, DTensor)
    local = tensor.to_local().detach()
    with torch.no_grad():
        return local.to(device=device if device is not None else local.device, dtype=wire_dtype(tensor, dtype))


class ShardSource(ExportSource):
    """:class:`~lightning_fsdp_export.export.source.ExportSource` of a shard-direct pass: ``metadata()`` also says,
    per tensor, which rows each rank yields (:class:`ShardMeta`); ``iter()`` is a :func:`shard_export` pass.

    Built by ``LazyExportFSDP2.export_source(layout="shards")``; ``weight_source(layout="m2n")`` its vLLM view.

    Args:
        entries: what one pass exports, in order (no collective).
        export: starts one pass yielding, per tensor, what ``layout`` says.
        layout: :func:`row_bounds` with this model's format and world bound.
        world: the trainer ranks.
        dtype: as for ``ExportSource``.
        show_progress: as for ``ExportSource``.
        checkpoint_format: as for ``ExportSource``.
        kind: as for ``ExportSource``.
    """

    def __init__(self, entries: Callable[[], Entries], export: Callable[[], Iterator[tuple[str, Tensor]]], *,
                 layout: Callable[[list[str], Tensor], Layout], world: int,
                 dtype: torch.dtype | None, show_progress: bool = False,
                 checkpoint_format: CheckpointFormat | None = None, kind: str = "merged") -> None:
        super().__init__(entries, export, dtype=dtype, show_progress=show_progress,
                         checkpoint_format=checkpoint_format, kind=kind)
        self.layout = layout
        self.world = world

    def metadata(self) -> list[ShardMeta]:
        """Every tensor of a pass, in order: checkpoint name, wire dtype, full shape, and the ranks' rows."""
        out = []
        for names, tensor in self._entries():
            layout = self.layout(names, tensor)
            for name in names:
                for piece in self._format.pieces(name, tensor):
                    bounds = (owner_bounds(layout[piece.name], piece.shape[0], self.world) if isinstance(layout, dict)
                              else layout)
                    out.append(ShardMeta(piece.name, wire_dtype(tensor, self.dtype), piece.shape, bounds))
        return out

    def full_tensors(self) -> list[str]:
        """Names of the tensors that go whole (gathered), not as every rank's rows."""
        return [m.name for m in self.metadata() if m.bounds is None]


class ShardSnapshot(ShardSource):
    """One pass of a :class:`ShardSource` taken now into host memory (this rank's parts, in the wire dtype: copied where
    they are the module's own or on a device; a cast or a gathered tensor the pass made on the host is kept as is), and
    replayed by every later iteration with no collective and no read of the module: what a background send reads while
    the model trains on (``RemoteVLLM`` over ``Gloo(shard_direct=True, background=True)``). Taking it is the pass (a
    collective: every rank takes its snapshot); ``nbytes`` is its host memory.
    """

    def __init__(self, source: ShardSource) -> None:
        meta, entries = source.metadata(), list(source._entries())  # read now: FSDP2 swaps params while it trains
        pin = torch.cuda.is_available()  # a GPU's shards: pinned host buffers (torch caches them across syncs)
        module = {_storage(tensor) for _, tensor in entries}
        pairs = [(name, _host_copy(tensor, pin) if tensor.device.type != "cpu" or _storage(tensor) in module
                  else tensor)  # never a view of a parameter; a host tensor the pass made (cast, gathered) is kept
                 for name, tensor in source]
        if pin:
            torch.cuda.synchronize()  # the copies were queued without waiting: all are done before it is read
        super().__init__(lambda: entries, lambda: iter(pairs), layout=source.layout, world=source.world,
                         dtype=source.dtype, checkpoint_format=source._format, kind=source.kind)
        self._meta = meta
        self.nbytes = sum(t.numel() * t.element_size() for _, t in pairs)

    def metadata(self) -> list[ShardMeta]:
        """The metadata of the pass it holds (read when it was taken)."""
        return self._meta


def _storage(tensor: Tensor) -> int:
    """The address of the storage under ``tensor`` (a DTensor's local shard's): equal for every view of it."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.untyped_storage().data_ptr()


def _host_copy(tensor: Tensor, pin: bool) -> Tensor:
    """A copy of ``tensor`` in host memory (pinned, and queued without waiting, from a GPU)."""
    out = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin)
    return out.copy_(tensor.detach(), non_blocking=pin)

