"""The ``staged_nccl`` backend: our gloo backend's staged rounds (:mod:`.gloo`) over NCCL between GPUs.

vLLM's ``nccl`` engine loads each chunk as it arrives, so the servers pause for the whole transfer. This one is the
gloo backend's protocol (the same plan, headers, status, digests, shard-direct and sparse rounds) with the group's
tensors on the GPUs, used for staged rounds only (``RemoteVLLM(transport=StagedNCCL())``): each worker receives the
version in a thread, on a CUDA stream of its own (the engine's generation never waits for the wire), into a staging
area on its GPU where memory allows (the swap is then a device copy: 14.2 GiB in 7.3 ms on an H200) or in pinned host
memory (the swap a host-to-device copy: 276 ms for the same bytes), and loads it at the swap round under the servers'
pause. Each trainer rank sends on a stream of its own too (a background push never makes training wait).

Per worker the staging costs a copy of the model in the wire dtype (``staging="device"``: GPU memory beside vLLM's,
which ``--gpu-memory-utilization`` must leave free; ``"host"``: pinned host memory; ``"auto"``: the GPU when its free
memory holds the copy with 1 GiB to spare, else the host). A digest is the device checksum of
:func:`~.gloo_protocol.device_checksum` (no copy to the host). Every wait of a round is on the host, with the round's
timeout; a NCCL error aborts the group's communicators (bounded, in a thread) and fails the round, and the next sync
builds a new group. Measured on one H200 (``benchmarks/staged_nccl_check.py``): a worker process killed mid-transfer
fails the trainer's round in 1.2 s; a trainer process killed mid-transfer kept the worker's receiving thread inside
torch's NCCL wait for about 60 s (docs/limitations.md).

The servers start with ``--weight-transfer-config '{"backend": "staged_nccl"}'`` (our vLLM plugin registers it).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from lightning_fsdp_export._common import STAGINGS, check_staging
from lightning_fsdp_export.backend.infos import (
    GlooTrainerInitInfo,
    GlooWeightTransferInitInfo,
    GlooWeightTransferUpdateInfo,
)
from lightning_fsdp_export.backend.protocol import Plan
from lightning_fsdp_export.backend.trainer import GlooTrainerWeightTransferEngine
from lightning_fsdp_export.backend.worker import GlooWeightTransferEngine, _logger

__all__ = ["BACKEND", "STAGINGS", "StagedNCCLInitInfo", "StagedNCCLTrainerInitInfo",
           "StagedNCCLTrainerWeightTransferEngine", "StagedNCCLWeightTransferEngine", "staging_on_device"]

BACKEND = "staged_nccl"
SPARE_BYTES = 1 << 30  # what "auto" leaves free on the GPU beside the staging


def staging_on_device(staging: str, nbytes: int, free_bytes: int) -> bool:
    """Whether a staged round of ``nbytes`` is kept on the GPU (else in pinned host memory) under ``staging``."""
    check_staging(staging, "staged_nccl")
    return staging == "device" or (staging == "auto" and free_bytes >= nbytes + SPARE_BYTES)


@dataclass(kw_only=True)
class StagedNCCLInitInfo(GlooWeightTransferInitInfo):
    """The workers' init info: the gloo one's, and where each worker keeps a staged round (``STAGINGS``)."""

    staging: str = "auto"


@dataclass
class StagedNCCLTrainerInitInfo(GlooTrainerInitInfo):
    """The trainer ranks' init info: the gloo one's, and the workers' ``staging``."""

    backend: ClassVar[str] = BACKEND
    staging: str = "auto"


