"""``RemoteVLLM``'s weight-transfer transports: vLLM's ``nccl`` / ``ipc`` engines and our ``gloo``.

The trainer side is vLLM's own API (``vllm.distributed.weight_transfer``): one trainer engine per rank,
built by ``WeightTransferTrainerFactory.trainer_init`` over a ``WeightSource`` and a client; each sync
is one ``send_weights()`` on every rank (rank 0 sends, the others iterate the source so the FSDP
gathers line up). This module adds what a deployment needs around it:

* :class:`FanOutClient`, vLLM's four-method ``VLLMWeightSyncClient`` over several servers at once: each
  server gets its own ``rank_offset`` (a running sum of ``/get_world_size``), and
  ``finish_weight_update`` carries the sync's version (vLLM's engines send none);
* :class:`NativeTransfer`, the round around ``send_weights``: ``/pause``, the transfer, the prefix
  cache reset, ``/resume``; and after a failure: close the round on every reachable server, leave them
  paused (they answer no request with half-loaded weights), and re-initialise the transfer group at
  the next sync, which then pushes everything.

Shard-direct transports (``gloo`` with ``shard_direct=True``, vLLM's ``nccl_m2n``) put every trainer rank
in the transfer group. Only rank 0 talks to the servers, so what it learns there (each server's world size,
the store's port, a fresh group name, or that a server failed) reaches the other ranks through a small gloo
control group of the trainer ranks before each round: every rank reports whether its last round broke,
and if any did, rank 0 rebuilds the group with every rank.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Literal

import torch

from lightning_fsdp_export._compat import json_safe_update_info, source_metadata
from lightning_fsdp_export.source import ExportSource
from lightning_fsdp_export.targets.http import Server, ServerError, on_all
from lightning_fsdp_export.targets.preflight import check_servers

__all__ = ["FanOutClient", "LLMClient", "NativeTransfer", "Transport", "PauseMode", "pause_route", "reset_prefix_caches"]

Transport = Literal["nccl", "ipc", "gloo", "nccl_m2n"]
PauseMode = Literal["wait", "keep"]


def pause_route(mode: PauseMode) -> str:
    """The ``/pause`` request of every round: ``wait`` drains running requests; ``keep`` freezes them and keeps
    their KV (``clear_cache=false``), to be recomputed after the prefix cache reset with the new weights."""
    return "/pause?mode=keep&clear_cache=false" if mode == "keep" else "/pause?mode=wait"


class FanOutClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol over one or several servers, called concurrently.

    Args:
        servers: the servers, in transfer-rank order.
        offsets: each server's first rank in the transfer group (its ``rank_offset``).
    """

    def __init__(self, servers: Sequence[Server], offsets: Sequence[int]) -> None:
        self.servers = list(servers)
        self.offsets = dict(zip((s.url for s in servers), offsets))
        self.version: str | None = None
        self.calls: list[str] = []

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        def init(server: Server) -> Any:
            info = dict(init_info)
            if "rank_offset" in info:  # broadcast backends; IPC has no group
                info["rank_offset"] = self.offsets[server.url]
            return server.request("POST", "/init_weight_transfer_engine", {"init_info": info})

        self._all("init_weight_transfer_engine", init)

    def start_weight_update(self) -> None:
        self._all("start_weight_update", lambda s: s.request("POST", "/start_weight_update"))

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        body = {"update_info": json_safe_update_info(update_info)}
        self._all("update_weights", lambda s: s.request("POST", "/update_weights", body))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        version = weight_version if weight_version is not None else self.version
        body = None if version is None else {"weight_version": version}
        self._all("finish_weight_update", lambda s: s.request("POST", "/finish_weight_update", body))

    def _all(self, what: str, call: Any) -> None:
        self.calls.append(what)
        on_all(self.servers, call)


class LLMClient:
    """vLLM's four-method ``VLLMWeightSyncClient`` over an ``LLM`` object in this process.

    ``LLM``'s own weight-transfer methods take request wrappers (``{"init_info": ...}``,
    ``{"update_info": ...}``), so it is not a client as is. Build the ``LLM`` with
    ``weight_transfer_config=WeightTransferConfig(backend=...)`` and vLLM's default multiprocess engine:
    the trainer engine calls ``update_weights`` from a side thread while rank 0 sends, and an
    in-process engine on rank 0 alone hangs a multi-rank fit (NOTES.md). Use it with
    :meth:`LazyExportFSDP2.weight_source` and ``WeightTransferTrainerFactory.trainer_init``.
    """

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)


