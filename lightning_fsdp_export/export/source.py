"""``ExportSource``: the trainer's weights as a re-iterable stream with metadata; torch only.

One object answers the two questions every consumer of a weight sync asks, in the shape of vLLM's
``WeightSource`` (``vllm.distributed.weight_transfer.base``):

* ``metadata()``: ``(name, wire dtype, full shape)`` per tensor, read from the state dict with no
  collective (an FSDP2 DTensor knows its global shape);
* ``iter(source)``: a fresh ``export_weights()`` pass, a collective generator every rank drains.

Both come in vLLM's layerwise order (:func:`layerwise_groups` flattened: embeddings, then the decoder
layers, then the rest), which for Qwen2/Llama is the state dict's own order. The source owns the live
pass: :meth:`ExportSource.drain` finishes it after a failure, so no rank is left inside a gather, and
it counts what went through (tensors, bytes, a rank-0 progress bar for long syncs).
:meth:`LazyExportFSDP2.weight_source` wraps it as a vLLM ``WeightSource`` subclass.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from lightning_fsdp_export.export.buckets import layer_key
from lightning_fsdp_export.export.checkpoint_format import CheckpointFormat
from lightning_fsdp_export.export.lazy import nonfinite

__all__ = ["ExportSource", "SourceLayout", "TensorMeta", "layerwise_groups", "layerwise_entries"]

_PROGRESS_AFTER_S = 2.0

Entries = list[tuple[list[str], Tensor]]


class SourceLayout(str, Enum):
    """How a source's tensors are cut across the trainer's ranks: the one meaning of "layout" in a sync.

    * ``FULL``: every tensor gathered whole on every rank (:class:`ExportSource`);
    * ``SHARDS``: each rank yields its own rows of every FSDP2 shard, no gather
      (:class:`~lightning_fsdp_export.export.shards.ShardSource`; fused experts as each rank's own experts'
      checkpoint pieces), for shard-direct transports;
    * ``M2N``: ``SHARDS`` within vLLM's ``nccl_m2n`` limits (split tensors and rows that do not divide by
      the ranks go whole; rows staged on the strategy's device).
    """

    FULL = "full"
    SHARDS = "shards"
    M2N = "m2n"

    @classmethod
    def parse(cls, value: SourceLayout | str, where: str = "export_source") -> SourceLayout:
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"{where}(layout={value!r}) must be one of"
                             f" {', '.join(repr(m.value) for m in cls)}.") from None


@dataclass(frozen=True)
class TensorMeta:
    """One exported tensor as it goes on the wire: vLLM's ``ParamMeta`` fields."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


def layerwise_groups(names: list[str]) -> list[list[str]]:
    """vLLM's ``layerwise_groups``, without importing vLLM: one group per decoder layer.

    Names without a layer index go to the first group (before any indexed name) or the last (after);
    stacks come out by first appearance of their prefix, then by index. ``tests/test_unit.py`` checks it
    against vLLM's own function on several architectures' names.
    """
    pre: list[str] = []
    post: list[str] = []
    stacks: dict[tuple[str, int], list[str]] = {}
    for name in names:
        key = layer_key(name)
        if key is None:
            (post if stacks else pre).append(name)
        else:
            stacks.setdefault(key, []).append(name)
    prefixes: dict[str, int] = {}
    for prefix, _ in stacks:
        prefixes.setdefault(prefix, len(prefixes))
    ordered = sorted(stacks, key=lambda key: (prefixes[key[0]], key[1]))
    return ([pre] if pre else []) + [stacks[key] for key in ordered] + ([post] if post else [])


def layerwise_entries(entries: Entries) -> Entries:
    """``entries`` reordered so their names come in flattened :func:`layerwise_groups` order.

    A tied tensor whose names land apart (an ``lm_head`` after the layers, its embedding before) becomes
    two entries of the same tensor, gathered twice; names that stay adjacent share one gather.
    """
    owner = {name: i for i, (names, _) in enumerate(entries) for name in names}
    order = [name for group in layerwise_groups(list(owner)) for name in group]
    out: Entries = []
    last = -1
    for name in order:
        i = owner[name]
        if i == last:
            out[-1][0].append(name)
        else:
            out.append(([name], entries[i][1]))
        last = i
    return out


