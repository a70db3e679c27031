"""What vLLM's scheduler side tells the worker sides each step (vLLM pickles it to every TP rank
with the step): the rooms to send, receive, release or give up. Plain data, without vLLM (the
connector hands it to vLLM as its ``KVConnectorMetadata``): the worker ranks each act on it
against their own agent."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SendOrder:
    """Prefill: request ``req_id`` ended with its prompt's KV in ``pages``; send them as ``room`` to
    the decode ranks that announce it (from the page after the prefix decode already holds)."""

    req_id: str
    room: int
    pages: tuple[int, ...]
    page_tokens: int


@dataclass(frozen=True)
class ReceiveOrder:
    """Decode: the KV of ``room`` from prefill replica ``prefill_replica`` lands in ``pages``, which
    follow the ``prefix_tokens`` this server already holds (its prefix cache)."""

    req_id: str
    room: int
    prefill_replica: int
    prefill_dp: int
    pages: tuple[int, ...]
    prefix_tokens: int


@dataclass(frozen=True)
class ReleaseOrder:
    """Decode: ``room`` will not be received (the request needed nothing of it, or was aborted
    before it was scheduled): the prefill ranks holding it are told, so they free its pages now."""

    req_id: str
    room: int
    prefill_replica: int
    prefill_dp: int
    reason: str


@dataclass(frozen=True)
class AbortOrder:
    """Decode: the request was aborted while its KV was on its way: the room fails at the agent,
    and vLLM frees its pages once the agent says every source's writes are over."""

    req_id: str
    room: int


@dataclass
class Orders:
    sends: list[SendOrder] = field(default_factory=list)
    receives: list[ReceiveOrder] = field(default_factory=list)
    releases: list[ReleaseOrder] = field(default_factory=list)
    aborts: list[AbortOrder] = field(default_factory=list)
    # The step computes nothing (vLLM steps only to hear how the rooms stand): the workers may wait
    # a moment for a room's news instead of answering at once and being asked again.
    idle: bool = False

    def __bool__(self) -> bool:
        return bool(self.sends or self.receives or self.releases or self.aborts)
