"""A userspace wire between two interfaces of this namespace: every Ethernet frame that arrives on one is sent out of
the other, held ``--delay`` seconds and dropped with probability ``--loss`` (this machine's kernel has no ``netem``;
``tests/hosts.py``'s ``Hosts.lossy`` puts a host's link through it). Runs until killed.

    python tests/scripts/wire.py --a IF_A --b IF_B --delay 0.1 --loss 0.07 --seed 1

The senders on both sides must not offload their TCP checksums (``Hosts.lossy`` turns it off): a copied frame would
carry a partial one and be dropped.
"""

from __future__ import annotations

import argparse
import collections
import random
import socket
import threading
import time

ETH_P_ALL = 0x0003
PACKET_OUTGOING = 4  # (a frame this wire sent out of an interface shows up on that interface's socket too)


def pump(src: socket.socket, dst: socket.socket, delay: float, loss: float, rng: random.Random) -> None:
    """Frames arriving on ``src`` out of ``dst``, each ``delay`` seconds later (in order), a share ``loss`` dropped."""
    queue: collections.deque[tuple[float, bytes]] = collections.deque()
    ready = threading.Condition()

    def send() -> None:
        while True:
            with ready:
                while not queue:
                    ready.wait()
                due, frame = queue.popleft()
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            try:
                dst.send(frame)
            except OSError:
                pass  # (the interface went down: a cut link)

    threading.Thread(target=send, daemon=True).start()
    while True:
        frame, address = src.recvfrom(65535)
        if address[2] == PACKET_OUTGOING or rng.random() < loss:
            continue
        with ready:
            queue.append((time.monotonic() + delay, frame))
            ready.notify()


def offload_off(interface: str) -> None:
    """Turn off ``interface``'s transmit checksum offload, TSO and GSO (``SIOCETHTOOL``, as ``ethtool -K IF tx off
    tso off gso off``; no ethtool here): its frames carry whole checksums, at most one MTU each."""
    import ctypes
    import fcntl
    import struct

    for command in (0x17, 0x1F, 0x24):  # ETHTOOL_STXCSUM, ETHTOOL_STSO, ETHTOOL_SGSO
        value = ctypes.create_string_buffer(struct.pack("II", command, 0))
        request = struct.pack("16sP", interface.encode(), ctypes.addressof(value))
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            fcntl.ioctl(sock.fileno(), 0x8946, request)  # SIOCETHTOOL


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--offload-off", default=None, help="only turn this interface's offloads off, and exit")
    parser.add_argument("--a")
    parser.add_argument("--b")
    parser.add_argument("--delay", type=float, default=0.0, help="seconds each frame is held, each way")
    parser.add_argument("--loss", type=float, default=0.0, help="the share of frames dropped, each way")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.offload_off:
        offload_off(args.offload_off)
        return
    sockets = []
    for name in (args.a, args.b):
        sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        sock.bind((name, 0))
        sockets.append(sock)
    rng = random.Random(args.seed)
    threading.Thread(target=pump, args=(sockets[0], sockets[1], args.delay, args.loss, random.Random(rng.random())),
                     daemon=True).start()
    pump(sockets[1], sockets[0], args.delay, args.loss, random.Random(rng.random()))


if __name__ == "__main__":
    main()
