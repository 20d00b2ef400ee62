"""What ``RemoteVLLM`` drives, whichever the transport: a :class:`Transfer`. Two exist: a network group's rounds
(:class:`~lightning_fsdp_export.transfer.frame.NativeTransfer`) and a shared directory's
(:class:`~lightning_fsdp_export.targets.remote_directory.DirectoryReload`). Each reads the round's servers from the pool
(:class:`~lightning_fsdp_export.servers.pool.ServerPool`, their one owner), holds the servers' pause (a
:class:`~lightning_fsdp_export.servers.pauses.Pauses`) and its pushes in the background (a
:class:`~lightning_fsdp_export.transfer.background.BackgroundPushes`, never enabled for a directory); what only some
transfers do has a default here that does nothing, so the target asks no transfer what class it is.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any

from torch import Tensor

from lightning_fsdp_export.backend.shared import PauseMode
from lightning_fsdp_export.export.source import ExportSource
from lightning_fsdp_export.servers.http import Server, on_all
from lightning_fsdp_export.servers.pauses import Pauses
from lightning_fsdp_export.servers.pool import ServerPool
from lightning_fsdp_export.transfer.adapters import AdapterFiles
from lightning_fsdp_export.transfer.background import BackgroundPushes

__all__ = ["Transfer"]


class Transfer(ABC):
    """One way weights reach the servers, every sync (every rank holds one; rank 0 talks to the servers).

    Args:
        pool: the servers (replicas) every sync updates: rank 0 keeps the pool current (``ServerPool.of(servers)``
            for a fixed list).
        pause_mode: how a round pauses them.
        background: a push takes this rank's snapshot and returns; a thread runs the round.
    """

    def __init__(self, pool: ServerPool, *, pause_mode: PauseMode, background: bool = False) -> None:
        self.pool = pool
        """Who takes each round, who is set aside (``RemoteVLLM(min_servers=...)``), who swaps on its own: the one
        owner of the round's servers, which every step is handed from here."""
        self.pauses = Pauses(pause_mode)
        self.background = BackgroundPushes(background)
        self.last_patch: dict[str, Any] | None = None
        """This rank's last sparse round's report: patched or dense, bytes sent and dense, elements, changed, copy
        bytes (``None``: no sparse round yet, or a transfer that sends no patches)."""

    @property
    def servers(self) -> list[Server]:
        """The servers the next round updates: the pool's active ones (rank 0 refreshes the pool before each sync, and
        sets a server aside the moment it fails a round; elsewhere the servers first named)."""
        return self.pool.active

    @property
    def pause_mode(self) -> PauseMode:
        """How a round pauses the servers."""
        return self.pauses.mode

    @property
    def last_pause(self) -> tuple[float, float] | None:
        """Rank 0: wall-clock times of the last completed round's ``/pause`` and ``/resume`` (None before one)."""
        return self.pauses.last_pause

    def pause_all(self) -> None:
        """Rank 0: pause every server (as a round would) outside a round: before the exact check zeroes them."""
        on_all(self.servers, lambda s: s.pause(self.pause_mode))

    @property
    def in_background(self) -> bool:
        """A push takes this rank's snapshot and returns; a thread runs the round."""
        return self.background.enabled

    def arrived(self) -> bool:
        """This rank: the push in the background (if any) has ended."""
        return self.background.arrived()

    def wait(self) -> None:
        """This rank: wait for the push in the background (if any); its failure raises."""
        self.background.wait()

    @property
    def rank(self) -> int:
        """This trainer rank (set at :meth:`setup`, on the pause: only rank 0 talks to the servers)."""
        return self.pauses.rank

    @abstractmethod
    def setup(self, trainer: Any) -> None:
        """Every rank, at fit start (``trainer``: its ``global_rank`` and ``world_size``)."""

    @abstractmethod
    def push(self, source: ExportSource, *, version: int, resume: bool = True) -> None:
        """Every rank: send ``source`` as ``version`` (``resume=False``: the servers stay paused for the adapter that
        follows)."""

    @abstractmethod
    def push_adapter(self, files: AdapterFiles, *, version: int, name: str) -> None:
        """Every rank: every server serves this adapter version as ``name``."""

    def push_draft(self, source: ExportSource, *, version: int) -> None:
        """Every rank: send a drafter's ``source`` as ``version`` into every server's draft model (a transfer that
        carries drafters says so in its target's ``cannot_push_drafts``, which ``VLLMWeightSync`` asks first)."""
        raise TypeError(f"{type(self).__name__} carries no drafter.")

    @abstractmethod
    def push_stream(self, weights: Iterable[tuple[str, Tensor]], *, version: int) -> None:
        """A plain stream of ``(name, tensor)``, without a source's metadata (a directory takes one; a network group
        refuses it, naming the transport)."""

    def confirm(self, version: int | None) -> None:  # noqa: B027 - a default that does nothing
        """Every rank, before a sync: the version every rank agreed the servers hold (sparse rounds patch it)."""

    def forget(self) -> None:  # noqa: B027 - a default that does nothing
        """The servers' weights are no longer what this rank last sent: the next push is dense."""

    def disconnect(self) -> None:  # noqa: B027 - a default that does nothing
        """Rank 0 at the fit's end: shut down what the servers hold for this transfer."""

    def remove_adapter_files(self) -> None:  # noqa: B027 - a default that does nothing
        """Rank 0 at the fit's end: this fit's adapter files on this host."""
