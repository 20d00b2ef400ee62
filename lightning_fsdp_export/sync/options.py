"""A sync's options, declared once (:class:`SyncOptions`) and parsed once into typed values.

The Trainer's ``VLLMWeightSync`` and Fabric's ``WeightSync`` take them as plain keyword arguments (their signatures
list exactly these names and defaults: ``tests/test_unit.py`` checks it) and hand them on whole
(``SyncOptions.of(locals(), owner)``) to the :class:`~lightning_fsdp_export.sync.engine.SyncEngine` both hold. Each
mode is a ``StrEnum``: users keep passing the strings (``lora="adapter"``), a member still compares equal to its
string, and a wrong value fails at construction with a ``ValueError`` naming the class the user built, the option and
the accepted values. :class:`Drafter` names a speculative-decoding drafter the sync pushes too (``drafter=``). What an
option needs of the target (``verify`` a target that scores logprobs, ...) is checked by the engine, which holds both.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import InitVar, dataclass, fields
from datetime import timedelta
from enum import Enum
from typing import Any, TypeVar

import torch

__all__ = ["Drafter", "OnError", "SyncLora", "SyncOptions", "Verify", "WhenBusy", "parse_option"]


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


@dataclass(frozen=True, kw_only=True)
class SyncOptions:
    """What a sync does beyond when it runs, for the Trainer's ``VLLMWeightSync`` and Fabric's ``WeightSync`` alike
    (each documents them for its users; the triggers are the callback's own). Strings become their enums and numbers
    their types here, once; a bad value raises naming ``owner`` (the class the user built), the option and the fix.
    """

    dtype: torch.dtype | None = None
    """The dtype of the pushed tensors; ``None``: the target's own."""
    verify: Verify | str | None = None
    """``"logprobs"``: after each sync, score a fixed probe with the engine and the trainer's model; ``None``: none."""
    verify_tolerance: float = 1.0
    """The largest absolute logprob difference per probe token ``verify`` allows."""
    lora: SyncLora | str = "merged"
    """For peft models: ``"merged"`` (the adapters merged into the base weights) or ``"adapter"`` (the base once,
    then the adapter alone, loaded as a LoRA)."""
    adapter_dir: str | os.PathLike[str] | None = None
    """Where ``lora="adapter"`` writes adapter directories (``None``: a temporary one, removed when the run ends)."""
    on_error: OnError | str = "raise"
    """``"raise"``: a failed sync stops the run; ``"warn"``: it warns and the next sync pushes every tensor."""
    check_finite: bool = True
    """Refuse to push a tensor holding NaN or Inf (checked on each rank's shards before any gather)."""
    timeout: timedelta | float | None = None
    """How long ranks wait for each other at a sync's control points (``None``: the strategy's ``timeout``)."""
    exact_first_sync: bool = False
    """Check the first sync bit for bit with vLLM's weight checker."""
    name: str | None = None
    """The sync's key in checkpoints (``None``: the target's ``state_name``)."""
    when_busy: WhenBusy | str = "wait"
    """With a target that pushes in the background: ``"wait"`` for the previous push, or ``"skip"`` this one."""
    drafter: Drafter | None = None
    """A speculative-decoding drafter every sync also pushes into the engine's draft model."""
    owner: InitVar[str] = "SyncOptions"
    """The class the user built, named in errors."""

    def __post_init__(self, owner: str) -> None:
        parsed = {"lora": parse_option(SyncLora, self.lora, "lora", owner),
                  "on_error": parse_option(OnError, self.on_error, "on_error", owner),
                  "when_busy": parse_option(WhenBusy, self.when_busy, "when_busy", owner),
                  "verify": None if self.verify is None else parse_option(Verify, self.verify, "verify", owner),
                  "timeout": _as_timedelta(self.timeout, owner)}
        if self.dtype is not None and not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"{owner}(dtype={self.dtype!r}) must be a torch.dtype such as torch.bfloat16, or None.")
        if isinstance(self.verify_tolerance, bool) or not isinstance(self.verify_tolerance, (int, float)) \
                or self.verify_tolerance <= 0:
            raise ValueError(f"{owner}(verify_tolerance={self.verify_tolerance}) must be positive.")
        if self.name is not None and (not isinstance(self.name, str) or not self.name):
            raise ValueError(f"{owner}(name={self.name!r}) must be a non-empty string (it keys the sync's state in"
                             " checkpoints), or None for the target's own name.")
        if self.drafter is not None and not isinstance(self.drafter, Drafter):
            raise TypeError(f"{owner}(drafter={self.drafter!r}) must be a lightning_fsdp_export.sync.options.Drafter,"
                            " e.g. Drafter('mtp', prefix='model.layers.46.'), or None.")
        for name, value in parsed.items():  # (frozen: set once, here, as the values parsed)
            object.__setattr__(self, name, value)

    @classmethod
    def of(cls, arguments: Mapping[str, Any], owner: str) -> SyncOptions:
        """The options among a sync class's ``__init__`` arguments (its ``locals()``), errors naming ``owner``."""
        return cls(**{f.name: arguments[f.name] for f in fields(cls)}, owner=owner)


def _as_timedelta(timeout: timedelta | float | None, owner: str) -> timedelta | None:
    given = timeout
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        timeout = timedelta(seconds=timeout)
    if timeout is not None and (not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0):
        raise ValueError(f"{owner}(timeout={given!r}) must be a positive timedelta or number of seconds.")
    return timeout
