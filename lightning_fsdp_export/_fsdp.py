"""What every room reads of an FSDP2 model's structure (at the bottom: the preparation shards a model, the export and
the phases walk a sharded one): the outermost matching modules, FSDP2's row split, a module's own class."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn
from torch.distributed.fsdp import FSDPModule

__all__ = ["chunk_bounds", "outermost", "unsharded_class"]


def outermost(root: nn.Module, match: Callable[[nn.Module], bool]) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every submodule of ``root`` (itself included) that ``match``es and has no
    matching ancestor, in module order (say the top-level FSDP modules, or the outermost HF models)."""
    found: list[tuple[str, nn.Module]] = []
    for name, sub in root.named_modules():
        inside = any(not above or name.startswith(f"{above}.") for above, _ in found)
        if not inside and match(sub):
            found.append((name, sub))
    return found


def chunk_bounds(rows: int, world: int) -> tuple[int, ...]:
    """Row offsets of ``torch.chunk`` shards, as FSDP2 makes them: rank ``r`` holds rows ``[b[r], b[r + 1])``
    (uneven: the last ranks hold fewer, or none)."""
    chunk = -(-rows // world)
    return tuple(min(rank * chunk, rows) for rank in range(world + 1))


def unsharded_class(module: nn.Module) -> type[nn.Module]:
    """The module's own class: ``fully_shard`` swaps it for a generated ``FSDP<name>`` subclass."""
    return next(c for c in type(module).__mro__ if issubclass(c, nn.Module) and not issubclass(c, FSDPModule))
