"""Lazy FSDP2 weight export for PyTorch Lightning, streamed into vLLM for RL post-training.

Importing the package registers the ``"lazy_fsdp2"`` strategy name with Lightning's Trainer and with Fabric (each
its own ``LazyExportFSDP2``). vLLM is imported only when a vLLM target is built.
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from lightning_fsdp_export._common import EngineNotRestored, WeightSyncError
from lightning_fsdp_export.export import ExportReport, export_name, lazy_export
from lightning_fsdp_export.fabric import strategy as _fabric_strategy
from lightning_fsdp_export.rollouts import AsyncRollouts, RolloutBatch, RolloutError
from lightning_fsdp_export.strategy import LazyExportFSDP2
from lightning_fsdp_export.sync.callback import VLLMWeightSync
from lightning_fsdp_export.sync.options import Drafter
from lightning_fsdp_export.targets import ColocatedVLLM, DirectoryTarget, InMemoryTarget, RemoteVLLM, WeightTarget

__all__ = [
    "AsyncRollouts",
    "ColocatedVLLM",
    "DirectoryTarget",
    "Drafter",
    "EngineNotRestored",
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
_fabric_strategy.LazyExportFSDP2.register_strategies(FABRIC_STRATEGY_REGISTRY)
