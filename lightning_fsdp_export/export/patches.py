"""Sparse syncs: each rank's copy of what it last sent, and the patches of the elements that changed; torch only.

RL steps move few bf16 values (a few percent per step at the learning rates RL uses), so after the first push a
rank can send only ``(index, value)`` pairs of its own part of each tensor. :class:`PatchBase` holds, on the host
and in the wire dtype, what this rank last sent of each tensor (its rows of each FSDP2 shard; rank 0 also the
tensors sent whole), and the version the engine confirmed for it. One round::

    sparse = base.can_patch(confirmed, plan)     # every rank, agreed by all (the round is sparse or dense for all)
    base.start(version, plan, sparse=sparse)     # a dense round forgets the copy and keeps what it sends
    patch = base.take(name, part)                # per tensor: a Patch, or None (send ``part`` dense)
    base.succeeded() / base.failed()             # the round's outcome on every member of the group

The copy is updated as each tensor is taken (no second copy during a round); a round that fails leaves it
invalid, so :meth:`PatchBase.failed` forgets it and the next round is dense. A patch names its elements by int32
flat indices (vLLM 0.33's ``SparseWeightPatch`` format: 6 bytes per changed bf16 element) or, where the
receiver takes them (``PatchBase(bitmaps=True, coded=True)``: our gloo wire) and that is smaller, by a bitmap of the
part (1 bit per element, then 2 bytes per changed one) or in the coded form (:mod:`.patch_codes`: the gaps between
changed elements, about a byte each at RL's learning rates, and each value's step from the previous one, a byte):
each part goes in the smallest form, or whole, so for bf16 a patch pays while under a third of the elements changed
with indices only, under 94% with bitmaps (the coded form is tried only where it may save an eighth of the part: over
7/8 of a bf16 part changed, coding it would cost more CPU than its bytes save). A patch is
only ever made against the version the engine last confirmed (``confirmed`` is the sync's, every rank
agreeing); a new plan (another model, dtype, layout) is dense.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_fsdp_export.export.patch_codes import encode_positions, steps

__all__ = ["INDEX_DTYPE", "Patch", "PatchBase", "PatchStats", "bitmap_nbytes", "changed_mask", "coded_nbytes",
           "pack_bits", "patch_nbytes", "unpack_bits"]

INDEX_DTYPE = torch.int32  # flat offsets into a rank's part (vLLM 0.33's sparse_nccl uses int32 too)
_MAX_ELEMENTS = torch.iinfo(INDEX_DTYPE).max  # a part this large goes dense
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MAX_CODED = 1 << 28  # the most elements of a coded patch the gloo wire's count code holds


@dataclass(frozen=True)
class Patch:
    """The elements of one part that changed and their new ``values`` (in the part's flat order), named by flat
    ``indices`` into the part (``int32``), by a ``bitmap`` of the part (:func:`pack_bits`) or by ``positions`` (the
    gaps between them in LEB128, :mod:`~lightning_fsdp_export.export.patch_codes`); the other two are None.
    ``stepped``: ``values`` are int8 steps from the previous values (:func:`~.patch_codes.steps`), not the values,
    and ``positions`` holds the escaped elements' moves after the gaps."""

    indices: Tensor | None
    values: Tensor
    bitmap: Tensor | None = None
    positions: Tensor | None = None
    stepped: bool = False

    @property
    def count(self) -> int:
        return int(self.values.numel())

    @property
    def names(self) -> Tensor:
        """What names the elements on the wire: the indices, the bitmap or the positions."""
        found = next((t for t in (self.indices, self.bitmap, self.positions) if t is not None), None)
        assert found is not None
        return found


def patch_nbytes(count: int, itemsize: int) -> int:
    """Bytes of a patch of ``count`` elements (unaligned): int32 indices and values."""
    return count * (INDEX_DTYPE.itemsize + itemsize)


def coded_nbytes(positions: int, count: int, value_size: int) -> int:
    """Bytes of a coded patch (unaligned): ``positions`` bytes, and ``count`` values (or steps) of ``value_size``."""
    return positions + count * value_size


def bitmap_nbytes(numel: int, count: int, itemsize: int) -> int:
    """Bytes of a bitmap patch of ``count`` of a part's ``numel`` elements (unaligned): the bitmap and values."""
    return -(-numel // 8) + count * itemsize


_BIT_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)  # element 8k + j is bit j of byte k


def pack_bits(mask: Tensor) -> Tensor:
    """A flat bool ``mask`` as ``ceil(n / 8)`` bytes (uint8): element ``8k + j`` is bit ``j`` of byte ``k``."""
    flat = mask.reshape(-1)
    pad = -flat.numel() % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    bits = flat.view(-1, 8).view(torch.uint8)  # (eight shifted ORs: 2x faster than a weighted sum over rows of 8)
    out = bits[:, 0].clone()
    for j in range(1, 8):
        out |= bits[:, j] << j
    return out


def unpack_bits(bitmap: Tensor, numel: int) -> Tensor:
    """The flat bool mask of ``numel`` elements :func:`pack_bits` made ``bitmap`` from."""
    if bitmap.numel() != -(-numel // 8):
        raise ValueError(f"a bitmap of {bitmap.numel()} bytes cannot mark {numel} elements")
    return (bitmap.view(-1, 1) & _BIT_WEIGHTS.to(bitmap.device)).ne(0).view(-1)[:numel]


def changed_mask(new: Tensor, old: Tensor) -> Tensor:
    """A flat bool mask of the elements whose bits differ (a NaN or a -0.0 is a change like any other)."""
    bits = _BITS[new.element_size()]
    return new.reshape(-1).view(bits) != old.reshape(-1).view(bits)


@dataclass
class PatchStats:
    """One round on this rank: elements of its parts, how many changed, and the tensors sent each way."""

    elements: int = 0
    changed: int = 0
    """Elements that changed since the copy (counted in sparse rounds only)."""
    patched: int = 0
    bitmaps: int = 0
    """Of the ``patched`` parts, those whose elements a bitmap names."""
    coded: int = 0
    """Of the ``patched`` parts, those in the coded form (gaps; steps where they fit): the rest by int32 indices."""
    dense: int = 0
    dense_bytes: int = 0
    """Bytes a dense round would have sent of this rank's parts (unaligned, one copy)."""
    wire_bytes: int = 0
    """Bytes this round sends of this rank's parts: patches and dense parts (unaligned, one copy)."""
    seconds: float = 0.0
    """Time spent comparing and copying (``take``) this round."""

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class PatchBase:
    """What this rank last sent of each tensor (host copies in the wire dtype) and the version the engine holds.

    ``version`` is set only once the round that sent it succeeded on every member of the transfer group; while
    a round runs, and after one fails, it is ``None`` (nothing to patch against). ``bitmaps``: the receiver also
    takes patches whose elements a bitmap names (our gloo wire does; vLLM's ``SparseWeightPatch`` does not)."""

    bitmaps: bool = False
    coded: bool = False
    """The receiver also takes coded patches (:mod:`~lightning_fsdp_export.export.patch_codes`: our gloo wire)."""
    tensors: dict[str, Tensor] = field(default_factory=dict)
    version: int | None = None
    plan: Any = None
    sparse: bool = False
    stats: PatchStats = field(default_factory=PatchStats)
    _round: int | None = None

    @property
    def nbytes(self) -> int:
        """Host bytes the copy holds (this rank's parts of every tensor it sends)."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def can_patch(self, confirmed: int | None, plan: Any) -> bool:
        """This rank can send patches against ``confirmed`` (the version the engine holds, every rank agreeing)."""
        return self.version is not None and confirmed == self.version and plan == self.plan

    def start(self, version: int, plan: Any, *, sparse: bool) -> None:
        """Begin the round of ``version``: ``sparse`` patches against the copy; else the copy is rebuilt."""
        if sparse and not self.can_patch(self.version, plan):
            raise RuntimeError("PatchBase.start(sparse=True) without a confirmed copy of the same plan.")
        if not sparse:
            self.tensors = {}
        self.version, self.plan, self.sparse, self._round = None, plan, sparse, version
        self.stats = PatchStats()

    def take(self, name: str, part: Tensor) -> Patch | None:
        """This rank's ``part`` of tensor ``name`` this round: its patch against the copy where the round is sparse
        and the patch is smaller, else ``None`` (send ``part`` whole). Either way the copy becomes ``part``."""
        start = time.perf_counter()
        try:
            return self._take(name, part)
        finally:
            self.stats.seconds += time.perf_counter() - start

    def _take(self, name: str, part: Tensor) -> Patch | None:
        host = part.detach().to("cpu")
        itemsize, numel = host.element_size(), host.numel()
        stats = self.stats
        stats.elements += numel
        stats.dense_bytes += numel * itemsize
        old = self.tensors.get(name)
        if not self.sparse or old is None or old.shape != host.shape or old.dtype != host.dtype:
            self.tensors[name] = (host.clone(memory_format=torch.contiguous_format)
                                  if host.data_ptr() == part.data_ptr()
                                  else host.contiguous())  # never the module's storage; flat-indexable
            stats.dense += 1
            stats.wire_bytes += numel * itemsize
            return None
        mask = changed_mask(host, old)
        count = int(torch.count_nonzero(mask))  # (a bool sum is 20x slower on the host)
        stats.changed += count
        by_index = patch_nbytes(count, itemsize) if numel <= _MAX_ELEMENTS else math.inf
        by_bitmap = bitmap_nbytes(numel, count, itemsize) if self.bitmaps else math.inf
        flat = host.reshape(-1)
        index = values = coded = None  # found only where a patch is made (a dense part never needs them)
        # coding costs ~45 ns an element here: only where it may save an eighth of the part (each element costs at
        # least a byte of gap and a byte of step), so a part that nearly all changed goes whole without it
        if self.coded and count < _MAX_CODED and 16 * count <= 7 * numel * itemsize:
            index = mask.nonzero().squeeze(1)  # (with the gather, 3x faster than masked_select on the host)
            values = flat[index]
            moved = steps(values, old.reshape(-1)[index])
            coded = (Patch(None, values, positions=encode_positions(index)) if moved is None  # values as they are
                     else Patch(None, moved[0], positions=encode_positions(index, moved[1]), stepped=True))
        by_coded = (coded_nbytes(coded.positions.numel(), count, 1 if coded.stepped else itemsize)
                    if coded is not None and coded.positions is not None else math.inf)
        old.copy_(host)  # the copy becomes the part whatever goes on the wire
        if min(by_index, by_bitmap, by_coded) >= numel * itemsize:
            stats.dense += 1
            stats.wire_bytes += numel * itemsize
            return None
        stats.patched += 1
        if coded is not None and by_coded <= min(by_index, by_bitmap):
            stats.coded += 1
            stats.wire_bytes += int(by_coded)
            return coded
        if index is None or values is None:
            index = mask.nonzero().squeeze(1)
            values = flat[index]
        if by_bitmap < by_index:
            stats.bitmaps += 1
            stats.wire_bytes += int(by_bitmap)
            return Patch(None, values, pack_bits(mask))
        stats.wire_bytes += int(by_index)
        return Patch(index.to(INDEX_DTYPE), values)

    def succeeded(self) -> None:
        """The round succeeded on every member of the group: the copy is what the engine holds now."""
        self.version = self._round

    def failed(self) -> None:
        """The round failed (or the engine's weights changed otherwise): forget the copy; the next round is dense."""
        self.tensors, self.version, self.plan = {}, None, None
