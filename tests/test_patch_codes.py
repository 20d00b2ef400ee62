"""The coded form of sparse patches (``export/patch_codes.py``): gaps and steps, bit for bit, in one process."""

from __future__ import annotations

import pytest
import torch

from lightning_fsdp_export.export.patch_codes import (
    ESCAPE,
    apply_steps,
    decode_gaps,
    decode_positions,
    decode_varints,
    encode_gaps,
    encode_varints,
    steps,
    ulp_bits,
    ulp_keys,
)
from lightning_fsdp_export.export.patches import PatchBase


@pytest.mark.parametrize("index", [[], [0], [7], list(range(300)), [0, 127, 128, 255, 256, 16511, 16512, 2**40]],
                         ids=["empty", "first", "single", "full", "edges"])
def test_gaps_round_trip_bit_for_bit(index: list[int]) -> None:
    want = torch.tensor(index, dtype=torch.int64)
    stream = encode_gaps(want)
    assert torch.equal(decode_gaps(stream, len(index)), want)
    # a gap under 128 is one byte (a full part: every gap 0), under 16384 two
    if index == list(range(300)):
        assert stream.numel() == 300 and int(stream.max()) == 0
    if index == [0, 127, 128, 255, 256, 16511, 16512, 2**40]:  # gaps 0 126 0 126 0 16254 0 2**40-16513
        assert stream.numel() == 1 + 1 + 1 + 1 + 1 + 2 + 1 + 6


def test_gaps_of_random_patches_and_malformed_streams() -> None:
    generator = torch.Generator().manual_seed(0)
    for n, k in [(10, 10), (1000, 13), (100_000, 1370)]:
        want = torch.sort(torch.randperm(n, generator=generator)[:k]).values
        assert torch.equal(decode_gaps(encode_gaps(want), k), want)
    with pytest.raises(ValueError, match="sorted, distinct"):
        encode_gaps(torch.tensor([3, 3]))
    with pytest.raises(ValueError, match="2 bytes hold 2 numbers, not 3"):
        decode_gaps(encode_gaps(torch.tensor([1, 2])), 3)
    with pytest.raises(ValueError, match="end inside a number"):
        decode_gaps(torch.tensor([0x81], dtype=torch.uint8), 1)  # a continuation byte last
    with pytest.raises(ValueError, match="2 bytes hold 2 numbers, not 0"):
        decode_gaps(torch.tensor([1, 2], dtype=torch.uint8), 0)
    with pytest.raises(ValueError, match="longer than 9 bytes"):
        decode_varints(torch.tensor([0x80] * 9 + [1], dtype=torch.uint8))
    big = torch.tensor([0, 1, 127, 128, 2**62], dtype=torch.int64)
    assert torch.equal(decode_varints(encode_varints(big)), big)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_16_bit_pattern_orders_and_steps_back_exactly(dtype: torch.dtype) -> None:
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    keys = ulp_keys(every)
    assert keys is not None and keys.unique().numel() == 2**16  # a bijection: NaNs, -0.0 and infinities too
    assert torch.equal(ulp_bits(keys, dtype).view(torch.int16), every.view(torch.int16))
    values = every.float()
    finite = ~torch.isnan(values)
    ordered = values[finite][torch.argsort(keys[finite])]
    assert bool((ordered[1:] >= ordered[:-1]).all())  # the keys order the values
    # one step from each pattern (the largest key wraps: 2 of 65536 patterns are left out) lands on the next one
    start = every[:-1]
    moved = torch.ones(start.numel(), dtype=torch.int8)
    inner = keys[:-1] != 2**15 - 1
    stepped = apply_steps(start[inner], moved[inner])
    assert torch.equal(ulp_keys(stepped), keys[:-1][inner] + 1)


def test_steps_fit_a_byte_and_larger_moves_escape_exactly() -> None:
    generator = torch.Generator().manual_seed(0)
    old = torch.randn(10_000, generator=generator).to(torch.bfloat16)
    new = (old.float() * (1 + 1e-3 * torch.randn(10_000, generator=generator))).to(torch.bfloat16)
    found = steps(new, old)
    assert found is not None and found[0].dtype == torch.int8 and found[1].numel() == 0  # all within a byte
    assert torch.equal(apply_steps(old, *found).view(torch.int16), new.view(torch.int16))
    # far moves (two binades up, a sign crossing, a NaN, -0.0 to +0.0 is one step) escape with their zigzag move
    far = torch.tensor([1.0, 0.5, -1e-30, 0.0, -0.0, 3.0], dtype=torch.bfloat16)
    went = torch.tensor([4.0, -0.5, 1e-30, float("nan"), 0.0, 3.0], dtype=torch.bfloat16)
    moved, escapes = steps(went, far)
    assert moved.tolist() == [ESCAPE, ESCAPE, ESCAPE, ESCAPE, 1, 0] and escapes.numel() == 4
    assert torch.equal(apply_steps(far, moved, escapes).view(torch.int16), went.view(torch.int16))
    with pytest.raises(ValueError, match="4 escaped steps but 3 escapes"):
        apply_steps(far, moved, escapes[:3])
    assert steps(torch.tensor([1, 2]), torch.tensor([1, 3])) is None  # integers have no steps here
    f32 = torch.randn(100, generator=generator)
    up = torch.nextafter(f32, f32 + 1)
    assert torch.equal(apply_steps(f32, *steps(up, f32)), up)


def test_a_coded_patch_is_the_smallest_form_at_rl_learning_rates() -> None:
    # 1.4% of a bf16 part moved by one step (what lr 1e-6 does to a 200M model): the coded form goes (gaps about a
    # byte, steps a byte: ~2 bytes per changed element) where indices cost 6 and a bitmap 1/8 byte per element + 2
    generator = torch.Generator().manual_seed(0)
    part = torch.randn(200_000, generator=generator).to(torch.bfloat16)
    base = PatchBase(bitmaps=True, coded=True)
    base.start(1, "plan", sparse=False)
    assert base.take("w", part) is None
    base.succeeded()
    new = part.clone()
    changed = torch.randperm(part.numel(), generator=generator)[:2800]
    new.view(torch.int16)[changed] += 1
    base.start(2, "plan", sparse=True)
    patch = base.take("w", new)
    assert patch is not None and patch.positions is not None and patch.stepped and patch.count == 2800
    assert base.stats.coded == 1 and base.stats.wire_bytes / base.stats.dense_bytes < 0.02, base.stats
    where, escapes = decode_positions(patch.positions, patch.count)
    rebuilt = part.clone()
    rebuilt[where] = apply_steps(part[where], patch.values, escapes)
    assert torch.equal(rebuilt.view(torch.int16), new.view(torch.int16))
    # the copy is the new part; nothing changed next: an empty coded patch
    base.succeeded()
    base.start(3, "plan", sparse=True)
    empty = base.take("w", new)
    assert empty is not None and empty.count == 0 and empty.positions is not None and empty.positions.numel() == 0
    # every element changed: no patch is smaller than the part, it goes whole
    base.succeeded()
    base.start(4, "plan", sparse=True)
    assert base.take("w", new * 3) is None
