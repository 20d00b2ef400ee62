"""The checkpoint-format mapping (``checkpoint_format.py``) in one process: transformers' own rules, per tensor.

The 2-rank checks against ``save_pretrained`` for every family are in ``tests/test_families.py``.
"""

from __future__ import annotations

import copy
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from lightning_fsdp_export import VLLMWeightSync
from lightning_fsdp_export.export.checkpoint_format import CheckpointFormat
from lightning_fsdp_export.sync.exact import EMPTY_SHA256, compare_checksums
from lightning_fsdp_export.testing import tiny_family
from tests.scripts.conversion_table import changes, conversion_table


def test_transformers_conversion_table_is_the_one_reviewed() -> None:
    # A new architecture, or a new kind of rule, in transformers' table fails here, so it is not silently
    # exported in the wrong layout: review it (tests/scripts/conversion_table.py says how), then write this
    # version's snapshot: python tests/scripts/conversion_table.py --write. The newest transformers a trainer may
    # run is checked the same way in tests/test_families.py.
    import transformers

    found = changes(transformers.__version__, conversion_table())
    assert found == {}, f"transformers {transformers.__version__}'s conversion table is not the one reviewed: {found}"


def test_a_rule_that_joins_tensors_on_save_is_refused_naming_the_model() -> None:
    # What the table review relies on for a new architecture whose rule joins in-memory tensors on save (5.23's
    # Molmo2 `Split`, reverted by `Concatenate`): converted one at a time, such a model would go out wrong, so the
    # first conversion refuses it. A real one here: DINOv2 with SwiGLU, its `weights_in` chunked into gate/up.
    from transformers import Dinov2Config, Dinov2Model

    model = Dinov2Model(Dinov2Config(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, intermediate_size=128,
                                     image_size=28, patch_size=14, use_swiglu_ffn=True))
    name, tensor = next(iter(model.state_dict().items()))
    with pytest.raises(ValueError, match=r"Dinov2Model: transformers joins .*mlp\.weights_in.*one tensor at a time"):
        CheckpointFormat(model).shapes(name, tensor)


@pytest.mark.parametrize("arch", ["qwen3", "gemma3", "gpt_oss"])
def test_same_layout_models_pass_through_untouched(arch: str) -> None:
    model = tiny_family(arch)
    fmt = CheckpointFormat.of(model)
    assert fmt.has_rules is False
    for name, tensor in model.state_dict().items():
        assert fmt.shapes(name, tensor) == [(name, tuple(tensor.shape))]
        assert list(fmt.convert(name, tensor))[0][1] is tensor  # no copy, no call into transformers


def test_fused_experts_split_per_expert_in_checkpoint_order() -> None:
    model = tiny_family("qwen3_moe")
    fmt = CheckpointFormat.of(model)
    name = "model.layers.0.mlp.experts.gate_up_proj"
    full = model.state_dict()[name]  # (E=4, 2I=256, H=256), gate rows first
    pieces = list(fmt.convert(name, full))
    assert [n for n, _ in pieces] == [f"model.layers.0.mlp.experts.{e}.{p}.weight" for p in ("gate_proj", "up_proj")
                                      for e in range(4)]
    assert torch.equal(pieces[1][1], full[1, :128]) and torch.equal(pieces[5][1], full[1, 128:])
    assert all(t.untyped_storage().data_ptr() != full.untyped_storage().data_ptr() for _, t in pieces)  # copies
    assert fmt.shapes(name, torch.empty(full.shape, device="meta")) == [(n, tuple(t.shape)) for n, t in pieces]


def test_large_fused_tensors_convert_a_block_of_experts_at_a_time() -> None:
    model = tiny_family("qwen3_moe")
    state = model.state_dict()
    name = "model.layers.1.mlp.experts.gate_up_proj"  # (4, 256, 256): 2 experts per block of 2**17 elements
    whole, blocked = CheckpointFormat.of(model), CheckpointFormat(model, block_elements=2 * 256 * 256)
    disk = dict(p for key in state for p in whole.convert(key, state[key]))
    assert [(lo, hi) for lo, hi, _ in blocked.blocks(name, state[name])] == [(0, 2), (2, 4)]
    names = [n for n, _ in blocked.shapes(name, state[name])]
    assert names[:4] == [f"model.layers.1.mlp.experts.{e}.{p}.weight" for p in ("gate_proj", "up_proj") for e in (0, 1)]
    assert sorted(names) == sorted(n for n, _ in whole.shapes(name, state[name]))
    converted = blocked.convert(name, state[name])
    first = next(converted)  # only the first block has been converted so far
    assert first[0] == names[0] and torch.equal(first[1], disk[first[0]])
    assert all(torch.equal(t, disk[n]) for n, t in converted)
    read: list[str] = []
    local = blocked.read_local(name, state[name], (1, 4), lambda n: (read.append(n), disk[n])[1])
    assert torch.equal(local, state[name][1:4]) and len(read) == 6 and not any(".experts.0." in n for n in read)


