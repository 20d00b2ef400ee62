"""Lightning's own ``test_meta_device_materialization`` (tests_pytorch/strategies/test_model_parallel.py,
Lightning 2.6.5), adapted to ``LazyExportFSDP2``: one process, a real 1-rank gloo group and device mesh
(the strategy shards for real, where Lightning's test mocks the mesh). Prints one JSON line. With ``--fabric``:
Fabric's version of the test (tests_fabric/strategies/test_model_parallel.py) against Fabric's ``LazyExportFSDP2``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import warnings
from unittest.mock import Mock

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))


def main() -> None:
    from lightning.pytorch import LightningModule
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_fsdp_export import LazyExportFSDP2

    class NoResetParameters(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(4, 4))

    fabric = "--fabric" in sys.argv

    class CustomModel(nn.Module if fabric else LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.layer1 = nn.Sequential(NoResetParameters(), NoResetParameters())  # a parameterless container
            self.layer2 = nn.Linear(4, 4)
            self.register_buffer("buffer", torch.rand(2))

        def reset_parameters(self) -> None:
            self.buffer.fill_(1.0)

        def configure_model(self) -> None:
            pass

    dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
    with torch.device("meta"):
        model = CustomModel()
    was_meta = model.layer1[0].weight.is_meta and model.layer2.weight.is_meta and model.buffer.is_meta
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if fabric:
            from lightning_fsdp_export.fabric import LazyExportFSDP2 as FabricStrategy

            fabric_strategy = FabricStrategy(parallelize_fn=lambda x, _: x)
            fabric_strategy._device_mesh = mesh
            fabric_strategy._parallel_devices = [torch.device("cpu")]
            model = fabric_strategy.setup_module(model)
        else:
            strategy = LazyExportFSDP2()
            strategy._accelerator = Mock()
            strategy._device_mesh = mesh
            strategy._parallel_devices = [torch.device("cpu")]
            strategy._lightning_module = model
            strategy.model = model
            strategy.setup(Mock())
    print("RESULT " + json.dumps({
        "was_meta": was_meta,
        "warnings": [f"{w.category.__name__}: {w.message}" for w in caught if "initialization" in str(w.message)],
        "params_materialized": all(not p.is_meta for p in model.parameters()),
        "buffers_materialized": all(not b.is_meta for b in model.buffers()),
        "buffer_reset": model.buffer.tolist() == [1.0, 1.0],
    }))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
