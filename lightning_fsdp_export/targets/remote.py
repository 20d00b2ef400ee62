"""``RemoteVLLM``: one or several vLLM OpenAI servers elsewhere, updated over the network or a directory.

Every server must run with ``VLLM_SERVER_DEV_MODE=1`` (it enables ``/pause``, ``/resume``,
``/reset_prefix_cache``, the weight-transfer routes and ``/collective_rpc``). vLLM's ``--api-key`` does
not guard those routes, and the transfer's store and sockets are unauthenticated: keep the servers,
their dev-mode routes and trainer rank 0's store port on the trainers' own network.
"""

from __future__ import annotations

import os
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from typing_extensions import override

from lightning_fsdp_export._common import SyncGroup
from lightning_fsdp_export.backend.shared import PAUSE_MODES, PauseMode
from lightning_fsdp_export.export.source import ExportSource, SourceLayout
from lightning_fsdp_export.servers.http import Server, ServerError, on_all, on_each
from lightning_fsdp_export.servers.pool import ServerPool, Urls
from lightning_fsdp_export.servers.preflight import adapter_problems
from lightning_fsdp_export.targets.base import (
    ExactCheckable,
    LoadsAdapters,
    PushesDrafts,
    ScoresLogprobs,
    SendsPatches,
    ServesRollouts,
    SyncRun,
    WeightTarget,
)
from lightning_fsdp_export.targets.directory import CheckpointCheck
from lightning_fsdp_export.targets.remote_directory import DirectoryReload
from lightning_fsdp_export.transfer.adapters import AdapterFiles, adapter_rank
from lightning_fsdp_export.transfer.base import Transfer
from lightning_fsdp_export.transfer.frame import NativeTransfer
from lightning_fsdp_export.transfer.transports import Directory, Transport, parse_transport

if TYPE_CHECKING:
    pass

__all__ = ["RemoteVLLM"]

