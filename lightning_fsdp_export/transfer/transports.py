"""``RemoteVLLM``'s transports, each named once with its options: ``RemoteVLLM(url, transport=Gloo(shard_direct=True))``

A transport is a frozen options dataclass: its fields are the only options it takes (a combination that does
not exist cannot be built), ``name`` is the backend the servers run (``--weight-transfer-config
'{"backend": NAME}'``), ``layout`` what the sync asks the strategy for, ``every_rank`` whether every trainer
rank joins the transfer group (shard-direct) or rank 0 alone sends, ``weights_round`` / ``adapter_round`` the
kinds of round it runs (:mod:`~lightning_fsdp_export.transfer.rounds`), and ``init_info()`` the trainer engine's
init info. :data:`TRANSPORTS` maps each name to its class; ``transport="gloo"`` means ``Gloo()``.

Adding a network transport is one class here (with its ``init_info``) and one entry in :data:`TRANSPORTS`;
the frame of every round (:class:`~lightning_fsdp_export.transfer.frame.NativeTransfer`) is the same for all.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from enum import Enum
from typing import Any, ClassVar

import torch

from lightning_fsdp_export._common import DEFAULT_SHARD_BYTES, check_staging
from lightning_fsdp_export.export.source import SourceLayout

__all__ = ["IPC", "NCCL", "TRANSPORTS", "Directory", "Gloo", "NCCLM2N", "NetworkTransport",
           "RendezvousTransport", "RoundKind", "SparseNCCL", "StagedNCCL", "Transport", "parse_transport"]



class RoundKind(str, Enum):
    """The kinds of round a transport may run (its ``weights_round``, its ``adapter_round``; each kind's class is in
    :mod:`~lightning_fsdp_export.transfer.rounds`)."""

    DENSE = "dense"
    PATCHES = "patches"
    PATCH_LISTS = "patch_lists"
    ADAPTER = "adapter"
    STAGED = "staged"
    STAGED_PATCHES = "staged_patches"
    DRAFT = "draft"


def _is_bytes(value: object) -> bool:
    """A positive ``int`` (``True`` is an ``int`` to Python, not a size to us)."""
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _check_buffer(owner: object, buffer_bytes: int | None, *, packed: bool = True) -> None:
    if buffer_bytes is not None and not _is_bytes(buffer_bytes):
        raise ValueError(f"{type(owner).__name__}(buffer_bytes={buffer_bytes!r}) must be a positive number of bytes.")
    if buffer_bytes is not None and not packed:
        raise ValueError(f"{type(owner).__name__}(packed=False, buffer_bytes={buffer_bytes}): vLLM uses the buffer size"
                         " only for packed transfers, so it would be ignored. Drop buffer_bytes, or keep packed=True.")


def _packed(buffer_bytes: int | None) -> dict[str, int]:
    """vLLM's packed chunk size argument, when one was given (else the backend's default)."""
    return {} if buffer_bytes is None else {"packed_buffer_size_bytes": buffer_bytes}


@dataclass(frozen=True)
class NetworkTransport:
    """What every weight-transfer transport is: a vLLM backend name, a source layout, and its init info."""

    name: ClassVar[str]
    adapter_round: ClassVar[RoundKind | None] = None
    """The round a LoRA adapter travels in over the transport itself (``ADAPTER``: our gloo workers write it on their
    hosts); ``None``: the servers read it from a directory they share with the trainer."""
    closes_failed_rounds: ClassVar[bool] = False
    """The servers' workers end a round that failed on their side themselves (our gloo backend); vLLM's engines leave
    the layerwise reload open, and the round closes it empty."""
    draft_round: ClassVar[RoundKind | None] = None
    """The round a speculative-decoding drafter travels in, into each server's draft model (``DRAFT``: our backends,
    whose trainer engine starts the session with ``/start_draft_weight_update``); ``None``: drafters are not pushed."""

    @property
    def weights_round(self) -> RoundKind:
        """The round that pushes the model's weights: ``DENSE`` (the engine iterates a source), ``PATCHES`` (our gloo
        engine, parts through each rank's copy) or ``PATCH_LISTS`` (vLLM's ``sparse_nccl``: lists rank 0 collects)."""
        return RoundKind.DENSE

    @property
    def carries_adapters(self) -> bool:
        """A LoRA adapter travels over the transport itself (it has an ``adapter_round``)."""
        return self.adapter_round is not None

    @property
    def sends_patch_lists(self) -> bool:
        """Each round is a list of patches handed to vLLM's engine, not a ``WeightSource`` the engine iterates."""
        return self.weights_round is RoundKind.PATCH_LISTS

    @property
    def layout(self) -> SourceLayout:
        """What the sync asks the strategy for (``export_source(layout=...)``)."""
        return SourceLayout.SHARDS if self.every_rank else SourceLayout.FULL

    @property
    def every_rank(self) -> bool:
        """Every trainer rank joins the transfer group and sends its own shards (shard-direct)."""
        return False

    @property
    def sends_patches(self) -> bool:
        """After the first round, every rank sends only the elements of its parts that changed (sparse rounds)."""
        return self.weights_round in (RoundKind.PATCHES, RoundKind.STAGED_PATCHES, RoundKind.PATCH_LISTS)

    @property
    def stages(self) -> bool:
        """The workers stage each version while the servers generate; the servers pause only for the swap."""
        return self.weights_round in (RoundKind.STAGED, RoundKind.STAGED_PATCHES)

    def init_info(self, *, rank: int, address: str, port: int, world_size: int, trainers: int, group: str,
                  timeout: float) -> Any:
        """The trainer engine's init info for ``WeightTransferTrainerFactory.trainer_init`` (imports vLLM)."""
        raise NotImplementedError

    takes_rounds: ClassVar[bool] = False
    """Its trainer engine takes each round, its source included, as the argument of ``send_weights`` (this package's
    backends: :meth:`payload`); ``False``: vLLM's engines, which read the source they hold (set before each round)."""

    def payload(self, **fields: Any) -> Any:
        """Our backend's per-round argument of ``send_weights`` (``backend.trainer.GlooRound``, the round's source
        among its fields): only a transport of this package's backends has one (:attr:`takes_rounds`)."""
        raise TypeError(f"{type(self).__name__} runs vLLM's {self.name!r} engine, which takes no per-round payload.")

    def swap_info(self, stage_id: str, *, check_only: bool = False) -> dict[str, Any]:
        """The update info of a staged round's swap (our backends only); ``check_only``: the check before it."""
        raise TypeError(f"{type(self).__name__} runs no staged rounds.")


