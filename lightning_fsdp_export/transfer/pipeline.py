"""One round of one push, as one pipeline read top to bottom (:meth:`RoundRun.run`):

1. **plan** (:meth:`RoundRun.plan`): rank 0 refreshes the pool, the one owner of this round's servers (every step
   reads them from it: ``transfer.servers``), rebuilds the transfer group where
   it broke or the plan changed, and pauses the servers (a staged round: not yet); where every trainer rank is in the
   group, they learn rank 0's decision (the plan, or that it failed) over the control group before anything is sent;
2. **send** (:meth:`RoundRun.send`): every rank of the group sends its part of ``source`` (the round's own
   ``run``: dense, patches, an adapter, a drafter, staged);
3. **the servers take it** (:meth:`RoundRun.servers_take_it`): rank 0 has each server swap the staged data in on its
   own, or tells each what follows the data (label, prefix-cache reset, adapter); the servers that took it serve it,
   the others are set aside where the pool may (``min_servers``);
4. **agree** (:meth:`RoundRun.agree`): a round in a background thread ends on every rank knowing whether the version
   serves;
5. **finish** (:meth:`RoundRun.finish`): keep what the round made (a sparse round's copy) and resume the servers; or
   **fail** (:meth:`RoundRun.fail`): a server that may hold half-loaded weights has its round closed and stays
   paused, one holding a whole version is resumed, the silent ones are named, and the next round rebuilds the group.

The transfer group itself (its rendezvous, engines and teardown) is :class:`~.frame.NativeTransfer`'s; what each kind
of round sends and tells the servers is :mod:`.rounds`'; the servers' pause and what a failure leaves is
:mod:`.pauses`'.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Protocol

from lightning_fsdp_export._compat import source_metadata
from lightning_fsdp_export.export.source import SourceLayout
from lightning_fsdp_export.transfer.http import Server, ServerError, next_round, not_answering
from lightning_fsdp_export.transfer.pauses import PartlyFailed, close_rounds
from lightning_fsdp_export.transfer.pool import ServerPool
from lightning_fsdp_export.transfer.rounds import Round, RoundInputs, Staged
from lightning_fsdp_export.transfer.transports import NetworkTransport
from lightning_fsdp_export.transfer.watch import HealthWatch

if TYPE_CHECKING:
    from lightning_fsdp_export._common import SyncGroup
    from lightning_fsdp_export.export.patches import PatchBase
    from lightning_fsdp_export.transfer.background import BackgroundPushes
    from lightning_fsdp_export.transfer.clients import FanOutClient
    from lightning_fsdp_export.transfer.pauses import Pauses

__all__ = ["RoundHost", "RoundRun", "plan_digest", "weight_source"]


class RoundHost(Protocol):
    """What a round reads and keeps of the transfer it runs through, between rounds (:class:`~.frame.NativeTransfer`
    is one: a protocol, as the frame imports this module). A round writes ``broken``, ``plan_digest``, ``kept``,
    ``last_patch``, the client's ``version``, the engine's ``source``, the pause's state and the pool's record (which
    servers it sets aside)."""

    every_rank: bool
    timeout: float
    options: NetworkTransport
    pool: ServerPool
    pauses: Pauses
    background: BackgroundPushes
    control: SyncGroup | None
    patches: PatchBase | None
    confirmed: int | None
    client: FanOutClient | None
    engine: Any  # (the transport's trainer engine: vLLM's or ours, built by connect)
    broken: bool
    plan_digest: str
    kept: str | None
    last_patch: dict[str, Any] | None

    @property
    def rank(self) -> int: ...

    @property
    def servers(self) -> list[Server]: ...

    def plan_group(self) -> dict[str, Any]: ...

    def connect(self, plan: dict[str, Any] | None, source: Any) -> None: ...

    def forget(self) -> None: ...


class RoundRun:
    """One round of ``source`` as ``version`` through ``transfer``'s group, on this rank (every rank builds one per
    push and calls :meth:`run`).

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
        self.own_pause = transfer.pauses.held_since is None  # else a base round paused them for this adapter round
        self.paused = False  # this rank (rank 0) paused the servers in this round
        self.paused_at = 0.0
        self.sparse = False  # this round sends patches (every rank holds the confirmed version's copy)
        self.sent = False  # from the send on, a failure may leave a server's model half-loaded
        self.swapped = False  # the servers took it each on its own (a staged swap) or the pool set the others aside
        self.resumed: list[Server] = []  # rank 0, after a failure: servers that hold a whole version, serving again
        self.resumed_each = False  # rank 0: each server was resumed as it took the round
        self.group_plan: dict[str, Any] | None = None  # every rank in the group: rank 0's plan of a new group
        self.outcome: str | None = None  # rank 0, a round in the background: why the servers did not take it
        self.inputs: RoundInputs | None = None

    def run(self) -> None:
        """The round: plan -> send -> the servers take it -> agree -> finish (or fail, and raise)."""
        transfer = self.transfer
        if not transfer.every_rank and transfer.rank != 0 and not transfer.options.sends_patch_lists:
            self._engine_source()
            transfer.engine.send_weights()  # iterates the source: this rank's part of the gathers
            return
        with self._watch():
            self.plan()
            try:
                self.send()
                self.servers_take_it()
                self.agree()
            except BaseException as err:
                self.fail(err)
                raise
            self.finish()  # (watched too: a server that freezes as it is resumed is found within seconds)

    # -- the steps ------------------------------------------------------------------------------------

    def plan(self) -> None:
        """Rank 0 rebuilds the group if needed (broken on any rank, a new plan, other servers) and, unless the round
        stages its data first, pauses the servers (unless held); alone in the group it connects first, else the others
        learn the plan, or its failure, from its broadcast."""
        transfer = self.transfer
        failure: BaseException | None = None
        if transfer.rank == 0:  # servers that left, joined, died or came back: a new group (one silent: failure)
            failure = _for_round(transfer.pool)
        rebuild = (transfer.broken or plan_digest(transfer.options, self.source) != transfer.plan_digest
                   or (transfer.rank == 0 and [s.url for s in transfer.servers] != transfer.pool.members))
        plan_key = self.round.plan_key(self._inputs())
        patches = transfer.patches
        can_patch = (plan_key is not None and patches is not None and patches.can_patch(transfer.confirmed, plan_key)
                     and (transfer.rank != 0 or transfer.kept is not None))
        if transfer.control is not None:
            states = transfer.control.gather((rebuild, can_patch))
            rebuild = any(r for r, _ in states)
            self.sparse = not rebuild and all(c for _, c in states)
        pause = self.round.pauses_for_data
        decision: dict[str, Any] = {"error": None, "plan": None}
        if transfer.rank == 0:
            try:
                if failure is not None:
                    raise failure
                decision["plan"], decision["rebuilt"] = self._start(rebuild, pause)
            except Exception as err:  # noqa: BLE001 - every rank of the group learns of it just below
                decision, failure = {"error": f"{type(err).__name__}: {err}", "plan": None}, err
        if transfer.control is not None:
            decision = transfer.control.broadcast(decision)
        if decision.get("rebuilt"):  # (rank 0 built a group the ranks did not agree on: nobody holds its copies)
            self.sparse = False
        if decision["error"] is not None:  # nothing was paused by this round (pausing is the last step above)
            transfer.broken = True
            if failure is not None:
                raise failure
            raise ServerError(f"trainer rank 0 could not start the round: {decision['error']}",
                              transfer.servers[0].url)
        self.paused = transfer.rank == 0 and pause
        self.group_plan = decision["plan"]

    def _start(self, rebuild: bool, pause: bool) -> tuple[dict[str, Any] | None, bool]:
        """Rank 0: build the group if needed (alone in it: rendezvous while the servers still serve) and pause the
        servers; the plan every rank joins (``None``: none new) and whether a group was built. With ``min_servers``,
        a server that fails here after answering ``/health`` is set aside and both steps are redone at once without
        it (a new group), while the quorum holds: nothing was sent yet."""
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
                self.paused_at = transfer.pauses.pause(transfer.servers) if pause else 0.0
                return (plan if transfer.every_rank else None), built
            except ServerError as err:
                if not pool.drop_failed(err, transfer.servers):  # (sets them aside: pool.active is the others)
                    raise
                rebuild = True

    def send(self) -> None:
        """Every rank of the group: join the new group rank 0 planned (if any), then this round's data, through this
        rank's engine over :attr:`source`."""
        transfer = self.transfer
        if self.group_plan is not None:
            transfer.connect(self.group_plan, self.source)
            transfer.plan_digest = plan_digest(transfer.options, self.source)
        if transfer.rank == 0:
            assert transfer.client is not None
            transfer.client.version = self.round.client_version(self.version)
        self.sent = True
        self._engine_source()
        self.inputs = self._inputs()
        try:
            self.round.run(self.inputs, version=self.version, sparse=self.sparse)
        finally:
            transfer.last_patch = self.round.result.patch or transfer.last_patch

    def servers_take_it(self) -> None:
        """Rank 0: each server swaps the staged data in on its own (a staged round that resumes), or is told what
        follows the data; where some fail, the pool keeps the round if enough took it (the others set aside)."""
        transfer, pauses, this, inputs = self.transfer, self.transfer.pauses, self.round, self.inputs
        assert inputs is not None
        if transfer.rank != 0:
            return
        try:
            mode = pauses.mode
            if isinstance(this, Staged) and self.resume:  # each server swaps (and resumes) alone
                self.swapped = True
                pauses.swap_each(transfer.servers, lambda s: this.swap(s, inputs, version=self.version, mode=mode,
                                                                       own=s in transfer.pool.own_swaps),
                                 version=self.version)
            else:
                if not self.paused:  # a staged round held for its adapter round: pause them all now
                    self.paused_at, self.paused = pauses.pause(transfer.servers), True
                pauses.on_each_server(transfer.servers,
                                      lambda s: this.on_server(s, inputs, version=self.version, mode=mode),
                                      version=self.version, resume=self.resume)
                self.resumed_each = self.resume
        except Exception as err:
            self.resumed = err.resumed if isinstance(err, PartlyFailed) else []
            if transfer.pool.took(self.resumed, err, transfer.servers):
                self.swapped = True  # the servers that took it serve it, resumed; the others are set aside
            else:
                self.outcome = f"{type(err).__name__}: {err}"
                if not transfer.background.enabled:
                    raise

    def agree(self) -> None:
        """In a background thread, every rank: rank 0's outcome of the servers' part, or a failure naming it."""
        transfer = self.transfer
        if not transfer.background.enabled:
            return
        assert transfer.control is not None
        outcome = transfer.control.broadcast(self.outcome)
        if outcome is not None:
            raise RuntimeError(f"version {self.version} reached the servers' workers but trainer rank 0 could not"
                               f" swap it in: {outcome}")

    def finish(self) -> None:
        """Every rank, the round succeeded everywhere: keep what it made (a sparse round's copy); resume the servers
        (unless each did on its own or as it took the round, or the adapter round that follows does). A server that
        fails to resume after taking the version is set aside where the pool may (``min_servers``)."""
        transfer = self.transfer
        assert self.inputs is not None
        transfer.kept = self.round.succeeded(self.inputs)
        transfer.broken = False  # also on a rank outside the group (sparse_nccl's others), which never connects again
        if self.swapped:
            return
        try:
            transfer.pauses.finish(transfer.servers, self.paused_at, self.resume, resumed=self.resumed_each)
        except PartlyFailed as err:
            if not transfer.pool.took(err.resumed, err, transfer.servers):  # (the others set aside)
                raise

    def fail(self, err: BaseException) -> None:
        """Every rank, the round failed: the next one rebuilds the group and is dense. Rank 0: servers this round never
        reached are resumed (and the error says so); the others have their round closed and stay paused, unless they
        hold a whole version; a server that went silent is named (gloo names only its address)."""
        transfer = self.transfer
        transfer.broken = True
        transfer.pauses.release()
        transfer.forget()
        gone = transfer.pool.silent  # (rank 0: found silent by the round's watch: not asked again)
        if transfer.rank == 0 and self.paused:
            if not self.sent and self.own_pause:  # nothing of this round reached them: they serve what they served
                transfer.pauses.resume_after(transfer.servers, err)  # raises, saying so
            else:
                close_rounds([s for s in transfer.servers if s not in self.resumed and s.url not in gone],
                             timeout=transfer.timeout, empty_round=not transfer.options.closes_failed_rounds)
        silent = [] if transfer.rank != 0 or isinstance(err, ServerError) else [
            *gone, *not_answering([s for s in transfer.servers if s.url not in gone])]
        if silent:
            raise ServerError(f"{type(err).__name__}: {err}; server(s) not answering now: {', '.join(silent)}",
                              silent[0]) from err

    # -- what the steps share ---------------------------------------------------------------------------

    def _watch(self) -> contextlib.AbstractContextManager[Any]:
        """Rank 0: the round's servers watched while it runs (``transfer/watch.py``): one found silent has its
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
        """This rank's engine iterates this round's source (vLLM's trainer engines read their ``source``)."""
        if self.transfer.engine is not None and not self.transfer.options.sends_patch_lists:
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
