"""Ray: vLLM servers that Ray places and restarts, feeding ``RemoteVLLM``'s pool; ``LazyExportFSDP2`` in Ray Train.

    servers = VLLMServers("/models/policy", count=2, actor_options={"num_gpus": 1})
    target = RemoteVLLM(servers.urls, transport=Gloo(shard_direct=True), min_servers=1)
    ...                                  # in Ray Train's workers too: a VLLMServers travels in train_loop_config
    servers.scale(3)                     # the pool takes the new server at the next sync, every tensor pushed
    servers.shutdown()

Each server is a Ray actor running ``python -m vllm.entrypoints.openai.api_server`` with the flags this project's
servers need (``VLLM_SERVER_DEV_MODE=1``, the ``gloo`` weight transfer, the swap route), bound to the address Ray
knows its node by, on a free port of that node. The actor lives as long as its server: a server that exits ends its
actor, and Ray starts the actor again (``max_restarts``), which starts a new server, on the same port where Ray
restarts it on the same node. Meanwhile the pool finds the server silent and sets it aside; when it answers again it
rejoins and takes every tensor at its next sync (restarted on another node, its new URL joins instead). A small named
actor owns the servers, so the driver, Ray Train's workers and a trainer Ray restarted all see the same servers
through :meth:`VLLMServers.urls` (the callable ``RemoteVLLM`` re-reads before every round), and
:meth:`VLLMServers.scale` changes them for everyone.

:class:`RayLazyExportFSDP2` is ``LazyExportFSDP2`` as Ray's own Lightning strategies are: the device and the world
come from Ray Train's context (Ray gives each worker its own GPU). Ray's ``prepare_trainer`` only accepts Ray's own
strategy classes, so leave it out; pass ``plugins=[RayLightningEnvironment()]`` as Ray's guide says.

The package never imports this module; it imports Ray (``pip install 'lightning-fsdp-export[ray]'``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
import ray.train
import ray.train.torch
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from typing_extensions import override

from lightning_fsdp_export._network import free_port
from lightning_fsdp_export.serve import SERVER_ENV, healthy, server_command, wait_healthy
from lightning_fsdp_export.strategy import LazyExportFSDP2

__all__ = ["RayLazyExportFSDP2", "VLLMServers"]

# Runs the server in a process group of its own (with vLLM's engine process, which outlives its API server when that
# is killed) and ends the whole group when the server exits or when the actor that started it is gone. Ray ends an
# actor with SIGKILL (nothing of the actor runs then) and kills its direct children too, so the reaper detaches at
# once (a fork whose parent exits: the actor's child is gone before Ray could kill it) and watches the actor's pid.
_REAPER = """\
import os, signal, subprocess, sys, time
actor = int(sys.argv[1])
if os.fork():
    os._exit(0)
server = subprocess.Popen(sys.argv[3:])
while server.poll() is None:
    try:
        os.kill(actor, 0)
    except ProcessLookupError:
        break
    time.sleep(0.5)
