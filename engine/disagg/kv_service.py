"""One stage's part of prefill/decode disaggregation: its KV sender or its KV receiver.

Prefill side (`KvExporter`): per room, the host first hands over the handshake (where each of
the stage's layers goes: `KvTarget`s, highest prefill stage first); the stage connects and
reports WaitingForInput. Once the prompt is prefilled, `export` reports Transferring, streams the
room's blocks layer slice by layer slice in chunks of whole blocks, and reports Success, or
Failed with the reason. The host decides everything else (engine side, scheduler/bootstrap.py).

Decode side (`KvImporter`): the host announces a room with the blocks it reserved; chunks for
rooms not announced, or outside the room's blocks or this stage's layers, are dropped and
logged, never written. When every block of every one of its layers is in (from whichever
prefill stages hold them: the decode side need not know how the prefill side is cut), the stage
reports Received.

Blocks are read and written where the stage computes (`run`), so the cache is never touched by
two threads at once. Faults (engine/disagg/faults.py) apply here, per stage.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import zmq.asyncio

from ppserve.engine.disagg.faults import FaultDice
from ppserve.engine.disagg.kv_blocks import read_blocks, write_blocks
from ppserve.transport.kv_transfer import KvChunk, KvSender, block_chunks, open_receiver, open_sender
from ppserve.transport.messages import KvStatus, KvTarget
from ppserve.transport.peers import AddressError, LogLimiter, check_address

if TYPE_CHECKING:
    from ppserve.transport.cluster_key import Guard

log = logging.getLogger("ppserve.kv")
Report = Callable[[KvStatus], Awaitable[None]]
Run = Callable[[Callable[[], Any]], Awaitable[Any]]  # runs a function where the stage computes
MAX_TARGETS = 64  # decode stages one prefill stage sends a room's KV to (one per decode stage it overlaps)
MAX_SENDERS = 64  # open senders to decode stages, kept for later rooms
MAX_FORGOTTEN = 4096  # rooms ended before their handshake ran, remembered until it does


class KvExporter:
    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        stage: int,
        own: range,
        cache: Callable[[], torch.Tensor],
        run: Run,
        report: Report,
        guard: Guard | None = None,
        backend: str = "zmq",
        faults: FaultDice | None = None,
        send_timeout_s: float = 30.0,
    ) -> None:
        self.ctx, self.stage, self.own, self.cache, self.run, self.report = ctx, stage, own, cache, run, report
        self.guard, self.backend, self.faults = guard, backend, faults
        self.send_timeout_s = send_timeout_s  # a receiver that is gone leaves a send waiting
        self.targets: dict[str, list[KvTarget]] = {}  # rooms past their handshake, until exported
        self.senders: dict[str, KvSender] = {}  # by address, kept for later rooms (least recently used first)
        self.exporting: set[str] = set()
        self.aborted: set[str] = set()  # exports in progress told to stop
        self.forgotten: OrderedDict[str, bool] = OrderedDict()  # rooms ended before their handshake ran

    async def bootstrap(self, room: str, targets: Sequence[KvTarget]) -> None:
        if self.faults is not None:
            if self.faults.drop_handshake():
                log.warning("prefill stage %d: dropped the handshake of room %s (injected)", self.stage, room)
                return  # the host's bootstrap timeout ends the room
            await asyncio.sleep(self.faults.jitter_s())
        if self.forgotten.pop(room, False):
            return  # the host ended the room before this handshake ran: nothing to hold for it
        try:
            self._check_targets(targets)
            for t in targets:
                self._sender(t.address)
        except (AddressError, ValueError, zmq.ZMQError) as e:  # the decode side's handshake, refused
            await self.report(KvStatus(room, self.stage, "Failed", f"{type(e).__name__}: {e}"))
            return
        self.targets[room] = list(targets)
        await self.report(KvStatus(room, self.stage, "WaitingForInput"))

    def _check_targets(self, targets: Sequence[KvTarget]) -> None:
        if not 0 < len(targets) <= MAX_TARGETS:
            raise ValueError(f"a handshake names {len(targets)} KV targets (1..{MAX_TARGETS})")
        for t in targets:
            check_address(t.address, "a decode stage's KV address")
            if not (self.own.start <= t.layer_start < t.layer_stop <= self.own.stop):
                raise ValueError(f"layers {t.layer_start}..{t.layer_stop - 1} are not this stage's")

    def _sender(self, address: str) -> KvSender:
        """The sender to `address`; past MAX_SENDERS, the least recently used idle one closes."""
        sender = self.senders.pop(address, None)
        if sender is None:
            busy = {t.address for ts in self.targets.values() for t in ts}
            for old in [a for a in self.senders if a not in busy][: max(0, len(self.senders) + 1 - MAX_SENDERS)]:
                self.senders.pop(old).close()
            if len(self.senders) >= MAX_SENDERS:
                raise ValueError(f"KV transfers to {len(self.senders)} decode stages are open here already")
            sender = open_sender(self.backend, self.ctx, address, self.guard)
        self.senders[address] = sender  # most recently used last
        return sender

    async def export(self, room: str, blocks: Sequence[int]) -> None:
        """Send the room's KV (its prefill is done on this stage); reports how it went."""
        targets = self.targets.get(room)  # kept until the export ends: its senders are busy
        if targets is None or room in self.exporting:
            await self.report(KvStatus(room, self.stage, "Failed", "no handshake for this room on this stage"))
            return
        await self.report(KvStatus(room, self.stage, "Transferring"))
        self.exporting.add(room)
        try:
            fail = self.faults is not None and self.faults.fail_transfer()
            cache = self.cache()
            per_layer_block = cache[0, :, 0].numel() * cache.element_size()
            for t in targets:
                layers = range(t.layer_start, t.layer_stop)
                for offset, count in block_chunks(len(blocks), per_layer_block * len(layers)):
                    if room in self.aborted:
                        raise RuntimeError("aborted by the host")
                    if fail:
                        raise RuntimeError("the transfer failed (injected)")
                    if self.faults is not None:
                        await asyncio.sleep(self.faults.jitter_s())
                    part = list(blocks[offset : offset + count])
                    data = await self.run(partial(read_blocks, self.cache(), self.own, layers, part))
                    chunk = KvChunk(
                        room, self.stage, layers.start, layers.stop, offset, count, len(blocks),
                        str(data.dtype).removeprefix("torch."), tuple(data.shape),
                    )  # fmt: skip
                    try:
                        await asyncio.wait_for(self._sender(t.address).send(chunk, data), self.send_timeout_s)
                    except TimeoutError:
                        raise RuntimeError(
                            f"decode stage {t.dst_stage} took no KV for {self.send_timeout_s:g} s"
                        ) from None
        except Exception as e:  # reported, never raised: one room's trouble is not the stage's
            await self.report(KvStatus(room, self.stage, "Failed", f"{type(e).__name__}: {e}"))
            return
        finally:
            self.targets.pop(room, None)
            self.exporting.discard(room)
            self.aborted.discard(room)
        await self.report(KvStatus(room, self.stage, "Success"))

    def abort(self, room: str) -> None:
        """Forget the room; a transfer in progress fails at its next chunk, a handshake not yet
        run is dropped when it runs."""
        if self.targets.pop(room, None) is None and room not in self.exporting:
            self.forgotten[room] = True
            while len(self.forgotten) > MAX_FORGOTTEN:
                self.forgotten.popitem(last=False)
        if room in self.exporting:
            self.aborted.add(room)

    def close(self) -> None:
        for sender in self.senders.values():
            sender.close()


