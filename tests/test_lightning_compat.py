"""Lightning's own strategy tests, adapted to ``LazyExportFSDP2`` (it subclasses ``ModelParallelStrategy``)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.subprocess
@pytest.mark.parametrize("fabric", [False, True], ids=["trainer", "fabric"])
def test_lightnings_meta_device_materialization_passes_against_the_strategy(fabric: bool) -> None:
    # tests_pytorch/strategies/test_model_parallel.py::test_meta_device_materialization (Lightning 2.6.5), run in
    # its own process (it needs a real 1-rank process group; Lightning's version mocks the mesh); with fabric=True
    # tests_fabric's version of it against Fabric's LazyExportFSDP2 (parallelize_fn=identity: the strategy shards).
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "scripts" / "lightning_compat.py"),
                           *(["--fabric"] if fabric else [])], cwd=ROOT, capture_output=True, text=True, timeout=300)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, proc.stderr[-4000:]
    got = json.loads(line[len("RESULT "):])
    assert got["was_meta"] and got["params_materialized"] and got["buffers_materialized"]
    assert got["buffer_reset"]  # the LightningModule's own reset_parameters() ran
    # Lightning's assertion: pytest.warns(UserWarning, match=...)
    pattern = r"`reset_parameters\(\)` method for re-initialization: NoResetParameters"
    assert any(w.startswith("UserWarning") and re.search(pattern, w) for w in got["warnings"]), got["warnings"]
    # and ours, naming the modules and the fixes
    assert any("['layer1.0', 'layer1.1']" in w for w in got["warnings"]), got["warnings"]
