"""What one sync pushes: sources of the strategy, each paired with how the target consumes it.

``VLLMWeightSync`` chooses the kinds once per sync (:func:`plan_pushes`): ``lora="merged"`` is one
merged source; ``lora="adapter"`` is the base weights (first sync only) then the adapter; a ``drafter=`` adds its
module's source last, into the engine's draft model. Every rank builds the same list, in the same order (each pass
is a collective).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lightning_fsdp_export.export.lora import write_adapter
from lightning_fsdp_export.export.source import ExportSource, SourceLayout
from lightning_fsdp_export.sync.options import Drafter, SyncLora
from lightning_fsdp_export.targets.base import ExactCheckable, LoadsAdapters, PushesDrafts, WeightTarget
from lightning_fsdp_export.transfer.adapters import prune_versions

if TYPE_CHECKING:
    from lightning_fsdp_export.strategy_core import LazyExportCore

__all__ = ["Push", "consume", "plan_pushes", "refusals"]


@dataclass
class Push:
    """One source of this sync and its consumer (a target call)."""

    source: ExportSource
    consume: Callable[[ExportSource], None]


def plan_pushes(strategy: LazyExportCore, target: WeightTarget, *, lora: SyncLora, base_pushed: bool,
                dtype: torch.dtype | None, version: int, rank: int, adapter_dir: Callable[[], Path],
                show_progress: bool, drafter: Drafter | None = None) -> list[Push]:
    """The sources this sync pushes, in the order every rank runs them (a drafter's last).

    Args:
        strategy: the ``LazyExportFSDP2`` giving the sources.
        target: where they go.
        lora: the callback's mode, ``"merged"`` or ``"adapter"``.
        base_pushed: the engine holds the current base weights (``"adapter"`` then pushes the adapter only).
        dtype: the wire dtype.
        version: this sync's version.
        rank: this trainer rank (adapter directories are per rank).
        adapter_dir: where ``"adapter"`` writes peft directories.
        show_progress: a progress bar for long passes.
        drafter: a speculative-decoding drafter beside the policy, pushed into the engine's draft model.
    """
    def source(kind: Any) -> ExportSource:  # a shard-direct target takes every rank's own shards
        return strategy.export_source(dtype=dtype, lora=kind, show_progress=show_progress,
                                      layout=SourceLayout.FULL if kind == "adapter" else target.source_layout)

    def to_target(src: ExportSource) -> None:
        target.push_source(src, version=version)

    drafts: list[Push] = []
    if drafter is not None:
        assert isinstance(target, PushesDrafts), "VLLMWeightSync(drafter=...) refuses other targets"
        takes_drafts = target

        def to_draft(src: ExportSource) -> None:
            takes_drafts.push_draft(src, version=version)

        drafts = [Push(strategy.module_source(drafter.module, prefix=drafter.prefix, dtype=dtype,
                                              show_progress=show_progress, layout=target.source_layout), to_draft)]
    if lora is SyncLora.MERGED:
        return [Push(source("merged"), to_target), *drafts]
    assert isinstance(target, LoadsAdapters), "VLLMWeightSync(lora='adapter') refuses other targets"
    loader, module = target, strategy.export_module
    pushes = [] if base_pushed else [Push(source("base"), lambda src: loader.push_base(src, version=version))]
    return pushes + [Push(source("adapter"), lambda src: _push_adapter(src, loader, module, adapter_dir() /
                                                                       f"rank{rank}", version)), *drafts]


def _push_adapter(source: ExportSource, target: LoadsAdapters, module: Any, rank_dir: Path, version: int) -> None:
    """Write the adapter as a peft directory, load it into the engine, drop directories it no longer needs."""
    path = rank_dir / f"v{version:06d}"
    write_adapter(iter(source), module, str(path))
    target.push_adapter(path, version=version)
    prune_versions(rank_dir)


def temporary_adapter_dir() -> Path:
    """A fresh directory for adapters when the user gave none."""
    return Path(tempfile.mkdtemp(prefix="lora_sync_"))


def refusals(target: WeightTarget, kind: str, shapes: list[tuple[str, tuple[int, ...]]]) -> list[str]:
    """What ``target`` would refuse of one source of kind ``kind`` (names and full shapes), before any gather."""
    if kind == "draft":
        return target.check_draft(shapes) if isinstance(target, PushesDrafts) else []
    if kind != "adapter":
        return target.check_weights(shapes)
    return target.check_adapter(shapes) if isinstance(target, LoadsAdapters) else []


def consume(pushes: list[Push], exact: ExactCheckable | None, *, part: bool = False,
            ) -> tuple[dict[str, dict[str, str]], dict[str, dict[str, str]] | None, str | None]:
    """Every source into its target (``exact``: that engine's checksums taken and its weights zeroed first); the
    checksums, those right after the zeroing (``part``: the trainer holds part of the engine's model, else
    ``None``), and this rank's failure if any.

    Every source is drained whatever happens, so no other rank waits forever in one of its gathers.
    """
    error: BaseException | None = None
    failed_at = ""
    baseline: dict[str, dict[str, str]] = {}
    zeroed = None
    if exact is not None:
        try:
            baseline = exact.weight_checksums()
            exact.reset_weights()
            zeroed = exact.weight_checksums() if part else None
        except Exception as err:  # noqa: BLE001 - reported on every rank, after the ranks agree
            error, failed_at = err, "before the push, taking the engine's checksums or zeroing it"
    for push in pushes:
        try:
            if error is None:
                push.consume(push.source)
        except Exception as err:  # noqa: BLE001 - reported on every rank, after the ranks agree
            error, failed_at = err, push.source.where()
        finally:
            push.source.drain()
    return baseline, zeroed, None if error is None else f"{type(error).__name__}: {error} ({failed_at})"
