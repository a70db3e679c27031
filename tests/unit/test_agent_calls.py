"""The SGLang plugin's agent calls (pdfabric_agent.client.calls): calls run on one worker in the
order they were made; ``call_now`` writes on the caller's thread only when no call is queued or
running, and a call made while it writes comes after its answer."""

from __future__ import annotations

import threading
import time

from pdfabric_agent.client.calls import AgentCalls


def test_call_now_writes_on_the_callers_thread_and_answers_on_the_worker() -> None:
    calls = AgentCalls("t")
    seen: list[tuple[str, str]] = []
    try:
        me = threading.current_thread().name
        assert calls.call_now(lambda: seen.append(("write", threading.current_thread().name)) or 1,
                              lambda r: seen.append(("then", threading.current_thread().name)))  # fmt: skip
        assert calls.wait_idle(2)
        assert seen[0] == ("write", me) and seen[1] == ("then", "t") and calls.written_now == 1
    finally:
        calls.close()


def test_call_now_steps_aside_while_a_call_is_ahead() -> None:
    calls = AgentCalls("t")
    release = threading.Event()
    order: list[str] = []

    def first() -> None:
        release.wait(2)
        order.append("first")

    try:
        calls.call(first)
        time.sleep(0.05)  # the first call is running
        assert not calls.call_now(lambda: order.append("wrote"), lambda _: order.append("then"))
        calls.call(lambda: order.append("second"))  # what the caller does instead: it queues
        release.set()
        assert calls.wait_idle(2) and order == ["first", "second"] and calls.written_now == 0
    finally:
        calls.close()


def test_a_call_made_while_call_now_writes_runs_after_its_answer() -> None:
    calls = AgentCalls("t")
    order: list[str] = []
    writing = threading.Event()

    def write() -> int:
        writing.set()
        time.sleep(0.1)  # another thread makes a call meanwhile
        order.append("wrote")
        return 1

    other = threading.Thread(target=lambda: (writing.wait(2), calls.call(lambda: order.append("other"))))
    try:
        other.start()
        assert calls.call_now(write, lambda _: order.append("answered"))
        other.join()
        assert calls.wait_idle(2) and order == ["wrote", "answered", "other"]
    finally:
        calls.close()