def test_each_expert_piece_has_one_owner_rank_and_a_rank_converts_only_its_own() -> None:
    """Shard-direct: the rank whose rows (experts) make a checkpoint piece converts and sends it; a block plan
    that cuts across a rank's rows (2 experts per block, 3 ranks holding 2, 2 and 0 of the 4) still works."""
    model = tiny_family("qwen3_moe")
    state = model.state_dict()
    name = "model.layers.1.mlp.experts.gate_up_proj"
    fmt = CheckpointFormat(model, block_elements=256 * 256)  # one expert per block
    disk = dict(fmt.convert(name, state[name]))
    for world, owned in ((2, {0: (0, 1), 1: (2, 3)}), (3, {0: (0, 1), 1: (2, 3), 2: ()}), (4, {3: (3,)})):
        owners = fmt.owners(name, state[name], world)
        assert owners is not None and sorted(owners) == sorted(disk)
        for rank, experts in owned.items():
            mine = sorted(n for n, r in owners.items() if r == rank)
            assert mine == sorted(f"model.layers.1.mlp.experts.{e}.{p}.weight" for e in experts
                                  for p in ("gate_proj", "up_proj")), (world, rank)
            chunk = -(-4 // world)
            lo, hi = min(rank * chunk, 4), min((rank + 1) * chunk, 4)
            got = list(fmt.convert_local(name, state[name], state[name][lo:hi], lo))
            assert [n for n, _ in got] == [p.name for p in fmt.pieces(name, state[name])]  # every piece, in order
            assert sorted(n for n, t in got if t is not None) == mine
            assert all(torch.equal(t, disk[n]) for n, t in got if t is not None)
    plain = "model.layers.1.self_attn.q_proj.weight"
    assert fmt.owners(plain, state[plain], 2) is None  # not split: sent as rows instead


def test_read_local_reads_only_its_own_experts_and_equals_the_converted_rows() -> None:
    model = tiny_family("mixtral")
    fmt = CheckpointFormat.of(model)
    state = model.state_dict()
    name = "model.layers.1.mlp.experts.gate_up_proj"
    disk = dict(piece for key in state for piece in fmt.convert(key, state[key]))
    read: list[str] = []
    local = fmt.read_local(name, state[name], (2, 4), lambda n: (read.append(n), disk[n].clone())[1])
    assert torch.equal(local, state[name][2:4])
    assert sorted(read) == [f"model.layers.1.block_sparse_moe.experts.{e}.{w}.weight"
                            for e in (2, 3) for w in ("w1", "w3")]
    mixed = fmt.read_local(name, state[name].to(torch.bfloat16), (0, 1), lambda n: disk[n])  # cast on the way
    assert mixed.dtype == torch.bfloat16 and torch.equal(mixed, state[name][:1].to(torch.bfloat16))


def test_the_whole_tensor_fallback_of_read_local_equals_the_rows() -> None:
    # the path for rules that do not split by rows (none of the families here): probes of the whole tensor
    model = tiny_family("qwen3_moe")
    fmt = CheckpointFormat.of(model)
    state = model.state_dict()
    name = "model.layers.0.mlp.experts.down_proj"
    disk = dict(p for key in state for p in fmt.convert(key, state[key]))
    assert torch.equal(fmt._read_rows_of_whole(name, state[name], (1, 3), disk.__getitem__), state[name][1:3])


def test_one_format_per_model_and_it_does_not_keep_the_model_alive() -> None:
    import gc
    import weakref

    model = tiny_family("qwen3_moe")
    assert CheckpointFormat.of(model) is CheckpointFormat.of(model)
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None


def test_a_checkpoint_piece_of_another_shape_is_named() -> None:
    model = tiny_family("qwen3_moe")
    fmt = CheckpointFormat.of(model)
    name = "model.layers.0.mlp.experts.down_proj"
    with pytest.raises(ValueError, match=r"experts\.0\.down_proj\.weight: checkpoint \[3\]"):
        fmt.read_local(name, model.state_dict()[name], (0, 2), lambda n: torch.zeros(3))


def test_vision_language_prefixes_are_renamed_even_after_fully_shard_renamed_the_classes() -> None:
    # fully_shard swaps each sharded module's class for FSDP<name>; transformers picks rules by class name
    model = tiny_family("qwen2_5_vl")
    fmt = CheckpointFormat.of(model)
    assert fmt.shapes("model.language_model.layers.0.mlp.up_proj.weight", torch.empty(512, 256)) == [
        ("model.layers.0.mlp.up_proj.weight", (512, 256))]
    assert fmt.shapes("model.visual.blocks.0.norm1.weight", torch.empty(64))[0][0] == "visual.blocks.0.norm1.weight"


def test_lora_over_moe_merged_pushes_map_like_save_pretrained_and_expert_adapters_are_refused() -> None:
    from peft import LoraConfig, get_peft_model

    from lightning_fsdp_export.export.lora import check_adapters_loadable, entries_for, staged_merged_export

    torch.manual_seed(0)
    peft = get_peft_model(tiny_family("qwen3_moe"), LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False))
    fmt = CheckpointFormat.of(peft)
    merged = dict(staged_merged_export(peft, device=torch.device("cpu"), dtype=None, stage=lambda: False,
                                       unstage=lambda: None, on_finish=lambda report: None, checkpoint_format=fmt))
    plain = copy.deepcopy(peft).merge_and_unload()
    want = dict(p for k, t in plain.state_dict().items() for p in CheckpointFormat.of(plain).convert(k, t))
    assert merged.keys() == want.keys() and all(torch.equal(merged[k], want[k]) for k in want)
    check_adapters_loadable(entries_for(peft, "base"), entries_for(peft, "adapter"), fmt)  # attention: fine

    on_experts = get_peft_model(tiny_family("qwen3_moe"),
                                LoraConfig(r=4, target_parameters=["mlp.experts.gate_up_proj"]))
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.experts\.lora_A\.weight.*lora='merged'"):
        check_adapters_loadable(entries_for(on_experts, "base"), entries_for(on_experts, "adapter"),
                                CheckpointFormat.of(on_experts))


