"""Our ``staged_nccl`` engines (``RemoteVLLM(transport=StagedNCCL())``) on one CUDA GPU: two processes, a trainer rank
and a server's worker, run by gpu_check.sh.

    python benchmarks/staged_nccl_check.py --weight-transfer .vllm033/weight_transfer

The engines are ours, run as a vLLM server runs them (the worker's ``update_weights`` behind a client); what stands in:
vLLM itself is not installed on the GPU machine (its wheel is too large to carry), so its weight-transfer package (pure
Python, from the 0.33 wheel: ``make vllm033``) is imported under stubs of the four vLLM modules it and our engines
import
(config classes, the logger, the layerwise reload, the MTP check: no-ops), and the worker's model is a stand-in whose
``load_weights`` copies each tensor into its preallocated GPU buffer (what a weight loader does). NCCL refuses two ranks
of one communicator on one device of one host, so each process names a host of its own (``NCCL_HOSTID``; the bytes go
over NCCL's socket transport).

Checked, per staging (``device``, ``host``): a staged round touches no model until its swap; after the swap every
tensor equals the trainer's (device checksums); the swap's time (the servers' pause); a round whose source fails midway
leaves the model on the previous version, refuses its swap, and the next round works. Prints ``RESULT`` lines.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
STUBS = {
    "vllm/__init__.py": "",
    "vllm/logger.py": "import logging\n\ndef init_logger(name):\n    return logging.getLogger(name)\n",
    "vllm/config/__init__.py": "class VllmConfig:\n    pass\n",
    "vllm/config/parallel.py": "class ParallelConfig:\n    pass\n",
    "vllm/config/weight_transfer.py": "class WeightTransferConfig:\n    pass\n",
    "vllm/distributed/__init__.py": "",
    "vllm/model_executor/__init__.py": "",
    "vllm/model_executor/model_loader/__init__.py": "",
    "vllm/model_executor/model_loader/mtp_validation.py":
        "import contextlib\n\ndef disable_mtp_completeness_check():\n    return contextlib.nullcontext()\n",
    "vllm/model_executor/model_loader/reload.py":
        "def initialize_layerwise_reload(model):\n    pass\n\n"
        "def finalize_layerwise_reload(model, config):\n    pass\n",
}


def stub_vllm(weight_transfer: Path) -> None:
    """Make ``import vllm.distributed.weight_transfer`` work from vLLM's own files (see the module's docstring)."""
    try:
        import vllm.distributed.weight_transfer.base  # noqa: F401 - a real vLLM: use it
        return
    except ImportError:
        pass
    root = Path(tempfile.mkdtemp(prefix="lfe-vllm-stub-"))
    for name, text in STUBS.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    shutil.copytree(weight_transfer, root / "vllm/distributed/weight_transfer")
    sys.path.insert(0, str(root))


def tensors(seed: int, mib: int) -> dict[str, torch.Tensor]:
    """A model's worth of bf16 tensors on the GPU (``mib`` in all, 24 tensors)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    rows = mib * (1 << 20) // (24 * 4096 * 2)
    return {f"model.layers.{i}.mlp.weight": torch.randn(rows, 4096, generator=g, device="cuda").to(torch.bfloat16)
            for i in range(24)}


class Model(torch.nn.Module):
    """A worker's model: ``load_weights`` copies into preallocated GPU buffers."""

    def __init__(self, shapes: dict[str, torch.Size]) -> None:
        super().__init__()
        self.buffers_ = {n: torch.zeros(s, dtype=torch.bfloat16, device="cuda") for n, s in shapes.items()}

    def load_weights(self, weights: Any) -> None:
        for name, tensor in weights:
            self.buffers_[name].copy_(tensor, non_blocking=True)


def checksums(named: dict[str, torch.Tensor]) -> dict[str, int]:
    from lightning_fsdp_export.backend.protocol import device_checksum

    return {n: device_checksum(0, t) for n, t in named.items()}