class NativeTransfer:
    """One transfer group from trainer rank 0 to every worker of ``servers``, and the per-sync round.

    Args:
        servers: the servers (replicas) updated by every sync.
        transport: ``"nccl"`` / ``"ipc"`` / ``"nccl_m2n"`` (vLLM's engines) or ``"gloo"`` (ours).
        master_address: where the servers reach trainer rank 0's store (``nccl``/``gloo``).
        master_port: its port; 0 picks a free one at each rendezvous.
        buffer_bytes: the packed chunk size (``None``: the backend's default).
        packed: vLLM's ``packed`` wire flag (``nccl``/``ipc``).
        timeout: seconds for the rendezvous and every collective of the transfer (``gloo``), and per request.
        pause_mode: ``"wait"`` lets running requests finish before the update; ``"keep"`` freezes them
            and preempts them after it (async RL).
        shard_direct: every trainer rank joins the group and sends its own shards (``gloo``; implied by
            ``nccl_m2n``). The group is built at the first push, from every rank.
    """

    def __init__(self, servers: Sequence[Server], transport: Transport, *, master_address: str | None,
                 master_port: int, buffer_bytes: int | None, packed: bool, timeout: float,
                 pause_mode: PauseMode, shard_direct: bool = False) -> None:
        self.servers = list(servers)
        self.transport = transport
        self.master_address = master_address
        self.master_port = master_port
        self.buffer_bytes = buffer_bytes
        self.packed = packed
        self.timeout = timeout
        self.pause_mode = pause_mode
        self.shard_direct = shard_direct or transport == "nccl_m2n"
        self.rank = 0
        self.trainers = 1  # trainer ranks in the transfer group
        self.world_size = 0
        self._control: Any = None  # shard-direct: the trainer ranks' SyncGroup, for rank 0's decisions
        self._plan_digest = ""  # nccl_m2n: the source's metadata the engine was built for
        self.client: FanOutClient | None = None
        self.engine: Any = None
        self.source: Any = None  # one FSDP2WeightSource for the engine's lifetime, repointed each sync
        self.broken = True  # no group yet: the first push (or setup) builds it

    # -- setup and teardown ------------------------------------------------------------------------

    def setup(self, rank: int, world_size: int = 1) -> None:
        """Every rank: build the trainer engine; on rank 0 that is the rendezvous with every server (if one
        does not answer, a warning, and the first sync tries again inside the ranks' agreement).
        Shard-direct: build the trainer ranks' control group (collective); the rendezvous is at the first push."""
        self.rank = rank
        if self.transport == "gloo":
            from lightning_fsdp_export.targets.gloo import register

            register()
        from lightning_fsdp_export.targets.vllm_source import FSDP2M2NSource, FSDP2WeightSource

        self.source = FSDP2M2NSource(None) if self.transport == "nccl_m2n" else FSDP2WeightSource(None)
        if self.shard_direct:
            from lightning_fsdp_export.agreement import SyncGroup

            self.trainers = world_size
            self._control = SyncGroup(timedelta(seconds=self.timeout))  # collective: a gloo group of every rank
            self.broken = True
            return
        try:
            self.connect()
        except ServerError as err:  # only rank 0 knows: the first sync retries, and fails on every rank
            from lightning.pytorch.utilities.rank_zero import rank_zero_warn

            self.broken = True
            rank_zero_warn(f"RemoteVLLM could not reach every server at setup ({err}); the first sync retries.")

    def connect(self) -> None:
        """(Re)build the transfer group: rank 0 asks every server's world size, hosts the store, and
        rendezvouses; other ranks build an engine that only iterates the source."""
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        if self.rank == 0:
            self.disconnect()
            check_servers(self.servers, backend=self.transport)  # dev mode, backend, quantization, vLLM minor
            sizes = on_all(self.servers, lambda s: int(s.request("GET", "/get_world_size")["world_size"]))
            offsets = [1 + sum(sizes[:i]) for i in range(len(sizes))]
            self.world_size = 1 + sum(sizes)
            self.client = FanOutClient(self.servers, offsets)
        else:
            self.client = FanOutClient([], [])
        self.engine = WeightTransferTrainerFactory.trainer_init(self._init_info(), client=self.client, source=self.source)
        self.broken = False

    def _init_info(self, port: int = 0, group: str = "") -> Any:
        extra = {} if self.buffer_bytes is None else {"packed_buffer_size_bytes": self.buffer_bytes}
        if self.transport == "ipc":
            from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

            return IPCTrainerInitInfo(rank=self.rank, packed=self.packed, **extra)
        address = self.master_address or _default_address(self.servers)
        port = port or self.master_port or (_free_port(address) if self.rank == 0 else 0)
        if self.transport == "nccl_m2n":
            from vllm.distributed.weight_transfer.m2n_trainer import M2NTrainerInitInfo

            return M2NTrainerInitInfo(rank=self.rank, master_address=address, master_port=port,
                                      world_size=self.world_size, num_trainer_ranks=self.trainers)
        if self.transport == "nccl":
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

            return NCCLTrainerInitInfo(rank=self.rank, master_address=address, master_port=port,
                                       world_size=self.world_size, packed=self.packed, **extra)
        from lightning_fsdp_export.targets.gloo import GlooTrainerInitInfo

        return GlooTrainerInitInfo(rank=self.rank, master_address=address, master_port=port,
                                   world_size=self.world_size, timeout_s=self.timeout, num_trainer_ranks=self.trainers,
                                   group=group, **extra)

    def disconnect(self) -> None:
        """Rank 0: shut the transfer engine down on every server that answers; drop ours."""
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
        if self.rank == 0 and self.client is not None:
            for server in self.servers:
                try:
                    server.request("POST", "/shutdown_weight_transfer_engine", timeout=min(self.timeout, 30.0))
                except ServerError:
                    pass
        self.client = None

    # -- one sync ----------------------------------------------------------------------------------

    def push(self, source: ExportSource, *, version: int) -> None:
        """Send ``source`` as ``version`` to every server; every rank calls it (rank 0 drives the servers)."""
        self.source.export = source  # the engine was built with this WeightSource once, at setup
        if self.shard_direct:
            self._push_shards(source, version)
            return
        if self.rank != 0:
            self.engine.send_weights()  # iterates the source: this rank's part of the gathers
            return
        if self.broken:
            self.connect()
        assert self.client is not None
        self.client.version = str(version)
        paused = False
        try:
            on_all(self.servers, lambda s: s.request("POST", pause_route(self.pause_mode)))
            paused = True
            self.engine.send_weights()
            self._reset_prefix_caches()
        except BaseException:
            self.broken = True
            if paused:
                self._close_round()
            raise
        on_all(self.servers, lambda s: s.request("POST", "/resume"))

    def _push_shards(self, source: ExportSource, version: int) -> None:
        """One shard-direct round, every rank in the group: agree (rebuild the group if any rank's last round
        broke; rank 0 pauses the servers and tells the others if it could not), send, then rank 0 finishes."""
        from lightning_fsdp_export.shards import ShardSource

        if self.transport == "nccl_m2n" and not isinstance(source, ShardSource):
            raise TypeError("RemoteVLLM(transport='nccl_m2n') sends every rank's own shards: give it a ShardSource"
                            " (strategy.export_source(layout='m2n')), as VLLMWeightSync does.")
        digest = repr(source_metadata(self.source)) if self.transport == "nccl_m2n" else ""
        rebuild = any(self._control.gather(self.broken or digest != self._plan_digest))
        decision: dict[str, Any] = {"error": None, "connect": None}
        paused = False
        if self.rank == 0:
            try:
                if rebuild:
                    decision["connect"] = self._rendezvous_plan()
                on_all(self.servers, lambda s: s.request("POST", pause_route(self.pause_mode)))
                paused = True
            except Exception as err:  # noqa: BLE001 - every rank learns of it just below
                decision = {"error": f"{type(err).__name__}: {err}", "connect": None}
                failure: BaseException = err
        decision = self._control.broadcast(decision)
        if decision["error"] is not None:  # nothing was paused by this round (pausing is the last step above)
            self.broken = True
            if self.rank == 0:
                raise failure
            raise ServerError(f"trainer rank 0 could not start the round: {decision['error']}", self.servers[0].url)
        try:
            if decision["connect"] is not None:
                self._connect_every_rank(decision["connect"])
                self._plan_digest = digest
            if self.rank == 0:
                self.client.version = str(version)  # type: ignore[union-attr]
            self.engine.send_weights()
            if self.rank == 0:
                self._reset_prefix_caches()
        except BaseException:
            self.broken = True
            if self.rank == 0 and paused:
                self._close_round()
            raise
        if self.rank == 0:
            on_all(self.servers, lambda s: s.request("POST", "/resume"))

    def _rendezvous_plan(self) -> dict[str, Any]:
        """Rank 0, before a shard-direct rebuild: shut the old engines down, ask each server's world size, pick
        the store's port and a fresh group name; what every rank needs to join."""
        import uuid

        self.disconnect()
        check_servers(self.servers, backend=self.transport)  # every rank learns of a refusal through the broadcast
        sizes = on_all(self.servers, lambda s: int(s.request("GET", "/get_world_size")["world_size"]))
        address = self.master_address or _default_address(self.servers)
        return {"sizes": sizes, "port": self.master_port or _free_port(address), "group": uuid.uuid4().hex}

    def _connect_every_rank(self, plan: dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        if self.engine is not None:
            self.engine.shutdown()
        sizes = plan["sizes"]
        offsets = [self.trainers + sum(sizes[:i]) for i in range(len(sizes))]
        self.world_size = self.trainers + sum(sizes)
        self.client = FanOutClient(self.servers if self.rank == 0 else [], offsets if self.rank == 0 else [])
        self.engine = WeightTransferTrainerFactory.trainer_init(self._init_info(plan["port"], plan["group"]),
                                                                client=self.client, source=self.source)
        self.broken = False

    def _reset_prefix_caches(self) -> None:
        reset_prefix_caches(self.servers, self.pause_mode)

    def _close_round(self) -> None:
        """After a failed round: end it on every server that answers, so the next one can start. The
        servers stay paused (the model may be half-loaded) until the next full push resumes them."""
        for server in self.servers:
            try:
                server.request("POST", "/finish_weight_update", timeout=min(self.timeout, 30.0))
                continue
            except ServerError as err:
                if "without a matching" not in str(err) or self.transport == "gloo":
                    continue  # down, or our gloo worker already closed its round when it failed
            try:  # vLLM's engines leave the layerwise reload open after a failed update: close it empty
                server.request("POST", "/start_weight_update", timeout=min(self.timeout, 30.0))
                server.request("POST", "/finish_weight_update", timeout=min(self.timeout, 30.0))
            except ServerError:
                pass


def reset_prefix_caches(servers: Sequence[Server], mode: PauseMode) -> None:
    """After an update: drop every server's prefix cache (with ``keep``, the kept requests' blocks too, so they
    are recomputed with the new weights); a server answering ``{"success": false}`` fails the round."""
    reset = "/reset_prefix_cache?reset_running_requests=true" if mode == "keep" else "/reset_prefix_cache"
    answers = on_all(servers, lambda s: (s, s.request("POST", reset)))
    refused = [s.url for s, answer in answers if not (isinstance(answer, dict) and answer.get("success"))]
    if refused:
        raise ServerError(f"vLLM server(s) {refused} refused to reset the prefix cache after the update"
                          " ({'success': false}: blocks still held); their cached prompts would use the old"
                          " weights.", refused[0])


def _default_address(servers: Sequence[Server]) -> str:
    """The trainer's address as the servers see it: loopback for local servers, else this host's name's address."""
    if all(s.host in ("127.0.0.1", "localhost", "::1") for s in servers):
        return "127.0.0.1"
    return socket.gethostbyname(socket.gethostname())


def _free_port(address: str) -> int:
    with socket.socket() as sock:
        sock.bind((address, 0))
        return int(sock.getsockname()[1])


def default_transport() -> Transport:
    """``"nccl"`` when CUDA is available, else ``"gloo"``."""
    return "nccl" if torch.cuda.is_available() else "gloo"
