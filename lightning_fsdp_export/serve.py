"""Start a vLLM server ready for this package's weight sync on this host's routable address, and publish its URL.

    python -m lightning_fsdp_export.serve --url-file /shared/run/servers.txt -- --model ckpt [vLLM's arguments]

For schedulers that place servers on hosts nobody names in advance (SLURM's ``srun``, a Kubernetes pod; Ray:
:mod:`lightning_fsdp_export.ray`). It starts ``python -m vllm.entrypoints.openai.api_server`` with what the sync
needs (``VLLM_SERVER_DEV_MODE=1``, ``--weight-transfer-config '{"backend": "gloo"}'``, the swap route), bound to the
address of this host that reaches ``--reach`` (default: SLURM's launching node, ``SLURM_LAUNCH_NODE_IPADDR``, where
set; else the hostname's address unless it is a loopback one, else the interface of the default route), on a free
port; once the server answers ``/health`` it appends its URL to ``--url-file`` (a file on storage the trainer
reads by its absolute path: ``RemoteVLLM(Path("/shared/run/servers.txt"), transport=Gloo(...), min_servers=k)``
re-reads it before every round; the transport is gloo, the backend these servers load: the default on a CUDA
machine, NCCL, is refused by the sync's pre-check) and removes it when the server stops (SIGTERM, SIGINT or a
crash). The exit status is the server's.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from lightning_fsdp_export._network import free_port, is_loopback, route_address
from lightning_fsdp_export.servers.http import Server, ServerError

if sys.platform != "win32":
    import fcntl
else:  # (Windows: no file locks, no interface lookups)
    fcntl = None

__all__ = ["SERVER_ENV", "healthy", "main", "server_command", "this_host_address", "wait_healthy"]

SERVER_ENV = {"VLLM_SERVER_DEV_MODE": "1"}
"""The environment a server needs for the sync: vLLM's dev routes (pause, weight transfer, ``/collective_rpc``)."""


def server_command(vllm_args: Sequence[str], host: str, port: int, backend: str = "gloo") -> list[str]:
    """``python -m vllm.entrypoints.openai.api_server`` on ``host:port`` with the weight-transfer ``backend`` and
    this package's swap route (a staged round's swap carried out by the server), then ``vllm_args`` (``--model``...)."""
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", host, "--port", str(port),
            "--weight-transfer-config", json.dumps({"backend": backend}),
            "--middleware", "lightning_fsdp_export_plugin.swap_route", *vllm_args]


def this_host_address(reach: str | None = None) -> str:
    """The address of this host that peers reach: the one routing to ``reach`` (default: SLURM's launching node,
    ``SLURM_LAUNCH_NODE_IPADDR``, where set); else the hostname's address, unless it is a loopback one (127.0.1.1 on
    stock Debian/Ubuntu hosts); else the one routing to the default route's side of the internet (nothing is sent)."""
    reach = reach or os.environ.get("SLURM_LAUNCH_NODE_IPADDR")
    if reach:
        return route_address(reach)
    try:
        named = socket.gethostbyname(socket.gethostname())
    except OSError:
        named = "127.0.0.1"
    if not is_loopback(named):
        return named
    try:
        return route_address("192.0.2.1")  # (TEST-NET-1: any address off this host picks the default route)
    except ValueError:
        return named


def healthy(url: str, timeout: float = 2.0) -> bool:
    """Whether the server at ``url`` answers ``/health``."""
    try:
        Server(url, api_key=None, timeout=timeout).health()
        return True
    except (ServerError, ValueError):
        return False


def wait_healthy(url: str, alive: Callable[[], bool], timeout: float) -> str | None:
    """Poll ``url``'s ``/health`` each second until it answers (``None``), or say why not: the server's process
    exited (``alive()`` false) or ``timeout`` seconds passed."""
    deadline = time.monotonic() + timeout
    while not healthy(url):
        if not alive():
            return "it exited"
        if time.monotonic() > deadline:
            return f"not up in {timeout:.0f} s"
        time.sleep(1.0)
    return None


def _edit(url_file: Path, url: str, add: bool) -> None:
    """Add ``url`` as a line of ``url_file``, or remove its lines, under an exclusive lock (servers share the file)."""
    url_file.parent.mkdir(parents=True, exist_ok=True)
    with open(url_file, "a+") as f:
        if fcntl is not None:
            fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        lines = [line for line in f.read().splitlines() if line.split("#", 1)[0].strip() != url]
        f.seek(0)
        f.truncate()
        f.write("".join(line + "\n" for line in [*lines, *([url] if add else [])]))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_fsdp_export.serve", description=__doc__.split("\n")[0],
                                     epilog="Everything after `--` goes to vLLM's api_server (at least --model).")
    parser.add_argument("--url-file", type=Path, required=True, help="where the server's URL is listed while it runs")
    parser.add_argument("--reach", default=None, help="a host the trainers run on (default: SLURM's launching node)")
    parser.add_argument("--host", default=None, help="bind this address instead of finding one")
    parser.add_argument("--port", type=int, default=0, help="0: a free port")
    parser.add_argument("--backend", default="gloo", help="the weight-transfer backend (gloo: this package's)")
    parser.add_argument("--ready-timeout", type=float, default=900.0, help="seconds to answer /health")
    args, vllm_args = parser.parse_known_args(argv)
    vllm_args = [a for a in vllm_args if a != "--"]
    if "--model" not in vllm_args and not any(a.startswith("--model=") for a in vllm_args):
        parser.error("give vLLM's arguments after `--`, at least --model (e.g. -- --model /ckpt --dtype bfloat16)")
    host = args.host or this_host_address(args.reach)
    port = args.port or free_port(host)
    url = f"http://{host}:{port}"
    server = subprocess.Popen(server_command(vllm_args, host, port, args.backend), env={**os.environ, **SERVER_ENV})
    stop = lambda signum, frame: server.send_signal(signum)  # noqa: E731 - the server stops, then we clean up
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    why = wait_healthy(url, lambda: server.poll() is None, args.ready_timeout)
    if why is not None:
        print(f"lightning_fsdp_export.serve: {url} did not answer /health: {why}", file=sys.stderr, flush=True)
        server.kill()
        return server.wait() if why == "it exited" else 1
    _edit(args.url_file, url, add=True)
    print(f"lightning_fsdp_export.serve: {url} listed in {args.url_file}", file=sys.stderr, flush=True)
    try:
        return server.wait()
    finally:
        _edit(args.url_file, url, add=False)


if __name__ == "__main__":
    sys.exit(main())
