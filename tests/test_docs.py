"""The docs site builds strictly, and what it shows is what the repository runs and measures.

``mkdocs build --strict`` (``mkdocs.yml``) fails on a broken link, a missing snippet or an API reference that no
longer resolves (mkdocstrings, from the docstrings). The site's examples are the repository's files, included
when it is built (the quickstart is ``examples/quickstart.py``, run by ``tests/test_examples.py``); the README
shows the same example and the deployment table the targets guide includes.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.subprocess  # mkdocs builds the site in its own process


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return out


def test_the_site_builds_strictly_with_every_page_of_the_nav(site: Path) -> None:
    for page in ("getting-started", "guides/strategy", "guides/weight-sync", "guides/targets", "guides/lora",
                 "guides/models", "guides/large-models", "guides/async", "guides/sparse", "troubleshooting",
                 "reference",
                 "architecture", "benchmarks", "limitations", "development"):
        assert (site / page / "index.html").is_file(), page
    reference = (site / "reference" / "index.html").read_text()
    for name in ("LazyExportFSDP2", "VLLMWeightSync", "RemoteVLLM", "ColocatedVLLM", "AsyncRollouts", "Gloo",
                 "LoadsAdapters", "ExportSource"):
        assert 'id="lightning_fsdp_export.' in reference and name in reference, name


def test_the_sites_numbers_and_examples_are_the_repositorys(site: Path) -> None:
    benchmarks = (site / "benchmarks" / "index.html").read_text()
    headings = re.findall(r"^## (.+)$", (ROOT / "BENCHMARKS.md").read_text(), flags=re.M)
    missing = [h for h in headings if _text(h) not in benchmarks]
    assert headings and not missing, missing
    started = (site / "getting-started" / "index.html").read_text()
    assert "ColocatedVLLM" in started and "verify=" in started  # examples/quickstart.py, included
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"```python\n(.*?)```", readme, flags=re.S)
    assert block and block.group(1) == (ROOT / "examples" / "quickstart.py").read_text(), \
        "README's first example must be examples/quickstart.py as it is (the tests run that file)"
    targets = (site / "guides" / "targets" / "index.html").read_text()
    for row in re.findall(r"^\| (?!---|vLLM runs)([^|]+) \|", readme, flags=re.M):
        assert _text(row.strip()) in targets, row  # README's deployment table, included by the targets guide


def _text(markdown: str) -> str:
    """A heading or cell as it reads in the HTML (code spans and escapes dropped)."""
    return markdown.replace("`", "").replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").split(" (")[0]
