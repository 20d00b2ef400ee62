"""Where a weight sync sends the exported weights.

A target implements :class:`WeightTarget`. Every rank calls :meth:`WeightTarget.push` with the same
collective generator and must let it be drained (the callback drains what a target leaves).
"""

from lightning_fsdp_export.targets.base import WeightTarget
from lightning_fsdp_export.targets.colocated import ColocatedVLLM
from lightning_fsdp_export.targets.directory import DirectoryTarget, write_safetensors
from lightning_fsdp_export.targets.memory import InMemoryTarget
from lightning_fsdp_export.targets.remote import RemoteVLLM
from lightning_fsdp_export.targets.transfer import LLMClient

__all__ = ["ColocatedVLLM", "DirectoryTarget", "InMemoryTarget", "LLMClient", "RemoteVLLM", "WeightTarget",
           "write_safetensors"]
