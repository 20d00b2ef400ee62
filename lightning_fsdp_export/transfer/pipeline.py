"""One round of one push, as one pipeline read top to bottom (:meth:`RoundRun.run`), each step handed what the one
before returned:

1. **plan** (:meth:`RoundRun.plan`, returning a frozen :class:`RoundPlan`: the version, the servers, the new group's
   plan, sparse or dense, when the pause began): rank 0 refreshes the pool (the one owner of the round's servers),
   rebuilds the transfer group where it broke or the plan changed, and pauses the servers (a staged round: not yet);
   where every trainer rank is in the group, they learn rank 0's decision (the plan, or that it failed) over the
   control group before anything is sent;
2. **join** (:meth:`RoundRun.join`): every rank of the group joins the new group, if any (a failure here sent
   nothing: :meth:`RoundRun.unpause` resumes what the round paused);
3. **send** (:meth:`RoundRun.send`, returning :class:`Sent`): every rank of the group sends its part of ``source``
   (the round's own ``run``: dense, patches, an adapter, a drafter, staged);
4. **the servers take it** (:meth:`RoundRun.servers_take_it`, returning :class:`Taken`): rank 0 has each server swap
   the staged data in on its own, or tells each what follows the data (label, prefix-cache reset, adapter); the
   servers that took it serve it, the others are set aside where the pool may (``min_servers``);
5. **agree** (:meth:`RoundRun.agree`): a round in a background thread ends on every rank knowing whether the version
   serves;
6. **finish** (:meth:`RoundRun.finish`): the transfer keeps what the round made (a sparse round's copy) and the servers
   are resumed; or **fail** (:meth:`RoundRun.fail`): a server that may hold half-loaded weights has its round closed
   and stays paused, one holding a whole version is resumed, the silent ones are named, and the next round rebuilds
   the group.

What a round leaves its transfer (the workers' copy, the sparse report, whether the group stands) is one
:class:`RoundEnd`, applied by the transfer in one place (``round_ended``).
The transfer group itself (its rendezvous, engines and teardown) is :class:`~.frame.NativeTransfer`'s; what each kind
of round sends and tells the servers is :mod:`.rounds`'; the servers' pause and what a failure leaves is
:mod:`~lightning_fsdp_export.servers.pauses`'.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

from lightning_fsdp_export._compat import source_metadata
from lightning_fsdp_export.export.source import SourceLayout
from lightning_fsdp_export.servers.http import Server, ServerError, next_round, not_answering
from lightning_fsdp_export.servers.pauses import PartlyFailed, close_rounds
from lightning_fsdp_export.servers.pool import ServerPool
from lightning_fsdp_export.servers.watch import HealthWatch
from lightning_fsdp_export.transfer.rounds import Round, RoundInputs, RoundResult, Staged, send_dense
from lightning_fsdp_export.transfer.transports import NetworkTransport

if TYPE_CHECKING:
    from lightning_fsdp_export._common import SyncGroup
    from lightning_fsdp_export.export.patches import PatchBase
    from lightning_fsdp_export.servers.clients import FanOutClient
    from lightning_fsdp_export.servers.pauses import Pauses
    from lightning_fsdp_export.transfer.background import BackgroundPushes

__all__ = ["NotTaken", "RoundEnd", "RoundHost", "RoundPlan", "RoundRun", "Sent", "Taken", "plan_digest",
           "weight_source"]


class RoundHost(Protocol):
    """What a round reads of the transfer it runs through, between rounds (:class:`~.frame.NativeTransfer` is one: a
    protocol, as the frame imports this module). Every member is read-only here: a round changes the transfer only
    through its methods, :meth:`connect` (a new group) and :meth:`round_ended` (what the round leaves: its copy, its
    report, the group's state), and through the objects it holds (the client's ``version``, the engine's ``source``,
    the pause, the pool's record of the servers it sets aside)."""

    @property
    def every_rank(self) -> bool: ...

    @property
    def timeout(self) -> float: ...

    @property
    def options(self) -> NetworkTransport: ...

    @property
    def pool(self) -> ServerPool: ...

    @property
    def pauses(self) -> Pauses: ...

    @property
    def background(self) -> BackgroundPushes: ...

    @property
    def control(self) -> SyncGroup | None: ...

    @property
    def patches(self) -> PatchBase | None: ...

    @property
    def confirmed(self) -> int | None: ...

    @property
    def client(self) -> FanOutClient | None: ...

    @property
    def engine(self) -> Any: ...  # (the transport's trainer engine: vLLM's or ours, built by connect)

    @property
    def broken(self) -> bool: ...

    @property
    def plan_digest(self) -> str: ...

    @property
    def kept(self) -> str | None: ...

    @property
    def rank(self) -> int: ...

    @property
    def servers(self) -> list[Server]: ...

    def plan_group(self) -> dict[str, Any]: ...

    def connect(self, plan: dict[str, Any] | None, source: Any) -> None: ...

    def round_ended(self, end: RoundEnd) -> None: ...


@dataclass(frozen=True)
class RoundPlan:
    """What a round's plan step decided (rank 0 decides; every rank of the group learns it before anything is sent)."""

    version: int
    """The version the servers report after the round."""
    servers: tuple[Server, ...]
    """Rank 0: the servers the round updates (the pool's active ones once it started; a server set aside later in the
    round ends it there); ``()`` on the other ranks."""
    group: dict[str, Any] | None
    """A new group's plan this rank joins before the data (``None``: the group stands)."""
    sparse: bool
    """The round sends patches (every rank holds the confirmed version's copy)."""
    paused_at: float | None
    """Rank 0: when the servers' pause began (this round's, or the base round's it continues); ``None``: not paused for
    the data (a staged round, or another rank)."""
    own_pause: bool
    """This round paused the servers itself (not a base round holding them for this adapter round)."""


@dataclass(frozen=True)
class Sent:
    """What the send step did on this rank: what the round read (after a reconnect: this round's engine) and made."""

    inputs: RoundInputs
    result: RoundResult


@dataclass(frozen=True)
class Taken:
    """Rank 0: how the servers took the data."""

    settled: bool
    """Each server swapped the version in and serves it, or the pool set aside those that failed: nothing to resume."""
    resumed_each: bool
    """Each server was resumed as it took the round (what remains is the pause's timing)."""
    outcome: str | None = None
    """A background round: why the servers did not take it (every rank fails the round at :meth:`RoundRun.agree`)."""
    resumed: tuple[Server, ...] = ()
    """Then: the servers that hold a whole version, serving again."""


@dataclass(frozen=True)
class RoundEnd:
    """What a round leaves its transfer, applied there in one place (:meth:`RoundHost.round_ended`)."""

    succeeded: bool
    """On every rank of the group: the group stands and the copy is the version's; else the next round rebuilds the
    group and is dense."""
    kept: str | None = None
    """Sparse rounds that succeeded: the id of the copy the workers keep now."""
    patch: dict[str, Any] | None = None
    """A sparse round's report (``None``: none, the transfer keeps its last)."""
    started: bool = True
    """``False``: the round failed as rank 0 planned it (nothing paused, nothing sent): only the group is rebuilt."""


class NotTaken(RuntimeError):
    """A background round whose data reached the workers but which rank 0 could not have the servers take; on rank 0,
    ``resumed`` names those that hold a whole version, serving again."""

    def __init__(self, message: str, *, resumed: Sequence[Server] = ()) -> None:
        super().__init__(message)
        self.resumed = list(resumed)


class RoundRun:
    """One round of ``source`` as ``version`` through ``transfer``'s group, on this rank (every rank builds one per
    push and calls :meth:`run`). Each step returns what it decided or did, and the next is handed it.

    Args:
        transfer: the :class:`~.frame.NativeTransfer` whose group it runs through, and what that keeps between rounds
            (engine, pause, pool, copies: :class:`RoundHost`).
        round_: the kind of round (:mod:`.rounds`).
        source: this push's source (the sync's export, an adapter's tensors, or a background snapshot).
        version: the version the servers report after it.
        resume: resume the servers at the end (``False``: held paused for the adapter round that follows).
    """

    def __init__(self, transfer: RoundHost, round_: Round, source: Any, *, version: int, resume: bool) -> None:
        next_round()  # (this process's requests from now on are this round's: a server refuses an earlier one's)
        self.transfer = transfer
        self.round = round_
        self.source = weight_source(source, transfer.options)
        """The vLLM ``WeightSource`` over ``source`` that this round's engine iterates."""
        self.version = version
        self.resume = resume

    def run(self) -> None:
        """The round: plan -> join -> send -> the servers take it -> agree -> finish (or fail, and raise); each step is
        handed what the one before returned."""
        transfer = self.transfer
        if not transfer.every_rank and transfer.rank != 0 and not transfer.options.sends_patch_lists:
            self._engine_source()
            send_dense(self._inputs())  # iterates the source: this rank's part of the gathers
            return
        with self._watch():
            plan = self.plan()
            try:
                self.join(plan)
            except BaseException as err:
                self.unpause(plan, err)
                raise
            try:
                sent = self.send(plan)
                plan = self.pause_to_take(plan)
                taken = self.servers_take_it(plan, sent)
                self.agree(taken)
            except BaseException as err:
                self.fail(plan, err)
                raise
            self.finish(plan, sent, taken)  # (watched too: a server that freezes as it is resumed is found in seconds)

    # -- the steps ------------------------------------------------------------------------------------

    def plan(self) -> RoundPlan:
        """Rank 0 rebuilds the group if needed (broken on any rank, a new plan, other servers) and, unless the round
        stages its data first, pauses the servers (unless held); alone in the group it connects first, else the others
        learn the plan, or its failure, from its broadcast."""
        transfer = self.transfer
        own_pause = transfer.pauses.held_since is None  # else a base round paused them for this adapter round
        failure: BaseException | None = None
        if transfer.rank == 0:  # servers that left, joined, died or came back: a new group (one silent: failure)
            failure = _for_round(transfer.pool)
        rebuild = (transfer.broken or plan_digest(transfer.options, self.source) != transfer.plan_digest
                   or (transfer.rank == 0 and [s.url for s in transfer.servers] != transfer.pool.members))
        plan_key = self.round.plan_key(self._inputs())
        patches = transfer.patches
        can_patch = (plan_key is not None and patches is not None and patches.can_patch(transfer.confirmed, plan_key)
                     and (transfer.rank != 0 or transfer.kept is not None))
        sparse = False
        if transfer.control is not None:
            states = transfer.control.gather((rebuild, can_patch))
            rebuild = any(r for r, _ in states)
            sparse = not rebuild and all(c for _, c in states)
        pause = self.round.pauses_for_data
        decision: dict[str, Any] = {"error": None, "plan": None}
        paused_at: float | None = None
        if transfer.rank == 0:
            try:
                if failure is not None:
                    raise failure
                decision["plan"], decision["rebuilt"], paused_at = self._start(rebuild, pause)
            except Exception as err:  # noqa: BLE001 - every rank of the group learns of it just below
                decision, failure = {"error": f"{type(err).__name__}: {err}", "plan": None}, err
        if transfer.control is not None:
            decision = transfer.control.broadcast(decision)
        if decision.get("rebuilt"):  # (rank 0 built a group the ranks did not agree on: nobody holds its copies)
            sparse = False
        if decision["error"] is not None:  # nothing was paused by this round (pausing is the last step above)
            transfer.round_ended(RoundEnd(succeeded=False, started=False))
            if failure is not None:
                raise failure
            raise ServerError(f"trainer rank 0 could not start the round: {decision['error']}",
                              transfer.servers[0].url)
        servers = tuple(transfer.servers) if transfer.rank == 0 else ()
        return RoundPlan(version=self.version, servers=servers, group=decision["plan"], sparse=sparse,
                         paused_at=paused_at, own_pause=own_pause)

    def _start(self, rebuild: bool, pause: bool) -> tuple[dict[str, Any] | None, bool, float | None]:
        """Rank 0: build the group if needed (alone in it: rendezvous while the servers still serve) and pause the
        servers; the plan every rank joins (``None``: none new), whether a group was built, and when the pause began
        (``None``: not paused). With ``min_servers``, a server that fails here after answering ``/health`` is set aside
        and both steps are redone at once without it (a new group), while the quorum holds: nothing was sent yet."""
        transfer, pool = self.transfer, self.transfer.pool
        built = False
        while True:
            pool.check_quorum()
            try:
                plan = None
                if rebuild:
                    plan, built = transfer.plan_group(), True
                    if not transfer.every_rank:
                        transfer.connect(plan, self.source)
                paused_at = transfer.pauses.pause(transfer.servers) if pause else None
                return (plan if transfer.every_rank else None), built, paused_at
            except ServerError as err:
                if not pool.drop_failed(err, transfer.servers):  # (sets them aside: pool.active is the others)
                    raise
                rebuild = True

    def join(self, plan: RoundPlan) -> None:
        """Every rank of the group: join the new group rank 0 planned, if any (a failure here sent nothing)."""
        if plan.group is not None:
            self.transfer.connect(plan.group, self.source)

    def send(self, plan: RoundPlan) -> Sent:
        """Every rank of the group: this round's data, through this rank's engine over :attr:`source`."""
        transfer = self.transfer
        if transfer.rank == 0:
            assert transfer.client is not None
            transfer.client.version = self.round.client_version(self.version)
        self._engine_source()
        inputs = self._inputs()
        return Sent(inputs, self.round.run(inputs, version=self.version, sparse=plan.sparse))

    def pause_to_take(self, plan: RoundPlan) -> RoundPlan:
        """Rank 0, a staged round held for the adapter round that follows (its servers do not swap and resume each on
        their own): pause them now, after their data arrived; the plan with its pause."""
        if self.transfer.rank != 0 or plan.paused_at is not None or self._swaps_each:
            return plan
        return replace(plan, paused_at=self.transfer.pauses.pause(plan.servers))

    def servers_take_it(self, plan: RoundPlan, sent: Sent) -> Taken:
        """Rank 0: each server swaps the staged data in on its own (a staged round that resumes), or is told what
        follows the data; where some fail, the pool keeps the round if enough took it (the others set aside). A
        background round the servers did not take is a failure at :meth:`agree`, on every rank."""
        transfer, pauses, this, inputs = self.transfer, self.transfer.pauses, self.round, sent.inputs
        if transfer.rank != 0:
            return Taken(settled=False, resumed_each=False)
        try:
            mode = pauses.mode
            if isinstance(this, Staged) and self._swaps_each:  # each server swaps (and resumes) alone
                pauses.swap_each(plan.servers, lambda s: this.swap(s, inputs, version=self.version, mode=mode,
                                                                   own=s in transfer.pool.own_swaps),
                                 version=self.version)
                return Taken(settled=True, resumed_each=False)
            pauses.on_each_server(plan.servers, lambda s: this.on_server(s, inputs, version=self.version, mode=mode),
                                  version=self.version, resume=self.resume)
            return Taken(settled=False, resumed_each=self.resume)
        except Exception as err:
            resumed = err.resumed if isinstance(err, PartlyFailed) else []
            if transfer.pool.took(resumed, err, plan.servers):  # the servers that took it serve it, resumed
                return Taken(settled=True, resumed_each=False)
            if not transfer.background.enabled:
                raise
            return Taken(settled=False, resumed_each=False, outcome=f"{type(err).__name__}: {err}",
                         resumed=tuple(resumed))

    def agree(self, taken: Taken) -> None:
        """In a background thread, every rank: rank 0's outcome of the servers' part, or a failure naming it."""
        transfer = self.transfer
        if not transfer.background.enabled:
            return
        assert transfer.control is not None
        outcome = transfer.control.broadcast(taken.outcome)
        if outcome is not None:
            raise NotTaken(f"version {self.version} reached the servers' workers but trainer rank 0 could not swap it"
                           f" in: {outcome}", resumed=taken.resumed)

    def finish(self, plan: RoundPlan, sent: Sent, taken: Taken) -> None:
        """Every rank, the round succeeded everywhere: the transfer keeps what it made (a sparse round's copy); the
        servers are resumed (unless each was as it took the round or swapped, or the adapter round that follows does).
        A server that fails to resume after taking the version is set aside where the pool may (``min_servers``)."""
        transfer = self.transfer
        transfer.round_ended(RoundEnd(succeeded=True, kept=self.round.succeeded(sent.inputs), patch=sent.result.patch))
        if taken.settled or plan.paused_at is None:  # (every rank but 0: not paused)
            return
        try:
            transfer.pauses.finish(plan.servers, plan.paused_at, self.resume, resumed=taken.resumed_each)
        except PartlyFailed as err:
            if not transfer.pool.took(err.resumed, err, plan.servers):  # (the others set aside)
                raise

    def unpause(self, plan: RoundPlan, err: BaseException) -> None:
        """Every rank, joining the new group failed: nothing of this round was sent. Rank 0: the servers it paused
        serve what they served, resumed, and the error raised says so (held by a base round: as :meth:`fail`)."""
        transfer = self.transfer
        if transfer.rank == 0 and plan.paused_at is not None and plan.own_pause:
            transfer.round_ended(RoundEnd(succeeded=False))
            transfer.pauses.resume_after(plan.servers, err)  # raises, saying so
        self.fail(plan, err)

    def fail(self, plan: RoundPlan, err: BaseException) -> None:
        """Every rank, the round failed: the next one rebuilds the group and is dense. Rank 0: the servers it paused
        that may hold half-loaded weights have their round closed and stay paused (those that took a whole version were
        resumed: ``err.resumed``); a server that went silent is named (gloo names only its address)."""
        transfer = self.transfer
        transfer.round_ended(RoundEnd(succeeded=False, patch=self.round.result.patch))
        gone = transfer.pool.silent  # (rank 0: found silent by the round's watch: not asked again)
        if transfer.rank == 0 and plan.paused_at is not None:
            resumed = err.resumed if isinstance(err, PartlyFailed | NotTaken) else []
            close_rounds([s for s in plan.servers if s not in resumed and s.url not in gone],
                         timeout=transfer.timeout, empty_round=not transfer.options.closes_failed_rounds)
        if transfer.rank != 0 or isinstance(err, ServerError):
            return
        silent = [*gone, *not_answering([s for s in plan.servers if s.url not in gone])]
        if silent:
            raise ServerError(f"{type(err).__name__}: {err}; server(s) not answering now: {', '.join(silent)}",
                              silent[0]) from err

    # -- what the steps share ---------------------------------------------------------------------------

    @property
    def _swaps_each(self) -> bool:
        """A staged round that resumes: each server swaps the data in (and resumes) on its own, none paused before."""
        return isinstance(self.round, Staged) and self.resume

    def _watch(self) -> contextlib.AbstractContextManager[Any]:
        """Rank 0: the round's servers watched while it runs (``servers/watch.py``): one found silent has its
        requests given up, the group's data abandoned on every member, and is recorded in the pool (set aside with
        ``min_servers``)."""
        transfer = self.transfer
        if transfer.rank != 0:
            return contextlib.nullcontext()

        def on_silent(server: Server, why: str) -> None:
            transfer.pool.silent[server.url] = why
            transfer.pool.members = []  # this group serves no other round
            abandon = getattr(transfer.engine, "abandon_round", None)  # (our backends; vLLM's engines: none)
            if abandon is not None:
                abandon(f"server {server.url} went silent: {why}")

        return HealthWatch(lambda: transfer.servers, on_silent)

    def _engine_source(self) -> None:
        """vLLM's own trainer engines read the ``source`` they hold (their contract: given at ``trainer_init``), so it
        is this round's; ours take it with the round (``transport.takes_rounds``: the ``send_weights`` payload)."""
        options = self.transfer.options
        if self.transfer.engine is not None and not options.takes_rounds and not options.sends_patch_lists:
            self.transfer.engine.source = self.source

    def _inputs(self) -> RoundInputs:
        """What the round reads of the transfer now (after a reconnect: the engine of this round)."""
        t = self.transfer
        return RoundInputs(transport=t.options, engine=t.engine, source=self.source, rank=t.rank, patches=t.patches,
                           kept=t.kept, client=t.client, control=t.control)


def weight_source(source: Any, transport: NetworkTransport) -> Any:
    """``source`` as the vLLM ``WeightSource`` a trainer engine iterates (``nccl_m2n``: its shard-direct kind)."""
    from lightning_fsdp_export.export.vllm_source import FSDP2M2NSource, FSDP2WeightSource

    return FSDP2M2NSource(source) if transport.layout is SourceLayout.M2N else FSDP2WeightSource(source)


def plan_digest(transport: NetworkTransport, source: Any) -> str:
    """``nccl_m2n`` builds its engine for one source plan: a new plan (another model, dtype) needs a new group."""
    return repr(source_metadata(source)) if transport.layout is SourceLayout.M2N else ""


def _for_round(pool: ServerPool) -> BaseException | None:
    """Rank 0: the pool made current for this round (its ``active`` servers take it), or why the round cannot start (a
    server required for it does not answer ``/health``), for every rank of the group to learn before anything is
    paused."""
    try:
        pool.for_round()
        return None
    except ServerError as err:
        return err
