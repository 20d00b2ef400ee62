"""The trainer half of the ``gloo`` backend (:mod:`.gloo`): the engine every trainer rank of the transfer group builds
(``WeightTransferTrainerFactory``), which sends each round's chunks from a ``WeightSource``; a round's payload beyond
the weights is its :class:`GlooRound` argument."""

from __future__ import annotations

import contextlib
import contextvars
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import TrainerWeightTransferEngine, VLLMWeightSyncClient, WeightSource

from lightning_fsdp_export._compat import iter_full, source_metadata
from lightning_fsdp_export._network import rendezvous
from lightning_fsdp_export.backend.abandon import Abandon, wait_for
from lightning_fsdp_export.backend.infos import (
    DEFAULT_BUFFER_BYTES,
    DEFAULT_TIMEOUT_S,
    GlooTrainerInitInfo,
    GlooWeightTransferInitInfo,
    GlooWeightTransferUpdateInfo,
)
from lightning_fsdp_export.backend.protocol import (
    ABORT,
    CPU,
    END,
    WHOLE,
    Plan,
    PlannedTensor,
    abort_message,
    aligned,
    crc32,
    exchange_digests,
    exchange_header,
    exchange_status,
    find_relays,
    join_group,
    patch_code,
    sparse_segment,
)
from lightning_fsdp_export.backend.shared import register_backends
from lightning_fsdp_export.export.patches import PatchBase

__all__ = ["DENSE", "GlooRound", "GlooTrainerWeightTransferEngine", "register", "swap_update_info"]


@runtime_checkable
class DraftingClient(Protocol):
    """A client that also starts a drafter's round (``/start_draft_weight_update``): this package's own clients."""

    def start_draft_weight_update(self) -> None: ...


@dataclass(frozen=True)
class GlooRound:
    """What one round carries beside the source's weights: the argument of
    :meth:`GlooTrainerWeightTransferEngine.send_weights` (vLLM's engines take per-round inputs as arguments, never
    as state set on the engine).

    Attributes:
        adapter: ``(adapter_dir, adapter_config)``: the source holds a peft adapter's tensors, which the workers write
            as a peft directory at ``adapter_dir`` on their hosts (see ``GlooWeightTransferUpdateInfo``).
        patches: this rank's copy of what it last sent (``patches.sparse``: send patches against it; else send dense
            and keep a new copy); ``None``: a plain dense round.
        patch_of: rank 0, with ``patches``: the workers' copy the patches apply to (``None``: a dense round).
        keep_as: rank 0, with ``patches``: the id under which the workers keep this round's copy.
        stage_as: a staged round (``Gloo(background=True)``): the workers receive it in a thread under this id while
            their engines go on generating, and load it only at a swap round (``swap_update_info``); every member
            checks each trainer rank's bytes and CRC-32 before the round succeeds. Every rank of the group gives it.
        draft: rank 0: the source is a speculative-decoding drafter's, loaded into each server's draft model (the
            session starts with ``/start_draft_weight_update``).
        source: this round's ``WeightSource`` (every rank; ``None``: the one the engine was built with, vLLM's
            contract for its own engines, which read the source they were given at ``trainer_init``).
    """

    adapter: tuple[str, str] | None = None
    patches: PatchBase | None = None
    patch_of: str | None = None
    keep_as: str | None = None
    stage_as: str | None = None
    draft: bool = False
    source: WeightSource | None = None