def test_exact_check_never_counts_an_empty_hash_as_a_match() -> None:
    before = {"e": {"dp0:pp0:pcp0:tp0:model.embed_tokens.weight": "a", "dp0:pp0:pcp0:tp0:qkv_proj.weight": EMPTY_SHA256,
                    "dp0:pp0:pcp0:tp0:w13_weight": "b"}}
    after = {"e": {"dp0:pp0:pcp0:tp0:model.embed_tokens.weight": "a", "dp0:pp0:pcp0:tp0:qkv_proj.weight": EMPTY_SHA256,
                   "dp0:pp0:pcp0:tp0:w13_weight": "c"}}
    check = compare_checksums(before, after)
    assert (check.compared, check.not_comparable, check.mismatched, check.engines) == (2, 1, ["e: w13_weight"], 1)


def test_exact_first_sync_arguments_are_checked_eagerly() -> None:
    from lightning_fsdp_export import InMemoryTarget

    with pytest.raises(TypeError, match="needs a target with weight_checksums and reset_weights"):
        VLLMWeightSync(InMemoryTarget(), exact_first_sync=True)

    class Checked(InMemoryTarget):
        def weight_checksums(self) -> dict: return {}  # noqa: E704
        def reset_weights(self) -> None: pass  # noqa: E704

    with pytest.raises(ValueError, match="needs sync_on_train_start=True"):
        VLLMWeightSync(Checked(), exact_first_sync=True, sync_on_train_start=False)


def test_a_text_model_trained_out_of_a_vision_language_checkpoint_is_named_as_that_checkpoint_holds_it(
        tmp_path: Path) -> None:
    # Qwen3.5-MoE: the checkpoint is the VLM (its text model under model.language_model., a vision tower beside it);
    # RL trains the text model. The relocation pretrained= finds makes every exported piece (fused experts split per
    # expert, block by block) a tensor of that checkpoint, bit for bit, and reading rows back (read_local) the same.
    from safetensors.torch import load_file
    from transformers import Qwen3_5MoeForCausalLM

    from lightning_fsdp_export._common import compare_shapes, find_relocation, trainer_part
    from lightning_fsdp_export.export.lazy import plan_export
    from lightning_fsdp_export.prepare.pretrained import checkpoint_shapes
    from lightning_fsdp_export.testing import tiny_vlm

    tiny_vlm("qwen3_5_moe").save_pretrained(tmp_path)
    on_disk = load_file(str(tmp_path / "model.safetensors"))
    loaded = Qwen3_5MoeForCausalLM.from_pretrained(tmp_path)  # transformers drops the prefix on load (PrefixChange)
    # a model from_pretrained keeps the rules it was loaded with, and saves (so exports) the VLM's names already
    own = CheckpointFormat(loaded)
    assert {p.name for n, t in plan_export(loaded) for p in own.pieces(n[0], t)} <= set(on_disk)
    model = Qwen3_5MoeForCausalLM(loaded.config)  # built from the config (init_module(empty_init=True)): no rules
    model.load_state_dict(loaded.state_dict())
    fmt = CheckpointFormat(model, block_elements=128 * 256)  # two experts a block: the block plan runs too
    plan = plan_export(model)
    wanted = [p.name for names, tensor in plan for p in fmt.pieces(names[0], tensor)]
    assert find_relocation(wanted, {"model.layers.0.x": ()}) is None  # no single prefix: none
    assert find_relocation(wanted, checkpoint_shapes(tmp_path)) == (("model.", "model.language_model."),)
    fmt.relocate((("model.", "model.language_model."),))
    got = {piece: t for names, tensor in plan for piece, t in fmt.convert(names[0], tensor.detach())}
    assert all(name in on_disk and torch.equal(t, on_disk[name]) for name, t in got.items())
    assert sorted(n for n in on_disk if n not in got) == sorted(n for n in on_disk if n.startswith("model.visual."))
    # the precheck's view: the export is the part under model.language_model. (lm_head beside it); a whole model's
    # names share only "model.", so a checkpoint tensor it lacks stays a missing one
    assert trainer_part(list(got)) == "model.language_model."
    assert trainer_part(wanted) is None
    # without the relocation the precheck refuses the text model's names, and names the fix
    plain = CheckpointFormat(model)
    lines = compare_shapes([s for names, t in plan for s in plain.shapes(names[0], t)], checkpoint_shapes(tmp_path),
                           may_be_absent=set())
    assert lines[0].startswith("unknown to the engine") and "pretrained=<that checkpoint>" in lines[-1], lines
    assert "holds the trainer's model.* as model.language_model.*" in lines[-1]
    fused = next((names[0], t) for names, t in plan if names[0].endswith("mlp.experts.gate_up_proj"))
    rows = fmt.read_local(fused[0], fused[1], (1, 3), lambda name: on_disk[name])
    assert torch.equal(rows, fused[1].detach()[1:3])


