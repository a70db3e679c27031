"""Room events for engines (``GET /v1/events/{rank}``): instead of asking the agent about each room
on every scheduler iteration, an engine rank holds one long-lived connection and keeps a table of
its rooms, so its poll is a dictionary lookup.

The agent pushes a room's view whenever something an engine acts on changes: a room ends
(Success with its bytes and aux row, or Failed with the reason), the decode side of a prefill room
not sent yet announced itself (WaitingForInput, with the decode ranks and their radix prefix) or
gave it up, and a failed decode room's sources are all quiet (its pages may be reused). A
subscriber first gets a snapshot of every room of its rank the agent holds, taken in the same
step as the subscription (the server writes it, then an empty line), so what follows is newer.

A subscriber names its engine instance (``?instance=``, the id it registered the rank's memory
with): while its connection is open, that instance is the rank's live registrant
(``registrants``).

A subscriber that does not keep up (its queue holds ``MAX_BACKLOG`` views) is dropped: the engine
reconnects and resynchronises from a fresh snapshot, and the agent never buffers without bound.
The agent closed that connection, not the engine, so the engine is taken to be alive: its
instance keeps holding the rank for ``RECONNECT_HOLD_S`` or until it subscribes again, and
another engine cannot take the rank in the moment between.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable

from pdfabric_agent.protocol.views import RoomView
from pdfabric_agent.protocol.wire import FEED_HEARTBEAT_S

MAX_BACKLOG = 1 << 16  # views queued for one subscriber before it is dropped
# How long a dropped subscriber's instance still holds its rank: the engine's feed reconnects
# 0.05 s after a feed that had been up ends, at most 2 s after one that had not (client.feed); a
# process that died meanwhile frees the rank after this, within the 3 heartbeats (6 s) a restarted
# engine waits for a taken rank (pdfabric_sglang.manager.TAKEN_WAIT_S).
RECONNECT_HOLD_S = FEED_HEARTBEAT_S


class Subscription:
    """One engine connection's queue of views for one rank; ``None`` ends it (dropped or closed).
    ``connected`` says whether the engine's connection is still open (its process alive)."""

    def __init__(
        self, feed: RoomFeed, rank: str, instance: str = "", connected: Callable[[], bool] | None = None
    ) -> None:
        self.feed, self.rank, self.instance = feed, rank, instance
        self.connected = connected or (lambda: True)
        self._queue: collections.deque[RoomView | None] = collections.deque()
        self._ready = asyncio.Event()
        self._ready.set()
        self.dropped = False

    def put(self, view: RoomView | None) -> None:
        if self.dropped:
            return
        if len(self._queue) >= MAX_BACKLOG:
            self.dropped = True  # the engine resynchronises from a snapshot when it reconnects
            self._queue.clear()
            view = None
        self._queue.append(view)
        self._ready.set()

    async def next(self, timeout_s: float) -> RoomView | None:
        """The next view; raises TimeoutError when none came within ``timeout_s`` (the caller
        writes a heartbeat); None when the subscription ended."""
        if not self._queue:
            self._ready.clear()
            async with asyncio.timeout(timeout_s):
                await self._ready.wait()
        return self._queue.popleft()

    @property
    def backlog(self) -> int:
        return len(self._queue)

    def close(self) -> None:
        self.feed.unsubscribe(self)


class RoomFeed:
    """The subscriptions of this agent's engine ranks, and the publishing of room views to them."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._subs: dict[str, set[Subscription]] = {}
        self._clock = clock
        self._dropped: dict[tuple[str, str], float] = {}  # (rank, instance) -> when the agent dropped its feed

    def subscribe(self, rank: str, instance: str = "", connected: Callable[[], bool] | None = None) -> Subscription:
        sub = Subscription(self, rank, instance, connected)
        self._subs.setdefault(rank, set()).add(sub)
        self._dropped.pop((rank, instance), None)  # back: its open connection holds the rank now
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        if sub.dropped and sub.connected():  # the agent ends a live engine's feed: it reconnects
            now = self._clock()
            # Holds that ran out go here (drops are rare), so instances that never came back leave nothing.
            self._dropped = {k: t for k, t in self._dropped.items() if now - t < RECONNECT_HOLD_S}
            self._dropped[(sub.rank, sub.instance)] = now
        subs = self._subs.get(sub.rank)
        if subs is not None:
            subs.discard(sub)
            if not subs:
                del self._subs[sub.rank]

    def watched(self, rank: str) -> bool:
        """Whether an engine of ``rank`` is listening (views are made only then)."""
        return rank in self._subs

    def held_by(self, rank: str, instance: str) -> bool:
        """Whether engine ``instance`` follows ``rank``'s feed on a connection still open, or the
        agent dropped its feed less than ``RECONNECT_HOLD_S`` ago (it is reconnecting)."""
        if any(sub.instance == instance and sub.connected() for sub in self._subs.get(rank, ())):
            return True
        dropped = self._dropped.get((rank, instance))
        return dropped is not None and self._clock() - dropped < RECONNECT_HOLD_S

    def publish(self, view: RoomView, *, after_s: float = 0.0) -> None:
        """To every subscriber of the view's rank: now, or ``after_s`` later (from the event loop)."""
        if after_s > 0:
            asyncio.get_running_loop().call_later(after_s, self.publish, view)
            return
        for sub in tuple(self._subs.get(view.rank, ())):
            sub.put(view)

    def subscribers(self) -> int:
        return sum(len(s) for s in self._subs.values())