class RemoteVLLM(WeightTarget, ScoresLogprobs, ExactCheckable, LoadsAdapters, PushesDrafts, SendsPatches,
                 ServesRollouts):
    """Push each version to one or several running vLLM servers (replicas), all in the same sync.

    Transports (``transport=``: an options object of :mod:`~lightning_fsdp_export.transfer.transports`, whose
    docstrings give each one's options and server setting, or a name for its defaults): ``NCCL()`` (vLLM's NCCL
    engine, servers on other GPUs or nodes; the default with CUDA), ``IPC()`` (a server on the trainer's own GPU),
    ``Gloo()`` (this package's backend over CPU sockets, the default without CUDA; ``shard_direct=True``: every rank
    sends its own rows; ``sparse=True``: only changed elements; ``background=True``: staged while the servers
    generate, then swapped by each server on its own), ``NCCLM2N()`` and ``SparseNCCL()`` (vLLM's shard-direct and
    sparse engines; GPU), ``Directory(path)`` (safetensors in a shared directory, reloaded by each server).

    Each sync: ``/pause`` every server, stream the export once (rank 0 sends, or every rank its own shards), set the
    version and reset the prefix caches, ``/resume`` (a staged round pauses only for its swap). A failed round never
    leaves a server serving half-loaded weights (it stays paused, named) and resumes every server that holds one whole
    version; the next sync rebuilds the group and pushes every tensor. By default every server takes every version
    and one that fails fails the sync; with ``min_servers=k`` the sync succeeds while ``k`` take it, and the others
    are set aside and rejoin when they answer again (:mod:`~lightning_fsdp_export.servers.pool`).

    Args:
        base_url: a server's address (``"http://10.0.0.5:8000"``), a list of them (replicas), or, for servers that
            join and leave a running fit, a callable returning the list or a file listing them (re-read before every
            sync). A data-parallel deployment behind one address is one entry.
        transport: a transport's options object (``Gloo(shard_direct=True)``, ``Directory(path)``, ...) or a
            network transport's name; see above.
        api_key: sent as ``Authorization: Bearer ...`` (the servers' ``--api-key``).
        dtype: the dtype pushed; default ``torch.bfloat16``.
        timeout: seconds for each HTTP request (a whole transfer round included) and, with ``Gloo``,
            for the rendezvous and every collective: a peer that dies mid-round ends the round after it.
        pause_mode: ``"wait"`` (running requests finish first), ``"keep"`` (they freeze during the
            update and are recomputed with the new weights after it; for async RL) or ``"keep_old_kv"``
            (they freeze and keep the old weights' KV: no recompute, no prefix-cache reset; every client must
            then salt its prefix cache per version, as ``AsyncRollouts`` does).
        adapter_name: the name every server serves the adapter under with ``VLLMWeightSync(lora="adapter")``
            (clients ask for ``model=<adapter_name>``); each version replaces it in place.
        min_servers: the fewest servers that must take each version (default: all of them). Network transports.

    LoRA adapters (``VLLMWeightSync(lora="adapter")``; servers with ``--enable-lora --max-lora-rank R`` and
    ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``, checked first): the first sync (and any after a failure or a resume)
    pushes the base weights, the servers held paused, then the adapter; later syncs only the adapter, loaded in place
    under ``adapter_name`` (a new path per version), then the caches reset and the version set. ``Gloo`` carries
    the adapter itself (no shared filesystem); ``Directory(path)`` copies it under ``path/adapters``; other
    transports need ``VLLMWeightSync``'s ``adapter_dir`` on a filesystem the servers share, at the same path. A
    server that cannot load it leaves every server paused.
    """

    def __init__(self, base_url: Urls, *, transport: Transport | str | None = None,
                 api_key: str | None = None, dtype: torch.dtype | None = torch.bfloat16, timeout: float = 300.0,
                 pause_mode: PauseMode = "wait", adapter_name: str = "policy", min_servers: int | None = None) -> None:
        _check_arguments(timeout=timeout, pause_mode=pause_mode, adapter_name=adapter_name)
        self.adapter_name = adapter_name
        self.adapter_version: int | None = None
        """Rank 0: the adapter version the servers serve under ``adapter_name`` (None: none loaded by this target)."""
        self.options = parse_transport(transport)
        self.transport = self.options.name
        self.pool = ServerPool(base_url, lambda url: Server(url, api_key=api_key, timeout=timeout),
                               min_servers=min_servers)
        """The servers (rank 0 keeps it current): ``pool.active`` take the next round, ``pool.out`` are set aside."""
        _check_min_servers(min_servers, len(self.pool.listed), self.options)
        self._dtype = dtype
        self._serving: list[str] | None = None  # AsyncRollouts' servers, as every rank agreed (``agree``)
        self._is_rank_zero = True
        self._checks: dict[str, CheckpointCheck] = {}  # by URL
        self._drafting: dict[str, str | None] = {}  # by URL: why the server cannot take a drafter (None: it can)
        self.precheck_skipped: list[str] = []
        self._round: Transfer = (
            DirectoryReload(self.pool, self.options, dtype=dtype, pause_mode=pause_mode)
            if isinstance(self.options, Directory) else
            NativeTransfer(self.pool, self.options, timeout=timeout, pause_mode=pause_mode))

    @property
    def servers(self) -> list[Server]:
        """The servers the next sync updates (rank 0's view; with ``min_servers``, those not set aside)."""
        return self.pool.active

    @property
    @override
    def serving(self) -> list[Server]:
        """Every rank: the servers rollouts may send requests to: with ``min_servers`` or URLs re-read, those rank 0
        found holding the served version before the last sync (not set aside, not joining: one that joins serves from
        the sync after the one that gave it every tensor); else every server."""
        if self._serving is None:
            return self.servers
        return [self.pool.server(url) for url in self._serving]

    @override
    def agree(self, ranks: SyncGroup) -> None:
        """Every rank, before each push, where the pool can change: rank 0 asks the servers (:meth:`ServerPool.refresh`)
        and every rank learns which of them serve (:attr:`serving`)."""
        if not self.pool.changes:
            return
        self._serving = self.pool.agree(ranks, rank_zero=self._is_rank_zero)

    @override
    def redo_without_failed(self, ranks: SyncGroup) -> bool:
        """With ``min_servers``: rank 0 sets aside the round's silent servers; the push is redone without them (those
        the failed round left paused get every tensor) while the quorum holds."""
        return bool(ranks.broadcast(self.pool.heals and self._is_rank_zero and self.pool.drop_silent(self.servers)))

    @property
    def servers_out(self) -> dict[str, str]:
        """Rank 0: the servers set aside (``min_servers``), by URL: why (they rejoin once they answer)."""
        return dict(self.pool.out)

    @override
    def sync_metrics(self) -> dict[str, float]:
        """``weight_sync/servers_out``: how many servers are set aside (with ``min_servers``)."""
        return {"weight_sync/servers_out": float(len(self.pool.out))} if self.pool.heals else {}

    @property
    def base_url(self) -> str:  # the first server's address
        return self.servers[0].url

    @property
    @override
    def state_name(self) -> str:
        return f"RemoteVLLM({self.transport}{', sparse' if self.options.sends_patches else ''})"

    @property
    @override
    def dtype(self) -> torch.dtype | None:
        return self._dtype

    @property
    @override
    def serves_during_push(self) -> bool:
        """A transport whose rounds stage the data while the servers generate (``Gloo(background=True)``)."""
        return self.options.stages

    @property
    @override
    def pushes_in_background(self) -> bool:
        """``Gloo(shard_direct=True, background=True)``: a push snapshots and returns; a thread sends it."""
        return self._round.in_background

    @override
    def push_arrived(self) -> bool:
        return self._round.arrived()

    @override
    def wait(self) -> None:
        self._round.wait()

    @property
    @override
    def pause_mode(self) -> PauseMode:
        """How a sync pauses the servers; ``"keep_old_kv"``: clients salt their prefix caches per version."""
        return self._round.pause_mode

    @property
    @override
    def last_paused_seconds(self) -> float | None:
        """Rank 0: how long the last completed sync paused the servers (``/pause`` to ``/resume``), else None."""
        pause = self._round.last_pause
        return None if pause is None else pause[1] - pause[0]

    @property
    def last_pause(self) -> tuple[float, float] | None:  # rank 0: the last sync's /pause and /resume, time.time()
        return self._round.last_pause

    @property
    @override
    def source_layout(self) -> SourceLayout:
        """The transport's layout, which ``VLLMWeightSync`` asks the strategy for (shards, m2n or full)."""
        return self.options.layout

    @override
    def setup(self, trainer: SyncRun) -> None:
        """Every rank: the network transports rendezvous here (rank 0 with every server)."""
        self._is_rank_zero = trainer.global_rank == 0
        self._round.setup(trainer)

    @override
    def check_weights(self, exported: list[tuple[str, tuple[int, ...]]]) -> list[str]:
        """Names and shapes the servers' checkpoints (their ``/v1/models`` roots' safetensors headers, where rank 0 can
        read them) would refuse; ``precheck_skipped`` lists the servers whose checkpoint was not readable."""
        return _precheck(self, lambda check: check.problems(exported)) if self._is_rank_zero else []

    @override
    def check_draft(self, exported: list[tuple[str, tuple[int, ...]]]) -> list[str]:
        """Rank 0: servers that draft with no model, and where the drafter's names and shapes disagree with theirs."""
        return _draft_problems(self, exported) if self._is_rank_zero else []

    @override
    def cannot_push_drafts(self) -> str | None:
        """Drafters travel over our backends' own rounds (``Gloo``), never in the background."""
        if self.options.draft_round is None or self.options.stages:
            return f"its transport {self.options!r} carries no drafter (use Gloo() or Gloo(shard_direct=True))"
        return None

    @override
    def push_draft(self, source: ExportSource, *, version: int) -> None:
        """The drafter into every server's draft model (``/start_draft_weight_update``): a dense round of its own."""
        self._round.push_draft(source, version=version)

    @override
    def check_adapter(self, exported: list[tuple[str, tuple[int, ...]]]) -> list[str]:
        """Rank 0, before an adapter sync sends anything: every server loads adapters of this rank at run time."""
        return adapter_problems(self.servers, adapter_rank(exported)) if self._is_rank_zero else []

    @override
    def push_base(self, source: ExportSource, *, version: int) -> None:
        """The base weights of an adapter sync: one transfer round that leaves the servers paused, so they never
        serve the new base with the previous adapter; :meth:`push_adapter` resumes them."""
        self.adapter_version = None
        self._round.push(source, version=version, resume=False)

    @override
    def push_adapter(self, path: str | os.PathLike[str], *, version: int) -> None:
        """Every rank: every server loads the peft directory ``path`` (this rank's) as ``adapter_name`` (a round)."""
        self.adapter_version = None
        self._round.push_adapter(AdapterFiles(Path(path)), version=version, name=self.adapter_name)
        self.adapter_version = version

    @override
    def prompt_logprobs(self, token_ids: list[int]) -> dict[str, list[float]]:
        """Each server's logprob of each token of ``token_ids`` given the ones before, by URL (``verify="logprobs"``),
        with the adapter once loaded; rank 0 only (``{}`` elsewhere). Not with ``--skip-tokenizer-init`` (HTTP 400)."""
        if not self._is_rank_zero:
            return {}
        adapter = self.adapter_name if self.adapter_version is not None else None
        return dict(zip((s.url for s in self.servers), on_all(self.servers, lambda s: _score(s, adapter, token_ids))))

    @override
    def checkpoint_path(self) -> str:
        """The first server's checkpoint directory (its ``/v1/models`` root); rank 0 only (``""`` elsewhere)."""
        if not self._is_rank_zero:
            return ""
        return str(self.servers[0].model().get("root", ""))

    @override
    def reload_checkpoint(self) -> None:
        """Every server reloads its own checkpoint, paused meanwhile (:func:`_reload_paused`); rank 0 only."""
        if self._is_rank_zero:
            _reload_paused(self.servers, self.pause_mode)

    @override
    def weight_checksums(self) -> dict[str, dict[str, str]]:
        """``{url: {vLLM parameter: sha256}}`` of every server (``/weight_checker``); rank 0 only (``{}`` elsewhere)."""
        if not self._is_rank_zero:
            return {}
        sums = on_all(self.servers, lambda s: s.weight_checksums())
        return dict(zip((s.url for s in self.servers), sums))

    @property
    def last_patch(self) -> dict[str, Any] | None:
        """This rank's last ``Gloo(sparse=True)`` round: ``sparse`` (patches, or dense), ``sent_bytes``, ``dense_bytes``
        (its parts, one copy), ``wire_bytes``, ``elements``, ``changed``, ``copy_bytes`` (host copy), or ``None``."""
        return self._round.last_patch

    @override
    def reset_weights(self) -> None:
        """Pause every server and zero its weights (``/weight_checker`` reset) before an exact check's push; rank 0
        only. The push resumes them; a push that fails leaves them paused, never serving the zeroed weights."""
        self._round.forget()  # every rank: the next push is dense
        if self._is_rank_zero:
            self._round.pause_all()
            on_all(self.servers, lambda s: s.zero_weights())

    @override
    def confirm(self, version: int | None) -> None:
        """Every rank, before each sync: the version the servers hold as every rank agreed (a transport that sends
        patches patches that version; ``None``: the push is dense). Other transports ignore it."""
        self._round.confirm(version)

    @override
    def held_version(self) -> int | None:
        """Rank 0: the highest version a listed server is tagged with (:meth:`ServerPool.held_version`)."""
        return self.pool.held_version()

    @override
    def push_source(self, source: ExportSource, *, version: int) -> None:
        """Send one version from ``source`` (every rank; a collective export pass): one transfer round."""
        self.adapter_version = None
        self._round.push(source, version=version)

    @override
    def push(self, weights: Iterator[tuple[str, Tensor]], *, version: int) -> None:
        """A plain stream of ``(name, tensor)``: only ``Directory`` can take one (network transports need the
        source's metadata first: :meth:`push_source`, which ``VLLMWeightSync`` calls)."""
        self._round.push_stream(weights, version=version)

    def request(self, method: str, route: str, body: dict[str, Any] | None = None) -> Any:
        """One HTTP request to the first server; raises ``ConnectionError`` naming the URL on any failure."""
        return self.servers[0].request(method, route, body)

    @override
    def teardown(self) -> None:
        """End a push still in the background (its failure is logged, not raised: the sync reported or will report
        it), shut the transfer engine down on every server that answers (network transports); remove this fit's
        adapter directories that gloo workers wrote on this host."""
        try:
            self.wait()
        except Exception as err:  # noqa: BLE001 - teardown runs on failure paths too
            warnings.warn(f"RemoteVLLM: the push still in flight at teardown failed: {type(err).__name__}: {err}",
                          stacklevel=2)
        self._round.disconnect()
        self._round.remove_adapter_files()


