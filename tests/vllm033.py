"""Run tests against vLLM 0.33's weight-transfer contract with vLLM 0.32 installed (no GPU, no 0.33 engine).

``make vllm033`` takes ``vllm/distributed/weight_transfer/`` (pure Python) out of the vLLM 0.33.0 wheel into
``.vllm033/weight_transfer`` (none of its code is in this repository). With ``LFE_VLLM_WEIGHT_TRANSFER`` set
to that folder, importing this module (``tests/conftest.py`` does, first) makes
``vllm.distributed.weight_transfer`` that package while the rest of vLLM stays the installed 0.32: the
contract, the engines' base classes, the factory, and 0.33's pure-Python m2n planning are 0.33's own.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

NAME = "vllm.distributed.weight_transfer"


def install(folder: str | os.PathLike[str]) -> None:
    """Make ``vllm.distributed.weight_transfer`` the package in ``folder`` (before anything imports it)."""
    folder = Path(folder)
    if not (folder / "base.py").exists():
        raise FileNotFoundError(f"{folder} holds no weight_transfer package: run `make vllm033` first.")
    import vllm.distributed

    for name in [n for n in sys.modules if n == NAME or n.startswith(NAME + ".")]:
        del sys.modules[name]
    spec = importlib.util.spec_from_file_location(NAME, folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[NAME] = module
    spec.loader.exec_module(module)
    vllm.distributed.weight_transfer = module  # type: ignore[attr-defined]


if os.environ.get("LFE_VLLM_WEIGHT_TRANSFER"):
    install(os.environ["LFE_VLLM_WEIGHT_TRANSFER"])
