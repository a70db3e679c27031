"""Background work of the agent's event loop: tasks it owns and callbacks run after what is ready."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any


class TaskSet:
    """Tasks the agent started and must cancel on close (a task nobody references can vanish)."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

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
