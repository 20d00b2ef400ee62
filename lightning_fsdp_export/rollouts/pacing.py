"""The pacing of :class:`~.callback.AsyncRollouts`: which version a group will be consumed at, and so whether the
servers' version lets it be admitted now without exceeding the staleness bound."""

from __future__ import annotations

from lightning_fsdp_export.rollouts.state import RolloutState

__all__ = ["Pacing"]


class Pacing:
    """Admission by the predicted consumption version.

    A group is sent only once the servers hold at least the version it will be consumed at minus
    ``max_staleness``, predicted from the groups ahead of it (``batch_size`` groups per step, one version per
    ``versions_every`` steps) and re-anchored at every consumption (``anchor``).

    Args:
        batch_size: groups consumed per step.
        max_staleness: the bound ``K``.
        max_in_flight: requests in flight at most.
        versions_every: batches per version (set at train start when not given).
    """

    def __init__(self, *, batch_size: int, max_staleness: int, max_in_flight: int,
                 versions_every: int | None) -> None:
        self.batch_size = batch_size
        self.max_staleness = max_staleness
        self.max_in_flight = max_in_flight
        self.versions_every = versions_every
        self.anchor = (0, 0, 0)
        """(groups consumed, version, groups consumed at that version) at the last fill."""

    def consumed_at(self, index: int) -> int:
        """The version the group at ``index`` of this fit's consumption order is predicted to be consumed at."""
        consumed, version, at_version = self.anchor
        per_version = self.batch_size * (self.versions_every or 1)
        ahead = index - consumed  # groups consumed before it, from the last fill on
        left = per_version - at_version  # still consumed at ``version``
        if ahead < left:
            return version
        return version + 1 + (ahead - left) // per_version

    def may_admit(self, state: RolloutState, served: int | None) -> bool:
        """Whether one more group may be sent now, the servers holding ``served`` (``None`` while a push is in flight:
        nothing is admitted against it); under ``state.lock``."""
        if len(state.in_flight) >= self.max_in_flight or served is None:
            return False
        position = state.consumed + len(state.in_flight) + len(state.ready)  # its place in the consumption order
        return served >= self.consumed_at(position) - self.max_staleness
