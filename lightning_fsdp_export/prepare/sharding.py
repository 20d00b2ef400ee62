"""Applying FSDP2 (``fully_shard``) to a model that did not shard itself, and recognising one that did."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel, fully_shard
from torch.distributed.tensor import DTensor

from lightning_fsdp_export._fsdp import chunk_bounds, outermost, unsharded_class

__all__ = ["auto_shard", "chunk_bounds", "default_shard_classes", "is_fully_sharded", "outermost", "reject_fsdp1",
           "unsharded_class"]


def is_fully_sharded(module: nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to ``module`` or any submodule."""
    return any(isinstance(m, FSDPModule) for m in module.modules())


def reject_fsdp1(module: nn.Module, strategy_name: str) -> None:
    """Raise a ``TypeError`` if any submodule is wrapped by FSDP1 (``FullyShardedDataParallel``)."""
    wrapped = [name or "<root>" for name, m in module.named_modules() if isinstance(m, FullyShardedDataParallel)]
    if wrapped:
        raise TypeError(
            f"{strategy_name} supports FSDP2 (`torch.distributed.fsdp.fully_shard`) only, but these modules are"
            f" wrapped with FSDP1 `FullyShardedDataParallel`: {wrapped[:5]}. Apply `fully_shard` in"
            " `configure_model` instead, or leave sharding to the strategy."
        )


def default_shard_classes(module: nn.Module) -> set[str]:
    """The class names of every ``_no_split_modules`` declared by Hugging Face models inside ``module``.

    For a Qwen2 model this is ``{"Qwen2DecoderLayer"}``.
    """
    names: set[str] = set()
    for m in module.modules():
        declared = getattr(m, "_no_split_modules", None)
        if declared:
            names.update(declared)
    return names


def _class_names(shard_modules: Iterable[type[nn.Module] | str]) -> set[str]:
    return {c if isinstance(c, str) else c.__name__ for c in shard_modules}


def auto_shard(
    module: nn.Module,
    *,
    mesh: DeviceMesh,
    shard_modules: Sequence[type[nn.Module] | str] | None,
    roots: Sequence[nn.Module],
    fsdp_kwargs: dict[str, Any],
) -> list[str]:
    """``fully_shard`` every submodule whose class is in ``shard_modules``, then each root.

    A root is a module whose ``forward`` is called (FSDP2 gathers a root's own parameters in its
    pre-forward hook), so the LightningModule itself is not one: its ``training_step`` calls its
    children. After ``roots``, every direct child of ``module`` still holding unsharded parameters is
    sharded as a root of its own (say a value head beside the policy).

    Args:
        module: the LightningModule.
        mesh: the 1-D data-parallel mesh to shard over.
        shard_modules: classes or class names to shard one by one; ``None`` means
            :func:`default_shard_classes`.
        roots: modules to shard after the layers, typically the exported HF model; ``module`` itself is one where
            its forward is called (Fabric's module), sharded last, so tied parameters stay in one unit.
        fsdp_kwargs: passed to every ``fully_shard`` call (``mp_policy``, ``reshard_after_forward``,
            ``offload_policy``).

    Returns:
        The names of the submodules sharded on their own, roots included.

    Raises:
        ValueError: if ``module`` holds parameters directly: no root would gather them, and their
            gradients would not be reduced across ranks.
    """
    own = [name for name, p in module.named_parameters(recurse=False)]
    if own and module not in roots:
        raise ValueError(
            f"{type(module).__name__} holds parameters directly ({own[:5]}); the automatic sharding cannot give them"
            " a root whose forward gathers them. Move them into a submodule, or shard in `configure_model`."
        )
    wanted = default_shard_classes(module) if shard_modules is None else _class_names(shard_modules)
    names = {m: name for name, m in module.named_modules()}
    layers = [m for name, m in module.named_modules() if name and type(m).__name__ in wanted]
    extra_roots = [] if module in roots else [child for child in module.children() if _has_unsharded_parameters(child)]
    done: list[str] = []
    for m in [*layers, *[r for r in roots if r is not module], *extra_roots, *[r for r in roots if r is module]]:
        if (m is module and m not in roots) or isinstance(m, FSDPModule) or not _has_unsharded_parameters(m) \
                and m not in roots:
            continue
        fully_shard(m, mesh=mesh, **fsdp_kwargs)
        done.append(names[m])
    return done


def _has_unsharded_parameters(module: nn.Module) -> bool:
    return any(not isinstance(p, DTensor) for p in module.parameters())
