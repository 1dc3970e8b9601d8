"""Prefill/decode disaggregation: the prefill host's table of bootstrap rooms.

A room is one request served by a prefill server and a decode server together. On the prefill
side, each pipeline stage holds a KV sender for the room that moves through

    Bootstrapping -> WaitingForInput -> Transferring -> Success | Failed

(Bootstrapping: waiting for the decode side's handshake, which names where its KV goes;
WaitingForInput: ready for the prefill's output; Transferring: sending its layers' KV blocks.)
The stages report their moves; every decision about the room is taken here, once, by the host:

- admit: a room enters prefill only when every stage is WaitingForInput;
- fail: any stage's failure, a timeout in any state, an abort or a failure on the decode side
  ends the room, with an error that names the side, the stage and the state;
- release: a room's KV blocks are freed only when every stage is Success or Failed (a stage
  still reading its blocks must not see them reused), or, for a failed room, once a stage that
  never answers has had its transfer timeout.

Reports arrive late, twice or out of order when the network jitters: those are ignored or, for
a move the protocol does not allow, turn into a failure of the room. Nothing here asserts, so
no interleaving can crash the server (the failure SGLang's per-rank consensus ran into). Pure:
no sockets, no clocks (callers pass `now`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class KvState(Enum):
    BOOTSTRAPPING = "Bootstrapping"
    WAITING_FOR_INPUT = "WaitingForInput"
    TRANSFERRING = "Transferring"
    SUCCESS = "Success"
    FAILED = "Failed"

    @property
    def terminal(self) -> bool:
        return self in (KvState.SUCCESS, KvState.FAILED)


_NEXT = {
    KvState.BOOTSTRAPPING: KvState.WAITING_FOR_INPUT,
    KvState.WAITING_FOR_INPUT: KvState.TRANSFERRING,
    KvState.TRANSFERRING: KvState.SUCCESS,
}


@dataclass(frozen=True)
class RoomError:
    side: str  # "prefill" | "decode" | "client"
    stage: int | None  # the stage on that side, when one is to blame
    state: KvState  # the state it was in
    reason: str

    def __str__(self) -> str:
        who = f"{self.side} stage {self.stage}" if self.stage is not None else f"the {self.side} side"
        return f"{who} failed in state {self.state.value}: {self.reason}"


@dataclass
class Room:
    room: str
    states: list[KvState]  # per prefill stage
    since: list[float]  # when each stage entered its state
    admitted: bool = False
    exported: bool = False  # prefilled, and the stages told to send (WaitingForInput is timed again)
    error: RoomError | None = None
    failed_at: float = 0.0
    notes: list[str] = field(default_factory=list)  # ignored reports, for the log

    @property
    def ready(self) -> bool:
        return all(s is KvState.WAITING_FOR_INPUT for s in self.states)

    @property
    def done(self) -> bool:
        return all(s.terminal for s in self.states)

    @property
    def succeeded(self) -> bool:
        return self.error is None and all(s is KvState.SUCCESS for s in self.states)


class BootstrapTable:
    def __init__(self, num_stages: int, bootstrap_timeout_s: float, transfer_timeout_s: float) -> None:
        self.num_stages = num_stages
        self.bootstrap_timeout_s = bootstrap_timeout_s
        self.transfer_timeout_s = transfer_timeout_s
        self.rooms: dict[str, Room] = {}

    def open(self, room: str, now: float) -> Room:
        if room in self.rooms:
            raise ValueError(f"bootstrap room {room!r} is already in use")
        r = Room(room, [KvState.BOOTSTRAPPING] * self.num_stages, [now] * self.num_stages)
        self.rooms[room] = r
        return r

    def report(self, room: str, stage: int, state: KvState, now: float, reason: str = "") -> None:
        """Prefill stage `stage` says it moved to `state` (`reason`: why, for Failed)."""
        r = self.rooms.get(room)
        if r is None or not 0 <= stage < self.num_stages:
            return  # a room already released (or never here): a late report
        current = r.states[stage]
        if current.terminal or state is current:
            r.notes.append(f"stage {stage}: {state.value} again, or after {current.value}")
            return
        r.states[stage], r.since[stage] = state, now
        if state is KvState.FAILED:
            self._fail(r, RoomError("prefill", stage, current, reason or "its KV sender failed"), now)
        elif _NEXT.get(current) is not state:
            r.states[stage] = KvState.FAILED
            why = f"went from {current.value} to {state.value}, which the protocol does not allow"
            self._fail(r, RoomError("prefill", stage, current, why), now)

    def admit(self) -> list[str]:
        """Rooms whose every stage is WaitingForInput, each once: the host prefills them now."""
        ready = [r for r in self.rooms.values() if not r.admitted and r.error is None and r.ready]
        for r in ready:
            r.admitted = True
        return [r.room for r in ready]

    def exported(self, room: str, now: float) -> None:
        """The room is prefilled and its stages told to send: from now, a stage still waiting for
        input has its bootstrap timeout to start (it may have died before it read the word)."""
        r = self.rooms.get(room)
        if r is None:
            return
        r.exported = True
        r.since = [now if s is KvState.WAITING_FOR_INPUT else t for s, t in zip(r.states, r.since, strict=True)]

    def fail(self, room: str, side: str, stage: int | None, reason: str, now: float) -> RoomError | None:
        """The host ends a room (an abort, a failure on the decode side, ...); its error, or None
        for a room that is gone. The stages not yet done are to be told to drop it."""
        r = self.rooms.get(room)
        if r is None:
            return None
        state = r.states[stage] if side == "prefill" and stage is not None else self._slowest(r)
        self._fail(r, RoomError(side, stage, state, reason), now)
        return r.error

    def expire(self, now: float) -> list[Room]:
        """Fail the rooms in which some stage has overstayed its state's timeout."""
        expired = []
        for r in self.rooms.values():
            if r.error is not None:
                continue
            # The stage furthest behind first: it is the one holding the others up.
            order = list(KvState)
            behind = sorted(range(self.num_stages), key=lambda i: (order.index(r.states[i]), i))
            for stage in behind:
                state, since = r.states[stage], r.since[stage]
                limit = self.transfer_timeout_s if state is KvState.TRANSFERRING else self.bootstrap_timeout_s
                # WaitingForInput lasts until the prefill is done: a room admitted and not yet
                # exported is waiting on the prefill (however long the queue), not on the stage.
                waits_on_prefill = state is KvState.WAITING_FOR_INPUT and r.admitted and not r.exported
                if not state.terminal and not waits_on_prefill and now - since > limit:
                    self._fail(r, RoomError("prefill", stage, state, f"timed out after {limit:g} s"), now)
                    expired.append(r)
                    break
        return expired

    def release(self, now: float) -> list[Room]:
        """Remove and return the rooms whose KV can be freed: every stage done, or failed rooms
        whose laggards have had their transfer timeout."""
        gone = [
            r
            for r in self.rooms.values()
            if r.done or (r.error is not None and now - r.failed_at > self.transfer_timeout_s)
        ]
        for r in gone:
            del self.rooms[r.room]
        return gone

    def pending(self, room: str) -> list[int]:
        """Stages still holding the room (not Success or Failed)."""
        r = self.rooms.get(room)
        return [] if r is None else [i for i, s in enumerate(r.states) if not s.terminal]

    def _fail(self, r: Room, error: RoomError, now: float) -> None:
        if r.error is None:  # the first failure is the cause; later ones are its consequences
            r.error, r.failed_at = error, now

    @staticmethod
    def _slowest(r: Room) -> KvState:
        order = list(KvState)
        return min((s for s in r.states if not s.terminal), key=order.index, default=r.states[0])


def handshake_order(num_prefill_stages: int) -> list[int]:
    """The decode side bootstraps the highest prefill stage first and stage 0 last: stage 0
    starts the prefill's data flowing, so by the time it is ready every later stage is too."""
    return list(range(num_prefill_stages - 1, -1, -1))
