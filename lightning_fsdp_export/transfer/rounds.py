"""The kinds of round, one small class each: what a round sends and what rank 0 tells each server after it. The
steps every round goes through are :class:`~lightning_fsdp_export.transfer.pipeline.RoundRun`'s.

- :class:`DenseRound`: the model's weights through the transport's engine (whole from rank 0, or every rank's rows);
- :class:`PatchRound`: the same through our gloo engine with this rank's copy: parts whole or patched (sparse rounds);
- :class:`PatchListRound`: vLLM 0.33's ``sparse_nccl`` engine, fed lists of patches rank 0 collects;
- :class:`AdapterRound`: a peft adapter's tensors through our gloo engine, written by the workers on their hosts,
  then loaded by every server under one name;
- :class:`DraftRound`: a speculative-decoding drafter's tensors through our gloo engine into each server's draft
  model;
- :class:`StagedRound` / :class:`StagedPatchRound` (``Gloo(background=True)``): the dense or sparse round received by
  the workers into a staging area while the servers go on generating; only the swap (load from the staging, set the
  version) runs under the pause, and a failed transfer leaves every server serving the previous version, unpaused.

A transport names the kinds it runs (``NetworkTransport.weights_round`` / ``adapter_round``, a ``RoundKind``);
:func:`round_for` builds the round of a push. A new kind of round is one class here and its entry in ``ROUNDS``. A
round gets what it reads as a :class:`RoundInputs` (engine, source, rank, copies, client, control group, the
transport) and returns a :class:`RoundResult`; what it hands our gloo engine is ``inputs.payload(...)`` (the
transport's ``backend.trainer.GlooRound``, the round's source included) as the argument of ``send_weights``, never
state set on the engine, and it imports nothing of the backend.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from typing_extensions import override

from lightning_fsdp_export._common import SyncGroup
from lightning_fsdp_export._compat import source_metadata
from lightning_fsdp_export._faults import fault, hold_at
from lightning_fsdp_export.backend.shared import PauseMode
from lightning_fsdp_export.export.patches import PatchBase
from lightning_fsdp_export.export.shards import ShardSource
from lightning_fsdp_export.servers.http import Server, ServerError
from lightning_fsdp_export.servers.pauses import load_adapter, reset_prefix_caches, set_versions
from lightning_fsdp_export.transfer.patch_lists import DEFAULT_CHUNK_BYTES, send_patch_lists
from lightning_fsdp_export.transfer.transports import NetworkTransport, RoundKind, SparseNCCL

__all__ = ["ROUNDS", "AdapterRound", "DenseRound", "DraftRound", "PatchListRound", "PatchRound", "Round",
           "RoundInputs", "RoundKind", "RoundResult", "Staged", "StagedPatchRound", "StagedRound",
           "round_for", "send_dense", "swap_on_server",
           "swap_staged"]


@dataclass(frozen=True)
class RoundInputs:
    """What a round reads, handed to it by the pipeline (:class:`~lightning_fsdp_export.transfer.pipeline.RoundRun`)
    for one push; a round never reaches into the transfer group.

    Attributes:
        transport: the transport's options; it builds our backend's per-round payload (``transport.payload``) and
            a swap's update info (``transport.swap_info``).
        engine: this rank's trainer engine (vLLM's, or our backend's), iterating ``source``.
        source: this round's vLLM ``WeightSource``; ``source.export`` is the push's source.
        rank: this trainer rank.
        patches: this rank's copy of what it last sent (sparse rounds), else ``None``.
        kept: the id of the copy the workers keep (``None``: none; only rank 0's is sent).
        client: rank 0's client of the servers (vLLM's four routes).
        control: the trainer ranks' gloo group (every rank joining, or patch lists), else ``None``.
    """

    transport: NetworkTransport
    engine: Any
    source: Any
    rank: int
    patches: PatchBase | None = None
    kept: str | None = None
    client: Any = None
    control: SyncGroup | None = None

    def payload(self, **fields: Any) -> Any:
        """Our backend's ``send_weights`` argument for this round: ``fields`` and this round's source (``transport.
        payload``; only a transport that ``takes_rounds`` has one)."""
        return self.transport.payload(source=self.source, **fields)


@dataclass(frozen=True)
class RoundResult:
    """What a round produced on this rank.

    Attributes:
        patch: with sparse rounds on: ``sparse`` (patched or dense), what it sent and would have sent dense of its
            parts, elements and changed elements, its copy's host bytes (set even when the round failed).
    """

    patch: dict[str, Any] | None = None


class Round(ABC):
    """One push's round through a ``NativeTransfer``: what is sent, and what rank 0 tells each server after it."""

    kind: ClassVar[RoundKind]
    pauses_for_data: ClassVar[bool] = True
    """The servers pause before the data travels (the model is loaded as it arrives); ``False``: they pause only for
    :meth:`on_server` (a staged round: the data goes to a staging area while they generate)."""

    def __init__(self) -> None:
        self.result = RoundResult()
        """What :meth:`run` produced on this rank, also after it raised."""

    def plan_key(self, inputs: RoundInputs) -> str | None:
        """What a sparse round's copies must have been made for (the source's metadata); ``None``: no copies."""
        return None

    def client_version(self, version: int) -> str | None:
        """The version the servers' ``finish_weight_update`` sets (``None``: set later, or not at all)."""
        return str(version)

    @abstractmethod
    def run(self, inputs: RoundInputs, *, version: int, sparse: bool) -> RoundResult:
        """Every rank of the group: send this round's data (``inputs.source.export``); what it produced."""

    def on_server(self, server: Server, inputs: RoundInputs, *, version: int, mode: PauseMode) -> None:
        """Rank 0, after the data went through, on each server (concurrently; the frame resumes the servers this
        succeeded on and names the others): the server drops its prefix cache (old weights' KV)."""
        reset_prefix_caches([server], mode)

    def succeeded(self, inputs: RoundInputs) -> str | None:
        """Every rank, after a round that succeeded everywhere: keep what it made (a sparse round's copy); the id of
        the copy the workers keep now."""
        return inputs.kept


