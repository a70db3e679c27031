"""What the agent answers about a room, typed for every caller (the agent, its client, the SGLang
plugin, the reference engine): its state as SGLang's ``KVPoll`` numbers it, and the names the
room views carry on the wire."""

from __future__ import annotations

import enum


class RoomState(enum.IntEnum):
    """SGLang's KVPoll values, so a serving engine can use them unchanged."""

    FAILED = 0
    BOOTSTRAPPING = 1
    WAITING_FOR_INPUT = 2
    TRANSFERRING = 3
    SUCCESS = 4

    @property
    def title(self) -> str:
        return {0: "Failed", 1: "Bootstrapping", 2: "WaitingForInput", 3: "Transferring", 4: "Success"}[self.value]

    @property
    def finished(self) -> bool:
        return self in (RoomState.FAILED, RoomState.SUCCESS)

    @classmethod
    def of_title(cls, title: str) -> RoomState:
        """The state a room view's ``state`` names; ValueError for another word."""
        for state in cls:
            if state.title == title:
                return state
        raise ValueError(f"not a room state: {title!r}")


FINAL_TITLES = (RoomState.SUCCESS.title, RoomState.FAILED.title)  # a view in one of these is final
