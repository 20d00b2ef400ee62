"""Faults and bad input during a sync on 2 real gloo ranks (``tests/scripts/faults.py``).

Every row ends in a clear error, or a warning with ``on_error="warn"``, on every rank; none hangs.
"""

from __future__ import annotations

import http.server
import json
import threading
from pathlib import Path
from typing import Any

import pytest

from lightning_fsdp_export import RemoteVLLM
from lightning_fsdp_export._common import compare_shapes
from lightning_fsdp_export.transfer.transports import Directory
from tests.conftest import run_torchrun
from tests.test_sync import ENGINE_ENV

pytestmark = pytest.mark.distributed  # starts real ranks (torchrun, or a multi-process Trainer)
STARTS_VLLM = ("ranks",)  # its job builds vLLM engines too: every test using it is marked vllm (conftest)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("faults") / "results.json"
    rank0 = run_torchrun("faults.py", out, env=ENGINE_ENV)
    return [rank0, json.loads(Path(f"{out}.rank1").read_text())]


def scenario(ranks: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    for got in ranks:
        assert "crash" not in got[name], got[name]["crash"]
    return [got[name] for got in ranks]


def test_target_failing_mid_sync_raises_on_every_rank_naming_version_and_tensor(ranks: list) -> None:
    for got in scenario(ranks, "mid_push_raise"):
        assert got["error"].startswith("WeightSyncError: Weight sync of version 2 failed (rank 1: OSError")
        assert "'model.layers.0.self_attn.k_proj.weight', 5 of 27" in got["error"]
        assert got["stale"] is True and got["seconds_to_error"] < 5


def test_on_error_warn_trains_on_and_the_next_sync_pushes_everything(ranks: list) -> None:
    rank0, rank1 = scenario(ranks, "mid_push_warn")
    assert rank0["error"] is None and "version 2 failed" in rank0["warnings"][0]
    assert rank1["versions"] == [1, 3, 4]  # version 2 failed on rank 1, 3 and 4 went through
    assert rank0["tensors_last"] == 27 and rank0["stale"] is False


def test_nan_weights_are_refused_before_any_push_naming_the_tensor(ranks: list) -> None:
    for got in scenario(ranks, "nan"):
        assert "refused before any tensor was pushed" in got["error"]
        assert "NaN or Inf in model.layers.1.mlp.up_proj.weight" in got["error"]
        assert got["versions"] == [1]  # version 2 never reached the target


def test_ranks_exporting_different_orders_error_before_gathering(ranks: list) -> None:
    for got in scenario(ranks, "order"):
        assert "ranks would export different tensors or orders" in got["error"] and "[[0], [1]]" in got["error"]
        assert got["versions"] == []


def test_a_rank_skipping_the_sync_is_named_within_the_timeout(ranks: list) -> None:
    got = scenario(ranks, "skipped")[0]
    assert "not every rank arrived within 5 s" in got["error"] and "Ranks 1" in got["error"]
    assert got["seconds_to_error"] < 15


def test_unreachable_server_errors_within_the_timeout_naming_the_url(ranks: list) -> None:
    rank0, rank1 = scenario(ranks, "remote_down")
    assert len(rank0["warnings"]) == 4  # train start + 3 steps: each retried, each failed
    url = rank0["url"]  # each rank listens on its own silent socket; rank 0's is the one contacted
    assert url.startswith("http://127.0.0.1:")
    # Its checkpoint check (GET /v1/models) is the first request: each sync is refused before any gather.
    assert all(f"vLLM server GET {url}/v1/models failed" in w and "timed out" in w and "refused before any tensor"
               in w for w in rank0["warnings"]), rank0["warnings"]
    assert rank1["losses"] == rank1["baseline_losses"], rank1  # the trainer's state is untouched
    assert rank1["stale"] is True and rank0["fit_seconds"] < 4 * 2 + 20


def test_resume_after_a_failed_sync_pushes_everything_before_the_first_step(ranks: list) -> None:
    rank0, _ = scenario(ranks, "resume")
    assert rank0["saved_state"] == {"version": 3, "last_synced_step": 1, "stale": True}
    assert rank0["second_versions"] == [4, 5] and rank0["second_steps"] == [2, 3]
    assert rank0["second_tensors"] == 27


@pytest.mark.vllm
def test_engine_built_from_another_model_is_refused_and_keeps_its_weights(ranks: list) -> None:
    for got in scenario(ranks, "engine"):
        assert got["engine_untouched"] is True and got["stale"] is True
    warning = scenario(ranks, "engine")[0]["warnings"][0]
    assert "model.embed_tokens.weight: trainer [512, 256] vs engine [640, 256]" in warning


@pytest.mark.parametrize(
    ("exported", "expected", "words"),
    [
        ([("a", (4, 2))], {"a": (5, 2)}, "shapes differ (1): a: trainer [4, 2] vs engine [5, 2]"),
        ([("a", (4,))], {"a": (4,), "layers.2.w": (4,)}, "missing from the trainer's export (1): layers.2.w"),
        ([("a", (4,)), ("b_renamed", (4,))], {"a": (4,), "b": (4,)}, "unknown to the engine (1): b_renamed"),
    ],
)
def test_compare_shapes_table(exported: list, expected: dict, words: str) -> None:
    assert words in " | ".join(compare_shapes(exported, expected, may_be_absent=set()))


def test_tied_lm_head_may_be_absent_from_the_checkpoint() -> None:
    exported = [("embed", (4, 2)), ("lm_head.weight", (4, 2))]
    assert compare_shapes(exported, {"embed": (4, 2)}, may_be_absent={"lm_head.weight"}) == []


def test_remote_sends_the_api_key_only_to_its_url() -> None:
    seen: list[tuple[str, str | None]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            seen.append((self.path, self.headers.get("Authorization")))
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        remote = RemoteVLLM(f"http://127.0.0.1:{server.server_port}/", transport=Directory("/tmp/unused"),
                            api_key="s3cret")
        remote.request("POST", "/pause?mode=wait")
    finally:
        server.shutdown()
    assert seen == [("/pause?mode=wait", "Bearer s3cret")]


@pytest.mark.subprocess
def test_a_rank_gone_mid_sync_is_named_by_the_survivor(tmp_path: Path) -> None:
    """Issue 39: a trainer rank killed during a sync left the others with gloo's bare "Connection closed by peer"; the
    survivor's agreement now names the rank gone (the ranks check in through the launcher's store), within seconds."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    out = tmp_path / "rank_gone.json"
    proc = subprocess.run([sys.executable, str(ROOT / "tests/scripts/rank_gone.py"), "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=180)
    assert out.exists(), proc.stderr[-4000:]
    got = json.loads(out.read_text())
    assert got["error"] is not None and got["error"].startswith("WeightSyncError: Weight sync of version 4 failed: The"
                                                                " sync's ranks could not agree: trainer rank(s) [1] did"
                                                                " not answer"), got
    assert "This rank's own failure: RuntimeError: Connection closed by peer" in got["error"]
    assert got["seconds"] < 15, got["seconds"]
