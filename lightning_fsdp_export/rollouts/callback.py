"""``AsyncRollouts``: the Lightning callback (and, for a Fabric loop, the batch iterator) that keeps the servers
generating while the trainer trains; its batch fill, metrics and checkpointed prompt positions. The pacing, the client
threads and their shared state are its
parts (:mod:`.pacing`, :mod:`.clients`, :mod:`.state`)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, IterableDataset
from typing_extensions import override

from lightning_fsdp_export._common import SyncGroup
from lightning_fsdp_export.rollouts.clients import RolloutClients
from lightning_fsdp_export.rollouts.loop import FabricLoop
from lightning_fsdp_export.rollouts.pacing import Pacing
from lightning_fsdp_export.rollouts.samples import Prompt, RolloutBatch, RolloutError, Sample
from lightning_fsdp_export.rollouts.state import RolloutState
from lightning_fsdp_export.servers.http import Server, ServerError
from lightning_fsdp_export.sync.callback import VLLMWeightSync, trainer_callbacks
from lightning_fsdp_export.sync.holder import HoldsSyncEngine
from lightning_fsdp_export.targets.base import ServesRollouts

__all__ = ["AsyncRollouts"]


class AsyncRollouts(Callback, FabricLoop):
    """Keep the servers of ``sync.target`` (a ``RemoteVLLM``) generating while the trainer trains.

    With the Trainer it is a callback (list it after the sync) whose :meth:`dataloader` gives one batch per step,
    filled before ``training_step``. In a Fabric loop it is an iterator of filled batches::

        sync.push(fabric)  # the first rollouts come from the trainer's weights
        with rollouts.start(fabric):  # the client threads start; stopped and joined at the block's end
            for step, batch in zip(range(1, steps + 1), rollouts):  # each batch filled when the loop asks
                ...  # loss from batch, fabric.backward(loss), optimizer.step(), optimizer.zero_grad()
                sync.push(fabric, step=step)

    Args:
        sync: the sync pushing to the servers: the Trainer's ``VLLMWeightSync`` (list it in the Trainer's callbacks
            too; it must sync at train start, the default, so the first rollouts come from the trainer's weights), or
            a Fabric loop's ``WeightSync`` (pushed once before :meth:`start`).
        prompts: token ids or, with images, vLLM's dicts (:data:`Prompt`); a sequence (cycled) or a callable
            ``index -> prompt`` for an endless stream; rank ``r`` of ``W`` takes indices ``r, r + W, ...``.
        reward: ``Sample -> float``, called in the client threads when a group finishes.
        batch_size: groups per step on each rank (a step trains ``batch_size * group_size`` samples per rank).
        group_size: samples per prompt (vLLM's ``n``).
        max_staleness: the bound ``K`` (versions); ``0`` is on-policy.
        sampling: vLLM sampling parameters for each request (``max_tokens``, ``temperature``, ...);
            ``n`` and ``logprobs`` are set here.
        max_in_flight: requests in flight per rank at most (default: ``batch_size * (max_staleness + 1)``).
        versions_every: batches per version (the sync's ``every_n_train_steps`` times the gradient
            accumulation); default: read from the sync and the Trainer; in a Fabric loop 1 (a push after every
            batch).
        batch_timeout: seconds ``training_step`` may wait for its batch before :class:`RolloutError`
            names every server's paused state and version.
        request_timeout: seconds for one request (a group).
    """

    def __init__(self, sync: HoldsSyncEngine, prompts: Sequence[Prompt] | Callable[[int], Prompt],
                 reward: Callable[[Sample], float], *, batch_size: int, group_size: int = 1,
                 max_staleness: int = 1, sampling: dict[str, Any] | None = None, max_in_flight: int | None = None,
                 versions_every: int | None = None, batch_timeout: float = 300.0,
                 request_timeout: float = 300.0) -> None:
        if not isinstance(sync, HoldsSyncEngine) or not isinstance(sync.target, ServesRollouts):
            raise TypeError("AsyncRollouts(sync=...) needs the VLLMWeightSync(RemoteVLLM(...)) (or Fabric's"
                            " WeightSync(RemoteVLLM(...))) that updates the servers it generates on; got"
                            f" {type(sync).__name__}"
                            f"{'' if not isinstance(sync, HoldsSyncEngine) else f'({type(sync.target).__name__})'}.")
        if isinstance(sync, VLLMWeightSync) and not sync.syncs_on_train_start:
            raise ValueError("AsyncRollouts needs VLLMWeightSync(sync_on_train_start=True): the first rollouts must"
                             " come from the trainer's weights.")
        for name, value, low in [("batch_size", batch_size, 1), ("group_size", group_size, 1),
                                 ("max_staleness", max_staleness, 0)]:
            if not isinstance(value, int) or value < low:
                raise ValueError(f"AsyncRollouts({name}={value!r}) must be an integer >= {low}.")
        if max_in_flight is not None and max_in_flight < 1:
            raise ValueError(f"AsyncRollouts(max_in_flight={max_in_flight!r}) must be >= 1.")
        if isinstance(prompts, Sequence) and not callable(prompts) and len(prompts) == 0:
            raise ValueError("AsyncRollouts(prompts=[]) needs at least one prompt.")
        sampling = dict(sampling or {})
        for key in ("n", "logprobs"):
            if key in sampling:
                raise ValueError(f"AsyncRollouts(sampling={{'{key}': ...}}): set by AsyncRollouts"
                                 f" ({'group_size' if key == 'n' else 'always 0: the sampled token'}).")
        self.sync = sync
        self.batch_size = batch_size
        self.group_size = group_size
        self.max_staleness = max_staleness
        self.batch_timeout = batch_timeout
        self._rank, self._world = 0, 1
        self._ranks: SyncGroup | None = None  # built at train start
        self._restored: dict[str, Any] | None = None  # a checkpoint's state, applied at the next train start
        self._fabric: Any = None  # a Fabric loop's, between start() and close()
        self.state = RolloutState()
        """What the client threads and the batch fill share (under ``state.lock``)."""
        self.pacing = Pacing(batch_size=batch_size, max_staleness=max_staleness,
                             max_in_flight=max_in_flight or batch_size * (max_staleness + 1),
                             versions_every=versions_every)
        """When a group may be admitted (the staleness bound's prediction)."""
        self.clients = RolloutClients(
            self.state, self.pacing, sync=sync, prompts=prompts, reward=reward, request_timeout=request_timeout,
            sampling={"max_tokens": 16, "temperature": 1.0, **sampling, "n": group_size, "logprobs": 0})
        """The client threads."""
        self.metrics: dict[str, float] = {}
        self.history: list[dict[str, Any]] = []
        """Per consumed batch on this rank: version, staleness per sample, waited seconds, dropped so far."""

    @property
    def servers(self) -> list[Server]:
        """The servers generating (``sync.target``'s)."""
        return self.clients.servers

    @property
    def max_in_flight(self) -> int:
        """Requests in flight per rank at most."""
        return self.pacing.max_in_flight

    @property
    def request_timeout(self) -> float:
        """Seconds for one request (a group)."""
        return self.clients.request_timeout

    @property
    def dropped(self) -> int:
        """Groups dropped on this rank (stale when their batch was filled, or failed too often)."""
        return self.state.dropped

    @property
    def produced_samples(self) -> int:
        """Samples finished on this rank."""
        return self.state.produced_samples

    @property
    def multi_version_samples(self) -> int:
        """Samples whose tokens came from two or more versions (updated in flight)."""
        return self.state.multi_version_samples

    @property
    def resampled(self) -> int:
        """Groups sent again on this rank (``pause_mode="keep_old_kv"``): the servers swapped versions between a group's
        admission and its prefill, so its prompt may have read the older weights' cached blocks (one attempt each)."""
        return self.state.resampled

    @property
    def errors(self) -> list[str]:
        """This rank's request errors, oldest first (``"url: error"``)."""
        return self.state.errors

    # -- the Trainer's side ----------------------------------------------------------------------------

    def dataloader(self, steps: int | None = None) -> DataLoader:
        """One empty :class:`RolloutBatch` per step (filled before ``training_step``); endless unless ``steps``."""
        class _Batches(IterableDataset):
            def __iter__(self) -> Iterator[RolloutBatch]:
                counter = itertools.count() if steps is None else range(steps)
                return (RolloutBatch() for _ in counter)

        return DataLoader(_Batches(), batch_size=None)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and self.sync not in trainer_callbacks(trainer):
            raise ValueError("AsyncRollouts(sync=...): that VLLMWeightSync is not among the Trainer's callbacks;"
                             " pass both: Trainer(callbacks=[sync, rollouts]).")

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.pacing.versions_every is None:
            assert isinstance(self.sync, VLLMWeightSync)  # setup() found it among the Trainer's callbacks
            every = self.sync.every_n_train_steps
            if every is None:
                raise ValueError("AsyncRollouts with VLLMWeightSync(every_n_epochs=...): pass versions_every= (steps"
                                 " per sync), the pacing needs it.")
            self.pacing.versions_every = every * trainer.accumulate_grad_batches
        self._begin(trainer.global_rank, trainer.world_size)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if isinstance(batch, RolloutBatch) and not batch.groups:
            self._fill_everywhere(batch)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not isinstance(batch, RolloutBatch):
            return
        self.metrics = self._metrics_of(batch)
        pl_module.log_dict(self.metrics, on_step=True, rank_zero_only=True, batch_size=len(batch.samples))

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.stop()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self.stop()

    @override
    def state_dict(self) -> dict[str, Any]:
        """Every rank's prompt position: the first prompt it admitted and has not consumed, and the prompts after
        it already consumed (skipped after a resume; the ones in flight at the checkpoint are sent again).
        Gathered from every rank (all ranks save together)."""
        state = self.state
        with state.lock:
            first = min(state.pending(), default=self._rank + self._world * state.next)
            state.done = {i for i in state.done if i > first}
            mine = ((first - self._rank) // self._world, sorted(state.done))
        everyone = self._ranks.gather(mine) if self._ranks is not None else [mine]
        return {"positions": [p for p, _ in everyone], "consumed_after": [c for _, c in everyone],
                "dropped": self.dropped}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = state_dict
        self.state.dropped = state_dict["dropped"]

    def stop(self) -> None:
        """Stop admitting, abort what is in flight on every server, join every client thread."""
        self.clients.stop()

    # -- the batch ---------------------------------------------------------------------------------------

    def _begin(self, rank: int, world: int) -> None:
        """Every rank, at the start of a run (a fit, or a Fabric loop's ``start()``): the checkpoint's prompt
        positions applied, the pacing anchored at the sync's version, the client threads started."""
        if not isinstance(self.sync, VLLMWeightSync) and self.sync.stale:
            raise ValueError(f"AsyncRollouts.start(): {type(self.sync).__name__} has not pushed the trainer's weights"
                             " since it was set up (or resumed): call sync.push(fabric) once before starting the"
                             " rollouts, so the first ones come from the trainer's weights.")
        self._rank, self._world = rank, world
        if self._restored is not None:
            saved = len(self._restored["positions"])
            if saved != self._world:
                raise ValueError(f"AsyncRollouts: the checkpoint holds the prompt positions of {saved} rank(s),"
                                 f" this run has {self._world}; resume on as many ranks, or build a new one.")
            self.state.next = self._restored["positions"][self._rank]
            self.state.done = set(self._restored["consumed_after"][self._rank])
            self.state.retry.clear()
            self._restored = None
        self.state.consumed = 0
        self.pacing.anchor = (0, self.sync.version, 0)
        # every rank's batch fills, or all raise together: a rank that raised alone would leave the others in
        # the step's collectives (built on every rank, a collective)
        self._ranks = SyncGroup(timedelta(seconds=self.batch_timeout + 60))
        self.clients.start(self.max_in_flight, rank=self._rank, world=self._world)

    def _fill_everywhere(self, batch: RolloutBatch) -> None:
        """Every rank: fill ``batch``; a rank whose fill failed makes every rank raise, naming it."""
        error = None
        try:
            self._fill(batch)
        except RolloutError as err:
            error = f"rank {self._rank}: {err}"
        assert self._ranks is not None, "built when the run started"
        errors = [e for e in self._ranks.gather(error) if e is not None]
        if errors:
            raise RolloutError(" | ".join(errors))

    def _metrics_of(self, batch: RolloutBatch) -> dict[str, float]:
        """The ``rollouts/*`` metrics of the batch just filled."""
        filled = self.history[-1]  # written by the fill of this batch
        staleness = filled["staleness"]
        with self.state.lock:
            in_flight = len(self.state.in_flight)
        metrics = {"rollouts/staleness_min": float(min(staleness)), "rollouts/staleness_max": float(max(staleness)),
                   "rollouts/staleness_mean": sum(staleness) / len(staleness),
                   "rollouts/dropped": float(self.dropped), "rollouts/in_flight": float(in_flight),
                   "rollouts/wait_seconds": batch.waited, "rollouts/versions_in_batch": float(len(filled["versions"]))}
        if self.clients.keeps_old_kv:
            metrics["rollouts/resampled"] = float(self.resampled)
        paused = self.clients.target.last_paused_seconds
        if paused is not None:
            metrics["rollouts/server_paused_seconds"] = paused
        return metrics

    def _fill(self, batch: RolloutBatch) -> None:
        start = time.monotonic()
        deadline = start + self.batch_timeout
        version = self.sync.version
        state = self.state
        with state.lock:
            _, anchor_version, at_version = self.pacing.anchor
            at_version = at_version if anchor_version == version else 0
            while len(batch.groups) < self.batch_size:
                while state.ready and len(batch.groups) < self.batch_size:
                    group = state.ready.popleft()
                    if version - group.min_version > self.max_staleness:
                        state.dropped += 1  # its place goes to a new group, admitted for this step
                        continue
                    batch.groups.append(group)
                    state.done.add(group.prompt_index)
                    state.consumed += 1  # counted at once: the pacing never sees a taken group as a free place
                    self.pacing.anchor = (state.consumed, version, at_version + len(batch.groups))
                if len(batch.groups) == self.batch_size:
                    break
                if state.errors and not state.in_flight and self.clients.all_down():
                    raise RolloutError("AsyncRollouts: every server failed: " + "; ".join(state.errors[-3:]))
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RolloutError(self._timeout_message(version, len(batch.groups)))
                state.lock.notify_all()  # places freed by drops: admission goes on
                state.lock.wait(timeout=min(left, 1.0))
            state.lock.notify_all()  # the pacing moved: admission may go on
        batch.version = version
        batch.waited = time.monotonic() - start
        self.history.append({"version": version, "staleness": batch.staleness(), "waited": batch.waited,
                             "dropped": self.dropped, "versions": sorted({v for s in batch.samples
                                                                          for v in s.versions})})

    def _timeout_message(self, version: int, have: int) -> str:
        states = []
        for server in self.servers:
            try:
                paused = server.is_paused(timeout=10.0)
                served = server.weight_info(timeout=10.0)
                states.append(f"{server.url}: paused={paused.get('is_paused')}, version={served.get('weight_version')}")
            except ServerError as err:
                states.append(f"{server.url}: unreachable ({err})")
        return (f"AsyncRollouts: {have} of {self.batch_size} groups for the step at version {version} after"
                f" {self.batch_timeout}s ({len(self.state.in_flight)} request(s) in flight)."
                f" Servers: {'; '.join(states)}. A server left paused by a failed sync stays so until the next full"
                " push (VLLMWeightSync's error said why); raise batch_timeout if generation is just slow."
                + (f" Last request errors: {'; '.join(self.state.errors[-3:])}" if self.state.errors else ""))
