"""Small pieces every room above may use: the sync's control group and error, and the shape comparison.

A sync is collective. A rank that skips it, iterates another order or fails in the middle would otherwise leave
the others waiting in an all-gather until the process group's timeout (30 minutes by default). The
:class:`SyncGroup` turns each of these into an error on every rank, within the sync's own timeout, naming the ranks.
"""

from __future__ import annotations

import contextlib
import difflib
import inspect
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import MISSING, fields
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as dist

from lightning_fsdp_export._compat import default_store

__all__ = ["DEFAULT_SHARD_BYTES", "STAGINGS", "EngineNotRestored", "SyncGroup", "WeightSyncError", "check_staging",
           "compare_shapes", "find_relocation", "options_signature", "Relocation", "trainer_part", "unknown_options"]

_Init = TypeVar("_Init", bound=Callable[..., None])

DEFAULT_SHARD_BYTES = 2 * 2**30
"""Largest safetensors file a directory version is split into (``DirectoryTarget`` and the ``Directory`` transport)."""

STAGINGS = ("auto", "device", "host")
"""Where a ``staged_nccl`` worker keeps a staged round (``StagedNCCL(staging=...)``)."""


def check_staging(staging: object, owner: str) -> None:
    """The one check of a ``staging`` value: the transport's option on the trainer, its init info on a worker."""
    if staging not in STAGINGS:
        raise ValueError(f"{owner}(staging={staging!r}) must be one of {', '.join(map(repr, STAGINGS))}.")


class WeightSyncError(RuntimeError):
    """A sync failed on at least one rank; every rank raises it, and the target is marked stale."""


class EngineNotRestored(WeightSyncError):
    """An exact check (``exact_first_sync=True``) failed once the engine was zeroed, and reloading the engine's
    checkpoint did not bring it back: it may serve zeroed parameters. The sync raises it whatever its ``on_error``
    says."""


