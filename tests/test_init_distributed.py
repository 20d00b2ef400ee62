"""Large-model flows on 2 real gloo ranks: meta-device init, ``pretrained=`` loading, any LightningModule.

One torchrun job (``tests/scripts/init_distributed.py``) runs every scenario; each test checks one. Models are
built under ``trainer.init_module(empty_init=True)`` as Lightning documents for models too big for a rank.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from tests.conftest import NO_NAME_DIFF, run_torchrun, scenario

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_torchrun("init_distributed.py", tmp_path_factory.mktemp("init") / "results.json")


@pytest.mark.parametrize("name", ["meta_qwen2", "meta_llama"])
def test_meta_init_gives_the_models_own_initial_state(results: dict[str, Any], name: str) -> None:
    got = scenario(results, name)
    assert got["was_meta"]
    assert got["warnings"] == []
    assert got["norms"] and all(bounds == [1.0, 1.0] for bounds in got["norms"].values()), got["norms"]
    assert got["inv_freq_max_diff"] == 0.0  # non-persistent rotary buffer recomputed, not garbage
    std = got["initializer_range"]
    assert all(abs(s - std) <= 0.25 * std for s in got["stds"].values()), got["stds"]
    # tied (Qwen2) still tied after init; untied (Llama) not made equal by it
    assert (got["head_vs_embedding_max_diff"] == 0.0) == got["tied"], got["head_vs_embedding_max_diff"]
    assert len(got["losses"]) == 3 and all(math.isfinite(x) for x in got["losses"]), got["losses"]


@pytest.mark.parametrize("name", ["meta_qwen2", "meta_llama"])
def test_meta_init_draws_distinct_shards_on_each_rank(results: dict[str, Any], name: str) -> None:
    # DTensor random ops on CPU draw the same numbers on every rank: rank 1's rows would copy rank 0's.
    halves = scenario(results, name)["halves_differ"]
    assert halves and all(halves.values()), halves


def test_meta_init_warns_naming_modules_nothing_initialised(results: dict[str, Any]) -> None:
    got = scenario(results, "meta_warns")
    # Lightning's own warning (its wording, the class names) and ours (the module names and the fixes)
    assert len(got["warnings"]) == 2
    assert got["warnings"][0].endswith("`reset_parameters()` method for re-initialization: Bare")
    assert "['bare']" in got["warnings"][1] and "reset_parameters()" in got["warnings"][1]
    # nn.Linear outside the HF model: its reset_parameters() ran (finite, and not all one value)
    assert got["head_nonfinite"] == 0 and got["head_std"] > 0, got


@pytest.mark.parametrize("name", ["pretrained_qwen2_meta", "pretrained_qwen2_built", "pretrained_llama_sharded_meta"])
def test_pretrained_export_equals_from_pretrained_bit_for_bit(results: dict[str, Any], name: str) -> None:
    got = scenario(results, name)
    assert got["names_diff"] == NO_NAME_DIFF and got["mismatched"] == []
    assert got["dtypes"] == ["torch.float32"]  # the model's dtype, from a bf16 checkpoint for Qwen2
    assert got["inv_freq_max_diff"] == 0.0 and got["warnings"] == [], got
    assert got["losses"] and all(math.isfinite(x) for x in got["losses"]), got["losses"]


def test_pretrained_mapping_loads_policy_and_reference(results: dict[str, Any]) -> None:
    got = scenario(results, "pretrained_policy_and_reference")
    assert got["tensors"] == [27, 27] and got["warnings"] == []
    assert got["policy_mismatched"] == [] and got["reference_mismatched"] == []


def test_pretrained_reads_a_sharded_checkpoint(results: dict[str, Any]) -> None:
    assert scenario(results, "pretrained_llama_sharded_meta")["files"] > 1


def test_pretrained_missing_tensor_is_named(results: dict[str, Any]) -> None:
    got = scenario(results, "pretrained_missing")
    assert got["error"] == "ValueError"
    for word in ["qwen2_missing", "Qwen2ForCausalLM", "missing 1 tensor(s) ['model.norm.weight']"]:
        assert word in got["message"], got["message"]


def test_a_module_without_hf_model_trains_and_export_names_the_fix(results: dict[str, Any]) -> None:
    got = scenario(results, "plain_module")
    assert len(got["losses"]) == 3 and got["sharded"] == "DTensor"
    for word in ["no transformers PreTrainedModel", "['net']", "export_module='net'"]:
        assert word in got["export_error"], got["export_error"]
    assert got["named_export"] == ["0.weight", "1.weight", "1.bias", "3.weight", "3.bias"]


def test_policy_beside_reference_trains_and_export_lists_both(results: dict[str, Any]) -> None:
    got = scenario(results, "several_models")
    assert len(got["losses"]) == 3
    assert "['model', 'reference']" in got["export_error"] and "export_module=" in got["export_error"]


def test_a_module_built_with_its_values_beside_a_meta_policy_keeps_them(results: dict[str, Any]) -> None:
    # init_module(empty_init=True) builds the policy on meta; a head (a drafter, a value head) assigned afterwards with
    # its values loaded keeps them through the strategy's materialization (to_empty reallocated every tensor, and the
    # head's reset_parameters() ran: it came out re-initialised); module_source names it for a drafter's push
    got = scenario(results, "meta_policy_beside_a_built_head")
    assert got["head_mismatched"] == [] and got["warnings"] == [], got
    assert got["named"] == ["value_head.0.weight", "value_head.0.bias", "value_head.1.weight", "value_head.1.bias"]
    assert "no submodule 'heads.value'" in got["error"] and "'model', 'head'" in got["error"], got["error"]
