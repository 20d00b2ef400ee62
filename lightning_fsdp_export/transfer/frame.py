"""The transfer group of a network transport (:class:`NativeTransfer`): its rendezvous, this rank's trainer engine
(vLLM's ``WeightTransferTrainerFactory.trainer_init`` over a ``WeightSource`` and a
:class:`~lightning_fsdp_export.servers.clients.FanOutClient`), its teardown, and the entry of every push, which
runs one round (:class:`~lightning_fsdp_export.transfer.pipeline.RoundRun`, where a round reads top to bottom).

Shard-direct transports (``gloo`` with ``shard_direct=True``, vLLM's ``nccl_m2n``) put every trainer rank in the
group; only rank 0 talks to the servers, so what it learns there (each server's world size, the store's port, a fresh
group name, or that a server failed) reaches the others over a small gloo control group of the trainer ranks.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import uuid
from collections.abc import Iterable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor

from lightning_fsdp_export._common import SyncGroup
from lightning_fsdp_export._network import free_port, is_loopback, route_address
from lightning_fsdp_export.backend.shared import PauseMode
from lightning_fsdp_export.export.patches import PatchBase
from lightning_fsdp_export.export.shards import ShardSource
from lightning_fsdp_export.export.source import ExportSource, SourceLayout
from lightning_fsdp_export.servers.clients import FanOutClient
from lightning_fsdp_export.servers.http import Server, ServerError, on_all, on_each
from lightning_fsdp_export.servers.pool import ServerPool
from lightning_fsdp_export.servers.preflight import check_servers
from lightning_fsdp_export.transfer.adapters import (
    SERVER_ADAPTER_ROOT,
    AdapterFiles,
    AdapterTensors,
)
from lightning_fsdp_export.transfer.base import Transfer
from lightning_fsdp_export.transfer.pipeline import RoundEnd, RoundRun, plan_digest, weight_source
from lightning_fsdp_export.transfer.rounds import (
    Round,
    round_for,
)
from lightning_fsdp_export.transfer.transports import NetworkTransport, RendezvousTransport

__all__ = ["NativeTransfer"]


class NativeTransfer(Transfer):
    """One transfer group from the trainer to every worker of ``servers``; each push runs one round through it
    (:class:`~lightning_fsdp_export.transfer.pipeline.RoundRun`: plan, pause, send, the servers take it, resume or
    close). A rank outside the group (rank 0 alone sends) iterates the source so the gathers line up; if rank 0
    fails, the sync drains the others' iteration.

    Args:
        pool: the servers updated by every sync (``RemoteVLLM``'s pool; ``ServerPool.of(servers)`` for a fixed list).
        transport: a network transport's options (:mod:`~lightning_fsdp_export.transfer.transports`).
        timeout: seconds for the rendezvous and every collective of the transfer (``Gloo``), and per request.
        pause_mode: ``"wait"`` lets running requests finish before the update; ``"keep"`` freezes them
            and preempts them after it (async RL); ``"keep_old_kv"`` freezes them and keeps their KV.
    """

    def __init__(self, pool: ServerPool, transport: NetworkTransport, *, timeout: float,
                 pause_mode: PauseMode) -> None:
        super().__init__(pool, pause_mode=pause_mode, background=transport.every_rank and transport.stages)
        self.options = transport
        self.transport = transport.name
        self.timeout = timeout
        self.every_rank = transport.every_rank
        self.trainers = 1  # trainer ranks in the transfer group
        self.world_size = 0
        self.control: SyncGroup | None = None
        """Every rank joining (shard-direct) or patch lists: the trainer ranks' group, for rank 0's decisions."""
        self.plan_digest = ""
        """``nccl_m2n``: the source's metadata the engine was built for (a new plan needs a new group)."""
        self.client: FanOutClient | None = None
        self.engine: Any = None
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

    def confirm(self, version: int | None) -> None:
        self.confirmed = version

    # -- setup and teardown ------------------------------------------------------------------------

    def setup(self, trainer: Any) -> None:
        """Every rank: rank 0 alone sending: rendezvous here (a server down: a warning; the first sync retries); every
        rank sending: build the trainer ranks' control group (collective), the rendezvous is at the first push."""
        self.pauses.rank = trainer.global_rank
        empty = weight_source(None, self.options)  # (each round gives the engine its own source)
        if self.every_rank or self.options.sends_patch_lists:  # (collective: every rank builds it)
            self.control = SyncGroup(timedelta(seconds=self.timeout))
        if self.every_rank:
            self.trainers = trainer.world_size
            return
        if self.rank != 0:
            self.connect(None, empty)  # an engine that only iterates the source
            return
        try:
            self.pool.refresh()  # (min_servers: a server down now is set aside, not waited for)
            self.connect(self.plan_group(), empty)
        except ServerError as err:  # only rank 0 knows: the first sync retries, and fails on every rank
            self.broken = True
            rank_zero_warn(f"RemoteVLLM could not reach every server at setup ({err}); the first sync retries.")

    def plan_group(self) -> dict[str, Any]:
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
            port = port or free_port(address)
        return {"sizes": sizes, "address": address, "port": port,
                "group": uuid.uuid4().hex if self.every_rank else ""}

    def connect(self, plan: dict[str, Any] | None, source: Any) -> None:
        """Build this rank's trainer engine over ``source`` (a vLLM ``WeightSource``) from rank 0's ``plan`` (each
        server's workers start after the trainer ranks and the servers before it); ``None``: a rank outside the group,
        whose engine only iterates the source."""
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
        self.plan_digest = plan_digest(self.options, source)
        source = None if self.options.sends_patch_lists else source  # vLLM's sparse engine takes lists, no source
        self.engine = WeightTransferTrainerFactory.trainer_init(info, client=self.client, source=source)
        self.broken = False

    def round_ended(self, end: RoundEnd) -> None:
        """Every rank: what a round leaves (:class:`~lightning_fsdp_export.transfer.pipeline.RoundEnd`), applied here
        only: its sparse report; after a success the workers' copy and the group as it stands; after a failure a
        group to rebuild, a dense next round and no pause held."""
        if end.patch is not None:
            self.last_patch = end.patch
        if end.succeeded:
            self.kept = end.kept
            self.broken = False  # also on a rank outside the group (sparse_nccl's others), which never connects again
            return
        self.broken = True
        if end.started:
            self.pauses.release()
            self.forget()

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

    def push(self, source: ExportSource, *, version: int, resume: bool = True) -> None:
        """Send ``source`` as ``version`` to every server: one round; every rank calls it (rank 0 drives the servers);
        ``resume=False``: the servers stay paused for the adapter round that follows."""
        self._push(source, version=version, resume=resume)

    def push_draft(self, source: ExportSource, *, version: int) -> None:
        """A drafter's ``source`` into every server's draft model: a dense round of its own (``draft_round``; never in
        the background)."""
        self._push(source, version=version, draft=True)

    def _push(self, source: ExportSource | AdapterTensors, *, version: int, resume: bool = True,
              adapter: tuple[str, str] | None = None, draft: bool = False) -> None:
        """One round of ``source`` as ``version`` (what :meth:`push`, :meth:`push_draft` and :meth:`push_adapter` run).

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
        this = _round_of(self.options, version, adapter, run=self._run, draft=draft)
        if self.background.enabled and adapter is None and not draft:
            snapshot = self.background.snapshot(source, version, self.control)
            self.background.start(lambda: self._in_background(snapshot, version, resume), name=f"lfe-sync-v{version}")
            return
        RoundRun(self, this, source, version=version, resume=resume).run()

    def _in_background(self, snapshot: Any, version: int, resume: bool) -> None:
        """Every rank's thread: the round of a background push, redone at once from the same snapshots without the
        servers it found silent, while ``min_servers`` holds (a foreground push is redone by the sync, which exports
        again: here nothing is). The ranks agree on each try's outcome over the control group."""
        control = self.control
        assert control is not None  # (a background push: every rank sends)
        while True:
            error: BaseException | None = None
            try:
                RoundRun(self, _round_of(self.options, version, None, run=self._run), snapshot, version=version,
                         resume=resume).run()
            except Exception as err:  # noqa: BLE001 - every rank learns of it just below
                error = err
            failed = [rank for rank, ok in enumerate(control.gather(error is None)) if not ok]
            if not failed:
                return
            if not control.broadcast(self.rank == 0 and self.pool.drop_silent(self.servers)):
                if error is not None:
                    raise error
                raise RuntimeError(f"version {version} failed on trainer rank(s) {failed} in the background")
            if self.rank == 0:
                why = f"{type(error).__name__}: {error}" if error is not None else f"on trainer rank(s) {failed}"
                rank_zero_warn(f"RemoteVLLM: the background push of version {version} failed ({why}). The servers that"
                               f" went silent are set aside; version {version} is pushed again, now, to the others"
                               " (from the same snapshots).")

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
            self._push(AdapterTensors(files.tensors()), version=version, adapter=(name, files.config))
            return
        if self.rank == 0:
            self.pauses.load_adapter_from(self.servers, os.fspath(files.path.resolve()), name=name, version=version)


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
