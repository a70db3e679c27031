"""The agent calls SGLang's scheduler thread hands off: a room's submit and its abort run on one
worker thread per engine rank, in the order they were made, so the scheduler's loop never waits on
the agent. A call's outcome reaches the room through the callback it was made with (``poll`` reads
it on the scheduler's next iteration).

``call_now`` saves the worker's wake-up (about 0.5 ms on two busy cores, on a chunk's way to the
agent): when no call is queued or running, the caller writes its request at once on its own
thread and the worker only reads the answer. The calls share one connection to the agent, used by
one thread at a time (``_turn``), so the agent takes them in the order they were made.

``inline`` runs each call at once on the caller's thread (unit tests that drive a fake client)."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import TypeVar

log = logging.getLogger("pdfabric.sglang")

T = TypeVar("T")

# How long a call on the calls' thread waits for the agent's answer. The engine's loop never waits
# on it, and past it the room fails (the engine's failure policy applies), so it is generous: a
# loopback call to the node's agent took over 2 s on this 2-core machine under the whole suite, and
# once (a decode submit in the vLLM e2e, 2026-12-06) over 10 s, the engine's own loop stalled as long.
SUBMIT_TIMEOUT_S = 30.0


class AgentCalls:
    def __init__(self, name: str, *, inline: bool = False) -> None:
        self.inline = inline
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._idle = threading.Event()
        self._idle.set()
        self._turn = threading.Lock()  # held while a call uses the agent connection
        self._count = threading.Lock()
        self._pending = 0  # calls queued or running
        self.written_now = 0  # calls whose request the caller's thread wrote (tests, benchmarks)
        self._thread: threading.Thread | None = None
        if not inline:
            self._thread = threading.Thread(target=self._run, daemon=True, name=name)
            self._thread.start()

    def call(self, fn: Callable[[], None]) -> None:
        if self.inline:
            fn()
            return
        with self._count:
            self._pending += 1
            self._idle.clear()
        self._queue.put(fn)

    def call_now(self, write: Callable[[], T], then: Callable[[T], None]) -> bool:
        """When no call is queued or running: ``write`` now, on this thread, and ``then`` with its
        result on the worker. False (nothing done) when another call is ahead: the caller then
        makes it an ordinary ``call``, which keeps the order. ``write`` must not raise (it hands
        its failure to ``then``)."""
        if self.inline:
            then(write())
            return True
        if not self._turn.acquire(blocking=False):
            return False
        try:
            with self._count:
                if self._pending:
                    return False
                self._pending = 1
                self._idle.clear()
            written: list[T] = []
            # Queued first, so a call made meanwhile comes after it; it runs once this turn ends.
            self._queue.put(lambda: then(written[0]))
            written.append(write())
            self.written_now += 1
        finally:
            self._turn.release()
        return True

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
            with self._turn:
                try:
                    fn()
                except Exception:  # a call reports its own failures; this one is a bug, logged
                    log.exception("pdfabric: an agent call failed")
            with self._count:
                self._pending -= 1
                if not self._pending:
                    self._idle.set()
