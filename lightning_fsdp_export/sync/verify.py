"""``verify="logprobs"``: the engine scores a fixed probe, the trainer's own model scores it too."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lightning_fsdp_export.sync.image_probe import image_probe_gap

if TYPE_CHECKING:
    from lightning_fsdp_export.strategy_core import LazyExportCore
    from lightning_fsdp_export.targets.base import ScoresLogprobs

__all__ = ["check_logprobs"]


def check_logprobs(strategy: LazyExportCore, target: ScoresLogprobs,
                   tolerance: float) -> tuple[float | None, str | None]:
    """This rank's engine(s) against the trainer on a fixed probe: ``(worst difference, message past tolerance)``;
    where the engine and the trainer's model both read images, on the probe after a picture too
    (:func:`~lightning_fsdp_export.sync.image_probe.image_probe_gap`).

    The trainer's forward runs with the shards on the device and starts no compute phase. A target may
    answer one list (its engine) or ``{engine name: list}`` (``RemoteVLLM``: every server from rank 0,
    ``{}`` elsewhere). A scoring failure is returned as the message, never raised alone (the ranks agree).
    """
    module = strategy.export_module
    vocab = int(getattr(getattr(module, "config", None), "vocab_size", 256))
    probe = [(13 * i + 7) % vocab for i in range(32)]
    with torch.no_grad(), strategy.params_on_device():
        logits = module(input_ids=torch.tensor([probe], device=strategy.root_device)).logits[0].float()
    logp = torch.log_softmax(logits, -1)
    mine = [logp[t - 1, probe[t]].item() for t in range(1, len(probe))]
    try:
        scored = target.prompt_logprobs(probe)
    except Exception as err:  # noqa: BLE001 - reported through the ranks' agreement
        return None, f"the engine could not score the probe ({type(err).__name__}: {err})"
    engines = scored if isinstance(scored, dict) else {"the engine": scored}
    if not engines:
        return None, None
    diffs = {f"{name}'s probe": max(abs(a - b) for a, b in zip(mine, lps)) for name, lps in engines.items()}
    image, failed = image_probe_gap(strategy, target, probe[:16])
    if failed:
        return None, failed
    if image is not None:  # the tower and projector of a whole VLM, which a text probe never reaches
        diffs["the engine's image probe"] = image
    worst = max(diffs, key=diffs.__getitem__)
    if diffs[worst] <= tolerance:
        return diffs[worst], None
    return diffs[worst], (f"{worst} logprobs differ from the trainer's by {diffs[worst]:.3f} >"
                          f" verify_tolerance={tolerance}: it does not hold the trainer's weights (a missing or"
                          " misnamed tensor, or a stale cache)")
