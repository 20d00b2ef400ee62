"""vLLM's ``sparse_nccl`` engine under ``RemoteVLLM``: every sync a list of patches in checkpoint coordinates.

vLLM 0.33's sparse engine (``vllm.distributed.weight_transfer.sparse_nccl_engine``, GPU) takes no
``WeightSource``: its trainer engine broadcasts lists of ``SparseWeightPatch(name, indices, values, full_shape)``
(flat int32 indices into the full checkpoint tensor) from trainer rank 0, and its workers apply them in place
through the model's own loaders (tensor-parallel shards and packed parameters included; no reload). There is no
dense mode: a dense round is a patch of every element.

:func:`send_patch_lists` makes those lists from a shard-direct pass. Each rank takes its own part of each tensor
(its rows; rank 0 also what goes whole) through its :class:`~lightning_fsdp_export.export.patches.PatchBase` (the
elements that changed since the confirmed version, or every element in a dense round), offsets the indices to the
full tensor, and rank 0 collects the patches (never the weights) over the trainer ranks' gloo control group, a
chunk of tensors at a time, and sends each chunk inside one update (``send_weight_chunk`` between the client's
``start_weight_update`` and ``finish_weight_update``). Before each chunk every rank learns whether any rank failed
(its own export, or rank 0's send), so a failure ends the round on every rank at the same point.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from lightning_fsdp_export._common import SyncGroup
from lightning_fsdp_export.export.patches import INDEX_DTYPE, PatchBase
from lightning_fsdp_export.export.shards import ShardMeta, ShardSource

__all__ = ["DEFAULT_CHUNK_BYTES", "send_patch_lists"]

DEFAULT_CHUNK_BYTES = 256 * 1024 * 1024  # full-size bytes of the tensors whose patches one collect carries
_MAX_INDEX = torch.iinfo(INDEX_DTYPE).max


def send_patch_lists(engine: Any, client: Any, source: ShardSource, patches: PatchBase, control: SyncGroup, *,
                     rank: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES, device: torch.device | None = None) -> int:
    """One round of ``source`` as patch lists (every rank calls it; rank 0 sends); the bytes rank 0 sent.

    ``patches`` must have been started for this round (``sparse``: patches against its copy; else every element).
    ``engine`` is vLLM's sparse trainer engine on rank 0 (``send_weight_chunk``), ``client`` the servers' client.
    """
    meta = source.metadata()
    pairs = iter(source)
    sent = 0
    failure: str | None = None  # rank 0: its send failed; told to every rank at the next exchange
    started = False
    for chunk in [*_chunks(meta, chunk_bytes), []]:  # the last, empty exchange reports the last chunk's send
        mine: list[tuple[Tensor, Tensor] | None] = []
        error = failure
        if error is None:
            try:
                mine = [_local_patch(want, _next(pairs, want, rank), patches, rank) for want in chunk]
            except Exception as err:  # noqa: BLE001 - every rank learns of it just below
                error = f"trainer rank {rank}: {type(err).__name__}: {err}"
        errors = [e for e in control.gather(error) if e is not None]
        if errors:
            raise RuntimeError("sparse_nccl round failed: " + "; ".join(errors))
        if not chunk:
            break
        collected = control.collect(mine)
        if rank != 0:
            continue
        try:
            if not started:
                client.start_weight_update()
                started = True
            batch = _merged(chunk, collected or [], device)
            if batch:
                engine.send_weight_chunk(batch)
                sent += sum(p.indices.numel() * 4 + p.values.numel() * p.values.element_size() for p in batch)
        except Exception as err:  # noqa: BLE001 - reported on every rank at the next exchange
            failure = f"trainer rank 0 sending to the servers: {type(err).__name__}: {err}"
    if rank == 0:
        if not started:
            client.start_weight_update()
        client.finish_weight_update()
    return sent


def _chunks(meta: list[ShardMeta], chunk_bytes: int) -> Iterator[list[ShardMeta]]:
    chunk: list[ShardMeta] = []
    total = 0
    for want in meta:
        chunk.append(want)
        total += math.prod(want.shape) * want.dtype.itemsize
        if total >= chunk_bytes:
            yield chunk
            chunk, total = [], 0
    if chunk:
        yield chunk


def _next(pairs: Iterator[tuple[str, Tensor]], want: ShardMeta, rank: int) -> Tensor:
    name, tensor = next(pairs)
    if name != want.name or tensor.dtype != want.dtype:
        raise ValueError(f"the shard source yielded {name!r} {tensor.dtype} on trainer rank {rank} where its metadata"
                         f" declared {want.name!r} {want.dtype}; the two must agree.")
    return tensor


def _local_patch(want: ShardMeta, part: Tensor, patches: PatchBase, rank: int) -> tuple[Tensor, Tensor] | None:
    """This rank's patch of ``want`` in full-tensor flat coordinates (int32 indices, values), or ``None`` (no part)."""
    if want.bounds is None:
        if rank != 0:
            return None  # every rank holds it whole; rank 0's copy is the one sent
        start = 0
    else:
        start = want.bounds[rank] * math.prod(want.shape[1:])
    if not part.numel():
        return None
    numel = math.prod(want.shape)
    if numel - 1 > _MAX_INDEX:
        raise ValueError(f"{want.name!r} {list(want.shape)} has {numel} elements: vLLM's sparse_nccl indexes a tensor"
                         " with int32; use Gloo(shard_direct=True, sparse=True) for this model.")
    patch = patches.take(want.name, part)
    if patch is None:  # dense (this round, or this part): every element (collecting and joining copy the values)
        host = part.detach().to("cpu").reshape(-1)
        return torch.arange(start, start + host.numel(), dtype=INDEX_DTYPE), host
    assert patch.indices is not None, "PatchBase(bitmaps=False) for vLLM's SparseWeightPatch (indices only)"
    return patch.indices + start, patch.values


def _merged(chunk: list[ShardMeta], collected: list[list[tuple[Tensor, Tensor] | None]],
            device: torch.device | None) -> list[Any]:
    """vLLM's ``SparseWeightPatch`` per tensor of ``chunk`` with any change, every rank's pieces joined."""
    from vllm.distributed.weight_transfer.sparse_nccl_engine import SparseWeightPatch

    out = []
    for i, want in enumerate(chunk):
        pieces = [piece for ranks in collected if (piece := ranks[i]) is not None]
        if not pieces or not any(p[0].numel() for p in pieces):
            continue  # nothing changed
        indices = torch.cat([p[0] for p in pieces])
        values = torch.cat([p[1] for p in pieces])
        if device is not None:
            indices, values = indices.to(device), values.to(device)
        out.append(SparseWeightPatch(want.name, indices, values, tuple(want.shape)))
    return out