def _check_arguments(*, timeout: float, pause_mode: Any, adapter_name: Any) -> None:
    """Refuse ``RemoteVLLM``'s bad arguments, naming the value and the fix."""
    if timeout <= 0:
        raise ValueError(f"RemoteVLLM(timeout={timeout}) must be a positive number of seconds.")
    if pause_mode not in PAUSE_MODES:
        modes = ", ".join(map(repr, PAUSE_MODES))
        raise ValueError(f"RemoteVLLM(pause_mode={pause_mode!r}) must be one of {modes}.")
    if not isinstance(adapter_name, str) or not adapter_name or "/" in adapter_name:
        raise ValueError(f"RemoteVLLM(adapter_name={adapter_name!r}) must be a non-empty name without '/'"
                         " (clients ask for model=<adapter_name>).")


def _check_min_servers(min_servers: Any, given: int, options: Transport) -> None:
    """Refuse a ``min_servers`` that is not a count from 1 to the ``given`` servers, or one with ``Directory``."""
    if min_servers is None:
        return
    if isinstance(min_servers, bool) or not isinstance(min_servers, int) or not 1 <= min_servers <= given:
        raise ValueError(f"RemoteVLLM(min_servers={min_servers!r}) must be a whole number from 1 to the {given}"
                         " server(s) given: the fewest that must take each version.")
    if isinstance(options, Directory):
        raise ValueError("RemoteVLLM(min_servers=...) needs a network transport (Gloo(), NCCL(), ...): a Directory"
                         " reload sets no server aside.")


