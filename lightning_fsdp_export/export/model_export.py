"""The export side of the strategy: the exported model, its checkpoint format, and sources of its weights.

:class:`ModelExport` answers, for the model the strategy found at setup, "give me the weights of kind K"
with an :class:`~lightning_fsdp_export.export.source.ExportSource` (metadata without a collective, a fresh
collective pass per iteration). The kinds are the LoRA modes, chosen once per source:

- ``"merged"``: every base weight in checkpoint format; for a peft model with its adapters merged (the
  staged path: the shards are loaded on the device first, then restored exactly);
- ``"base"``: a peft model's base weights without adapters;
- ``"adapter"``: only a peft model's adapter tensors, under peft's file names.

Of the compute phases it knows only "load the shards for me" (``stage``/``unstage``, for the staged path);
it knows nothing of vLLM (``weight_source()`` imports the vLLM view lazily).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from lightning_fsdp_export.export.checkpoint_format import CheckpointFormat
from lightning_fsdp_export.export.lazy import ExportReport, lazy_export
from lightning_fsdp_export.export.lora import (
    LoraMode,
    check_adapters_loadable,
    entries_for,
    is_peft_model,
    parse_lora_mode,
    staged_merged_export,
)
from lightning_fsdp_export.export.shards import Layout, ShardSource, row_bounds, shard_export, trainer_world
from lightning_fsdp_export.export.source import Entries, ExportSource, SourceLayout, layerwise_entries

__all__ = ["ModelExport"]


class ModelExport:
    """Exports of one model (found at setup) in every kind; owned by ``LazyExportFSDP2``.

    Args:
        name: the strategy's class name, for error messages.
        bucket_bytes: as ``LazyExportFSDP2(export_bucket_bytes=)``.
        prefetch: as ``LazyExportFSDP2(export_prefetch=)``.
        device: where tensors are staged and gathered by default (the strategy's ``root_device``).
        stage: loads offloaded shards on the device, returning whether it moved them (staged LoRA path).
        unstage: puts them back (called only when ``stage`` moved them).
    """

    def __init__(self, name: str, *, bucket_bytes: int, prefetch: int, device: Callable[[], torch.device],
                 stage: Callable[[], bool], unstage: Callable[[], None]) -> None:
        for option, value, what in (("export_bucket_bytes", bucket_bytes, "0 (no buckets) or a positive number of"
                                     " bytes"), ("export_prefetch", prefetch, "0 (no overlap) or a positive number"
                                                 " of all-gathers to keep in flight")):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name}({option}={value!r}) must be {what}.")
        self.name = name
        self.bucket_bytes = bucket_bytes
        self.prefetch = prefetch
        self._device = device
        self._stage = stage
        self._unstage = unstage
        self._module: nn.Module | None = None
        self._error: ValueError | None = None
        self._format: CheckpointFormat | None = None
        self._prefix = ""
        self.last: ExportReport | None = None

    def bind(self, module: nn.Module | None, error: ValueError | None, *, prefix: str = "",
             checkpoint_format: CheckpointFormat | None = None) -> None:
        """The model found at setup (or why there is none: raised once something exports). A module that is part of
        a larger model (a drafter beside the policy): ``prefix`` goes before each of its names, and
        ``checkpoint_format`` (the larger model's) converts the names so made (default: the module's own,
        :meth:`CheckpointFormat.of`)."""
        self._module, self._error, self._format, self._prefix = module, error, checkpoint_format, prefix

    @property
    def module(self) -> nn.Module:
        if self._error is not None:
            raise ValueError(str(self._error))
        if self._module is None:
            raise RuntimeError(
                f"{self.name}.export_weights() was called before the strategy was set up. Call it from a hook that"
                " runs during fit/validate (for instance `on_train_batch_end`), not before `trainer.fit`."
            )
        return self._module

    @property
    def checkpoint_format(self) -> CheckpointFormat:
        if self._format is None:
            self._format = CheckpointFormat.of(self.module)
        return self._format

    def kind(self, lora: str) -> LoraMode:
        """Validate a ``lora=`` argument against the model (modes other than ``"merged"`` need peft)."""
        mode = parse_lora_mode(lora)
        if mode != "merged" and not is_peft_model(self.module):
            raise ValueError(
                f"export_weights(lora={lora!r}) needs a peft model, but {type(self.module).__name__} has no"
                " adapters; call it without `lora`."
            )
        return mode

    def weights(self, mode: LoraMode, *, dtype: torch.dtype | None, device: torch.device | str | None = None,
                reorder: Callable[[Entries], Entries] | None = None) -> Iterator[tuple[str, Tensor]]:
        """One collective export pass of kind ``mode``; ``reorder`` rearranges the planned entries first."""
        module = self.module
        fmt = self._format_for(mode)
        target = torch.device(device) if device is not None else self._device()
        if mode == "merged" and is_peft_model(module):  # plans its entries after merging
            return staged_merged_export(module, device=target, dtype=dtype, stage=self._stage, unstage=self._unstage,
                                        on_finish=self._record, bucket_bytes=self.bucket_bytes,
                                        prefetch=self.prefetch, reorder=reorder, checkpoint_format=fmt)
        entries = self._entries(mode)
        return lazy_export(module, device=target, dtype=dtype, on_finish=self._record,
                           entries=reorder(entries) if reorder else entries, bucket_bytes=self.bucket_bytes,
                           prefetch=self.prefetch, checkpoint_format=fmt)

    def source(self, mode: LoraMode, *, dtype: torch.dtype | None, show_progress: bool = False,
               kind: str | None = None) -> ExportSource:
        """The weights of kind ``mode`` as a re-iterable source, in vLLM's layerwise order (``kind``: what the
        source says it is, default ``mode``; a drafter's is ``"draft"``)."""
        return ExportSource(lambda: layerwise_entries(self._entries(mode)),
                            lambda: self.weights(mode, dtype=dtype, reorder=layerwise_entries),
                            dtype=dtype, show_progress=show_progress, checkpoint_format=self._format_for(mode),
                            kind=kind or mode)

    def shard_source(self, mode: LoraMode, *, dtype: torch.dtype | None, even: bool = False,
                     device: torch.device | str | None = None, show_progress: bool = False,
                     kind: str | None = None) -> ShardSource:
        """The weights of kind ``mode`` for a shard-direct consumer (:mod:`~lightning_fsdp_export.export.shards`).

        ``even=True`` sends uneven shards whole (vLLM's ``nccl_m2n`` needs rows that divide by the ranks);
        ``device`` is where each rank's rows are yielded (``None``: where the shard lives). A peft model
        merged with its adapters goes through the staged merge, every tensor whole.
        """
        module = self.module
        fmt = self._format_for(mode)
        _, world = trainer_world()
        merged_peft = mode == "merged" and is_peft_model(module)

        def layout(names: list[str], tensor: Tensor) -> Layout:
            return None if merged_peft else row_bounds(names, tensor, fmt, world, even=even)

        def export() -> Iterator[tuple[str, Tensor]]:
            if merged_peft:
                return self.weights(mode, dtype=dtype, reorder=layerwise_entries)
            return shard_export(layerwise_entries(self._entries(mode)), fmt=fmt, dtype=dtype, layout=layout,
                                device=device, gather_device=self._device(), on_finish=self._record)

        return ShardSource(lambda: layerwise_entries(self._entries(mode)), export, layout=layout, world=world,
                           dtype=dtype, show_progress=show_progress, checkpoint_format=fmt, kind=kind or mode)

    def source_for(self, mode: LoraMode, layout: SourceLayout, *, dtype: torch.dtype | None,
                   device: torch.device | str | None, show_progress: bool = False,
                   kind: str | None = None) -> ExportSource:
        """The source of kind ``mode`` in ``layout``; ``M2N`` rows are staged on ``device`` (the strategy's);
        ``kind``: what the source says it is (default ``mode``)."""
        if layout is SourceLayout.FULL:
            return self.source(mode, dtype=dtype, show_progress=show_progress, kind=kind)
        m2n = layout is SourceLayout.M2N
        return self.shard_source(mode, dtype=dtype, even=m2n, device=device if m2n else None,
                                 show_progress=show_progress, kind=kind)

    def weight_source(self, mode: LoraMode, layout: SourceLayout, *, dtype: torch.dtype | None,
                      device: torch.device | str | None) -> Any:
        """:meth:`source_for` as a vLLM ``WeightSource`` (``M2N``: its ``M2NWeightSource``); imports vLLM."""
        from lightning_fsdp_export.export.vllm_source import FSDP2M2NSource, FSDP2WeightSource

        source = self.source_for(mode, layout, dtype=dtype, device=device)
        if layout is SourceLayout.M2N:
            assert isinstance(source, ShardSource)  # (source_for gives each rank's rows in any layout but FULL)
            return FSDP2M2NSource(source)
        return FSDP2WeightSource(source)

    def _format_for(self, mode: str) -> CheckpointFormat:
        """Adapters go out under peft's file names, untouched; base weights in checkpoint format."""
        return CheckpointFormat(None) if mode == "adapter" else self.checkpoint_format

    def _entries(self, mode: LoraMode) -> Entries:
        """The planned entries of an export of kind ``mode``; adapters vLLM could not load are refused here."""
        entries = entries_for(self.module, mode)
        if self._prefix:
            entries = [([self._prefix + name for name in names], tensor) for names, tensor in entries]
        if mode == "adapter":
            check_adapters_loadable(entries_for(self.module, "base"), entries, self.checkpoint_format)
        return entries

    def _record(self, report: ExportReport) -> None:
        self.last = report
