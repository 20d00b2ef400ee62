"""Old import paths of modules that moved into the rooms' folders: they keep working for one more minor, with a
``DeprecationWarning`` naming the new path (``import lightning_fsdp_export.callback`` gives
``lightning_fsdp_export.sync.callback`` itself, so every name, private ones included, is still there)."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import Any

__all__ = ["MOVED", "forward_old_attribute", "install"]

_P = "lightning_fsdp_export."
MOVED = {_P + old: _P + new for old, new in {
    "preparation": "prepare.preparation", "sharding": "prepare.sharding", "materialize": "prepare.materialize",
    "pretrained": "prepare.pretrained", "offload": "phases.offload",
    "model_export": "export.model_export", "buckets": "export.buckets", "checkpoint_format": "export.checkpoint_format",
    "names": "export.names", "lora": "export.lora", "source": "export.source", "shards": "export.shards",
    "patches": "export.patches", "targets.vllm_source": "export.vllm_source",
    "callback": "sync.callback", "pushes": "sync.pushes", "agreement": "sync.agreement", "verify": "sync.verify",
    "exact": "sync.exact",
    "targets.transports": "transfer.transports", "targets.transfer": "transfer.frame",
    "targets.rounds": "transfer.rounds", "targets.background": "transfer.background",
    "targets.preflight": "transfer.preflight", "targets.http": "transfer.http", "targets.clients": "transfer.clients",
    "targets.adapters": "transfer.adapters", "targets.patch_lists": "transfer.patch_lists",
    "targets.gloo": "backend.gloo", "targets.gloo_infos": "backend.infos",
    "targets.gloo_protocol": "backend.protocol", "targets.gloo_worker": "backend.worker",
    "targets.gloo_trainer": "backend.trainer", "targets.staged_nccl": "backend.staged_nccl",
}.items()}
"""Old module path -> new one (``export`` and ``phases`` are packages now: their old names are forwarded by the
packages' ``__getattr__``)."""

_REMOVAL = "0.3.0"


def _warn(old: str, new: str, stacklevel: int = 3) -> None:
    warnings.warn(f"{old} moved to {new}; the old path will be removed in {_REMOVAL}.", DeprecationWarning,
                  stacklevel=stacklevel)


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old module path and hands out the moved module itself."""

    def __init__(self) -> None:
        self._own_specs: dict[str, importlib.machinery.ModuleSpec] = {}  # old path -> the moved module's own spec

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        return importlib.util.spec_from_loader(fullname, self) if fullname in MOVED else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        _warn(spec.name, MOVED[spec.name])
        module = importlib.import_module(MOVED[spec.name])
        self._own_specs[spec.name] = module.__spec__  # importlib sets the alias's spec on it: put its own back after
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run (the moved module ran under its own name): give it back its own spec."""
        module.__spec__ = self._own_specs.pop(module.__spec__.name)


def install() -> None:
    """Put the finder on ``sys.meta_path`` once (the package's ``__init__`` does)."""
    if not any(isinstance(finder, _OldPaths) for finder in sys.meta_path):
        sys.meta_path.append(_OldPaths())


def forward_old_attribute(package: str, old_module: str, name: str) -> Any:
    """A module's ``__getattr__`` for names that moved to ``old_module`` (``export`` was ``export/lazy.py``;
    ``targets.write_safetensors`` is ``targets.directory``'s own step)."""
    module = importlib.import_module(old_module)
    if name.startswith("__") or not hasattr(module, name):
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    _warn(f"{package}.{name}", f"{old_module}.{name}", stacklevel=4)
    return getattr(module, name)