def worker(conn: Any, port: int, staging: str, shapes: dict[str, torch.Size], fault: str = "", mib: int = 0) -> None:
    from lightning_fsdp_export.backend.staged_nccl import StagedNCCLInitInfo, StagedNCCLWeightTransferEngine

    model = Model(shapes)
    engine = StagedNCCLWeightTransferEngine.__new__(StagedNCCLWeightTransferEngine)  # no vLLM config: see docstring
    engine.model, engine.group, engine._store, engine._reloading = model, None, None, False
    engine._start_reload = lambda: None
    engine._base, engine._kept, engine._staging, engine.times = {}, None, None, {}
    engine.wire_device, engine.staging, engine.on_device, engine._side = torch.device("cuda", 0), staging, True, None
    while True:
        try:
            method, payload = conn.recv()
        except EOFError:  # the trainer process is gone (the "trainer" fault): what became of the round?
            died = time.perf_counter()
            staged = engine._staging
            if staged is not None and staged.thread is not None:
                staged.thread.join(120)
            ended = time.perf_counter() - died
            torch.cuda.current_stream().synchronize()  # (a device-wide sync would wait on the transfer's streams)
            kept = checksums(model.buffers_) == checksums(tensors(1, mib))
            error = ("none" if staged is None or staged.error is None
                     else f"{type(staged.error).__name__}: {staged.error}")
            print(f"RESULT staged_nccl fault (trainer killed mid-transfer): the worker process lives on; its staged"
                  f" round ended {ended:.2f} s after the trainer died, with {error[:160]!r}; the model still serves"
                  f" version 1: {kept}", flush=True)
            return
        try:
            if method == "stop":
                conn.send(("ok", None))
                return
            if method == "init_weight_transfer_engine":
                info = StagedNCCLInitInfo(**payload)
                engine.staging = info.staging
                engine.join(info, info.rank_offset)
                answer: Any = None
            elif method == "update_weights":
                start = time.perf_counter()
                engine.update_weights(payload)
                answer = time.perf_counter() - start
                if fault == "worker" and payload.get("stage_as") == "v2":  # dies while the version travels
                    threading.Timer(0.15, os._exit, args=(1,)).start()
            elif method == "checksums":
                torch.cuda.synchronize()
                answer = checksums(model.buffers_)
            elif method == "staging":
                answer = engine.on_device
            else:  # start / finish: the server's session, nothing for the engine here
                answer = None
            conn.send(("ok", answer))
        except BaseException as err:  # noqa: BLE001 - the trainer's client raises it
            conn.send(("error", f"{type(err).__name__}: {err}"))


