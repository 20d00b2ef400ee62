"""The server half of the health rule (issue 67): a server whose engine process is stopped is not healthy.

vLLM's ``/health`` is answered by the API server process alone: with its engine process stopped (SIGSTOP, a debugger,
a cgroup freezer) it still answers 200, while every request that needs the engine (``/pause``, a weight update, a
completion) waits forever. A trainer's watch then saw a live server, and a round waited on that server's workers until
the transfer group's timeout (measured: 20 s with ``timeout=20``, 300 s by default).

The plugin's middleware (``server_swap.middleware``) answers ``/health`` with 503 when a process under the API server
(its engine core, its workers) is stopped (:func:`stopped_processes`, read from ``/proc``), naming it. The pool's
``/health`` before a round and the round's watch (``servers/watch.py``) then find the server unhealthy within seconds,
set it aside where ``min_servers`` allows, and let it rejoin once the process runs again. A process that hangs without
being stopped (a kernel that never returns) is not seen here: the round's timeout still ends that one. Linux only
(elsewhere no process is ever found stopped).
"""

from __future__ import annotations

import os
from typing import Any

from fastapi.responses import JSONResponse  # (this module runs in the vLLM API server, which serves with FastAPI)

__all__ = ["stopped_processes", "unhealthy"]

STOPPED = frozenset("Tt")
"""``/proc/<pid>/stat`` states of a stopped process (by a signal; by a tracer)."""


def stopped_processes(root: int | None = None) -> list[tuple[int, str]]:
    """The processes under ``root`` (default: this process), at any depth, that are stopped now: ``(pid, name)``."""
    children: dict[int, list[int]] = {}
    states: dict[int, tuple[str, str]] = {}
    try:
        entries = [e.name for e in os.scandir("/proc") if e.name.isdigit()]
    except OSError:
        return []
    for name in entries:
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue  # gone meanwhile
        head, _, rest = stat.rpartition(")")  # "pid (comm) state ppid ...": comm may hold spaces and parentheses
        fields = rest.split()
        if len(fields) < 2:
            continue
        pid = int(name)
        states[pid] = (fields[0], head.partition("(")[2])
        children.setdefault(int(fields[1]), []).append(pid)
    found, todo = [], list(children.get(os.getpid() if root is None else root, []))
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        state, comm = states.get(pid, ("?", "?"))
        if state in STOPPED:
            found.append((pid, comm))
    return sorted(found)


def unhealthy() -> Any:
    """The 503 to answer ``/health`` with while a process of this server is stopped, else ``None``."""
    stopped = stopped_processes()
    if not stopped:
        return None
    named = ", ".join(f"{pid} ({comm})" for pid, comm in stopped)
    return JSONResponse({"error": f"process(es) {named} of this vLLM server are stopped: its engine can neither"
                                  " generate nor take weights. Continue them (SIGCONT) or restart the server."},
                        status_code=503)
