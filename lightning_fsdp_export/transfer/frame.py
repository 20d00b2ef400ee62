"""``RemoteVLLM``'s weight-transfer transports: vLLM's ``nccl`` / ``ipc`` engines and our ``gloo``.

The trainer side is vLLM's own API (``vllm.distributed.weight_transfer``): one trainer engine per rank,
built by ``WeightTransferTrainerFactory.trainer_init`` over a ``WeightSource`` and a client; each sync
is one ``send_weights()`` on every rank (rank 0 sends, the others iterate the source so the FSDP
gathers line up). This module adds what a deployment needs around it:

* :class:`~lightning_fsdp_export.transfer.clients.FanOutClient` (:mod:`.clients`), vLLM's four-method
  ``VLLMWeightSyncClient`` over several servers at once: each server gets its own ``rank_offset`` (a running sum
  of ``/get_world_size``), and ``finish_weight_update`` carries the sync's version (vLLM's engines send none);
* :class:`NativeTransfer`, the frame of every round: ``/pause``, the round (one class per kind,
  :mod:`~lightning_fsdp_export.transfer.rounds`: what is sent, what the servers are told after it), ``/resume``
  (a staged round, ``Gloo(background=True)``, pauses only after its data arrived, for the swap);
  and after a failure: close the round on every reachable server that may hold half-loaded weights and leave it
  paused (it answers no request then), resume every server that holds one whole version (a pause or a group that
  failed before the send; the servers whose swap, adapter or cache reset succeeded when others' failed), and
  re-initialise the transfer group at the next sync, which then pushes everything.

Shard-direct transports (``gloo`` with ``shard_direct=True``, vLLM's ``nccl_m2n``) put every trainer rank
in the transfer group. Only rank 0 talks to the servers, so what it learns there (each server's world size,
the store's port, a fresh group name, or that a server failed) reaches the other ranks through a small gloo
control group of the trainer ranks before each round: every rank reports whether its last round broke,
and if any did, rank 0 rebuilds the group with every rank.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import uuid
from collections.abc import Iterable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor

from lightning_fsdp_export._common import SyncGroup
from lightning_fsdp_export._compat import source_metadata
from lightning_fsdp_export._network import is_loopback, route_address
from lightning_fsdp_export.backend.shared import PauseMode
from lightning_fsdp_export.export.patches import PatchBase
from lightning_fsdp_export.export.shards import ShardSource
from lightning_fsdp_export.export.source import ExportSource, SourceLayout
from lightning_fsdp_export.transfer.adapters import (
    SERVER_ADAPTER_ROOT,
    AdapterFiles,
    AdapterTensors,
)
from lightning_fsdp_export.transfer.base import Transfer
from lightning_fsdp_export.transfer.clients import FanOutClient
from lightning_fsdp_export.transfer.http import Server, ServerError, not_answering, on_all, on_each
from lightning_fsdp_export.transfer.pauses import PartlyFailed, close_rounds
from lightning_fsdp_export.transfer.pool import ServerPool
from lightning_fsdp_export.transfer.preflight import check_servers
from lightning_fsdp_export.transfer.rounds import (
    Round,
    RoundInputs,
    Staged,
    reset_prefix_caches,
    round_for,
)
from lightning_fsdp_export.transfer.transports import NetworkTransport, RendezvousTransport

__all__ = ["NativeTransfer", "PartlyFailed", "reset_prefix_caches"]


class NativeTransfer(Transfer):
    """One transfer group from the trainer to every worker of ``servers``, and the one round every sync runs.

    The round, whichever the transport: (rank 0) rebuild the group if it is broken or the source's plan changed, then
    ``/pause`` every server; send (every rank in the group sends its part; others iterate the source so the gathers
    line up); (rank 0) reset the prefix caches, ``/resume``. A failed round is closed on every server that may hold
    half-loaded weights, which stays paused; a server holding one whole version (nothing sent yet, or its part of the
    round after the data succeeded) is resumed; the next round rebuilds the group. Where every trainer rank joins the
    group (``transport.every_rank``: shard-direct), rank 0's decisions (rebuild with what plan, or that it failed)
    reach the others through a small gloo control group before the send; else rank 0 alone knows, and the other
    ranks' iteration is drained by the sync if rank 0 fails.

    Args:
        servers: the servers (replicas) updated by every sync.
        transport: a network transport's options (:mod:`~lightning_fsdp_export.transfer.transports`).
        timeout: seconds for the rendezvous and every collective of the transfer (``Gloo``), and per request.
        pause_mode: ``"wait"`` lets running requests finish before the update; ``"keep"`` freezes them
            and preempts them after it (async RL); ``"keep_old_kv"`` freezes them and keeps their KV.
        pool: the servers' pool (``RemoteVLLM``'s, whose ``active`` servers are ``servers``); default: ``servers``.
    """

    def __init__(self, servers: Sequence[Server], transport: NetworkTransport, *, timeout: float,
                 pause_mode: PauseMode, pool: ServerPool | None = None) -> None:
        super().__init__(servers, pause_mode=pause_mode, background=transport.every_rank and transport.stages)
        self.options = transport
        self.transport = transport.name
        self.timeout = timeout
        self.every_rank = transport.every_rank
        self.trainers = 1  # trainer ranks in the transfer group
        self.world_size = 0
        self.control: SyncGroup | None = None
        """Every rank joining (shard-direct) or patch lists: the trainer ranks' group, for rank 0's decisions."""
        self._plan_digest = ""  # nccl_m2n: the source's metadata the engine was built for
        self.client: FanOutClient | None = None
        self.engine: Any = None
        self.source: Any = None  # one vLLM WeightSource for the engine's lifetime, repointed each sync
        self.broken = True  # no group yet: setup (rank 0 alone) or the first push (every rank) builds it
        self._run = uuid.uuid4().hex[:12]  # names this fit's adapter directories on the servers' hosts
        _require_engine(transport)
        ours = not transport.sends_patch_lists  # our gloo wire takes bitmaps and coded patches (vLLM: indices)
        self.patches = PatchBase(bitmaps=ours, coded=ours) if transport.sends_patches else None
        """Sparse rounds: this rank's copy of what it last sent (``None`` unless the transport sends patches)."""
        self.confirmed: int | None = None
        """The version every rank agreed the servers hold (before each push); patches are made only against it."""
        self.kept: str | None = None
        """Rank 0, sparse rounds: the id of the copy the workers keep (set by a round that succeeded)."""
        self._last_patch: dict[str, Any] | None = None
        self.pool = pool or ServerPool.of(servers)
        """Rank 0: who takes each round, who is set aside (``RemoteVLLM(min_servers=...)``), who swaps on its own."""

    @property
    def last_patch(self) -> dict[str, Any] | None:
        """This rank's last sparse round: patched or dense, bytes sent and dense, elements, changed, copy bytes."""
        return self._last_patch

    def confirm(self, version: int | None) -> None:
        self.confirmed = version

    # -- setup and teardown ------------------------------------------------------------------------

    def setup(self, trainer: Any) -> None:
        """Every rank: rank 0 alone sending: rendezvous here (a server down: a warning; the first sync retries); every
        rank sending: build the trainer ranks' control group (collective), the rendezvous is at the first push."""
        from lightning_fsdp_export.export.vllm_source import FSDP2M2NSource, FSDP2WeightSource

        self.pauses.rank = trainer.global_rank
        self.source = FSDP2M2NSource(None) if self.options.layout is SourceLayout.M2N else FSDP2WeightSource(None)
        if self.every_rank or self.options.sends_patch_lists:  # (collective: every rank builds it)
            self.control = SyncGroup(timedelta(seconds=self.timeout))
        if self.every_rank:
            self.trainers = trainer.world_size
            return
        if self.rank != 0:
            self._connect(None)  # an engine that only iterates the source
            return
        try:
            self.pauses.servers = self.pool.refresh()  # (min_servers: a server down now is set aside, not waited for)
            self._connect(self._plan())
        except ServerError as err:  # only rank 0 knows: the first sync retries, and fails on every rank
            self.broken = True
            rank_zero_warn(f"RemoteVLLM could not reach every server at setup ({err}); the first sync retries.")

    def _plan(self) -> dict[str, Any]:
        """Rank 0, before (re)building the group: shut the old engines down, check the servers, ask their world sizes,
        pick the store's port (every rank joining: a fresh group name): all a rank needs."""
        self.disconnect()
        self.pool.members = [s.url for s in self.servers]
        check_servers(self.servers, backend=self.transport)  # dev mode, backend, quantization, vLLM minor
        sizes = on_all(self.servers, lambda s: s.world_size())
        if self.options.stages:
            self.pool.find_own_swaps(self.servers)
        address, port = _store_address(self.options, self.servers)
        if isinstance(self.options, RendezvousTransport):
            port = port or _free_port(address)
        return {"sizes": sizes, "address": address, "port": port,
                "group": uuid.uuid4().hex if self.every_rank else ""}

    def _connect(self, plan: dict[str, Any] | None) -> None:
        """Build this rank's trainer engine from rank 0's ``plan`` (each server's workers start after the trainer ranks
        and the servers before it); ``None``: a rank outside the group, whose engine only iterates the source."""
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        if self.engine is not None:
            self.engine.shutdown()
        if plan is None:
            self.client = FanOutClient([], [])
            address, port = _store_address(self.options, self.servers)
            plan = {"address": address, "port": port, "group": ""}
        else:
            sizes = plan["sizes"]
            self.world_size = self.trainers + sum(sizes)
            offsets = [self.trainers + sum(sizes[:i]) for i in range(len(sizes))]
            self.client = FanOutClient(self.servers if self.rank == 0 else [], offsets if self.rank == 0 else [])
        info = self.options.init_info(rank=self.rank, address=plan["address"], port=plan["port"],
                                      world_size=self.world_size, trainers=self.trainers, group=plan["group"],
                                      timeout=self.timeout)
        source = None if self.options.sends_patch_lists else self.source  # vLLM's sparse engine takes lists, no source
        self.engine = WeightTransferTrainerFactory.trainer_init(info, client=self.client, source=source)
        self.broken = False

    def remove_adapter_files(self) -> None:
        """At the fit's end, rank 0: this fit's adapter directories on this host (the servers hold them loaded)."""
        if self.rank == 0:
            shutil.rmtree(Path(SERVER_ADAPTER_ROOT) / self._run, ignore_errors=True)

    def disconnect(self) -> None:
        """Rank 0: shut the transfer engine down on every server that answers and drop ours: a new group next."""
        self.forget()
        self.broken = True
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
        if self.rank == 0 and self.client is not None:
            on_each(self.servers, lambda s: s.shutdown_transfer(timeout=min(self.timeout, 30.0)))  # (down: nothing)
        self.client = None

    # -- one sync ----------------------------------------------------------------------------------

    def push_stream(self, weights: Iterable[tuple[str, Tensor]], *, version: int) -> None:
        raise TypeError(f"RemoteVLLM(transport={self.transport!r}) sends from a source: call push_source(), as"
                        " VLLMWeightSync does.")

    def push(self, source: ExportSource | AdapterTensors, *, version: int, resume: bool = True,
             adapter: tuple[str, str] | None = None, draft: bool = False) -> None:
        """Send ``source`` as ``version`` to every server: one round; every rank calls it (rank 0 drives the servers).

        Args:
            source: the sync's source, or (``adapter``) an adapter's tensors.
            version: the version the servers report after it.
            resume: resume the servers at the end (``False``: held paused for the adapter round that follows).
            adapter: ``(name, adapter_config text)``: ``source`` is a peft adapter, sent in the transport's
                ``adapter_round``, which every server then loads as ``name``.
            draft: ``source`` is a drafter's, for each server's draft model (``draft_round``; never in the background).
        """
        if self.options.layout is not SourceLayout.FULL and not isinstance(source, (ShardSource, AdapterTensors)):
            raise TypeError(f"RemoteVLLM(transport={self.transport!r}) sends every rank's own shards: give it a"
                            f" ShardSource (strategy.export_source(layout={self.options.layout.value!r})), as"
                            " VLLMWeightSync does.")
        self.background.wait()  # at most one push in flight: the previous one ends (or raises) first
        if self.background.enabled and adapter is None and not draft:
            snapshot = self.background.snapshot(source, version, self.control)
            self.background.start(lambda: self._round_now(snapshot, version=version, resume=resume, adapter=None),
                                   name=f"lfe-sync-v{version}")
            return
        self._round_now(source, version=version, resume=resume, adapter=adapter, draft=draft)

    def _round_now(self, source: ExportSource | AdapterTensors, *, version: int, resume: bool,
                   adapter: tuple[str, str] | None, draft: bool = False) -> None:
        """One round of ``source``, in this thread."""
        self.source.export = source  # the engine was built with this WeightSource once
        if not self.every_rank and self.rank != 0 and not self.options.sends_patch_lists:
            self.engine.send_weights()  # iterates the source: this rank's part of the gathers
            return
        this = _round_of(self.options, version, adapter, run=self._run, draft=draft)
        own_pause = self.pauses.held_since is None  # else a base round paused them for this adapter round
        plan, paused, paused_at, sparse = self._start_round(this.plan_key(self._inputs()), pause=this.pauses_for_data)
        sent = False  # from the send on, a failure may leave a server's model half-loaded
        swapped = False  # a staged round whose servers swapped (and resumed) each on its own
        resumed: list[Server] = []  # rank 0: servers that hold a whole version after a failure, serving again
        try:
            if plan is not None:
                self._connect(plan)
                self._plan_digest = _digest(self.options, self.source)
            if self.rank == 0:
                assert self.client is not None
                self.client.version = this.client_version(version)
            sent = True
            inputs = self._inputs()  # (after _connect: the engine of this round)
            try:
                this.run(inputs, version=version, sparse=sparse)
            finally:
                self._last_patch = this.result.patch or self._last_patch
            outcome: str | None = None
            if self.rank == 0:
                try:
                    mode = self.pauses.mode
                    if swapped := isinstance(this, Staged) and resume:  # each server swaps (and resumes) alone
                        self.pauses.swap_each(lambda s: this.swap(s, inputs, version=version, mode=mode,
                                                                  own=s in self.pool.own_swaps), version=version)
                    else:
                        if not paused:  # a staged round held for its adapter round: pause them all now
                            paused_at, paused = self.pauses.pause(), True
                        self.pauses.on_each_server(lambda s: this.on_server(s, inputs, version=version, mode=mode),
                                                   version=version, resume=resume)
                except Exception as err:
                    resumed = err.resumed if isinstance(err, PartlyFailed) else []
                    if self.pool.took(resumed, err, self.servers):
                        swapped = True  # the servers that took it serve it, resumed; the others are set aside
                        self.pauses.servers = self.pool.active
                    else:
                        outcome = f"{type(err).__name__}: {err}"
                        if not self.background.enabled:
                            raise
            if self.background.enabled:  # every rank's thread ends knowing whether the version serves
                assert self.control is not None
                outcome = self.control.broadcast(outcome)
                if outcome is not None:
                    raise RuntimeError(f"version {version} reached the servers' workers but trainer rank 0 could not"
                                       f" swap it in: {outcome}")
        except BaseException as err:
            self.broken = True
            self.pauses.held_since = None
            self.forget()
            if self.rank == 0 and paused:
                if not sent and own_pause:  # nothing of this round reached them: they serve what they served
                    self.pauses.resume_after(err)  # raises, saying so
                else:
                    close_rounds([s for s in self.servers if s not in resumed], timeout=self.timeout,
                                 empty_round=not self.options.closes_failed_rounds)
            silent = not_answering(self.servers) if self.rank == 0 and not isinstance(err, ServerError) else []
            if silent:  # a peer that closed the transfer group's connection, named (gloo names only its address)
                raise ServerError(f"{type(err).__name__}: {err}; server(s) not answering now: {', '.join(silent)}",
                                  silent[0]) from err
            raise
        self.kept = this.succeeded(inputs)
        self.broken = False  # also on a rank outside the group (sparse_nccl's others), which never connects again
        if not swapped:
            self.pauses.finish(paused_at, resume)

    def _inputs(self) -> RoundInputs:  # what a round reads of this transfer now
        return RoundInputs(transport=self.options, engine=self.engine, source=self.source, rank=self.rank,
                           patches=self.patches, kept=self.kept, client=self.client, control=self.control)

    def forget(self) -> None:
        """The servers' weights are no longer what this rank last sent: the next round is dense."""
        if self.patches is not None:
            self.patches.failed()
        self.kept = None

    def push_adapter(self, files: AdapterFiles, *, version: int, name: str) -> None:
        """Load one adapter version on every server as ``name``: over the transport where it carries adapters
        (the workers write it on their hosts; every rank of the group takes part), else from ``files.path``,
        which every server must read at that path (a shared filesystem)."""
        if self.options.carries_adapters:
            self.push(AdapterTensors(files.tensors()), version=version, adapter=(name, files.config))
            return
        if self.rank == 0:
            self.pauses.load_adapter_from(os.fspath(files.path.resolve()), name=name, version=version)

    def _start_round(self, plan_key: str | None, *, pause: bool = True) -> _Start:
        """Rank 0 rebuilds the group if needed (broken on any rank, a new plan, other servers) and, with ``pause``,
        pauses the servers (unless held); alone in the group it connects first, else the others learn the plan, or
        its failure, from its broadcast. Returns :data:`_Start`."""
        failure: BaseException | None = None
        if self.rank == 0:  # servers that left, joined, died or came back: a new group (one silent: failure)
            self.pauses.servers, failure = _for_round(self.pool, self.pauses.servers)
        rebuild = (self.broken or _digest(self.options, self.source) != self._plan_digest
                   or (self.rank == 0 and [s.url for s in self.servers] != self.pool.members))
        can_patch = (plan_key is not None and self.patches is not None
                     and self.patches.can_patch(self.confirmed, plan_key)
                     and (self.rank != 0 or self.kept is not None))
        sparse = False
        if self.control is not None:
            states = self.control.gather((rebuild, can_patch))
            rebuild = any(r for r, _ in states)
            sparse = not rebuild and all(c for _, c in states)
        decision: dict[str, Any] = {"error": None, "plan": None}
        paused_at = 0.0
        if self.rank == 0:
            try:
                if failure is not None:
                    raise failure
                self.pool.check_quorum()
                if rebuild:
                    plan = self._plan()
                    if not self.every_rank:  # rank 0 alone in the group: rendezvous while the servers still serve
                        self._connect(plan)
                    decision["plan"] = plan if self.every_rank else None
                paused_at = self.pauses.pause() if pause else 0.0
            except Exception as err:  # noqa: BLE001 - every rank of the group learns of it just below
                decision, failure = {"error": f"{type(err).__name__}: {err}", "plan": None}, err
        if self.control is not None:
            decision = self.control.broadcast(decision)
        if decision["error"] is not None:  # nothing was paused by this round (pausing is the last step above)
            self.broken = True
            if failure is not None:
                raise failure
            raise ServerError(f"trainer rank 0 could not start the round: {decision['error']}", self.servers[0].url)
        return decision["plan"], self.rank == 0 and pause, paused_at, sparse