class DenseRound(Round):
    """The model's weights through the transport's engine, whole from rank 0 or each rank's rows (shard-direct)."""

    kind = RoundKind.DENSE

    @override
    def run(self, inputs: RoundInputs, *, version: int, sparse: bool) -> RoundResult:
        send_dense(inputs)
        return self.result


class AdapterRound(Round):
    """A peft adapter's tensors through our gloo engine: the workers write them as a peft directory at ``server_dir``
    on their hosts, then every server loads it as ``name`` (in place) and reports ``version``."""

    kind = RoundKind.ADAPTER

    def __init__(self, *, name: str, config: str, server_dir: str) -> None:
        super().__init__()
        self.name, self.config, self.server_dir = name, config, server_dir

    @override
    def client_version(self, version: int) -> str | None:
        return None  # the base round set the servers' version; this round's is set once the adapter is loaded

    @override
    def run(self, inputs: RoundInputs, *, version: int, sparse: bool) -> RoundResult:
        payload = inputs.payload(adapter=(self.server_dir, self.config))
        inputs.engine.send_weights(payload)
        return self.result

    @override
    def on_server(self, server: Server, inputs: RoundInputs, *, version: int, mode: PauseMode) -> None:
        load_adapter([server], self.name, self.server_dir)
        super().on_server(server, inputs, version=version, mode=mode)
        set_versions([server], version)


class DraftRound(Round):
    """A speculative-decoding drafter's tensors through our gloo engine into each server's draft model (vLLM's
    ``/start_draft_weight_update`` session), dense, in a round of its own after the policy's; the workers' copy of the
    policy (sparse rounds) is left as it is. The servers report the version the policy's round set."""

    kind = RoundKind.DRAFT

    @override
    def run(self, inputs: RoundInputs, *, version: int, sparse: bool) -> RoundResult:
        inputs.engine.send_weights(inputs.payload(draft=True))
        return self.result


