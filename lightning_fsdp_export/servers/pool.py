"""A pool of servers that heals: which servers a network transfer updates each round, and which it has set aside.

``RemoteVLLM(urls, min_servers=k)`` keeps syncing while at least ``k`` servers take each version. Rank 0 holds the
pool. Before each round it re-reads the URLs (a callable or a file given as ``base_url``: servers join and leave a
running fit), asks every server in the round for ``/health`` and every server set aside too: a server that does not
answer is set aside (named once in a warning, counted in ``weight_sync/servers_out``); one set aside that answers
again (restarted, from any checkpoint) rejoins, and the round that takes it rebuilds the transfer group, so it gets
every tensor whole before anything is patched against it. A set-aside server is waited for only :data:`OUT_GRACE_S`
past the serving ones (in full where its last answer came late): one frozen or cut off costs the syncs nothing. A
round that fails on some servers only (their pause, swap, adapter load or cache reset) succeeds when at least ``k``
took the version: the others are set aside. One that answered ``/health`` and then fails as the round begins (its
pause, the group's rebuild) is set aside at once and the round starts again without it, in a new group, before any
data leaves.

``min_servers=None`` (the default) is today's rule: every server takes every version, and one that fails fails the
sync; the pool then only re-reads the URLs.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_fsdp_export._common import SyncGroup
from lightning_fsdp_export.servers.http import Server, ServerError
from lightning_fsdp_export.servers.pauses import PartlyFailed

__all__ = ["HEALTH_TIMEOUT_S", "MISSES", "OUT_GRACE_S", "ServerPool", "Urls", "answers", "read_urls"]

HEALTH_TIMEOUT_S = 2.0
"""Seconds a server has to answer one ``/health``."""

MISSES = 2
"""``/health`` requests in a row a server must leave unanswered to be set aside (before a round, and by the round's
watch): one lost to a lossy link is not a silent server. A refused connection (nothing listens) is enough at once."""

OUT_GRACE_S = 0.25
"""Seconds a set-aside server's ``/health`` is waited for past the serving servers' answers before a round (a restarted
server answers in milliseconds). One that answers later is waited for in full at the next sync; one that never answers
(frozen, cut off) is not waited for: each sync waited its whole ``/health`` timeout (2 s) while it stayed out."""

Urls = str | Sequence[str] | Callable[[], Sequence[str]] | os.PathLike[str]
"""What ``RemoteVLLM(base_url=...)`` takes: one URL, a list, a callable returning the list now, or a file of them."""


def read_urls(given: Urls) -> list[str]:
    """The server URLs ``given`` names now: itself, its items, what the callable returns, or the file's lines (blank
    lines and ``#`` comments skipped; a file as a ``Path`` or as a ``str`` naming a file, not a URL)."""
    if isinstance(given, str) and "://" not in given and Path(given).is_file():
        given = Path(given)
    if isinstance(given, os.PathLike):
        lines = Path(given).read_text().splitlines()
        urls = [line.split("#", 1)[0].strip() for line in lines]
        return [u for u in urls if u]
    if callable(given):
        got = given()
        return [got] if isinstance(got, str) else list(got)
    return [given] if isinstance(given, str) else list(given)


