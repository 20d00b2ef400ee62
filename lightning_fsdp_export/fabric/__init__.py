"""Lightning Fabric: the lazy export, weight syncs and asynchronous rollouts in a loop you write.

::

    from lightning_fsdp_export.fabric import LazyExportFSDP2, WeightSync

``LazyExportFSDP2`` here is Fabric's strategy (beside the Trainer's :class:`lightning_fsdp_export.LazyExportFSDP2`,
as ``lightning.fabric.strategies`` sits beside ``lightning.pytorch.strategies``); :class:`WeightSync` is the sync a
loop calls, and :class:`~lightning_fsdp_export.rollouts.AsyncRollouts` runs without a Trainer too.
"""

from lightning_fsdp_export.fabric.strategy import LazyExportFSDP2
from lightning_fsdp_export.fabric.sync import WeightSync
from lightning_fsdp_export.rollouts import AsyncRollouts

__all__ = ["AsyncRollouts", "LazyExportFSDP2", "WeightSync"]