def test_the_exact_check_keeps_engine_modules_the_push_never_reached() -> None:
    # checksums before the reset, right after it, after the push: "visual" untouched by the push is kept (not the
    # trainer's); a language-model parameter the push did not restore is still a mismatch
    lm = "language_model"
    before = {"e": {"visual.a": "v1", f"{lm}.x": "x1", f"{lm}.y": "y1", f"{lm}.p": EMPTY_SHA256}}
    zeroed = {"e": {"visual.a": "z", f"{lm}.x": "z", f"{lm}.y": "z", f"{lm}.p": EMPTY_SHA256}}
    after = {"e": {"visual.a": "z", f"{lm}.x": "x1", f"{lm}.y": "z", f"{lm}.p": EMPTY_SHA256}}
    check = compare_checksums(before, after, zeroed, frozenset({"visual", "blocks"}))
    assert (check.compared, check.not_comparable, check.kept, check.mismatched) == (2, 1, 1, ["e: language_model.y"])
    assert compare_checksums(before, after).mismatched == ["e: language_model.y", "e: visual.a"]  # without: both
    # a trainer holding the whole model (nothing not held): an unreached module is a mismatch, never kept
    check = compare_checksums(before, after, zeroed, frozenset())
    assert check.kept == 0 and check.mismatched == ["e: language_model.y", "e: visual.a"]


def test_a_whole_vlm_renamed_by_pretrained_holds_every_checkpoint_tensor_so_an_exact_check_keeps_nothing(
        tmp_path: Path) -> None:
    # Issue 54's defect: whole LLaVA from its published layout (vision_tower.vision_model.*, which transformers 5.19's
    # save_pretrained writes as vision_tower.*) needs a relocation; it used to make the exact check count modules no
    # push reached as "kept" (the engine's own), so a projector dropped from the push passed. What the trainer does
    # not hold is now read from its model: nothing for a whole VLM, the vision tower for a text model of a VLM.
    from transformers import Qwen3_5ForCausalLM

    from lightning_fsdp_export.prepare.pretrained import load_hf_checkpoint
    from lightning_fsdp_export.sync.exact import exact_verdict
    from lightning_fsdp_export.testing import save_whole_vlm, tiny_vlm, tiny_whole_vlm

    saved = tiny_whole_vlm("llava").to(torch.bfloat16)
    save_whole_vlm(saved, tmp_path / "llava")
    whole = tiny_whole_vlm("llava", seed=1).to(torch.bfloat16)
    load_hf_checkpoint(whole, tmp_path / "llava")
    fmt = CheckpointFormat.of(whole)
    assert fmt.relocation == (("vision_tower.", "vision_tower.vision_model."),)  # (the match that misled the check)
    assert fmt.parts_not_held == frozenset()
    assert all(torch.equal(a, b) for a, b in zip(saved.state_dict().values(), whole.state_dict().values()))
    tiny_vlm("qwen3_5").save_pretrained(tmp_path / "qwen3_5")
    text = Qwen3_5ForCausalLM(tiny_vlm("qwen3_5").config.text_config)
    load_hf_checkpoint(text, tmp_path / "qwen3_5")
    assert "visual" in CheckpointFormat.of(text).parts_not_held
    assert not {"model", "language_model", "layers", "lm_head"} & CheckpointFormat.of(text).parts_not_held

    class Engine:  # checksums as vLLM's checker gives them: the push reached the text model, not the projector
        reloads = 0

        def weight_checksums(self) -> dict[str, dict[str, str]]:
            return {"e": {"multi_modal_projector.linear_1.bias": "z", "language_model.model.norm.weight": "n"}}

        def reload_checkpoint(self) -> None:
            self.reloads += 1

    before = {"e": {"multi_modal_projector.linear_1.bias": "p", "language_model.model.norm.weight": "n"}}
    zeroed = {"e": {"multi_modal_projector.linear_1.bias": "z", "language_model.model.norm.weight": "z"}}
    engine = Engine()
    check, message = exact_verdict(engine, before, zeroed, fmt.parts_not_held)  # type: ignore[arg-type]
    assert check is not None and check.kept == 0 and engine.reloads == 0
    assert message is not None and "multi_modal_projector.linear_1.bias" in message and "whole model" in message


