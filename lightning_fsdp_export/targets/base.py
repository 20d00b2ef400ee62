"""The contracts between the Sync room and the targets: what every target does, and what only some can.

:class:`WeightTarget` is what every target is: ``push`` is the one method it must write; the rest has a
default. What only some targets can do is a small capability class a target also derives from, and
``VLLMWeightSync`` checks it with ``isinstance`` when it is built (an option that needs a capability the
target lacks is refused there, naming both):

- :class:`ScoresLogprobs` (``prompt_logprobs``): for ``verify="logprobs"``;
- :class:`ExactCheckable` (``checkpoint_path``, ``weight_checksums``, ``reset_weights``, ``reload_checkpoint``): for
  ``exact_first_sync=True``;
- :class:`LoadsAdapters` (``push_adapter``; ``push_base``, ``check_adapter`` with defaults): for ``lora="adapter"``;
- :class:`SleepsDuringCompute` (``before_compute``, ``after_compute``, ``weights_discarded``,
  ``sleep_level``): told of the strategy's compute phases (a colocated engine sleeps through them);
- :class:`SendsPatches` (``confirm``): told, before each sync, which version the engine holds as every rank
  agreed (a sparse sync patches only that version; another transport ignores it);
- :class:`PushesDrafts` (``push_draft``, ``check_draft``): for ``drafter=`` (a speculative-decoding drafter trained
  beside the policy, pushed into the engine's draft model);
- :class:`ServesRollouts` (``serving``, ``pause_mode``, ``adapter_name``, ``last_paused_seconds``): servers that take
  ``AsyncRollouts``' requests between and during syncs.

A sync calls, on every rank::

    target.setup(trainer)                                # once, at fit start
    problems = target.check_weights(names_and_shapes)    # each sync, before any gather
    target.push_source(strategy.export_source(dtype=target.dtype, layout=target.source_layout), version=v)
    target.teardown()                                    # at fit end
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor

from lightning_fsdp_export._common import SyncGroup
from lightning_fsdp_export.export.source import ExportSource, SourceLayout

if TYPE_CHECKING:

    from lightning_fsdp_export.servers.http import Server

__all__ = ["ExactCheckable", "LoadsAdapters", "PushesDrafts", "ScoresLogprobs", "SendsPatches", "ServesRollouts",
           "SleepsDuringCompute", "SyncRun", "WeightTarget"]


class SyncRun(Protocol):
    """What a sync and its target read of the run: a ``lightning.pytorch.Trainer`` is one; a Fabric loop's is
    :class:`~lightning_fsdp_export.fabric.sync.FabricRun`."""

    @property
    def strategy(self) -> Any: ...
    @property
    def global_rank(self) -> int: ...
    @property
    def local_rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def is_global_zero(self) -> bool: ...
    @property
    def global_step(self) -> int: ...
    @property
    def accumulate_grad_batches(self) -> int: ...


class WeightTarget(ABC):
    """Where :class:`~lightning_fsdp_export.VLLMWeightSync` sends weights; every method runs on every rank.

    Subclass it and write :meth:`push`; override the others where the default does not fit.
    """

    @property
    def source_layout(self) -> SourceLayout:
        """What the sync asks the strategy for: whole tensors (this default), or each rank's own shards (a
        shard-direct target)."""
        return SourceLayout.FULL

    @property
    def dtype(self) -> torch.dtype | None:
        """The dtype the receiver wants (an engine's own), or ``None`` (default) to keep the trainer's."""
        return None

    @property
    def state_name(self) -> str:
        """Names this target's kind in ``VLLMWeightSync``'s checkpoint state key, so two syncs into different kinds of
        target can share a Trainer; stable across a resume, also one that swaps the target for another of its kind
        (never a URL or a port). Default: the first target class of this package it derives from (a subclass of
        ``InMemoryTarget`` is an ``InMemoryTarget``), else its own class name."""
        ours = [c for c in type(self).__mro__ if c.__module__.startswith("lightning_fsdp_export.targets.")
                and c.__module__ != __name__]
        return (ours[0] if ours else type(self)).__name__

    @property
    def serves_during_push(self) -> bool:
        """The receiver goes on serving the version it holds while a push travels and swaps the new one in at its end
        (``RemoteVLLM`` over ``Gloo(background=True)``): ``VLLMWeightSync.served_version`` then stays that version
        during the push. Default ``False``: a push replaces the weights as it goes."""
        return False

    @property
    def pushes_in_background(self) -> bool:
        """A push returns once this rank's part is taken (a snapshot) and a thread sends it while training goes on;
        :meth:`wait` ends it. Default ``False``: a push returns when it is done."""
        return False

    def push_arrived(self) -> bool:
        """Without waiting: whether the push in the background (if any) arrived and serves, as far as this rank knows
        (every rank learns the swap's outcome from rank 0). Default ``True``: nothing is ever in flight."""
        return True

    def wait(self) -> None:  # noqa: B027 - a default that does nothing
        """Every rank: wait for this rank's push still travelling in the background (at most one), and raise its
        failure; default: nothing is ever in flight."""

    def setup(self, trainer: SyncRun) -> None:  # noqa: B027 - a default that does nothing
        """Prepare before the first push (build an engine, reach a server); default: nothing."""

    def agree(self, ranks: SyncGroup) -> None:  # noqa: B027 - a default that does nothing
        """Every rank, before each push: learn what only rank 0 knows of the receiver (``RemoteVLLM``'s pool: which
        servers serve, for ``AsyncRollouts`` on every rank); default: nothing."""

    def redo_without_failed(self, ranks: SyncGroup) -> bool:
        """Every rank, a push that failed on every rank: whether the target set aside what made it fail
        (``RemoteVLLM``'s pool: servers gone silent, with ``min_servers`` still met) so the same push may be redone at
        once (rank 0's word, learnt by every rank); default: never."""
        return False

    def sync_metrics(self) -> dict[str, float]:
        """Rank 0, after a sync: what the target adds to its metrics (``RemoteVLLM(min_servers=...)``:
        ``weight_sync/servers_out``); default: nothing."""
        return {}

    @abstractmethod
    def push(self, weights: Iterator[tuple[str, Tensor]], *, version: int) -> None:
        """Send one full set of weights as version ``version``; called on every rank with the same collective
        stream, which the target must let be drained (the sync drains what it leaves)."""

    def push_source(self, source: ExportSource, *, version: int) -> None:
        """What the sync calls: the source itself, for a target that needs its ``metadata()`` before the stream
        (``RemoteVLLM``'s network transports). Default: ``push(iter(source), version=version)``."""
        self.push(iter(source), version=version)

    def held_version(self) -> int | None:
        """Rank 0, before the first push of a resumed run: the highest version the receiver is tagged with (an engine
        that outlived the run before the resume may hold versions past the checkpoint's), so the versions go on past
        it and no two pushes share one; default ``None``: it cannot tell (a fresh engine holds none)."""
        return None

    def check_weights(self, exported: list[tuple[str, tuple[int, ...]]]) -> list[str]:
        """What the receiver would refuse among ``(name, full shape)``, checked before any gather (one line per
        problem); default: nothing is checked here (the receiver's load checks)."""
        return []

    def teardown(self) -> None:  # noqa: B027 - a default that does nothing
        """Release what ``setup`` created; default: nothing."""


class ScoresLogprobs(ABC):
    """A target that can score tokens with the weights it holds (``VLLMWeightSync(verify="logprobs")``)."""

    @abstractmethod
    def prompt_logprobs(self, token_ids: list[int]) -> list[float] | dict[str, list[float]]:
        """The logprob of each token of ``token_ids`` after the ones before it (``len - 1`` values), or such a
        list per server (``{url: [...]}``); an empty result on ranks that do not ask."""

    def image_checkpoint(self) -> str | None:
        """The checkpoint directory of an engine that reads images (its processor is there), else ``None``: then
        ``verify`` scores text only. Only targets that implement :meth:`image_prompt_logprobs` say one."""
        return None

    def image_prompt_logprobs(self, token_ids: list[int], image: Any) -> tuple[list[int], list[float]]:
        """The prompt as the engine expanded ``image``'s placeholder in ``token_ids``, and the logprob of each of its
        tokens after the ones before (``len - 1`` values)."""
        raise NotImplementedError(f"{type(self).__name__} does not score images")


class ExactCheckable(ABC):
    """A target whose engine can be checked bit for bit (``VLLMWeightSync(exact_first_sync=True)``)."""

    @abstractmethod
    def checkpoint_path(self) -> str | os.PathLike[str]:
        """The checkpoint the engine was built from (must be the strategy's ``pretrained=``)."""

    @abstractmethod
    def weight_checksums(self) -> dict[str, dict[str, str]]:
        """``{engine: {parameter: checksum}}`` of the engine's weights now (vLLM's weight checker)."""

    @abstractmethod
    def reset_weights(self) -> None:
        """Zero the engine's weights (it serves nothing until the next push completes)."""

    def reload_checkpoint(self) -> None:
        """Load the engine's whole checkpoint again (vLLM's ``reload_weights`` from its own directory): after an exact
        check whose trainer holds only part of what the engine serves (a vision-language checkpoint's text model),
        the rest (the vision tower) comes back from disk. Default: not supported."""
        raise NotImplementedError(f"{type(self).__name__} cannot reload its engine's checkpoint.")


class LoadsAdapters(ABC):
    """A target that loads peft adapter directories (``VLLMWeightSync(lora="adapter")``).

    A sync of such a target pushes the base weights (its first, and any after a failure or a resume:
    :meth:`push_base`) and then the adapter (:meth:`push_adapter`), or the adapter alone."""

    @abstractmethod
    def push_adapter(self, path: str | os.PathLike[str], *, version: int) -> None:
        """Load the adapter directory ``path`` (this rank's copy) as version ``version`` (later requests use it)."""

    def push_base(self, source: ExportSource, *, version: int) -> None:
        """The base weights of a sync whose adapter follows at once; default: :meth:`WeightTarget.push_source`. A
        target serving others may hold them stopped until the adapter is in (never new base, old adapter)."""
        assert isinstance(self, WeightTarget)
        self.push_source(source, version=version)

    def cannot_load_adapters(self) -> str | None:
        """Why this target, as configured, cannot load adapters at all (checked when ``VLLMWeightSync`` is built,
        before anything is pushed), or ``None`` (default: it can)."""
        return None

    def check_adapter(self, exported: list[tuple[str, tuple[int, ...]]]) -> list[str]:
        """What the receiver would refuse of the adapter ``(name, shape)`` list, checked before any gather or push
        (one line per problem); default: nothing is checked here."""
        return []


class SleepsDuringCompute(ABC):
    """A target sharing the trainer's device: told of the strategy's compute phases (a colocated engine)."""

    sleep_level: int | None = None
    """2: the engine drops its weights while asleep, so only a full push after every step restores them."""

    weights_discarded: bool = False
    """The engine holds no weights now (it slept at level 2 through a phase no sync followed): push first."""

    @abstractmethod
    def before_compute(self) -> None:
        """The trainer is about to take the device."""

    @abstractmethod
    def after_compute(self) -> None:
        """The trainer gave the device back."""


class SendsPatches(ABC):
    """A target that may send only what changed since the version the engine holds (sparse syncs): a class has it
    where its objects may (``RemoteVLLM``: those whose transport sends patches use the version; the others ignore
    it)."""

    @abstractmethod
    def confirm(self, version: int | None) -> None:
        """Before each sync, every rank: the version every rank agreed the engine holds; ``None`` at the first
        sync and after a failed one or a resume (the next push is then dense)."""


class ServesRollouts(ABC):
    """A target whose servers take rollout requests between and during syncs (``AsyncRollouts`` generates on them)."""

    adapter_name: str
    """The name a ``lora="adapter"`` sync serves the adapter under (requests ask for ``model=<adapter_name>``)."""

    @property
    @abstractmethod
    def serving(self) -> list[Server]:
        """Every rank: the servers requests may go to now (none set aside, none still joining)."""

    @property
    @abstractmethod
    def pause_mode(self) -> str:
        """How a sync pauses the servers (``"keep_old_kv"``: clients salt their prefix caches per version)."""

    @property
    @abstractmethod
    def last_paused_seconds(self) -> float | None:
        """Rank 0: how long the last sync kept the servers paused (None elsewhere and before one)."""


class PushesDrafts(ABC):
    """A target whose engine drafts with a speculative-decoding model that a sync can load
    (``VLLMWeightSync(drafter=...)``)."""

    @abstractmethod
    def push_draft(self, source: ExportSource, *, version: int) -> None:
        """Load the drafter's tensors (named as the engine's checkpoint names them) into the engine's draft model,
        after this version's weights; the draft model's other tensors (those it shares with the target) are
        left as they are."""

    @abstractmethod
    def check_draft(self, exported: list[tuple[str, tuple[int, ...]]]) -> list[str]:
        """Where the drafter's ``exported`` names and shapes disagree with the engine's drafter (empty: they agree),
        before any gather."""

    def cannot_push_drafts(self) -> str | None:
        """Why this target, as configured, cannot push drafters (``VLLMWeightSync`` refuses ``drafter=`` saying it), or
        ``None``."""
        return None