os.killpg(0, signal.SIGKILL)
"""
_REAPER_TAG = "lfe-vllm-reaper"  # (its argv[2]: what `ps` shows of it)


@dataclass(frozen=True, kw_only=True)
class _ServerSpec:
    """What every server of a :class:`VLLMServers` is started with (see its arguments)."""

    model: str
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    backend: str = "gloo"
    ready_timeout: float = 900.0
    log_dir: str | None = None


class _Server:
    """A Ray actor: one vLLM server on this node, started when the actor starts; the actor exits when it does."""

    def __init__(self, spec: _ServerSpec, fleet: Any, index: int) -> None:
        host = ray.util.get_node_ip_address()
        before = ray.get(fleet.before.remote(index))  # (its URL and process group, where Ray restarted it)
        port = 0
        if before is not None and before[0].startswith(f"http://{host}:"):  # restarted on the same node: same URL
            _end_group(before[1])
            port = int(before[0].rsplit(":", 1)[1])
        port = free_port(host, port, wait=10.0)  # (that port once free, within 10 s: else another)
        self._url = f"http://{host}:{port}"
        command = server_command(["--model", spec.model, *spec.args], host, port, spec.backend)
        self.log = Path(spec.log_dir or tempfile.gettempdir()) / f"vllm-{host}-{port}.log"
        with open(self.log, "a") as log:
            detach = subprocess.Popen([sys.executable, "-c", _REAPER, str(os.getpid()), _REAPER_TAG, *command],
                                      env={**os.environ, **SERVER_ENV, **spec.env},
                                      stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        detach.wait()  # (the reaper forked away: its group is the server's)
        self._group = detach.pid
        self._stopping = False
        why = wait_healthy(self._url, self._alive, spec.ready_timeout)
        if why is not None:
            _end_group(self._group)
            raise RuntimeError(f"the vLLM server for {spec.model} at {self._url} did not start: {why}; its log"
                               f" ({self.log}) ends:\n{self.log_tail()}")
        ray.get(fleet.register.remote(index, self._url, self._group))
        threading.Thread(target=self._watch, daemon=True, name="lfe-vllm-watch").start()

    def url(self) -> str:
        """The server's URL."""
        return self._url

    def group(self) -> int:
        """The server's process group on the actor's node (the server, its engine process, its reaper)."""
        return self._group

    def log_tail(self, chars: int = 3000) -> str:
        """The end of the server's log."""
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def stop(self) -> None:
        """End the server and every process it started (before its actor is killed for good)."""
        self._stopping = True
        _end_group(self._group)

    def _alive(self) -> bool:
        try:
            os.killpg(self._group, 0)
            return True
        except ProcessLookupError:
            return False

    def _watch(self) -> None:
        """The server exited (it crashed, or someone killed it; its reaper ended the rest of the group): end the
        actor too, so Ray restarts both."""
        while self._alive():
            time.sleep(1.0)
        if not self._stopping:
            os._exit(1)


def _end_group(group: int) -> None:
    """SIGKILL every process of process group ``group`` on this node (a server's: its leader may be gone already)."""
    try:
        os.killpg(group, signal.SIGKILL)
    except ProcessLookupError:
        pass


class _Fleet:
    """A Ray actor owning the servers' actors, and the URL each one registered once its server was up.

    Ray restarts it where it dies (``max_restarts=-1``). Its servers' actors died with it (Ray's ownership): the new
    owner starts as many again, the count it last ran kept in a file on its node (``memo``; on another node, where
    ``owner_options`` let Ray move it: the count it was made with)."""

    def __init__(self, spec: _ServerSpec, actor_options: Mapping[str, Any], max_restarts: int, count: int,
                 memo: str) -> None:
        self._make = ray.remote(_Server).options(max_restarts=max_restarts, **{"num_cpus": 1, **actor_options})
        self._spec = spec
        self._servers: list[Any] = []
        self._urls: dict[int, tuple[str, int]] = {}  # by server index: the URL its server last answered at, and
        # the server's process group on its node
        self._me = ray.get_runtime_context().current_actor
        self._memo = Path(memo)
        if ray.get_runtime_context().was_current_actor_reconstructed:
            with contextlib.suppress(OSError, ValueError):
                count = int(self._memo.read_text())
        self.scale(count)

    def forget(self) -> None:
        self._memo.unlink(missing_ok=True)

    def scale(self, count: int) -> None:
        self._memo.write_text(str(count))
        while len(self._servers) < count:
            self._servers.append(self._make.remote(self._spec, self._me, len(self._servers)))
        while len(self._servers) > count:
            server = self._servers.pop()
            try:  # its server and the processes it started first (Ray kills an actor's direct children only)
                ray.get(server.stop.remote(), timeout=30)
            except ray.exceptions.RayError:
                pass  # (dead or restarting: its next start would have ended the group)
            ray.kill(server, no_restart=True)
            self._urls.pop(len(self._servers), None)

    def servers(self) -> list[Any]:
        return list(self._servers)

    def register(self, index: int, url: str, group: int) -> None:
        if index < len(self._servers):
            self._urls[index] = (url, group)

    def before(self, index: int) -> tuple[str, int] | None:
        return self._urls.get(index)

    def urls(self) -> list[str]:
        return [self._urls[i][0] for i in range(len(self._servers)) if i in self._urls]

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()