def tiny_idefics3() -> torch.nn.Module:
    """SmolVLM's layout: tower, connector and text model all under one top-level ``model.``."""
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    torch.manual_seed(0)
    return Idefics3ForConditionalGeneration(Idefics3Config(
        text_config=dict(model_type="llama", vocab_size=512, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2),
        vision_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                           image_size=32, patch_size=8), scale_factor=2, image_token_id=508))


def test_the_exact_check_keeps_a_tower_nested_under_the_text_models_top_level_module(tmp_path: Path) -> None:
    # Issue 66: a text model trained out of an Idefics3 checkpoint (model.vision_model.*, model.connector.*,
    # model.text_model.*): the tower shares its top-level module with the text model the push reaches, so deciding by
    # the top-level module compared the tower (21 mismatches, and the engine left zeroed). What is kept is now decided
    # at the depth of the part the trainer does not hold.
    from transformers import LlamaForCausalLM

    from lightning_fsdp_export.prepare.pretrained import load_hf_checkpoint

    vlm = tiny_idefics3().to(torch.bfloat16)
    vlm.save_pretrained(tmp_path)
    text = LlamaForCausalLM(vlm.config.text_config).to(torch.bfloat16)
    load_hf_checkpoint(text, tmp_path)
    fmt = CheckpointFormat.of(text)
    assert fmt.relocation is not None and ("model.", "model.text_model.") in fmt.relocation
    not_held = fmt.parts_not_held
    assert {"vision_model", "connector"} <= not_held and not {"model", "text_model", "layers"} & not_held
    tower, proj = "model.vision_model.encoder.layers.0.mlp.fc1.bias", "model.connector.modality_projection.proj.weight"
    norm, head = "model.text_model.norm.weight", "lm_head.weight"
    before = {"e": {tower: "t", proj: "c", norm: "n", head: "h"}}
    zeroed = {"e": {tower: "z", proj: "z", norm: "z", head: "z"}}
    after = {"e": {tower: "z", proj: "z", norm: "n", head: "h"}}  # the push restored the text model only
    check = compare_checksums(before, after, zeroed, not_held)
    assert (check.compared, check.kept, check.mismatched) == (2, 2, [])
    # a part the trainer does not hold but the push changed is compared (so a wrong value there is named)
    touched = {"e": {**after["e"], proj: "x"}}
    assert compare_checksums(before, touched, zeroed, not_held).mismatched == [f"e: {proj}"]
    # a part of the text model the push missed is a mismatch whatever its depth
    missed = {"e": {**after["e"], norm: "z"}}
    assert compare_checksums(before, missed, zeroed, not_held).mismatched == [f"e: {norm}"]


class FakeEngine:
    """An engine's checksums as vLLM's checker gives them, zeroed and reloaded as the exact check does (a fake: the
    real engines run in tests/test_families.py's ``@fault`` and ``@drop`` scenarios)."""

    def __init__(self, reload_fails: bool = False, reload_differs: bool = False) -> None:
        self.sums = {"a": "1", "b": "2"}
        self.reload_fails, self.reload_differs = reload_fails, reload_differs

    def weight_checksums(self) -> dict[str, dict[str, str]]:
        return {"e": dict(self.sums)}

    def reset_weights(self) -> None:
        self.sums = {"a": "0", "b": "0"}

    def reload_checkpoint(self) -> None:
        if self.reload_fails:
            raise OSError("disk gone")
        self.sums = {"a": "1", "b": "3" if self.reload_differs else "2"}


