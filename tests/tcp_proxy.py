"""A TCP proxy for tests: one listening port forwarded to a target, with injected one-way delay
and jitter per direction, dropped connections, and refused ones. It stands in for kernel netem
(absent on these machines) between processes or network namespaces.

Delay keeps TCP's order: a chunk read at time t is written at max(t + delay + jitter, when the
previous chunk of that direction was written), so jitter stretches gaps but never reorders bytes.
Every delivery is logged as (direction, read_at, written_at, bytes) on the loop's clock, so a test
can check what the proxy did without timing anything itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from dataclasses import dataclass, field

CHUNK = 65536


@dataclass
class Delivery:
    direction: str  # "up": client -> target; "down": target -> client
    read_at: float
    written_at: float
    size: int


@dataclass
class TcpProxy:
    target_host: str
    target_port: int
    delay_s: float = 0.0  # one way, each direction
    jitter_s: float = 0.0  # plus uniform [0, jitter_s)
    listen_host: str = "127.0.0.1"
    seed: int = 0
    refuse: bool = False  # new connections are closed at once (a peer that is down)
    log: list[Delivery] = field(default_factory=list)
    port: int = 0  # where it listens, once started
    _server: asyncio.Server | None = None
    _links: set[asyncio.Task[None]] = field(default_factory=set)
    _writers: set[asyncio.StreamWriter] = field(default_factory=set)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    async def start(self, port: int = 0) -> int:
        """Listen; returns the port."""
        self._server = await asyncio.start_server(self._accept, self.listen_host, port)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        self.drop_all()
        for task in list(self._links):
            task.cancel()
        await asyncio.gather(*self._links, return_exceptions=True)

    def drop_all(self) -> None:
        """Reset every open connection, as a cut link or a killed peer would."""
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    @property
    def connections(self) -> int:
        return len(self._writers) // 2

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        if self.refuse:
            client_w.transport.abort()
            return
        try:
            target_r, target_w = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError:
            client_w.transport.abort()
            return
        self._writers |= {client_w, target_w}
        task = asyncio.current_task()
        assert task is not None
        self._links.add(task)
        try:
            await asyncio.gather(self._pipe("up", client_r, target_w), self._pipe("down", target_r, client_w))
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self._links.discard(task)
            for w in (client_w, target_w):
                self._writers.discard(w)
                w.transport.abort()

    async def _pipe(self, direction: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, float, bytes]] = asyncio.Queue()
        last_due = 0.0

        async def deliver() -> None:
            while True:
                read_at, due, data = await queue.get()
                if not data:
                    with contextlib.suppress(OSError):
                        writer.write_eof()  # half-close, as the sender did
                    return
                while (wait := due - loop.time()) > 0:  # the injected delay (timers may fire a hair early)
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()
                self.log.append(Delivery(direction, read_at, loop.time(), len(data)))

        sender = asyncio.create_task(deliver())
        try:
            while True:
                data = await reader.read(CHUNK)
                now = loop.time()
                jitter = self._rng.uniform(0.0, self.jitter_s) if self.jitter_s else 0.0
                last_due = max(last_due, now + self.delay_s + jitter)
                queue.put_nowait((now, last_due, data))
                if not data:
                    break
            await sender
        finally:
            sender.cancel()
