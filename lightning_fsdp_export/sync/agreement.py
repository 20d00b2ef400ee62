"""Ranks agreeing on a sync: before any gather (same plan, no bad input) and after the stream (success), over the
sync's :class:`~lightning_fsdp_export._common.SyncGroup`: each failure becomes an error on every rank, naming the
ranks, within the sync's own timeout.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from lightning_fsdp_export._common import SyncGroup, WeightSyncError

if TYPE_CHECKING:
    from lightning_fsdp_export.export.source import ExportSource
    from lightning_fsdp_export.targets.base import WeightTarget

__all__ = ["FAILED", "agree_after", "agree_arrived", "agree_before", "plan_digest"]


def plan_digest(plans: list[list[tuple[str, tuple[int, ...]]]]) -> str:
    """A short hash of the names and shapes a sync will export, in order."""
    return hashlib.sha1(repr(plans).encode()).hexdigest()[:16]


def agree_before(group: SyncGroup, version: int, sources: list[ExportSource],
                 check: Callable[[str, list[tuple[str, tuple[int, ...]]]], list[str]], *, check_finite: bool) -> None:
    """Before any gather: every rank here, the same sources, finite weights, names and shapes the engine knows.

    Reads only the sources' metadata (no collective besides this group's small messages); raises
    :class:`WeightSyncError` on every rank, naming the ranks, when anything is off.

    Args:
        group: the sync's control group.
        version: the sync's version (for messages).
        sources: this sync's :class:`~lightning_fsdp_export.export.source.ExportSource` s, in push order.
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
    try:
        everyone = group.gather(mine)
    except WeightSyncError as err:  # a rank is gone: say so, with what this rank saw of the step itself
        raise WeightSyncError(f"Weight sync of version {version} failed: {err}" + (
            f" This rank's own failure: {mine}" if mine else "")) from err
    failures = [(rank, msg) for rank, msg in enumerate(everyone) if msg]
    if failures:
        lines = "; ".join(f"rank {rank}: {msg}" for rank, msg in failures)
        raise WeightSyncError(what.format(version=version, lines=lines))


FAILED = "Weight sync of version {version} failed ({lines}). The target is stale."


def agree_arrived(group: SyncGroup, version: int, target: WeightTarget) -> None:
    """Every rank: wait for ``target``'s push still in the background (``target.wait()``) and agree on its outcome;
    raises :class:`~lightning_fsdp_export._common.WeightSyncError` on every rank if it failed on any."""
    mine = None
    try:
        target.wait()
    except Exception as err:  # noqa: BLE001 - reported on every rank, after the ranks agree
        mine = f"{type(err).__name__}: {err} (in the background, after the snapshot)"
    agree_after(group, version, mine, FAILED)

