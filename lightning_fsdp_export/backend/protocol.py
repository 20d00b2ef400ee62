"""The wire protocol of the ``gloo`` weight-transfer backend (:mod:`lightning_fsdp_export.backend.gloo`): the
round's plan, shared by the trainer ranks and the workers, and the group's control messages; torch only.

A round is the tensors of one update info, cut into chunks (consecutive tensors until their full size
passes the buffer); per chunk every trainer rank sends its part (its rows of row-sharded tensors, rank 0
also the whole ones), each tensor's bytes padded to ``ALIGN``. Before each chunk and after the last one,
every member all-reduces a header ``(code, origin)`` (MIN: an abort beats an end, an end beats more data;
``origin`` is the first trainer rank that aborted); after the end, a status (MAX: anyone failed).

A sparse round (``patch_of`` in the update info) sends, per chunk and trainer rank with a part in it, first its
``counts`` (int64, one code per tensor of the chunk: ``WHOLE`` (-1), ``n >= 0`` a patch of ``n`` elements by
int32 flat indices into the part, ``-2 - n`` a patch of ``n`` elements by a bitmap of the part, codes below
``-2**62`` a coded patch: :func:`patch_code`), then its payload: per tensor its part whole, or a patch (its indices,
bitmap or gaps, then the values or their int8 steps), each piece padded to ``ALIGN``.
The worker applies the patches to the copy it kept of the previous round.

A staged round (``stage_as``, ``Gloo(background=True)``) is received by a thread of each worker into host memory; after
the end header every member all-reduces a digest table (each trainer rank's bytes and CRC-32 of all it sent,
:func:`exchange_digests`), every worker compares it with what it received, and the status says whether anyone
failed. A later swap round (``swap_to``, no tensors) loads it.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from lightning_fsdp_export._network import gloo_group, is_loopback, route_address
from lightning_fsdp_export.backend.abandon import Abandon, wait_for
from lightning_fsdp_export.export.patch_codes import apply_steps, decode_positions
from lightning_fsdp_export.export.patches import unpack_bits

DATA, END, ABORT = 1, 0, -1
NOBODY = 1 << 62  # the origin a member that did not abort reports (the all-reduce keeps the smallest)
ALIGN = 16  # every part starts at a multiple of this many bytes, so each unpacks as a view of its dtype
CPU = torch.device("cpu")


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    bounds: tuple[int, ...] | None
    same_as: str | None = None  # an earlier tensor's name (a tied head): nothing is sent for this one

    def part(self, rank: int) -> int:
        """Bytes trainer ``rank`` sends of this tensor."""
        if self.same_as is not None:
            return 0
        if self.bounds is None:
            return math.prod(self.shape) * self.dtype.itemsize if rank == 0 else 0
        row = math.prod(self.shape[1:]) * self.dtype.itemsize
        return (self.bounds[rank + 1] - self.bounds[rank]) * row

    def span(self, rank: int) -> tuple[int, int]:
        """Flat element offsets ``[start, end)`` of trainer ``rank``'s part in the full tensor."""
        if self.bounds is None:
            return (0, math.prod(self.shape)) if rank == 0 else (0, 0)
        row = math.prod(self.shape[1:])
        return self.bounds[rank] * row, self.bounds[rank + 1] * row


