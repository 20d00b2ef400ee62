"""Fault injection for the tests that kill a trainer at each step of a round (``tests/test_remote_swap.py``).

``LIGHTNING_FSDP_EXPORT_FAULT`` holds comma-separated directives: ``kill:<point>`` SIGKILLs this process when it reaches
``<point>`` (a real death: no handler, no ``finally``), and ``hold:<step>`` asks a server's swap (``/lfe/swap``) to
wait at ``<step>`` until the trainer is gone, so the death lands while the server is at that step. Unset (always, in
use), nothing happens. The points a trainer reaches: ``staged`` (a staged round's data is at every server, before the
swap) and ``swap_sent`` (the swap request is on the wire, before its answer).
"""

from __future__ import annotations

import os
import signal

__all__ = ["FAULT_ENV", "fault", "hold_at"]

FAULT_ENV = "LIGHTNING_FSDP_EXPORT_FAULT"


def _directives() -> list[str]:
    return [d.strip() for d in os.environ.get(FAULT_ENV, "").split(",") if d.strip()]


def fault(point: str) -> None:
    """Die here (SIGKILL) if ``kill:<point>`` is set."""
    if f"kill:{point}" in _directives():
        os.kill(os.getpid(), signal.SIGKILL)


def hold_at() -> str | None:
    """The swap step a ``hold:<step>`` directive names, else ``None``."""
    holds = [d.removeprefix("hold:") for d in _directives() if d.startswith("hold:")]
    return holds[0] if holds else None
