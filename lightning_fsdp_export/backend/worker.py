"""The worker half of the ``gloo`` backend (:mod:`.gloo`): the engine each vLLM worker builds from
``--weight-transfer-config '{"backend": "gloo"}'`` (registered by our vLLM plugin), which receives each round's
chunks, loads them inside vLLM's layerwise reload (or keeps and patches its host copy, or writes an adapter, or
stages them in a thread for a later swap)."""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from lightning_fsdp_export._compat import load_naming_refusals
from lightning_fsdp_export.backend.abandon import Abandon, wait_for
from lightning_fsdp_export.backend.adapter_dirs import write_adapter_dir
from lightning_fsdp_export.backend.infos import (
    DEFAULT_BUFFER_BYTES,
    DEFAULT_TIMEOUT_S,
    GlooWeightTransferInitInfo,
    GlooWeightTransferUpdateInfo,
)
from lightning_fsdp_export.backend.inplace import InPlace
from lightning_fsdp_export.backend.protocol import (
    ABORT,
    CPU,
    END,
    PatchTarget,
    Plan,
    PlannedTensor,
    Relays,
    abort_message,
    crc32,
    exchange_digests,
    exchange_header,
    exchange_status,
    find_relays,
    join_group,
    patch_chunk,
    relay_tag,
    sparse_segment,
    unpack_chunk,
)
from lightning_fsdp_export.backend.staging import StagedRounds, Staging, digest_mismatch, staged
from lightning_fsdp_export.backend.staging import logger as _logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig

__all__ = ["GlooWeightTransferEngine", "write_adapter_dir"]  # (the latter: backend.adapter_dirs)

@dataclass
class _Received:
    """One chunk on its way to a worker: its tensors, each trainer rank's part, the receives in flight."""

    chunk: list[PlannedTensor]
    parts: list[torch.Tensor | None]
    works: list[Any]
    trainers: int
    index: int = 0  # the chunk's place in the round (its messages' tags)
    counts: list[list[int] | None] | None = None  # a sparse round: each trainer rank's counts (None: no part)
    messages: list[torch.Tensor | None] | None = None  # a sparse round: the counts as received (for the digest)


@dataclass
class _Round:
    """What one round's receive works on: a round that outlives its group (a staged one whose trainer vanished)
    writes only here, never into the engine's state of a newer round."""

    info: GlooWeightTransferUpdateInfo
    group: dist.ProcessGroup
    base: dict[str, torch.Tensor]
    adapter: dict[str, torch.Tensor] | None = None  # an adapter round's tensors
    staging: Staging | None = None
    targets: dict[str, torch.Tensor | PatchTarget] | None = None  # a sparse round in place: the copy and the engine's
    changed: set[str] | None = None  # a sparse round in place: the tensors it wrote into (their layers reload)
    digests: list[list[int]] = field(default_factory=list)  # a staged round: per trainer rank, [bytes, crc]
    forwards: list[Any] = field(default_factory=list)  # a relay's sends to its host's other workers, in flight
    tied: dict[str, torch.Tensor | None] = field(default_factory=dict)  # tensors a later name is the same as (ties)
    abandon: Abandon | None = None  # the group's way out of a round stuck on a silent member (gloo)

    def wait(self, work: Any, timeout: timedelta) -> None:
        """A receive's (or a relay's send's) wait, within a second of an abandon (gloo)."""
        wait_for(work, timeout, self.abandon, collective=False)
    times: dict[str, float] = field(default_factory=lambda: {"round": time.perf_counter(), "waiting": 0.0,
                                                             "loading": 0.0})


