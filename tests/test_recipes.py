"""Every Python block in the README and the docs reads as written (issue 69, item 4): it parses, and every name it
imports from this package exists there, so a renamed class or a moved module fails here, not in a reader's session.
The blocks that run here run elsewhere: the README's is ``examples/quickstart.py`` (``tests/test_docs.py`` holds them
equal, ``tests/test_examples.py`` runs it); the SLURM recipe is ``examples/slurm/grpo_async.sbatch``
(``tests/test_slurm.py``); the Ray recipe's parts are what ``tests/test_ray.py`` runs."""

from __future__ import annotations

import ast
import importlib
import re
import textwrap

from tests.conftest import ROOT


def blocks() -> list[tuple[str, str]]:
    """Each ```` ```python ```` block of README.md and docs/, as ``(file:line, code)`` (a block in a list item
    dedented)."""
    found = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = page.read_text()
        for match in re.finditer(r"```python\n(.*?)```", text, flags=re.S):
            line = text[:match.start()].count("\n") + 2
            found.append((f"{page.relative_to(ROOT)}:{line}", textwrap.dedent(match.group(1))))
    return found


def test_every_python_block_of_the_docs_parses_and_imports_what_the_package_has() -> None:
    found = blocks()
    assert len(found) >= 15, len(found)  # (the README's, the guides': the scan finds them)
    problems = []
    for where, code in found:
        try:
            tree = ast.parse(code)
        except SyntaxError as err:
            problems.append(f"{where}: {err}")
            continue
        for node in ast.walk(tree):
            if not (isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lightning_fsdp_export")):
                continue
            module = importlib.import_module(str(node.module))
            problems += [f"{where}: {node.module} has no {alias.name}" for alias in node.names
                         if not hasattr(module, alias.name) and not _submodule(f"{node.module}.{alias.name}")]
    assert problems == [], problems


def _submodule(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True