def wire_dtype(tensor: Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype an export with ``dtype`` yields for ``tensor`` (floating tensors are cast)."""
    return dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype


class ExportSource:
    """The trainer's weights for one kind of push: metadata, fresh collective passes, drain.

    Built by :meth:`LazyExportFSDP2.export_source`; the callback and every target consume it.

    Args:
        entries: what one pass exports, ``(names, tensor)`` in layerwise order (for metadata; no collective).
        export: starts one collective pass yielding exactly those names in that order, cast to ``dtype``.
        dtype: the wire dtype of floating tensors (``None``: their own).
        show_progress: a progress bar on this rank once a pass runs longer than ~2 s.
        checkpoint_format: how each entry becomes checkpoint tensors (names, shapes), as ``export`` yields
            them; ``None``: each name as it is.
        kind: what the source holds (``"merged"``, ``"base"`` or ``"adapter"``: a LoRA mode).
    """

    def __init__(self, entries: Callable[[], Entries], export: Callable[[], Iterator[tuple[str, Tensor]]],
                 *, dtype: torch.dtype | None, show_progress: bool = False,
                 checkpoint_format: CheckpointFormat | None = None, kind: str = "merged") -> None:
        self._entries = entries
        self.kind = kind
        self._format = checkpoint_format or CheckpointFormat(None)
        self._export = export
        self.dtype = dtype
        self._show = show_progress
        self._live: Iterator[tuple[str, Tensor]] | None = None
        self._bar: Any = None
        self.tensors = 0
        self.bytes = 0
        self.last_name: str | None = None
        self.done = False
        self.expected: int | None = None
        self.passes = 0

    def metadata(self) -> Sequence[TensorMeta]:
        """``(checkpoint name, wire dtype, full shape)`` for every tensor a pass yields, in its order; no collective."""
        return [TensorMeta(piece.name, wire_dtype(tensor, self.dtype), piece.shape)
                for names, tensor in self._entries() for name in names
                for piece in self._format.pieces(name, tensor)]

    def ties(self) -> dict[str, str]:
        """Checkpoint names a pass yields with the same tensor as an earlier name (a tied head: ``lm_head.weight``
        after ``model.embed_tokens.weight``), by the later name; no collective. A consumer may send such a tensor
        once and load it under both names."""
        first: dict[int, str] = {}
        ties: dict[str, str] = {}
        for names, tensor in self._entries():
            for name in names:
                pieces = self._format.pieces(name, tensor)
                if len(pieces) != 1 or tuple(pieces[0].shape) != tuple(tensor.shape):
                    continue  # (a tensor the format splits or reshapes: its pieces are its own)
                if id(tensor) in first:
                    ties[pieces[0].name] = first[id(tensor)]
                else:
                    first[id(tensor)] = pieces[0].name
        return ties

    def pass_bytes(self) -> int:
        """Bytes of every tensor of a pass at full size, from :meth:`metadata` (what a consumer receives in all)."""
        return sum(math.prod(m.shape) * m.dtype.itemsize for m in self.metadata())

    def shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """``(name, full shape)`` of :meth:`metadata`, for the pre-checks."""
        return [(m.name, m.shape) for m in self.metadata()]

    def nonfinite(self) -> list[str]:
        """Names of the trainer's tensors whose local shard on this rank holds NaN or Inf; no collective."""
        return nonfinite(self._entries())

    def __iter__(self) -> Iterator[tuple[str, Tensor]]:
        """A fresh pass (a collective: every rank must iterate it, or :meth:`drain` it, to the end)."""
        self._finish_live()  # a pass left half-way would leave the other ranks in its gathers
        self.passes += 1
        self.tensors = self.bytes = 0
        self.last_name = None
        self.done = False
        self.expected = sum(len(self._format.pieces(name, tensor)) for names, tensor in self._entries()
                            for name in names)
        if self._show:
            self._bar = tqdm(total=self.expected, delay=_PROGRESS_AFTER_S, desc="weight sync", unit="tensor",
                             leave=False)
        live = self._count(self._export())
        self._live = live
        return live

    def _count(self, weights: Iterator[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        weights = iter(weights)
        for name, tensor in weights:
            self._counted(name, tensor)
            if self.tensors == self.expected:
                # The planned last tensor: finish the pass before handing it out, so its cleanup (a LoRA
                # unmerge, shards moved back, the report) runs even for a consumer that stops after
                # exactly the planned count, as vLLM's iter_groups() does. Exported tensors never share
                # memory with the module's, so this one stays valid.
                extra = list(weights)  # empty unless the export disagrees with its plan
                self._finish()
                yield name, tensor
                for item in extra:
                    self._counted(*item)
                    yield item
                return
            yield name, tensor
        self._finish()

    def _counted(self, name: str, tensor: Tensor) -> None:
        self.last_name = name
        self.tensors += 1
        self.bytes += tensor.numel() * tensor.element_size()
        if self._bar is not None:
            self._bar.update()

    def _finish(self) -> None:
        self.done = True
        self._close()

    def drain(self) -> None:
        """After a consumer failed: finish the live pass (its remaining gathers), or run a whole pass if
        this source never started one, so this rank ends the round having taken part in exactly the
        gathers the other ranks run. (A source reused over rounds only finishes the live pass.)"""
        if self.passes == 0:
            iter(self)
        self._finish_live()

    def _finish_live(self) -> None:
        live, self._live = self._live, None
        if live is not None:
            for _ in live:
                pass
        self._close()

    def _close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def where(self) -> str:
        """Where the last pass stood, for error messages."""
        if self.done:
            return f"after all {self.tensors} tensors were streamed"
        if self.last_name is None:
            return "before the first tensor"
        of = f" of {self.expected}" if self.expected else ""
        return f"at tensor {self.last_name!r}, {self.tensors}{of}"