def test_a_failed_exact_check_reloads_the_engine_or_fails_whatever_on_error_says() -> None:
    # Issue 66 item 2: no exit leaves an engine zeroed. After a failure the engine reloads its checkpoint and must hold
    # what it held before the check; if it cannot, the error is EngineNotRestored (raised even with on_error="warn").
    from lightning_fsdp_export._common import SyncGroup, WeightSyncError
    from lightning_fsdp_export.sync.exact import EngineNotRestored, restore_after_failure

    group = SyncGroup(timedelta(seconds=5))  # (no process group: one rank)
    failure = WeightSyncError("Exact check of version 1 failed (rank 0: ...).")
    engine = FakeEngine()
    baseline = engine.weight_checksums()
    engine.reset_weights()
    err = restore_after_failure(group, engine, baseline, failure)  # type: ignore[arg-type]
    assert type(err) is WeightSyncError and engine.weight_checksums() == baseline
    assert "Exact check of version 1 failed" in str(err) and "reloaded from its checkpoint" in str(err)
    for engine, said in ((FakeEngine(reload_fails=True), "reloading its checkpoint failed (OSError: disk gone)"),
                         (FakeEngine(reload_differs=True), "after reloading its checkpoint 1 parameter(s) differ from"
                                                           " what the engine held before the check: e: b")):
        baseline = engine.weight_checksums()
        engine.reset_weights()
        err = restore_after_failure(group, engine, baseline, failure)  # type: ignore[arg-type]
        assert isinstance(err, EngineNotRestored) and f"rank 0: {said}" in str(err), err
        assert "may serve zeroed parameters" in str(err)


def test_a_checkpoint_with_an_mtp_layer_is_no_refusal_and_its_layer_is_the_drafters(tmp_path: Path) -> None:
    # GLM-4.5's and DeepSeek-V3's checkpoints hold a multi-token-prediction layer past num_hidden_layers (Qwen3-Next's
    # and Qwen3.5's: mtp.*); vLLM drafts with it, transformers drops it, so the trainer never exports it. The
    # precheck counts it as the engine's drafter's, not as tensors missing from the export (which refused every sync).
    from lightning_fsdp_export.export.lazy import plan_export
    from lightning_fsdp_export.targets.directory import CheckpointCheck, drafter_names
    from lightning_fsdp_export.testing import add_mtp_layer

    model = tiny_family("glm4_moe")
    model.save_pretrained(tmp_path)
    exported = [s for names, t in plan_export(model) for s in CheckpointFormat(model).shapes(names[0], t)]
    added = add_mtp_layer(tmp_path)
    assert "model.layers.2.eh_proj.weight" in added and "model.layers.2.self_attn.q_proj.weight" in added
    check = CheckpointCheck(tmp_path)
    assert check.problems(exported) == [] and sorted(check.drafter) == added
    assert drafter_names(["mtp.fc.weight", "model.layers.1.x", "model.layers.2.x"], {"num_hidden_layers": 2}) == [
        "mtp.fc.weight"]  # past the layers only with num_nextn_predict_layers
    missing = CheckpointCheck(tmp_path).problems([s for s in exported if s[0] != "model.norm.weight"])
    assert missing == ["missing from the trainer's export (1): model.norm.weight"]  # a real one still is


def test_a_drafter_trained_beside_the_policy_exports_as_the_checkpoints_mtp_layer(tmp_path: Path) -> None:
    # VLLMWeightSync(drafter=Drafter("mtp", prefix="model.layers.2.")): the drafter's names under the prefix, converted
    # by the policy's rules (its fused experts split per expert, as save_pretrained writes the policy's), are exactly
    # the checkpoint's MTP tensors, shape for shape; a wrong prefix or shape is named before any gather.
    from safetensors.torch import load_file

    from lightning_fsdp_export.export.model_export import ModelExport
    from lightning_fsdp_export.targets.directory import CheckpointCheck
    from lightning_fsdp_export.testing import add_mtp_layer, mtp_layer

    model = tiny_family("glm4_moe")
    model.save_pretrained(tmp_path)
    added = add_mtp_layer(tmp_path)
    block = mtp_layer(tmp_path)
    export = ModelExport("test", bucket_bytes=0, prefetch=0, device=lambda: torch.device("cpu"), stage=lambda: False,
                         unstage=lambda: None)
    export.bind(block, None, prefix="model.layers.2.", checkpoint_format=CheckpointFormat(model))
    source = export.source("merged", dtype=None, kind="draft")
    shapes = [(m.name, tuple(m.shape)) for m in source.metadata()]
    tensors = dict(source)
    assert source.kind == "draft" and sorted(tensors) == sorted(n for n, _ in shapes) == added
    assert "model.layers.2.mlp.experts.3.down_proj.weight" in tensors  # split per expert
    files = {n: t for n, t in load_file(str(next(tmp_path.glob("*.safetensors")))).items() if n in tensors}
    assert all(torch.equal(tensors[n], files[n]) for n in added)  # loaded from the checkpoint's MTP layer
    check = CheckpointCheck(tmp_path)
    assert check.draft_problems(shapes) == []
    wrong = check.draft_problems([("model.layers.3." + n[len("model.layers.2."):], s) for n, s in shapes[:2]])
    assert len(wrong) == 1 and "not among the checkpoint's drafter tensors (2)" in wrong[0], wrong
    assert "['model.layers.2.']" in wrong[0] and "Drafter(prefix=...)" in wrong[0]
    bad = check.draft_problems([("model.layers.2.enorm.weight", (3,))])
    assert bad == ["shapes differ (1): model.layers.2.enorm.weight: trainer [3] vs engine [256]"], bad


