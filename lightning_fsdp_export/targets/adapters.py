"""LoRA adapters into vLLM servers: the checks before a push, the load, and an adapter as a transfer source.

vLLM's OpenAI server loads adapters at run time (``POST /v1/load_lora_adapter`` with ``lora_name``,
``lora_path``, ``load_inplace``) when started with ``--enable-lora --max-lora-rank R`` and the environment
variable ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``. ``RemoteVLLM`` loads every version under one stable name
(clients keep asking for ``model=<that name>``), from a new path per version: vLLM's prefix cache keys an
adapter's blocks by its path, so no cached prompt of an older adapter is reused.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import Tensor

from lightning_fsdp_export.targets.http import Server, ServerError, on_all

__all__ = ["AdapterFiles", "AdapterTensors", "adapter_problems", "adapter_rank", "load_adapter", "make_private_dirs",
           "prune_runs", "prune_versions", "server_layout"]

SERVER_ADAPTER_ROOT = f"/tmp/lightning-fsdp-export-{os.getuid()}/adapters"
"""Where our gloo workers write adapters sent over the transport, on each server's host: ``<run>/<name>/v<version>``
under it. Private (the workers create it with mode 0700) and never named like a Python module: a directory
``/tmp/lightning_fsdp_export`` would shadow this package for every process with ``/tmp`` on its path."""

STALE_RUN_SECONDS = 3600.0
"""A run's adapter directories on a server's host untouched this long are removed when another run writes there."""


@dataclass(frozen=True)
class AdapterFiles:
    """One version of a peft adapter directory as the sync wrote it on this rank."""

    path: Path

    @property
    def config(self) -> str:
        """``adapter_config.json``'s text."""
        return (self.path / "adapter_config.json").read_text()

    def tensors(self) -> list[tuple[str, Tensor]]:
        """``adapter_model.safetensors``' tensors, in name order."""
        return sorted(load_file(str(self.path / "adapter_model.safetensors")).items())


@dataclass(frozen=True)
class _Meta:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


class AdapterTensors:
    """An adapter's tensors as a transfer source (what ``FSDP2WeightSource`` wraps): no collective, every rank
    holds the same tensors, so every pass yields them all."""

    def __init__(self, tensors: Sequence[tuple[str, Tensor]]) -> None:
        self._tensors = list(tensors)

    def metadata(self) -> list[_Meta]:
        return [_Meta(name, t.dtype, tuple(t.shape)) for name, t in self._tensors]

    def __iter__(self) -> Iterator[tuple[str, Tensor]]:
        return iter(self._tensors)

    def drain(self) -> None:
        """Nothing to finish: no pass holds a collective."""


def adapter_rank(shapes: Sequence[tuple[str, tuple[int, ...]]]) -> int:
    """The adapter's LoRA rank: the largest first dimension of its ``lora_A`` tensors (0: none)."""
    return max((shape[0] for name, shape in shapes if ".lora_A." in name and shape), default=0)


def adapter_problems(servers: Sequence[Server], rank: int) -> list[str]:
    """What keeps each server from loading a rank-``rank`` adapter at run time, one line per problem with its fix:
    LoRA off, a smaller ``--max-lora-rank``, or runtime updating off (its route answers 404)."""
    def check(server: Server) -> list[str]:
        info = server.request("GET", "/server_info?config_format=json")
        lora = (info.get("vllm_config") or {}).get("lora_config")  # None without --enable-lora
        problems = []
        if not lora:
            problems.append(f"{server.url} was started without --enable-lora: restart it with --enable-lora"
                            f" --max-lora-rank {rank} (or more)")
        elif lora.get("max_lora_rank") is not None and int(lora["max_lora_rank"]) < rank:
            problems.append(f"{server.url} takes LoRA ranks up to --max-lora-rank {lora['max_lora_rank']}, and this"
                            f" adapter has rank {rank}: restart it with --max-lora-rank {rank} (or more)")
        try:  # an empty body: 400/422 from the route, or 404 without runtime updating
            server.request("POST", "/v1/load_lora_adapter", {})
        except ServerError as err:
            if " answered 404" in str(err):
                problems.append(f"{server.url} does not load adapters at run time (POST /v1/load_lora_adapter answered"
                                " 404): start it with the environment variable VLLM_ALLOW_RUNTIME_LORA_UPDATING=True")
        return problems

    return [line for lines in on_all(servers, check) for line in lines]


def load_adapter(servers: Sequence[Server], name: str, path: str) -> None:
    """Every server loads the peft directory ``path`` (on its host) as ``name``, replacing the adapter of that name in
    place; a server that cannot is named with vLLM's reason (its previous adapter stays loaded)."""
    body = {"lora_name": name, "lora_path": os.fspath(path), "load_inplace": True}
    on_all(servers, lambda s: s.request("POST", "/v1/load_lora_adapter", body))


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
