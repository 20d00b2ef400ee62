"""``VLLMWeightSync``'s mode options, parsed once in its ``__init__`` and passed on typed.

Each mode is a ``StrEnum``: users keep passing the strings (``lora="adapter"``), a member still compares equal to its
string, and a wrong value fails at construction with a ``ValueError`` listing the accepted ones. :class:`Drafter`
names a speculative-decoding drafter the sync pushes too (``drafter=``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, TypeVar

__all__ = ["Drafter", "OnError", "SyncLora", "Verify", "WhenBusy", "parse_option"]


class SyncLora(str, Enum):
    """``lora=``: what a sync of a peft model pushes."""

    MERGED = "merged"
    """The base weights with the adapters merged (the staged path)."""
    ADAPTER = "adapter"
    """The base weights on the first sync only, then the adapter alone, loaded as a LoRA."""

    def __str__(self) -> str:
        return self.value


class OnError(str, Enum):
    """``on_error=``: what a failed sync does."""

    RAISE = "raise"
    """Every rank raises ``WeightSyncError``: the fit stops."""
    WARN = "warn"
    """Every rank warns and trains on; the next sync pushes every tensor again."""

    def __str__(self) -> str:
        return self.value


class Verify(str, Enum):
    """``verify=``: the check after each sync (``None``: none)."""

    LOGPROBS = "logprobs"
    """Score a fixed probe with the engine and with the trainer's model; they must agree within the tolerance."""

    def __str__(self) -> str:
        return self.value


class WhenBusy(str, Enum):
    """``when_busy=``: what a sync does while the previous version still travels in the background (a target that
    ``pushes_in_background``)."""

    WAIT = "wait"
    """Wait for it (its failure raises, or warns, as a sync's), then push."""
    SKIP = "skip"
    """Push nothing this time and count it (``skipped``); the next trigger tries again. The ranks agree first."""

    def __str__(self) -> str:
        return self.value


E = TypeVar("E", bound=Enum)


def parse_option(kind: type[E], value: Any, name: str, owner: str = "VLLMWeightSync") -> E:
    """``value`` as a member of ``kind``, or a ``ValueError`` naming the option, the value and the accepted ones."""
    try:
        return kind(value)
    except ValueError:
        accepted = ", ".join(repr(member.value) for member in kind)
        raise ValueError(f"{owner}({name}={value!r}) must be one of {accepted}.") from None


@dataclass(frozen=True)
class Drafter:
    """``drafter=``: a speculative-decoding drafter the LightningModule trains beside the policy, which every sync also
    pushes into the engine's draft model (vLLM's ``speculative_config``: GLM-4.5's or DeepSeek-V3's MTP layer, ...).

    Args:
        module: where it is in the LightningModule (or Fabric's module): an attribute path such as ``"mtp"`` or
            ``"heads.mtp"``. It is exported as the policy is (FSDP2 shards gathered one tensor at a time).
        prefix: put before each of its parameter names to name it as the engine's checkpoint does (GLM-4.5's and
            DeepSeek-V3's MTP layer ``N``, ``N`` the number of decoder layers: ``"model.layers.N."``). The names
            it gives must be the checkpoint's drafter tensors, or the sync is refused before any gather.
    """

    module: str
    prefix: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.module, str) or not self.module or self.module.startswith(".") \
                or self.module.endswith("."):
            raise ValueError(f"Drafter(module={self.module!r}) must name a submodule of the LightningModule by its"
                             " attribute path, e.g. 'mtp' or 'heads.mtp'.")
        if not isinstance(self.prefix, str):
            raise TypeError(f"Drafter(prefix={self.prefix!r}) must be a string such as 'model.layers.46.'.")