class _CopyRound(Round):
    """A round that goes through this rank's copy (``inputs.patches``): patches against it where every rank holds the
    version the servers serve (``sparse``), else whole parts and a new copy; the copy is kept only if the round
    succeeds everywhere, under an id the workers keep theirs by."""

    def __init__(self) -> None:
        super().__init__()
        self._keep = uuid.uuid4().hex
        self._key: str | None = None

    @override
    def plan_key(self, inputs: RoundInputs) -> str | None:
        self._key = repr(source_metadata(inputs.source))
        return self._key

    @override
    def run(self, inputs: RoundInputs, *, version: int, sparse: bool) -> RoundResult:
        patches = inputs.patches
        assert patches is not None
        patches.start(version, self._key, sparse=sparse)
        sent = 0
        try:
            sent = self.send(inputs, inputs.kept if sparse else None)
        finally:
            self.result = RoundResult(patch={"sparse": sparse, "sent_bytes": sent, "copy_bytes": patches.nbytes,
                                             **patches.stats.as_dict()})
        return self.result

    @abstractmethod
    def send(self, inputs: RoundInputs, patch_of: str | None) -> int:
        """Send every part through the copy (patching ``patch_of``, the workers' copy; ``None``: dense); bytes sent."""

    @override
    def succeeded(self, inputs: RoundInputs) -> str | None:
        assert inputs.patches is not None
        inputs.patches.succeeded()
        return self._keep


class PatchRound(_CopyRound):
    """Our gloo engine takes each part through the copy itself: whole, or a patch by index or by bitmap."""

    kind = RoundKind.PATCHES

    @override
    def send(self, inputs: RoundInputs, patch_of: str | None) -> int:
        payload = inputs.payload(patches=inputs.patches, patch_of=patch_of, keep_as=self._keep)
        return int(inputs.engine.send_weights(payload))


class PatchListRound(_CopyRound):
    """vLLM's ``sparse_nccl`` engine takes lists of patches: every rank takes its parts through its copy, rank 0
    collects them over the control group a chunk at a time and hands them to the engine."""

    kind = RoundKind.PATCH_LISTS

    @override
    def send(self, inputs: RoundInputs, patch_of: str | None) -> int:
        source, transport = inputs.source.export, inputs.transport
        assert isinstance(source, ShardSource) and isinstance(transport, SparseNCCL)
        assert inputs.patches is not None and inputs.control is not None
        return send_patch_lists(inputs.engine, inputs.client, source, inputs.patches, inputs.control,
                                rank=inputs.rank, chunk_bytes=transport.chunk_bytes or DEFAULT_CHUNK_BYTES,
                                device=_sender_device())


class Staged(Round):
    """A round whose data the workers stage while the servers generate (our gloo engine's ``stage_as``); then every
    server swaps it in: on its own where it has our swap route (:meth:`swap`), else under rank 0's pause
    (:func:`swap_staged`)."""

    pauses_for_data = False

    def __init__(self) -> None:
        super().__init__()
        self.stage_id = uuid.uuid4().hex

    @override
    def client_version(self, version: int) -> str | None:
        return None  # the staging sets nothing; each server's swap sets the version

    @override
    def on_server(self, server: Server, inputs: RoundInputs, *, version: int, mode: PauseMode) -> None:
        swap_staged(server, inputs.transport.swap_info(self.stage_id), version, mode)

    def swap(self, server: Server, inputs: RoundInputs, *, version: int, mode: PauseMode, own: bool) -> float:
        """Rank 0, the data staged at every server, nothing paused: ``server`` swaps it in and serves again; its
        paused seconds. ``own``: the server runs the whole swap itself (``POST /lfe/swap``: check, pause, load, label,
        prefix-cache reset, resume; a trainer that dies meanwhile changes nothing); else rank 0 drives the steps."""
        fault("staged")
        if own:
            return swap_on_server(server, inputs.transport, self.stage_id, version, mode)
        start = time.monotonic()
        server.pause(mode)
        swap_staged(server, inputs.transport.swap_info(self.stage_id), version, mode)
        server.resume()
        return time.monotonic() - start


