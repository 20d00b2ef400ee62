"""The servers' pause around a round, and what a failed round leaves behind: the rule that no server holding one whole
version stays paused, and that a server which may hold half-loaded weights never serves.

Rank 0 pauses every server of the round (the pool's, handed to each call) before a round's data travels (or, for a
staged round, before the swap), tells each server what follows the data (:meth:`Pauses.on_each_server`: swap,
adapter, prefix-cache reset, label) and resumes them. Where a step fails on some servers only, the others are resumed
at once (:class:`PartlyFailed` names both); a round that failed mid-transfer is closed on the servers that may hold
half-loaded weights (:func:`close_rounds`), which stay paused until the next full push.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence

from lightning_fsdp_export.backend.shared import PauseMode
from lightning_fsdp_export.servers.http import HealthProbe, Server, ServerError, on_all, on_each

__all__ = ["PartlyFailed", "Pauses", "close_rounds", "load_adapter", "reset_prefix_caches", "set_versions"]


class PartlyFailed(ServerError):
    """A round that failed on some servers only: the others, each holding one whole version with its label, were
    resumed (``resumed``); ``url`` names the first that failed."""

    def __init__(self, message: str, url: str, *, resumed: list[Server]) -> None:
        super().__init__(message, url)
        self.resumed = resumed


class Pauses:
    """The servers' pause, which every transfer holds (a network group's and a directory's rounds alike): held across a
    base round into its adapter round, its timing, and what a failed round leaves behind. It keeps no list of servers:
    each call is handed the round's (its transfer's pool is their one owner).

    Args:
        mode: how they pause (``RemoteVLLM(pause_mode=...)``).
    """

    def __init__(self, mode: PauseMode) -> None:
        self.mode = mode
        self.rank = 0
        """This trainer rank (its transfer's ``setup`` sets it): only rank 0 talks to the servers."""
        self.last_pause: tuple[float, float] | None = None
        """Rank 0: wall-clock times (``time.time()``) of the last completed sync's ``/pause`` and ``/resume``."""
        self._held_since: float | None = None
        self._renewing: threading.Event | None = None

    @property
    def held_since(self) -> float | None:
        """Rank 0: a base round left the servers paused for its adapter round, since then. Meanwhile a thread renews
        their pause's lease (``/health?watch`` each second: the round's watch is not running)."""
        return self._held_since

    def hold(self, servers: Sequence[Server], since: float) -> None:
        """Rank 0: a base round leaves ``servers`` paused for its adapter round (:attr:`held_since`); a thread renews
        their pause's lease until the hold ends."""
        self._held_since = since
        if self._renewing is None:
            self._renewing = threading.Event()
            threading.Thread(target=_renew, args=(list(servers), self._renewing), daemon=True,
                             name="lfe-held-pause").start()

    def release(self) -> None:
        """Rank 0: no round holds the servers paused any more (resumed, or failed): the lease's renewal stops."""
        self._held_since = None
        if self._renewing is not None:
            self._renewing.set()
            self._renewing = None

    def pause(self, servers: Sequence[Server]) -> float:
        """Rank 0: pause every one of ``servers`` unless a base round holds them paused; when the pause began. Servers
        that cannot be paused fail the round before anything is sent: the others are resumed at once (they serve the
        version they served, its label true) and the error names the ones that failed."""
        if self.held_since is not None:
            return self.held_since
        failed = on_each(servers, lambda s: s.pause(self.mode))
        if failed:
            self._resume_all_but(servers, failed, failed_to="be paused", serving="the version they served")
        return time.time()

    def on_each_server(self, servers: Sequence[Server], step: Callable[[Server], None], *, version: int,
                       resume: bool) -> None:
        """Rank 0, the servers paused after the round's data reached them: ``step`` on every server (what it is told
        then: swap, load an adapter, reset its prefix cache, set its label), and with ``resume`` each server is resumed
        as soon as its own ``step`` is done (its pause never waits on another server's; without ``resume`` an adapter
        round follows, so they stay paused). Where some fail, the others hold ``version`` whole, labelled, and are
        resumed; the failed ones stay paused, named in the error (:class:`PartlyFailed`)."""

        done: set[Server] = set()  # resumed already

        def take(server: Server) -> None:
            step(server)
            if resume:
                server.resume()
                done.add(server)

        failed = on_each(servers, take)
        if not failed:
            return
        if not resume:
            raise next(iter(failed.values()))
        self._resume_all_but(servers, failed, failed_to=f"take version {version} and stay paused",
                             serving=f"version {version}", done=done)

    def swap_each(self, servers: Sequence[Server], swap: Callable[[Server], float], *, version: int) -> None:
        """Rank 0, a staged round's data at every server, nothing paused: each server swaps it in on its own
        (``swap(server)``: its paused seconds), concurrently. Where some fail, the others serve ``version``; each
        failure says what its server serves (:class:`PartlyFailed` names them all)."""
        paused: dict[Server, float] = {}

        def one(server: Server) -> None:
            paused[server] = swap(server)

        failed = on_each(servers, one)
        end = time.time()
        if paused:
            self.last_pause = (end - max(paused.values()), end)
        if not failed:
            return
        resumed = [s for s in servers if s not in failed]
        raise _partly_failed(servers, failed, f"failed to swap in version {version}", resumed,
                             others=f"{len(resumed)} other(s) serve it")

    def _resume_all_but(self, servers: Sequence[Server], failed: dict[Server, BaseException], *, failed_to: str,
                        serving: str, done: set[Server] | frozenset[Server] = frozenset()) -> None:
        """Rank 0, a round of ``servers`` that failed on ``failed`` only: resume every other one (each holds one whole
        version, ``serving``; those in ``done`` are resumed already), then raise a :class:`PartlyFailed` naming them
        all."""
        whole = [s for s in servers if s not in failed]
        stuck = on_each([s for s in whole if s not in done], lambda s: s.resume())
        resumed = [s for s in whole if s not in stuck]
        self.release()
        others = (f"{len(resumed)} other(s) resumed, serving {serving}" + (f", {len(stuck)} not" if stuck else "")
                  if whole else "no other server")
        raise _partly_failed(servers, failed, f"failed to {failed_to}", resumed, others=others, also=stuck)

    def finish(self, servers: Sequence[Server], paused_at: float, resume: bool, *, resumed: bool = False) -> None:
        """Rank 0 after a round that succeeded: resume the servers (``resumed``: each was as it took the round) and
        time the pause, or hold them paused. A server that fails to resume (it died, froze or was cut off after taking
        the version) stays as it is; the others serve the version and the error names it (:class:`PartlyFailed`)."""
        if self.rank != 0:
            return
        if not resume:
            self.hold(servers, paused_at)
            return
        failed = {} if resumed else on_each(servers, lambda s: s.resume())
        self.release()
        self.last_pause = (paused_at, time.time())
        if failed:
            others = [s for s in servers if s not in failed]
            raise _partly_failed(servers, failed, "took the version but failed to be resumed", others,
                                 others=f"{len(others)} other(s) serve it", then="")

    def resume_after(self, servers: Sequence[Server], err: BaseException) -> None:
        """Rank 0, a round that failed after the pause but before any data was sent (building the group): resume every
        one of ``servers`` that answers, then raise ``err`` saying so."""
        stuck = on_each(servers, lambda s: s.resume())
        lines = f" ({'; '.join(f'{s.url}: {e}' for s, e in stuck.items())})" if stuck else ""
        raise ServerError(f"{type(err).__name__}: {err}; nothing was sent: {len(servers) - len(stuck)} of"
                          f" {len(servers)} server(s) resumed, serving the version they served{lines}.",
                          next(iter(stuck)).url if stuck else servers[0].url) from err

    def load_adapter_from(self, servers: Sequence[Server], path: str, *, name: str, version: int) -> None:
        """Rank 0: every one of ``servers`` reads the adapter at ``path`` (on its host) and serves it as ``name``: pause
        (unless held), load, reset the prefix caches, set the version, resume. A server that fails stays paused until
        the next full push; the others serve ``version`` (its adapter and base), resumed."""
        paused_at = self.pause(servers)

        def load(server: Server) -> None:
            load_adapter([server], name, path)
            reset_prefix_caches([server], self.mode)
            set_versions([server], version)

        try:
            self.on_each_server(servers, load, version=version, resume=True)
        finally:
            self.release()
        self.finish(servers, paused_at, resume=True, resumed=True)


def _partly_failed(servers: Sequence[Server], failed: dict[Server, BaseException], what: str, resumed: list[Server], *,
                   others: str, also: dict[Server, BaseException] | None = None,
                   then: str = " The next sync pushes every tensor whole.") -> PartlyFailed:
    """The :class:`PartlyFailed` of a step of ``servers`` that ``failed`` on some (``also``: more failures it names),
    ``resumed`` the others, caused by the first failure."""
    lines = "; ".join(f"{s.url}: {err}" for s, err in {**failed, **(also or {})}.items())
    first = next(iter(failed))
    error = PartlyFailed(f"{len(failed)} of {len(servers)} server(s) {what}; {others} ({lines}).{then}",
                         first.url, resumed=resumed)
    error.__cause__ = failed[first]
    return error


def _renew(servers: list[Server], done: threading.Event) -> None:
    """Ask ``servers`` for ``/health?watch`` each second until ``done`` (a held pause's lease renewed)."""
    probes = [HealthProbe(server, timeout=1.0) for server in servers]
    while not done.wait(1.0):
        for probe in probes:
            try:
                probe()
            except ServerError:
                pass  # (the next round finds it)
    for probe in probes:
        probe.close()


def close_rounds(servers: Sequence[Server], *, timeout: float, empty_round: bool) -> None:
    """After a failed round: end it on each of ``servers`` that answers, so the next one can start. They stay paused
    (the model may be half-loaded) until the next full push resumes them. ``empty_round``: a server that has no round
    open any more gets an empty one (vLLM's engines leave the layerwise reload open after a failed update)."""
    for server in servers:
        try:
            server.finish_update(timeout=min(timeout, 30.0))
            continue
        except ServerError as err:
            if "without a matching" not in str(err) or not empty_round:
                continue  # down, or the worker already closed its round when it failed
        try:
            server.start_update(timeout=min(timeout, 30.0))
            server.finish_update(timeout=min(timeout, 30.0))
        except ServerError:
            pass


def set_versions(servers: Sequence[Server], version: int) -> None:
    """Every server reports ``version`` from now on (its requests' ``weight_versions``)."""
    on_all(servers, lambda s: s.set_version(version))


def reset_prefix_caches(servers: Sequence[Server], mode: PauseMode) -> None:
    """After an update: drop every server's prefix cache (with ``keep``, the kept requests' blocks too, so they
    are recomputed with the new weights; a server answering ``{"success": false}`` fails the round), then its
    encoder cache (vision embeddings, kept across requests by vLLM: a ``keep`` pause does not clear it).

    ``keep_old_kv`` resets nothing: the frozen requests hold blocks (vLLM would answer ``{"success": false}``)
    and keep their old KV by choice; the prefix cache must then be isolated per version by the clients
    (``cache_salt``: ``AsyncRollouts`` salts every request with the version it starts at, and
    ``RemoteVLLM.prompt_logprobs`` salts every probe afresh)."""
    if mode == "keep_old_kv":
        return
    answers = on_all(servers, lambda s: (s, s.reset_prefix_cache(running=mode == "keep")))
    refused = [s.url for s, answer in answers if not (isinstance(answer, dict) and answer.get("success"))]
    if refused:
        raise ServerError(f"vLLM server(s) {refused} refused to reset the prefix cache after the update"
                          " ({'success': false}: blocks still held); their cached prompts would use the old"
                          " weights.", refused[0])
    on_all(servers, lambda s: s.reset_encoder_cache())  # no image embedding of the old weights


def load_adapter(servers: Sequence[Server], name: str, path: str) -> None:
    """Every server loads the peft directory ``path`` (on its host) as ``name``, replacing the adapter of that name in
    place; a server that cannot is named with vLLM's reason (its previous adapter stays loaded)."""
    body = {"lora_name": name, "lora_path": os.fspath(path), "load_inplace": True}
    on_all(servers, lambda s: s.load_adapter(body))
