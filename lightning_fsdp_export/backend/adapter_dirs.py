"""Adapter directories on a server's host: where our gloo workers write the adapters a round carries, and how old
versions and runs are removed (the trainer side names the same layout: :data:`SERVER_ADAPTER_ROOT`)."""

from __future__ import annotations

import os
import shutil
import time
import uuid
from pathlib import Path

import torch
from safetensors.torch import save_file

__all__ = ["SERVER_ADAPTER_ROOT", "STALE_RUN_SECONDS", "make_private_dirs", "prune_runs", "prune_versions",
           "server_layout", "write_adapter_dir"]

SERVER_ADAPTER_ROOT = f"/tmp/lightning-fsdp-export-{os.getuid()}/adapters"
"""Where our gloo workers write adapters sent over the transport, on each server's host: ``<run>/<name>/v<version>``
under it. Private (the workers create it with mode 0700) and never named like a Python module: a directory
``/tmp/lightning_fsdp_export`` would shadow this package for every process with ``/tmp`` on its path."""

STALE_RUN_SECONDS = 3600.0
"""A run's adapter directories on a server's host untouched this long are removed when another run writes there."""


def prune_versions(parent: Path, keep: int = 2) -> None:
    """Remove the adapter version directories (``v<number>``) in ``parent`` but the ``keep`` newest: the current one
    and the one before (a server may still be loading it; vLLM holds a loaded adapter in memory)."""
    versions = sorted((p for p in parent.glob("v[0-9]*") if p.is_dir() and p.name[1:].isdigit()),
                      key=lambda p: int(p.name[1:]))
    for old in versions[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def server_layout(version_dir: Path) -> tuple[Path, str] | None:
    """``(root, run)`` when ``version_dir`` is ``.../lightning-fsdp-export-<uid>/adapters/<run>/<name>/v<N>`` (what
    :data:`SERVER_ADAPTER_ROOT` lays out), else ``None``: nothing but such a directory's own runs is ever pruned."""
    parts = version_dir.parts
    if (len(parts) < 6 or not version_dir.is_absolute() or not parts[-1].startswith("v") or parts[-4] != "adapters"
            or not parts[-5].startswith("lightning-fsdp-export-")):
        return None
    return version_dir.parents[2], parts[-3]


def make_private_dirs(path: Path, root: Path) -> None:
    """Create ``path`` and every missing directory from ``root`` down to it with mode 0700 (``os.makedirs`` applies a
    mode to the leaf only); what is above ``root`` as usual."""
    root.parent.mkdir(parents=True, exist_ok=True)
    missing = [p for p in [path, *path.parents] if not p.exists() and (p == root or root in p.parents)]
    for directory in reversed(missing):
        directory.mkdir(mode=0o700, exist_ok=True)


def prune_runs(root: Path, current: str, *, older_than: float = STALE_RUN_SECONDS) -> list[Path]:
    """Remove the run directories under ``root`` other than ``current`` whose newest version was written more than
    ``older_than`` seconds ago (finished or killed runs; a live run writes a version every sync); the removed ones."""
    now = time.time()
    removed = []
    for run in root.iterdir() if root.is_dir() else []:
        if run.name == current or not run.is_dir():
            continue
        newest = max((p.stat().st_mtime for p in run.glob("*/v[0-9]*")), default=run.stat().st_mtime)
        if now - newest > older_than:
            shutil.rmtree(run, ignore_errors=True)
            removed.append(run)
    return removed


def write_adapter_dir(path: str, tensors: dict[str, torch.Tensor], config: str) -> None:
    """Write a peft adapter directory at ``path`` (``<root>/<run>/<name>/v<version>``: ``adapter_model.safetensors``,
    ``adapter_config.json``), each file replaced atomically (workers of one server on one host write the same files);
    version directories beside it older than the one before are removed (vLLM keeps a loaded adapter in memory), and
    so are other runs' directories untouched for :data:`~lightning_fsdp_export.transfer.adapters.STALE_RUN_SECONDS`.
    Directories it creates are private (0700)."""
    target = Path(path)
    layout = server_layout(target)
    if layout is None:  # another layout (a test's directory): only what is asked
        target.mkdir(parents=True, exist_ok=True)
    else:
        root, run = layout
        make_private_dirs(target, root.parent)  # the per-user directory above the root too
        prune_runs(root, current=run)  # older runs' leftovers on this host
    tmp = f".tmp{uuid.uuid4().hex}"  # per writer: workers of one server (or one process) write side by side
    save_file(tensors, str(target / f"adapter_model.safetensors{tmp}"), metadata={"format": "pt"})
    (target / f"adapter_config.json{tmp}").write_text(config)
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        os.replace(target / f"{name}{tmp}", target / name)
    prune_versions(target.parent)
