"""The client threads of :class:`~.callback.AsyncRollouts`: each admits a prompt when the pacing allows, sends it to
the least loaded server, and turns the answer into a :class:`~.samples.SampleGroup` with a version per token."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from lightning_fsdp_export.rollouts.pacing import Pacing
from lightning_fsdp_export.rollouts.samples import (
    GENERATE_ROUTE,
    UNKNOWN_VERSION,
    Prompt,
    RolloutError,
    Sample,
    SampleGroup,
    image_parts,
    split_prompt,
)
from lightning_fsdp_export.rollouts.state import RolloutState
from lightning_fsdp_export.servers.http import Server, ServerError, interrupt
from lightning_fsdp_export.sync.holder import HoldsSyncEngine
from lightning_fsdp_export.targets.base import ServesRollouts

__all__ = ["RolloutClients"]


class RolloutClients:
    """A rank's client threads over the servers of ``sync.target``.

    Args:
        state: what they share with the batch fill.
        pacing: when a prompt may be admitted.
        sync: the sync updating the servers (its ``served_version`` paces admission; ``lora`` names the model), whose
            target's servers take the requests (a ``ServesRollouts``: ``RemoteVLLM``).
        prompts: token-id prompts, or ``index -> prompt``.
        reward: ``Sample -> float``.
        sampling: vLLM sampling parameters of every request.
        request_timeout: seconds for one request.
    """

    DOWN_SECONDS = 5.0
    """A server whose request failed gets no new request for this long (unless every server failed)."""
    MAX_ATTEMPTS = 3
    """A prompt whose request failed this often (on any servers) is dropped and counted."""

    def __init__(self, state: RolloutState, pacing: Pacing, *, sync: HoldsSyncEngine,
                 prompts: Sequence[Prompt] | Callable[[int], Prompt], reward: Callable[[Sample], float],
                 sampling: dict[str, Any], request_timeout: float) -> None:
        self.state = state
        self.pacing = pacing
        self.sync = sync
        assert isinstance(sync.target, ServesRollouts)  # AsyncRollouts checks it, naming the target
        self.target: ServesRollouts = sync.target
        """``sync.target``: the servers requests go to."""
        self.prompts = prompts
        self.reward = reward
        self.sampling = sampling
        self.request_timeout = request_timeout
        self.keeps_old_kv = self.target.pause_mode == "keep_old_kv"
        """The servers keep older weights' blocks across a swap: the prefix cache is salted per version."""
        self.rank, self.world = 0, 1
        self._threads: list[threading.Thread] = []
        self._serving: set[str] = set()  # the servers' URLs at the last pick

    @property
    def servers(self) -> list[Server]:
        """The servers new requests go to: those the target says serve (``RemoteVLLM.serving``: with ``min_servers``,
        none set aside, none still joining)."""
        return list(self.target.serving)

    def start(self, count: int, *, rank: int, world: int) -> None:
        """Start ``count`` threads for trainer rank ``rank`` of ``world`` (it takes prompts ``rank, rank + world,
        ...``)."""
        self.rank, self.world = rank, world
        self.state.stopping.clear()
        for i in range(count):
            thread = threading.Thread(target=self._run, name=f"AsyncRollouts-{rank}-{i}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        """Stop admitting, abort what is in flight on every server, join every thread; what was admitted and not
        consumed is sent again by the next fit (or after a resume)."""
        state = self.state
        state.stopping.set()
        with state.lock:
            state.lock.notify_all()
            by_server: dict[str, tuple[Server, list[str]]] = {}
            for rid, (server, _) in state.in_flight.items():
                by_server.setdefault(server.url, (server, []))[1].append(rid)
        for server, ids in by_server.values():
            try:
                server.abort(ids, timeout=10.0)
            except ServerError:
                pass  # a dead server has nothing running
        # a paused server (a failed sync) answers nothing, aborted requests included: stop waiting for them
        for conn in list(state.connections.values()):
            interrupt(conn)
        for thread in self._threads:
            thread.join(timeout=self.request_timeout)
        alive = [t.name for t in self._threads if t.is_alive()]
        self._threads = []
        with state.lock:
            unconsumed = [i for _, i in state.in_flight.values()] + [g.prompt_index for g in state.ready]
            state.retry.extend(sorted(unconsumed))
            state.ready.clear()
            state.in_flight.clear()
            state.connections.clear()
        if alive:
            raise RolloutError(f"AsyncRollouts: client threads {alive} did not stop within {self.request_timeout}s.")

    def all_down(self) -> bool:
        """Every server failed a request within ``DOWN_SECONDS``."""
        now = time.monotonic()
        return all(self._is_down(s, now) for s in self.servers)

    def _is_down(self, server: Server, now: float) -> bool:
        return now - self.state.down.get(server.url, -math.inf) < self.DOWN_SECONDS

    # -- one thread ------------------------------------------------------------------------------------------

    def _run(self) -> None:
        state = self.state
        while not state.stopping.is_set():
            with state.lock:
                while not state.stopping.is_set() and not self.pacing.may_admit(state, self.sync.served_version):
                    state.lock.wait(timeout=0.5)
                if state.stopping.is_set():
                    return
                if state.retry:
                    index = state.retry.popleft()
                else:
                    index = self.rank + self.world * state.next
                    state.next += 1
                    if index in state.done:  # consumed before the checkpoint this run resumed from
                        continue
                admitted_version = self.sync.served_version  # (a push may have started since may_admit: None)
                # settled: no push under way, so the servers prefill this request with the version served now
                settled = admitted_version is not None and admitted_version == self.sync.version
                server = self._pick()
                rid = f"lfe-{self.rank}-{index}-{time.monotonic_ns()}"
                state.in_flight[rid] = (server, index)
            group = self._generate(rid, index, server, admitted_version, settled=settled)
            with state.lock:
                state.in_flight.pop(rid, None)
                if group is not None and not state.stopping.is_set():
                    state.ready.append(group)
                elif group is None and not state.stopping.is_set():
                    state.attempts[index] = state.attempts.get(index, 0) + 1
                    if state.attempts[index] < self.MAX_ATTEMPTS:
                        state.retry.append(index)
                    else:
                        state.dropped += 1
                        state.attempts.pop(index)
                state.lock.notify_all()

    def _pick(self) -> Server:
        """The server with the fewest requests in flight (ties: the one sent least), among those not down."""
        now = time.monotonic()
        servers = self.servers
        for url in {s.url for s in servers} - self._serving:  # back in the pool with every tensor: not down any more
            self.state.down.pop(url, None)
        self._serving = {s.url for s in servers}
        load = {s.url: 0 for s in servers}
        for server, _ in self.state.in_flight.values():
            if server.url in load:  # (one set aside since: not a candidate)
                load[server.url] += 1
        up = [s for s in servers if not self._is_down(s, now)] or servers
        server = min(up, key=lambda s: (load[s.url], self.state.sent.get(s.url, 0)))
        self.state.sent[server.url] = self.state.sent.get(server.url, 0) + 1
        return server

    def prompt(self, index: int) -> tuple[list[int], dict[str, Any] | None]:
        """The prompt at ``index`` (a sequence is cycled): its token ids and its images, if any."""
        found = self.prompts(index) if callable(self.prompts) else self.prompts[index % len(self.prompts)]
        return split_prompt(found, index)

    def _generate(self, rid: str, index: int, server: Server, admitted_version: Any, *,
                  settled: bool) -> SampleGroup | None:
        """One request; None when it failed, was aborted, or may have read another version's prefix blocks.

        A prefix cache per version (``cache_salt``) where ``pause_mode="keep_old_kv"`` keeps the blocks of older
        weights across a swap (the other modes reset the servers' prefix caches at each swap, while paused): a
        request admitted while a push is under way may be prefilled with either version, so it shares no blocks (a
        salt of its own); one admitted when settled is salted with the version served, and if the servers swapped
        before its prefill anyway (its first token names another version), its prompt may have been read from the
        older weights' blocks: it is sent again (``resampled``)."""
        prompt, media = self.prompt(index)
        salt = f"lfe-{rid}" if self.keeps_old_kv and not settled else f"lfe-v{admitted_version}"
        body = {"request_id": rid, "token_ids": prompt, "sampling_params": self.sampling, "cache_salt": salt}
        if media is not None:  # the images, resolved by the server (its processor expands each placeholder)
            body["content_parts"] = image_parts(media)
        if self.sync.lora == "adapter":  # the policy is the adapter the sync loads, not the base model
            body["model"] = self.target.adapter_name
        admitted = time.time()
        state = self.state
        try:
            answer = server.generate(body, timeout=self.request_timeout,
                                               opened=lambda conn: self._opened(rid, conn))
            samples = [self.sample(index, prompt, choice, server, media) for choice in answer["choices"]]
        except (ServerError, KeyError, TypeError, ValueError) as err:
            with state.lock:
                state.connections.pop(rid, None)
                if state.stopping.is_set():
                    return None  # interrupted by stop()
                state.down[server.url] = time.monotonic()
                hint = ""
                if isinstance(err, ServerError) and " 404" in str(err):
                    hint = (f" ({GENERATE_ROUTE} is registered by `--enable-scale-out`: start the server with it, it"
                            " returns the weight version of every token)")
                state.errors.append(f"{server.url}: {err}{hint}")
            return None
        with state.lock:
            state.connections.pop(rid, None)
        if any(s.finish_reason == "abort" for s in samples):
            return None
        if self.keeps_old_kv and settled and any(s.versions and s.versions[0] != admitted_version for s in samples):
            with state.lock:
                state.resampled += 1
            return None
        for s in samples:
            s.reward = float(self.reward(s))
        with state.lock:
            state.produced_samples += len(samples)
            state.multi_version_samples += sum(s.min_version != s.max_version for s in samples)
        return SampleGroup(index, samples, admitted_version, admitted, time.time())

    def _opened(self, rid: str, conn: Any) -> None:
        with self.state.lock:
            self.state.connections[rid] = conn
            stopping = self.state.stopping.is_set()
        if stopping:  # stop() ran between this request's admission and its connection
            interrupt(conn)

    @staticmethod
    def sample(index: int, prompt: list[int], choice: dict[str, Any], server: Server,
               media: dict[str, Any] | None = None) -> Sample:
        """One of the server's choices as a :class:`Sample`: its tokens, vLLM's logprobs and a version per token
        from the ``weight_versions`` spans (a label that is no version of the sync's: ``UNKNOWN_VERSION``)."""
        tokens = list(choice.get("token_ids") or [])
        spans = choice.get("weight_versions")
        if spans is None:
            raise ValueError(f"{server.url} returned no weight_versions: the server is older than vLLM 0.32")
        versions = [UNKNOWN_VERSION] * len(tokens)
        for span in spans:
            label = str(span["version"])
            value = int(label) if label.isdigit() else UNKNOWN_VERSION
            versions[span["start"]:span["end"]] = [value] * (span["end"] - span["start"])
        content = (choice.get("logprobs") or {}).get("content") or []
        logprobs = [float(c["logprob"]) for c in content]
        if len(logprobs) != len(tokens):
            raise ValueError(f"{server.url} returned {len(logprobs)} logprobs for {len(tokens)} tokens")
        return Sample(index, prompt, tokens, logprobs, versions, str(choice.get("finish_reason")), server.url,
                      multi_modal_data=media)