def test_a_whole_gemma3_vlm_exports_its_tied_head_and_the_precheck_takes_it(tmp_path: Path) -> None:
    # Issue 54 item 2: Gemma 3's tied head is exported under the VLM's text-model name (language_model.lm_head.weight:
    # vLLM-cpu needs the head pushed, save_pretrained leaves it out, and tie_word_embeddings is in the text config
    # too); the precheck took only a literal lm_head.weight as absent, so every whole-Gemma-3 sync was refused.
    from lightning_fsdp_export.export.lazy import plan_export
    from lightning_fsdp_export.targets.directory import CheckpointCheck
    from lightning_fsdp_export.testing import tiny_whole_vlm

    model = tiny_whole_vlm("gemma3_vlm")
    model.save_pretrained(tmp_path)
    fmt = CheckpointFormat.of(model)
    exported = [s for names, t in plan_export(model) for name in names for s in fmt.shapes(name, t)]
    assert "language_model.lm_head.weight" in dict(exported)
    assert CheckpointCheck(tmp_path).problems(exported) == []
    # an untied checkpoint lacking its head is still refused
    config = (tmp_path / "config.json").read_text()
    (tmp_path / "config.json").write_text(config.replace('"tie_word_embeddings": true', '"tie_word_embeddings": false'))
    assert CheckpointCheck(tmp_path).problems(exported) == ["unknown to the engine (1): language_model.lm_head.weight"]


def test_a_text_model_with_an_untied_head_starts_from_a_llava_layout_checkpoint(tmp_path: Path) -> None:
    # Issue 54 item 4: in LLaVA's layout both model. and lm_head. move (language_model.model.*,
    # language_model.lm_head.weight); one relocation could not hold both, so the text model was refused ("missing 21
    # tensor(s)"). pretrained= now finds a move per first part, the export is named so and the precheck agrees.
    from transformers import LlamaForCausalLM

    from lightning_fsdp_export._common import find_relocation
    from lightning_fsdp_export.export.lazy import plan_export
    from lightning_fsdp_export.prepare.pretrained import load_hf_checkpoint
    from lightning_fsdp_export.targets.directory import CheckpointCheck
    from lightning_fsdp_export.testing import save_whole_vlm, tiny_whole_vlm

    assert find_relocation(["model.embed_tokens.weight", "lm_head.weight"],
                           {"language_model.model.embed_tokens.weight", "language_model.lm_head.weight"}) == (
        ("lm_head.", "language_model.lm_head."), ("model.", "language_model.model."))
    vlm = tiny_whole_vlm("llava").to(torch.bfloat16)
    save_whole_vlm(vlm, tmp_path)
    text = LlamaForCausalLM(vlm.config.text_config).to(torch.bfloat16)
    load_hf_checkpoint(text, tmp_path)
    fmt = CheckpointFormat.of(text)
    assert fmt.relocation == (("lm_head.", "language_model.lm_head."), ("model.", "language_model.model."))
    assert {"vision_tower", "multi_modal_projector"} <= fmt.parts_not_held
    assert not {"language_model", "model", "lm_head", "layers"} & fmt.parts_not_held
    assert torch.equal(text.lm_head.weight, vlm.lm_head.weight)
    assert torch.equal(text.model.layers[1].mlp.up_proj.weight, vlm.model.language_model.layers[1].mlp.up_proj.weight)
    exported = [s for names, t in plan_export(text) for name in names for s in fmt.shapes(name, t)]
    assert CheckpointCheck(tmp_path).problems(exported) == []


def test_a_save_pretrained_vlm_is_refused_before_an_engine_is_built_and_rewritten_in_vllms_layout(
        tmp_path: Path) -> None:
    # Issue 54 item 5: transformers 5.19 writes LLaVA's and Gemma 3's towers as vision_tower.*, which vLLM 0.32 cannot
    # load (the engine failed at build, its hint pointing elsewhere). ColocatedVLLM names it before building, and
    # write_vllm_layout renames the tensors in place (what published checkpoints hold).
    from safetensors.torch import load_file

    from lightning_fsdp_export import ColocatedVLLM
    from lightning_fsdp_export.targets import vision_layout_problem, write_vllm_layout
    from lightning_fsdp_export.testing import tiny_whole_vlm

    model = tiny_whole_vlm("gemma3_vlm")
    model.save_pretrained(tmp_path)
    problem = vision_layout_problem(tmp_path)
    assert problem is not None and "write_vllm_layout" in problem
    assert "vision_tower.embeddings.patch_embedding" in problem
    trainer = type("Trainer", (), {"accumulate_grad_batches": 1, "world_size": 1})()
    with pytest.raises(ValueError, match=r"ColocatedVLLM\(model=.*vision_tower.vision_model"):
        ColocatedVLLM(str(tmp_path)).setup(trainer)  # type: ignore[arg-type]
    before = load_file(str(tmp_path / "model.safetensors"))
    assert write_vllm_layout(tmp_path) == sum(k.startswith("vision_tower.") for k in before)
    after = load_file(str(tmp_path / "model.safetensors"))
    assert sorted(after) == sorted(k.replace("vision_tower.", "vision_tower.vision_model.", 1) for k in before)
    assert vision_layout_problem(tmp_path) is None and write_vllm_layout(tmp_path) == 0
    assert vision_layout_problem(tmp_path / "missing") is None