def _precheck(target: RemoteVLLM, problems: Any) -> list[str]:
    """Rank 0: ``problems(check)`` of every server's checkpoint (read once per server: servers may join a running
    fit), each line naming the server; servers whose checkpoint is not readable here are skipped, and named once."""
    new = [s for s in target.servers if s.url not in target._checks]
    if new:
        roots = on_all(new, lambda s: s.model().get("root", ""))
        target._checks.update((s.url, CheckpointCheck(root)) for s, root in zip(new, roots))
        skipped = [s.url for s in new if not target._checks[s.url].readable]
        target.precheck_skipped += skipped
        if skipped:
            rank_zero_info(f"RemoteVLLM: the checkpoints of {skipped} are not readable here; names and shapes"
                           " are not checked before sending (the servers' load checks them).")
    return [f"{s.url}: {line}" for s in target.servers for line in problems(target._checks[s.url])]


def _draft_problems(target: RemoteVLLM, exported: list[tuple[str, tuple[int, ...]]]) -> list[str]:
    """Rank 0, before a sync with a drafter: each server must draft with a model (its dev-mode ``/server_info``
    names a ``speculative_config``; asked once per server), and its checkpoint's drafter tensors take the export."""
    new = [s for s in target.servers if s.url not in target._drafting]
    for server, config in zip(new, on_all(new, lambda s: s.config())):
        speculative = (config.get("vllm_config") or {}).get("speculative_config")
        target._drafting[server.url] = None if speculative else (
            "drafts with no model: start it with --speculative-config '{\"method\": \"mtp\","
            " \"num_speculative_tokens\": 1}' (or your drafter's), or drop VLLMWeightSync(drafter=...)")
    lines = [f"{s.url}: {target._drafting[s.url]}" for s in target.servers if target._drafting[s.url]]
    return lines + _precheck(target, lambda check: check.draft_problems(exported))


