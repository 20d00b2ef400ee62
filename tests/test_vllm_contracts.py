"""Our vLLM ``WeightSource`` views under the contract of the vLLM in this process, 0.32 or 0.33.

Run as part of the suite against the installed vLLM 0.32, and once more (``test_the_same_tests_pass_against_vllm_0_33``)
in a subprocess where ``vllm.distributed.weight_transfer`` is vLLM 0.33's own package (``tests/vllm033.py``;
``make vllm033`` takes it from the 0.33.0 wheel), together with the whole gloo protocol test module
(``tests/test_gloo_backend.py``: our gloo engines on 0.33's engine base classes, both halves in one process) and
the ``RemoteVLLM`` / ``NativeTransfer`` unit tests (``tests/test_transfer_unit.py``, through 0.33's factory).
0.33's NCCL, IPC and M2N engines need CUDA (and NVIDIA's nccl-extensions): ``benchmarks/gpu_check.sh`` runs them.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from lightning_fsdp_export import _compat
from lightning_fsdp_export.export.shards import ShardSource
from lightning_fsdp_export.export.source import ExportSource
from lightning_fsdp_export.export.vllm_source import FSDP2M2NSource, FSDP2WeightSource, RowShardMeta
from tests.conftest import ROOT

OVERLAY = ROOT / ".vllm033" / "weight_transfer"
CONTRACT = _compat.weight_source_contract()


def tensors(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [("model.embed_tokens.weight", torch.randn(6, 4, generator=g)),
            ("model.layers.0.q.weight", torch.randn(4, 4, generator=g)),
            ("model.norm.weight", torch.randn(4, generator=g))]


def full(items: list[tuple[str, torch.Tensor]]) -> ExportSource:
    return ExportSource(lambda: [([n], t) for n, t in items], lambda: iter(items), dtype=torch.float32)


def shards(items: list[tuple[str, torch.Tensor]], rank: int = 0) -> ShardSource:
    """Two trainer ranks: the 2-D tensors as each rank's rows (torch.chunk), the norm whole."""
    def layout(names: list[str], tensor: torch.Tensor) -> tuple[int, ...] | None:
        return None if tensor.ndim == 1 else (0, tensor.shape[0] // 2, tensor.shape[0])

    def export() -> object:
        for name, tensor in items:
            bounds = layout([name], tensor)
            yield name, tensor if bounds is None else tensor[bounds[rank]:bounds[rank + 1]]

    return ShardSource(lambda: [([n], t) for n, t in items], export, layout=layout, world=2, dtype=torch.float32)


def test_the_contract_is_read_from_vllms_api() -> None:
    from vllm.distributed.weight_transfer import base

    assert ("0.33" if hasattr(base, "Shard") else "0.32") == CONTRACT
    assert os.environ.get("LFE_EXPECT_CONTRACT", CONTRACT) == CONTRACT  # the 0.33 job asks for "0.33"


def test_the_full_source_declares_what_it_yields_and_follows_each_syncs_export() -> None:
    first, second = tensors(0), tensors(1)
    source = FSDP2WeightSource(full(first))
    meta = _compat.source_metadata(source)
    assert [(m.name, m.dtype, tuple(m.shape)) for m in meta] == [(n, t.dtype, tuple(t.shape)) for n, t in first]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(_compat.iter_full(source), first))
    source.export = full(second + [("lm_head.weight", torch.zeros(6, 4))])  # the next sync: metadata follows
    assert [m.name for m in _compat.source_metadata(source)][-1] == "lm_head.weight"
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(_compat.iter_full(source), second))
    if CONTRACT == "0.33":  # what 0.33's NCCL/IPC trainer_init and engines check and read
        assert source.implements_iter_full() and not source.implements_iter_local()
        assert source.owned_names(1) == [m.name for m in source.metadata]
        assert source.metadata is source.metadata  # cached: engines read it repeatedly


def test_shard_rows_reach_our_gloo_backend_as_bounds() -> None:
    meta = _compat.source_metadata(FSDP2WeightSource(shards(tensors(0))))
    assert [type(m) for m in meta] == [RowShardMeta] * 3
    assert [m.bounds for m in meta] == [(0, 3, 6), (0, 2, 4), None]


def test_the_m2n_source_is_what_vllms_m2n_plans_from() -> None:
    source = FSDP2M2NSource(shards(tensors(0), rank=1))
    meta = _compat.source_metadata(source)
    if CONTRACT == "0.33":
        from vllm.distributed.weight_transfer.base import Shard
        from vllm.distributed.weight_transfer.m2n_common import REPLICATE, REPLICATED, m2n_param_meta

        assert source.implements_iter_local() and not source.implements_iter_full()
        assert [(m.owners, m.placements) for m in meta] == [((0, 1), (Shard(0),))] * 2 + [(None, None)]
        planned = [m2n_param_meta(m, 2) for m in meta]  # 0.33's own conversion; it refuses partial owners
        assert [p.source_layout.placements for p in planned] == [(0, REPLICATE), (0, REPLICATE), REPLICATED]
        assert [p.source_layout.mesh.dims for p in planned] == [(2, 1)] * 3
        pairs = list(source.iter_local())
    else:
        from vllm.distributed.weight_transfer.m2n_common import REPLICATE, REPLICATED

        assert [m.placements for m in meta] == [(0, REPLICATE), (0, REPLICATE), REPLICATED]
        assert source.mesh().dims == (2, 1)
        pairs = list(source)
    assert [tuple(t.shape) for _, t in pairs] == [(3, 4), (2, 4), (4,)]  # rank 1's rows, the norm whole


@pytest.mark.subprocess  # a nested pytest (up to 600 s)
def test_the_same_tests_pass_against_vllm_0_33() -> None:
    if CONTRACT == "0.33":
        pytest.skip("this is the 0.33 job itself")
    if not OVERLAY.joinpath("base.py").exists():
        pytest.fail(f"{OVERLAY} is missing: `make vllm033` (part of `make setup`) takes it from the vLLM 0.33.0 wheel.")
    env = {**os.environ, "LFE_VLLM_WEIGHT_TRANSFER": str(OVERLAY), "LFE_EXPECT_CONTRACT": "0.33",
           "PYTEST_ADDOPTS": ""}  # the outer run's options (--durations, -x) are not this job's
    # the gloo module's last test builds a real vLLM 0.32 engine: not a 0.33 contract test
    # and our NativeTransfer driving a recording stand-in of vLLM's trainer engines, built through 0.33's factory
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__)),
                           str(ROOT / "tests" / "test_gloo_backend.py"), str(ROOT / "tests" / "test_transfer_unit.py"),
                           "-k", "not llm_in_this_process"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    # the summary line, not any "failed" (test names have it: test_a_failed_replica_...)
    assert re.search(r"\b\d+ passed", proc.stdout) and not re.search(r"\b\d+ (failed|error)", proc.stdout), proc.stdout
