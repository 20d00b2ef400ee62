"""transformers' checkpoint-conversion table, summarized for review, and the reviewed snapshot of each version.

``python tests/scripts/conversion_table.py`` prints ``{"version": ..., "changes": ...}`` for the transformers it runs
under: what differs from that version's reviewed snapshot (``tests/data/conversion_table-<major.minor>.json``).
``tests/test_checkpoint_format.py`` checks the trainer's transformers in-process, ``tests/test_families.py`` the
newest one (``.venv-transformers``, which has no pytest) through this script. ``--write`` writes the snapshot of the
running version, after the review: each new architecture's rules are reverted by transformers itself one tensor at a
time (``CheckpointFormat``), and a rule that joins several in-memory tensors into one checkpoint tensor is refused at
the first export (``CheckpointFormat._check_one_at_a_time``); a new family we sync also gets an export-vs-
``save_pretrained`` case in ``tests/test_families.py``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parents[1] / "data"


def conversion_table() -> dict[str, list[str]]:
    """``{architecture key: sorted kinds of rule}`` of transformers' conversion table."""
    from transformers.conversion_mapping import _MODEL_TO_CONVERSION_PATTERN, _build_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightConverter

    table: dict[str, list[str]] = {}
    for key, rules in _build_checkpoint_conversion_mapping().items():
        kinds = set()
        for rule in rules:
            ops = rule.operations if isinstance(rule, WeightConverter) else [rule]
            kinds |= {type(op).__name__ + ("(check_dims)" if getattr(op, "check_dims", False) else "") for op in ops}
        table[key] = sorted(kinds)
    for alias, key in _MODEL_TO_CONVERSION_PATTERN.items():
        table.setdefault(alias, [f"= {key}"])
    return dict(sorted(table.items()))


def snapshot_path(version: str) -> Path:
    """The reviewed snapshot of transformers ``version``'s minor release."""
    return DATA / f"conversion_table-{'.'.join(version.split('.')[:2])}.json"


def changes(version: str, table: dict[str, list[str]]) -> dict[str, Any]:
    """What ``table`` adds, changes or drops against ``version``'s reviewed snapshot (empty: as reviewed)."""
    path = snapshot_path(version)
    if not path.exists():
        return {"no_snapshot": str(path)}
    reviewed = json.loads(path.read_text())
    found: dict[str, Any] = {}
    if changed := {k: v for k, v in table.items() if reviewed.get(k) != v}:
        found["new_or_changed"] = changed
    if gone := sorted(set(reviewed) - set(table)):
        found["gone"] = gone
    return found


if __name__ == "__main__":
    import transformers

    if "--write" in sys.argv:
        snapshot_path(transformers.__version__).write_text(json.dumps(conversion_table(), indent=1) + "\n")
    print(json.dumps({"version": transformers.__version__, "changes": changes(transformers.__version__,
                                                                              conversion_table())}))
