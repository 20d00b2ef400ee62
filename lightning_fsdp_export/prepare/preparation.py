"""Model preparation: the user's LightningModule made into sharded, materialised, loaded shards.

At setup, in this order (:meth:`ModelPreparation.prepare`): refuse FSDP1, find the model to export, apply
``fully_shard`` where ``configure_model`` did not, allocate meta tensors and fill them (``pretrained=``
checkpoints first, then each model's own init), and put plain tensors where they belong. It owns the
sharding options and the checkpoint directories; it does not move shards between phases
(:mod:`~lightning_fsdp_export.phases.compute`) and does not export (:mod:`~lightning_fsdp_export.export.model_export`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypedDict

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel

from lightning_fsdp_export._common import unknown_options
from lightning_fsdp_export.export.lazy import DEFAULT_BUCKET_BYTES, DEFAULT_PREFETCH
from lightning_fsdp_export.export.lora import is_peft_model
from lightning_fsdp_export.phases.offload import OffloadMode
from lightning_fsdp_export.prepare.materialize import materialize_meta
from lightning_fsdp_export.prepare.pretrained import load_hf_checkpoint
from lightning_fsdp_export.prepare.sharding import auto_shard, is_fully_sharded, outermost, reject_fsdp1

__all__ = ["LazyExportArgs", "LazyExportOptions", "ModelPreparation", "validate_options", "validate_pretrained"]


class LazyExportArgs(TypedDict, total=False):
    """The options both ``LazyExportFSDP2`` strategies (the Trainer's and Fabric's) take beyond Lightning's
    ``ModelParallelStrategy`` (keywords, each optional; its default is :class:`LazyExportOptions`' and is said below).
    """

    shard_modules: Sequence[type[nn.Module] | str] | None
    """Classes (or class names) whose instances are ``fully_shard``-ed one by one before the root. Default: every
    Hugging Face model's ``_no_split_modules`` (for Qwen2, ``Qwen2DecoderLayer``). Ignored when ``configure_model``
    (Fabric: ``parallelize_fn``) applied ``fully_shard`` itself."""
    export_module: str | None
    """Dotted name of the submodule that ``export_weights`` exports (say ``"policy"``). Default: the single
    ``transformers.PreTrainedModel`` (or peft model) found inside the LightningModule (Fabric: the module given to
    ``setup_module``). Any module trains; with none or several candidates, ``export_weights()`` (and a sync) raises
    and lists them."""
    pretrained: str | os.PathLike[str] | Mapping[str, str | os.PathLike[str]] | None
    """A ``save_pretrained`` directory (safetensors) loaded into the exported model's shards right after sharding,
    each rank reading only its slices, cast to the model's dtype; under ``init_module(empty_init=True)`` nothing it
    holds is randomly initialised first (peft adapters keep their init). ``{"policy": dir, "reference": dir}`` loads
    submodules by name. Default ``None``."""
    mixed_precision: MixedPrecisionPolicy | None
    """FSDP2's ``MixedPrecisionPolicy`` for the automatic sharding. Default ``None``."""
    reshard_after_forward: bool
    """FSDP2's ``reshard_after_forward`` for the automatic sharding. Default ``True``."""
    offload: Literal["params", "policy"] | None
    """``None`` (default) keeps shards on the device; ``"params"`` moves sharded parameters to the host (a pinned
    buffer per shard, reused, on CUDA) outside each step's compute phase (its first forward through a sharded module
    to the optimizer step; ``add_phase_listener``) and back for it. ``"policy"`` uses FSDP2's ``CPUOffloadPolicy``
    (shards always on the host, gathered to the device per layer)."""
    offload_optimizer: bool
    """With ``offload="params"``, move the optimizer state along with the parameters. Default ``False``."""
    export_bucket_bytes: int
    """The most bytes (full tensors, after the cast) one all-gather moves: consecutive shards of one decoder layer
    share a gather, a larger tensor is gathered in row blocks of it (bit-identical either way; bounds the export's
    transient memory). 0 (default): each tensor alone."""
    export_prefetch: int
    """All-gathers kept in flight (``async_op=True``) while the consumer takes the current tensor (each costs one more
    tensor of memory). Default 1; 0: none. Measured: BENCHMARKS.md."""


@dataclass(frozen=True)
class LazyExportOptions:
    """The strategies' options as given (:class:`LazyExportArgs` documents each; the field defaults are the options'
    defaults). Both strategies take them as ``**options: Unpack[LazyExportArgs]`` beside Lightning's own keywords and
    hand them to the core with :meth:`of`; each is validated once, where the core builds its parts; each part takes
    them whole. (Here, in the preparation room, so that its ``ModelPreparation`` can take them; ``strategy_core``
    re-exports it.)
    """

    shard_modules: Sequence[type[nn.Module] | str] | None = None
    export_module: str | None = None
    pretrained: str | os.PathLike[str] | Mapping[str, str | os.PathLike[str]] | None = None
    mixed_precision: MixedPrecisionPolicy | None = None
    reshard_after_forward: bool = True
    offload: Literal["params", "policy"] | None = None
    offload_optimizer: bool = False
    export_bucket_bytes: int = DEFAULT_BUCKET_BYTES
    export_prefetch: int = DEFAULT_PREFETCH

    @classmethod
    def of(cls, options: Mapping[str, Any], owner: str) -> LazyExportOptions:
        """The options a strategy was given (its ``**options``; the others keep their defaults); a keyword that is no
        option is refused naming ``owner`` and the nearest option."""
        unknown_options(options, LazyExportArgs, owner)
        return cls(**options)


class ModelPreparation:
    """The sharding and loading options of ``LazyExportFSDP2``, and the set-up steps that use them.

    Args:
        name: the strategy's class name, for error messages.
        options: the strategy's options, whole (this part reads ``shard_modules``, ``export_module``, ``pretrained``,
            validated here into ``{submodule name or None (the exported model): directory}``, ``mixed_precision`` and
            ``reshard_after_forward``).
        offload: the strategy's offload mode, parsed once by the core (``POLICY`` shards with ``CPUOffloadPolicy``).
    """

    def __init__(self, name: str, options: LazyExportOptions, *, offload: OffloadMode) -> None:
        self.name = name
        self.shard_modules = options.shard_modules
        self.export_module_name = options.export_module
        self.pretrained = validate_pretrained(options.pretrained, name)
        self.mixed_precision = options.mixed_precision
        self.reshard_after_forward = options.reshard_after_forward
        self.offload = offload

    def prepare(self, model: nn.Module, lightning_module: nn.Module, *, mesh: DeviceMesh,
                device: torch.device, called: bool = False) -> tuple[nn.Module | None, ValueError | None]:
        """Shard, allocate and fill ``model`` in place; returns the export module (or why there is none).

        An ambiguous or absent export candidate is returned as the error, to be raised only once something
        exports; a name that names nothing, or a checkpoint with nowhere to go, raises now. ``called``: the loop
        calls ``model``'s forward (Fabric's module), so ``model`` is the last root the automatic sharding shards
        (the Trainer's LightningModule is not: its children are the roots).
        """
        reject_fsdp1(model, self.name)
        export_module, error = self._find_export_module(lightning_module)
        self._shard(model, export_module, mesh, called)
        load = (lambda: self._load_pretrained(lightning_module, export_module)) if self.pretrained else None
        # CPUOffloadPolicy keeps shards on the host: allocate them there (plain tensors move later)
        home = torch.device("cpu") if self.offload is OffloadMode.POLICY else device
        materialize_meta(model, home, load=load)
        return export_module, error

    def _find_export_module(self, root: nn.Module) -> tuple[nn.Module | None, ValueError | None]:
        try:
            return _find_export_module(root, self.export_module_name), None
        except ValueError as err:
            if self.export_module_name is not None or (self.pretrained is not None and None in self.pretrained):
                raise
            return None, err

    def _shard(self, model: nn.Module, export_module: nn.Module | None, mesh: DeviceMesh, called: bool) -> None:
        if is_fully_sharded(model):
            if self.offload is OffloadMode.POLICY:
                raise ValueError(
                    f"{self.name}(offload='policy') shards the model itself, but `configure_model` already"
                    " applied `fully_shard`. Pass `offload_policy=CPUOffloadPolicy()` to your own `fully_shard`"
                    " calls and use offload=None, or remove them and let the strategy shard."
                )
            return
        if mesh["tensor_parallel"].size() > 1:
            raise ValueError(
                f"{self.name}(tensor_parallel_size={mesh['tensor_parallel'].size()}) needs `configure_model` to"
                " apply tensor parallelism and `fully_shard` itself; the automatic sharding is pure FSDP."
            )
        roots = [] if export_module in (None, model) else [export_module]
        if called:  # the loop calls ``model``, or any model inside it (a policy and a reference model side by side)
            roots += [m for _, m in outermost(model, _is_export_candidate) if m is not model and m not in roots]
            roots.append(model)
        auto_shard(model, mesh=mesh["data_parallel"], shard_modules=self.shard_modules, roots=roots,
                   fsdp_kwargs=self._fsdp_kwargs(mesh.device_type))

    def _load_pretrained(self, lightning_module: nn.Module, export_module: nn.Module | None) -> list[Tensor]:
        assert self.pretrained is not None
        loaded: list[Tensor] = []
        for name, path in self.pretrained.items():
            if name is None:  # _find_export_module raised already if there is no export module
                assert export_module is not None
                module = export_module
            else:
                try:
                    module = lightning_module.get_submodule(name)
                except AttributeError:
                    children = [n for n, _ in lightning_module.named_children()]
                    raise ValueError(
                        f"{self.name}(pretrained={{{name!r}: ...}}) names no submodule of"
                        f" {type(lightning_module).__name__}; its children are {children}."
                    ) from None
            loaded += load_hf_checkpoint(module, path)
        return loaded

    def _fsdp_kwargs(self, device_type: str) -> dict[str, Any]:
        policy: OffloadPolicy = OffloadPolicy()
        if self.offload is OffloadMode.POLICY:
            policy = CPUOffloadPolicy(pin_memory=device_type == "cuda")
        return {
            "mp_policy": self.mixed_precision or MixedPrecisionPolicy(),
            "reshard_after_forward": self.reshard_after_forward,
            "offload_policy": policy,
        }

    def export_checkpoint(self) -> Path | None:
        """The ``pretrained=`` directory the exported model starts from (``None`` if it starts from none)."""
        paths = self.pretrained or {}
        return paths.get(None) or (paths.get(self.export_module_name) if self.export_module_name else None)


def validate_options(
    strategy: Any,
    shard_modules: Sequence[type[nn.Module] | str] | None,
    export_module: str | None,
    mixed_precision: MixedPrecisionPolicy | None,
    offload_optimizer: bool,
    tensor_parallel_size: int,
) -> None:
    name = type(strategy).__name__
    if shard_modules is not None and (
        isinstance(shard_modules, str)
        or not all(isinstance(c, str) or (isinstance(c, type) and issubclass(c, nn.Module)) for c in shard_modules)
    ):
        raise TypeError(
            f"{name}(shard_modules={shard_modules!r}) must be a list of nn.Module classes or class names,"
            " for example shard_modules=['Qwen2DecoderLayer']."
        )
    if export_module is not None and not isinstance(export_module, str):
        raise TypeError(f"{name}(export_module={export_module!r}) must be a submodule's dotted name, like 'policy'.")
    if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecisionPolicy):
        raise TypeError(
            f"{name}(mixed_precision={mixed_precision!r}) must be a torch.distributed.fsdp.MixedPrecisionPolicy."
        )
    if offload_optimizer and strategy._offload is not OffloadMode.PARAMS:
        raise ValueError(
            f"{name}(offload_optimizer=True) needs offload='params' (got offload={strategy._offload.value!r})."
        )
    if not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
        raise ValueError(f"{name}(tensor_parallel_size={tensor_parallel_size!r}) must be a positive integer.")