_Start = tuple[dict[str, Any] | None, bool, float, bool]
"""What ``NativeTransfer._start_round`` returns: the plan (or ``None``), whether this rank paused, when, and whether the
round sends patches (only where every rank holds a copy of the confirmed version and the group stays)."""


def _for_round(pool: ServerPool, servers: list[Server]) -> tuple[list[Server], BaseException | None]:
    """Rank 0: the pool's servers for this round, or ``servers`` and why it cannot start (a server required for it
    does not answer ``/health``), for every rank of the group to learn before anything is paused."""
    try:
        return pool.for_round(), None
    except ServerError as err:
        return servers, err


def _store_address(transport: NetworkTransport, servers: Sequence[Server]) -> tuple[str, int]:
    """Where the servers reach trainer rank 0's store: the transport's ``master_address`` (default: loopback for local
    servers, else this host's address on the interface that routes to them) and ``master_port`` (0: picked by rank
    0). A loopback address for a server on another host is refused, naming both."""
    given = transport if isinstance(transport, RendezvousTransport) else RendezvousTransport()
    address = given.master_address or _default_address(servers)
    remote = [s.url for s in servers if not is_loopback(s.host)]
    if is_loopback(address) and remote:
        raise ValueError(f"{type(transport).__name__}(master_address={address!r}) is this host's loopback, which the"
                         f" server(s) {remote} on other hosts cannot reach: give an address of this host they reach, or"
                         " leave master_address unset (the address that routes to them).")
    return address, given.master_port


