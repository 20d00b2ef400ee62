"""Fabric's LazyExportFSDP2 and WeightSync on 2 real gloo ranks (``tests/scripts/fabric.py``, one torchrun job).

The same preparation and export as the Trainer's strategy, in a loop written with Lightning Fabric: the export bit
for bit against the model's own weights and against the Trainer strategy's export of the same model on the same
ranks; the user's ``parallelize_fn``; ``fabric.init_module(empty_init=True)`` with ``pretrained=``;
``offload="params"``; a reference model beside the policy; ``WeightSync`` into memory with ``fabric.save`` /
``fabric.load``. The sync into real servers is
``tests/test_remote_fabric.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.conftest import NO_NAME_DIFF, run_torchrun, scenario

pytestmark = pytest.mark.distributed

SAME = {"names_diff": NO_NAME_DIFF, "tensors": 27, "mismatched": []}  # tiny Qwen2: 26 parameters, lm_head tied


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_torchrun("fabric.py", tmp_path_factory.mktemp("fabric") / "results.json")


def test_fabric_export_equals_the_model_and_the_trainer_strategys_bit_for_bit(results: dict[str, Any]) -> None:
    got = scenario(results, "auto")
    assert got["start"] == SAME and got["vs_trainer"] == SAME, got
    assert got["end"] == SAME and got["path"] == "lazy", got  # after 2 optimizer steps: the trained full state
    # sharded with the module as the root: every parameter a DTensor, the tied head still one parameter
    assert got["dtensors"] == got["params"] == 26 and got["tied"] and got["tied_after_steps"], got
    assert got["losses"][0] != got["losses"][1], got


def test_fabric_with_the_users_parallelize_fn(results: dict[str, Any]) -> None:
    got = scenario(results, "parallelize_fn")
    assert got["calls"] == [2] and got["export"] == SAME and got["vs_full_state"] == SAME, got


def test_fabric_meta_init_loads_pretrained_into_the_shards(results: dict[str, Any]) -> None:
    got = scenario(results, "meta_pretrained")
    assert got["meta_before_setup"] and got["export"] == SAME and got["export_checkpoint"].endswith("pretrained"), got


def test_fabric_offload_params_between_steps(results: dict[str, Any]) -> None:
    got = scenario(results, "offload")
    assert got["offloaded_after_step"] and got["offload_moves"] >= 4 and got["end"] == SAME, got
    # strategy.compute_phase(): the shards on the device for a loop's evaluation, offloaded again after it
    assert got["offloaded_in_eval"] is False and got["offloaded_after_eval"] is True, got


def test_fabric_a_reference_model_beside_the_policy(results: dict[str, Any]) -> None:
    """Both models inside the module set up, each called directly by the loop (each is an FSDP root of its own, and
    whichever the step calls first loads the offloaded shards); only the policy trains and is exported."""
    got = scenario(results, "reference")
    assert got["kls"][0] == 0.0 and got["kls"][1] > 0, got  # both loaded from one checkpoint; then the policy moved
    assert got["offloaded_before"] == [True, True] and got["loaded_by_the_reference"] == [True, True], got
    assert got["offloaded_after"] is True and got["policy_moved"], got
    assert got["export"] == SAME and got["reference_is_the_checkpoint"] == SAME, got
    assert "already holds PolicyAndReference" in got["second_setup"] and "export_module='policy'" in got["second_setup"]


def test_weight_sync_versions_metrics_and_fabric_save_load(results: dict[str, Any], tmp_path: Path) -> None:
    got = scenario(results, "sync_state")
    assert got["versions"] == [1, 2] and got["steps"] == [1, 1], got  # push() without step=: the version
    assert [m["weight_sync/version"] for m in got["metrics"]] == [1.0, 2.0, 3.0], got
    assert all(m["weight_sync/tensors"] == 27.0 for m in got["metrics"]), got
    # fabric.load restored the sync in place from the distributed checkpoint: the versions go on, the push is full
    assert got["loaded"] == {"version": 2, "stale": True, "resumed": True, "last_synced_step": 1}, got
    assert got["resumed_push"]["versions"] == [3] and got["resumed_push"]["same_as_saved"] == SAME, got
    assert got["errors"]["lora"] == "WeightSync(lora='both') must be one of 'merged', 'adapter'.", got
    assert "takes the loop's lightning.fabric.Fabric, got str" in got["errors"]["setup"], got


def test_fabric_lora_merged_push_equals_merge_and_unload(results: dict[str, Any]) -> None:
    got = scenario(results, "lora")
    assert got["merged"] == SAME, got  # rank 0 keeps the pushed weights
    assert got["adapter_tensors"] > 0 and got["adapter_names_lora"], got
