"""Rank 0's watch on the servers while a round runs (issue 67): a server that stops answering is found within seconds,
not at the round's timeout, and no other server waits on it.

**The rule**: a server is *silent* when it leaves ``/health`` unanswered for :data:`HEALTH_TIMEOUT_S` seconds
:data:`MISSES` times in a row, asked every :data:`PERIOD_S` seconds over one kept-open connection (so about 3 to 5 s
after it froze or its link was cut), or at once when its host refuses the connection (its process is gone: about 1 s
after it died). A slow server
(a lossy or loaded link, a ``wait`` pause that lets long requests finish) still answers ``/health`` and is waited for,
up to ``RemoteVLLM(timeout=...)``.

A silent server's requests of the round are given up at once (:func:`~.http.on_each` / ``on_all`` stop waiting for
them: the failure names it), and the round's data stops: trainer rank 0 posts an abandon in the transfer group's store,
and every member's waits leave the round within a second (``backend/abandon.py``). The pipeline then sets it aside
(``min_servers``) and starts the round again without it, or fails the sync naming it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from contextvars import Token
from types import TracebackType

from lightning_fsdp_export.servers.http import SILENT, HealthProbe, Server, ServerError
from lightning_fsdp_export.servers.pool import HEALTH_TIMEOUT_S, MISSES

__all__ = ["MISSES", "PERIOD_S", "HealthWatch"]

PERIOD_S = 1.0
"""Seconds between two ``/health`` requests to a server, while a round runs."""



class HealthWatch:
    """The watch, entered for one round on rank 0: a thread per server asks ``/health`` (the rule above) while the round
    runs; :attr:`silent` names the servers found silent, and ``on_silent(server, why)`` is called once for each.

    Args:
        servers: the round's servers now (those set aside during the round are no longer watched).
        on_silent: what the transfer does when one goes silent (its group's abandon, its pool's record).
    """

    def __init__(self, servers: Callable[[], Sequence[Server]], on_silent: Callable[[Server, str], None]) -> None:
        self._servers = servers
        self._on_silent = on_silent
        self.silent: dict[str, str] = {}
        """The servers found silent during this round, by URL: why."""
        self._stop = threading.Event()
        self._token: Token[Mapping[str, str] | None] | None = None

    def __enter__(self) -> HealthWatch:
        self._token = SILENT.set(self.silent)
        for server in self._servers():
            threading.Thread(target=self._watch, args=(server,), name=f"lfe-watch {server.url}", daemon=True).start()
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        if self._token is not None:
            SILENT.reset(self._token)

    def _watch(self, server: Server) -> None:
        probe = HealthProbe(server, HEALTH_TIMEOUT_S)
        try:
            self._probe(server, probe)
        finally:
            probe.close()

    def _probe(self, server: Server, probe: HealthProbe) -> None:
        misses = 0
        while not self._stop.wait(PERIOD_S):
            if server not in self._servers():
                return  # set aside during the round
            try:
                probe()
                misses = 0
            except ServerError as err:
                misses = MISSES if err.refused else misses + 1  # (nothing listens: no need to ask again)
                if misses >= MISSES and not self._stop.is_set():
                    why = f"no answer to /health for {HEALTH_TIMEOUT_S:g} s, {MISSES} times in a row (last: {err})"
                    self.silent[server.url] = why
                    self._on_silent(server, why)
                    return