class VLLMServers:
    """vLLM servers as Ray actors, on the nodes Ray picks, restarted by Ray, their live URLs for ``RemoteVLLM``.

    Args:
        model: the checkpoint each server serves (a path every server's node can read, or a hub name).
        count: how many servers to start (:meth:`scale` changes it later).
        args: more ``api_server`` arguments (``--tensor-parallel-size 2``, ``--enable-lora``, ``--api-key`` ...).
        env: more environment for each server (``VLLM_SERVER_DEV_MODE=1`` is always set: the weight routes need it).
        actor_options: Ray's ``.options()`` for each server's actor: ``num_gpus`` (one per GPU the server uses),
            ``num_cpus`` (default 1), ``resources``, ``scheduling_strategy`` (a placement group), ``runtime_env``.
        backend: the weight-transfer backend the servers load (``"gloo"``: this package's; ``"nccl"``: vLLM's).
        max_restarts: how often Ray restarts a server's actor (``-1``: always).
        ready_timeout: seconds a server has to answer ``/health`` after it starts.
        log_dir: where each server writes its log on its node (``vllm-<address>-<port>.log``; default: the temp dir).
        name: the Ray name of the actor owning the servers (one per set of servers in a Ray namespace).
        owner_options: Ray's ``.options()`` for that owner; default: on the node that makes this object (the
            driver's), as Ray Train pins its controller: by Ray's ownership the servers' actors share their owner's
            fate, so an owner on a server's node would take every server down with that node. Ray restarts the
            owner where it dies alone (``max_restarts=-1``): the servers that died with it start again, as many as
            it last ran; meanwhile the pool finds them silent (the sync fails where fewer than ``min_servers``
            answer), and they rejoin with every tensor once up, at new URLs.

    ``urls`` is what ``RemoteVLLM(servers.urls, min_servers=k)`` re-reads before each round: a server is listed from
    the moment it first answers; while Ray restarts it, the pool finds it silent and sets it aside; restarted on the
    same node it answers at the same URL and rejoins with every tensor (on another node: its new URL joins). Every
    method is safe to call from any process of the Ray cluster the object was made in; the object travels
    (``train_loop_config``). A server that fails to start ends its actor for good: :meth:`wait` names its log's end.
    """

    _fleet: Any  # (the owner's Ray actor handle: Ray types a handle's methods as the class's, not as remote calls)

    def __init__(self, model: str | os.PathLike[str], count: int, *, args: Sequence[str] = (),
                 env: Mapping[str, str] | None = None, actor_options: Mapping[str, Any] | None = None,
                 backend: str = "gloo", max_restarts: int = -1, ready_timeout: float = 900.0,
                 log_dir: str | os.PathLike[str] | None = None, name: str = "lfe-vllm-servers",
                 owner_options: Mapping[str, Any] | None = None) -> None:
        _check_count(count)
        if isinstance(args, str):
            raise TypeError(f"VLLMServers(args={args!r}) must be a list of arguments, e.g. {args.split()!r}.")
        if not ray.is_initialized():
            raise RuntimeError("VLLMServers(...) needs Ray: call ray.init(...) first (ray.init(address='auto') on a"
                               " node of a running cluster).")
        spec = _ServerSpec(model=str(model), args=tuple(args), env=dict(env or {}), backend=backend,
                           ready_timeout=ready_timeout, log_dir=None if log_dir is None else str(log_dir))
        self.name = name
        context = ray.get_runtime_context()
        here = NodeAffinitySchedulingStrategy(context.get_node_id(), soft=False)
        # (restarted where it dies; a call made meanwhile waits for the new one instead of failing)
        options = {"scheduling_strategy": here, "max_restarts": -1, "max_task_retries": -1, **(owner_options or {})}
        memo = Path(tempfile.gettempdir()) / f"lfe-vllm-servers-{context.get_job_id()}-{name}.count"
        self._fleet = ray.remote(_Fleet).options(name=name, num_cpus=0, max_concurrency=8, **options).remote(
            spec, dict(actor_options or {}), max_restarts, count, str(memo))
        ray.get(self._fleet.node.remote())  # (its servers are started: a failure to make the owner is said here)

    def urls(self) -> list[str]:
        """Each server's URL once its server first answered, in the servers' order (what ``RemoteVLLM`` re-reads;
        the pool asks each for ``/health`` and sets aside one that does not answer)."""
        return ray.get(self._fleet.urls.remote())

    def scale(self, count: int) -> None:
        """Run ``count`` servers: new ones start (and join the pool once up), the last ones stop (and leave it)."""
        _check_count(count)
        ray.get(self._fleet.scale.remote(count))

    def owner_node(self) -> str:
        """The Ray node id the servers' owner runs on (the driver's, unless ``owner_options`` placed it)."""
        return ray.get(self._fleet.node.remote())

    def actors(self) -> list[Any]:
        """The servers' Ray actor handles, in order (``ray.kill(handle, no_restart=False)`` restarts one)."""
        return ray.get(self._fleet.servers.remote())

    def wait(self, count: int | None = None, timeout: float = 900.0) -> list[str]:
        """Block until ``count`` servers (default: all) answer; their URLs. Raises ``TimeoutError`` naming how many
        answered, and the first server log's end if one failed to start."""
        want = len(self.actors()) if count is None else count
        deadline = time.monotonic() + timeout
        while len(urls := [url for url in self.urls() if healthy(url)]) < want:
            if time.monotonic() > deadline:
                raise TimeoutError(f"VLLMServers.wait: {len(urls)} of {want} server(s) up after {timeout:.0f} s"
                                   f" ({urls}). {self._first_failure()}")
            time.sleep(1.0)
        return urls

    def shutdown(self) -> None:
        """Stop every server (their actors are not restarted) and the actor owning them."""
        self.scale(0)
        ray.get(self._fleet.forget.remote())
        ray.kill(self._fleet, no_restart=True)

    def _first_failure(self) -> str:
        for actor in self.actors():
            try:
                ray.get(actor.url.remote(), timeout=0.1)
            except ray.exceptions.GetTimeoutError:
                continue
            except ray.exceptions.RayError as err:
                return f"A server failed: {err}"
        return "Are there resources for them (actor_options), and is the model readable on every node?"


def _check_count(count: Any) -> None:
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"VLLMServers: count={count!r} must be a whole number of servers, 0 or more.")


class RayLazyExportFSDP2(LazyExportFSDP2):
    """``LazyExportFSDP2`` inside Ray Train (``TorchTrainer``): the device is the one Ray gave this worker, and
    ``data_parallel_size="auto"`` is Ray's world size (Ray starts each worker as a Trainer of its own, so Lightning's
    ``num_nodes * devices`` counts one). Use it with ``plugins=[RayLightningEnvironment()]``; it takes
    ``LazyExportFSDP2``'s arguments."""

    @property
    @override
    def root_device(self) -> torch.device:
        return ray.train.torch.get_device()

    @override
    def _before_process_group(self) -> None:
        if self._data_parallel_size == "auto":
            self._data_parallel_size = ray.train.get_context().get_world_size() // self._tensor_parallel_size
        super()._before_process_group()
