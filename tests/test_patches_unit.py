"""Sparse syncs' bookkeeping, one process: a rank's copy and its patches (``patches.py``), and what the callback
confirms before each sync. The rounds over real servers are in ``tests/test_remote_sparse.py``."""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lightning_fsdp_export import LazyExportFSDP2, VLLMWeightSync
from lightning_fsdp_export._common import SyncGroup, WeightSyncError
from lightning_fsdp_export.export.patches import PatchBase, changed_mask, pack_bits, unpack_bits
from lightning_fsdp_export.targets import SendsPatches, WeightTarget


def apply(old: torch.Tensor, patch: Any) -> torch.Tensor:
    out = old.clone()
    where = patch.indices.long() if patch.bitmap is None else unpack_bits(patch.bitmap, old.numel())
    out.view(-1)[where] = patch.values
    return out


def test_a_round_patches_only_the_changed_bits_and_the_copy_follows() -> None:
    base = PatchBase()
    first = torch.randn(64, 8).to(torch.bfloat16)
    base.start(1, "plan", sparse=False)
    assert base.take("w", first) is None and base.stats.dense == 1  # a dense round keeps a copy
    base.succeeded()
    assert base.version == 1 and base.nbytes == first.numel() * 2
    assert base.tensors["w"].data_ptr() != first.data_ptr()  # a copy, not the module's storage

    second = first.clone()
    second[3, 2] += 1
    second[10, 0] = float("nan")  # NaN and -0.0 are changes of bits
    second[20, 5] = -second[20, 5] if second[20, 5] == 0 else second[20, 5]
    assert base.can_patch(1, "plan") and not base.can_patch(None, "plan") and not base.can_patch(1, "other")
    base.start(2, "plan", sparse=True)
    patch = base.take("w", second)
    assert patch is not None and patch.count == 2 and patch.indices.dtype == torch.int32
    assert torch.equal(apply(first, patch).view(torch.int16), second.view(torch.int16))
    assert torch.equal(base.tensors["w"].view(torch.int16), second.view(torch.int16))
    assert base.stats.changed == 2 and base.stats.wire_bytes == 2 * (4 + 2)
    assert base.version is None  # not confirmed while its round runs
    base.succeeded()

    third = second * 2  # every element: its patch would be larger than the part, it goes whole
    base.start(3, "plan", sparse=True)
    assert base.take("w", third) is None and base.stats.dense == 1
    assert torch.equal(base.tensors["w"].view(torch.int16), third.view(torch.int16))
    base.failed()
    assert base.version is None and base.tensors == {} and not base.can_patch(2, "plan")
    with pytest.raises(RuntimeError, match="without a confirmed copy"):
        base.start(4, "plan", sparse=True)


def test_changed_mask_compares_bits() -> None:
    a = torch.tensor([0.0, 1.0, float("nan"), 2.0])
    b = torch.tensor([-0.0, 1.0, float("nan"), 3.0])
    assert changed_mask(a, b).nonzero().squeeze(1).tolist() == [0, 3]


@pytest.mark.parametrize("numel", [1, 7, 8, 9, 1001])
def test_bits_pack_eight_to_a_byte_and_unpack_to_the_same_mask(numel: int) -> None:
    mask = torch.rand(numel, generator=torch.Generator().manual_seed(numel)) < 0.4
    packed = pack_bits(mask)
    assert packed.dtype == torch.uint8 and packed.numel() == -(-numel // 8)
    assert torch.equal(unpack_bits(packed, numel), mask)
    assert pack_bits(torch.tensor([True, False, False, True])).tolist() == [0b1001]  # element j is bit j
    with pytest.raises(ValueError, match="cannot mark"):
        unpack_bits(packed, numel + 8)


def test_with_bitmaps_each_part_goes_in_the_smallest_form() -> None:
    # bf16, 8,000 elements: indices cost 6 B per change, a bitmap 1,000 B + 2 B per change, whole 16,000 B
    first = torch.randn(100, 80).to(torch.bfloat16)
    base = PatchBase(bitmaps=True)
    base.start(1, "plan", sparse=False)
    base.take("w", first)
    base.succeeded()
    changed = first.clone()
    for fraction, form in ((0.01, "indices"), (0.5, "bitmap"), (0.97, "whole")):
        flat = changed.view(-1)
        step = int(1 / fraction) if fraction < 0.5 else 1
        n = int(fraction * flat.numel())
        where = torch.arange(0, flat.numel(), step)[:n] if step > 1 else torch.randperm(flat.numel())[:n]
        new = changed.clone()
        new.view(-1).view(torch.int16)[where] ^= 1  # one bf16 step: always a change of bits
        base.start(base.version + 1, "plan", sparse=True)
        patch = base.take("w", new)
        if form == "whole":
            assert patch is None and base.stats.dense == 1, base.stats
        else:
            assert patch is not None and (patch.bitmap is not None) == (form == "bitmap"), (form, base.stats)
            assert patch.count == n == base.stats.changed
            expected = n * 6 if form == "indices" else 1000 + 2 * n
            assert base.stats.wire_bytes == expected and base.stats.bitmaps == (form == "bitmap")
            assert torch.equal(apply(changed, patch).view(torch.int16), new.view(torch.int16))
        assert torch.equal(base.tensors["w"].view(torch.int16), new.view(torch.int16))  # the copy follows
        base.succeeded()
        changed = new
    # without bitmaps (vLLM's SparseWeightPatch lists) the half-changed part goes whole
    plain = PatchBase()
    plain.start(1, "plan", sparse=False)
    plain.take("w", first)
    plain.succeeded()
    plain.start(2, "plan", sparse=True)
    half = first.clone()
    half.view(-1)[::2] += 1
    assert plain.take("w", half) is None and plain.stats.dense == 1


class Patching(WeightTarget, SendsPatches):
    def __init__(self) -> None:
        self.confirmed: list[int | None] = []

    def push(self, weights: Any, *, version: int) -> None:  # pragma: no cover - not pushed here
        raise AssertionError

    def confirm(self, version: int | None) -> None:
        self.confirmed.append(version)


def test_the_callback_confirms_only_a_version_every_rank_agreed_on(monkeypatch: pytest.MonkeyPatch) -> None:
    target = Patching()
    sync = VLLMWeightSync(target, on_error="warn")
    outcomes = iter([None, None, WeightSyncError("lost"), None])

    def fake_sync(*args: Any) -> list[Any]:
        outcome = next(outcomes)
        if outcome is not None:
            raise outcome
        return []

    monkeypatch.setattr(sync.engine, "_ensure_target", lambda *a: None)
    sync.engine._group = SyncGroup(timedelta(seconds=10))  # (what _ensure_target builds: one process, rank 0)
    monkeypatch.setattr(sync.engine, "_sync", fake_sync)
    trainer = SimpleNamespace(strategy=LazyExportFSDP2(), global_step=0, is_global_zero=True, loggers=[])
    with pytest.warns(UserWarning, match="lost"):
        for _ in range(4):
            sync.sync(trainer)  # type: ignore[arg-type]
    assert target.confirmed == [None, 1, 2, None]  # first, then the served one; after a failure: none
    sync.load_state_dict(sync.state_dict())  # a resume: the engine holds what it was built from
    monkeypatch.setattr(sync.engine, "_sync", lambda *a: [])
    sync.sync(trainer)  # type: ignore[arg-type]
    assert target.confirmed[-1] is None
