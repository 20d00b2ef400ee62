"""``RemoteVLLM``: one or several vLLM OpenAI servers elsewhere, updated over the network or a directory.

Every server must run with ``VLLM_SERVER_DEV_MODE=1`` (it enables ``/pause``, ``/resume``,
``/reset_prefix_cache``, the weight-transfer routes and ``/collective_rpc``). vLLM's ``--api-key`` does
not guard those routes, and the transfer's store and sockets are unauthenticated: keep the servers,
their dev-mode routes and trainer rank 0's store port on the trainers' own network.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args

import torch
from torch import Tensor

from lightning_fsdp_export.source import ExportSource, SourceLayout
from lightning_fsdp_export.targets.base import ExactCheckable, ScoresLogprobs, WeightTarget
from lightning_fsdp_export.targets.directory import DEFAULT_SHARD_BYTES, CheckpointCheck, DirectoryTarget
from lightning_fsdp_export.targets.http import Server, on_all
from lightning_fsdp_export.targets.preflight import check_servers
from lightning_fsdp_export.targets.transfer import (
    NativeTransfer,
    PauseMode,
    Transport,
    default_transport,
    pause_route,
    reset_prefix_caches,
)

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["RemoteVLLM"]

_TRANSPORTS = ("nccl", "ipc", "gloo", "nccl_m2n", "directory")
# Which transports use each transport-specific option; any other transport refuses it.
_OPTIONS = {"directory": ("directory",), "shard_bytes": ("directory",), "keep_last": ("directory",),
            "master_address": ("nccl", "gloo", "nccl_m2n"), "master_port": ("nccl", "gloo", "nccl_m2n"),
            "buffer_bytes": ("nccl", "ipc", "gloo"), "packed": ("nccl", "ipc"), "shard_direct": ("gloo", "nccl_m2n")}


class RemoteVLLM(WeightTarget, ScoresLogprobs, ExactCheckable):
    """Push each version to one or several running vLLM servers (replicas), all in the same sync.

    Transports (``transport=``):

    * ``"nccl"``: vLLM's NCCL engine; the servers on other GPUs or nodes, started with
      ``--weight-transfer-config '{"backend": "nccl"}'``. Trainer rank 0 joins the group on its GPU.
    * ``"ipc"``: vLLM's CUDA-IPC engine, for a server on the trainer's own GPU
      (``'{"backend": "ipc"}'`` and ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` on the server).
    * ``"gloo"``: this package's backend over CPU sockets (``'{"backend": "gloo"}'``; the server's
      environment must have this package installed, which registers it as a vLLM plugin). With
      ``shard_direct=True`` every trainer rank sends its own rows of each FSDP2 shard (no all-gather on
      the trainer; the workers assemble the full tensors); the servers need no other setting.
    * ``"nccl_m2n"``: vLLM's M2N engine (``'{"backend": "nccl_m2n"}'``; needs NVIDIA's
      ``nccl-extensions`` on both sides): every trainer rank sends its local shards over NCCL and the
      workers reshard them (``strategy.weight_source(layout="m2n")``). GPU only.
    * ``"directory"``: rank 0 writes safetensors to ``directory`` (shared with the servers) and each
      server reloads them (``/collective_rpc reload_weights``): for setups with no network path.

    Default: ``"directory"`` when ``directory=`` is given, else ``"nccl"`` with CUDA and ``"gloo"`` without.
    The network transports rendezvous at fit start (trainer rank 0 hosts a store at
    ``master_address:master_port``; the servers' workers join at ranks after it, one server after the
    other; shard-direct transports at the first sync, with every trainer rank). Each sync then: ``/pause``
    every server, stream the export once (every trainer rank takes part in the gathers and rank 0 sends;
    shard-direct: every rank sends its own shards, gloo also its own experts' checkpoint pieces; only plain
    tensors and other layouts are gathered and sent whole by rank 0), set the version and reset the
    prefix cache on every server, ``/resume``. All servers form one group: one replica that is down or refuses a tensor fails the
    sync for all of them. Then every rank raises (``WeightSyncError`` from ``VLLMWeightSync``), the
    servers that answer have their round closed and stay paused (never serving a half-loaded model),
    and the next sync rebuilds the group, pushes every tensor and resumes them.

    Args:
        base_url: a server's address (``"http://10.0.0.5:8000"``), or a list of them (replicas). A
            data-parallel deployment behind one address is one entry (its ``/get_world_size`` counts
            every rank).
        transport: ``"nccl"``, ``"ipc"``, ``"gloo"``, ``"nccl_m2n"`` or ``"directory"``; see above.
        directory: (``"directory"``) a directory every server reads at the same path.
        api_key: sent as ``Authorization: Bearer ...`` (the servers' ``--api-key``).
        dtype: the dtype pushed; default ``torch.bfloat16``.
        timeout: seconds for each HTTP request (a whole transfer round included) and, with ``"gloo"``,
            for the rendezvous and every collective: a peer that dies mid-round ends the round after it.
        pause_mode: ``"wait"`` (running requests finish first) or ``"keep"`` (they freeze during the
            update and are recomputed with the new weights after it; for async RL).
        master_address: (``nccl``/``gloo``) trainer rank 0's address as the servers reach it; default:
            ``127.0.0.1`` when every server is local, else the address of this host's name.
        master_port: (``nccl``/``gloo``) the store's port on rank 0; 0 (default) picks a free one.
        buffer_bytes: (``nccl``/``gloo``/``ipc``) the packed chunk size; the trainer and every worker
            hold up to two of them (vLLM's NCCL default: 1 GiB; ``gloo``: 16 MiB, the fastest here).
        packed: (``nccl``/``ipc``) vLLM's packed transfer (``True``; unpacked IPC holds the whole model
            on the GPU until the round ends).
        shard_bytes: (``"directory"``) the largest safetensors file written.
        keep_last: (``"directory"``) version directories kept on disk (at least 2: the servers read the
            current one).
        shard_direct: (``"gloo"``) every trainer rank sends its own shards (see above); ``nccl_m2n`` always does
            (``shard_direct=True`` is accepted there and changes nothing).
    """

    def __init__(self, base_url: str | Sequence[str], *, transport: str | None = None,
                 directory: str | os.PathLike[str] | None = None, api_key: str | None = None,
                 dtype: torch.dtype | None = torch.bfloat16, timeout: float = 300.0, pause_mode: PauseMode = "wait",
                 master_address: str | None = None, master_port: int = 0, buffer_bytes: int | None = None,
                 packed: bool = True, shard_bytes: int | None = None, keep_last: int | None = None,
                 shard_direct: bool = False) -> None:
        urls = [base_url] if isinstance(base_url, str) else list(base_url)
        if not urls:
            raise ValueError("RemoteVLLM(base_url=[]) needs at least one server address.")
        if len(set(urls)) != len(urls):
            raise ValueError(f"RemoteVLLM(base_url={urls!r}) lists a server twice.")
        if timeout <= 0:
            raise ValueError(f"RemoteVLLM(timeout={timeout}) must be a positive number of seconds.")
        if pause_mode not in get_args(PauseMode):
            raise ValueError(f"RemoteVLLM(pause_mode={pause_mode!r}) must be 'wait' or 'keep'.")
        if transport is None:
            transport = "directory" if directory is not None else default_transport()
        if transport not in _TRANSPORTS:
            raise ValueError(f"RemoteVLLM(transport={transport!r}) must be one of {', '.join(map(repr, _TRANSPORTS))}.")
        given = {"directory": directory, "shard_bytes": shard_bytes, "keep_last": keep_last,
                 "master_address": master_address, "master_port": master_port or None, "buffer_bytes": buffer_bytes,
                 "packed": None if packed else False, "shard_direct": shard_direct or None}
        wrong = [f"{name}={value!r} (a {' / '.join(repr(t) for t in _OPTIONS[name])} option)"
                 for name, value in given.items() if value is not None and transport not in _OPTIONS[name]]
        if wrong:
            raise ValueError(f"RemoteVLLM(transport={transport!r}) does not use {', '.join(wrong)}. Drop it, or choose"
                             " that transport.")
        if buffer_bytes is not None and buffer_bytes <= 0:
            raise ValueError(f"RemoteVLLM(buffer_bytes={buffer_bytes}) must be a positive number of bytes.")
        if not 0 <= master_port < 65536:
            raise ValueError(f"RemoteVLLM(master_port={master_port}) must be a TCP port (0: pick a free one).")
        self.transport = transport
        self.servers = [Server(url, api_key=api_key, timeout=timeout) for url in urls]
        self._dtype = dtype
        self._timeout = timeout
        self._pause_mode = pause_mode
        self._is_rank_zero = True
        self._checks: list[CheckpointCheck] | None = None
        self.precheck_skipped: list[str] = []
        self._writer: DirectoryTarget | None = None
        self._checked_servers = False
        self._native: NativeTransfer | None = None
        if transport == "directory":
            if directory is None:
                raise ValueError("RemoteVLLM(transport='directory') needs directory=, a path every server can read.")
            keep = 2 if keep_last is None else keep_last
            if keep < 2:
                raise ValueError(f"RemoteVLLM(keep_last={keep}) must be at least 2: the servers read the current one.")
            self._writer = DirectoryTarget(directory, dtype=dtype, shard_bytes=shard_bytes or DEFAULT_SHARD_BYTES,
                                           keep_last=keep)
        else:
            self._native = NativeTransfer(self.servers, transport, master_address=master_address,  # type: ignore[arg-type]
                                          master_port=master_port, buffer_bytes=buffer_bytes, packed=packed,
                                          timeout=timeout, pause_mode=pause_mode, shard_direct=shard_direct)

    @property
    def base_url(self) -> str:
        """The first server's address."""
        return self.servers[0].url

    @property
    def dtype(self) -> torch.dtype | None:
        return self._dtype

    @property  # type: ignore[override]
    def source_layout(self) -> SourceLayout:
        """What ``VLLMWeightSync`` asks the strategy for: ``SHARDS`` for gloo shard-direct, ``M2N`` for
        ``nccl_m2n``, else ``FULL``."""
        if self.transport == "nccl_m2n":
            return SourceLayout.M2N
        return SourceLayout.SHARDS if self._native is not None and self._native.shard_direct else SourceLayout.FULL

    def setup(self, trainer: pl.Trainer) -> None:
        """Every rank: the network transports rendezvous here (rank 0 with every server)."""
        self._is_rank_zero = trainer.global_rank == 0
        if self._writer is not None:
            self._writer.setup(trainer)
        if self._native is not None:
            self._native.setup(trainer.global_rank, trainer.world_size)

    def check_weights(self, exported: list[tuple[str, tuple[int, ...]]]) -> list[str]:
        """Names and shapes the servers' checkpoints would refuse, when rank 0 can read them.

        No route tells the HF names and shapes a server loads; a server's ``/v1/models`` root is its
        checkpoint path, so this reads its safetensors headers when that path exists on rank 0.
        ``precheck_skipped`` lists the servers whose checkpoint was not readable (checked by the load).
        """
        if not self._is_rank_zero:
            return []
        if self._checks is None:
            roots = on_all(self.servers, lambda s: s.request("GET", "/v1/models")["data"][0].get("root", ""))
            self._checks = [CheckpointCheck(root) for root in roots]
            self.precheck_skipped = [s.url for s, c in zip(self.servers, self._checks) if not c.readable]
            if self.precheck_skipped:
                from lightning.pytorch.utilities.rank_zero import rank_zero_info

                rank_zero_info(f"RemoteVLLM: the checkpoints of {self.precheck_skipped} are not readable here; names and"
                               " shapes are not checked before sending (the servers' load checks them).")
        return [f"{s.url}: {line}" for s, check in zip(self.servers, self._checks) for line in check.problems(exported)]

    def prompt_logprobs(self, token_ids: list[int]) -> dict[str, list[float]]:
        """Each server's logprob of each token of ``token_ids`` given the ones before it, by URL (for
        ``VLLMWeightSync(verify="logprobs")``); asked from rank 0 only (``{}`` on other ranks). A server
        started with ``--skip-tokenizer-init`` cannot return logprobs (HTTP 400)."""
        if not self._is_rank_zero:
            return {}

        def score(server: Server) -> list[float]:
            model = server.request("GET", "/v1/models")["data"][0]["id"]
            body = {"model": model, "prompt": token_ids, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0}
            rows = server.request("POST", "/v1/completions", body)["choices"][0]["prompt_logprobs"][1:]
            return [row[str(token)]["logprob"] for row, token in zip(rows, token_ids[1:])]

        return dict(zip((s.url for s in self.servers), on_all(self.servers, score)))

    def checkpoint_path(self) -> str:
        """The first server's checkpoint directory (its ``/v1/models`` root); rank 0 only (``""`` elsewhere)."""
        if not self._is_rank_zero:
            return ""
        return str(self.servers[0].request("GET", "/v1/models")["data"][0].get("root", ""))

    def weight_checksums(self) -> dict[str, dict[str, str]]:
        """``{url: {vLLM parameter: sha256}}`` of every server (``/weight_checker``); rank 0 only (``{}`` elsewhere)."""
        if not self._is_rank_zero:
            return {}
        sums = on_all(self.servers, lambda s: s.request("POST", "/weight_checker", {"action": "checksum"})["checksums"])
        return dict(zip((s.url for s in self.servers), sums))

    def reset_weights(self) -> None:
        """Pause every server and zero its weights (``/weight_checker`` reset) before an exact check's push; rank 0
        only. The push resumes them; a push that fails leaves them paused, never serving the zeroed weights."""
        if self._is_rank_zero:
            on_all(self.servers, lambda s: s.request("POST", pause_route(self._pause_mode)))
            on_all(self.servers, lambda s: s.request("POST", "/weight_checker", {"action": "reset"}))

    def push_source(self, source: ExportSource, *, version: int) -> None:
        """Send one version from ``source`` (every rank; a collective export pass)."""
        if self._native is not None:
            self._native.push(source, version=version)
        else:
            self.push(iter(source), version=version)

    def push(self, weights: Iterator[tuple[str, Tensor]], *, version: int) -> None:
        """The ``WeightTarget`` protocol: a plain stream of ``(name, tensor)`` (``"directory"`` only)."""
        if self._writer is None:
            raise TypeError(f"RemoteVLLM(transport={self.transport!r}) sends from a source: call push_source(), as"
                            " VLLMWeightSync does.")
        self._writer.push(weights, version=version)
        if not self._is_rank_zero:
            return
        path = os.fspath(Path(self._writer.version_dir(version)).resolve())
        reload = {"method": "reload_weights", "kwargs": {"weights_path": path}}
        if not self._checked_servers:
            check_servers(self.servers, backend=None)  # dev mode and quantization, before the first reload
            self._checked_servers = True
        on_all(self.servers, lambda s: s.request("POST", pause_route(self._pause_mode)))
        try:
            on_all(self.servers, lambda s: s.request("POST", "/collective_rpc", reload))
            reset_prefix_caches(self.servers, self._pause_mode)
            on_all(self.servers, lambda s: s.request("POST", "/update_weight_version", {"new_version": str(version)}))
        finally:
            on_all(self.servers, lambda s: s.request("POST", "/resume"))

    def request(self, method: str, route: str, body: dict[str, Any] | None = None) -> Any:
        """One HTTP request to the first server; raises ``ConnectionError`` naming the URL on any failure."""
        return self.servers[0].request(method, route, body)

    def teardown(self) -> None:
        """Shut the transfer engine down on every server that answers (network transports)."""
        if self._native is not None:
            self._native.disconnect()