@dataclass(frozen=True)
class RendezvousTransport(NetworkTransport):
    """A transport whose servers' workers join a store trainer rank 0 hosts (every backend but IPC).

    Args:
        master_address: trainer rank 0's address as the servers reach it (default: ``127.0.0.1`` when every
            server is local, else this host's address on the interface the kernel routes to the servers through;
            a loopback address for a server on another host is refused).
        master_port: the store's port on rank 0; 0 (default) picks a free one.
    """

    master_address: str | None = None
    master_port: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.master_port, int) or not 0 <= self.master_port < 65536:
            raise ValueError(f"{type(self).__name__}(master_port={self.master_port!r}) must be a TCP port (0: pick a"
                             " free one).")


@dataclass(frozen=True)
class NCCL(RendezvousTransport):
    """vLLM's NCCL engine: servers on other GPUs or nodes; trainer rank 0 joins the group on its GPU.

    Args:
        master_address: see :class:`RendezvousTransport`.
        master_port: see :class:`RendezvousTransport`.
        buffer_bytes: the packed chunk size (vLLM's default: 1 GiB); trainer and workers hold up to two. Only with
            ``packed=True`` (refused otherwise: vLLM would ignore it).
        packed: vLLM's packed transfer.
    """

    name: ClassVar[str] = "nccl"
    buffer_bytes: int | None = None
    packed: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_buffer(self, self.buffer_bytes, packed=self.packed)

    def init_info(self, *, rank: int, address: str, port: int, world_size: int, trainers: int, group: str,
                  timeout: float) -> Any:
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        return NCCLTrainerInitInfo(rank=rank, master_address=address, master_port=port, world_size=world_size,
                                   packed=self.packed, **_packed(self.buffer_bytes))


