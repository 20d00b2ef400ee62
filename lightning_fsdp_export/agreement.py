"""Ranks agreeing on a sync: before any gather (same plan, no bad input) and after the stream (success).

A sync is collective. A rank that skips it, iterates another order or fails in the middle would
otherwise leave the others waiting in an all-gather until the process group's timeout (30 minutes by
default). The :class:`SyncGroup` turns each of these into an error on every rank, within the
sync's own timeout, naming the ranks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

if TYPE_CHECKING:
    from lightning_fsdp_export.source import ExportSource

__all__ = ["SyncGroup", "WeightSyncError", "agree_before", "compare_shapes", "plan_digest"]


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


def plan_digest(plans: list[list[tuple[str, tuple[int, ...]]]]) -> str:
    """A short hash of the names and shapes a sync will export, in order."""
    return hashlib.sha1(repr(plans).encode()).hexdigest()[:16]


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


def agree_before(group: SyncGroup, version: int, sources: list[ExportSource],
                 check: Callable[[str, list[tuple[str, tuple[int, ...]]]], list[str]], *, check_finite: bool) -> None:
    """Before any gather: every rank here, the same sources, finite weights, names and shapes the engine knows.

    Reads only the sources' metadata (no collective besides this group's small messages); raises
    :class:`WeightSyncError` on every rank, naming the ranks, when anything is off.

    Args:
        group: the sync's control group.
        version: the sync's version (for messages).
        sources: this sync's :class:`~lightning_fsdp_export.source.ExportSource` s, in push order.
        check: ``check(kind, shapes)``, the target's refusals of one source's names and shapes (its
            ``check_weights``, or a ``LoadsAdapters``' ``check_adapter`` for the adapter).
        check_finite: refuse NaN or Inf in this rank's local shards.
    """
    try:
        group.arrive(f"Weight sync of version {version}")
    except RuntimeError as err:
        raise WeightSyncError(str(err)) from None
    shapes = [source.shapes() for source in sources]
    problems: list[str] = []
    if check_finite:
        bad = sorted({name for source in sources for name in source.nonfinite()})
        if bad:
            problems.append(f"NaN or Inf in {', '.join(bad[:5])} (check_finite=False pushes them anyway)")
    for source, plan in zip(sources, shapes):
        try:
            problems += check(source.kind, plan)
        except Exception as err:  # noqa: BLE001 - a server down: reported with the others below
            problems.append(f"checking names and shapes failed: {type(err).__name__}: {err}")
    everyone = group.gather((plan_digest(shapes), problems))
    digests = {digest for digest, _ in everyone}
    if len(digests) > 1:
        groups = {d: [r for r, (dd, _) in enumerate(everyone) if dd == d] for d in digests}
        raise WeightSyncError(
            f"Weight sync of version {version}: ranks would export different tensors or orders (ranks grouped by their"
            f" plan: {sorted(groups.values())}); nothing was gathered or pushed. Every rank must export the same model"
            " with the same options."
        )
    reported = [(rank, p) for rank, (_, ps) in enumerate(everyone) for p in ps]
    if reported:
        lines = "; ".join(f"rank {rank}: {p}" for rank, p in reported[:6])
        raise WeightSyncError(
            f"Weight sync of version {version} refused before any tensor was pushed ({lines}). The engine keeps its"
            " previous weights."
        )


def agree_after(group: SyncGroup, version: int, mine: str | None, what: str) -> None:
    """Every rank's failure (or ``None``) of one step of the sync; raise on every rank if any failed."""
    failures = [(rank, msg) for rank, msg in enumerate(group.gather(mine)) if msg]
    if failures:
        lines = "; ".join(f"rank {rank}: {msg}" for rank, msg in failures)
        raise WeightSyncError(what.format(version=version, lines=lines))