class GlooWeightTransferEngine(StagedRounds,
                               WeightTransferEngine[GlooWeightTransferInitInfo, GlooWeightTransferUpdateInfo]):
    """Worker side: receives every trainer rank's parts of each chunk over gloo, assembles each tensor in a
    fresh buffer, and loads them with the layerwise reload; a chunk is loaded while the next one arrives.

    A staged round (``Gloo(background=True)``) is received by a thread into host memory while the engine goes on
    generating, and loaded by a later swap round under the servers' pause; the staging costs a host copy of the model
    in the wire dtype per worker (a sparse round's is the copy it keeps anyway)."""

    init_info_cls = GlooWeightTransferInitInfo
    update_info_cls = GlooWeightTransferUpdateInfo
    wire_device = CPU
    """Where the group's tensors live: the host for gloo (``staged_nccl``'s engine: this worker's GPU)."""

    def __init__(self, config: WeightTransferConfig, vllm_config: VllmConfig, device: torch.device,
                 model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: dist.ProcessGroup | None = None
        self._store: dist.TCPStore | None = None
        self.abandon: Abandon | None = None  # gloo: the group's way out of a round stuck on a silent member
        self.buffer_bytes = DEFAULT_BUFFER_BYTES
        self.trainers = 1
        self.timeout = timedelta(seconds=DEFAULT_TIMEOUT_S)
        self._reloading = False
        self._base: dict[str, torch.Tensor] = {}  # the copy of the last kept round (sparse rounds patch it)
        self._kept: str | None = None  # its id, once its round succeeded
        self._inplace: InPlace | None = None  # where sparse rounds write in place (the copy then holds only the rest)
        self._trace_ties: dict[str, str] | None = None  # a kept round's ties: trace where it loaded, once reloaded
        self._placing = False  # this round writes into the engine's parameters
        self._staging: Staging | None = None  # the last staged round, until a swap loads it
        self.times = {"round": 0.0, "waiting": 0.0, "loading": 0.0}  # the last round's, in seconds
        self.rank = 0  # this worker's rank in the transfer group
        self.relays = Relays()  # which workers of this host receive through which (Relays)

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        self.shutdown()
        parallel = self.parallel_config
        rank = parallel.data_parallel_index * parallel.world_size + parallel.rank + init_info.rank_offset
        self.join(init_info, rank)

    def join(self, init_info: GlooWeightTransferInitInfo, rank: int) -> None:
        """Join the transfer group as ``rank``."""
        self.buffer_bytes = init_info.packed_buffer_size_bytes
        self.trainers = init_info.num_trainer_ranks
        self.timeout = timedelta(seconds=init_info.timeout_s)
        self.group, self._store = join_group(init_info.master_address, init_info.master_port, rank,
                                             init_info.world_size,
                                        init_info.group, init_info.timeout_s, host=False, device=self.wire_device)
        self.rank = rank
        self.abandon = Abandon(self._store, init_info.group, self.timeout) if self.wire_device.type == "cpu" else None
        self.relays = find_relays(self._store, init_info.group, rank, init_info.world_size, self.trainers,
                                  init_info.master_address, self.wire_device)
        _log_relays(rank, self.relays)

    def start_weight_update(self) -> None:
        """Nothing yet: the round's update info says whether it reloads the model (the layerwise reload starts at
        its first ``update_weights``), stages a round, or writes an adapter."""

    def _start_reload(self, info: GlooWeightTransferUpdateInfo, staging: Staging | None) -> None:
        """Open vLLM's layerwise reload for the whole model; a sparse round in place (:mod:`.inplace`) opens it once
        its chunks are in (a staged one: at its swap), only for the layers that changed and cannot be patched in
        place (:meth:`_reload_changed`)."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self._placing = (self._inplace is not None and info.patch_of is not None and info.stage_as is None
                         and info.swap_to is None and not info.draft) or (staging is not None
                                                                          and staging.inplace is not None)
        if not self._placing:
            initialize_layerwise_reload(self.model)
            self._reloading = True

    def _reload_changed(self, r: _Round) -> BaseException | None:
        """A sparse round in place, every chunk in: reload the layers its changes reach that are not patched in place
        (every tensor of theirs, from the copy); the round's error, if any."""
        assert self._inplace is not None and r.changed is not None
        start = time.perf_counter()
        try:
            said = self._inplace.reload(self.model, r.changed, r.base)
        except Exception as err:  # noqa: BLE001 - the whole group learns of it in the status
            return err
        finally:
            self._reloading = self._inplace.open
            r.times["loading"] += time.perf_counter() - start
        _logger().info("gloo weight update: %s", said)
        return None

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        start = time.perf_counter()
        if self._reloading:
            self._reloading = False
            finalize_layerwise_reload(self.model, self.model_config)
            _logger().info("gloo weight update: finalized in %.3f s", time.perf_counter() - start)
        if self._placing and self._inplace is not None:
            self._placing = False
            self._inplace.after_round(self.model, _resolved(self.model_config.dtype))
        if self._trace_ties is not None:  # a kept dense round loaded: where its tensors live (logged once)
            ties, self._trace_ties = self._trace_ties, None
            self._inplace = InPlace.trace(self.model, self._base, ties, _logger())

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class ends with torch.accelerator.synchronize(), which raises on CPU-only torch;
        # gloo is synchronous, so there is nothing to wait for.
        try:
            info = self.parse_update_info(update_info)
            if info.stage_as is not None:
                self._stage(info)  # returns at once: the model is not touched
                return
            staging = None if info.swap_to is None else staged(self._staging, info.swap_to, self.timeout)  # (first)
            if info.check_only:
                return  # the staged round is complete: the swap that follows loads it
            if info.adapter_dir is None and not self._reloading:
                self._start_reload(info, staging)
            if staging is not None:
                self._swap(staging)
                return
            self.receive_weights(info)
        except BaseException:
            self.finish_weight_update()  # leaves the model loadable: the next round can start
            raise

    # -- receiving a round -------------------------------------------------------------------------

    def receive_weights(self, update_info: GlooWeightTransferUpdateInfo, staging: Staging | None = None) -> None:
        """Receive one round: load it (inside the layerwise reload), write it as an adapter, or (``staging``) keep
        it for a swap round."""
        if self.group is None:
            raise RuntimeError("gloo weight transfer is not initialized: call init_weight_transfer_engine first.")
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        plan = Plan.of(update_info, self.trainers, self.buffer_bytes)
        error: BaseException | None = None
        adapter = update_info.adapter_dir is not None
        policy = not adapter and not update_info.draft  # a round into the policy's weights (the copy follows them)
        if policy and staging is None and update_info.patch_of is None:
            self._base, self._inplace = {}, None  # the weights change: the copy is valid only if this round succeeds
        base = {} if update_info.draft else self._base if staging is None else staging.base  # a drafter's: no copy
        r = _Round(update_info, self.group, base, adapter={} if adapter else None, staging=staging,
                   tied=dict.fromkeys(t.same_as for t in plan.tensors if t.same_as), abandon=self.abandon)
        if self._placing and self._inplace is not None and staging is None:
            r.targets, r.changed = {**base, **self._inplace.placed}, set()
        elif staging is not None and staging.inplace is not None:  # in place at its swap: the writes recorded
            r.targets, r.changed = {**base, **staging.deferred}, staging.changed
        if policy:
            if update_info.patch_of is not None and update_info.patch_of != self._kept:
                error = RuntimeError(f"sparse round against the copy {update_info.patch_of!r}, but this worker keeps"
                                     f" {self._kept!r} (restarted, or its last round failed); the next sync pushes"
                                     " every tensor whole.")
            self._kept = None
        if staging is not None:
            r.digests = [[0, 0] for _ in range(plan.trainers)]
        with disable_mtp_completeness_check() if staging is None else contextlib.nullcontext():
            error = self._receive_chunks(r, plan, error)
            if error is None and r.changed is not None and staging is None:
                error = self._reload_changed(r)
        for work in r.forwards:
            r.wait(work, self.timeout)
        if error is None and r.adapter is not None:
            try:
                assert update_info.adapter_dir is not None and update_info.adapter_config is not None
                write_adapter_dir(update_info.adapter_dir, r.adapter, update_info.adapter_config)
            except Exception as err:  # noqa: BLE001 - the whole group learns of it in the status
                error = err
        if staging is not None:
            sent = exchange_digests(r.group, plan.trainers, None, device=self.wire_device, timeout=self.timeout,
                                    abandon=r.abandon)
            error = error or digest_mismatch(sent, r.digests)
        failed = exchange_status(r.group, error is not None, device=self.wire_device, timeout=self.timeout,
                                 abandon=r.abandon)
        current = staging is None or staging is self._staging  # a staged round replaced since writes nothing more
        if policy and current:
            self._base = {} if failed or update_info.keep_as is None else r.base
            self._kept = None if failed else update_info.keep_as
            if failed or update_info.keep_as is None:
                self._inplace = None
            elif staging is None and update_info.patch_of is None:
                self._trace_ties = dict(update_info.same_as or {})  # once the reload finished
        if current:
            self.times = r.times
        _log_round(plan, update_info, r, staged=staging is not None, failed=failed,
                   draft_model=type(self.model).__name__ if update_info.draft else None)
        if failed:
            raise error or RuntimeError("another member of the weight-transfer group failed this round")

    def _receive_chunks(self, r: _Round, plan: Plan, error: BaseException | None) -> BaseException | None:
        """Every chunk of the round: each posted, then the one before loaded while it arrives; an abort raises, an
        early end is the round's error (returned)."""
        held: _Received | None = None  # the last chunk received: loaded while the next one arrives
        for index, chunk in enumerate(plan.chunks):
            code, origin = self._header(r)
            if code == ABORT:
                raise RuntimeError(abort_message(origin))
            if code == END:
                left = sum(len(c) for c in plan.chunks[index:])
                error = error or RuntimeError(f"the trainer ended the round with {left} announced tensors unsent")
                break
            posted = self._post(r, plan, chunk, index)
            error = self._load(r, held, error)
            held = posted
        else:
            error = self._load(r, held, error)
            held = None
            code, origin = self._header(r)
            if code == ABORT:
                raise RuntimeError(abort_message(origin))
        if held is not None:
            self._load(r, held, error or RuntimeError("the round ended early"))  # its sends complete
        return error

    def _header(self, r: _Round) -> tuple[int, int]:
        start = time.perf_counter()
        try:
            return exchange_header(r.group, device=self.wire_device, timeout=self.timeout, abandon=r.abandon)
        finally:
            r.times["waiting"] += time.perf_counter() - start

    def _post(self, r: _Round, plan: Plan, chunk: list[PlannedTensor], index: int) -> _Received:
        """Start receiving each trainer rank's part of ``chunk`` (``None`` where it sends nothing)."""
        sparse = r.info.patch_of is not None
        parts: list[torch.Tensor | None] = []
        counts: list[list[int] | None] = []
        messages: list[torch.Tensor | None] = []
        works = []
        relay = self.relays.source.get(self.rank)  # a follower receives every part from its host's relay
        for rank in range(plan.trainers):
            size = plan.segment(chunk, rank)
            counts.append(None)
            messages.append(None)
            if size and sparse:  # a sparse round: this rank's counts first, its payload's size from them
                message = torch.empty(len(chunk), dtype=torch.int64, device=self.wire_device)
                r.wait(r.group.recv([message], *_source(relay, rank, 2 * index, plan.trainers)), self.timeout)
                _forward(r, self.relays.followers.get(self.rank, []), message, 2 * index, rank, plan.trainers)
                counts[-1], messages[-1] = (codes := message.tolist()), message
                size = sparse_segment(chunk, rank, codes)
            parts.append(part := torch.empty(size, dtype=torch.uint8, device=self.wire_device) if size else None)
            if part is not None:
                tag = 2 * index + 1 if sparse else index
                works.append(r.group.recv([part], *_source(relay, rank, tag, plan.trainers)))
        return _Received(chunk, parts, works, plan.trainers, index, counts if sparse else None,
                         messages if sparse else None)

    def _load(self, r: _Round, held: _Received | None, error: BaseException | None) -> BaseException | None:
        """Wait for ``held`` to arrive and load it (or stage it), unless the round already failed; the round's error,
        if any."""
        if held is None:
            return error
        start = time.perf_counter()
        for work in held.works:
            r.wait(work, self.timeout)
        for work in r.forwards:  # the previous chunk's, done by now (the host's loopback): its buffers may go
            r.wait(work, self.timeout)
        r.forwards = []
        tag = 2 * held.index + 1 if held.counts is not None else held.index
        for rank, part in enumerate(held.parts):  # a relay passes each part on before loading it
            if part is not None:
                _forward(r, self.relays.followers.get(self.rank, []), part, tag, rank, held.trainers)
        loading = time.perf_counter()
        r.times["waiting"] += loading - start
        if r.digests:  # a staged round: what each trainer rank sent, in its order (counts, then payload)
            for rank, digest in enumerate(r.digests):
                for piece in (held.messages[rank] if held.messages else None, held.parts[rank]):
                    if piece is not None:
                        digest[0] += piece.nbytes
                        digest[1] = crc32(digest[1], piece)
        if error is not None:
            return error  # kept receiving so the trainer ranks' sends complete; reported at the end
        try:  # a refused tensor is named in the error, with its shape and the engine's
            staged = r.staging is not None
            if staged:
                held.parts = [self._on_host(part) for part in held.parts]
            if held.counts is not None:
                pairs = patch_chunk(held.chunk, held.parts, held.counts, held.trainers,
                                    r.base if r.targets is None else r.targets, fresh=not staged and r.changed is None,
                                    changed=r.changed)
            else:
                pairs = unpack_chunk(held.chunk, held.parts, held.trainers)
                if r.info.keep_as is not None:
                    pairs = _keeping(pairs, r.base)
            pairs = _tied(pairs, held.chunk, r.tied, r.targets or {})
            if r.changed is not None:  # in place: the copy patched here, its layers reloaded once all chunks are in
                collections.deque(pairs, maxlen=0)
            elif r.staging is not None:  # staged: kept for the swap (from the host copy where one is kept)
                kept = r.info.keep_as is not None
                r.staging.tensors.update((name, None if kept and name in r.base else tensor) for name, tensor in pairs)
            elif r.adapter is not None:  # an adapter round: kept for its files, the model untouched
                r.adapter.update((name, tensor.to(CPU, copy=True)) for name, tensor in pairs)
            else:
                load_naming_refusals(self.model.load_weights, self.model, pairs)
        except Exception as err:  # noqa: BLE001 - the whole group learns of it in the status
            return err
        finally:
            r.times["loading"] += time.perf_counter() - loading
        return None

    def shutdown(self) -> None:
        if self.abandon is not None:
            self.abandon.close(self.group)
        self.group = self._store = self.abandon = None
        self._base, self._kept, self._staging, self._inplace = {}, None, None, None


def _log_relays(rank: int, relays: Relays) -> None:
    if relays.followers.get(rank) or rank in relays.source:  # (the across-hosts test reads it)
        _logger().info("gloo weight transfer: rank %d, relaying to %d other worker(s) of this host %s", rank,
                       len(relays.followers.get(rank, [])), relays)


def _tied(pairs: Iterator[tuple[str, torch.Tensor]], chunk: list[PlannedTensor], tied: dict[str, torch.Tensor | None],
          targets: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """``pairs``, then each tensor of ``chunk`` that is an earlier one (``same_as``: nothing of it was sent) under its
    own name; ``tied`` keeps the earlier tensors as they pass (a reference: every chunk's buffers are fresh). An
    earlier one written in place (a ``targets`` entry that is no tensor) took its tied names' places with it."""
    for name, tensor in pairs:
        if name in tied:
            tied[name] = tensor
        yield name, tensor
    for planned in chunk:
        in_place = planned.same_as in targets and not isinstance(targets[planned.same_as], torch.Tensor)
        if planned.same_as is not None and not in_place:
            earlier = tied.get(planned.same_as)
            if earlier is None:
                raise RuntimeError(f"{planned.name!r} is the same tensor as {planned.same_as!r}, which this round did"
                                   " not carry before it.")
            yield planned.name, earlier


def _source(relay: int | None, rank: int, tag: int, trainers: int) -> tuple[int, int]:
    """Where and under which tag a worker receives trainer rank ``rank``'s message ``tag``: from that rank, or from
    its host's ``relay``."""
    return (rank, tag) if relay is None else (relay, relay_tag(tag, rank, trainers))


def _forward(r: _Round, followers: list[int], message: torch.Tensor, tag: int, rank: int, trainers: int) -> None:
    """A relay (``followers`` not empty): send trainer rank ``rank``'s ``message`` (arrived) on to this host's other
    workers (:class:`~lightning_fsdp_export.backend.protocol.Relays`)."""
    for follower in followers:
        r.forwards.append(r.group.send([message], follower, relay_tag(tag, rank, trainers)))


def _keeping(pairs: Iterator[tuple[str, torch.Tensor]], base: dict[str, torch.Tensor]
             ) -> Iterator[tuple[str, torch.Tensor]]:
    """``pairs``, each also copied into ``base`` (the copy the next sparse round patches)."""
    for name, tensor in pairs:
        base[name] = tensor.clone()
        yield name, tensor


def _log_round(plan: Plan, info: GlooWeightTransferUpdateInfo, r: _Round, *, staged: bool, failed: bool,
               draft_model: str | None) -> None:
    """The worker's one log line per round: tensors, bytes, trainers, seconds (waiting, loading or staging), and
    what it kept or patched."""
    times = r.times
    kept = sum(t.nbytes for t in r.base.values()) if not failed and info.keep_as else 0
    placed = len(r.targets) - len(r.base) if r.targets else 0
    where = "to write in place at the swap" if staged else "written in place"
    _logger().info("gloo weight update: %d tensors, %.1f MB from %d trainer rank(s) in %.3f s (waiting for the"
                   " trainers and data %.3f s, %s %.3f s)%s", len(plan.tensors), plan.nbytes / 1e6, plan.trainers,
                   time.perf_counter() - times["round"], times["waiting"], "staging" if staged else "loading",
                   times["loading"], (", failed" if failed else "") + (
                       f", {'patched' if info.patch_of else 'kept'} a host copy of {kept / 1e6:.1f} MB"
                       if kept else "") + (f", {placed} tensor(s) {where}" if placed else "") + (
                       f", into the draft model {draft_model}" if draft_model else ""))


def _resolved(dtype: Any) -> torch.dtype:
    """The engine's dtype (vLLM resolved ``"auto"`` and the names when the engine started)."""
    assert isinstance(dtype, torch.dtype), dtype
    return dtype
