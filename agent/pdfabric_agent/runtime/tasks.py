"""Background work of the agent's event loop: tasks it owns and callbacks run after what is ready."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Coroutine
from typing import Any


class TaskSet:
    """Tasks the agent started and must cancel on close (a task nobody references can vanish)."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def cancel_all(self) -> None:
        for task in list(self._tasks):
            task.cancel()


def later(fn: Callable[[], None]) -> None:
    """Run `fn` after what is ready now (a long poll woken by a room's end answers first); at once
    when no event loop runs here."""
    try:
        asyncio.get_running_loop().call_soon(fn)
    except RuntimeError:
        fn()


class Liveness:
    """When this agent's own event loop last ran its tick, and its recent stalls: a process that was
    stopped (SIGSTOP, a frozen node, a long GC) finds every deadline passed and its writes failed
    when it resumes, and must not blame the peers for its own pause."""

    STALL_S = 2.0  # a tick gap this long is a stall (ticks come every 0.1 s)
    KEEP = 64  # stalls remembered (an operation older than the oldest kept is old enough to fail)

    def __init__(self, now: float) -> None:
        self.last_tick = now
        self.stalls: collections.deque[tuple[float, float]] = collections.deque(maxlen=self.KEEP)  # (end, s)

    def tick(self, now: float) -> None:
        gap = now - self.last_tick
        if gap >= self.STALL_S:
            self.stalls.append((now, gap))
        self.last_tick = now

    def stalled_since(self, since: float, now: float) -> float:
        """Seconds this agent was stalled after `since` (0.0 when it ran throughout): the gap it
        is in right now (its tick has not run since it resumed), else the longest stall that ended
        after `since`."""
        current = now - self.last_tick
        if current >= self.STALL_S:
            return current
        return max((gap for end, gap in self.stalls if end > since), default=0.0)