def validate_pretrained(pretrained: Any, name: str) -> dict[str | None, Path] | None:
    """``{submodule name or None (the exported model): directory}``, every directory checked to exist."""
    if pretrained is None:
        return None
    wanted = dict(pretrained) if isinstance(pretrained, Mapping) else {None: pretrained}
    out: dict[str | None, Path] = {}
    for key, value in wanted.items():
        shown = f"{{{key!r}: {value!r}}}" if key is not None else repr(value)
        if (key is not None and not isinstance(key, str)) or not isinstance(value, (str, os.PathLike)):
            raise TypeError(
                f"{name}(pretrained={shown}) must be a Hugging Face checkpoint directory, or a mapping from submodule"
                " names to directories like {'policy': 'ckpt', 'reference': 'ckpt'}."
            )
        path = Path(value)
        if not path.is_dir():
            raise ValueError(
                f"{name}(pretrained={shown}): {str(value)!r} is not a directory. Pass the directory `save_pretrained`"
                " wrote (config.json and *.safetensors)."
            )
        out[key] = path
    return out


def _is_export_candidate(module: nn.Module) -> bool:
    return isinstance(module, PreTrainedModel) or is_peft_model(module)


def _find_export_module(root: nn.Module, name: str | None) -> nn.Module:
    """The submodule named ``name``, else the single outermost HF/peft model inside ``root``."""
    candidates = [sub_name for sub_name, _ in outermost(root, _is_export_candidate)]
    if name is not None:
        try:
            return root.get_submodule(name)
        except AttributeError:
            raise ValueError(
                f"export_module={name!r} names no submodule of {type(root).__name__}. Candidates found:"
                f" {candidates or 'none'}; pass the attribute name of the model to export."
            ) from None
    if len(candidates) == 1:
        return root.get_submodule(candidates[0])
    if not candidates:
        children = [n for n, child in root.named_children() if any(True for _ in child.parameters())]
        raise ValueError(
            f"Found no transformers PreTrainedModel (or peft model) inside {type(root).__name__} to export;"
            f" its submodules holding parameters are {children}. Pass LazyExportFSDP2(export_module=...) to name"
            f" the one to export{f', e.g. export_module={children[0]!r}' if children else ''}."
        )
    raise ValueError(
        f"Found several models inside {type(root).__name__} that could be exported: {candidates}."
        f" Pass LazyExportFSDP2(export_module=...) with one of them, e.g. export_module={candidates[0]!r}."
    )


def move_unsharded(module: nn.Module, device: torch.device) -> None:
    """Move plain (non-DTensor) parameters and buffers to ``device``, leaving FSDP2's host shards alone."""
    with torch.no_grad():
        for sub in module.modules():
            for key, param in sub._parameters.items():
                if param is not None and not isinstance(param, DTensor) and param.device != device:
                    sub._parameters[key] = nn.Parameter(param.to(device), requires_grad=param.requires_grad)
            for key, buf in sub._buffers.items():
                if buf is not None and buf.device != device:
                    sub._buffers[key] = buf.to(device)