class PipeClient:
    """vLLM's four-method client, over a pipe to the worker process (as a server's HTTP routes would)."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def call(self, method: str, payload: Any = None) -> Any:
        self.conn.send((method, payload))
        status, answer = self.conn.recv()
        if status != "ok":
            raise RuntimeError(answer)
        return answer

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.call("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        self.call("start")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.last_update_s = self.call("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.call("finish")


def on_the_gpu(rank: int, mib: int) -> dict[str, torch.Size]:
    """This process on the one GPU, as a host of its own to NCCL (see the module's docstring); the model's shapes."""
    os.environ["NCCL_HOSTID"] = f"lfe-staged-{rank}"
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_IB_DISABLE", "1")
    torch.cuda.set_device(0)
    return {n: t.shape for n, t in tensors(0, mib).items()}


def run(rank: int, conns: list[Any], port: int, staging: str, mib: int) -> None:
    shapes = on_the_gpu(rank, mib)
    if rank == 1:
        worker(conns[1], port, staging, shapes)
        return
    try:
        trainer(PipeClient(conns[0]), port, staging, mib)
    except BaseException:  # noqa: BLE001 - a check's result line, printed whatever stopped it
        traceback.print_exc()
        print(f"RESULT staged_nccl ({staging} staging): FAILED (see the traceback above)", flush=True)
    finally:
        PipeClient(conns[0]).call("stop")


def trainer(client: PipeClient, port: int, staging: str, mib: int) -> None:
    from lightning_fsdp_export.backend.staged_nccl import (
        StagedNCCLTrainerInitInfo,
        StagedNCCLTrainerWeightTransferEngine,
    )
    from lightning_fsdp_export.backend.trainer import GlooRound, swap_update_info
    from lightning_fsdp_export.export.source import ExportSource
    from lightning_fsdp_export.export.vllm_source import FSDP2WeightSource

    current: dict[str, Any] = {"tensors": tensors(1, mib), "fail_at": None}

    def export() -> Any:
        for name, tensor in current["tensors"].items():
            if name == current["fail_at"]:
                raise RuntimeError(f"export failed at {name}")
            yield name, tensor

    source = FSDP2WeightSource(ExportSource(lambda: [([n], t) for n, t in current["tensors"].items()], export,
                                            dtype=None))
    info = StagedNCCLTrainerInitInfo(rank=0, master_address="127.0.0.1", master_port=port, world_size=2,
                                     timeout_s=60, staging=staging)
    engine = StagedNCCLTrainerWeightTransferEngine.trainer_init(info, client=client, source=source)
    zeros = client.call("checksums")
    results = []
    for version in (1, 2):
        current["tensors"] = tensors(version, mib)
        start = time.perf_counter()
        engine.send_weights(GlooRound(stage_as=f"v{version}"))
        sent = time.perf_counter() - start
        untouched = client.call("checksums") == (zeros if version == 1 else checksums(tensors(1, mib)))
        client.start_weight_update()
        client.update_weights(swap_update_info(f"v{version}"))
        client.finish_weight_update()
        equal = client.call("checksums") == checksums(current["tensors"])
        results.append((sent, client.last_update_s, untouched, equal))
    on_device = client.call("staging")
    current["tensors"], current["fail_at"] = tensors(3, mib), "model.layers.12.mlp.weight"
    try:
        engine.send_weights(GlooRound(stage_as="v3"))
        failed = "the round did not fail"
    except RuntimeError as err:
        failed = str(err).split(";")[0]
    try:
        client.update_weights(swap_update_info("v3"))
        refused = "the swap was not refused"
    except RuntimeError as err:
        refused = str(err)[:120]
    kept = client.call("checksums") == checksums(tensors(2, mib))
    current["fail_at"] = None
    engine.send_weights(GlooRound(stage_as="v4"))
    client.update_weights(swap_update_info("v4"))
    recovered = client.call("checksums") == checksums(tensors(3, mib))
    gib = mib / 1024
    for version, (sent, swap_s, untouched, equal) in enumerate(results, 1):
        print(f"RESULT staged_nccl ({staging} staging, kept on {'GPU' if on_device else 'pinned host'}): version"
              f" {version}, {gib:.2f} GiB sent in {sent:.3f} s (socket transport), model untouched until the swap:"
              f" {untouched}, swap (the pause) {swap_s * 1e3:.1f} ms, every tensor equal after it: {equal}", flush=True)
    print(f"RESULT staged_nccl ({staging} staging): a source failing midway -> {failed!r}; its swap -> {refused!r};"
          f" model still version 2: {kept}; the next round swaps in: {recovered}", flush=True)


def fault_run(rank: int, conn: Any, port: int, fault: str, mib: int) -> None:
    """Version 1 staged and swapped in, then version 2 with ``fault``: the trainer process (``"trainer"``) or the
    worker process (``"worker"``) dies while it travels."""
    shapes = on_the_gpu(rank, mib)
    if rank == 1:
        import faulthandler

        faulthandler.dump_traceback_later(45, exit=False)  # where it waits, if it does
        worker(conn, port, "device", shapes, fault, mib)
        os._exit(0)  # a communicator whose peer died may block the interpreter's exit
    from lightning_fsdp_export.backend.staged_nccl import (
        StagedNCCLTrainerInitInfo,
        StagedNCCLTrainerWeightTransferEngine,
    )
    from lightning_fsdp_export.backend.trainer import GlooRound, swap_update_info
    from lightning_fsdp_export.export.source import ExportSource
    from lightning_fsdp_export.export.vllm_source import FSDP2WeightSource

    client = PipeClient(conn)
    current = {"tensors": tensors(1, mib), "version": 1}

    def export() -> Any:
        for index, (name, tensor) in enumerate(current["tensors"].items()):
            if fault == "trainer" and current["version"] == 2 and index == 12:
                os._exit(1)  # mid-transfer
            yield name, tensor

    source = FSDP2WeightSource(ExportSource(lambda: [([n], t) for n, t in current["tensors"].items()], export,
                                            dtype=None))
    info = StagedNCCLTrainerInitInfo(rank=0, master_address="127.0.0.1", master_port=port, world_size=2,
                                     timeout_s=20, staging="device", packed_buffer_size_bytes=4 << 20)
    engine = StagedNCCLTrainerWeightTransferEngine.trainer_init(info, client=client, source=source)
    engine.send_weights(GlooRound(stage_as="v1"))
    client.update_weights(swap_update_info("v1"))
    current.update(tensors=tensors(2, mib), version=2)
    start = time.perf_counter()
    try:
        engine.send_weights(GlooRound(stage_as="v2"))
        outcome = "the round did not fail"
    except Exception as err:  # noqa: BLE001 - reported
        outcome = f"{type(err).__name__}: {err}"
    print(f"RESULT staged_nccl fault (worker killed mid-transfer): the trainer's round raised after"
          f" {time.perf_counter() - start:.2f} s (timeout 20 s): {outcome[:200]!r}; the trainer process lives on",
          flush=True)
    os._exit(0)  # a communicator whose peer died may block the interpreter's exit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weight-transfer", type=Path, default=ROOT / ".vllm033/weight_transfer",
                        help="vLLM's weight_transfer package (make vllm033) where vLLM is not installed")
    parser.add_argument("--mib", type=int, default=1024, help="the model's size in MiB (bf16)")
    parser.add_argument("--port", type=int, default=29631)
    parser.add_argument("--faults", nargs="*", default=["trainer", "worker"], choices=["trainer", "worker"],
                        help="which process is killed mid-transfer, in turn")
    parser.add_argument("--faults-only", action="store_true", help="only the fault runs")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("RESULT staged_nccl check skipped: no CUDA GPU")
        return
    stub_vllm(args.weight_transfer)
    sys.path.insert(0, str(ROOT))
    os.environ["PYTHONPATH"] = os.pathsep.join([*sys.path[:2], os.environ.get("PYTHONPATH", "")])
    for offset, staging in enumerate(() if args.faults_only else ("device", "host")):
        conns = list(mp.Pipe())
        mp.spawn(run, args=(conns, args.port + offset, staging, args.mib), nprocs=2)
    context = mp.get_context("spawn")
    for offset, fault in enumerate(args.faults, 2):  # a process dies: plain processes, not mp.spawn's
        conns = list(context.Pipe())
        procs = [context.Process(target=fault_run, args=(rank, conns[rank], args.port + offset, fault, 256))
                 for rank in (0, 1)]  # each process holds only its end: the worker sees EOF when the trainer is gone
        for proc in procs:
            proc.start()
        for conn in conns:
            conn.close()
        for proc in procs:
            proc.join(60)
            if proc.is_alive():
                print(f"RESULT staged_nccl fault ({fault} killed): a process still runs after 60 s", flush=True)
                proc.kill()


if __name__ == "__main__":
    main()