def _default_address(servers: Sequence[Server]) -> str:
    """The trainer's address as the servers see it: loopback for local servers, else the address of the interface
    the kernel routes to them through (never the hostname's, 127.0.1.1 on many hosts)."""
    if all(is_loopback(s.host) for s in servers):
        return "127.0.0.1"
    found = {route_address(s.host): s.url for s in servers if not is_loopback(s.host)}
    if len(found) > 1:
        raise ValueError(f"the servers are reached through different addresses of this host ({found}): give the"
                         " transport master_address= one that every server reaches.")
    return next(iter(found))


def _digest(transport: NetworkTransport, source: Any) -> str:
    """``nccl_m2n`` builds its engine for one source plan: a new plan (another model, dtype) needs a new group."""
    return repr(source_metadata(source)) if transport.layout is SourceLayout.M2N else ""


def _round_of(transport: NetworkTransport, version: int, adapter: tuple[str, str] | None, *, run: str,
              draft: bool = False) -> Round:
    """A push's round: the transport's ``draft_round`` for a drafter, its ``adapter_round`` for an adapter (written
    under this fit's ``run`` directory on the servers' hosts), else its ``weights_round``."""
    if draft:
        assert transport.draft_round is not None, "RemoteVLLM refuses drafters over this transport"
        return round_for(transport.draft_round)
    if adapter is None:
        return round_for(transport.weights_round)
    assert transport.adapter_round is not None, "push_adapter reads the adapter from a directory instead"
    name, config = adapter
    return round_for(transport.adapter_round, name=name, config=config,
                     server_dir=f"{SERVER_ADAPTER_ROOT}/{run}/{name}/v{version:06d}")


def _require_engine(transport: NetworkTransport) -> None:
    """Refuse a transport whose trainer engine this vLLM lacks (``sparse_nccl`` came with vLLM 0.33)."""
    if transport.sends_patch_lists and importlib.util.find_spec(
            "vllm.distributed.weight_transfer.sparse_nccl_engine") is None:
        raise ValueError(f"RemoteVLLM(transport=SparseNCCL()) needs vLLM's sparse_nccl weight-transfer engine (vLLM"
                         f" 0.33 or newer; this is vLLM {_vllm_version()}); on vLLM 0.32 use"
                         " Gloo(shard_direct=True, sparse=True).")


def _vllm_version() -> str:
    import vllm

    return str(vllm.__version__)


def _free_port(address: str) -> int:
    with socket.socket() as sock:
        sock.bind((address, 0))
        return int(sock.getsockname()[1])
