"""The worker half of the ``gloo`` backend (:mod:`.gloo`): the engine each vLLM worker builds from
``--weight-transfer-config '{"backend": "gloo"}'`` (registered by our vLLM plugin), which receives each round's
chunks, loads them inside vLLM's layerwise reload (or keeps and patches its host copy, or writes an adapter)."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from lightning_fsdp_export._compat import load_naming_refusals
from lightning_fsdp_export.targets.adapters import make_private_dirs, prune_runs, prune_versions, server_layout
from lightning_fsdp_export.targets.gloo_infos import (
    DEFAULT_BUFFER_BYTES,
    DEFAULT_TIMEOUT_S,
    GlooWeightTransferInitInfo,
    GlooWeightTransferUpdateInfo,
)
from lightning_fsdp_export.targets.gloo_protocol import (
    ABORT,
    END,
    Plan,
    PlannedTensor,
    abort_message,
    exchange_header,
    exchange_status,
    join_group,
    patch_chunk,
    sparse_segment,
    unpack_chunk,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig

__all__ = ["GlooWeightTransferEngine", "write_adapter_dir"]

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