@dataclass(frozen=True)
class IPC(NetworkTransport):
    """vLLM's CUDA-IPC engine, for a server on the trainer's own GPU (``VLLM_ALLOW_INSECURE_SERIALIZATION=1``
    on the server). Unpacked IPC holds the whole model on the GPU until the round ends.

    Args:
        buffer_bytes: the packed chunk size; only with ``packed=True`` (refused otherwise: vLLM would ignore it).
        packed: vLLM's packed transfer.
    """

    name: ClassVar[str] = "ipc"
    buffer_bytes: int | None = None
    packed: bool = True

    def __post_init__(self) -> None:
        _check_buffer(self, self.buffer_bytes, packed=self.packed)

    def init_info(self, *, rank: int, address: str, port: int, world_size: int, trainers: int, group: str,
                  timeout: float) -> Any:
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

        return IPCTrainerInitInfo(rank=rank, packed=self.packed, **_packed(self.buffer_bytes))


@dataclass(frozen=True)
class _OwnBackend(RendezvousTransport):
    """What this package's own backends (``Gloo``, ``StagedNCCL``) share: one protocol, so the same chunk size,
    shard-direct and sparse options, validated alike, and adapters carried in the round."""

    adapter_round: ClassVar[RoundKind | None] = RoundKind.ADAPTER
    closes_failed_rounds: ClassVar[bool] = True
    draft_round: ClassVar[RoundKind | None] = RoundKind.DRAFT
    takes_rounds: ClassVar[bool] = True
    buffer_bytes: int | None = None
    shard_direct: bool = False
    sparse: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_buffer(self, self.buffer_bytes)
        name = type(self).__name__
        for flag in (f.name for f in fields(self) if f.type == "bool"):  # (annotations are strings here)
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{name}({flag}={getattr(self, flag)!r}) must be True or False.")
        if self.sparse and not self.shard_direct:
            raise ValueError(f"{name}(sparse=True) computes each rank's patches from its own shards: it needs"
                             f" shard_direct=True ({name}(shard_direct=True, sparse=True)).")

    @property
    def every_rank(self) -> bool:
        return self.shard_direct

    def init_info(self, *, rank: int, address: str, port: int, world_size: int, trainers: int, group: str,
                  timeout: float) -> Any:
        from lightning_fsdp_export.backend.trainer import register

        register()
        info_class, extra = self._trainer_info()
        return info_class(rank=rank, master_address=address, master_port=port, world_size=world_size,
                          timeout_s=timeout, num_trainer_ranks=trainers, group=group, **extra,
                          **_packed(self.buffer_bytes))

    def _trainer_info(self) -> tuple[type, dict[str, Any]]:
        """The trainer init info's class, and its fields beyond the shared ones."""
        raise NotImplementedError

    def payload(self, **fields: Any) -> Any:
        from lightning_fsdp_export.backend.trainer import GlooRound

        return GlooRound(**fields)

    def swap_info(self, stage_id: str, *, check_only: bool = False) -> dict[str, Any]:
        from lightning_fsdp_export.backend.trainer import swap_update_info

        return swap_update_info(stage_id, check_only=check_only)


@dataclass(frozen=True)
class Gloo(_OwnBackend):
    """This package's backend over CPU sockets (the servers' environment must have this package installed).

    Args:
        master_address: see :class:`RendezvousTransport`.
        master_port: see :class:`RendezvousTransport`.
        buffer_bytes: the packed chunk size (default 16 MiB, the fastest measured here).
        shard_direct: every trainer rank sends its own rows of each FSDP2 shard (no all-gather on the trainer;
            the workers assemble full tensors) and its own experts' checkpoint pieces; the servers need no
            other setting.
        sparse: sparse syncs (needs ``shard_direct``): after a dense round, each rank sends only the elements of
            its parts whose bits changed since the version the servers confirmed (int32 index and value; a part
            whose patch would not be smaller goes whole). Costs each trainer rank a host copy of its parts in the
            wire dtype (its shard of the model; rank 0 also the tensors sent whole) and each server worker a host
            copy of the whole model; the first sync, and any after a failure, a resume, an exact check or a new
            plan, is dense.
        background: the servers go on generating while the version travels: each worker receives it in a thread
            into a staging area on its host (a host copy of the model in the wire dtype per worker; with ``sparse``
            the copy it keeps anyway), and the servers pause only for the swap (load it, set the version, reset the
            prefix cache). A transfer that fails leaves every server serving the previous version, unpaused; the next
            sync is a full push. With ``shard_direct`` the trainer does not wait either: each rank's push takes a host
            snapshot of its parts and returns, a thread sends it while training goes on (at most one version in
            flight; ``VLLMWeightSync`` ends it before the next sync and at the fit's end). Without it rank 0 sends
            while every rank waits. Pays with servers that generate during syncs (``AsyncRollouts``).
    """

    name: ClassVar[str] = "gloo"
    background: bool = False

    @property
    def weights_round(self) -> RoundKind:
        if self.background:
            return RoundKind.STAGED_PATCHES if self.sparse else RoundKind.STAGED
        return RoundKind.PATCHES if self.sparse else RoundKind.DENSE

    def _trainer_info(self) -> tuple[type, dict[str, Any]]:
        from lightning_fsdp_export.backend.infos import GlooTrainerInitInfo

        return GlooTrainerInitInfo, {}


