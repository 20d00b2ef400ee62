"""Leaving a round that waits on a silent member (issue 67).

Trainer rank 0 watches the servers while a round runs (``servers/watch.py``); when one goes silent it posts why in the
group's store (:meth:`Abandon.post`). Every member's waits on the group (trainer ranks and workers alike) look there
whenever a wait has lasted a slice (:data:`SLICE_S`) and raise :class:`RoundAbandoned` with the reason, so no member
waits for the group's timeout on a peer that will never answer: the healthy servers' workers leave the round within
about a second, and rank 0 can redo it without the silent one.

Gloo only (the group's tensors on the host): a collective's wait is cut in slices (a slice that times out leaves the
collective running); a send's or a receive's wait runs in a helper thread (gloo closes every pair of a group whose send
or receive wait times out), which stays with the op once the round is left. A group a round left this way is not
destroyed at once (its destructor would join the thread that runs the stuck op): :func:`keep_group` holds it until
its ops have certainly ended (twice the group's timeout, by which gloo has failed every op it still ran), and the next
group made or left in the process lets it go. (Held until the process ended, as before, every fault cost each member
~0.3 MiB: measured, 60 kept 2-member groups +19 MiB, 60 destroyed +6 MiB; the fault campaign's trainer grew ~5 MiB
per 100 syncs.) NCCL groups (``staged_nccl``) wait as before, on the group's timeout.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from datetime import timedelta
from typing import Any

import torch.distributed as dist

__all__ = ["SLICE_S", "Abandon", "RoundAbandoned", "keep_group", "release_kept", "wait_for"]

SLICE_S = 1.0
"""Seconds a wait lasts before it looks for an abandon in the store (and again every slice after)."""

_KEY = "abandoned"
_KEPT: list[tuple[Any, float]] = []  # groups a round left while an op of theirs may still be stuck: until when


class RoundAbandoned(RuntimeError):
    """Trainer rank 0 left the round: a member went silent (the message says which, and why)."""


class Abandon:
    """One transfer group's abandon: its key in the group's store, and the waits that look for it.

    Args:
        store: the group's store (trainer rank 0 hosts it).
        group: the group's name (a fresh one per rendezvous: an abandon never outlives its group).
        timeout: the group's timeout: how long an op a left round still runs may last.
    """

    def __init__(self, store: dist.Store, group: str, timeout: timedelta) -> None:
        release_kept()
        self._timeout = timeout
        self._store = dist.PrefixStore(f"lfe-gloo/{group}/round", store)
        self._helper: ThreadPoolExecutor | None = None
        self.reason: str | None = None
        """Why the round was left, once a wait has seen it (or this member posted it)."""

    def post(self, reason: str) -> None:
        """Trainer rank 0: leave the round on every member, saying ``reason``."""
        self.reason = self.reason or reason
        self._store.set(_KEY, reason)

    def check(self) -> None:
        """Raise :class:`RoundAbandoned` if the round was left (asks the store)."""
        if self.reason is None and self._store.check([_KEY]):
            self.reason = self._store.get(_KEY).decode(errors="replace")
        if self.reason is not None:
            raise RoundAbandoned(f"the weight-transfer round was left by trainer rank 0: {self.reason}")

    def wait(self, work: Any, timeout: timedelta, *, collective: bool) -> None:
        """``work.wait`` within ``timeout``, raising :class:`RoundAbandoned` within a slice of an abandon."""
        deadline = time.monotonic() + timeout.total_seconds()
        if collective:
            while True:
                left = deadline - time.monotonic()
                try:
                    work.wait(timedelta(seconds=max(min(SLICE_S, left), 0.001)))
                    return
                except RuntimeError as err:
                    if "timed out" not in str(err).lower() or time.monotonic() >= deadline:
                        raise
                self.check()
        if self._helper is None:
            self._helper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lfe-gloo-wait")
        future = self._helper.submit(work.wait, timeout)
        while True:
            try:
                future.result(timeout=SLICE_S)
                return
            except FutureTimeout:
                self.check()

    def close(self, group: Any) -> None:
        """The engine lets go of ``group``: kept alive if a round of it was left (an op may still be stuck in it)."""
        if self.reason is not None:
            keep_group(group, 2 * self._timeout.total_seconds() + 5)
        if self._helper is not None:
            self._helper.shutdown(wait=False)


def wait_for(work: Any, timeout: timedelta, abandon: Abandon | None, *, collective: bool) -> None:
    """``work.wait(timeout)``, through the group's ``abandon`` where it has one (gloo): every wait of the protocol,
    on either side (``collective``: an all-reduce; else a send or a receive)."""
    if abandon is None:
        work.wait(timeout)
    else:
        abandon.wait(work, timeout, collective=collective)


def keep_group(group: Any, seconds: float) -> None:
    """Hold ``group`` for ``seconds`` at least: until an op a left round still runs in it has ended (see the module's
    docstring); then the next call, or the next :class:`Abandon` made, lets it go."""
    release_kept()
    if group is not None:
        _KEPT.append((group, time.monotonic() + seconds))


def release_kept() -> None:
    """Let go of the kept groups whose time is over (their destructors, on this thread, find no op left to join)."""
    now = time.monotonic()
    _KEPT[:] = [(group, until) for group, until in _KEPT if until > now]
