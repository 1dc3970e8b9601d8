"""Prefill/decode disaggregation, host side: the rooms of a prefill engine (engine/disagg/prefill.py)
and of a decode engine (engine/disagg/decode.py), and what the two share (here).

    decode host                              prefill host                      prefill stages
    reserve blocks; KvExpect -> its stages
    RoomOpen (prompt, where each decode  ->  open the room (bootstrap table)
      stage receives, its layers)            KvBootstrap, highest stage first ->  connect; WaitingForInput
                                             all WaitingForInput: admit, prefill
                          <- RoomFirstToken  the first token is sampled; KvExport ->  Transferring ... Success
    its stages report Received                                                   (KV goes stage to stage)
    all Received + first token: decode on    all Success or Failed: free the KV

Every decision about a room is the prefill host's (scheduler/bootstrap.py) or, for its own half,
the decode host's; a failure or timeout on either side ends the room on both with the error
(side, stage, state) and frees its KV on both. The prefill host tells each decode host every
second where its rooms stand (RoomProgress), so a prefill server that dies is noticed within the
bootstrap or transfer timeout of the state it died in.

Nothing a peer sends can crash either host, or make it hold memory or sockets without bound:
the pair's sockets need the cluster key (unless --insecure-cluster), every field of a room is
checked as an HTTP request is (sampling parameters, prompt length and vocabulary, addresses),
replies go through bounded links (transport/peers.py), and every task is supervised.
"""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import zmq
import zmq.asyncio

from ppserve.scheduler.handover import KvHandover
from ppserve.scheduler.request import Request
from ppserve.transport.cluster_key import CurveKeys, Guard
from ppserve.transport.control import PullSocket
from ppserve.transport.messages import ControlMsg, KvStatus, Sampled
from ppserve.transport.peers import AddressError

if TYPE_CHECKING:
    from ppserve.engine.config import EngineConfig
    from ppserve.engine.outputs import RequestOutput

log = logging.getLogger("ppserve.disagg")
TICK_S = 0.1
PROGRESS_S = 1.0  # how often the prefill host tells each decode host where its rooms stand
MAX_ROOM_CHARS = 256  # a room's name (the decode side's request id)
ROOM_MESSAGE_BYTES = 4 << 20  # a room message besides its prompt (a progress report of 4,096 rooms fits)
UNDELIVERED = (AddressError, TimeoutError, zmq.ZMQError)  # a reply no peer took


class DisaggregationError(RuntimeError):
    """A room failed: the message names the side, the stage and the state."""


@dataclass(frozen=True)
class RoomHost:
    """All that a server's rooms may use of their engine (AsyncEngine builds it): the scheduler's
    side of the handover, the stages' side (KV commands to one stage: engine/disagg/kv_service.py
    runs them), and the engine's own request path."""

    config: EngineConfig
    handover: KvHandover  # which requests hold KV for export, which wait for it, when they run
    send_to: Callable[[int, ControlMsg], None]  # a KvBootstrap/KvExpect/KvExport/KvForget to a stage
    kv_addresses: Callable[[], list[str]]  # where each stage receives KV (decode side)
    check_request: Callable[..., None]  # AsyncEngine.check_request: a room is checked as a request is
    generate: Callable[..., AsyncIterator[RequestOutput]]  # AsyncEngine.generate (prefill side, hold_kv)
    wake: Callable[[], None]  # blocks were freed outside a step: the scheduler may have work


class Connector(ABC):
    """A server's side of disaggregation as its engine sees it: the engine starts `serve`, routes
    its stages' KvStatus reports to `on_kv_status`, and (on a decode server) has a request
    prefilled elsewhere with `prefill_remotely`."""

    address: str  # where peers reach this server's rooms (its bootstrap address)

    @abstractmethod
    async def serve(self) -> None: ...

    @abstractmethod
    def on_kv_status(self, status: KvStatus) -> None: ...

    async def prefill_remotely(self, request: Request, prefill: str) -> Sampled | None:
        """The request's first token once its KV is here and it may decode (None if it was
        aborted meanwhile); DisaggregationError if the room fails."""
        raise ValueError("prefilling elsewhere needs an engine in disaggregation mode 'decode'")

    @abstractmethod
    def close(self) -> None: ...


def room_guard(ctx: zmq.asyncio.Context, key: bytes | None, who: str, address: str) -> Guard | None:
    """The pair's sockets speak CURVE under the cluster key; without one (--insecure-cluster,
    which EngineConfig requires then) anyone who reaches them is heard, and the log says so."""
    if key is None:
        log.warning("%s: --insecure-cluster: %s takes rooms from anyone who can reach it", who, address)
        return None
    return Guard(ctx, CurveKeys.from_secret(key), who)


def room_inbox(ctx: zmq.asyncio.Context, address: str, guard: Guard | None, max_model_len: int) -> PullSocket:
    """A host's room inbox: a peer whose message is larger than a longest prompt's room could be
    (9 bytes per token id at most, plus the rest) is disconnected before it is read."""
    max_bytes = ROOM_MESSAGE_BYTES + 9 * max_model_len
    return PullSocket(ctx, address, bind=True, guard=guard, max_msg_bytes=max_bytes)


class RoomTasks:
    """A host's room tasks: held (so none is collected while it runs) and, should one raise
    what it does not handle itself, logged with its traceback rather than lost."""

    def __init__(self, who: str) -> None:
        self.who = who
        self.running: set[asyncio.Task[None]] = set()

    def spawn(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(work)
        self.running.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[None]) -> None:
        self.running.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            log.error("%s: a room task failed", self.who, exc_info=error)

    def cancel(self) -> None:
        for task in self.running:
            task.cancel()