class Plan:
    """The round's cut into chunks (consecutive tensors until their full size passes ``buffer_bytes``) and each
    trainer rank's share of each chunk: computed alike by the trainer ranks and the workers from the update info."""

    def __init__(self, tensors: list[PlannedTensor], trainers: int, buffer_bytes: int) -> None:
        self.tensors = tensors
        self.trainers = trainers
        self.chunks: list[list[PlannedTensor]] = []
        total = 0
        for tensor in tensors:
            if not self.chunks or total > buffer_bytes:
                self.chunks.append([])
                total = 0
            self.chunks[-1].append(tensor)
            total += tensor.part(0) if tensor.bounds is None else sum(tensor.part(r) for r in range(trainers))

    @property
    def nbytes(self) -> int:
        """Bytes of the round's tensors at full size."""
        return sum(math.prod(t.shape) * t.dtype.itemsize for t in self.tensors)

    def segment(self, chunk: list[PlannedTensor], rank: int) -> int:
        """Bytes trainer ``rank`` sends of ``chunk`` (each part padded to ``ALIGN``)."""
        return sum(aligned(t.part(rank)) for t in chunk)

    @classmethod
    def of(cls, info: Any, trainers: int, buffer_bytes: int) -> Plan:
        """From a ``GlooWeightTransferUpdateInfo`` (names, dtype names, shapes, bounds)."""
        bounds = info.bounds or [None] * len(info.names)
        ties = info.same_as or {}
        tensors = []
        for name, dtype_name, shape, rows in zip(info.names, info.dtype_names, info.shapes, bounds):
            if rows is not None and (len(rows) != trainers + 1 or not shape or rows[0] != 0 or rows[-1] != shape[0]
                                     or any(a > b for a, b in zip(rows, rows[1:]))):
                raise ValueError(f"gloo update_info: bounds {rows} of {name!r} {list(shape)} are not row offsets over"
                                 f" {trainers} trainer ranks.")
            tensors.append(PlannedTensor(name, getattr(torch, dtype_name), tuple(shape),
                                         None if rows is None else tuple(rows), ties.get(name)))
        return cls(tensors, trainers, buffer_bytes)


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


WHOLE = -1  # a sparse round's count code of a part sent whole
_CODED = -(1 << 62)  # codes at or below: a coded patch, ``_CODED - (count << 33 | positions bytes << 1 | stepped)``


def patch_code(count: int, bitmap: bool, positions: int | None = None, stepped: bool = False) -> int:
    """The count code of a patch of ``count`` elements: by indices, by a bitmap of the part, or coded (``positions``
    bytes of gaps; ``stepped``: int8 steps for values)."""
    if positions is not None:
        if count >= 1 << 28 or positions >= 1 << 32:
            raise ValueError(f"a coded patch of {count} elements and {positions} position bytes is too large.")
        return _CODED - (count << 33 | positions << 1 | int(stepped))
    return -2 - count if bitmap else count


def decode(code: int) -> tuple[int, bool]:
    """``(count, bitmap)`` of a patch's count code (not ``WHOLE``, not coded: :func:`decode_coded`)."""
    return (-2 - code, True) if code < WHOLE else (code, False)


def decode_coded(code: int) -> tuple[int, int, bool] | None:
    """``(count, positions bytes, stepped)`` of a coded patch's count code, or ``None`` for another code."""
    if code > _CODED:
        return None
    value = _CODED - code
    return value >> 33, (value >> 1) & 0xFFFFFFFF, bool(value & 1)


