"""The benchmark scripts run on a tiny model, so they cannot rot (no timing is asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT


def test_export_bench_tiny(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    subprocess.run([sys.executable, "benchmarks/export_bench.py", "--vocab", "512", "--hidden", "256", "--layers",
                    "2", "--repeats", "1", "--json", str(out)], cwd=ROOT, check=True, capture_output=True, timeout=300)
    result = json.loads(out.read_text())
    assert set(result["methods"]) == {"lazy", "full_state_dict"}
    assert result["methods"]["lazy"]["bytes"] == result["methods"]["full_state_dict"]["bytes"] > 0


def test_gpu_check_runs_on_cpu_fallback() -> None:
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--hidden", "256", "--layers", "2", "--vocab",
                           "512", "--repeats", "1"], cwd=ROOT, check=True, capture_output=True, text=True, timeout=300)
    assert "staged" in proc.stdout and "lazy" in proc.stdout
