"""Where a process reaches another across hosts: the local address that routes to a peer, and the gloo device bound to
it; torch and the standard library only.

On stock Debian/Ubuntu hosts the hostname resolves to 127.0.1.1, which is what gloo advertises by default (and what
``socket.gethostbyname(socket.gethostname())`` gives): a peer on another host can never dial it, and since gloo lets
the side with the higher address dial, a run "works" against 10.x peers and hangs against 192.168.x or 172.16.x ones.
Both halves of the transfer group therefore bind the address the kernel would use to reach the other side.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

if sys.platform != "win32":
    import fcntl
else:  # (Windows: no file locks, no interface lookups)
    fcntl = None

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def is_loopback(host: str) -> bool:
    """``host`` (a name or an address) is this host's loopback: ``localhost``, 127.x, ``::1``."""
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def route_address(peer: str, port: int = 9) -> str:
    """This host's IPv4 address on the interface the kernel would use to reach ``peer`` (a name or an address;
    a loopback peer gives 127.0.0.1, an address of this host gives itself). Nothing is sent (a UDP socket is only
    connected). Raises ``ValueError`` naming ``peer`` if it does not resolve or no route reaches it."""
    try:
        target = socket.getaddrinfo(peer, port, socket.AF_INET, socket.SOCK_DGRAM)[0][4]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(target)
            return str(probe.getsockname()[0])
    except OSError as err:
        raise ValueError(f"no local address reaches {peer!r} ({err}): is the name right and the network up? Give the"
                         " transport's master_address= an address of this host that the servers reach.") from None


def free_port(host: str, want: int = 0, wait: float = 0.0) -> int:
    """A port free on ``host``: ``want`` where it is free (or frees) within ``wait`` seconds, else one the kernel
    picks."""
    deadline = time.monotonic() + wait
    while want:
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, want))
                return want
            except OSError:
                if time.monotonic() > deadline:
                    break
        time.sleep(0.5)
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def gloo_group(store: Any, rank: int, world_size: int, timeout: Any, peer: str) -> dist.ProcessGroupGloo:
    """A gloo group whose device binds :func:`route_address` of ``peer`` (the store's host), unless
    ``GLOO_SOCKET_IFNAME`` names the interface (then gloo's own device, which reads it). gloo's default device takes
    the hostname's address, 127.0.1.1 on many hosts: a peer on another host cannot dial it.

    (torch has no public way to hand a ``ProcessGroupGloo`` its device: ``_Options._devices`` is what torch's own
    ``new_group`` fills; ``tests/test_unit.py`` builds a group through it, so a torch that changes it fails there.)"""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # (private: torch's stubs omit it)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=route_address(peer))]
    options._timeout = timeout
    return dist.ProcessGroupGloo(store, rank, world_size, options)


class RendezvousError(ConnectionError):
    """The transfer group could not be formed between the trainer ranks and the servers' workers (a network setting,
    not a server that is down: retrying does not help, so a rendezvous at setup fails the fit)."""


def rendezvous_error(err: BaseException, info: Any) -> RendezvousError:
    """``err`` (what gloo or the store raised on trainer rank ``info.rank``) with the address, and what to do."""
    address = f"{info.master_address}:{info.master_port}"
    return RendezvousError(
        f"trainer rank {info.rank} could not form the transfer group at {address} with the servers' workers"
        f" ({type(err).__name__}: {str(err).strip()[:400]}). Each side binds the address that routes to the other"
        " (the store's host for the servers); a peer advertising 127.0.1.1 (a hostname resolving to loopback) or a"
        " port a firewall drops cannot be dialled: set GLOO_SOCKET_IFNAME=<interface> on the host that advertised the"
        " wrong address, give the transport master_address= an address of trainer rank 0 that the servers reach, and"
        " open the ports (docs/guides/across-machines.md).")


class Answer:
    """``call()`` run in a daemon thread (a request or a rendezvous that may block as long as its peer does: the process
    can still exit while it waits); :meth:`result` waits for it and returns or raises what it did."""

    def __init__(self, call: Callable[[], Any], name: str = "lfe-rendezvous") -> None:
        self._value: Any = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(call,), name=name, daemon=True)
        self._thread.start()

    def _run(self, call: Callable[[], Any]) -> None:
        try:
            self._value = call()
        except BaseException as err:  # noqa: BLE001 - handed to result()
            self.error = err

    def done(self, timeout: float | None = None) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def result(self) -> Any:
        self.done()
        if self.error is not None:
            raise self.error
        return self._value


def rendezvous(join: Callable[[], Any], request: Callable[[], Any], info: Any, poll_s: float = 0.2) -> None:
    """Trainer rank 0 joins the transfer group (``join``) while ``request`` asks the servers' workers to join it; the
    first failure of either is raised at once as a :class:`RendezvousError` (the other may block until its timeout: a
    peer that dialled the wrong address fails in seconds on one side only)."""
    answer, joined = Answer(request, "lfe-rendezvous-request"), Answer(join)
    while not joined.done(poll_s):
        if answer.done(0) and answer.error is not None:
            raise rendezvous_error(answer.error, info) from answer.error
    if joined.error is not None:
        raise rendezvous_error(joined.error, info) from joined.error
    answer.result()


def interface_of(address: str) -> str | None:
    """The name of this host's network interface that holds IPv4 ``address`` (its primary address), ``None`` if none
    does (Linux and macOS: ``SIOCGIFADDR``; elsewhere ``None``)."""
    if fcntl is None:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
            except OSError:
                continue
            if socket.inet_ntoa(packed[20:24]) == address:
                return name
    return None


def trainer_gloo_interface(main_address: str) -> str | None:
    """The interface torch's own gloo group (a CPU trainer's process group) should bind on this host, where gloo's
    default would not reach the other ranks: ``GLOO_SOCKET_IFNAME`` unset, ``main_address`` (rank 0's) a routable
    address (another host's, or this host's own: rank 0 itself, or a rank beside it, in a job that may span hosts, as
    Ray Train's ``MASTER_ADDR`` always is), and this hostname resolving to a loopback address (127.0.1.1 on stock
    Debian/Ubuntu hosts), which gloo would advertise to the ranks on other hosts; else ``None``. A
    ``main_address`` naming this host (SLURM's node name, which resolves to 127.0.1.1 there) needs nothing: binding the
    loopback interface would also make the transfer group advertise 127.0.0.1 to servers on other hosts."""
    if os.environ.get("GLOO_SOCKET_IFNAME") or not main_address or is_loopback(main_address):
        return None
    try:
        if is_loopback(route_address(main_address)):
            return None
    except ValueError:  # no route: torch's own error says more than ours could
        return None
    try:
        own = socket.gethostbyname(socket.gethostname())
    except OSError:
        own = "127.0.0.1"
    return None if not is_loopback(own) else interface_of(route_address(main_address))
