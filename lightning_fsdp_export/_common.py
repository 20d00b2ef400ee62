"""Small pieces every room above may use: the sync's control group and error, and the shape comparison.

A sync is collective. A rank that skips it, iterates another order or fails in the middle would otherwise leave
the others waiting in an all-gather until the process group's timeout (30 minutes by default). The
:class:`SyncGroup` turns each of these into an error on every rank, within the sync's own timeout, naming the ranks.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist

__all__ = ["SyncGroup", "WeightSyncError", "compare_shapes"]


class WeightSyncError(RuntimeError):
    """A sync failed on at least one rank; every rank raises it, and the target is marked stale."""


class SyncGroup:
    """A gloo group with its own timeout for a sync's small control messages.

    Args:
        timeout: how long a rank waits for the others at each control point.
    """

    def __init__(self, timeout: timedelta) -> None:
        self.timeout = timeout
        self.rank = 0
        self.world_size = 1
        self._group: Any = None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
            self._group = dist.new_group(backend="gloo", timeout=timeout)  # collective: every rank builds it

    def arrive(self, what: str) -> None:
        """Wait until every rank reached ``what``; past the timeout raise, naming the ranks missing (rank 0)."""
        if self._group is None:
            return
        try:
            dist.monitored_barrier(group=self._group, timeout=self.timeout, wait_all_ranks=True)
        except RuntimeError as err:
            raise RuntimeError(
                f"{what}: not every rank arrived within {self.timeout.total_seconds():.0f} s ({err}). Every rank must"
                " call the sync at the same point (same trigger, same step)."
            ) from None

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (picklable), in rank order."""
        if self._group is None:
            return [value]
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, value, group=self._group)
        return everyone

    def collect(self, value: Any) -> list[Any] | None:
        """Every rank's ``value`` (picklable) on rank 0, in rank order; ``None`` on the others."""
        if self._group is None:
            return [value]
        out: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(value, out, dst=0, group=self._group)
        return out

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` (picklable) on every rank."""
        if self._group is None:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self._group)
        return box[0]


def compare_shapes(exported: list[tuple[str, tuple[int, ...]]], expected: dict[str, tuple[int, ...]], *,
                   may_be_absent: set[str], limit: int = 5) -> list[str]:
    """Lines describing where the trainer's export and the engine's checkpoint disagree (empty: they agree).

    Args:
        exported: ``(name, shape)`` the trainer will push.
        expected: ``{name: shape}`` of the engine's checkpoint.
        may_be_absent: exported names a checkpoint may lack (a tied ``lm_head.weight``).
        limit: at most this many names per kind of mismatch.
    """
    have = dict(exported)
    wrong = [f"{n}: trainer {list(s)} vs engine {list(expected[n])}" for n, s in exported
             if n in expected and tuple(expected[n]) != tuple(s)]
    unknown = [n for n, _ in exported if n not in expected and n not in may_be_absent]
    missing = [n for n in expected if n not in have]
    lines = []
    if wrong:
        lines.append(f"shapes differ ({len(wrong)}): " + "; ".join(wrong[:limit]))
    if unknown:
        lines.append(f"unknown to the engine ({len(unknown)}): " + ", ".join(unknown[:limit]))
    if missing:
        lines.append(f"missing from the trainer's export ({len(missing)}): " + ", ".join(missing[:limit]))
    return lines
