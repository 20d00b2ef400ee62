"""Where a weight sync sends the exported weights: a colocated engine, servers, a directory, memory.

A target subclasses :class:`WeightTarget` (and the capabilities it has: :class:`ScoresLogprobs`,
:class:`ExactCheckable`, :class:`LoadsAdapters`, :class:`SleepsDuringCompute`, :class:`SendsPatches`,
:class:`PushesDrafts`; see
:mod:`.base`). How a push reaches servers is the next room, :mod:`lightning_fsdp_export.transfer`; ``RemoteVLLM``'s
transports are its options objects (``Gloo(shard_direct=True)``, ``Directory(path)``), re-exported here.
"""

from lightning_fsdp_export.servers.clients import LLMClient
from lightning_fsdp_export.targets.base import (
    ExactCheckable,
    LoadsAdapters,
    PushesDrafts,
    ScoresLogprobs,
    SendsPatches,
    SleepsDuringCompute,
    WeightTarget,
)
from lightning_fsdp_export.targets.colocated import ColocatedVLLM
from lightning_fsdp_export.targets.directory import DirectoryTarget
from lightning_fsdp_export.targets.memory import InMemoryTarget
from lightning_fsdp_export.targets.remote import RemoteVLLM
from lightning_fsdp_export.targets.vision_layout import vision_layout_problem, write_vllm_layout
from lightning_fsdp_export.transfer.transports import IPC, NCCL, NCCLM2N, Directory, Gloo, SparseNCCL, StagedNCCL

__all__ = ["IPC", "NCCL", "NCCLM2N", "ColocatedVLLM", "Directory", "DirectoryTarget", "ExactCheckable", "Gloo",
           "InMemoryTarget", "LLMClient", "LoadsAdapters", "PushesDrafts", "RemoteVLLM", "ScoresLogprobs",
           "SendsPatches", "SleepsDuringCompute", "SparseNCCL", "StagedNCCL", "WeightTarget", "vision_layout_problem",
           "write_vllm_layout"]

