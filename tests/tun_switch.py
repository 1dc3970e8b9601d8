"""A network switch in user space with a one-way delay per link, for namespaces (tests/netns.py).

Kernel netem is missing on these machines. Here each node's only interface is a TUN device whose
IP packets this process reads, holds for `delay_s`, and writes to the TUN of the node that owns
the destination address: every packet of every protocol (ZeroMQ, gloo, the rendezvous store,
TCP's acknowledgements) crosses a link with that delay, as on a long cable. With a fixed delay,
packets of one direction leave in the order they came. tests/tcp_proxy.py does the same for one
TCP connection whose address can be pointed at it; this needs no address changed.
"""

from __future__ import annotations

import fcntl
import heapq
import os
import selectors
import struct
import subprocess
import threading
import time

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000


class TunSwitch:
    def __init__(self, namespaces: list[str], addrs: list[str], delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.fds: list[int] = []
        self.by_addr: dict[bytes, int] = {}  # destination IPv4 address -> TUN fd
        self.forwarded = 0
        self._stop = threading.Event()
        for i, (ns, addr) in enumerate(zip(namespaces, addrs, strict=True)):
            name = f"tun{i}"
            fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
            fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
            self.fds.append(fd)
            # The device moves into the node's namespace; this fd still reads and writes it.
            for cmd in (
                ["link", "set", name, "netns", ns],
                ["-n", ns, "addr", "add", f"{addr}/24", "dev", name],
                ["-n", ns, "link", "set", name, "up"],
                ["-n", ns, "link", "set", "lo", "up"],
            ):
                subprocess.run(["ip", *cmd], check=True, capture_output=True, timeout=10)
            self.by_addr[bytes(int(b) for b in addr.split("."))] = fd
        self._thread = threading.Thread(target=self._run, name="tun-switch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        for fd in self.fds:
            sel.register(fd, selectors.EVENT_READ)
        queue: list[tuple[float, int, int, bytes]] = []  # (due, sequence, destination fd, packet)
        seq = 0
        while not self._stop.is_set():
            timeout = max(0.0, queue[0][0] - time.monotonic()) if queue else 0.1
            for key, _ in sel.select(timeout):
                while True:
                    try:
                        packet = os.read(key.fd, 65536)
                    except BlockingIOError:
                        break
                    if len(packet) < 20 or packet[0] >> 4 != 4:
                        continue  # IPv4 only (router solicitations and the like are dropped)
                    dst = self.by_addr.get(packet[16:20])
                    if dst is not None:
                        seq += 1
                        heapq.heappush(queue, (time.monotonic() + self.delay_s, seq, dst, packet))
            now = time.monotonic()
            while queue and queue[0][0] <= now:
                _, _, dst, packet = heapq.heappop(queue)
                try:
                    os.write(dst, packet)
                    self.forwarded += 1
                except OSError:
                    pass  # its queue is full: dropped, as a congested link would (TCP resends)
        sel.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for fd in self.fds:
            os.close(fd)