class ServerPool:
    """Rank 0's view of the servers: who takes the next round (:attr:`active`), who is set aside and why (:attr:`out`).

    Args:
        urls: the servers (``RemoteVLLM``'s ``base_url``); a callable or a file is re-read before every round.
        make: builds a :class:`Server` for a URL (the target's API key and timeout).
        min_servers: the fewest servers that must take each version (``None``: every one).
    """

    def __init__(self, urls: Urls, make: Callable[[str], Server], *, min_servers: int | None) -> None:
        self._urls, self._make = urls, make
        self.min_servers = min_servers
        self.known: dict[str, Server] = {}
        """Every server named so far, by URL (those that left included)."""
        self.listed: list[str] = []
        """The URLs named now, in their order."""
        self.out: dict[str, str] = {}
        """The servers set aside, by URL: why (they are polled before every round and rejoin when they answer)."""
        self.joined: list[str] = []
        """The URLs that joined (or rejoined) at the last :meth:`refresh`: their first round pushes every tensor."""
        self.members: list[str] = []
        """The URLs the transfer group was last built for (a round whose active servers differ rebuilds it)."""
        self.own_swaps: set[Server] = set()
        """Staged rounds: the servers that swap on their own (``/lfe/swap``), found at each group build."""
        self.silent: dict[str, str] = {}
        """The servers the running round's watch found silent, by URL: why (``servers/watch.py``; cleared as the
        next round's servers are asked for ``/health``)."""
        self._warned_swaps: set[str] = set()
        self._late: set[str] = set()  # set-aside servers whose last /health answered after the grace: waited for
        self._fresh = False  # refreshed for the coming round already (the sync's agreement): not asked again
        self._reread()

    @classmethod
    def of(cls, servers: Sequence[Server]) -> ServerPool:
        """A pool of these servers, every one taking every version."""
        by_url = {s.url: s for s in servers}
        return cls(list(by_url), by_url.__getitem__, min_servers=None)

    @property
    def heals(self) -> bool:
        """Servers are set aside and rejoin (``min_servers`` given); else every server takes every version."""
        return self.min_servers is not None

    @property
    def changes(self) -> bool:
        """Whether the servers a round updates can change during the fit (``min_servers``, or URLs re-read)."""
        return self.heals or not isinstance(self._urls, (str, Sequence))

    def held_version(self) -> int | None:
        """The highest version a listed server is tagged with (``/weight_info``; a server that does not answer in
        :data:`HEALTH_TIMEOUT_S`, or holds none of ours, counts none)."""
        held = []
        for url in self.listed:
            try:
                held.append(int(self.server(url).weight_info(timeout=HEALTH_TIMEOUT_S)
                                ["weight_version"]))
            except (ServerError, KeyError, TypeError, ValueError):
                continue
        return max(held, default=None)

    def server(self, url: str) -> Server:
        """The server at ``url`` (one already named, else a new one)."""
        if url not in self.known:
            self.known[url] = self._make(url)
        return self.known[url]

    @property
    def active(self) -> list[Server]:
        """The servers the next round updates: every one listed and not set aside."""
        return [self.known[u] for u in self.listed if u not in self.out]

    def quorum(self) -> int:
        """How many servers must take a version: ``min_servers``, or every one listed."""
        return self.min_servers if self.min_servers is not None else len(self.listed)

    def _reread(self) -> None:
        urls = read_urls(self._urls)
        if not urls:
            raise ValueError(f"RemoteVLLM(base_url={self._urls!r}) names no server now; it needs at least one.")
        if len(set(urls)) != len(urls):
            raise ValueError(f"RemoteVLLM(base_url=...) lists a server twice: {urls}.")
        for url in urls:
            self.server(url)
        self.listed = urls
        self.out = {u: why for u, why in self.out.items() if u in urls}  # a server that left is forgotten

    def refresh(self) -> list[Server]:
        """Rank 0, before a round: re-read the URLs; with ``min_servers``, set aside the servers that do not answer
        ``/health`` and take back those set aside that answer again; without, fail on the first that does not. The
        servers the round updates (where they differ from the group's :attr:`members`, the round rebuilds the group,
        pushing every tensor)."""
        before = [s.url for s in self.active]
        self.silent = {}
        if self.changes:
            self._reread()
        silent = self._health([self.known[u] for u in self.listed])
        if self.heals:
            back = [u for u in self.out if self.known[u] not in silent]
            for url in back:
                del self.out[url]
            self.set_aside({s: e for s, e in silent.items() if s.url not in self.out},
                           why="does not answer /health")
        elif silent:  # every server takes every round: one that vanished fails it now, not at /pause a timeout later
            self.members = []  # its workers may be gone or new (a restart): the next round builds a new group
            server, err = next(iter(silent.items()))
            raise ServerError(f"{err} (asked before the round, {HEALTH_TIMEOUT_S:g} s to answer, {MISSES} times;"
                              " nothing was paused. With RemoteVLLM(min_servers=k) the others would take it.)",
                              server.url) from err
        after = self.active
        self._fresh = True
        self.joined = [s.url for s in after if s.url not in before]
        if self.joined and before:
            rank_zero_warn(f"RemoteVLLM: server(s) {self.joined} join the pool; this round pushes every tensor whole"
                           f" to {len(after)} server(s).")
        return after

    def _health(self, servers: list[Server]) -> dict[Server, BaseException]:
        """Every server's ``/health`` at once (:func:`answers`), what failed by server. A set-aside server is waited for
        :data:`OUT_GRACE_S` past the others (in full where its last answer came late, or where the serving ones are
        fewer than ``min_servers``); one not answered by then stays out, its request left to finish in its thread."""
        waited = {s for s in servers if s.url not in self.out or s.url in self._late}
        if len(waited) < self.quorum() or not self.heals:
            waited = set(servers)
        failed: dict[Server, BaseException] = {}
        done: set[Server] = set()
        gave_up: set[Server] = set()  # not answered when this refresh stopped waiting
        changed = threading.Condition()

        def ask(server: Server) -> None:
            try:
                answers(server, confirm=server.url not in self.out)
            except Exception as err:  # noqa: BLE001 - what failed is the caller's to judge
                with changed:
                    failed[server] = err
            with changed:
                if server in gave_up and server not in failed:
                    self._late.add(server.url)  # it answers, slowly: wait for it in full next time
                done.add(server)
                changed.notify_all()

        for server in servers:
            threading.Thread(target=ask, args=(server,), name=f"lfe-health {server.url}", daemon=True).start()
        with changed:
            changed.wait_for(lambda: waited <= done)
            changed.wait_for(lambda: len(done) == len(servers), timeout=OUT_GRACE_S)
            gave_up.update(s for s in servers if s not in done)
            self._late -= {s.url for s in done}
            return {s: failed[s] if s in failed else
                    ServerError(f"vLLM server {s.url} (set aside) did not answer /health within {OUT_GRACE_S:g} s of"
                                " the others; it is asked again before the next round.", s.url)
                    for s in servers if s in failed or s in gave_up}

    def agree(self, ranks: SyncGroup, *, rank_zero: bool) -> list[str]:
        """Every rank, before each push where the pool can change: rank 0 refreshes it (its :attr:`active` servers take
        the round); returns, on every rank, the URLs that serve (not those that just joined). Rank 0's failure (every
        server required, one silent) is raised on every rank."""
        failure: ServerError | None = None
        serving: Any = None
        if rank_zero:
            try:
                active = self.refresh()
                serving = [s.url for s in active if s.url not in self.joined]
            except ServerError as err:
                failure, serving = err, {"error": str(err), "url": err.url}
        serving = ranks.broadcast(serving)
        if isinstance(serving, dict):
            raise failure or ServerError(f"trainer rank 0: {serving['error']}", serving["url"])
        return list(serving)

    def for_round(self) -> list[Server]:
        """Rank 0, as a round starts: the servers it updates. Refreshed now, unless the sync's agreement
        (``RemoteVLLM.agree``) refreshed the pool for this round already: each sync asks every server once."""
        if self._fresh:
            self._fresh = False
            return self.active
        servers = self.refresh()
        self._fresh = False
        return servers

    def find_own_swaps(self, servers: Sequence[Server]) -> None:
        """Rank 0, building a group for staged rounds: which ``servers`` swap on their own (``/lfe/swap``); the
        others are named once."""
        self.own_swaps = {s for s in servers if s.swaps_on_its_own()}
        stepwise = [s.url for s in servers if s not in self.own_swaps and s.url not in self._warned_swaps]
        if stepwise:
            self._warned_swaps.update(stepwise)
            rank_zero_warn(f"vLLM server(s) {stepwise} have no /lfe/swap route, so this trainer drives their swaps step"
                           " by step: a trainer that dies mid-swap leaves such a server paused until the next trainer"
                           " pushes. Start them with `--middleware lightning_fsdp_export_plugin.swap_route` to let"
                           " each server carry out its swap on its own.")

    def set_aside(self, failed: dict[Server, BaseException], *, why: str) -> None:
        """Set ``failed`` aside (a warning names each once); they are polled before every round."""
        new = {s.url: f"{why}: {err}" for s, err in failed.items() if s.url not in self.out}
        self.out.update(new)
        if new:
            lines = "; ".join(f"{u} ({w})" for u, w in new.items())
            rank_zero_warn(f"RemoteVLLM: set aside {len(new)} server(s): {lines}. {len(self.active)} of"
                           f" {len(self.listed)} take the next versions (min_servers={self.min_servers}); a server set"
                           " aside is asked for /health before every sync and rejoins with every tensor once it"
                           " answers.")

    def took(self, resumed: Sequence[Server], err: Exception, servers: Sequence[Server]) -> bool:
        """Rank 0, a round of ``servers`` that failed on some of them after the data reached them (``err``, a
        ``PartlyFailed``): with ``min_servers``, if enough took the version (``resumed``), set the others aside (the
        next round rebuilds the group without them) and say the round is done."""
        if not self.heals or not isinstance(err, PartlyFailed) or len(resumed) < self.quorum():
            return False
        self.set_aside({s: err for s in servers if s not in resumed}, why="failed the round")
        return True

    def drop_failed(self, err: ServerError, servers: Sequence[Server]) -> bool:
        """Rank 0, a round that failed before its data left (a server answered ``/health``, then could not be paused
        or asked for its world size: it died, froze or was cut off in between): with ``min_servers``, set aside the
        servers that failed (those a ``PartlyFailed`` pause did not resume; else those that do not answer ``/health``
        now) and say the round may start again without them. ``False``: nobody to set aside (the failure is the
        round's own, or every server is required)."""
        if not self.heals:
            return False
        if not isinstance(err, PartlyFailed):
            return self.drop_silent(servers, why="failed as the round began")
        self.set_aside({s: err for s in servers if s not in err.resumed}, why="failed as the round began")
        return True

    def drop_silent(self, servers: Sequence[Server], *, why: str = "went silent during the round") -> bool:
        """Rank 0, with ``min_servers``: set aside those of ``servers`` that do not answer ``/health`` now; whether
        any were and the quorum still holds (the round may be redone at once without them)."""
        if not self.heals:
            return False
        silent: dict[Server, BaseException] = {}
        for server in servers:
            if server.url in self.silent:  # (found by the round's watch: not asked again)
                silent[server] = ServerError(self.silent[server.url], server.url)
                continue
            try:
                answers(server, confirm=True)
            except ServerError as err:
                silent[server] = err
        self.set_aside(silent, why=why)
        return bool(silent) and len(self.active) >= self.quorum()

    def check_quorum(self) -> None:
        """Raise a :class:`ServerError` when fewer than the quorum can take the next round."""
        active = self.active
        if len(active) >= max(self.quorum(), 1):
            return
        out = "; ".join(f"{u}: {w}" for u, w in self.out.items())
        raise ServerError(f"only {len(active)} of {len(self.listed)} server(s) can take this version, fewer than"
                          f" min_servers={self.quorum()} (set aside: {out}). They are asked again at the next sync.",
                          next(iter(self.out), self.listed[0]))


def answers(server: Server, *, confirm: bool) -> None:
    """Raise the :class:`ServerError` of ``server``'s ``/health`` unless it answers within :data:`HEALTH_TIMEOUT_S`;
    ``confirm``: a server that serves now is asked up to :data:`MISSES` times (a refused connection ends it at once)."""
    asks = MISSES if confirm else 1
    for ask in range(1, asks + 1):
        try:
            server.health(timeout=HEALTH_TIMEOUT_S)
            return
        except ServerError as err:
            if err.refused or ask == asks:
                raise
