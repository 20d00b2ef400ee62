"""Lazy FSDP2 weight export for PyTorch Lightning, streamed into vLLM for RL post-training.

Importing the package registers the ``"lazy_fsdp2"`` strategy name with Lightning. vLLM is imported
only when a vLLM target is built.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_fsdp_export.callback import VLLMWeightSync, WeightSyncError
from lightning_fsdp_export.export import ExportReport, lazy_export
from lightning_fsdp_export.names import export_name
from lightning_fsdp_export.rollouts import AsyncRollouts, RolloutBatch, RolloutError
from lightning_fsdp_export.strategy import LazyExportFSDP2
from lightning_fsdp_export.targets import ColocatedVLLM, DirectoryTarget, InMemoryTarget, RemoteVLLM, WeightTarget

__all__ = [
    "AsyncRollouts",
    "ColocatedVLLM",
    "DirectoryTarget",
    "ExportReport",
    "InMemoryTarget",
    "LazyExportFSDP2",
    "RemoteVLLM",
    "RolloutBatch",
    "RolloutError",
    "VLLMWeightSync",
    "WeightSyncError",
    "WeightTarget",
    "export_name",
    "lazy_export",
]
__version__ = "0.1.0"

LazyExportFSDP2.register_strategies(StrategyRegistry)
