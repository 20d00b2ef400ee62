"""Compact patches for sparse syncs over slow links: positions as gaps, values as steps; torch only, vectorised.

A patch of ``count`` changed elements of a part (:mod:`~lightning_fsdp_export.export.patches`) names them by int32
indices (4 bytes each) or a bitmap (an eighth of a byte per element of the part), and sends their new values (the
wire dtype: 2 bytes in bf16). At the learning rates RL uses (1e-6), about 1% of the bf16 elements change per step,
each by one or two units in the last place (ULPs), so both halves carry mostly redundant bits. The coded form:

* positions: the gaps between consecutive changed elements (the first from the part's start) in LEB128 (7 bits per
  byte, the high bit set on every byte but a number's last): a gap under 128 costs one byte, under 16384 two;
* values: how many steps of its dtype's order each element moved (:func:`ulp_keys`: the bit patterns of a float
  dtype, ordered as their values), one signed byte per element; the receiver holds the previous version (the copy
  every sparse round patches) and adds it. An element that moved further (a value crossing zero) has the step
  :data:`ESCAPE`, and its move follows the gaps in the same LEB128 stream (zigzag: a few bytes).

Both are exact: any bit pattern (NaN, -0.0, infinities) round-trips, since the steps are taken between bit patterns
through a bijection. ``tests/test_patch_codes.py`` checks them bit for bit (empty, full, single-element, every bf16
pattern). What they cost in CPU time is measured by ``benchmarks/sparse_bench.py``.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["ESCAPE", "apply_steps", "decode_gaps", "decode_positions", "decode_varints", "encode_gaps",
           "encode_positions", "encode_varints", "gaps_of", "steps", "ulp_bits", "ulp_keys"]

_INTS = {2: (torch.int16, 0x7FFF), 4: (torch.int32, 0x7FFFFFFF)}


def encode_varints(numbers: Tensor) -> Tensor:
    """Non-negative integers (int64) as LEB128 bytes (uint8): 7 bits a byte, the high bit set on all but a number's
    last byte."""
    numbers = numbers.to(torch.int64).reshape(-1)
    device = numbers.device
    if not numbers.numel():
        return torch.empty(0, dtype=torch.uint8, device=device)
    if int(numbers.min()) < 0:
        raise ValueError("encode_varints: the numbers must be >= 0.")
    nbytes = torch.ones_like(numbers)
    longest = 1
    for shift in range(7, 63, 7):
        more = (numbers >> shift) > 0
        if not bool(more.any()):
            break
        nbytes += more
        longest += 1
    if longest == 1:  # every number under 128: the bytes are the numbers
        return numbers.to(torch.uint8)
    starts = torch.cumsum(nbytes, 0) - nbytes
    out = torch.empty(int(starts[-1] + nbytes[-1]), dtype=torch.uint8, device=device)
    # byte k of every number that has one: 7 bits, and the continuation bit where a byte follows
    rest, where, left = numbers, starts, nbytes
    for _ in range(longest):
        out[where] = ((rest & 0x7F) | ((left > 1).to(torch.int64) << 7)).to(torch.uint8)
        keep = left > 1
        rest, where, left = (rest >> 7)[keep], (where + 1)[keep], (left - 1)[keep]
    return out


def decode_varints(stream: Tensor) -> Tensor:
    """Every number :func:`encode_varints` wrote into ``stream`` (int64); raises on a malformed stream."""
    data = stream.reshape(-1).to(torch.int64)
    device = data.device
    if not data.numel():
        return torch.empty(0, dtype=torch.int64, device=device)
    last = (data & 0x80) == 0  # a number's last byte
    if not bool(last[-1]):
        raise ValueError(f"{stream.numel()} bytes end inside a number.")
    count = int(torch.count_nonzero(last))
    owner = torch.cumsum(last.to(torch.int64), 0) - last.to(torch.int64)  # the number each byte belongs to
    starts = torch.zeros(count, dtype=torch.int64, device=device)
    starts[1:] = torch.nonzero(last).reshape(-1)[:-1] + 1
    position = torch.arange(data.numel(), device=device) - starts[owner]
    if int(position.max()) >= 9:
        raise ValueError("a number longer than 9 bytes.")
    return torch.zeros(count, dtype=torch.int64, device=device).index_add_(0, owner, (data & 0x7F) << (7 * position))


def gaps_of(index: Tensor) -> Tensor:
    """The gaps of sorted, distinct flat ``index`` (int64, >= 0): ``index[0]``, then ``index[i] - index[i - 1] - 1``."""
    index = index.to(torch.int64).reshape(-1)
    gaps = torch.diff(index, prepend=index.new_full((1,), -1)) - 1
    if gaps.numel() and int(gaps.min()) < 0:
        raise ValueError("the indices must be sorted, distinct and >= 0.")
    return gaps


def encode_gaps(index: Tensor) -> Tensor:
    """Sorted, distinct flat ``index`` as LEB128 gaps (:func:`gaps_of`, :func:`encode_varints`)."""
    return encode_varints(gaps_of(index))


def decode_gaps(stream: Tensor, count: int) -> Tensor:
    """The ``count`` indices (int64) that :func:`encode_gaps` wrote into ``stream``; raises on a malformed stream."""
    index, rest = decode_positions(stream, count)
    if rest.numel():
        raise ValueError(f"{stream.numel()} bytes hold {count + rest.numel()} numbers, not {count}.")
    return index


def encode_positions(index: Tensor, escapes: Tensor | None = None) -> Tensor:
    """A coded patch's position stream: the gaps of ``index``, then the escaped elements' zigzag moves (``steps``'
    second half), all LEB128; the one place that lays it out (:func:`decode_positions` reads it)."""
    gaps = gaps_of(index)
    return encode_varints(gaps if escapes is None else torch.cat([gaps, escapes]))


def decode_positions(stream: Tensor, count: int) -> tuple[Tensor, Tensor]:
    """The ``count`` indices and the escaped moves after them of an :func:`encode_positions` stream."""
    numbers = decode_varints(stream)
    if numbers.numel() < count:
        raise ValueError(f"{stream.numel()} bytes hold {numbers.numel()} numbers, not {count}.")
    return torch.cumsum(numbers[:count] + 1, 0) - 1, numbers[count:]


def ulp_keys(values: Tensor) -> Tensor | None:
    """The bit patterns of a 2- or 4-byte float tensor as integers ordered like the values (``-0.0`` just below
    ``+0.0``; NaNs at the ends): the sign-magnitude patterns with the magnitude bits of negative ones flipped, a
    bijection; ``None`` for other dtypes."""
    found = _INTS.get(values.element_size()) if values.is_floating_point() else None
    if found is None:
        return None
    ints, magnitude = found
    bits = values.reshape(-1).view(ints)
    return torch.where(bits < 0, bits ^ magnitude, bits)


def ulp_bits(keys: Tensor, dtype: torch.dtype) -> Tensor:
    """The values of ``dtype`` whose :func:`ulp_keys` are ``keys`` (same integer dtype)."""
    _, magnitude = _INTS[dtype.itemsize]
    return torch.where(keys < 0, keys ^ magnitude, keys).view(dtype)


ESCAPE = -128  # a step that says: this element moved further, its move follows the gaps (zigzag LEB128)


def steps(new: Tensor, old: Tensor) -> tuple[Tensor, Tensor] | None:
    """How far each element moved in its dtype's order: ``(int8 steps, escapes)``, where an element that moved more
    than 127 steps either way has the step :data:`ESCAPE` and its move, zigzag-coded (0, -1, 1, -2, ... as 0, 1, 2,
    3, ...: int64, >= 0), in ``escapes`` in order; ``None`` for a dtype without that order."""
    a, b = ulp_keys(new), ulp_keys(old)
    if a is None or b is None or new.dtype != old.dtype:
        return None
    delta = a.to(torch.int64) - b.to(torch.int64)
    far = (delta < -127) | (delta > 127)
    moved = torch.where(far, ESCAPE, delta).to(torch.int8)
    escaped = delta[far]
    return moved, (escaped << 1) ^ (escaped >> 63)


def apply_steps(old: Tensor, moved: Tensor, escapes: Tensor | None = None) -> Tensor:
    """The values ``moved`` (int8, from :func:`steps`) steps from ``old``, bit for bit; ``escapes``: the zigzag moves of
    the elements whose step is :data:`ESCAPE`, in order."""
    keys = ulp_keys(old)
    if keys is None:
        raise ValueError(f"apply_steps: {old.dtype} has no step order (a 2- or 4-byte float dtype has).")
    delta = moved.to(torch.int64)
    far = moved == ESCAPE
    found = int(torch.count_nonzero(far))
    given = 0 if escapes is None else escapes.numel()
    if found != given:
        raise ValueError(f"apply_steps: {found} escaped steps but {given} escapes.")
    if found:
        assert escapes is not None
        delta[far] = (escapes >> 1) ^ -(escapes & 1)
    return ulp_bits((keys.to(torch.int64) + delta).to(keys.dtype), old.dtype).view(old.shape)