def test_qwen3_vl_moe_experts_are_exported_and_read_in_the_published_orientation(tmp_path: Path) -> None:
    # Issue 54: Qwen3-VL-MoE's published checkpoints hold the fused experts transposed ((E, H, 2I), (E, I, H)), what
    # vLLM 0.32 reads (is_fused_checkpoint_transposed); transformers' rule transposes only where shapes differ, so
    # save_pretrained (and the export) wrote the memory layout, which vLLM refused at build, and pretrained= refused the
    # published one. Both sides now use the published orientation (served by vllm-cpu: tests/test_families.py).
    from transformers import Qwen3VLMoeForConditionalGeneration

    from lightning_fsdp_export.export.lazy import plan_export
    from lightning_fsdp_export.prepare.pretrained import load_hf_checkpoint
    from lightning_fsdp_export.targets import write_vllm_layout
    from lightning_fsdp_export.testing import tiny_family

    model = tiny_family("qwen3_vl_moe").to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    write_vllm_layout(tmp_path)  # the published layout
    fmt = CheckpointFormat.of(model)
    exported = {n: t for names, tensor in plan_export(model) for n, t in fmt.convert(names[0], tensor.detach())}
    assert tuple(exported["model.language_model.layers.0.mlp.experts.gate_up_proj"].shape) == (4, 256, 192)
    fresh = Qwen3VLMoeForConditionalGeneration(model.config).to(torch.bfloat16)
    load_hf_checkpoint(fresh, tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))


def test_write_vllm_layout_gives_qwen3_vl_moe_the_published_orientation_and_norm_topk_prob(tmp_path: Path) -> None:
    # save_pretrained writes Qwen3-VL-MoE's experts in the memory orientation and no norm_topk_prob: vLLM 0.32 fails at
    # build. vision_layout_problem names it; write_vllm_layout transposes them in place (what the export writes).
    import json

    from safetensors.torch import load_file

    from lightning_fsdp_export.export.lazy import plan_export
    from lightning_fsdp_export.targets import vision_layout_problem, write_vllm_layout
    from lightning_fsdp_export.testing import tiny_family

    model = tiny_family("qwen3_vl_moe")
    model.save_pretrained(tmp_path)
    problem = vision_layout_problem(tmp_path)
    assert problem is not None and "untransposed (4 tensor(s)" in problem and "write_vllm_layout" in problem
    assert write_vllm_layout(tmp_path) == 4 and vision_layout_problem(tmp_path) is None
    assert json.loads((tmp_path / "config.json").read_text())["text_config"]["norm_topk_prob"] is True
    on_disk = load_file(str(tmp_path / "model.safetensors"))
    fmt = CheckpointFormat.of(model)
    exported = {n: t for names, tensor in plan_export(model) for n, t in fmt.convert(names[0], tensor.detach())}
    assert exported.keys() == on_disk.keys() and all(torch.equal(exported[k], on_disk[k]) for k in on_disk)


def test_a_text_config_field_vllm_reads_and_transformers_omits_is_named_and_written(tmp_path: Path) -> None:
    # Issue 66 item 4: transformers 5.19's Glm4vMoeTextConfig (GLM-4.5V) has no use_qk_norm, which vLLM 0.32's GLM-4.5
    # attention reads: no engine can be built on save_pretrained's config. The precheck names it; write_vllm_layout
    # writes the published value (false), as for Qwen3-VL-MoE's norm_topk_prob (true).
    import json

    from transformers import Glm4vMoeConfig

    from lightning_fsdp_export.targets import vision_layout_problem, write_vllm_layout
    from lightning_fsdp_export.targets.vision_layout import PUBLISHED_FIELDS

    Glm4vMoeConfig().save_pretrained(tmp_path)
    assert "use_qk_norm" not in json.loads((tmp_path / "config.json").read_text())["text_config"]
    problem = vision_layout_problem(tmp_path)
    assert problem is not None and "without use_qk_norm" in problem and "use_qk_norm=False" in problem, problem
    assert write_vllm_layout(tmp_path) == 0 and vision_layout_problem(tmp_path) is None
    assert json.loads((tmp_path / "config.json").read_text())["text_config"]["use_qk_norm"] is False
    assert PUBLISHED_FIELDS["qwen3_vl_moe"] == {"norm_topk_prob": True}
