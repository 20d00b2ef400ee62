"""What ``RemoteVLLM`` drives, whichever the transport: a :class:`Transfer`. Two exist: a network group's rounds
(:class:`~lightning_fsdp_export.transfer.frame.NativeTransfer`) and a shared directory's
(:class:`~lightning_fsdp_export.targets.remote_directory.DirectoryReload`). Each holds the servers' pause (a
:class:`~lightning_fsdp_export.transfer.pauses.Pauses`) and its pushes in the background (a
:class:`~lightning_fsdp_export.transfer.background.BackgroundPushes`, never enabled for a directory); what only some
transfers do has a default here that does nothing, so the target asks no transfer what class it is.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import Any

from torch import Tensor

from lightning_fsdp_export.export.source import ExportSource
from lightning_fsdp_export.transfer.adapters import AdapterFiles
from lightning_fsdp_export.transfer.background import BackgroundPushes
from lightning_fsdp_export.transfer.http import Server
from lightning_fsdp_export.transfer.pauses import Pauses
from lightning_fsdp_export.transfer.transports import PauseMode

__all__ = ["Transfer"]


class Transfer(ABC):
    """One way weights reach the servers, every sync (every rank holds one; rank 0 talks to the servers).

    Args:
        servers: the servers (replicas) every sync updates.
        pause_mode: how a round pauses them.
        background: a push takes this rank's snapshot and returns; a thread runs the round.
    """

    def __init__(self, servers: Sequence[Server], *, pause_mode: PauseMode, background: bool = False) -> None:
        self.pauses = Pauses(servers, pause_mode)
        self.background = BackgroundPushes(background)

    @property
    def servers(self) -> list[Server]:
        """The servers every round updates."""
        return self.pauses.servers

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

    @abstractmethod
    def push_stream(self, weights: Iterable[tuple[str, Tensor]], *, version: int) -> None:
        """A plain stream of ``(name, tensor)``, without a source's metadata (a directory takes one; a network group
        refuses it, naming the transport)."""

    def confirm(self, version: int | None) -> None:  # noqa: B027 - a default that does nothing
        """Every rank, before a sync: the version every rank agreed the servers hold (sparse rounds patch it)."""

    def forget(self) -> None:  # noqa: B027 - a default that does nothing
        """The servers' weights are no longer what this rank last sent: the next push is dense."""

    @property
    def last_patch(self) -> dict[str, Any] | None:
        """This rank's last sparse round's report (``None``: the transfer sends no patches)."""
        return None

    def disconnect(self) -> None:  # noqa: B027 - a default that does nothing
        """Rank 0 at the fit's end: shut down what the servers hold for this transfer."""

    def remove_adapter_files(self) -> None:  # noqa: B027 - a default that does nothing
        """Rank 0 at the fit's end: this fit's adapter files on this host."""