@dataclass
class _Incoming:
    blocks: list[int]
    got: dict[int, set[int]] = field(default_factory=dict)  # layer -> indices of its blocks in


class KvImporter:
    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        stage: int,
        own: range,
        cache: Callable[[], torch.Tensor],
        run: Run,
        report: Report,
        address: str,
        guard: Guard | None = None,
        backend: str = "zmq",
        faults: FaultDice | None = None,
    ) -> None:
        self.stage, self.own, self.cache, self.run, self.report = stage, own, cache, run, report
        self.faults = faults
        self._delayed: set[asyncio.Task[None]] = set()  # chunks held back by injected jitter
        self.receiver = open_receiver(backend, ctx, address, guard)
        self.address = self.receiver.address
        self.rooms: dict[str, _Incoming] = {}
        self.junk = LogLimiter(log)  # chunks a peer sends for rooms not here: one line per 10 s

    def expect(self, room: str, blocks: Sequence[int]) -> None:
        """The room's blocks on this stage (its KV arrives into them, block-table order)."""
        if self.faults is not None and self.faults.drop_handshake():
            log.warning("decode stage %d: dropped the announcement of room %s (injected)", self.stage, room)
            return  # its chunks are refused as unexpected; the decode host's timeout ends the room
        self.rooms[room] = _Incoming(list(blocks), {layer: set() for layer in self.own})

    def drop(self, room: str) -> None:
        self.rooms.pop(room, None)

    async def serve(self) -> None:
        """Write chunks as they come (runs until cancelled). With injected jitter each chunk
        waits on its own, as on a network, without holding up the others."""
        while True:
            chunk, data = await self.receiver.recv()
            if self.faults is None:
                await self._deliver(chunk, data)
            else:
                task = asyncio.create_task(self._deliver(chunk, data, self.faults.jitter_s()))
                self._delayed.add(task)
                task.add_done_callback(self._delayed.discard)

    async def _deliver(self, chunk: KvChunk, data: torch.Tensor, delay_s: float = 0.0) -> None:
        await asyncio.sleep(delay_s)
        room = self.rooms.get(chunk.room)
        if (problem := self._check(chunk, room)) is not None:
            self.junk.warning("decode stage %d: dropped a KV chunk of room %.80r: %s", self.stage, chunk.room, problem)
            return
        assert room is not None
        if self.faults is not None and self.faults.fail_transfer():
            self.rooms.pop(chunk.room, None)
            await self.report(KvStatus(chunk.room, self.stage, "Failed", "the transfer failed (injected)"))
            return
        layers = range(chunk.layer_start, chunk.layer_stop)
        into = room.blocks[chunk.block_offset : chunk.block_offset + chunk.num_blocks]
        try:
            await self.run(partial(write_blocks, self.cache(), self.own, layers, into, data))
        except (ValueError, RuntimeError) as e:  # a shape or dtype that does not fit this cache
            self.rooms.pop(chunk.room, None)
            await self.report(KvStatus(chunk.room, self.stage, "Failed", f"{type(e).__name__}: {e}"))
            return
        if self.rooms.get(chunk.room) is not room:
            return  # dropped while it was written (the host ended the room)
        for layer in layers:
            room.got[layer].update(range(chunk.block_offset, chunk.block_offset + chunk.num_blocks))
        if all(len(got) == len(room.blocks) for got in room.got.values()):
            del self.rooms[chunk.room]
            await self.report(KvStatus(chunk.room, self.stage, "Received"))

    def _check(self, chunk: KvChunk, room: _Incoming | None) -> str | None:
        if room is None:
            return "the room is not expected here (unknown, or already ended)"
        if chunk.total_blocks != len(room.blocks) or chunk.block_offset + chunk.num_blocks > len(room.blocks):
            return (
                f"blocks {chunk.block_offset}+{chunk.num_blocks} of {chunk.total_blocks} do not fit {len(room.blocks)}"
            )
        if chunk.layer_start < self.own.start or chunk.layer_stop > self.own.stop:
            return f"layers {chunk.layer_start}..{chunk.layer_stop - 1} are not this stage's"
        return None

    def close(self) -> None:
        for task in self._delayed:
            task.cancel()
        self.receiver.close()