class SyncGroup:
    """A gloo group with its own timeout for a sync's small control messages.

    Args:
        timeout: how long a rank waits for the others at each control point.
    """

    def __init__(self, timeout: timedelta) -> None:
        self.timeout = timeout
        self.rank = 0
        self.world_size = 1
        self._group: Any = None
        self._failures = 0
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
            self._group = dist.new_group(backend="gloo", timeout=timeout)  # collective: every rank builds it

    def arrive(self, what: str) -> None:
        """Wait until every rank reached ``what``; past the timeout raise, naming the ranks missing (rank 0)."""
        if self._group is None:
            return
        try:
            dist.monitored_barrier(group=self._group, timeout=self.timeout, wait_all_ranks=True)
        except RuntimeError as err:
            raise RuntimeError(
                f"{what}: not every rank arrived within {self.timeout.total_seconds():.0f} s ({err}). Every rank must"
                " call the sync at the same point (same trigger, same step)."
            ) from None

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (picklable), in rank order."""
        if self._group is None:
            return [value]
        everyone: list[Any] = [None] * self.world_size
        with self._naming_the_missing():
            dist.all_gather_object(everyone, value, group=self._group)
        return everyone

    def collect(self, value: Any) -> list[Any] | None:
        """Every rank's ``value`` (picklable) on rank 0, in rank order; ``None`` on the others."""
        if self._group is None:
            return [value]
        out: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        with self._naming_the_missing():
            dist.gather_object(value, out, dst=0, group=self._group)
        return out

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` (picklable) on every rank."""
        if self._group is None:
            return value
        box = [value]
        with self._naming_the_missing():
            dist.broadcast_object_list(box, src=0, group=self._group)
        return box[0]

    @contextlib.contextmanager
    def _naming_the_missing(self) -> Iterator[None]:
        """A control message that failed (a rank's process died, or it hangs elsewhere: gloo says only "Connection
        closed by peer" or a timeout) becomes a :class:`WeightSyncError` naming the ranks that do not answer
        (:meth:`missing_ranks`)."""
        try:
            yield
        except RuntimeError as err:
            if isinstance(err, WeightSyncError):
                raise
            missing = self.missing_ranks()
            who = (f"trainer rank(s) {missing} did not answer (their process died, or it is stuck elsewhere)"
                   if missing else "a trainer rank did not answer in time")
            raise WeightSyncError(f"The sync's ranks could not agree: {who}; this rank (rank {self.rank}) saw:"
                                  f" {type(err).__name__}: {_first_line(err)}. Every rank stops here; restart the run"
                                  " (the servers keep serving the last version they loaded).") from err

    def missing_ranks(self, wait_s: float = 5.0) -> list[int]:
        """After a failed control message: every rank that gets here says so in the default group's store (the
        launcher's, which outlives the gloo connections), and waits up to ``wait_s`` for the others; the ranks never
        heard from. ``[]`` where the store cannot tell; ``[0]`` where it is unreachable and rank 0 hosts it."""
        if self._group is None:
            return []
        self._failures += 1
        prefix = f"lfe-sync/{self._group.group_name}/{self._failures}/alive/"  # (its name is the same on every rank)
        try:
            store = default_store()
            store.set(f"{prefix}{self.rank}", "1")
            deadline = time.monotonic() + wait_s
            missing = list(range(self.world_size))
            while missing and time.monotonic() < deadline:
                missing = [r for r in missing if not store.check([f"{prefix}{r}"])]
                time.sleep(0.05)
            return missing
        except Exception:  # noqa: BLE001 - the store itself is gone: its host is
            return [0] if self.rank != 0 else []


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [""])[0][:300]


Relocation = tuple[tuple[str, str], ...]
"""Prefix moves ``((prefix, new prefix), ...)`` that name a model's tensors as a larger checkpoint holds them."""


def find_relocation(wanted: list[str], available: Collection[str]) -> Relocation | None:
    """The prefix moves (:meth:`CheckpointFormat.relocate`) under which every name of ``wanted`` missing from
    ``available`` is found there, each keeping its first part's tail: a text model's ``model.*`` found as a
    vision-language checkpoint's ``model.language_model.*`` (one move), or its ``model.*`` and ``lm_head.*`` as
    LLaVA's ``language_model.model.*`` and ``language_model.lm_head.*`` (two). One move per first part of the
    missing names; ``None`` if one of them has none."""
    missing = [name for name in wanted if name not in available]
    heads = sorted({name.split(".", 1)[0] + "." for name in missing if "." in name})
    if not missing or len(heads) != len({name.split(".", 1)[0] for name in missing}):
        return None
    moves = []
    for head in heads:
        names = [name for name in missing if name.startswith(head)]
        rest = names[0][len(head):]
        candidates = {name[: -len(rest)] for name in available if name.endswith("." + rest)}
        # the head kept at the end first (lm_head. as language_model.lm_head.); another new prefix only where the
        # tail names a module, not just a leaf ("weight" ends half the checkpoint's names)
        ordered = sorted(candidates, key=lambda new: (not new.endswith("." + head), len(new)))
        move = next(((head, new) for new in ordered if (new.endswith("." + head) or "." in rest)
                     and all(new + name[len(head):] in available for name in names)), None)
        if move is None:
            return None
        moves.append(move)
    return tuple(moves)


def trainer_part(names: list[str]) -> str | None:
    """The prefix under which an export holds part of a larger checkpoint, or ``None``: the common prefix of two or
    more parts (``model.language_model.``), or of one other than ``model.`` (LLaVA's ``language_model.``), of every
    name but top-level heads (``lm_head.weight``). A text model trained out of a vision-language checkpoint exports
    only that part; the checkpoint's other tensors (the vision tower, an MTP head) are the engine's own, not missing
    from the export. A whole model's names share at most ``model.``."""
    body = [name.split(".") for name in names if name.count(".") > 1]
    if not body:
        return None
    common = body[0][:-1]
    for parts in body[1:]:
        i = 0
        while i < min(len(common), len(parts) - 1) and common[i] == parts[i]:
            i += 1
        common = common[:i]
    return ".".join(common) + "." if len(common) >= 2 or common[:1] not in ([], ["model"]) else None


def compare_shapes(exported: list[tuple[str, tuple[int, ...]]], expected: dict[str, tuple[int, ...]], *,
                   may_be_absent: set[str], limit: int = 5) -> list[str]:
    """Lines describing where the trainer's export and the engine's checkpoint disagree (empty: they agree).

    Args:
        exported: ``(name, shape)`` the trainer will push.
        expected: ``{name: shape}`` of the engine's checkpoint.
        may_be_absent: exported names a checkpoint may lack (a tied ``lm_head.weight``).
            Checkpoint names outside :func:`trainer_part` of an export that holds part of it are not missing.
        limit: at most this many names per kind of mismatch.
    """
    have = dict(exported)
    wrong = [f"{n}: trainer {list(s)} vs engine {list(expected[n])}" for n, s in exported
             if n in expected and tuple(expected[n]) != tuple(s)]
    unknown = [n for n, _ in exported if n not in expected and n not in may_be_absent]
    part = trainer_part(list(have))
    missing = [n for n in expected if n not in have and (part is None or n.startswith(part))]
    lines = []
    if wrong:
        lines.append(f"shapes differ ({len(wrong)}): " + "; ".join(wrong[:limit]))
    if unknown:
        lines.append(f"unknown to the engine ({len(unknown)}): " + ", ".join(unknown[:limit]))
    if missing:
        lines.append(f"missing from the trainer's export ({len(missing)}): " + ", ".join(missing[:limit]))
    moves = find_relocation(unknown, expected) if unknown else None
    if moves is not None:
        held = ", ".join(f"the trainer's {old}* as {new}*" for old, new in moves)
        lines.append(f"the engine's checkpoint holds {held} (a text model of a vision-language checkpoint): start the"
                     " trainer with LazyExportFSDP2(pretrained=<that checkpoint>), which names the export so")
    return lines


def unknown_options(given: Mapping[str, Any], declared: type, owner: str) -> None:
    """Raise a ``TypeError`` naming the first of ``given``'s keywords that ``declared`` (a ``TypedDict`` of options)
    lacks, the nearest option's name, and every option's (the check a plain keyword signature would make)."""
    names = list(declared.__annotations__)
    for key in given:
        if key not in names:
            near = difflib.get_close_matches(key, names, n=1)
            hint = f" Did you mean {near[0]!r}?" if near else ""
            raise TypeError(f"{owner}() got an unexpected keyword argument {key!r}.{hint} Its options:"
                            f" {', '.join(names)}.")


def options_signature(declared: type, defaults: type) -> Callable[[_Init], _Init]:
    """Decorate an ``__init__`` taking ``**options: Unpack[declared]``: its ``__signature__`` lists each option as a
    keyword-only parameter with its annotation (from ``declared``) and default (``defaults``' dataclass field), so
    ``inspect.signature``, ``help()`` and editors that read it show them one by one; the type checker keeps reading
    the ``Unpack`` (the decorated function's type is unchanged)."""
    default_of = {f.name: f.default for f in fields(defaults) if f.default is not MISSING}

    def decorate(init: _Init) -> _Init:
        signature = inspect.signature(init)
        kept = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        options = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default_of[name],
                                     annotation=annotation)
                   for name, annotation in declared.__annotations__.items()]
        listed = signature.replace(parameters=[*kept, *options])
        init.__dict__["__signature__"] = listed  # (the function's attribute inspect.signature reads)
        return init

    return decorate