class StagedNCCLWeightTransferEngine(GlooWeightTransferEngine):
    """Worker side: the gloo engine with its group on this worker's GPU, staged rounds received on a stream of their
    own into device or pinned host memory."""

    init_info_cls = StagedNCCLInitInfo

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.wire_device = torch.device(device)
        self.staging = "auto"
        self.on_device = True  # where the last staged round was kept
        self._side: torch.cuda.Stream | None = None

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        assert isinstance(init_info, StagedNCCLInitInfo)
        staging_on_device(init_info.staging, 0, 0)  # a bad value fails the rendezvous, named
        self.staging = init_info.staging
        super().init_transfer_engine(init_info)

    def _stage(self, info: GlooWeightTransferUpdateInfo) -> None:
        nbytes = Plan.of(info, self.trainers, self.buffer_bytes).nbytes
        free = torch.cuda.mem_get_info(self.wire_device)[0]
        self.on_device = staging_on_device(self.staging, nbytes, free)
        _logger().info("staged_nccl: round %s staged in %s memory (%.1f MB; %.1f MB free on the GPU)", info.stage_as,
                       "GPU" if self.on_device else "pinned host", nbytes / 1e6, free / 1e6)
        super()._stage(info)

    def _swap(self, staging: Any) -> None:
        super()._swap(staging)
        # the swap's copies are done before the servers resume (this stream only: a device-wide sync would wait on
        # the transfer's NCCL streams too)
        torch.cuda.current_stream(self.wire_device).synchronize()

    def receive_weights(self, update_info: GlooWeightTransferUpdateInfo, staging: Any = None) -> None:
        group = self.group
        try:
            super().receive_weights(update_info, staging)
        except dist.DistError:
            _abort(group)  # a dead peer or a timeout: free the device's streams from the receive that never ends
            if self.group is group:
                self.group = None  # the next round's init builds a new group
            raise

    def _receiving(self) -> contextlib.AbstractContextManager[None]:
        if self._side is None:
            self._side = torch.cuda.Stream(device=self.wire_device)
        return _on_stream(self._side)

    def _on_host(self, part: torch.Tensor | None) -> torch.Tensor | None:
        if part is None or self.on_device:
            return part
        host = torch.empty(part.shape, dtype=part.dtype, pin_memory=True)
        host.copy_(part)
        return host


class StagedNCCLTrainerWeightTransferEngine(GlooTrainerWeightTransferEngine):
    """Trainer side: the gloo engine with its group on this rank's GPU, its sends on a stream of their own."""

    init_info_cls = StagedNCCLTrainerInitInfo

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.wire_device = torch.device("cuda", torch.cuda.current_device())
        self._side: torch.cuda.Stream | None = None

    @classmethod
    def worker_init_info(cls, init_info: GlooTrainerInitInfo, group: str) -> GlooWeightTransferInitInfo:
        assert isinstance(init_info, StagedNCCLTrainerInitInfo)
        base = super().worker_init_info(init_info, group)
        return StagedNCCLInitInfo(**{**base.__dict__, "staging": init_info.staging})

    def _send(self, *args: Any) -> int:
        group = self.group
        try:
            return super()._send(*args)
        except dist.DistError:
            _abort(group)  # as the worker does; the next sync re-initializes the transfer (a failed round's rule)
            raise

    def _sending(self) -> contextlib.AbstractContextManager[None]:
        if self._side is None:
            self._side = torch.cuda.Stream(device=self.wire_device)
        self._side.wait_stream(torch.cuda.current_stream(self.wire_device))  # what the caller's stream made so far
        return _on_stream(self._side)


@contextlib.contextmanager
def _on_stream(stream: torch.cuda.Stream) -> Any:
    """Run on ``stream`` (and its device: a new thread's current device is the first GPU); at the end wait for it (in
    this thread only: the caller's stream never waits)."""
    with torch.cuda.device(stream.device), torch.cuda.stream(stream):
        try:
            yield
        finally:
            stream.synchronize()


def _abort(group: Any, wait_s: float = 5.0) -> None:
    """Abort ``group``'s NCCL communicators (ends their kernels), best effort and in a thread of its own, waited for
    ``wait_s`` at most (the watchdog may be aborting them too): the caller raises the round's error either way."""
    abort = getattr(group, "abort", None)
    if abort is None:
        return

    def run() -> None:
        with contextlib.suppress(Exception):
            abort()

    thread = threading.Thread(target=run, name="staged-nccl-abort", daemon=True)
    thread.start()
    thread.join(wait_s)