@dataclass(frozen=True)
class StagedNCCL(_OwnBackend):
    """Background syncs between GPUs: ``Gloo(background=True)``'s staged rounds over NCCL (this package's
    ``staged_nccl`` backend; the servers' environment must have this package installed). The servers go on generating
    while the version travels: each worker receives it in a thread, on a CUDA stream of its own, into a staging area,
    and the servers pause only for the swap. A transfer that fails leaves every server serving the previous version,
    unpaused; the next sync is a full push. GPU only (trainer and servers).

    Args:
        master_address: see :class:`RendezvousTransport`.
        master_port: see :class:`RendezvousTransport`.
        buffer_bytes: the packed chunk size (default 16 MiB).
        shard_direct: every trainer rank sends its own rows of each FSDP2 shard (no all-gather on the trainer), and
            the trainer does not wait either: each rank's push takes a host snapshot of its parts (one device-to-host
            copy of its shard) and returns; a thread sends it on a stream of its own while training goes on (at most
            one version in flight). Without it rank 0 sends while every rank waits.
        sparse: after a dense round, each rank sends only the elements of its parts that changed (needs
            ``shard_direct``; each worker keeps its copy of the model where its staging is).
        staging: where each worker keeps the version until the swap: ``"device"`` (a copy of the model in the wire
            dtype in GPU memory beside vLLM's, which ``--gpu-memory-utilization`` must leave free; the swap is a device
            copy), ``"host"`` (pinned host memory; the swap a host-to-device copy), ``"auto"`` (default: the GPU when
            its free memory holds the copy with 1 GiB to spare, else the host; decided per round by each worker).
    """

    name: ClassVar[str] = "staged_nccl"
    staging: str = "auto"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_staging(self.staging, "StagedNCCL")

    @property
    def weights_round(self) -> RoundKind:
        return RoundKind.STAGED_PATCHES if self.sparse else RoundKind.STAGED

    def _trainer_info(self) -> tuple[type, dict[str, Any]]:
        from lightning_fsdp_export.backend.staged_nccl import StagedNCCLTrainerInitInfo

        return StagedNCCLTrainerInitInfo, {"staging": self.staging}


@dataclass(frozen=True)
class NCCLM2N(RendezvousTransport):
    """vLLM's M2N engine (NVIDIA's ``nccl-extensions`` on both sides): every trainer rank sends its local shards
    over NCCL and the workers reshard them. GPU only.

    Args:
        master_address: see :class:`RendezvousTransport`.
        master_port: see :class:`RendezvousTransport`.
    """

    name: ClassVar[str] = "nccl_m2n"

    @property
    def layout(self) -> SourceLayout:
        return SourceLayout.M2N

    @property
    def every_rank(self) -> bool:
        return True

    def init_info(self, *, rank: int, address: str, port: int, world_size: int, trainers: int, group: str,
                  timeout: float) -> Any:
        from vllm.distributed.weight_transfer.m2n_trainer import M2NTrainerInitInfo

        return M2NTrainerInitInfo(rank=rank, master_address=address, master_port=port, world_size=world_size,
                                  num_trainer_ranks=trainers)