class StagedRound(Staged, DenseRound):
    """The model's weights (whole from rank 0, or every rank's rows), staged by the workers, then swapped in."""

    kind = RoundKind.STAGED

    @override
    def run(self, inputs: RoundInputs, *, version: int, sparse: bool) -> RoundResult:
        inputs.engine.send_weights(inputs.payload(stage_as=self.stage_id))
        return self.result


class StagedPatchRound(Staged, PatchRound):
    """A sparse round staged: the workers patch the host copy they keep (or take a new one) while the servers
    generate; the swap loads from that copy."""

    kind = RoundKind.STAGED_PATCHES

    @override
    def send(self, inputs: RoundInputs, patch_of: str | None) -> int:
        payload = inputs.payload(patches=inputs.patches, patch_of=patch_of, keep_as=self._keep, stage_as=self.stage_id)
        return int(inputs.engine.send_weights(payload))


def send_dense(inputs: RoundInputs) -> None:
    """Every rank of the group: a dense round of ``inputs.source`` through this rank's engine: handed to ours with the
    round (``transport.takes_rounds``), or read by vLLM's from the source it holds (set by the pipeline)."""
    if inputs.transport.takes_rounds:
        inputs.engine.send_weights(inputs.payload())
    else:
        inputs.engine.send_weights()


ROUNDS: dict[RoundKind, type[Round]] = {RoundKind.DENSE: DenseRound, RoundKind.PATCHES: PatchRound,
                                        RoundKind.PATCH_LISTS: PatchListRound, RoundKind.ADAPTER: AdapterRound,
                                        RoundKind.STAGED: StagedRound, RoundKind.STAGED_PATCHES: StagedPatchRound,
                                        RoundKind.DRAFT: DraftRound}
"""Each kind's class: what a transport's ``weights_round`` / ``adapter_round`` / ``draft_round`` names."""


def round_for(kind: RoundKind, **arguments: Any) -> Round:
    """A fresh round of ``kind`` (an adapter round takes ``name``, ``config``, ``server_dir``)."""
    return ROUNDS[kind](**arguments)


def swap_staged(server: Server, update_info: dict[str, Any], version: int, mode: PauseMode) -> None:
    """Rank 0, the server paused: it loads the round its workers staged (``update_info``: the transport's
    ``swap_info``) and reports ``version``, then drops its prefix cache. A failed load is closed on the server (its
    model may be half-loaded: it stays paused)."""
    server.start_update()
    try:
        server.update(update_info)
    except ServerError:
        with contextlib.suppress(ServerError):  # a worker that failed closed its reload already
            server.finish_update()
        raise
    server.finish_update(str(version))
    reset_prefix_caches([server], mode)


def swap_on_server(server: Server, transport: NetworkTransport, stage_id: str, version: int, mode: PauseMode) -> float:
    """``server`` swaps in the round staged as ``stage_id`` on its own (``POST /lfe/swap``,
    :mod:`lightning_fsdp_export.backend.server_swap`) and reports ``version``; its paused seconds. Raises a
    :class:`ServerError` saying whether the server still serves the version it served or stays paused (a load that
    failed inside the model)."""
    body = {"update_info": transport.swap_info(stage_id), "check_info": transport.swap_info(stage_id, check_only=True),
            "version": str(version), "pause_mode": mode, "hold_at": hold_at()}
    answer = server.swap(body, sent=lambda: fault("swap_sent"))
    if not answer.get("ok"):
        left = ("stays paused until the next full push (its model may be half-loaded)" if answer.get("paused")
                else "never paused: it serves the version it served")
        raise ServerError(f"vLLM server {server.url} could not swap in version {version}: {answer.get('error')};"
                          f" it {left}.", server.url)
    return float(answer.get("paused_s") or 0.0)


def _sender_device() -> torch.device | None:
    """Where rank 0 stages the patches it broadcasts: its current CUDA device (vLLM's NCCL needs it), else the host."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