DENSE = GlooRound()
"""A plain round: the model's weights, whole or in shard rows, loaded by the workers."""


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """Trainer side: rank 0 hosts the store and drives the workers; every rank in the group sends its parts.

    ``sent_bytes`` is what this rank sent in the last round (each worker's copy counted; also returned by
    :meth:`send_weights`)."""

    init_info_cls = GlooTrainerInitInfo
    wire_device = CPU
    """Where the group's tensors live: the host for gloo (``staged_nccl``'s engine: this rank's GPU)."""

    def __init__(self, *, client: VLLMWeightSyncClient, source: WeightSource | None, is_sender: bool = True,
                 buffer_bytes: int = DEFAULT_BUFFER_BYTES, rank: int = 0, trainers: int = 1,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.buffer_bytes = buffer_bytes
        self.rank = rank
        self.trainers = trainers
        self.timeout = timedelta(seconds=timeout_s)
        self.group: dist.ProcessGroup | None = None
        self._store: dist.TCPStore | None = None  # rank 0 hosts it for the group's lifetime
        self.abandon: Abandon | None = None
        """Gloo: the group's way out of a round stuck on a silent member (``backend/abandon.py``)."""
        self.workers: list[int] = []
        self.sent_bytes = 0

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client: VLLMWeightSyncClient,
                     source: WeightSource | None = None) -> GlooTrainerWeightTransferEngine:
        if source is None:
            raise ValueError("the gloo trainer engine needs a WeightSource (e.g. strategy.weight_source()).")
        trainers = init_info.num_trainer_ranks
        engine = cls(client=client, source=source, is_sender=init_info.is_sender,
                     buffer_bytes=init_info.packed_buffer_size_bytes, rank=init_info.rank, trainers=trainers,
                     timeout_s=init_info.timeout_s)
        if not engine.is_sender:
            return engine
        # a fresh namespace per rendezvous: a re-init never meets stale keys
        group = init_info.group or uuid.uuid4().hex

        def connect() -> None:
            engine.group, engine._store = join_group(init_info.master_address, init_info.master_port, init_info.rank,
                                                init_info.world_size, group, init_info.timeout_s, host=engine.rank == 0,
                                                device=engine.wire_device)

        if engine.rank != 0:
            connect()
        else:
            payload = asdict(cls.worker_init_info(init_info, group))
            # the workers block in the rendezvous until rank 0 joins: the request runs beside it, and a failure on
            # either side is raised at once (not when the other side gives up, the group's timeout later)
            rendezvous(connect, lambda: client.init_weight_transfer_engine(payload), init_info)
        assert engine._store is not None  # (every member asks: over gloo one worker per other host relays the parts)
        if engine.wire_device.type == "cpu":
            engine.abandon = Abandon(engine._store, group, engine.timeout)
        relays = find_relays(engine._store, group, engine.rank, init_info.world_size, trainers,
                             init_info.master_address, engine.wire_device)
        engine.workers = relays.receivers(range(trainers, init_info.world_size))
        return engine

    @classmethod
    def worker_init_info(cls, init_info: GlooTrainerInitInfo, group: str) -> GlooWeightTransferInitInfo:
        """What rank 0 tells the workers when they join (the ranks after the trainers')."""
        return GlooWeightTransferInitInfo(
            master_address=init_info.master_address, master_port=init_info.master_port,
            rank_offset=init_info.num_trainer_ranks, world_size=init_info.world_size, group=group,
            packed_buffer_size_bytes=init_info.packed_buffer_size_bytes, timeout_s=init_info.timeout_s,
            num_trainer_ranks=init_info.num_trainer_ranks)

    def send_weights(self, payload: GlooRound = DENSE) -> int:  # type: ignore[override]  # (vLLM's takes no round)
        """One round of ``payload.source``'s weights (and ``payload``: an adapter, or patches against a kept copy);
        every rank of the group calls it. Returns the bytes this rank sent."""
        source = payload.source if payload.source is not None else self.source
        assert source is not None
        meta = source_metadata(source)
        self.sent_bytes = 0
        if not self.is_sender:
            for _ in iter_full(source):
                pass
            return 0
        assert self.group is not None, "trainer_init() must run before send_weights()"
        bounds = [_bounds(m, self.trainers) for m in meta]
        adapter, patching = payload.adapter, payload.patches is not None
        info = GlooWeightTransferUpdateInfo(names=[m.name for m in meta],
                                            dtype_names=[str(m.dtype).removeprefix("torch.") for m in meta],
                                            shapes=[list(m.shape) for m in meta],
                                            bounds=None if all(b is None for b in bounds) else bounds,
                                            adapter_dir=adapter[0] if adapter else None,
                                            adapter_config=adapter[1] if adapter else None,
                                            patch_of=payload.patch_of if patching else None,
                                            keep_as=payload.keep_as if patching else None,
                                            stage_as=payload.stage_as, draft=payload.draft, same_as=_ties(source, meta))
        with self._sending():
            return self._send(payload, source, meta, info)

    def _sending(self) -> contextlib.AbstractContextManager[None]:
        """Where a round's sends run: the host for gloo (the NCCL engine: a side stream, so a round in a background
        thread never makes the training stream wait)."""
        return contextlib.nullcontext()

    def _send(self, payload: GlooRound, source: WeightSource, meta: list[Any], info: GlooWeightTransferUpdateInfo
              ) -> int:
        plan = Plan.of(info, self.trainers, self.buffer_bytes)
        staged = payload.stage_as is not None
        if self.rank != 0:
            self._stream(plan, self._checked(source, meta), None, payload.patches, staged)
            return self.sent_bytes
        if payload.draft:
            assert isinstance(self.client, DraftingClient), f"a drafter's round needs our client: {self.client!r}"
            self.client.start_draft_weight_update()
        else:
            self.client.start_weight_update()
        if staged:  # the workers' threads receive it; their engines generate on, out of any update session
            try:
                self.client.update_weights(asdict(info))
            except BaseException:
                with contextlib.suppress(Exception):  # vLLM ended the session when the update failed
                    self.client.finish_weight_update()
                raise
            self.client.finish_weight_update()
            self._stream(plan, self._checked(source, meta), None, payload.patches, staged)
            return self.sent_bytes
        pool = ThreadPoolExecutor(max_workers=1)
        try:
            # (in the round's context: a server the watch finds silent is not waited for there either; a stopped
            # API process held this answer for the request's whole timeout while its workers took every byte)
            answer = pool.submit(contextvars.copy_context().run, self.client.update_weights, asdict(info))
            self._stream(plan, self._checked(source, meta), answer, payload.patches, staged)
            answer.result()
        finally:
            pool.shutdown(wait=False)  # a worker stuck in a collective must not turn an error into a hang
        self.client.finish_weight_update()
        return self.sent_bytes

    def _stream(self, plan: Plan, pairs: Iterator[tuple[str, torch.Tensor]], answer: Any,
                base: PatchBase | None, staged: bool) -> None:
        assert self.group is not None
        digest = [0, 0]  # a staged round: bytes and CRC-32 of all this rank sent (each worker gets the same)
        inflight: list[Any] = [None]  # the last chunk's buffer and sends: the next chunk is packed while they run
        for index, chunk in enumerate(plan.chunks):
            try:
                if answer is not None and answer.done():
                    answer.result()  # the workers refused the round before any data: say why
                packed = self._pack(plan, chunk, pairs, base)
            except BaseException:
                if answer is None or not answer.done():
                    self._abort()
                raise
            code, origin = exchange_header(self.group, device=self.wire_device, timeout=self.timeout,
                                           abandon=self.abandon)
            if code == ABORT:
                raise RuntimeError(abort_message(origin))
            if code == END:
                raise RuntimeError("another trainer rank ended the round early: the ranks' sources disagree")
            for work in inflight[1:]:
                wait_for(work, self.timeout, self.abandon, collective=False)
            counts, part = packed
            inflight = [(counts, part)]
            if staged:
                for piece in (counts, part):
                    if piece is not None:
                        digest[0] += piece.nbytes
                        digest[1] = crc32(digest[1], piece)
            if counts is not None:  # a sparse round: the counts first (the workers size the payload from them)
                inflight += [self.group.send([counts], w, 2 * index) for w in self.workers]
                self.sent_bytes += counts.numel() * 8 * len(self.workers)
            tag = index if counts is None else 2 * index + 1
            inflight += [] if part is None else [self.group.send([part], w, tag) for w in self.workers]
            self.sent_bytes += 0 if part is None else part.numel() * len(self.workers)
        for work in inflight[1:]:
            wait_for(work, self.timeout, self.abandon, collective=False)
        try:
            if next(pairs, None) is not None:
                raise ValueError("WeightSource yielded more tensors than metadata() declared.")
        except BaseException:
            self._abort()
            raise
        code, origin = exchange_header(self.group, END, device=self.wire_device, timeout=self.timeout,
                                       abandon=self.abandon)
        if code == ABORT:
            raise RuntimeError(abort_message(origin))
        if staged:
            exchange_digests(self.group, self.trainers, (self.rank, digest[0], digest[1]), device=self.wire_device,
                             timeout=self.timeout, abandon=self.abandon)
        if exchange_status(self.group, False, device=self.wire_device, timeout=self.timeout, abandon=self.abandon):
            if answer is not None:
                answer.result()  # the worker's own error, through its server
            raise RuntimeError("a worker refused this weight update round" + (
                " (staged: the workers dropped it; the servers serve the previous version)" if staged else ""))

    def _pack(self, plan: Plan, chunk: list[PlannedTensor], pairs: Iterator[tuple[str, torch.Tensor]],
              base: PatchBase | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """This rank's ``(counts, part)`` of ``chunk``, from the next tensors of the source: ``counts`` only in a sparse
        round where this rank has a part (a code per tensor: ``WHOLE``, or its patch's length and form,
        :func:`patch_code`); ``part`` ``None`` where this rank sends nothing."""
        pieces: list[tuple[torch.Tensor, ...]] = []
        counts: list[int] = []
        for want in chunk:
            _, tensor = next(pairs)  # checked against the metadata (rows on this rank) by _checked
            if not want.part(self.rank):
                counts.append(0)
                continue
            patch = base.take(want.name, tensor) if base is not None else None
            if patch is None:
                counts.append(WHOLE)
                pieces.append((tensor,))
            else:
                positions = None if patch.positions is None else patch.positions.numel()
                counts.append(patch_code(patch.count, patch.bitmap is not None, positions, patch.stepped))
                pieces.append((patch.names, patch.values))
        sparse = base is not None and base.sparse
        size = sparse_segment(chunk, self.rank, counts) if sparse else plan.segment(chunk, self.rank)
        part = torch.empty(size, dtype=torch.uint8, device=self.wire_device) if size else None
        offset = 0
        for piece in pieces:
            for tensor in piece:
                nbytes = tensor.numel() * tensor.element_size()
                if not nbytes:
                    continue  # an empty patch (nothing changed) or part
                assert part is not None
                part[offset:offset + nbytes].copy_(tensor.detach().contiguous().view(-1).view(torch.uint8))
                offset += aligned(nbytes)
        has_part = any(want.part(self.rank) for want in chunk)
        return (torch.tensor(counts, dtype=torch.int64, device=self.wire_device) if sparse and has_part else None), part

    def abandon_round(self, reason: str) -> None:
        """Trainer rank 0: leave the round under way on every member of the group (gloo; a member went silent)."""
        if self.abandon is not None:
            self.abandon.post(reason)

    def _abort(self) -> None:
        """Tell every member this round is over (they raise), best effort: a dead peer must not hide the error."""
        if self.group is None:
            return  # (no group: nobody to tell)
        try:
            exchange_header(self.group, ABORT, self.rank, device=self.wire_device, timeout=self.timeout)
        except Exception:  # noqa: BLE001 - the caller raises the original error
            pass

    def _checked(self, source: WeightSource, meta: list[Any]) -> Iterator[tuple[str, torch.Tensor]]:
        """The source's pairs, each checked against what the workers were told to expect (rows on shard ranks)."""
        sent = 0
        for name, tensor in iter_full(source):
            want = meta[sent] if sent < len(meta) else None
            shape: tuple[int, ...] = ()
            if want is not None:
                bounds = _bounds(want, self.trainers)
                shape = tuple(want.shape if bounds is None else
                              (bounds[self.rank + 1] - bounds[self.rank], *want.shape[1:]))
            if want is None or name != want.name or tensor.dtype != want.dtype or tuple(tensor.shape) != shape:
                expected = "nothing more" if want is None else f"{want.name!r} {want.dtype} {shape}"
                raise ValueError(f"WeightSource yielded {name!r} {tensor.dtype} {tuple(tensor.shape)} at position"
                                 f" {sent} on trainer rank {self.rank} where metadata() declared {expected}; the two"
                                 " must agree.")
            sent += 1
            yield name, tensor
        if sent != len(meta):
            raise ValueError(f"WeightSource yielded {sent} tensors but metadata() declared {len(meta)}.")

    def shutdown(self) -> None:
        if self.abandon is not None:
            self.abandon.close(self.group)
        self.group = self._store = None




def _bounds(meta: Any, trainers: int) -> list[int] | None:
    """A tensor's row offsets over the trainer ranks when its metadata has them (shard-direct), else ``None``."""
    bounds = getattr(meta, "bounds", None)
    if bounds is None:
        return None
    if len(bounds) != trainers + 1:
        raise ValueError(f"{meta.name!r}: row bounds {list(bounds)} are not for {trainers} trainer rank(s); a"
                         " shard-direct source must be sent with num_trainer_ranks equal to its world.")
    return None if trainers == 1 else list(bounds)




def swap_update_info(stage_id: str, *, check_only: bool = False) -> dict[str, Any]:
    """The update info of a swap round: every worker loads the round it staged as ``stage_id`` (no tensors travel);
    ``check_only``: it only checks that round is complete, touching nothing."""
    return asdict(GlooWeightTransferUpdateInfo(names=[], dtype_names=[], shapes=[], swap_to=stage_id,
                                               check_only=check_only))


def register() -> None:
    """Register ``"gloo"`` in vLLM's worker and trainer factories (what the vLLM plugin does); a repeat is a no-op."""
    register_backends()


def _ties(source: WeightSource, meta: list[Any]) -> dict[str, str] | None:
    """The names of ``meta`` whose tensor is an earlier name's, as the source's export says (a tied head: sent once,
    loaded under both names by each worker); ``None``: none, or a source that does not say."""
    export = getattr(source, "export", None)
    told = getattr(export, "ties", None)
    ties = told() if callable(told) else {}
    what = {m.name: (m.dtype, tuple(m.shape)) for m in meta}
    ties = {a: b for a, b in ties.items() if a in what and what.get(b) == what[a]}
    return ties or None
