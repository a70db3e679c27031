"""Polling SGLang's senders and receivers as its scheduler does, for the e2e tests that drive
SGLang's classes by hand (bytes, DP, state, metadata buffers, chunks)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

FAILED = 0  # SGLang's KVPoll.Failed


def poll_until(objs: Sequence[Any], until: set[int], timeout_s: float = 30.0, *, failed_ends: bool = True) -> list[int]:
    """Every object's ``poll()`` once each is in ``until`` (or Failed, with ``failed_ends``), or
    at the deadline: the states then, for the caller to assert on."""
    ends = until | {FAILED} if failed_ends else until
    deadline = time.monotonic() + timeout_s
    while True:
        states = [int(o.poll()) for o in objs]
        if all(s in ends for s in states) or time.monotonic() > deadline:
            return states
        time.sleep(0.005)
