"""The connector of a server in a disaggregated pair: its prefill or decode rooms, chosen once
from `EngineConfig.disaggregation`. The engine holds only this interface (rooms.py's `Connector`)
and gives the rooms only a `RoomHost`."""

from __future__ import annotations

from ppserve.engine.disagg.decode import DecodeRooms
from ppserve.engine.disagg.prefill import PrefillRooms
from ppserve.engine.disagg.rooms import Connector, RoomHost


def open_connector(host: RoomHost) -> Connector | None:
    """The rooms of `host.config.disaggregation` (None: the server is not in a pair)."""
    mode = host.config.disaggregation
    if mode == "prefill":
        return PrefillRooms(host)
    if mode == "decode":
        return DecodeRooms(host)
    return None
