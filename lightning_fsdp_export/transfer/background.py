"""Pushes that go on in the background: each trainer rank takes a snapshot of its parts, returns to training, and a
thread of its own runs the round (``RemoteVLLM`` over ``Gloo(shard_direct=True, background=True)``; the round is a
staged one, so the servers generate meanwhile and pause only for the swap). At most one push is in flight per target;
the next push, ``wait()`` or the sync's ``settle()`` ends it and raises what it raised.

The thread uses only the transfer's own groups (the trainer ranks' control group, the transfer group) and the
servers; training goes on over the default group in the main thread. A snapshot is taken by every rank or by none:
the ranks agree over the control group before any thread starts.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from lightning_fsdp_export.export.shards import ShardSnapshot, ShardSource

if TYPE_CHECKING:
    from lightning_fsdp_export._common import SyncGroup
    from lightning_fsdp_export.export.source import ExportSource
    from lightning_fsdp_export.transfer.adapters import AdapterTensors

__all__ = ["BackgroundPushes"]


class _Background:
    """A round running in a thread of its own; :meth:`result` joins it and raises what it raised."""

    def __init__(self, run: Callable[[], None], *, name: str) -> None:
        self._error: BaseException | None = None

        def target() -> None:
            try:
                run()
            except BaseException as err:  # noqa: BLE001 - raised by result() in the caller's thread
                self._error = err

        self._thread = threading.Thread(target=target, name=name, daemon=True)
        self._thread.start()

    @property
    def succeeded(self) -> bool:
        """The thread ended without an error (no wait)."""
        return not self._thread.is_alive() and self._error is None

    def result(self) -> None:
        self._thread.join()  # the round's own timeouts bound it (every collective and request has one)
        if self._error is not None:
            raise self._error


class BackgroundPushes:
    """What a transfer holds to push in the background: the push in flight, its snapshot, waiting for it.

    Args:
        enabled: a push takes this rank's snapshot and returns; a thread runs the round while training goes on.
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        """A push takes this rank's snapshot and returns; a thread runs the round while training goes on."""
        self._pending: _Background | None = None
        self.last_snapshot_bytes = 0
        """This rank's host bytes of its last background push's snapshot."""

    def start(self, run: Callable[[], None], *, name: str) -> None:
        """Run ``run`` (one round) in a thread of its own named ``name``; the next :meth:`wait` ends it."""
        self._pending = _Background(run, name=name)

    def snapshot(self, source: ExportSource | AdapterTensors, version: int, control: SyncGroup | None) -> ShardSnapshot:
        """Every rank: its snapshot of ``source`` (the pass, a collective), once every rank has one: a rank whose pass
        failed drains it (so no rank waits in a gather) and the ranks learn of it (over ``control``, the trainer ranks'
        group) before any thread starts."""
        assert isinstance(source, ShardSource) and control is not None  # every_rank: shards, a control group
        error: BaseException | None = None
        snapshot = None
        try:
            snapshot = ShardSnapshot(source)
        except Exception as err:  # noqa: BLE001 - every rank learns of it just below
            error = err
            source.drain()
        failed = [rank for rank, ok in enumerate(control.gather(error is None)) if not ok]
        if error is not None:
            raise error
        if failed:
            raise RuntimeError(f"trainer rank(s) {failed} failed to take their snapshot of version {version}; nothing"
                               " was sent (the servers serve the previous version).")
        assert snapshot is not None
        self.last_snapshot_bytes = snapshot.nbytes
        return snapshot

    def arrived(self) -> bool:
        """Without waiting: no push in the background, or its round ended well on this rank (every rank's ends after
        rank 0 told it the swap's outcome)."""
        return self._pending is None or self._pending.succeeded

    def wait(self) -> None:
        """Every rank: end the push still travelling in the background, if any, and raise its failure (this rank's)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()
