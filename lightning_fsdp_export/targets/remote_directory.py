"""``RemoteVLLM``'s round over a shared directory (``transport=Directory(path)``): the version written as safetensors by
a :class:`~lightning_fsdp_export.targets.directory.DirectoryTarget`, then reloaded by every server from it, under the
same pause as a network round (:class:`~lightning_fsdp_export.servers.pauses.Pauses`); it keeps the adapters' two
newest versions per name under the shared directory and holds no group, so it has nothing to shut down."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from typing_extensions import override

from lightning_fsdp_export.backend.shared import PauseMode
from lightning_fsdp_export.export.source import ExportSource
from lightning_fsdp_export.servers.http import Server
from lightning_fsdp_export.servers.pauses import reset_prefix_caches, set_versions
from lightning_fsdp_export.servers.pool import ServerPool
from lightning_fsdp_export.servers.preflight import check_servers
from lightning_fsdp_export.targets.directory import DirectoryTarget
from lightning_fsdp_export.transfer.adapters import AdapterFiles, prune_versions
from lightning_fsdp_export.transfer.base import Transfer
from lightning_fsdp_export.transfer.transports import Directory

__all__ = ["DirectoryReload"]


class DirectoryReload(Transfer):
    """``Directory``'s round: rank 0 writes the version as safetensors, then on every server ``/pause``,
    ``reload_weights`` from it, reset the prefix cache, set the version, ``/resume``. A server whose reload failed
    stays paused (as after a failed network round), never serving a half-reloaded model, until the next sync's full
    reload resumes it; the servers whose reload succeeded serve the new version, resumed.

    Args:
        pool: the servers updated by every sync (``RemoteVLLM``'s pool).
        options: the ``Directory`` transport's options.
        dtype: the dtype written.
        pause_mode: as :class:`NativeTransfer`'s.
    """

    def __init__(self, pool: ServerPool, options: Directory, *, dtype: torch.dtype | None,
                 pause_mode: PauseMode) -> None:
        super().__init__(pool, pause_mode=pause_mode)
        self._checked = False
        self.writer = DirectoryTarget(options.path, dtype=dtype, shard_bytes=options.shard_bytes,
                                      keep_last=options.keep_last)

    @override
    def setup(self, trainer: Any) -> None:
        self.pauses.rank = trainer.global_rank
        self.writer.setup(trainer)

    @override
    def push(self, source: ExportSource, *, version: int, resume: bool = True) -> None:
        self.push_stream(source, version=version, resume=resume)

    @override
    def push_stream(self, weights: Iterable[tuple[str, Tensor]], *, version: int, resume: bool = True) -> None:
        """Every rank: write (rank 0; the others take part in the gathers), then rank 0 reloads every server
        (``resume=False``: they stay paused for the adapter that follows)."""
        self.writer.push(iter(weights), version=version)
        pauses = self.pauses
        if pauses.rank != 0:
            return
        path = os.fspath(Path(self.writer.version_dir(version)).resolve())
        if not self._checked:
            check_servers(self.servers, backend=None)  # dev mode and quantization, before the first reload
            self._checked = True
        servers = self.servers
        paused_at = pauses.pause(servers)

        def reload_one(server: Server) -> None:
            server.reload_weights(path)
            reset_prefix_caches([server], pauses.mode)
            set_versions([server], version)

        pauses.on_each_server(servers, reload_one, version=version, resume=resume)
        pauses.finish(servers, paused_at, resume, resumed=True)

    @override
    def push_adapter(self, files: AdapterFiles, *, version: int, name: str) -> None:
        """Rank 0: copy the adapter under the shared directory (``<path>/adapters/<name>/v<version>``) and load it
        on every server as ``name``."""
        if self.rank != 0:
            return
        target = self.writer.directory / "adapters" / name / f"v{version:06d}"
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(files.path, target)
        prune_versions(target.parent)
        self.pauses.load_adapter_from(self.servers, os.fspath(target.resolve()), name=name, version=version)