def wire_part(tensor: PlannedTensor, rank: int, code: int) -> int:
    """Bytes (aligned) of trainer ``rank``'s part of ``tensor`` in a sparse round, from its count code."""
    if code == WHOLE:
        return aligned(tensor.part(rank))
    coded = decode_coded(code)
    if coded is not None:
        count, positions, stepped = coded
        return aligned(positions) + aligned(count * (1 if stepped else tensor.dtype.itemsize))
    count, bitmap = decode(code)
    start, end = tensor.span(rank)
    return aligned(-(-(end - start) // 8) if bitmap else count * 4) + aligned(count * tensor.dtype.itemsize)


def sparse_segment(chunk: list[PlannedTensor], rank: int, counts: list[int]) -> int:
    """Bytes trainer ``rank`` sends of ``chunk`` in a sparse round, given its ``counts``."""
    return sum(wire_part(t, rank, c) for t, c in zip(chunk, counts) if t.part(rank))


class PatchTarget(Protocol):
    """Where a sparse round writes one tensor, by flat positions: the worker's host copy (:class:`HostCopy`), or the
    engine's parameters themselves (``backend.inplace.Placed``)."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def put(self, start: int, values: torch.Tensor) -> None: ...

    def get(self, positions: torch.Tensor) -> torch.Tensor: ...

    def set(self, positions: torch.Tensor, values: torch.Tensor) -> None: ...


class HostCopy:
    """A :class:`PatchTarget` over a tensor the worker keeps."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.flat, self.shape, self.dtype = tensor.view(-1), tuple(tensor.shape), tensor.dtype

    def put(self, start: int, values: torch.Tensor) -> None:
        self.flat[start:start + values.numel()] = values

    def get(self, positions: torch.Tensor) -> torch.Tensor:
        return self.flat[positions]

    def set(self, positions: torch.Tensor, values: torch.Tensor) -> None:
        self.flat[positions] = values


def patch_chunk(chunk: list[PlannedTensor], parts: list[torch.Tensor | None], counts: list[list[int] | None],
                trainers: int, base: Mapping[str, torch.Tensor | PatchTarget], *,
                fresh: bool = True, changed: set[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """A sparse round's chunk: each tensor is its copy in ``base`` (the previous round's, updated here in place)
    with every trainer rank's part written whole or patched; yielded as a fresh tensor (the copy stays ours), or
    with ``fresh=False`` as the copy itself (a staged round, which loads from the copy later). A tensor whose entry in
    ``base`` is a :class:`PatchTarget` (the engine's parameters) is written there and not yielded. ``changed``
    collects the names of the tensors something was written into (a part sent whole, or a patch of any element)."""
    offsets = [0] * trainers
    for i, tensor in enumerate(chunk):
        if tensor.same_as is not None:
            continue  # (the worker yields the tensor it is the same as: tied)
        full = base.get(tensor.name)
        if full is None or tuple(full.shape) != tensor.shape or full.dtype != tensor.dtype:
            raise RuntimeError(f"sparse round: this worker keeps no copy of {tensor.name!r} {tensor.dtype}"
                               f" {list(tensor.shape)} to patch; the next sync pushes every tensor whole.")
        target = HostCopy(full) if isinstance(full, torch.Tensor) else full
        written = False
        for rank in range(trainers):
            if tensor.part(rank):
                written = _patch_part(tensor, rank, counts[rank], i, parts[rank], offsets, target) or written
        if written and changed is not None:
            changed.add(tensor.name)
        if isinstance(full, torch.Tensor):
            yield tensor.name, full.clone() if fresh else full


def _patch_part(tensor: PlannedTensor, rank: int, rank_counts: list[int] | None, i: int, part: torch.Tensor | None,
                offsets: list[int], target: PatchTarget) -> bool:
    """Write trainer ``rank``'s part of ``tensor`` (whole, or its patch) into ``target``; whether anything was."""
    start, end = tensor.span(rank)
    assert rank_counts is not None  # a rank with a part sent its counts
    code, elements = rank_counts[i], end - start
    if code == WHOLE:
        target.put(start, _take(part, offsets, rank, elements, tensor.dtype))
        return True
    coded = decode_coded(code)
    if coded is not None:
        count, positions, stepped = coded
        where, escapes = _positions(_take(part, offsets, rank, positions, torch.uint8), count, elements, stepped,
                                    tensor.name, rank)
        if count:
            moved = _take(part, offsets, rank, count, torch.int8 if stepped else tensor.dtype)
            where = where.long() + start
            target.set(where, apply_steps(target.get(where), moved, escapes) if stepped else moved)
        return count > 0
    count, bitmap = decode(code)
    if bitmap:
        mask = unpack_bits(_take(part, offsets, rank, -(-elements // 8), torch.uint8), elements)
        where = torch.nonzero(mask).view(-1)  # (a bool sum is 20-40x slower on the host than counting)
        if where.numel() != count:
            raise RuntimeError(f"sparse round: trainer rank {rank}'s bitmap of {tensor.name!r} marks {where.numel()}"
                               f" elements, its counts say {count}.")
    else:
        where = _take(part, offsets, rank, count, torch.int32)
        if count and (int(where.min()) < 0 or int(where.max()) >= elements):
            raise RuntimeError(f"sparse round: trainer rank {rank}'s patch of {tensor.name!r} indexes outside"
                               f" its {elements} elements.")
        where = where.long()
    if count:  # (none: a rank may send no payload at all)
        target.set(where + start, _take(part, offsets, rank, count, tensor.dtype))
    return count > 0


def _positions(stream: torch.Tensor, count: int, elements: int, stepped: bool, name: str,
               rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The flat indices a coded patch's gaps name (checked to lie in the part), and the escaped moves after them."""
    try:
        where, escapes = decode_positions(stream, count)
        if escapes.numel() and not stepped:
            raise ValueError(f"{escapes.numel()} numbers past the {count} gaps of a patch without steps")
    except ValueError as err:
        raise RuntimeError(f"sparse round: trainer rank {rank}'s coded patch of {name!r}: {err}") from None
    if count and int(where[-1]) >= elements:
        raise RuntimeError(f"sparse round: trainer rank {rank}'s patch of {name!r} indexes outside its {elements}"
                           " elements.")
    return where, escapes


def _take(part: torch.Tensor | None, offsets: list[int], rank: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    """The next ``count`` elements of ``dtype`` from trainer ``rank``'s payload (its offset moves past them,
    aligned)."""
    nbytes = count * dtype.itemsize
    if not nbytes:
        return torch.empty(0, dtype=dtype)  # nothing changed: a rank may then send no payload at all
    assert part is not None
    start = offsets[rank]
    offsets[rank] += aligned(nbytes)
    return part[start:start + nbytes].view(dtype)


def join_group(address: str, port: int, rank: int, world_size: int, group: str, timeout_s: float,
          *, host: bool, device: torch.device = CPU) -> tuple[Any, dist.TCPStore]:
    """The transfer group, straight from a TCPStore (not vLLM's ``init_gloo_process_group``, which swaps fd 1 while it
    runs, and not torch's default group, which belongs to the trainer): gloo over CPU sockets, or NCCL on ``device``
    (a CUDA device: the ``staged_nccl`` backend). A ``ProcessGroupGloo`` or ``ProcessGroupNCCL`` used as a group
    (``Any``: torch's stubs type these backends apart from ``ProcessGroup``, though they answer the same calls)."""
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(address, port, world_size if host else None, is_master=host, timeout=timeout,
                          wait_for_workers=False)
    prefixed = dist.PrefixStore(f"lfe-gloo/{group}", store)
    if device.type == "cpu":  # bound to the interface that reaches the store's host (never 127.0.1.1 for a peer)
        return gloo_group(prefixed, rank, world_size, timeout, peer=address), store
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    # torch's default on a collective that fails is to end the process: a vLLM server must outlive its trainer, so this
    # group asks to only abort its communicators, with no debug dump first and no heartbeat monitor. torch reads some of
    # these only later (on one H200 it still signalled a dump: docs/limitations.md); set only around the construction,
    # they never change the process's other groups.
    with _environment(TORCH_NCCL_ASYNC_ERROR_HANDLING="2", TORCH_NCCL_DUMP_ON_TIMEOUT="0",
                      TORCH_NCCL_ENABLE_MONITORING="0"):
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, options), store


@dataclass(frozen=True)
class Relays:
    """Which workers a round's parts reach through another worker, so that the bytes cross each host's link once.

    The trainer ranks send each part to the workers on trainer rank 0's host and to one worker per other host (its
    relay, the host's lowest rank); a relay forwards every part to the other workers of its host (its followers) as
    soon as it has arrived, over the host's loopback. Found by :func:`find_relays` (gloo only: NCCL matches point-to-
    point messages by order, not by tag, and its GPUs' links are another story)."""

    source: dict[int, int] = field(default_factory=dict)
    """A follower's relay, by the follower's rank."""
    followers: dict[int, list[int]] = field(default_factory=dict)
    """A relay's followers, by the relay's rank."""

    def receivers(self, workers: range) -> list[int]:
        """The workers the trainer ranks send to: every one that no relay serves."""
        return [w for w in workers if w not in self.source]


def find_relays(store: dist.Store, group: str, rank: int, world_size: int, trainers: int, master_address: str,
                device: torch.device) -> Relays:
    """Every member of the group calls it after joining (through the store: each worker says the address it reaches the
    store from, then every member reads them all): the :class:`Relays` of this group. Workers on the store's host
    (loopback, or its address) take the trainers' sends directly; workers that share another address share a host.
    None on a ``device`` other than the host's (NCCL: no relays)."""
    if device.type != "cpu":
        return Relays()
    keys = dist.PrefixStore(f"lfe-relays/{group}", store)
    if rank >= trainers:
        keys.set(str(rank), route_address(master_address))
    home = socket.gethostbyname(master_address)
    hosts: dict[str, list[int]] = {}
    for worker in range(trainers, world_size):
        address = keys.get(str(worker)).decode()
        if not is_loopback(address) and address != home:
            hosts.setdefault(address, []).append(worker)
    relays = Relays()
    for ranks in hosts.values():
        if len(ranks) > 1:
            relays.followers[ranks[0]] = ranks[1:]
            relays.source.update((follower, ranks[0]) for follower in ranks[1:])
    return relays


def relay_tag(tag: int, trainer_rank: int, trainers: int) -> int:
    """The tag a relay forwards trainer rank ``trainer_rank``'s message of tag ``tag`` under (one source: the relay)."""
    return tag * trainers + trainer_rank


@contextlib.contextmanager
def _environment(**values: str) -> Iterator[None]:
    old = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in old.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def exchange_header(pg: dist.ProcessGroup, code: int = DATA, origin: int = NOBODY, *, device: torch.device = CPU,
                    timeout: timedelta | None = None, abandon: Abandon | None = None) -> tuple[int, int]:
    """Every member's ``(code, origin)``, reduced to the smallest: an abort by any trainer rank (and the first
    rank that aborted) wins over an end, an end over more data. ``device``: where the group's tensors live;
    ``timeout``: how long to wait for the others (default: the group's; NCCL's needs it to wait on the host, where a
    dead peer is seen); ``abandon``: the group's (gloo), which ends the wait within a second of trainer rank 0 leaving
    the round. The exchanges below take all three too."""
    message = torch.tensor([code, origin], dtype=torch.int64, device=device)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp(dist.ReduceOp.MIN)
    _wait(pg.allreduce([message], opts), timeout, abandon)
    return int(message[0]), int(message[1])


def exchange_status(pg: dist.ProcessGroup, failed: bool, *, device: torch.device = CPU,
                    timeout: timedelta | None = None, abandon: Abandon | None = None) -> bool:
    """Whether any member of the group failed this round (an all-reduce of everyone's flag)."""
    flag = torch.tensor([1 if failed else 0], dtype=torch.int64, device=device)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp(dist.ReduceOp.MAX)
    _wait(pg.allreduce([flag], opts), timeout, abandon)
    return bool(flag.item())


def exchange_digests(pg: dist.ProcessGroup, trainers: int, mine: tuple[int, int, int] | None, *,
                     device: torch.device = CPU, timeout: timedelta | None = None,
                     abandon: Abandon | None = None) -> list[tuple[int, int]]:
    """A staged round's check: every trainer rank's ``(bytes, digest)`` of what it sent, on every member (a trainer
    rank gives ``mine`` as ``(its rank, bytes, digest)``; a worker ``None``): an all-reduce (sum) of one row each."""
    table = torch.zeros(trainers, 2, dtype=torch.int64, device=device)
    if mine is not None:
        rank, nbytes, crc = mine
        table[rank] = torch.tensor([nbytes, crc], dtype=torch.int64, device=device)
    _wait(pg.allreduce([table]), timeout, abandon)
    return [(int(n), int(c)) for n, c in table.tolist()]


def _wait(work: Any, timeout: timedelta | None, abandon: Abandon | None) -> None:
    if timeout is None:
        work.wait()
    else:
        wait_for(work, timeout, abandon, collective=True)


def crc32(crc: int, tensor: torch.Tensor | None) -> int:
    """``crc`` extended by ``tensor``'s bytes: their CRC-32 for a host tensor, :func:`device_checksum` for a device
    one (both ends of a group hold their tensors on the same kind of device; ``None``: nothing)."""
    if tensor is None or not tensor.numel():
        return crc
    if tensor.device.type != "cpu":
        return device_checksum(crc, tensor)
    host = tensor.contiguous().view(-1).view(torch.uint8).numpy()
    return zlib.crc32(host, crc)  # type: ignore[arg-type]  # (an ndarray is a buffer; numpy 2.3's stubs omit it)


CHECKSUM_MOD = (1 << 31) - 1  # a prime: the checksum stays an int64 through the group's all-reduce


def device_checksum(previous: int, tensor: torch.Tensor) -> int:
    """``previous`` extended by ``tensor``'s bytes, computed where the tensor lives (no copy to the host): each byte
    weighted by its position (mod 65521, plus one), summed, folded with ``previous`` modulo :data:`CHECKSUM_MOD`.
    Sees a changed, missing, extra or moved byte (not a cryptographic hash: the wire is trusted, the count of what
    arrived is what it checks)."""
    # each product is < 2^24, so int32 holds the bytes and weights (half of int64's transient memory), except for the
    # positions of a part of 2 GiB or more
    data = tensor.contiguous().view(-1).view(torch.uint8).to(torch.int32)
    positions = torch.int32 if data.numel() < 1 << 31 else torch.int64
    weights = torch.arange(data.numel(), device=data.device, dtype=positions).remainder_(65521).add_(1)
    value = int((data * weights).sum(dtype=torch.int64).remainder(CHECKSUM_MOD))
    return (previous * 65537 + value + data.numel()) % CHECKSUM_MOD


def abort_message(origin: int) -> str:
    return (f"trainer rank {origin} aborted this weight update round (it failed while exporting); the model is"
            " incomplete until the next full round")


def unpack_chunk(chunk: list[PlannedTensor], parts: list[torch.Tensor | None],
                 trainers: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The chunk's tensors: a whole one is a view of rank 0's part; a row-sharded one a fresh tensor of every
    rank's rows."""
    offsets = [0] * trainers
    for tensor in chunk:
        if tensor.same_as is not None:
            continue  # (the worker yields the tensor it is the same as: tied)
        if tensor.bounds is None:
            yield tensor.name, part_view(parts[0], offsets, 0, tensor, tensor.shape)
            continue
        given = next(p for p in parts if p is not None)  # pinned host parts (NCCL's host staging) stay pinned
        full = torch.empty(tensor.shape, dtype=tensor.dtype, device=given.device,
                           pin_memory=given.device.type == "cpu" and given.is_pinned())
        for rank in range(trainers):
            lo, hi = tensor.bounds[rank], tensor.bounds[rank + 1]
            if hi > lo:
                full[lo:hi] = part_view(parts[rank], offsets, rank, tensor, (hi - lo, *tensor.shape[1:]))
        yield tensor.name, full


def part_view(part: torch.Tensor | None, offsets: list[int], rank: int, tensor: PlannedTensor,
          shape: tuple[int, ...]) -> torch.Tensor:
    nbytes = tensor.part(rank)
    assert part is not None
    start = offsets[rank]
    offsets[rank] += aligned(nbytes)
    return part[start:start + nbytes].view(tensor.dtype).view(shape)
