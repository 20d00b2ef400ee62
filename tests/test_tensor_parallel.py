"""Tensor parallelism in the trainer, as Lightning's 2-D recipe writes it: 4 gloo ranks, TP 2 x DP 2.

One torchrun job (``tests/scripts/tensor_parallel.py``): the model on meta, ``configure_model`` applying
``ColwiseParallel``/``RowwiseParallel`` on ``tensor_parallel`` then ``fully_shard`` on ``data_parallel``, the
checkpoint loaded by ``pretrained=``. Nothing but these tests keeps that combination working.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import NO_NAME_DIFF, run_torchrun

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    got = run_torchrun("tensor_parallel.py", tmp_path_factory.mktemp("tp") / "results.json", nproc=4, timeout=900)
    for rank, report in enumerate(got):
        assert "crash" not in report, f"rank {rank}: {report['crash']}"
    return got


def test_the_mesh_is_two_by_two(ranks: list[dict[str, Any]]) -> None:
    assert all(r["mesh"] == {"data_parallel": 2, "tensor_parallel": 2} for r in ranks)


@pytest.mark.parametrize("dtype", ["torch.float32", "torch.bfloat16"])
def test_export_of_a_tp_x_dp_model_equals_its_checkpoint_bit_for_bit(ranks: list[dict[str, Any]], dtype: str) -> None:
    for rank, report in enumerate(ranks):
        assert report[f"names_{dtype}"] == NO_NAME_DIFF, (rank, report[f"names_{dtype}"])
        assert report[f"unequal_{dtype}"] == [], (rank, report[f"unequal_{dtype}"])
        assert report[f"dtypes_{dtype}"] == [dtype]


def test_shard_direct_sends_every_tensor_of_a_tp_model_whole(ranks: list[dict[str, Any]]) -> None:
    # 2-D DTensors (and 1-D ones on the data-parallel sub-mesh) are not rows of the whole world: a
    # shard-direct transport gathers each and sends it whole, equal to the checkpoint (checked in the job).
    for report in ranks:
        assert report["shards_layout"]["rows"] == 0
        assert report["shards_layout"]["whole"] > 0


def test_a_sync_after_a_step_pushes_exactly_what_export_weights_gives(ranks: list[dict[str, Any]]) -> None:
    assert ranks[0]["synced_versions"] == [1]
    assert ranks[0]["sync_names_diff"] == NO_NAME_DIFF and all(r["sync_not_equal"] == [] for r in ranks), ranks[0]
    assert ranks[0]["trained"], "the step moved no tensor"  # the names of the tensors training moved


def test_fabric_with_the_same_recipe_exports_what_the_trainer_strategy_exports(ranks: list[dict[str, Any]]) -> None:
    # Fabric's LazyExportFSDP2(parallelize_fn=the recipe, pretrained=ckpt, tensor_parallel_size=2), meta init
    for rank, report in enumerate(ranks):
        fabric = report["fabric"]
        assert fabric["mesh"] == {"data_parallel": 2, "tensor_parallel": 2}, (rank, fabric)
        assert fabric["names"] == NO_NAME_DIFF and fabric["unequal"] == [] and fabric["unequal_to_trainer"] == [], \
            (rank, fabric)
        assert fabric["sync_not_equal"] == [] and fabric["trained"] > 0, (rank, fabric)
    assert ranks[0]["fabric"]["synced_versions"] == [1]