@dataclass(frozen=True)
class SparseNCCL(RendezvousTransport):
    """vLLM 0.33's sparse NCCL engine (GPU; servers started with ``'{"backend": "sparse_nccl"}'``): every sync is a
    list of patches (flat int32 index and value in checkpoint coordinates) that the servers apply in place through
    their model's loaders, with no reload. Each trainer rank makes the patches of its own rows (the elements that
    changed since the version the servers confirmed; no all-gather of the weights), rank 0 collects them (over the
    trainer ranks' gloo group) and broadcasts them. The first sync, and any after a failure, a resume, an exact check
    or a new plan, patches every element: 6 bytes per bf16 element (3x a dense push). Each trainer rank keeps a
    host copy of its parts in the wire dtype; the servers keep nothing.

    Args:
        master_address: see :class:`RendezvousTransport`.
        master_port: see :class:`RendezvousTransport`.
        chunk_bytes: full-size bytes of the tensors whose patches rank 0 collects and sends at once (default 256 MiB).
    """

    name: ClassVar[str] = "sparse_nccl"
    chunk_bytes: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.chunk_bytes is not None and not _is_bytes(self.chunk_bytes):
            raise ValueError(f"SparseNCCL(chunk_bytes={self.chunk_bytes!r}) must be a positive number of bytes.")

    @property
    def layout(self) -> SourceLayout:
        return SourceLayout.SHARDS

    @property
    def weights_round(self) -> RoundKind:
        return RoundKind.PATCH_LISTS

    def init_info(self, *, rank: int, address: str, port: int, world_size: int, trainers: int, group: str,
                  timeout: float) -> Any:
        from vllm.distributed.weight_transfer.sparse_nccl_engine import SparseNCCLTrainerInitInfo

        return SparseNCCLTrainerInitInfo(rank=rank, master_address=address, master_port=port, world_size=world_size)


@dataclass(frozen=True)
class Directory:
    """No network path: rank 0 writes safetensors under ``path`` (shared with the servers, same path on each) and
    every server reloads them (``/collective_rpc reload_weights``).

    Args:
        path: a directory every server reads at the same path.
        shard_bytes: the largest safetensors file written (default 2 GiB).
        keep_last: version directories kept on disk (at least 2: the servers read the current one).
    """

    name: ClassVar[str] = "directory"
    path: str | os.PathLike[str]
    shard_bytes: int = DEFAULT_SHARD_BYTES
    keep_last: int = 2

    def __post_init__(self) -> None:
        if not _is_bytes(self.shard_bytes):
            raise ValueError(f"Directory(shard_bytes={self.shard_bytes!r}) must be a positive number of bytes.")
        if not isinstance(self.keep_last, int) or isinstance(self.keep_last, bool) or self.keep_last < 2:
            raise ValueError(f"Directory(keep_last={self.keep_last!r}) must be at least 2: the servers read the"
                             " current one.")

    @property
    def layout(self) -> SourceLayout:
        return SourceLayout.FULL

    sends_patches: ClassVar[bool] = False
    """Every sync is a whole reload."""
    stages: ClassVar[bool] = False
    """The servers pause for the whole reload."""
    draft_round: ClassVar[RoundKind | None] = None
    """It carries no drafter (the servers reload their policy's checkpoint only)."""


Transport = NetworkTransport | Directory
TRANSPORTS: dict[str, type[Transport]] = {cls.name: cls for cls in (NCCL, IPC, Gloo, NCCLM2N, SparseNCCL, StagedNCCL,
                                                                     Directory)}


def parse_transport(value: Transport | str | None) -> Transport:
    """A transport from its options object, its name (its default options) or ``None`` (``NCCL()`` with CUDA,
    else ``Gloo()``)."""
    if value is None:
        return NCCL() if torch.cuda.is_available() else Gloo()
    if isinstance(value, (NetworkTransport, Directory)):
        return value
    names = ", ".join(map(repr, TRANSPORTS))
    if not isinstance(value, str) or value not in TRANSPORTS:
        raise ValueError(f"RemoteVLLM(transport={value!r}) must be one of {names}, or an options object such as"
                         " Gloo(shard_direct=True).")
    if value == "directory":
        raise ValueError("RemoteVLLM(transport='directory') needs the directory: transport=Directory(PATH), a path"
                         " every server can read.")
    network = TRANSPORTS[value]
    assert issubclass(network, NetworkTransport)  # (the directory's path has no default: refused above)
    return network()
