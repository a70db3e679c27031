"""The agent calls SGLang's scheduler thread hands off: a room's submit and its abort run on one
worker thread per engine rank, in the order they were made, so the scheduler's loop never waits on
the agent. A call's outcome reaches the room through the callback it was made with (``poll`` reads
it on the scheduler's next iteration).

``inline`` runs each call at once on the caller's thread (unit tests that drive a fake client)."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

log = logging.getLogger("pdfabric.sglang")


class AgentCalls:
    def __init__(self, name: str, *, inline: bool = False) -> None:
        self.inline = inline
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._idle = threading.Event()
        self._idle.set()
        self._thread: threading.Thread | None = None
        if not inline:
            self._thread = threading.Thread(target=self._run, daemon=True, name=name)
            self._thread.start()

    def call(self, fn: Callable[[], None]) -> None:
        if self.inline:
            fn()
            return
        self._idle.clear()
        self._queue.put(fn)

    def wait_idle(self, timeout_s: float) -> bool:
        """Whether every call made so far has run (tests; an engine never waits)."""
        return self._idle.wait(timeout_s)

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=2.0)

    def _run(self) -> None:
        while True:
            fn = self._queue.get()
            if fn is None:
                return
            try:
                fn()
            except Exception:  # a call reports its own failures; this one is a bug, logged
                log.exception("pdfabric: an agent call failed")
            if self._queue.empty():
                self._idle.set()
