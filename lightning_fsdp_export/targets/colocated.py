"""A vLLM engine on every trainer rank, updated in place by streaming the export into it."""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lightning_fsdp_export._compat import (
    add_lora,
    engine_dtype,
    engine_model_path,
    engine_runs_in_process,
    import_vllm,
    remove_lora,
)
from lightning_fsdp_export.agreement import compare_shapes
from lightning_fsdp_export.targets.directory import read_checkpoint_shapes

if TYPE_CHECKING:
    import lightning.pytorch as pl


class ColocatedVLLM:
    """An ``LLM`` built on every rank at setup (``external_launcher``), exposed as ``.llm`` for rollouts.

    Each sync is one call per rank: ``llm.collective_rpc("reload_weights", kwargs={"weights_iterator":
    stream})`` (never one call per tensor: measured 13.7x slower), then ``llm.reset_prefix_cache()``
    so no prompt KV computed with the old weights is reused.

    Args:
        model: path of the HF checkpoint the engine starts from (the trainer's initial weights).
        llm: an ``LLM`` you built yourself instead; it must run its engine in this process (built with
            ``distributed_executor_backend="external_launcher"`` or ``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
        tensor_parallel_size: vLLM tensor parallelism across the trainer's ranks (1 or the world size).
        **llm_kwargs: passed to ``vllm.LLM`` (``dtype``, ``max_model_len``, ``enforce_eager``, ...).
    """

    def __init__(self, model: str | os.PathLike[str] | None = None, *, llm: Any = None,
                 tensor_parallel_size: int = 1, **llm_kwargs: Any) -> None:
        if (model is None) == (llm is None):
            raise ValueError("ColocatedVLLM needs exactly one of model=PATH (an HF checkpoint directory) or llm=LLM(...).")
        if llm is not None and llm_kwargs:
            raise ValueError(f"ColocatedVLLM(llm=...) builds nothing, so {sorted(llm_kwargs)} would be ignored.")
        if llm is not None:
            _check_in_process(llm)
        if not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
            raise ValueError(f"ColocatedVLLM(tensor_parallel_size={tensor_parallel_size!r}) must be a positive int.")
        self._model = None if model is None else os.fspath(model)
        self._tp = tensor_parallel_size
        self._llm_kwargs = llm_kwargs
        self.llm: Any = llm
        self._expected: dict[str, tuple[int, ...]] | None = None
        self._tied = False
        self.lora_request: Any = None
        """The ``LoRARequest`` of the latest adapter pushed with ``VLLMWeightSync(lora="adapter")``; pass it to
        ``llm.generate(..., lora_request=...)`` so rollouts use the current adapter."""

    @property
    def dtype(self) -> torch.dtype | None:
        return None if self.llm is None else engine_dtype(self.llm)

    def setup(self, trainer: pl.Trainer) -> None:
        if self.llm is not None:
            return
        vllm = import_vllm()
        world = trainer.world_size
        if world % self._tp:
            raise ValueError(f"ColocatedVLLM(tensor_parallel_size={self._tp}) must divide the world size {world}.")
        os.environ.update(RANK=str(trainer.global_rank), LOCAL_RANK=str(trainer.local_rank), WORLD_SIZE=str(world))
        kwargs = {"seed": 0, **self._llm_kwargs}
        with _preserved_rng():  # building an LLM with a seed reseeds the process's global RNG
            self.llm = vllm.LLM(model=self._model, tensor_parallel_size=self._tp,
                                distributed_executor_backend="external_launcher", **kwargs)

    def push(self, weights: Iterator[tuple[str, Tensor]], *, version: int) -> None:
        if self.llm is None:
            raise RuntimeError("ColocatedVLLM.push() before setup(): the engine is built when the fit starts.")
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self.llm.reset_prefix_cache()

    def check_weights(self, exported: list[tuple[str, tuple[int, ...]]]) -> list[str]:
        """Where ``exported`` disagrees with the engine's checkpoint (names and shapes from its safetensors
        headers); empty when they agree, or when the checkpoint is not a local directory."""
        if self._expected is None:
            path = Path(self._model or engine_model_path(self.llm))
            self._expected = read_checkpoint_shapes(path) if path.is_dir() else {}
            config = path / "config.json"
            self._tied = config.is_file() and bool(json.loads(config.read_text()).get("tie_word_embeddings", False))
        if not self._expected:
            return []
        return compare_shapes(exported, self._expected, may_be_absent={"lm_head.weight"} if self._tied else set())

    def push_adapter(self, path: str | os.PathLike[str], *, version: int) -> None:
        """Load the peft adapter directory ``path`` as a new LoRA (id ``version``) and drop the previous one."""
        from vllm.lora.request import LoRARequest

        request = LoRARequest(f"policy-v{version}", version, os.fspath(path))
        add_lora(self.llm, request)
        if self.lora_request is not None and self.lora_request.lora_int_id != version:
            remove_lora(self.llm, self.lora_request.lora_int_id)
        self.lora_request = request
        self.llm.reset_prefix_cache()

    def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        """The engine's logprob of each token of ``token_ids`` given the ones before it (used by ``verify``).

        Uses the current adapter (``lora_request``) when one was pushed.
        """
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        (out,) = self.llm.generate([{"prompt_token_ids": token_ids}], params, use_tqdm=False,
                                   lora_request=self.lora_request)
        return [entry[tok].logprob for entry, tok in zip(out.prompt_logprobs[1:], token_ids[1:])]

    def teardown(self) -> None:
        pass


def _check_in_process(llm: Any) -> None:
    if not engine_runs_in_process(llm):
        raise ValueError(
            "ColocatedVLLM(llm=...) needs an engine running in this process: a multiprocess engine receives"
            " streamed tensors as lists. Build it with distributed_executor_backend='external_launcher' (or set"
            " VLLM_ENABLE_V1_MULTIPROCESSING=0), or pass model=PATH and let the target build it."
        )


@contextmanager
def _preserved_rng() -> Iterator[None]:
    state = (random.getstate(), torch.get_rng_state(),
             torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
    try:
        import numpy as np

        np_state = np.random.get_state()
    except ImportError:  # pragma: no cover
        np_state = None
    try:
        yield
    finally:
        random.setstate(state[0])
        torch.set_rng_state(state[1])
        if state[2] is not None:
            torch.cuda.set_rng_state_all(state[2])
        if np_state is not None:
            import numpy as np

            np.random.set_state(np_state)
