"""Prefill rooms not sent yet that a decode side spoke of first: the room info each decode rank
announced before the send (which takes it), and the rooms given up before their send, with why.
The registry keeps one ``UnsentRooms``; what the prefill side does with these rooms is ``early``'s."""

from __future__ import annotations

from collections.abc import Collection

from pdfabric_agent.protocol.peer_wire import RoomInfo

RoomKey = tuple[str, int]  # (local rank id, room id), as the registry keys its rooms

# Rooms remembered as given up before their send, at most (the oldest forgotten first), and the
# reason kept with each: a peer's burst of cancels for rooms that never come (20,000 frames grew an
# agent by 14 MB, issue 40) costs a bounded few MB; a forgotten room's late send waits for room info
# until its bootstrap deadline, as if no cancel had come.
MAX_GIVEN_UP = 4096
MAX_GIVEN_UP_REASON = 256


class UnsentRooms:
    """Prefill rooms not sent yet that a decode side spoke of first, for the early room info's TTL:
    the room info each decode rank announced (kept for the send, which takes it), and the rooms a
    decode side or the engine gave up before their send (a send of one then fails at once with
    the reason, instead of waiting for room info that will not come; at most ``MAX_GIVEN_UP``)."""

    def __init__(self) -> None:
        self._announced: dict[RoomKey, dict[str, tuple[float, RoomInfo]]] = {}  # decode rank -> (when, info)
        self._given_up: dict[RoomKey, tuple[float, str]] = {}  # (when, why), oldest first

    def announce(self, key: RoomKey, info: RoomInfo, at: float) -> None:
        self._announced.setdefault(key, {})[info.decode_rank] = (at, info)

    def announced(self, key: RoomKey) -> dict[str, RoomInfo]:
        """The room info announced for the room so far, by decode rank."""
        return {rank: info for rank, (_, info) in self._announced.get(key, {}).items()}

    def take_announced(self, key: RoomKey) -> dict[str, RoomInfo]:
        """The room info announced for the room, no longer kept (its send took it, or it ended)."""
        return {rank: info for rank, (_, info) in self._announced.pop(key, {}).items()}

    def withdraw(self, key: RoomKey, decode_rank: str) -> None:
        """One decode rank's room info is void (it gave the room up)."""
        infos = self._announced.get(key)
        if infos is not None:
            infos.pop(decode_rank, None)
            if not infos:
                del self._announced[key]

    def give_up(self, key: RoomKey, at: float, reason: str, *, replace: bool = True) -> None:
        """Remember the room as given up before its send; ``replace``: a later reason wins."""
        if key in self._given_up and not replace:
            return
        self._given_up.pop(key, None)  # to the newest end
        self._given_up[key] = (at, reason[:MAX_GIVEN_UP_REASON])
        while len(self._given_up) > MAX_GIVEN_UP:
            del self._given_up[next(iter(self._given_up))]

    def given_up(self, key: RoomKey) -> str | None:
        """Why the room was given up before its send; None if it was not."""
        entry = self._given_up.get(key)
        return None if entry is None else entry[1]

    def take_given_up(self, key: RoomKey) -> str | None:
        """``given_up``, no longer remembered (its send came, and fails with it)."""
        entry = self._given_up.pop(key, None)
        return None if entry is None else entry[1]

    def announced_keys(self, rank_ids: Collection[str]) -> list[RoomKey]:
        return [key for key in self._announced if key[0] in rank_ids]

    def keys(self, rank_id: str) -> set[RoomKey]:
        """Every room of ``rank_id`` announced or given up."""
        return {key for key in (*self._announced, *self._given_up) if key[0] == rank_id}

    def given_up_reasons(self) -> dict[RoomKey, str]:
        return {key: why for key, (_, why) in self._given_up.items()}

    def expire(self, now: float, ttl_s: float) -> None:
        for key, infos in list(self._announced.items()):
            for decode_rank, (at, _) in list(infos.items()):
                if now - at > ttl_s:
                    del infos[decode_rank]
            if not infos:
                del self._announced[key]
        for key, (at, _) in list(self._given_up.items()):
            if now - at > ttl_s:
                del self._given_up[key]

    def __bool__(self) -> bool:
        return bool(self._announced or self._given_up)