def _score(server: Server, adapter: str | None, token_ids: list[int]) -> list[float]:
    """``server``'s logprob of each token of ``token_ids`` given the ones before (with ``adapter``, if loaded)."""
    model = adapter or server.model()["id"]
    body = {"model": model, "prompt": token_ids, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0,
            "cache_salt": uuid.uuid4().hex}  # never a cached prefix of older weights (keep_old_kv)
    rows = server.completions(body)["choices"][0]["prompt_logprobs"][1:]
    return [row[str(token)]["logprob"] for row, token in zip(rows, token_ids[1:])]


def _reload_paused(servers: list[Server], mode: PauseMode) -> None:
    """Every server paused, reloaded from its own checkpoint (:func:`_reload_checkpoint`) and resumed; one that fails a
    step stays paused, and the error names each."""
    failed = on_each(servers, lambda s: s.pause(mode))
    failed |= on_each([s for s in servers if s not in failed], _reload_checkpoint)
    failed |= on_each([s for s in servers if s not in failed], lambda s: s.resume())
    if failed:
        lines = "; ".join(f"{s.url}: {err}" for s, err in failed.items())
        raise ServerError(f"{len(failed)} of {len(servers)} server(s) could not reload their checkpoint and stay paused"
                          f" ({lines})", next(iter(failed)).url)


def _reload_checkpoint(server: Server) -> None:
    """``reload_weights`` of ``server`` from its own checkpoint directory, then its prefix cache reset (dev mode)."""
    server.reload_weights(server.model()["root"])
    server.reset_prefix_cache()
