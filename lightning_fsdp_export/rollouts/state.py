"""What the client threads and the Trainer's side of :class:`~.callback.AsyncRollouts` share, under one lock."""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

from lightning_fsdp_export.rollouts.samples import SampleGroup
from lightning_fsdp_export.servers.http import Server

__all__ = ["RolloutState"]


class RolloutState:
    """The groups ready and in flight, the prompts' positions and the counters of one rank's rollouts.

    Every field is read and written under ``lock`` (a condition: the client threads wait on it for admission,
    the batch fill for groups).
    """

    def __init__(self) -> None:
        self.lock = threading.Condition()
        self.stopping = threading.Event()
        self.ready: deque[SampleGroup] = deque()
        self.in_flight: dict[str, tuple[Server, int]] = {}
        """Request id -> (server, prompt index)."""
        self.connections: dict[str, Any] = {}
        """Request id -> its HTTP connection (``stop()`` interrupts it)."""
        self.next = 0
        """This rank's next prompt (its position in its share)."""
        self.done: set[int] = set()
        """Prompts consumed (pruned below the first pending one at each save)."""
        self.consumed = 0
        """Groups consumed this fit."""
        self.retry: deque[int] = deque()
        """Prompts whose request failed: sent again, to another server."""
        self.attempts: dict[int, int] = {}
        self.errors: list[str] = []
        self.down: dict[str, float] = {}
        """Server url -> when it last failed."""
        self.sent: dict[str, int] = {}
        """Server url -> requests sent to it."""
        self.dropped = 0
        self.produced_samples = 0
        self.multi_version_samples = 0
        self.resampled = 0
        """Groups sent again because the servers swapped between their admission and their prefill."""

    def pending(self) -> list[int]:
        """Prompts admitted and not consumed: in flight, ready, or to be sent again (under ``lock``)."""
        return [i for _, i in self.in_flight.values()] + [g.prompt_index for g in self.ready] + list(self.retry)
